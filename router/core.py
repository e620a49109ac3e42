"""`RoutingCore`: one routing step, free of HTTP, ZMQ and Redis.

    decision = core.decide(request, endpoints, warm=bound_worker_id)
    flight = core.dispatched(request, decision)      # predictions + load accounting
    ... core.loads.first_token(flight) ... core.loads.finish(flight)

`decide` matches the request's block hashes in the prefix index (hybrid-aware: a hit is *full*
only when the window tail is resident too), builds a `WorkerView` per endpoint (router-tracked
and scraped load, breaker health, the session's warm worker), lets the policy pick a decode
worker among decode-capable endpoints, then lets conditional disaggregation add a prefill
worker that pairs with it (same revision and KV layout). `dispatched` writes predicted index
entries (TTL `predict_ttl_s`) for the workers that will hold the prompt's KV, bridging the gap
until their own KV events arrive, and books the request's load.

The HTTP front door, the gRPC services and the benchmark replay all call this same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.load import Flight, LoadBook
from beamserve.router.policy import (
    ConditionalDisaggregation,
    RoutingPolicy,
    effective_cached_tokens,
)
from beamserve.router.types import Endpoint, PrefixHit, RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True)
class CoreConfig:
    """`block_size`: tokens per hashed block (the engines' page size; 64 for Beam).
    `sliding_window`: Beam's window (read from the checkpoint's config.json).
    `predict_ttl_s`: how long a routing-time prediction counts without an engine event."""

    block_size: int = 64
    sliding_window: int = 512
    predict_ttl_s: float = 10.0


class RoutingCore:
    def __init__(
        self,
        policy: RoutingPolicy,
        index: PrefixIndex | None = None,
        loads: LoadBook | None = None,
        disaggregation: ConditionalDisaggregation | None = None,
        config: CoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.config = config or CoreConfig()
        self.clock = clock
        self.index = index if index is not None else PrefixIndex(clock=clock)
        self.loads = loads if loads is not None else LoadBook(clock=clock)
        self.disaggregation = disaggregation

    def views(
        self, request: RouteRequest, endpoints: Sequence[Endpoint], warm: str | None = None
    ) -> list[WorkerView]:
        now = self.clock()
        cfg = self.config
        hits = (
            self.index.match(
                request.block_hashes,
                [e.id for e in endpoints],
                block_size=cfg.block_size,
                sliding_window=cfg.sliding_window,
                now=now,
            )
            if request.block_hashes
            else {}
        )
        empty = PrefixHit()
        load = self.loads.load
        hit = hits.get
        return [WorkerView(e, load(e.id, now), hit(e.id, empty), e.id == warm) for e in endpoints]

    def decide(
        self, request: RouteRequest, endpoints: Sequence[Endpoint], warm: str | None = None
    ) -> RouteDecision:
        """Raises `beamserve.router.policy.NoCandidates` when no decode worker fits."""
        views = self.views(request, endpoints, warm)
        decision = self.policy.route(request, [v for v in views if v.endpoint.can_decode])
        if self.disaggregation is not None:
            decision = self.disaggregation.apply(request, decision, views)
        return decision

    def uncached_tokens(self, request: RouteRequest, hit: PrefixHit) -> int:
        cached = effective_cached_tokens(
            hit,
            request.prompt_tokens,
            block_size=self.config.block_size,
            sliding_window=self.config.sliding_window,
        )
        return max(0, request.prompt_tokens - int(cached))

    def dispatched(self, request: RouteRequest, decision: RouteDecision) -> Flight:
        """The request is being sent as decided: predict its blocks, book its load."""
        now = self.clock()
        ttl = self.config.predict_ttl_s
        if request.block_hashes:
            self.index.predict(decision.decode.id, request.block_hashes, ttl, now)
            if decision.prefill is not None:
                self.index.predict(decision.prefill.id, request.block_hashes, ttl, now)
        return self.loads.start(
            decision.decode.id,
            self.uncached_tokens(request, decision.expected_hit),
            request.prompt_tokens + request.max_tokens,
            decision.prefill.id if decision.prefill is not None else None,
        )
