"""Conditional disaggregation: prefill on the prefill pool only when the uncached part of the
prompt is large; otherwise prefill on the chosen decode worker.

Decision, for the decode worker already chosen (its hit ``h``; ``P`` prompt tokens)::

    cached   = effective_cached_tokens(h)         (a partial hit recomputes its window tail;
                                                   the decode worker's block size and window)
    uncached = P − cached,   cached_ratio = cached / P
    require = "both"   (default): disaggregate iff uncached ≥ min_uncached_tokens
                                                AND cached_ratio < max_cached_ratio
    require = "either":           disaggregate iff uncached ≥ min_uncached_tokens
                                                OR  cached_ratio < max_cached_ratio

Why "both" by default: the issue asks for remote prefill "only when the uncached part is large".
The absolute test says the new tokens are worth moving off the decode worker (a prefill chunk of
that size would stall its running decodes). The ratio test says the decode worker does not
already hold most of the prompt: when it does (an agent's next turn: 80K context, 95 % warm on
its decode worker), a prefill worker would have to hold or recompute that context too, so the
short local prefill wins. With "either", a 100-token cold prompt (ratio 0) would go remote,
which the issue's wording rules out. Dynamo's default (skip remote prefill when uncached < 2,048
*and* uncached/total < 0.7) is ``require: either, max_cached_ratio: 0.3``.

`keep_warm_local`: a request routed to the decode worker its session is bound to (the session
store's warm worker: a continuing turn) is prefilled there, whatever the size of its new part.
That worker holds the session's context; a prefill worker would prefill the whole prompt again
(it does not hold the turns the decode worker ran) and take the time of the pool's new sessions.
On the agentic bench (`bench agentic --routers beamserve-2p2d`, 64 agents) splitting such turns
sent 0.86M of 5.25M prefill tokens to the prefill pool, its bottleneck, and the run took 100 s
instead of 94–96 s (docs/bench/agentic.md).

Only a decode worker that can receive a KV handoff (`Endpoint.receives_kv`: a decode-role worker,
or what the worker itself reported) is ever disaggregated; a `both`-role pool is aggregated
serving and is left alone.

Choosing the prefill worker: among the views that are healthy, prefill-capable, not the decode
worker itself, and pair with it (`pairs_with`: it can send and the decode worker can receive a
handoff in the same style, same revision and KV layout), the lowest
estimated TTFT (prefix hit + prefill backlog, `beamserve.router.policy.ttft`), ties broken by
the stable hash of the session/request id. No such worker → prefill locally.

| parameter | default | meaning |
|---|---|---|
| `enabled` | ``true`` | ``false``: always prefill on the decode worker |
| `min_uncached_tokens` | ``2048`` | uncached tokens at or above which it goes remote |
| `max_cached_ratio` | ``0.7`` | cached share of the prompt below which it goes remote |
| `require` | ``"both"`` | ``"both"``: both tests must hold; ``"either"``: one suffices |
| `keep_warm_local` | ``false`` | ``true``: a turn on its session's own worker prefills there |
| `pool_roles` | ``null`` | a ``kv_both`` pool's roles follow its load (`pool_roles`) |
| `prefill_tok_s`, … | as `ttft` | the `ttft` parameters: cost of each prefill candidate |

Block size and sliding window are no parameters: each worker's come from its KV geometry
(`WorkerView.geometry`: its own report, else the router's flags).

Config example::

    disaggregation:
      min_uncached_tokens: 4096
      max_cached_ratio: 0.7
      require: both
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import structlog
from beamserve.kvwire.geometry import DEFAULT_GEOMETRY
from beamserve.router.policy.base import break_tie, parse_params
from beamserve.router.policy.kv_compat import pairs_with
from beamserve.router.policy.pool_roles import PoolRolesParams
from beamserve.router.policy.prefix_affinity import effective_cached_tokens
from beamserve.router.policy.ttft import TTFTParams, estimate_ttft
from beamserve.router.types import Endpoint, PrefixHit, RouteDecision, RouteRequest, WorkerView
from pydantic import Field

log = structlog.get_logger(__name__)

Require = Literal["both", "either"]


class DisaggregationParams(TTFTParams):
    enabled: bool = True
    min_uncached_tokens: int = Field(default=2048, ge=0)
    max_cached_ratio: float = Field(default=0.7, ge=0.0, le=1.0)
    require: Require = "both"
    keep_warm_local: bool = False
    # A `kv_both` pool's roles follow its load (`beamserve.router.policy.pool_roles`).
    pool_roles: PoolRolesParams | None = None


def decide_disaggregation(
    request: RouteRequest,
    decode_hit: PrefixHit,
    *,
    min_uncached_tokens: int = 2048,
    max_cached_ratio: float = 0.7,
    require: Require = "both",
    block_size: int = DEFAULT_GEOMETRY.block_size,
    sliding_window: int = DEFAULT_GEOMETRY.sliding_window,
    predicted_credit: float = 1.0,
) -> bool:
    """True when `request` should be prefilled on the prefill pool (rule in the module
    docstring); `decode_hit` is the chosen decode worker's hit in blocks of `block_size`
    (its geometry's, with its `sliding_window`)."""
    if request.prompt_tokens <= 0:
        return False
    cached = effective_cached_tokens(
        decode_hit,
        request.prompt_tokens,
        block_size=block_size,
        sliding_window=sliding_window,
        predicted_credit=predicted_credit,
    )
    uncached = request.prompt_tokens - cached
    large = uncached >= min_uncached_tokens
    cold = cached / request.prompt_tokens < max_cached_ratio
    return (large and cold) if require == "both" else (large or cold)


def prefill_candidates(decode: Endpoint, views: Sequence[WorkerView]) -> tuple[WorkerView, ...]:
    """Healthy, prefill-capable views other than `decode` that pair with it."""
    return tuple(
        v
        for v in views
        if v.load.healthy
        and v.endpoint.can_prefill
        and v.endpoint.id != decode.id
        and pairs_with(v.endpoint, decode)
    )


def choose_prefill_worker(
    request: RouteRequest,
    decode: Endpoint,
    views: Sequence[WorkerView],
    params: TTFTParams | None = None,
) -> WorkerView | None:
    """The prefill worker for `request` paired with `decode`: lowest estimated TTFT among
    `prefill_candidates`, ties by stable hash; None when none pairs."""
    params = params or TTFTParams()
    cands = prefill_candidates(decode, views)
    if not cands:
        return None
    cost = {v.endpoint.id: estimate_ttft(v, request, params).seconds for v in cands}
    best = min(cost.values())
    return break_tie(request, [v for v in cands if cost[v.endpoint.id] <= best + 1e-12])


class ConditionalDisaggregation:
    """Adds a prefill worker to a decode decision when the rule says so."""

    type = "conditional-disaggregation"

    def __init__(self, params: DisaggregationParams | None = None) -> None:
        self.params = params or DisaggregationParams()

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> ConditionalDisaggregation:
        return cls(parse_params(DisaggregationParams, params, "disaggregation"))

    def apply(
        self, request: RouteRequest, decision: RouteDecision, views: Sequence[WorkerView]
    ) -> RouteDecision:
        """`decision` with `prefill` set (and `expected_hit` the prefill worker's hit) when the
        request is disaggregated; unchanged apart from the explain string otherwise."""
        p = self.params
        decode = decision.decode
        if not decode.receives_kv:  # aggregated serving (a `both` pool): nothing to pair with
            return decision
        if decision.prefill is not None:  # paired already (a draining pool's move)
            return decision
        if not p.enabled:
            return replace(decision, explain=f"{decision.explain} | disagg=no (local prefill)")
        if p.keep_warm_local and any(v.warm and v.endpoint.id == decode.id for v in views):
            return replace(
                decision, explain=f"{decision.explain} | disagg=no (the session's own worker)"
            )
        # The decode worker's geometry: its hit is in its blocks.
        g = next((v.geometry for v in views if v.endpoint.id == decode.id), DEFAULT_GEOMETRY)
        if not decide_disaggregation(
            request,
            decision.expected_hit,
            min_uncached_tokens=p.min_uncached_tokens,
            max_cached_ratio=p.max_cached_ratio,
            require=p.require,
            block_size=g.block_size,
            sliding_window=g.sliding_window,
            predicted_credit=p.predicted_credit,
        ):
            return replace(decision, explain=f"{decision.explain} | disagg=no (local prefill)")
        chosen = choose_prefill_worker(request, decode, views, p)
        if chosen is None:
            log.info("disagg.no_pair", request=request.request_id, decode=decode.id)
            return replace(
                decision,
                explain=f"{decision.explain} | disagg=wanted but no prefill worker pairs "
                f"with {decode.id} (revision {decode.revision!r}, kv_layout "
                f"{decode.kv_layout!r}); local prefill",
            )
        return replace(
            decision,
            prefill=chosen.endpoint,
            expected_hit=chosen.hit,
            explain=f"{decision.explain} | disagg=yes prefill={chosen.endpoint.id}",
        )
