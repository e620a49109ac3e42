"""Policy `sticky-until-saturated` (the default): keep a session on its warm worker until that
worker is clearly slower than the best alternative; place everything else by estimated TTFT.

Rule, for the candidates left by the filters (default: `healthy`, `role: decode`), with
``ttft(w)`` the estimate of `beamserve.router.policy.ttft` (queued prefill + this request's
uncached tokens, a partial hit recomputing its window tail, over the prefill rate)::

    warm worker w₀ among the candidates, the pool saturated    → stay on w₀ ("sticky")
    warm worker w₀ among the candidates, best other b = argmin_{w ≠ w₀} ttft(w):
        recompute(b)  = move_cost · (uncached(b) − uncached(w₀)) / prefill_tok_s
                        · (1 + n(b))      n(b): requests already on b (in flight, or the
                                          scrape's running + waiting, whichever is more)
        leave w₀ for b  iff  ttft(w₀) − ttft(b) > margin_s + recompute(b)
                        AND  ttft(w₀) > margin_ratio · ttft(b)
                                                        → reason "rebalance"
        otherwise stay on w₀                             → reason "sticky"
    no warm worker among the candidates:
        pick argmin_w ttft(w)  (ties — with router replicas in sync, every worker within
                                `tie_window_s` of the least estimate — to the fewest
                                sessions resting there, none resting: to the longest
                                since a turn ended there (`tie_by_resting`), then by a
                                stable hash of the session/request id; in a burst — with peers, this
                                replica's previous decision under `burst_gap_s` ago — the
                                workers within `burst_window_s` of the least, ranked by
                                estimate, and replica r of the peers takes the r-th)
                                                        → reason "prefix" when the pick holds more
                                                          of the prompt than the worst candidate,
                                                          else "load"
    no candidates                                       → raises NoCandidates ("no-candidates")

Why both margins: the estimate already prices the warm worker's cache (its uncached tokens are
few), so the margin is hysteresis against estimation noise and pays for what leaving costs
later (the next turns lose their warm cache). The absolute margin ignores differences too small
to matter (0.1 s vs 0.3 s); the ratio ignores differences that are large in seconds but small
relative to a long prefill (30 s vs 31.5 s). Set ``margin_ratio: 1`` for an absolute-only rule,
``margin_s: 0`` for a ratio-only rule.

Why the recompute term: ``ttft(b)`` prices the prefill the move repeats for *this* request, but
not for the pool. The repeated tokens are work the pool would not otherwise do, and every
request on ``b`` waits for them too (queued behind them, or decoding beside their chunks). When
the whole pool is saturated a move swaps one long queue for another and adds that work; the
saving must pay for it once more for this request and once for each request already on ``b``
(``move_cost: 1``) before the session leaves. ``move_cost: 0`` is the rule without it. Priced
for this request alone, moves at 64 agents over HTTP cost hit ratio (0.828–0.834 against 0.845
without moves) and goodput (docs/bench/agentic.md, "Steady state at 64 agents"); priced for
the requests on ``b`` as well, the same run shape gave 0.844 (the gateways': 0.842–0.845). An
idle ``b`` (the skew the rule is for) prices it as before.

Why no move while the pool is saturated (`hold_when_saturated`, on by default): when the flow
controller's saturation signal is on (`RouteRequest.pool_saturated`, `beamserve.router.flow`),
every worker's queue is long and the move only swaps queues while adding the repeated prefill,
which every request queued after it on ``b`` waits for too. The margins see one request's two
estimates, not that the pool has no slack for the recompute. Measured over HTTP at 64 agents
(192 sessions, docs/bench/agentic.md "Steady state at 64 agents"): without any moves the hit
ratio was the gateways' (0.845 against 0.828) and goodput 1.08–1.11 × the same build's with
moves; this hold alone reached 0.834, since most moves come when one worker's queue is long
and the pool's mean is under the threshold.

Why a tie window: estimates a few tens of milliseconds apart are equal within the estimator's
noise, and several router replicas deciding a burst at the same instant on the same (synced)
view would all take the one lowest: the window spreads such picks by request id, as a single
router's one-after-the-other decisions spread them by seeing each other's bookings (Dynamo's
router temperature plays this part). It applies only while the router hears replica-sync
peers (`RouteRequest.router_peers`): a single router decides a burst one request after the
other and needs no spreading. **Off by default**, as measured (4 replicas, first 3,000 Mooncake
lines, docs/bench/route.md): 0.1 s moved max/mean load from 1.19 to 1.13 where the trace's
arrivals share the very same instants, but from 1.14 to 1.24 once each arrival is spread by
U(0, 50 ms) — random picks among near-ties unbalance traffic that a synced view would have
ordered. Set it where replicas see truly simultaneous bursts.

Why a burst rank: when a burst reaches every replica at once, each decides its share on the
same synced view before any peer's booking can reach it (the sync delay is a few ms). A
replica's own picks in the burst see each other, its peers' do not, so all replicas would take
the same least-loaded worker first. A replica cannot see its peers' arrivals, but it sees its
own: when its previous decision was less than `burst_gap_s` ago (of the order of the sync
delay), its peers are probably deciding too. Then it ranks the workers within
`burst_window_s` of the least estimate and takes the one at its own rank among the replicas
(ordered by replica id; `RouteRequest.router_rank`), so the replicas' first picks differ by
construction — a hash of the request id (the tie window) collides with probability 1/k. The
cost when the guess is wrong is one pick at most `burst_window_s` worse than the least. On the
Mooncake conversation trace, 4 replicas (docs/bench/route.md, 3 replica draws each): max/mean
load 1.19 → 1.09 on the first 3,000 lines, 1.18 → 1.14 on the held-out lines 3,001–6,000, and
1.22 → 1.14 on the first 3,000 with arrivals spread by U(0, 50 ms); TTFT p90 lower on all three.
A single router (no peers) is never affected.

The no-warm case is Dynamo's cost rule in seconds
(``cost = prefill blocks + decode load``), llm-d's "sticky until saturated" for the warm case.

Scores reported in the decision: ``1 / (1 + ttft_s)`` per candidate (1 = instant).

Data: `WorkerView.warm`, `.hit`, `.load`, `.geometry` (each worker's block size and sliding
window price its hit); `RouteRequest.prompt_tokens`, `.session_id`.

| parameter | default | meaning |
|---|---|---|
| `margin_s` | ``1.0`` | leave only if warm TTFT − best other's > this (s) |
| `margin_ratio` | ``1.5`` | … and warm TTFT > this × best other's |
| `move_cost` | ``1.0`` | … and the difference also > this × the move's recompute seconds |
| `tie_window_s` | ``0.0`` | with replica-sync peers: estimates within this of the least tie (s) |
| `burst_window_s` | ``0.1`` | with peers, in a burst: estimates this near the least rank (s) |
| `burst_gap_s` | ``0.01`` | a burst: this replica's previous decision less than this ago (s) |
| `hold_when_saturated` | ``true`` | never leave the warm worker while the pool is saturated |
| `tie_by_resting` | ``true`` | ties: fewest resting sessions, then (none) longest quiet |
| `prefill_tok_s` | ``40000`` | TTFT estimator: prefill throughput per worker (tokens/s) |
| `decode_interference` | ``0.002`` | TTFT estimator: cost of decode context per token |
| `overhead_s` | ``0.0`` | TTFT estimator: fixed per-request cost |
| `predicted_credit` | ``1.0`` | share of a predicted hit block that counts |
| `resting_weight` | ``0.0`` | TTFT estimator: share of resting sessions' context counted |

Config example::

    strategy: sticky-until-saturated
    filters: [{type: healthy}, {type: role, params: {role: decode}}]
    params: {margin_s: 1.0, margin_ratio: 1.5, prefill_tok_s: 60000}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from beamserve.router.policy.base import Filter, apply_filters, break_tie
from beamserve.router.policy.healthy import HealthyFilter
from beamserve.router.policy.role import RoleFilter
from beamserve.router.policy.ttft import TTFTEstimate, TTFTParams, estimate_ttft
from beamserve.router.types import RouteDecision, RouteRequest, WorkerView
from pydantic import Field

KIND = "sticky-until-saturated"


class StickyParams(TTFTParams):
    margin_s: float = Field(default=1.0, ge=0)
    margin_ratio: float = Field(default=1.5, ge=1.0)
    move_cost: float = Field(default=1.0, ge=0.0)
    tie_window_s: float = Field(default=0.0, ge=0.0)
    burst_window_s: float = Field(default=0.1, ge=0.0)
    burst_gap_s: float = Field(default=0.01, ge=0.0)
    hold_when_saturated: bool = True
    tie_by_resting: bool = True


def _least_resting(tied: Sequence[WorkerView]) -> list[WorkerView]:
    """Of equally good workers, those with the fewest sessions resting (their next turn will
    be back there); where none rests, those whose last turn ended longest ago (a session just
    past the rest window may still come back; one long quiet is likelier gone)."""
    fewest = min(v.load.resting for v in tied)
    least = [v for v in tied if v.load.resting == fewest]
    if fewest == 0 and len(least) > 1:
        quiet = max(_quiet_s(v) for v in least)  # never used: quiet forever
        least = [v for v in least if _quiet_s(v) == quiet]
    return least


def _quiet_s(v: WorkerView) -> float:
    since = v.load.since_rest_s
    return math.inf if since is None else since


def should_leave_warm(
    warm_ttft_s: float,
    best_other_ttft_s: float,
    params: StickyParams,
    recompute_tokens: float = 0.0,
    sharers: int = 0,
) -> bool:
    """True iff the warm worker is saturated relative to the best alternative: both margins,
    the absolute one raised by what the move recomputes (`recompute_tokens`, priced at
    `move_cost` × the prefill rate, once for this request and once for each of the `sharers`,
    the requests already on the alternative, who wait for it or decode beside it)."""
    recompute_s = (
        params.move_cost * max(recompute_tokens, 0.0) / params.prefill_tok_s * (1 + max(sharers, 0))
    )
    return (
        warm_ttft_s - best_other_ttft_s > params.margin_s + recompute_s
        and warm_ttft_s > params.margin_ratio * best_other_ttft_s
    )


class StickyUntilSaturated:
    """The default routing policy (rule in the module docstring)."""

    kind: ClassVar[str] = KIND

    def __init__(
        self,
        name: str = KIND,
        filters: Sequence[Filter] | None = None,
        params: StickyParams | None = None,
    ) -> None:
        self.name = name
        self.filters: tuple[Filter, ...] = (
            tuple(filters) if filters is not None else (HealthyFilter(), RoleFilter("decode"))
        )
        self.params = params or StickyParams()

    def route(self, request: RouteRequest, views: Sequence[WorkerView]) -> RouteDecision:
        cands = apply_filters(self.filters, request, views)
        est = {v.endpoint.id: estimate_ttft(v, request, self.params) for v in cands}
        warm = [v for v in cands if v.warm]
        if warm:
            w0 = min(warm, key=lambda v: (est[v.endpoint.id].seconds, v.endpoint.id))
            others = [v for v in cands if v.endpoint.id != w0.endpoint.id]
            if not others or (request.pool_saturated and self.params.hold_when_saturated):
                chosen, reason = w0, "sticky"  # saturated: a move only adds work (docstring)
            else:
                best = self._cheapest(request, others, est)
                e0, eb = est[w0.endpoint.id], est[best.endpoint.id]
                ld = best.load
                leave = should_leave_warm(
                    e0.seconds,
                    eb.seconds,
                    self.params,
                    recompute_tokens=eb.uncached_tokens - e0.uncached_tokens,
                    sharers=max(ld.in_flight, ld.running + ld.queue_len),
                )
                chosen, reason = (best, "rebalance") if leave else (w0, "sticky")
        else:
            chosen = self._cheapest(request, cands, est)
            least_cached = min(e.cached_tokens for e in est.values())
            reason = "prefix" if est[chosen.endpoint.id].cached_tokens > least_cached else "load"
        return RouteDecision(
            decode=chosen.endpoint,
            expected_hit=chosen.hit,
            reason=reason,
            explain=self._explain(chosen, cands, est),
            scores=tuple(sorted((i, 1.0 / (1.0 + e.seconds)) for i, e in est.items())),
        )

    def _cheapest(
        self, request: RouteRequest, views: Sequence[WorkerView], est: dict[str, TTFTEstimate]
    ) -> WorkerView:
        best = min(est[v.endpoint.id].seconds for v in views)
        p = self.params
        if (
            p.burst_window_s > 0
            and request.router_peers > 0
            and request.since_last_decision_s < p.burst_gap_s
        ):
            ranked = sorted(
                (v for v in views if est[v.endpoint.id].seconds <= best + p.burst_window_s),
                key=lambda v: (est[v.endpoint.id].seconds, v.endpoint.id),
            )
            return ranked[request.router_rank % len(ranked)]
        w = p.tie_window_s
        window = w if w > 0 and request.router_peers > 0 else 1e-12
        tied = [v for v in views if est[v.endpoint.id].seconds <= best + window]
        if p.tie_by_resting and len(tied) > 1:
            tied = _least_resting(tied)
        return break_tie(request, tied)

    def _explain(
        self, chosen: WorkerView, cands: Sequence[WorkerView], est: dict[str, TTFTEstimate]
    ) -> str:
        p = self.params
        parts = [
            f"policy={self.name} pick={chosen.endpoint.id} "
            f"margin_s={p.margin_s:g} margin_ratio={p.margin_ratio:g} move_cost={p.move_cost:g}"
        ]
        for v in sorted(cands, key=lambda v: (est[v.endpoint.id].seconds, v.endpoint.id)):
            e = est[v.endpoint.id]
            parts.append(
                f"{v.endpoint.id}{' (warm)' if v.warm else ''} ttft={e.seconds:.3f}s "
                f"cached={e.cached_tokens:.0f} uncached={e.uncached_tokens:.0f} "
                f"queued={e.queued_prefill_tokens} decode={e.decode_tokens}"
                + (f" resting={e.resting_tokens}" if e.resting_tokens else "")
            )
        return " | ".join(parts)
