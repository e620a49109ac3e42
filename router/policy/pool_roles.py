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
a flip costs little anyway: a session keeps its worker while it can (below). The default line, 6
a worker, is where the agentic bench over HTTP (4 sim H200 workers, docs/bench/agentic.md, "Pool
roles that follow the load") had the colocated pool ahead at 16 agents (4 a worker) and the
split one ahead at 32 (8 a worker); at 3 a worker the pool split at 16 agents and lost there.

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

Workers that are not ``kv_both`` (fixed ``prefill`` / ``decode`` roles, SGLang workers, vLLM
workers without a connector) keep what they are.

Several router replicas: each decides the mode from its own requests and resting sessions plus
the requests its peers book (replica sync), so near the line two replicas can disagree for a
moment; a session placed meanwhile on a worker that is a prefill worker to the other replica
moves once more, by the same handoff. The prefill workers are the same on every replica.

| parameter | default | meaning |
|---|---|---|
| `prefill_workers` | ``1`` | workers that prefill while split (at least one decodes) |
| `split_at_sessions_per_worker` | ``6.0`` | active sessions a worker that split the pool |
| `colocate_below_sessions_per_worker` | ``null`` | under this (null: ⅔ of the above)… |
| `settle_s` | ``10.0`` | …for this long, the pool serves colocated again |
| `spill_at_sessions_per_worker` | ``null`` | split, the prefill stage spills only from here |
| `spill_stop_below_sessions_per_worker` | ``null`` | …and on until under this (null: half) |

Config example (`beamserve router --disaggregation`)::

    disaggregation:
      min_uncached_tokens: 8192
      keep_warm_local: true
      pool_roles: {prefill_workers: 2, spill_at_sessions_per_worker: 24}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import structlog
from beamserve.router.policy.base import PluginParams
from beamserve.router.types import Endpoint
from pydantic import Field, model_validator

log = structlog.get_logger(__name__)

Mode = Literal["colocated", "split"]
MODES: tuple[Mode, ...] = ("colocated", "split")


class PoolRolesParams(PluginParams):
    prefill_workers: int = Field(default=1, ge=1)
    split_at_sessions_per_worker: float = Field(default=6.0, gt=0.0)
    # None: two thirds of the split line
    colocate_below_sessions_per_worker: float | None = Field(default=None, gt=0.0)
    settle_s: float = Field(default=10.0, ge=0.0)
    # None: the prefill stage's spill (if configured) whenever split
    spill_at_sessions_per_worker: float | None = Field(default=None, gt=0.0)
    # None: half of the spill line
    spill_stop_below_sessions_per_worker: float | None = Field(default=None, ge=0.0)

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


def overlay(endpoints: Sequence[Endpoint], mode: Mode, prefill_workers: int) -> list[Endpoint]:
    """`endpoints` as the rest of the router sees them in `mode` (module docstring). The
    prefill workers are the first `prefill_workers` swinging workers by id; at least one
    swinging worker always decodes. Pure."""
    swing = sorted(e.id for e in endpoints if swings(e))
    if mode == "split" and len(swing) >= 2:
        prefill = frozenset(swing[: min(prefill_workers, len(swing) - 1)])
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

    def observe(self, active: int, workers: int, now: float) -> Mode:
        """The mode after seeing `active` sessions on `workers` swinging workers at `now`."""
        p = self.params
        if workers < 2:
            self._low_since = None
            return self._go("colocated", active)
        if self.mode == "colocated":
            if active >= p.split_at_sessions_per_worker * workers:
                return self._go("split", active)
            return self.mode
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

    @property
    def spilling(self) -> bool:
        """May the prefill stage spill now: split, and (with `spill_at_sessions_per_worker`)
        since the last `apply` that saw that many active sessions a swinging worker, none
        has seen fewer than half as many."""
        return self._spilling

    def apply(self, endpoints: Sequence[Endpoint], active: int, now: float) -> list[Endpoint]:
        """`endpoints` overlaid for the mode that `active` sessions at `now` give."""
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
        mode = self.switch.observe(active, self._swinging, now)
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
