"""Pool roles that follow the load: a pool of workers that can each send and receive KV
(vLLM's ``kv_role: kv_both``) serves colocated while it is lightly loaded and splits into
prefill and decode workers once it is not.

Why: a prefill/decode split buys the knee — users decoding on the decode workers never share an
engine step with a new session's 20K-token prompt — with every level below it. There each
session decodes on half the pool (at 8 agents on 4 workers: 4 users a decode worker, 118 tok/s
each, against 2 a worker and 135 tok/s colocated) and every first turn takes two legs and a KV
transfer. With fixed roles (SGLang's `--disaggregation-mode prefill|decode`) nothing can be done
about it; a ``kv_both`` worker can play either part on any request, so the router chooses.

Signal: the pool's active sessions ``A`` = the router's requests in flight + the sessions resting
between turns (`LoadBook.active_sessions`), over ``n`` = the pool's ``kv_both`` workers:

    colocated → split       when A ≥ split_at_sessions_per_worker · n        (at once)
    split     → colocated   when A < colocate_below_sessions_per_worker · n
                            without a break for settle_s seconds

The gap between the two thresholds and the settle time keep a pool near the line from flapping;
a flip costs little anyway: a session keeps its worker while it can (below). The default line is
10 a worker. The agentic bench over HTTP (4 sim H200 workers, docs/bench/agentic.md) first set it
at 6 ("Pool roles that follow the load": colocated ahead at 16 agents, 4 a worker, split ahead
at 32; at 3 a worker the pool split at 16 agents and lost there). Once the first-turn pieces
and the tie rule had made the colocated pool faster, the line at 10 (colocated up to 40
agents) was ahead at 32 agents in all five rounds (9,653–9,815 against 9,386–9,722
tok/s/GPU, p90 TTFT 0.73–0.78 against 1.02–1.24 s) and level at 64 and 128 ("The pool's
line at 10 sessions a worker").

What each mode shows the rest of the router (`PoolRoles.apply`: the endpoints with their roles
overlaid; nothing else changes, so every consumer — the policy, conditional disaggregation, the
prefill stage, the pace hold, the pieces — acts as in a fixed pool of that shape):

- colocated: every ``kv_both`` worker is role ``both`` with no KV handoff (aggregated serving:
  conditional disaggregation leaves it alone);
- split: the first `prefill_workers` of them by id are role ``prefill`` (send only), the rest
  role ``decode`` (receive only). The choice is by id so that every router replica makes the
  same one.

One thing differs from a fixed pool: while the pool is colocated the router skips the pace hold
and the prefill in pieces (`router/flow/pace_hold.py`, `router/flow/pieces.py`). Below the split
line no worker has more than a few users, who decode far above the 20 tokens/s those rules
protect, so holding a turn or cutting its prefill into round trips would only add to its TTFT.

Past the knee, a third step: the prefill stage's spill (`FlowConfig.prefill_spill_after_s`: a
held new session prefilled on a decode worker with room, in pieces) acts only while the pool is
split and, with `spill_at_sessions_per_worker`, from ``A ≥ spill_at · n`` on until ``A <
spill_stop · n`` (`spill_stop_below_sessions_per_worker`, default half the line; 0: until the
pool colocates): the end of a burst, when fewer sessions are left and the prefill workers still
hold the late first turns, is where the spill pays most. Over HTTP (4
sim H200 workers, docs/bench/agentic.md, "Past the knee") the spill priced for pieces brought
the throughput at 128 agents from 0.93 to 0.98 × the best gateway's, but at 64 agents it cost
the split pool goodput (13.44 against 14.84 r/s in one run; 14.97 and 14.03 against 15.70 in
another, spilling after 5 and 2 s); the line at 24 a worker is between the two (128 agents on 4
workers are 32 a worker before any session resting between turns, 64 are 16).

A session that started on a worker that is a prefill worker once the pool splits moves on its
next turn: the policy picks a decode worker, which holds none of its context, so conditional
disaggregation splits the turn, and the prefill worker it picks (lowest estimated TTFT, the
prefix hit counted) is the session's old worker, which holds it: the turn prefills only its new
part there and its whole context moves by KV transfer. Nothing is computed twice.

**The drain** (`drain_quiet_s`, 2 s by default; null: never). A split pool's end of a burst: new
sessions have stopped, the prefill stage has drained its backlog, and the prefill workers fall
idle while the decode workers still serve every session's last turns. Their users decode more
slowly for it: a decode step's time grows with its batch (on the sim's `h200-bf16-tp8` profile
18.0 ms for 12 users of 60K tokens, 12.5 ms for 6), and the last sessions' chains of turns are
what the burst's end waits for. So once, while split,

- no new session has reached the router for `drain_quiet_s` seconds, none is held or let
  through and not yet routed (the flow controller's `drain_state`),
- the pool's active sessions are under `drain_below_peak` of their peak over the last minute
  (null: any quiet spell; a closed-loop burst's start is quiet too, but at its peak), and
- a prefill worker has nothing of this replica's in flight and no prefill queued,

the pool *drains*: every swinging worker is role ``both`` and both sends and receives KV, and a
continuing turn that the policy keeps on its session's worker moves instead to the worker with
the fewest requests in flight, when that one has `drain_move_margin` (2) fewer and at most
`drain_max_prefill_tokens` (8,192) of prefill queued (`drain_move`): its new part is prefilled
where its context is, the whole context is handed over by KV transfer (≈ 15 ms for 144K tokens
by the sim's cost model), and the session stays where it moved. Nothing is computed twice. The
next new session ends the drain (the pool splits again, and a session resting on a prefill
worker moves back to a decode worker on its next turn, by the same handoff); the active sessions
falling under the colocate line colocate it, as from split. While draining, the pace hold and
the pieces still apply, the spill does not (nothing is held). Over HTTP at 128 agents on 4 sim
workers (docs/bench/agentic.md, "The drain") the runs ended 1.1 and 2.3 s sooner, for 1.008 and
1.017 × the throughput of the same pool without it in the same runs, at the same p90 TTFT and
0.96–1.01 × its goodput; at 64 agents the two were level (0.993 ×, goodput 0.99 ×). A moved
turn's decode worker reports its prompt as not cached (the KV came by transfer), so the router's
and the benchmark's hit ratio fall a little; the prefill worker's counters show the hit.

Workers that are not ``kv_both`` (fixed ``prefill`` / ``decode`` roles, SGLang workers, vLLM
workers without a connector) keep what they are.

Several router replicas: each decides the mode from its own requests and resting sessions plus
the requests its peers book (replica sync), so near the line two replicas can disagree for a
moment; a session placed meanwhile on a worker that is a prefill worker to the other replica
moves once more, by the same handoff. The prefill workers are the same on every replica. A
replica drains on its own word (its own arrivals; the prefill workers' queues as the peers'
bookings show them): a new session at another replica ends nothing here, so a prefill worker
may prefill it beside users this replica moved there, who move back on their next turns.

| parameter | default | meaning |
|---|---|---|
| `prefill_workers` | ``1`` | workers that prefill while split (at least one decodes) |
| `split_at_sessions_per_worker` | ``10.0`` | active sessions a worker that split the pool |
| `colocate_below_sessions_per_worker` | ``null`` | under this (null: ⅔ of the above)… |
| `settle_s` | ``10.0`` | …for this long, the pool serves colocated again |
| `spill_at_sessions_per_worker` | ``null`` | split, the prefill stage spills only from here |
| `spill_stop_below_sessions_per_worker` | ``null`` | …and on until under this (null: half) |
| `drain_quiet_s` | ``2.0`` | split, no new session for this long: the drain (null: never) |
| `drain_below_peak` | ``0.9`` | …while the active sessions are under this share of their peak |
| `drain_move_margin` | ``2`` | draining, a turn moves to a worker with this many fewer requests |
| `drain_max_prefill_tokens` | ``8192`` | …and at most this much prefill queued |

Config example (`beamserve router --disaggregation`)::

    disaggregation:
      min_uncached_tokens: 8192
      keep_warm_local: true
      pool_roles: {prefill_workers: 2, spill_at_sessions_per_worker: 24}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import structlog
from beamserve.router.policy.base import PluginParams
from beamserve.router.policy.kv_compat import pairs_with
from beamserve.router.types import Endpoint, RouteDecision, RouteRequest, WorkerView
from pydantic import Field, model_validator

log = structlog.get_logger(__name__)

Mode = Literal["colocated", "split", "drain"]
MODES: tuple[Mode, ...] = ("colocated", "split", "drain")
# What the router says of the drain (`ModeSwitch.observe`): ``ready`` (a split pool may drain
# now), ``busy`` (new sessions arrive: a draining pool splits again), ``hold`` (neither: stay).
Drain = Literal["ready", "busy", "hold"]


class PoolRolesParams(PluginParams):
    prefill_workers: int = Field(default=1, ge=1)
    split_at_sessions_per_worker: float = Field(default=10.0, gt=0.0)
    # None: two thirds of the split line
    colocate_below_sessions_per_worker: float | None = Field(default=None, gt=0.0)
    settle_s: float = Field(default=10.0, ge=0.0)
    # None: the prefill stage's spill (if configured) whenever split
    spill_at_sessions_per_worker: float | None = Field(default=None, gt=0.0)
    # None: half of the spill line
    spill_stop_below_sessions_per_worker: float | None = Field(default=None, ge=0.0)
    # None: a split pool never drains (module docstring, "The drain")
    drain_quiet_s: float | None = Field(default=2.0, gt=0.0)
    drain_below_peak: float | None = Field(default=0.9, gt=0.0, le=1.0)
    drain_move_margin: int = Field(default=2, ge=1)
    drain_max_prefill_tokens: int = Field(default=8192, ge=0)

    @property
    def spill_stop_below(self) -> float | None:
        """Under this many active sessions a worker a spilling pool stops spilling (None: no
        spill line, so no stop either)."""
        line, stop = self.spill_at_sessions_per_worker, self.spill_stop_below_sessions_per_worker
        if line is None:
            return None
        return line / 2 if stop is None else stop

    @property
    def colocate_below(self) -> float:
        c = self.colocate_below_sessions_per_worker
        return self.split_at_sessions_per_worker * 2 / 3 if c is None else c

    @model_validator(mode="after")
    def _ordered(self) -> PoolRolesParams:
        c = self.colocate_below_sessions_per_worker
        if c is not None and c > self.split_at_sessions_per_worker:
            raise ValueError(
                "colocate_below_sessions_per_worker must not exceed split_at_sessions_per_worker "
                f"({c} > {self.split_at_sessions_per_worker}); lower it, or the pool would flap"
            )
        spill = self.spill_at_sessions_per_worker
        if spill is not None and spill < self.split_at_sessions_per_worker:
            raise ValueError(
                "spill_at_sessions_per_worker must not be below split_at_sessions_per_worker "
                f"({spill} < {self.split_at_sessions_per_worker}): the spill acts only on a "
                "split pool; raise it, or leave it null to spill whenever split"
            )
        stop = self.spill_stop_below_sessions_per_worker
        if stop is not None and (spill is None or stop > spill):
            raise ValueError(
                "spill_stop_below_sessions_per_worker needs spill_at_sessions_per_worker and "
                f"must not exceed it ({stop} > {spill}); lower it, or leave it null for half "
                "the spill line"
            )
        return self


def swings(ep: Endpoint) -> bool:
    """Can this worker play either part: role ``both``, and it both sends and receives KV
    (``kv_both``, as its facts say)."""
    return ep.role == "both" and ep.sends_kv and ep.receives_kv


def prefill_workers_of(endpoints: Sequence[Endpoint], prefill_workers: int) -> list[Endpoint]:
    """The swinging workers that prefill while split: the first `prefill_workers` by id, at
    least one left to decode (none with fewer than two). Pure."""
    swing = sorted((e for e in endpoints if swings(e)), key=lambda e: e.id)
    return swing[: min(prefill_workers, len(swing) - 1)] if len(swing) >= 2 else []


def overlay(endpoints: Sequence[Endpoint], mode: Mode, prefill_workers: int) -> list[Endpoint]:
    """`endpoints` as the rest of the router sees them in `mode` (module docstring). The
    prefill workers are the first `prefill_workers` swinging workers by id; at least one
    swinging worker always decodes. Pure."""
    swinging = sum(1 for e in endpoints if swings(e))
    if mode == "drain" and swinging >= 2:
        # every swinging worker decodes, and hands a session's KV on or takes it in
        return [
            replace(e, role="both", kv_send=True, kv_receive=True) if swings(e) else e
            for e in endpoints
        ]
    if mode == "split" and swinging >= 2:
        prefill = frozenset(e.id for e in prefill_workers_of(endpoints, prefill_workers))
    else:
        prefill = None
    out = []
    for e in endpoints:
        if not swings(e):
            out.append(e)
        elif prefill is None:
            out.append(replace(e, kv_send=False, kv_receive=False))
        elif e.id in prefill:
            out.append(replace(e, role="prefill", kv_send=True, kv_receive=False))
        else:
            out.append(replace(e, role="decode", kv_send=False, kv_receive=True))
    return out


@dataclass
class ModeSwitch:
    """The mode as a function of the active sessions over time (thresholds in the module
    docstring); `observe` is pure apart from this object's own state."""

    params: PoolRolesParams
    mode: Mode = "colocated"
    switches: int = 0
    _low_since: float | None = None

    def observe(
        self,
        active: int,
        workers: int,
        now: float,
        drain: Callable[[], Drain] | None = None,
    ) -> Mode:
        """The mode after seeing `active` sessions on `workers` swinging workers at `now`;
        `drain`, asked only while split or draining: whether the pool may drain now (module
        docstring, "The drain"; None: never)."""
        p = self.params
        if workers < 2:
            self._low_since = None
            return self._go("colocated", active)
        if self.mode == "colocated":
            if active >= p.split_at_sessions_per_worker * workers:
                return self._go("split", active)
            return self.mode
        if drain is not None and p.drain_quiet_s is not None:
            state = drain()
            if self.mode == "split" and state == "ready":
                self._go("drain", active)
            elif self.mode == "drain" and state == "busy":
                self._go("split", active)
        if active >= p.colocate_below * workers:
            self._low_since = None
            return self.mode
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since >= p.settle_s:
            self._low_since = None
            return self._go("colocated", active)
        return self.mode

    def _go(self, mode: Mode, active: int) -> Mode:
        if mode != self.mode:
            self.mode = mode
            self.switches += 1
            log.info("pool.mode", mode=mode, active_sessions=active)
        return mode


