"""`RoutingCore`: one routing step, free of HTTP, ZMQ and Redis.

    decision = core.decide(request, endpoints, warm=bound_worker_id)
    flight = core.dispatched(request, decision)      # predictions + load accounting
    ... core.loads.first_token(flight) ... core.loads.finish(flight)

The dispatch lifecycle (`Dispatch`, owned here, driven alike by the HTTP door, the ext_proc
picker and the benchmark replay)::

    d = core.open(request, ticket)          # admitted (flow-control ticket, may be None)
    decision = core.route(d, endpoints, warm)   # decided + dispatched: predictions, load booked
                                            #   (predict=False: load only; `core.predict(d)`
                                            #   writes the predictions, or the next step does)
    core.first_token(d)                     # prefill done: its load moves to decode
    binding = core.finish(d, output_tokens) # success: load and ticket released, breaker closed;
                                            #   the session rests on its worker till its next turn
    core.retry(d, worker, ...)              # before the first byte: release, back to admitted
    core.fail(d, worker=…)                  # any other end (upstream 4xx/5xx, timeout,
    core.cancel(d)                          #   client disconnect, cancellation)

Every terminal call releases exactly what `route` booked (the `LoadBook` flight) and the
ticket, once; later calls on a closed dispatch do nothing, so an outcome reported twice (a
`finally` after an `except`) cannot release twice, and `close` (cancel unless already closed)
is safe in every `finally`. `open_dispatches` counts dispatches not yet closed.

`decide` matches the request's block hashes in the prefix index (hybrid-aware: a hit is *full*
only when the window tail is resident too), each worker's hit with that worker's KV geometry
(`geometry_of`: what it reported, else `CoreConfig.geometry`, the router's flags) — the prompt
is hashed once per distinct geometry among the candidates, the common single-geometry pool
costing one match as before — builds a `WorkerView` per endpoint (router-tracked
and scraped load, breaker health, the session's warm worker), lets the policy pick a decode
worker among decode-capable endpoints, then lets conditional disaggregation add a prefill
worker that pairs with it (same revision and KV layout). `dispatched` writes predicted index
entries (TTL `predict_ttl_s`) for the workers that will hold the prompt's KV, bridging the gap
until their own KV events arrive (and hands the ones the index lacked to `on_predict`: replica
sync shares them with the other router replicas), and books the request's load.

The HTTP front door, the gRPC services and the benchmark replay all call this same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from beamserve.kvwire.geometry import DEFAULT_GEOMETRY, KVGeometry
from beamserve.router.flow.fairness import service_tokens
from beamserve.router.flow.pace_hold import PaceHold
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.load import Flight, LoadBook
from beamserve.router.policy import (
    ConditionalDisaggregation,
    RoutingPolicy,
    effective_cached_tokens,
)
from beamserve.router.sessions import session_tip
from beamserve.router.types import Endpoint, PrefixHit, RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True)
class CoreConfig:
    """`geometry`: the default KV geometry, for workers that report none (the router's
    `--block-size`, `--sliding-window` — else config.json of `--tokenizer` — and `--hash-scheme`).
    `predict_ttl_s`: how long a routing-time prediction counts without an engine event."""

    geometry: KVGeometry = DEFAULT_GEOMETRY
    predict_ttl_s: float = 10.0


class Releasable(Protocol):
    """A flow-control ticket (`beamserve.router.flow.Ticket`): release it exactly once."""

    def release(self, service_tokens: int | None = None) -> None: ...


Phase = Literal["admitted", "dispatched", "streaming", "finished", "failed", "cancelled"]
TERMINAL: frozenset[Phase] = frozenset({"finished", "failed", "cancelled"})


@dataclass(eq=False)
class Dispatch:
    """One request's way through the router, from admission to its end (module docstring).

    `decision`/`flight`: the current attempt's routing decision and booked load (None while
    admitted). `attempts`: how many attempts were given up before the first byte. `spilled`:
    the current attempt went, as the flow gate's prefill stage asked, to the decode worker
    that prefills it itself (`Ticket.spill_to`)."""

    request: RouteRequest
    ticket: Releasable | None = None
    phase: Phase = "admitted"
    decision: RouteDecision | None = None
    flight: Flight | None = None
    attempts: int = 0
    excluded: set[str] = field(default_factory=set)
    first_token_at: float | None = None
    opened_at: float = 0.0
    spilled: bool = False
    pieced_tokens: int = 0  # the longest prefix the prefill in pieces sent first (0: none)
    unpredicted: bool = False  # routed with `predict=False`: `predict` still to run

    @property
    def closed(self) -> bool:
        return self.phase in TERMINAL


@dataclass(frozen=True, slots=True)
class SessionBinding:
    """What a finished dispatch asks the session store to record (I/O stays with the caller)."""

    session_id: str
    worker: str
    turn_tokens: int
    tenant: str | None = None
    tip: str = ""  # `sessions.session_tip` of the turn's prompt


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
        self.open_dispatches = 0
        self._last_decision_at = float("-inf")
        # `on_predict(worker, block_keys, ttl_s)` after each routing-time prediction written
        # into the index, with the blocks it added or refreshed (replica sync,
        # `beamserve.router.sync`, shares them with the peers).
        self.on_predict: Callable[[str, tuple[int, ...], float], None] | None = None
        # Whether the pool is saturated now (the flow controller's signal; None: never):
        # `decide` stamps it on the request as `RouteRequest.pool_saturated`.
        self.pool_saturated: Callable[[], bool] | None = None
        # Called when a split request's prefill worker is done with it (its first token came):
        # the flow controller's prefill stage has room again (`FlowController.prefill_stage`).
        self.on_prefill_done: Callable[[], None] | None = None
        # Asked after the policy's pick, before conditional disaggregation: may move the
        # request elsewhere, with its own prefill worker (a draining pool's move,
        # `pool_roles.drain_move`; None: never).
        self.rebalance: (
            Callable[[RouteRequest, RouteDecision, Sequence[WorkerView]], RouteDecision] | None
        ) = None

    def geometry_of(self, endpoint: Endpoint) -> KVGeometry:
        """The worker's KV geometry: its own report, else the router's default."""
        return endpoint.geometry or self.config.geometry

    def block_hashes_for(self, request: RouteRequest, geometry: KVGeometry) -> tuple[int, ...]:
        """The request's block hashes in `geometry` (() when they cannot be computed)."""
        mine = request.geometry or self.config.geometry
        if geometry is mine or geometry == mine:
            return request.block_hashes
        if request.hashes_for is None:
            return ()
        return request.hashes_for(geometry)

    def views(
        self, request: RouteRequest, endpoints: Sequence[Endpoint], warm: str | None = None
    ) -> list[WorkerView]:
        now = self.clock()
        default = self.config.geometry
        mine = request.geometry or default
        empty = PrefixHit()
        load = self.loads.load
        index = self.index
        # The common case, one geometry for the whole pool: one match, as cheap as ever
        # (geometries are interned, so identity decides).
        if all((e.geometry or default) is mine for e in endpoints):
            hashes = request.block_hashes
            hits = (
                index.match(
                    hashes,
                    [e.id for e in endpoints],
                    block_size=mine.block_size,
                    sliding_window=mine.sliding_window,
                    now=now,
                )
                if hashes
                else {}
            )
            hit = hits.get
            return [
                WorkerView(e, load(e.id, now), hit(e.id, empty), e.id == warm, mine)
                for e in endpoints
            ]
        # Mixed pools: hash once per distinct geometry, match each worker in its own.
        groups: dict[KVGeometry, list[str]] = {}
        for e in endpoints:
            groups.setdefault(e.geometry or default, []).append(e.id)
        hits = {}
        for g, ids in groups.items():
            hashes = self.block_hashes_for(request, g)
            if hashes:
                hits.update(
                    index.match(
                        hashes,
                        ids,
                        block_size=g.block_size,
                        sliding_window=g.sliding_window,
                        now=now,
                    )
                )
        return [
            WorkerView(
                e, load(e.id, now), hits.get(e.id, empty), e.id == warm, e.geometry or default
            )
            for e in endpoints
        ]

    def decide(
        self,
        request: RouteRequest,
        endpoints: Sequence[Endpoint],
        warm: str | None = None,
        *,
        local: bool = False,
    ) -> RouteDecision:
        """Raises `beamserve.router.policy.NoCandidates` when no decode worker fits. `local`:
        the decode worker prefills it itself (no disaggregation)."""
        peers = self.loads.peers
        now = self.clock()
        since, self._last_decision_at = now - self._last_decision_at, now
        if peers is not None and not request.router_peers:
            fresh = peers.fresh(now)
            if fresh:
                me = peers.replica_id
                request = replace(
                    request,
                    router_peers=len(fresh),
                    router_rank=sorted([*fresh, me]).index(me),
                    since_last_decision_s=since,
                )
        saturated = self.pool_saturated
        if saturated is not None and not request.pool_saturated and saturated():
            request = replace(request, pool_saturated=True)
        views = self.views(request, endpoints, warm)
        decision = self.policy.route(request, [v for v in views if v.endpoint.can_decode])
        if local:
            return replace(decision, explain=f"{decision.explain} | disagg=no (spilled)")
        if self.rebalance is not None:
            decision = self.rebalance(request, decision, views)
        if self.disaggregation is not None:
            decision = self.disaggregation.apply(request, decision, views)
        return decision

    # --- the dispatch lifecycle ------------------------------------------------------------------
    def open(self, request: RouteRequest, ticket: Releasable | None = None) -> Dispatch:
        """A request was admitted (its flow-control `ticket`, if any, is now the dispatch's)."""
        self.open_dispatches += 1
        self.loads.wake(request.session_id)  # its next turn is here: no longer resting
        return Dispatch(request, ticket, opened_at=self.clock())

    def route(
        self,
        d: Dispatch,
        endpoints: Sequence[Endpoint],
        warm: str | None = None,
        *,
        predict: bool = True,
    ) -> RouteDecision:
        """Decide among `endpoints` (minus those an earlier attempt excluded) and book the
        decision. Raises `NoCandidates` (the dispatch stays admitted: close it).

        `predict=False`: book the load now, write the index predictions when `predict(d)` is
        called — the HTTP door calls it once the request's bytes are on their way to the
        worker, so that a long prompt's predictions (a pass over its blocks) are not between
        the decision and the upstream call. Every later step of the lifecycle runs it first if
        it has not run."""
        if d.phase != "admitted":
            raise RuntimeError(f"route() on a dispatch that is {d.phase}")
        eps = [e for e in endpoints if e.id not in d.excluded] if d.excluded else endpoints
        if warm is not None and warm in d.excluded:
            warm = None
        # Spilled by the flow gate's prefill stage: to the decode worker it found room on,
        # prefilled there (gone or excluded since: routed as any other request).
        spill = getattr(d.ticket, "spill_to", None)
        only = [e for e in eps if e.id == spill] if spill is not None else []
        d.spilled = bool(only)
        decision = self.decide(d.request, only or eps, warm, local=d.spilled)
        d.decision = decision
        d.flight = self.dispatched(d.request, decision, predict=predict)
        d.unpredicted = not predict
        d.phase = "dispatched"
        routed = getattr(d.ticket, "routed", None)
        if routed is not None:
            routed()  # its load is booked: the flow gate's prefill stage sees it now
        return decision

    def predict(self, d: Dispatch) -> None:
        """The index predictions of the current decision (`dispatched`), once per attempt."""
        if d.unpredicted and d.decision is not None:
            d.unpredicted = False
            self._predict(d.request, d.decision)

    def amend(self, d: Dispatch, request: RouteRequest) -> None:
        """`request` is what `d.request` stood for, now known whole: the HTTP door sends a long
        new prompt on its *head* (`PromptKey.partial`: the first blocks, which decide every
        worker's hit, and an estimated length) and finishes tokenizing and hashing it while
        the worker starts. The current attempt's load is rebooked with the exact numbers while
        it is still prefilling; the predictions, when still to come, use the whole prompt.
        A closed dispatch keeps what it had (its books are already settled)."""
        if d.closed:
            return
        d.request = request
        if d.phase == "dispatched" and d.flight is not None and d.decision is not None:
            decision = d.decision
            worker = decision.prefill or decision.decode
            uncached = self.uncached_tokens(
                request, decision.expected_hit, self.geometry_of(worker)
            )
            self.loads.resize(d.flight, uncached, request.prompt_tokens + request.max_tokens)

    def first_token(self, d: Dispatch) -> None:
        """The first output token arrived: the prefill load becomes decode load (and
        `on_prefill_done` hears of it when the prefill ran on a prefill worker)."""
        self.predict(d)
        if d.phase == "dispatched" and d.flight is not None:
            d.first_token_at = self.clock()
            self.loads.first_token(d.flight, d.first_token_at)
            d.phase = "streaming"
            if self.on_prefill_done is not None and d.decision and d.decision.prefill is not None:
                self.on_prefill_done()

    def pace_holds(self, d: Dispatch, rule: PaceHold) -> bool:
        """Should `d`, routed and booked, wait before it is sent (`flow.pace_hold`)? Only a
        continuing turn prefilled on its decode worker with `rule.min_tokens` or more uncached
        tokens, while its prefill (with what waits there before it) would push one of the
        users streaming from that worker under `rule.user_tok_s`, and only as long as its own
        prefill still ends within `rule.max_s` of its admission. The flight is marked held
        (`LoadBook.hold`) while the answer is yes, and unmarked when it is no."""
        f, decision = d.flight, d.decision
        if d.phase != "dispatched" or f is None or decision is None:
            return False
        if decision.prefill is not None or d.request.band != "continuing":
            return False
        if f.prefill_tokens < rule.min_tokens:
            return False
        now = self.clock()
        hold = self.pace_hold_left(d, rule, now) > 0 and (
            self.loads.pushed_under(
                f.worker,
                now,
                user_tok_s=rule.user_tok_s,
                prefill_tok_s=rule.prefill_tok_s,
                own=f,
            )
            > 0
        )
        self.loads.hold(f, hold)
        return hold

    def pace_hold_left(self, d: Dispatch, rule: PaceHold, now: float | None = None) -> float:
        """Seconds `d` may still wait in the pace hold: until its own prefill, started then,
        would end `rule.max_s` after its admission (≤ 0: its time is up)."""
        own = d.flight.prefill_tokens if d.flight is not None else 0
        now = self.clock() if now is None else now
        return rule.max_s - (now - d.opened_at) - own / rule.prefill_tok_s

    def prefill_hook(self, d: Dispatch) -> Callable[[], None]:
        """What to call when the prefill leg of `d`'s current attempt answers (the prefill
        worker computed the prompt): its booking on the prefill worker ends then, and
        `on_prefill_done` hears of it, so the flow gate's prefill stage sees the room before the
        decode worker's first token. A late call (another attempt, a closed dispatch) does
        nothing."""
        flight = d.flight

        def done() -> None:
            if d.phase != "dispatched" or flight is None or d.flight is not flight:
                return
            if self.loads.prefill_leg_done(flight) and self.on_prefill_done is not None:
                self.on_prefill_done()

        return done

    def _release_flight(self, d: Dispatch) -> None:
        if d.flight is not None:
            self.loads.finish(d.flight)
            d.flight = None

    def retry(self, d: Dispatch, worker: str, *, worker_failed: bool = True) -> None:
        """The attempt failed before the first byte: release its load, mark `worker` failed
        (breaker), exclude it, and go back to admitted for another `route`."""
        if d.closed:
            return
        self.predict(d)
        self._release_flight(d)
        if worker_failed:
            self.loads.failed(worker)
        d.excluded.add(worker)
        d.attempts += 1
        d.decision = None
        d.phase = "admitted"

    def finish(
        self, d: Dispatch, output_tokens: int = 0, *, streamed: bool = True
    ) -> SessionBinding | None:
        """Success: release load and ticket, close the decode worker's breaker, record the
        decode pace (seconds per token after the first, `LoadBook.decoded`) when it streamed
        two or more tokens (`streamed=False`: the answer came whole, its tokens' times are
        unknown); returns the session binding to record (None: no session, or
        already closed)."""
        if d.closed:
            return None
        decision = d.decision
        self._close(d, "finished", service_tokens(d.request.prompt_tokens, output_tokens))
        if decision is None:
            return None
        self.loads.succeeded(decision.decode.id)
        if streamed and d.first_token_at is not None and output_tokens >= 2:
            now = self.clock()
            if now > d.first_token_at:
                pace = (now - d.first_token_at) / (output_tokens - 1)
                self.loads.decoded(decision.decode.id, pace, now)
        r = d.request
        if not r.session_id:
            return None
        # until its next turn, the session rests on its worker (`LoadBook.rest`)
        self.loads.rest(r.session_id, decision.decode.id, r.prompt_tokens + output_tokens)
        return SessionBinding(
            r.session_id,
            decision.decode.id,
            r.prompt_tokens + output_tokens,
            r.tenant or None,
            session_tip(r.block_hashes),
        )

    def fail(self, d: Dispatch, *, worker: str | None = None, answered: bool = False) -> None:
        """Any unsuccessful end. `worker`: the worker at fault (its breaker counts a failure);
        `answered`: the worker answered, refusing the request (a 4xx) — it is alive, so its
        breaker closes (a half-open probe is not left hanging)."""
        if d.closed:
            return
        decode = d.decision.decode.id if d.decision is not None else None
        self._close(d, "failed", d.request.prompt_tokens)
        if worker is not None:
            self.loads.failed(worker)
        elif answered and decode is not None:
            self.loads.succeeded(decode)

    def cancel(self, d: Dispatch) -> None:
        """The client went away or the task was cancelled: release, blame nobody."""
        if d.closed:
            return
        self._close(d, "cancelled", d.request.prompt_tokens)

    def close(self, d: Dispatch) -> None:
        """For `finally` blocks: cancel unless the dispatch already ended."""
        self.cancel(d)

    def _close(self, d: Dispatch, phase: Phase, service: int) -> None:
        self.predict(d)
        self._release_flight(d)
        if d.ticket is not None:
            d.ticket.release(service)
        d.phase = phase
        self.open_dispatches -= 1

    def uncached_tokens(
        self, request: RouteRequest, hit: PrefixHit, geometry: KVGeometry | None = None
    ) -> int:
        """Prompt tokens left to prefill given `hit`, in blocks of `geometry` (default: the
        router's)."""
        g = geometry or self.config.geometry
        cached = effective_cached_tokens(
            hit, request.prompt_tokens, block_size=g.block_size, sliding_window=g.sliding_window
        )
        return max(0, request.prompt_tokens - int(cached))

    def hit_tokens(self, request: RouteRequest, decision: RouteDecision) -> int:
        """Prompt tokens covered by the decision's expected hit (the prefill worker's when
        disaggregated, else the decode worker's), in that worker's block size."""
        worker = decision.prefill or decision.decode
        blocks = decision.expected_hit.full_blocks
        return min(request.prompt_tokens, blocks * self.geometry_of(worker).block_size)

    def dispatched(
        self, request: RouteRequest, decision: RouteDecision, *, predict: bool = True
    ) -> Flight:
        """The request is being sent as decided: predict its blocks (`predict=False`: not
        now), book its load."""
        if predict:
            self._predict(request, decision)
        return self._book(request, decision)

    def _predict(self, request: RouteRequest, decision: RouteDecision) -> None:
        now = self.clock()
        ttl = self.config.predict_ttl_s
        decode, prefill = decision.decode, decision.prefill
        # Each worker's predictions in its own geometry's hashes (as its events will be); none
        # for a worker that keeps no prefix (its next turn would find nothing there).
        for ep in (decode,) if prefill is None else (decode, prefill):
            if ep.prefix_caching is False:
                continue
            hashes = self.block_hashes_for(request, self.geometry_of(ep))
            if hashes:
                added = self.index.predict(ep.id, hashes, ttl, now)
                # only what the own index lacked: blocks its KV events already confirm are in
                # every replica's index (each subscribes to the same events)
                if added and self.on_predict is not None:
                    self.on_predict(ep.id, added, ttl)

    def _book(self, request: RouteRequest, decision: RouteDecision) -> Flight:
        decode, prefill = decision.decode, decision.prefill
        uncached = self.uncached_tokens(
            request, decision.expected_hit, self.geometry_of(prefill or decode)
        )
        return self.loads.start(
            decode.id,
            uncached,
            request.prompt_tokens + request.max_tokens,
            prefill.id if prefill is not None else None,
            max_tokens=request.max_tokens,
        )