class PoolRoles:
    """The overlay with its mode switch, cached: `apply` rebuilds the endpoint list only when
    the mode or the endpoints changed."""

    def __init__(self, params: PoolRolesParams) -> None:
        self.params = params
        self.switch = ModeSwitch(params)
        self._source: Sequence[Endpoint] | None = None
        self._swinging = 0
        self._built: tuple[Mode, list[Endpoint]] | None = None
        self._spilling = False

    @property
    def mode(self) -> Mode:
        return self.switch.mode

    def prefill_endpoints(self) -> list[Endpoint]:
        """The swinging workers that prefill while split (`prefill_workers_of`)."""
        return prefill_workers_of(self._source or [], self.params.prefill_workers)

    @property
    def spilling(self) -> bool:
        """May the prefill stage spill now: split, and (with `spill_at_sessions_per_worker`)
        since the last `apply` that saw that many active sessions a swinging worker, none
        has seen fewer than half as many."""
        return self._spilling

    def apply(
        self,
        endpoints: Sequence[Endpoint],
        active: int,
        now: float,
        drain: Callable[[], Drain] | None = None,
    ) -> list[Endpoint]:
        """`endpoints` overlaid for the mode that `active` sessions at `now` give (`drain`:
        `ModeSwitch.observe`'s)."""
        if endpoints is not self._source:
            self._source = endpoints
            self._swinging = sum(1 for e in endpoints if swings(e))
            self._built = None
            # (once every worker has reported: an unprobed one swings only once it has)
            if self._swinging < 2 and endpoints and all(e.api is not None for e in endpoints):
                log.warning(
                    "pool.roles_fixed",
                    swinging_workers=self._swinging,
                    fix="pool_roles needs two or more workers of role both that send and "
                    "receive KV (vLLM kv_transfer_config kv_role kv_both: label kv_role=kv_both); "
                    "until then the pool serves colocated",
                )
        mode = self.switch.observe(active, self._swinging, now, drain)
        line = self.params.spill_at_sessions_per_worker
        if mode != "split":
            self._spilling = False
        elif line is None or active >= line * self._swinging:
            self._spilling = True
        elif active < (self.params.spill_stop_below or 0.0) * self._swinging:
            self._spilling = False  # (under the stop, default half the line: the tail spills on)
        built = self._built
        if built is None or built[0] != mode:
            built = self._built = (mode, overlay(endpoints, mode, self.params.prefill_workers))
        return built[1]


def drain_move(
    request: RouteRequest,
    decision: RouteDecision,
    views: Sequence[WorkerView],
    params: PoolRolesParams,
) -> RouteDecision:
    """In a draining pool (module docstring, "The drain"): a continuing turn the policy keeps
    on its session's worker goes instead to the worker with the fewest requests in flight,
    when that one has `drain_move_margin` or more fewer and at most `drain_max_prefill_tokens`
    of prefill queued: its new part is prefilled on the session's worker (the decision's
    `prefill`), which hands the whole context over (`pairs_with`: it sends, they receive).
    `decision` unchanged otherwise. Pure."""
    if request.band != "continuing" or decision.prefill is not None:
        return decision
    here = decision.decode
    home = next((v for v in views if v.endpoint.id == here.id), None)
    if home is None or not home.warm:
        return decision
    cands = [
        v
        for v in views
        if v.endpoint.can_decode
        and v.load.healthy
        and v.load.effective_prefill_tokens <= params.drain_max_prefill_tokens
        and pairs_with(here, v.endpoint)
    ]
    if not cands:
        return decision
    best = min(
        cands, key=lambda v: (v.load.in_flight, v.load.effective_prefill_tokens, v.endpoint.id)
    )
    if best.load.in_flight + params.drain_move_margin > home.load.in_flight:
        return decision
    return replace(
        decision,
        decode=best.endpoint,
        prefill=here,
        expected_hit=home.hit,
        reason="drain-move",
        explain=f"{decision.explain} | drain: {here.id} has {home.load.in_flight} in flight, "
        f"{best.endpoint.id} {best.load.in_flight}: moved by KV handoff",
    )
