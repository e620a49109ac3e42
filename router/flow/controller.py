"""Flow control: admit requests in priority bands, fairly between tenants, shedding under overload.

`await controller.admit(band, tenant, cost_tokens)` returns a `Ticket` once the request may be
dispatched; `ticket.release(service_tokens)` (or leaving ``async with ticket:``) returns its
room. Contract:

* **Priority.** Bands are `beamserve.router.types.BANDS`, highest first: ``continuing`` (the
  next turn of a running agent session) > ``new`` > ``sheddable``. A queued item of a lower
  band is never dispatched while a higher band has queued items.
* **Fairness within a band.** Least attained service (`fairness`): the queued item whose tenant
  (session or API key) has the least decayed service goes first; a tenant's own items go
  first-in first-out, except in a congested band (next point).
* **Adaptive LIFO in the lower bands.** While the oldest queued item of ``new`` or
  ``sheddable`` has waited at least `lifo_after_s` (default 2 s, the TTFT bound of the goodput
  SLO the benchmarks use) the band is congested, and it goes newest first: among the tenants of
  least attained service the one whose newest item is newest, and that item. Under a standing
  backlog first-in first-out makes every request wait the whole backlog, so none is served in
  time; newest first serves the requests that still can be, and the ones that already waited
  longest — already late — wait on. Once the oldest item has waited `lifo_max_wait_s` (30 s;
  at most half the band's TTL) the band goes oldest first again until it has none that old, so
  no request expires while the gate still moves. The order changes, not how much is admitted.
  ``continuing`` turns stay first-in first-out (a session's turns come one at a time, and they
  are not held by default). Measured: docs/bench/agentic.md, "Adaptive LIFO".
* **Continuing turns are not gated** (default; `hold_continuing: true` gates them as below,
  with the room rules and the replicas' room sharing that serve them). A continuing turn's
  prefill is its new part, small beside the new sessions' prompts the gate holds back; holding
  it in the router only moves its wait out of the engine, where with new sessions held it
  queues behind little. Measured over HTTP at 64 agents (192 sessions; docs/bench/agentic.md
  "Steady state at 64 agents"), two separate runs with moves off: gated, continuing turns' TTFT
  p50 was 0.26 s and goodput 10.98 r/s; ungated 0.15 s and 11.51 r/s. In one run beside the
  gateways this tree's defaults gave continuing turns 0.164 s against the morning's build's
  0.474 s (the gateways' 0.137–0.142 s). Ungated, they still count in the projection
  (`admitted`) that paces the lower bands.
* **Saturation gate.** While the `SaturationSignal` says saturated, nothing new is dispatched,
  except into room that in-flight completions free: each ticket released while saturated adds
  its `cost_tokens` to a *room* budget; the next queued item (in priority order, never
  reordered) is dispatched when its cost fits in the room, or when room is positive and nothing
  of this controller is left in flight (else a single large item could wait forever). Room
  resets to 0 each time saturation begins. Not saturated: dispatch immediately, as long as
  the signal's projection (`SaturationDetector.admits`: the last snapshot plus what was
  admitted since) stays below saturation; the rest waits for the next snapshot or release, so
  a backlog drains at the pool's pace instead of all at once into the engines' own queues
  (where bands no longer apply). With such a measuring signal, the room of a saturated spell
  serves the ``continuing`` band only (unless nothing is in flight): completions that free
  room do not make the pool less busy (its level is prefill and queue work, and a new session's
  prompt is mostly uncached where the finished turn's was mostly cached), so handing their room
  to new sessions would keep the engines' queues growing, and every continuing turn waits in
  them; new and sheddable work waits here instead, until the level falls below the threshold,
  and is shed by its TTL if it never does — the overload is absorbed by the lower bands. A
  signal without `admits` (a test fake) gates on `saturated` and room alone.
* **Several replicas.** Each router replica has its own controller, and while saturated each
  gets room only from its own completions — so room freed at a replica with nothing queued
  would sit unused while another replica's continuing turns wait. With replica sync
  (`beamserve.router.sync`) a replica hears how many continuing turns each peer has queued
  (`on_continuing_queued` reports its own), and the room a release frees while saturated is
  split evenly among the peers whose continuing turns wait (`on_spare_room` returns what it
  handed over; a peer receives its share through `grant_room`) — also when continuing turns
  wait here: every replica hands its room on alike, so room goes round to where turns wait;
  with no such peer it stays here as before. Room that stays is *banked* here, and sync
  tells the peers how much (`on_room`); a turn that arrives at a replica whose own room does
  not cover it borrows the shortfall from the peers' banks (`peer_room`, most first;
  `on_borrow` claims it, the lender's `lend_room` takes it out of its room), so a turn waits
  only when the pool's room — not this replica's share of it — falls short, as at one router.
  Two replicas borrowing the same room a sync delay apart leave the lender below zero, and its
  next releases repay it. Room is never created, only moved: the pool's saturated pace is
  kept. New sessions, likewise, are taken in the pool's order rather than each replica's:
  each replica tells its peers since when the item it would dispatch next in the ``new`` and
  ``sheddable`` bands has waited (`on_head`), and when the gate is open a replica whose next
  item is younger than `older_peers` of its peers' admits it only if the projection has room
  for theirs as well (each counted at this item's cost) — without that, every replica admits
  one session into the same headroom, and a session's wait depends on how many others queued
  at its replica, not on when it came. The two exceptions for "nothing in flight" (a
  large item; new work in a levelled spell) read the pool (`peers_busy`: a peer has requests
  in flight or continuing turns queued), or a replica whose own requests happen to have all
  finished would let new sessions in ahead of the continuing turns queued at the others.
* **The prefill stage of a disaggregated pool** (`prefill_stage`, set by the router when it has
  prefill workers; `prefill_gate_tokens`, default 32,768). There, a new session's long first
  prompt is prefilled on a prefill worker, and its decode worker waits for the KV (SGLang's
  handoff sends both legs at once and gives up after its KV deadline, 10 s on the sim, then
  prefills again itself). First-in first-out into the prefill workers' own queues makes every
  first turn wait the whole backlog: over HTTP at 64 agents on 2 prefill + 2 decode workers
  the first turns' TTFT p50 was 12.5 s and 86 decode legs gave up and prefilled again. So the
  router keeps that queue: an item of a lower band whose cost is at least the stage's
  `min_tokens` (the requests the P/D rule splits) is dispatched only while some healthy
  prefill worker has less than `prefill_gate_tokens` of prefill in flight (the router's own
  books, and the engine's queue while the scrape is fresh; items dispatched and not yet routed
  count against the worker with the most room; with `prefill_gate_lead`, off by default, the
  prompt the worker computes now — this replica's oldest prefill in flight there — does not
  count, so its next prompt is sent meanwhile: counted, a prefill worker with one long prompt
  idles from its answer to the router's next dispatch, over HTTP at 128 agents about 0.11 s
  each time, 4.0–4.6 s of a 120 s run per prefill worker by the sim's own step times, 1.5 s
  with the lead; but the prompt sent early is one the engine takes first come first served,
  not shortest first, and at 64 agents the lead cost first turns their TTFT — 68 of 192 in
  time against 98 without it, p90 TTFT 2.07 s against 1.67 s — for no throughput at 128:
  docs/bench/agentic.md, "Sub-agent calls as continuing turns, by default, and the
  prefill stage's lead"), and while the stage gates, the band goes
  **shortest first among the items that can still be in time**: those that waited less than
  `prefill_sjf_window_s` (default 2 s, the TTFT bound of the benchmarks' SLO) go first, the
  cheapest first (oldest among equals); then the others, oldest first; and before all, items
  that waited `lifo_max_wait_s` (oldest first, so none starves). Shortest first is what a
  single server's queue does to minimise the mean wait, and it is what lets most first turns
  meet a 2 s TTFT at all: on virtual time (`scripts/knee-search.py`) the same pool gave 12 of
  192 first turns in time first-in first-out and 104–111 shortest first. Shortest first among
  *all* waiting items, though, keeps the longest prompts waiting until the queue empties — long
  after they could be in time — and their sessions' later turns with them, which lengthens
  the run: with the items that are late anyway served oldest first, the same pool's run took
  82.0 s instead of 83.6 s and its goodput rose from 14.94 to 15.39 r/s (3 seeds;
  `pd-2p2d-legbooks-window-2` against `pd-2p2d-legbooks-cont-pace-hold-1024-1.5`; over HTTP
  docs/bench/agentic.md, "The pace hold, and late first turns oldest first"). The stage is
  such an item's only gate: the saturation gate and the pool's pace (below) watch the decode
  workers, where its prefill does not run. The two gates hold only their own kind: while the
  stage is closed the band's other items still pass the saturation gate if it lets them, and
  while that gate holds a short (local) first turn — shortest first often puts one at the
  head — the items behind it still go to a prefill worker with room. (Before, whichever item
  headed the band stopped every item behind it: over HTTP at 128 agents split first turns
  waited 29 s in the router at the median, local ones 2 s.)
  **The spill** (`prefill_spill_after_s`, off by default; `prefill_spill_max_tokens` 49,152,
  `prefill_spill_margin_s` 0.5 s): while the stage is closed, an item held there that long or longer
  may instead be prefilled on a decode worker, the session's worker from then on, when that worker
  has room for it (`PrefillStage.spill`, the router's `LoadBook.spill_room`): its queued prefill,
  with the item, stays within the maximum, and none of the users streaming from it would be pushed
  under the pace hold's speed (`pace_hold_user_tok_s`) by that prefill plus the margin, the prefill
  priced at `prefill_spill_tok_s` (default: the pace hold's `pace_hold_prefill_tok_s`). With the
  prefill in pieces on, a spilled first turn is prefilled a piece at a time
  (`beamserve.router.flow.pieces`), and a piece beside memory-bound decode steps costs their users
  far less than a prefill worker's rate: on the sim's `h200-bf16-tp8` profile a step of 60 decodes
  takes 37.9 ms, 48.1 ms with 1,024 prefill tokens beside them (≈ 100K tokens/s at the margin),
  while a prefill worker does 8,192 tokens in ≈ 0.25 s (≈ 32K tokens/s). Over HTTP at 128 agents,
  priced at 100K tokens/s with 96K tokens and no margin, the adaptive pool's throughput went from
  0.925–0.944 × to 0.981–0.982 × the best gateway's (docs/bench/agentic.md, "Past the knee"). The
  users' speed it keeps is the pace hold's unless `prefill_spill_user_tok_s` says otherwise; at 12
  tokens/s (the same runs, fourth session) it spilled so much that the decode workers' queued
  prefill kept the saturation gate shut on short first turns until 15 of them expired (HTTP 503).
  Items go in the stage's order, each to the roomiest such worker, and until an item is routed its
  cost counts against the worker it was spilled to; with none roomy enough, the stage looks again
  every 50 ms. While a short new session of the band (one the stage does not gate) has waited
  `lifo_max_wait_s` or half the band's TTL at the saturation gate, the spill yields: it would take
  the decode workers' room past that gate, and over HTTP at 128 agents with the users' speed at 12
  tokens/s (above) 15 such sessions waited there until their TTL. The ticket carries the worker
  (`Ticket.spill_to`) and the routing core sends the request there, unsplit. The prefill workers are
  the pool's bottleneck at and past its knee (three quarters of the prefill is new sessions'), and
  the decode workers' users sometimes have slack to spare: on virtual time
  (`scripts/knee-search.py`, `pd-2p2d-spill`) the pool's goodput rose from 15.39 to 15.62 r/s at 64
  agents (3 seeds) and from 10.83 to 11.46 r/s at 128 (2 seeds, 6 % more throughput); spilling at
  once, with no bound on the queue and no margin, lost (10.47 r/s, `pd-2p2d-spill-no-bound`:
  continuing turns queued behind spilled prompts). Over HTTP at 64 agents it spilled 8 times a run
  and did not help (two runs beside the pool without it: 14.46 against 14.73 and 15.10 against 15.58
  r/s; docs/bench/agentic.md), so it is off. Holding split first turns there too left the prefill
  workers idle 12 % of the run while first turns waited (HTTP, 64 agents, 2 prefill + 2 decode
  workers), and the run took 94–96 s instead of 85 s. A split request's booking on its prefill
  worker ends when the prefill leg answers (`RoutingCore.prefill_hook`), not at the decode worker's
  first token. Without prefill workers nothing of this applies.
  **The spill in a lull** (`prefill_spill_lull_s`, off by default): once no new item of the band
  has arrived for that long while some are held at the closed stage, the spill reckons the decode
  workers' users at `prefill_spill_lull_user_tok_s` (default 10) instead, and bounds their queued
  prefill at `prefill_spill_lull_max_tokens` (default: the spill's own); the next arrival ends the
  lull (the stage's `spill` asked with ``lull=True``; `FlowController.lull_spilled`). The end of a
  burst is why: past the knee the stage holds a backlog of new sessions (over HTTP at 128 agents on
  4 sim workers, ≈ 2M prompt tokens, 50–60 first turns, waiting ≈ 25 s) that only the two prefill
  workers and the priced spill drain. While new sessions keep arriving, holding them protects the
  users decoding; once they stop, the backlog is all the new work there will be, and every second
  it takes to drain is a second added to the end of the burst, when the decode workers' users are
  ever fewer. Measured over HTTP (docs/bench/agentic.md, "The end of a burst drained in a lull";
  128 agents): the run ended 1–6 s sooner and its throughput was 0.8–4.6 % higher than the same
  pool's without the lull in the same run (six pairs), while goodput dropped 6–36 % (the users
  slowed for those seconds miss 20 tokens/s): a trade, so off by default. Only while the spill
  itself is on (`pool_roles`' spill line). A quiet spell is not always the end of a burst: when
  many sessions open at once (a closed-loop benchmark's start, a batch of agents launched
  together) the next arrives only once one of them ends, and the lull's slower users would be
  the few the pool serves. So the lull also asks that the pool is draining: its active sessions
  (`FlowController.active_sessions`, the pool-roles signal: requests admitted or queued and
  sessions resting between turns) under `prefill_spill_lull_below_peak` (0.9) of their peak
  over the last `prefill_spill_lull_peak_s` (60 s), sampled at every admission (null, or no
  source: any lull). Over HTTP (docs/bench/agentic.md, "Where the GPU time goes") the rule
  without it lost as much goodput in the first 30 s of a 128-agent run as at its end.
  **Longest first in a lull** (`prefill_lull_longest_first_s`): once no new item of the band has
  arrived for that long, the items held at the stage that can no longer be in time (they waited
  `prefill_sjf_window_s` or more; before them, oldest first, only those that waited
  `prefill_lull_rescue_s`, 45 s and at most ¾ of the band's TTL, instead of `lifo_max_wait_s`:
  with no arrivals nothing can starve, and only the TTL is left to guard) go longest first
  (the short, local ones among them oldest first, ahead), and the spill takes the shortest of
  them. Nothing waiting can meet the TTFT bound any more, so the order moves no request into or
  out of the SLO; what it moves is when the backlog ends. Oldest first (or shortest first) leaves
  the longest prompts for last, and the run of the last one on one prefill worker, while the
  other has nothing left, is added to the end of the burst; longest first onto whichever prefill
  worker frees first is the classic list-scheduling rule for the shortest makespan, and the
  slower spill is given the small ones. The next arrival ends the lull. Over HTTP at 128 agents
  (docs/bench/agentic.md, "Longest first in a lull") the run ended 3.5–5.5 s sooner, for
  1.026 × and 1.041 × the throughput of the same pool without it in the same run, at the same
  goodput; at 64 agents 1.002 ×. On by default (2 s). With the overdue bound of a lull at 45 s
  instead of 30 (`prefill_lull_rescue_s`) the last prompt of a 128-agent burst was no longer a
  144K-token one held behind older items: 1.024 × the throughput of the same pool with the 30 s
  bound in the same run, at a better goodput (docs/bench/agentic.md, "Longest first in a lull,
  the overdue included").
* **Bounded queues.** At most `max_queued` items in all bands together, and at most
  ``band_max_queued[band]`` in one band (default: `max_queued`). An arrival that finds its own
  band full is refused. An arrival that finds the total full evicts the **newest** queued item
  of the lowest non-empty band strictly below its own (the item that has waited least loses
  least), or, when there is none, is refused. Evicted and refused items get
  ``Shed(reason="overload")`` (HTTP 429). So, under the default limits, a ``continuing`` turn
  is never shed for overload while lower-band work is queued.
* **TTL.** Each queued item leaves the queue after its TTL (`ttl_s` argument, else the band's
  default, 60 s) with ``Shed(reason="ttl")`` (HTTP 503).
* **Retry-After.** ``ceil((queued at or above the item's band + 1) / drain rate)`` seconds,
  clamped to ``[1, retry_after_max_s]``; the drain rate is dispatches per second over the last
  `drain_window_s` (no dispatch yet: `retry_after_max_s`).
* **Cancellation.** When the task awaiting `admit` is cancelled (client disconnect), its item
  leaves the queue; if it had just been dispatched, its ticket is released. Nothing leaks.
* **Accounting.** Per band: ``submitted == admitted + shed + cancelled + queued`` at all times
  (`stats`). Gauges for Prometheus come from `stats()`.

Time comes from the injected `clock` (seconds, monotonic); with a fake clock, call `poll()`
after moving it (TTL expiry is otherwise driven by an event-loop timer on the real clock).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import structlog
from beamserve.router.flow.fairness import DEFAULT_HALF_LIFE_S, AttainedService
from beamserve.router.flow.pace_hold import PaceHold
from beamserve.router.flow.pieces import PrefillPieces
from beamserve.router.flow.saturation import (
    FlowConfigError,
    SaturationDetector,
    SaturationSignal,
    parse_strict,
)
from beamserve.router.policy.pool_roles import Drain
from beamserve.router.types import BANDS, Band, WorkerLoad
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger(__name__)

ShedReason = Literal["ttl", "overload"]
SHED_REASONS: tuple[ShedReason, ...] = ("ttl", "overload")
Clock = Callable[[], float]


class Shed(Exception):
    """The request was not admitted. `reason`: ``"ttl"`` (waited too long; HTTP 503) or
    ``"overload"`` (queue full or evicted by higher-priority work; HTTP 429). Retry after
    `retry_after_s` seconds (integer ≥ 1, for the `Retry-After` header)."""

    def __init__(self, reason: ShedReason, band: Band, retry_after_s: int, detail: str) -> None:
        super().__init__(f"shed ({reason}) from band {band!r}: {detail}; retry in {retry_after_s}s")
        self.reason: ShedReason = reason
        self.band: Band = band
        self.retry_after_s = retry_after_s
        self.detail = detail

    @property
    def http_status(self) -> int:
        return 503 if self.reason == "ttl" else 429


class FlowConfig(BaseModel):
    """Flow-control parameters.

    | key | default | meaning |
    |---|---|---|
    | `max_queued` | ``5000`` | queued items in all bands together |
    | `band_max_queued` | ``{}`` | per-band queue limit (missing band: `max_queued`) |
    | `ttl_s` | ``60`` | default queue TTL (s) |
    | `band_ttl_s` | ``{}`` | per-band TTL (missing band: `ttl_s`) |
    | `las_half_life_s` | ``60`` | half-life of attained service (s) |
    | `retry_after_max_s` | ``60`` | upper bound of Retry-After (s) |
    | `drain_window_s` | ``30`` | window of the drain-rate estimate (s) |
    | `hold_continuing` | ``false`` | the saturation gate holds continuing turns too |
    | `live_session_s` | ``60`` | a session's request this soon after its last is ``continuing`` |
    |  |  | whatever its prompt (null: only one that extends the last) |
    | `lifo_after_s` | ``2`` | oldest item waited this long: newest first from then (null: off) |
    | `lifo_max_wait_s` | ``30`` | under LIFO, items that waited this long (≤ TTL/2) go first |
    | `prefill_gate_tokens` | ``32768`` | P/D pools: a prefill worker under this takes new work |
    | `prefill_gate_lead` | ``false`` | … not counting the prompt it computes now (its next is |
    |  |  | sent meanwhile, so it does not idle for the router's round trip) |
    | `prefill_sjf_window_s` | ``2`` | … shortest first among items that waited less (null: all) |
    | `prefill_lull_longest_first_s` | ``2`` | … and no new item for this long: the late ones |
    |  |  | longest first, the spill taking the shortest (module docstring) |
    | `prefill_lull_rescue_s` | ``45`` | … before them only those that waited this long (≤ ¾ of |
    |  |  | the TTL; null: `lifo_max_wait_s`, as outside a lull) |
    | `prefill_spill_after_s` | off | P/D pools: a new session held this long may be prefilled |
    |  |  | on a decode worker with room for it (module docstring) |
    | `prefill_spill_max_tokens` | ``49152`` | … whose queued prefill, with it, stays within this |
    | `prefill_spill_margin_s` | ``0.5`` | … and whose users keep this slack beyond that prefill |
    | `prefill_spill_tok_s` | ``null`` | … priced at this rate (null: `pace_hold_prefill_tok_s`) |
    | `prefill_spill_user_tok_s` | ``null`` | … against users kept at this speed (null: |
    |  |  | `pace_hold_user_tok_s`) |
    | `prefill_spill_lull_s` | off | no new item for this long: the spill in a lull (module |
    |  |  | docstring), users kept at `prefill_spill_lull_user_tok_s` (``10``), queued |
    |  |  | prefill within `prefill_spill_lull_max_tokens` (null: the spill's) |
    | `prefill_spill_lull_below_peak` | ``0.9`` | … and only while the pool's active sessions |
    |  |  | are under this share of their peak over `prefill_spill_lull_peak_s` (``60``); |
    |  |  | null: any lull (module docstring) |
    | `pace_hold_*` | off | the pace hold's keys (`beamserve.router.flow.pace_hold`) |
    | `prefill_piece_min_tokens` | off | a continuing turn with this many uncached tokens on its |
    |  |  | decode worker is prefilled in pieces (`beamserve.router.flow.pieces`) |
    | `prefill_piece_tokens` | ``1024`` | … of this many tokens each |
    | `prefill_first_pieces` | on | a new session's first turn prefilled where other sessions |
    |  |  | live is sent in pieces (`beamserve.router.flow.pieces`) … |
    | `prefill_first_piece_tokens` | ``null`` | … of this many tokens (null: the worker's own |
    |  |  | step budget, less room for its decodes) |
    | `prefill_piece_yield_tokens` | off | before each piece, wait while a turn of at most this |
    |  |  | many uncached tokens waits for its first token on that worker … |
    | `prefill_piece_yield_max_s` | ``0.5`` | … for this long at most |

    Config example: ``{max_queued: 2000, band_ttl_s: {sheddable: 10}}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queued: int = Field(default=5000, ge=1)
    band_max_queued: dict[Band, int] = Field(default_factory=dict)
    ttl_s: float = Field(default=60.0, ge=0)
    band_ttl_s: dict[Band, float] = Field(default_factory=dict)
    las_half_life_s: float = Field(default=DEFAULT_HALF_LIFE_S, gt=0)
    retry_after_max_s: int = Field(default=60, ge=1)
    drain_window_s: float = Field(default=30.0, gt=0)
    hold_continuing: bool = False
    live_session_s: float | None = Field(default=60.0, gt=0)
    lifo_after_s: float | None = Field(default=2.0, ge=0)
    lifo_max_wait_s: float = Field(default=30.0, gt=0)
    prefill_gate_tokens: int | None = Field(default=32768, ge=1)
    prefill_gate_lead: bool = False
    prefill_sjf_window_s: float | None = Field(default=2.0, gt=0)
    prefill_lull_longest_first_s: float | None = Field(default=2.0, gt=0)
    prefill_lull_rescue_s: float | None = Field(default=45.0, gt=0)
    prefill_spill_after_s: float | None = Field(default=None, ge=0)
    prefill_spill_max_tokens: int = Field(default=49152, ge=1)
    prefill_spill_margin_s: float = Field(default=0.5, ge=0)
    prefill_spill_tok_s: float | None = Field(default=None, gt=0)
    prefill_spill_user_tok_s: float | None = Field(default=None, gt=0)
    prefill_spill_lull_s: float | None = Field(default=None, gt=0)
    prefill_spill_lull_user_tok_s: float = Field(default=10.0, gt=0)
    prefill_spill_lull_max_tokens: int | None = Field(default=None, ge=1)
    prefill_spill_lull_below_peak: float | None = Field(default=0.9, gt=0, le=1)
    prefill_spill_lull_peak_s: float = Field(default=60.0, gt=0)
    pace_hold_tokens: int | None = Field(default=None, ge=1)
    pace_hold_max_s: float = Field(default=1.5, gt=0)
    pace_hold_user_tok_s: float = Field(default=20.0, gt=0)
    pace_hold_prefill_tok_s: float = Field(default=38000.0, gt=0)
    prefill_piece_min_tokens: int | None = Field(default=None, ge=1)
    prefill_piece_tokens: int = Field(default=1024, ge=1)
    prefill_first_pieces: bool = True
    prefill_first_piece_tokens: int | None = Field(default=None, ge=1)
    prefill_piece_yield_tokens: int | None = Field(default=None, ge=1)
    prefill_piece_yield_max_s: float = Field(default=0.5, gt=0)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> FlowConfig:
        config = parse_strict(cls, values, "flow")
        if config.prefill_spill_lull_s is not None and config.prefill_spill_after_s is None:
            raise FlowConfigError(
                "flow: 'prefill_spill_lull_s' changes the prefill stage's spill in a lull, and "
                "the spill is off: set 'prefill_spill_after_s' too, or remove it"
            )
        after = config.lifo_after_s
        if after is not None and after >= config.lifo_max_wait_s:
            raise FlowConfigError(
                f"flow: 'lifo_after_s' ({after:g}) must be below 'lifo_max_wait_s' "
                f"({config.lifo_max_wait_s:g}): raise the one or lower the other"
            )
        return config

    def pace_hold(self) -> PaceHold | None:
        """The pace hold's rule (`beamserve.router.flow.pace_hold`), None when off."""
        if self.pace_hold_tokens is None:
            return None
        return PaceHold(
            self.pace_hold_tokens,
            self.pace_hold_max_s,
            self.pace_hold_user_tok_s,
            self.pace_hold_prefill_tok_s,
        )

    def prefill_pieces(self) -> PrefillPieces | None:
        """The prefill-in-pieces rule (`beamserve.router.flow.pieces`), None when off."""
        if self.prefill_piece_min_tokens is None:
            return None
        return PrefillPieces(self.prefill_piece_min_tokens, self.prefill_piece_tokens)

    def prefill_spill(self) -> PrefillSpill | None:
        """The spill rule of the prefill stage (module docstring), None when off."""
        if self.prefill_spill_after_s is None:
            return None
        return PrefillSpill(
            self.prefill_spill_after_s,
            self.prefill_spill_max_tokens,
            self.prefill_spill_margin_s,
            self.prefill_spill_user_tok_s or self.pace_hold_user_tok_s,
            self.prefill_spill_tok_s or self.pace_hold_prefill_tok_s,
            self.prefill_spill_lull_s,
            self.prefill_spill_lull_user_tok_s,
            self.prefill_spill_lull_max_tokens or self.prefill_spill_max_tokens,
        )

    def band_limit(self, band: Band) -> int:
        return self.band_max_queued.get(band, self.max_queued)

    def band_ttl(self, band: Band) -> float:
        return self.band_ttl_s.get(band, self.ttl_s)


@dataclass(frozen=True, slots=True)
class FlowStats:
    """A snapshot of the controller's gauges and counters."""

    queued: dict[Band, int]
    submitted: dict[Band, int]
    admitted: dict[Band, int]
    cancelled: dict[Band, int]
    shed: dict[tuple[Band, ShedReason], int]
    in_flight: int
    in_flight_tokens: int
    saturated: bool
    room_tokens: int
    drain_rate_per_s: float

    def shed_in(self, band: Band) -> int:
        return sum(n for (b, _), n in self.shed.items() if b == band)


_QUEUED, _ADMITTED, _SHED, _CANCELLED = "queued", "admitted", "shed", "cancelled"


@dataclass(eq=False, slots=True)
class _Item:
    seq: int
    band: Band
    tenant: str
    cost: int
    enqueued_at: float
    deadline: float
    future: asyncio.Future[Ticket]
    state: str = _QUEUED
    ticket: Ticket | None = field(default=None)


@dataclass(frozen=True, slots=True)
class PrefillSpill:
    """The spill rule's values, as `FlowConfig.prefill_spill` gives them: an item held at the
    prefill stage `after_s` or longer may go to a decode worker whose queued prefill, with
    it, stays within `max_tokens` and whose streaming users keep `margin_s` of slack beyond
    that prefill (at `user_tok_s` each; prefill priced at `prefill_tok_s`)."""

    after_s: float
    max_tokens: int
    margin_s: float
    user_tok_s: float
    prefill_tok_s: float
    lull_s: float | None
    lull_user_tok_s: float
    lull_max_tokens: int


SPILL_POLL_S = 0.05  # while a spill waits for a decode worker's room, how often to look
# (cost of the item, tokens already spilled to each worker and not routed yet, whether new items
# are in a lull: `PrefillSpill.lull_s`) → the decode worker that can prefill it itself now, or None
SpillTarget = Callable[[int, Mapping[str, int], bool], str | None]


@dataclass(frozen=True, slots=True)
class PrefillStage:
    """The prefill workers of a disaggregated pool, as the gate sees them (module docstring,
    "The prefill stage"): `loads()` gives their current loads (an empty list: no stage now);
    items cheaper than `min_tokens` are not split by the P/D rule and pass ungated. `spill`
    (None: never) finds a decode worker that can prefill a held item itself
    (`FlowConfig.prefill_spill`)."""

    loads: Callable[[], list[WorkerLoad]]
    min_tokens: int = 0
    spill: SpillTarget | None = None


class Ticket:
    """Permission to dispatch one request. Release it exactly once when the request ends
    (repeat calls do nothing); ``async with ticket:`` releases on exit with `cost_tokens` as
    the service unless `release` was called inside the block."""

    def __init__(
        self, controller: FlowController, band: Band, tenant: str, cost_tokens: int, waited_s: float
    ) -> None:
        self._controller = controller
        self.band: Band = band
        self.tenant = tenant
        self.cost_tokens = cost_tokens
        self.waited_s = waited_s
        self.released = False
        # The prefill stage spilled it (module docstring): the decode worker that prefills it
        self.spill_to: str | None = None
        self.spill_lull = False  # … spilled by the rule of a lull in new items

    def routed(self) -> None:
        """The request was routed and its load booked (`RoutingCore.route` calls this): the
        prefill stage now sees it in the workers' loads."""
        self._controller._unrouted.pop(self, None)
        self._controller._spilling.pop(self, None)

    def release(self, service_tokens: int | None = None) -> None:
        """Return this request's room; credit its tenant `service_tokens` (default:
        `cost_tokens`; see `fairness.service_tokens`)."""
        if self.released:
            return
        self.released = True
        self._controller._unrouted.pop(self, None)
        self._controller._spilling.pop(self, None)
        served = self.cost_tokens if service_tokens is None else service_tokens
        self._controller._on_release(self, served)

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class FlowController:
    """Admission queue in front of routing (contract in the module docstring)."""

    def __init__(
        self,
        config: FlowConfig | None = None,
        *,
        saturation: SaturationSignal | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config or FlowConfig()
        self.saturation: SaturationSignal = saturation or SaturationDetector()
        self._clock = clock
        self._service = AttainedService(self.config.las_half_life_s)
        self._queues: dict[Band, dict[str, deque[_Item]]] = {b: {} for b in BANDS}
        self._queued: dict[Band, int] = dict.fromkeys(BANDS, 0)
        self._submitted: dict[Band, int] = dict.fromkeys(BANDS, 0)
        self._last_submit: dict[Band, float] = dict.fromkeys(BANDS, -math.inf)
        self._admitted: dict[Band, int] = dict.fromkeys(BANDS, 0)
        self._cancelled: dict[Band, int] = dict.fromkeys(BANDS, 0)
        self._shed: dict[tuple[Band, ShedReason], int] = {
            (b, r): 0 for b in BANDS for r in SHED_REASONS
        }
        self._deadlines: list[tuple[float, int, _Item]] = []
        self._seq = itertools.count()
        self._in_flight = 0
        self._in_flight_tokens = 0
        self._room = 0
        self._was_saturated = False
        self._dispatches: deque[float] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        # Room shared between router replicas (`beamserve.router.sync`; module docstring,
        # "Several replicas"): offer room this replica cannot use; hear its continuing queue.
        self.on_spare_room: Callable[[int], int] | None = None
        self.on_continuing_queued: Callable[[int], None] | None = None
        # Whether other replicas have requests in flight or continuing turns queued: the
        # saturated gate's "nothing in flight" exceptions are about the pool, not this replica.
        self.peers_busy: Callable[[], bool] | None = None
        # The peers' banked room (peer → tokens it could lend now, most first), how to claim
        # some of it, and where to report this replica's own banked room.
        self.peer_room: Callable[[], list[tuple[str, int]]] | None = None
        self.on_borrow: Callable[[str, int], None] | None = None
        self.on_room: Callable[[int], None] | None = None
        self._reported_room = 0
        # Since when the next item of a lower band waits here (`on_head`), and how many peers'
        # next items of a band wait since before a time (`older_peers`).
        self.on_head: Callable[[Band, float | None], None] | None = None
        self.older_peers: Callable[[Band, float], int] | None = None
        self._reported_heads: dict[Band, float | None] = {}
        self._heads_stale = False  # a queue or a tenant's service changed since the report
        # The prefill stage of a P/D pool (module docstring), and the costs of the items it let
        # through that are not routed yet (their load is not in the workers' books).
        self.prefill_stage: PrefillStage | None = None
        self._unrouted: dict[Ticket, int] = {}
        self._spill = self.config.prefill_spill()
        self._spilling: dict[Ticket, tuple[str, int]] = {}  # spilled, not routed: worker, cost
        self._spill_check_at = math.inf  # when `_spill_held` wants to look again
        self.spilled = 0  # items the stage spilled to a decode worker (a counter)
        self.spill_yields = 0  # spill checks that yielded to an overdue short item (a counter)
        self.lull_spilled = 0  # of `spilled`, those spilled in a lull of new items (a counter)
        # The pool's active sessions now (`LoadBook.active_sessions`; None: unknown, any lull
        # counts), and their peak over `prefill_spill_lull_peak_s`: (time, count), the counts
        # falling (module docstring, "The spill in a lull").
        self.active_sessions: Callable[[], int] | None = None
        self._active_peaks: deque[tuple[float, int]] = deque()
        # Sample that peak at every admission for a reader other than the spill in a lull
        # (a draining pool's `drain_state`).
        self.track_active_peak = False

    # --- public --------------------------------------------------------------------------------

    async def admit(
        self, band: Band, tenant: str, cost_tokens: int, ttl_s: float | None = None
    ) -> Ticket:
        """Wait until the request may be dispatched. Raises `Shed` (refused, evicted or expired)
        and `CancelledError` (caller cancelled; nothing stays queued)."""
        if band not in BANDS:
            raise FlowConfigError(f"unknown band {band!r}; valid bands: {', '.join(BANDS)}")
        if cost_tokens < 0:
            raise ValueError(f"cost_tokens must be ≥ 0, not {cost_tokens}")
        self._loop = asyncio.get_running_loop()
        now = self._clock()
        ttl = self.config.band_ttl(band) if ttl_s is None else ttl_s
        item = _Item(
            seq=next(self._seq),
            band=band,
            tenant=tenant,
            cost=cost_tokens,
            enqueued_at=now,
            deadline=now + ttl,
            future=self._loop.create_future(),
        )
        self._submitted[band] += 1
        self._last_submit[band] = now
        if self.track_active_peak or (self._spill is not None and self._spill.lull_s is not None):
            self._active_peak(now)
        self._enqueue(item, now)  # raises Shed when refused
        self._pump()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._on_caller_cancelled(item)
            raise

    def poll(self) -> None:
        """Re-evaluate now: expire TTLs and dispatch what the saturation signal allows. Call
        after a new saturation snapshot, or after moving a fake clock."""
        self._pump()

    def observe_pool(self, loads: list[WorkerLoad]) -> None:
        """Feed the built-in `SaturationDetector` a pool snapshot, then `poll`."""
        if not isinstance(self.saturation, SaturationDetector):
            raise TypeError("observe_pool needs the built-in SaturationDetector as `saturation`")
        self.saturation.observe(loads, self._clock())
        self._pump()

    def retry_after_s(self, band: Band) -> int:
        """Seconds a client shed from `band` now should wait (see the module docstring)."""
        ahead = sum(self._queued[b] for b in BANDS[: BANDS.index(band) + 1])
        rate = self._drain_rate(self._clock())
        cap = self.config.retry_after_max_s
        if rate <= 0:
            return cap
        return max(1, min(cap, math.ceil((ahead + 1) / rate)))

    @property
    def waiting(self) -> int:
        """Requests queued now, every band."""
        return sum(self._queued.values())

    def drain_state(self, quiet_s: float, below_peak: float | None) -> Drain:
        """What this controller says of a pool's drain (`pool_roles`, "The drain"): ``busy``
        while a new session arrived less than `quiet_s` ago; ``ready`` once none has for that
        long, none of the bands below ``continuing`` has anything queued or let through and
        not routed yet, and (with `below_peak` and an `active_sessions` source) the pool's
        active sessions are under that share of their peak over `prefill_spill_lull_peak_s`;
        ``hold`` otherwise. Sampling the peak needs `track_active_peak`."""
        now = self._clock()
        if not self._quiet("new", now, quiet_s):
            return "busy"
        if self._queued["new"] or self._queued["sheddable"] or self._unrouted:
            return "hold"
        if below_peak is not None and self.active_sessions is not None:
            active, peak = self._active_peak(now)
            if not active < below_peak * peak:
                return "hold"
        return "ready"

    def stats(self) -> FlowStats:
        now = self._clock()
        return FlowStats(
            queued=dict(self._queued),
            submitted=dict(self._submitted),
            admitted=dict(self._admitted),
            cancelled=dict(self._cancelled),
            shed=dict(self._shed),
            in_flight=self._in_flight,
            in_flight_tokens=self._in_flight_tokens,
            saturated=self.saturation.saturated(now),
            room_tokens=self._room,
            drain_rate_per_s=self._drain_rate(now),
        )

    def close(self) -> None:
        """Stop the TTL timer (queued callers keep waiting until cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    # --- queue -----------------------------------------------------------------------------------

    def _enqueue(self, item: _Item, now: float) -> None:
        band = item.band
        if self._queued[band] >= self.config.band_limit(band):
            self._refuse(item, f"band {band!r} queue full ({self._queued[band]} queued)")
        if sum(self._queued.values()) >= self.config.max_queued:
            victim = self._eviction_victim(below=band)
            if victim is None:
                self._refuse(item, f"queue full ({self.config.max_queued} queued)")
            else:
                self._drop(victim, _SHED)
                self._shed_item(victim, "overload", f"evicted by a {band!r} arrival")
        self._queues[band].setdefault(item.tenant, deque()).append(item)
        self._queued[band] += 1
        self._heads_stale = True
        heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
        if band == "continuing" and self.on_continuing_queued is not None:
            self.on_continuing_queued(self._queued[band])

    def _refuse(self, item: _Item, detail: str) -> None:
        self._shed[(item.band, "overload")] += 1
        log.info("flow.shed", band=item.band, tenant=item.tenant, reason="overload", detail=detail)
        raise Shed("overload", item.band, self.retry_after_s(item.band), detail)

    def _eviction_victim(self, below: Band) -> _Item | None:
        """The newest queued item of the lowest non-empty band strictly below `below`."""
        for band in reversed(BANDS[BANDS.index(below) + 1 :]):
            tails = [q[-1] for q in self._queues[band].values() if q]
            if tails:
                return max(tails, key=lambda it: it.seq)
        return None

    def _drop(self, item: _Item, state: str) -> None:
        """Take a queued item out of its queue (its deadline entry is skipped lazily)."""
        queue = self._queues[item.band][item.tenant]
        if queue[-1] is item:  # the newest: taken by adaptive LIFO, evicted
            queue.pop()
        else:
            queue.remove(item)
        if not queue:
            del self._queues[item.band][item.tenant]
        self._queued[item.band] -= 1
        self._heads_stale = True
        item.state = state
        if item.band == "continuing" and self.on_continuing_queued is not None:
            self.on_continuing_queued(self._queued["continuing"])

    def _shed_item(self, item: _Item, reason: ShedReason, detail: str) -> None:
        self._shed[(item.band, reason)] += 1
        log.info("flow.shed", band=item.band, tenant=item.tenant, reason=reason, detail=detail)
        exc = Shed(reason, item.band, self.retry_after_s(item.band), detail)
        if not item.future.done():
            item.future.set_exception(exc)

    def _next_item(self, now: float, skip: frozenset[bool] = frozenset()) -> _Item | None:
        """Head of the highest non-empty band: least-attained-service tenant, then oldest.
        `skip`: leave out the items whose `_staged` value is in it (their gate is shut)."""
        for band in BANDS:
            if self._queues[band] and (item := self._next_in(band, now, skip)) is not None:
                return item
        return None

    def _next_in(self, band: Band, now: float, skip: frozenset[bool] = frozenset()) -> _Item | None:
        """The item of `band` that goes first (None: none queued): the least-attained-service
        tenant's oldest item, or in a congested band (`_lifo`) its newest; with `skip`, among
        the items whose `_staged` value is not in it."""
        tenants = self._queues[band]
        gating = band != "continuing" and self._stage_gating()
        if skip:
            tenants = {
                t: kept
                for t, q in tenants.items()
                if (kept := deque(it for it in q if self._staged(it, gating) not in skip))
            }
        if not tenants:
            return None
        if gating:
            return self._shortest([it for q in tenants.values() for it in q], band, now)
        if self._lifo(band, now):
            tenant = min(tenants, key=lambda t: (self._service.value(t, now), -tenants[t][-1].seq))
            return tenants[tenant][-1]
        tenant = min(tenants, key=lambda t: (self._service.value(t, now), tenants[t][0].seq))
        return tenants[tenant][0]

    def _staged(self, item: _Item, gating: bool | None = None) -> bool:
        """Is `item` gated by the prefill stage alone: below ``continuing``, at least the
        stage's `min_tokens`, with the stage gating (module docstring, "The prefill stage";
        `gating`: `_stage_gating()` when the caller has it already)."""
        if item.band == "continuing" or self.prefill_stage is None:
            return False
        if item.cost < self.prefill_stage.min_tokens:
            return False
        return self._stage_gating() if gating is None else gating

    def _stage_gating(self) -> bool:
        """A prefill stage is set, has workers, and the gate is on."""
        stage = self.prefill_stage
        if stage is None or self.config.prefill_gate_tokens is None:
            return False
        return bool(stage.loads())

    def _rescue_s(self, band: Band) -> float:
        """How long an item of `band` waits before it is overdue: `lifo_max_wait_s`, or half
        the band's TTL when that is less (module docstring, "Adaptive LIFO")."""
        return min(self.config.lifo_max_wait_s, self.config.band_ttl(band) / 2)

    def _shortest(self, items: list[_Item], band: Band, now: float) -> _Item:
        """Shortest first among `items` of `band` (module docstring, "The prefill stage"):
        items that waited `lifo_max_wait_s` (or half the TTL) first, oldest first; then the
        cheapest of those that waited less than `prefill_sjf_window_s`, oldest among equals;
        then the oldest."""
        quiet = self._quiet(band, now, self.config.prefill_lull_longest_first_s)
        rescue = self._rescue_s(band)
        if quiet and self.config.prefill_lull_rescue_s is not None:
            # no arrivals: nothing can starve, only run into its TTL ("Longest first in a lull")
            lull = min(self.config.prefill_lull_rescue_s, 0.75 * self.config.band_ttl(band))
            rescue = max(rescue, lull)
        overdue = [it for it in items if now - it.enqueued_at >= rescue]
        if overdue:
            return min(overdue, key=lambda it: it.seq)
        window = self.config.prefill_sjf_window_s
        fresh = items if window is None else [it for it in items if now - it.enqueued_at < window]
        if fresh:
            return min(fresh, key=lambda it: (it.cost, it.seq))
        if quiet:
            # the short (local) ones oldest first, then the stage's longest first

            def longest(it: _Item) -> tuple[bool, int, int]:
                staged = self._staged(it, True)
                return (staged, -it.cost if staged else 0, it.seq)

            return min(items, key=longest)
        return min(items, key=lambda it: it.seq)

    def _quiet(self, band: Band, now: float, seconds: float | None) -> bool:
        """No new item of `band` has arrived for `seconds` (None: never quiet) — a lull of new
        sessions (module docstring, "The spill in a lull", "Longest first in a lull")."""
        return seconds is not None and now - self._last_submit[band] >= seconds

    def _stage_open(self) -> bool:
        """Some healthy prefill worker has room under `prefill_gate_tokens` (with
        `prefill_gate_lead`, the prompt it computes now not counted), after the items let
        through but not routed yet each take the room of the worker with the most."""
        stage, gate = self.prefill_stage, self.config.prefill_gate_tokens
        if stage is None or gate is None:
            return True
        lead = self.config.prefill_gate_lead
        rooms = sorted(
            (
                gate - w.effective_prefill_tokens + (w.head_prefill_tokens if lead else 0)
                for w in stage.loads()
                if w.healthy
            ),
            reverse=True,
        )
        for _cost in self._unrouted.values():
            if not rooms:
                break
            rooms.pop(0)  # an unrouted item fills the roomiest worker (it would go there)
        return any(r > 0 for r in rooms)

    def _spill_held(self, band: Band, now: float) -> None:
        """While the stage is closed: dispatch the held items of `band` that waited
        `PrefillSpill.after_s` or longer, in the stage's order, each marked with the decode
        worker that can prefill it itself now (module docstring, "The prefill stage"); stop
        at the first that none can take."""
        rule, stage = self._spill, self.prefill_stage
        if rule is None or stage is None or stage.spill is None:
            return
        window = self.config.prefill_sjf_window_s
        rescue = self._rescue_s(band)
        overdue = any(
            it.cost < stage.min_tokens
            and now - it.enqueued_at >= rescue
            and not it.future.cancelled()
            for q in self._queues[band].values()
            for it in q
        )
        if overdue:
            # A short new session overdue at the saturation gate waits for the decode workers'
            # room; a spill would take that room past the gate and starve it to its TTL. Yield
            # until it has gone (module docstring, "The spill").
            self.spill_yields += 1
            self._spill_check_at = min(self._spill_check_at, now + SPILL_POLL_S)
            return
        lull = self._lull(band, now)
        # in a lull the late ones go shortest first too: the long ones are the prefill workers'
        # (module docstring, "Longest first in a lull")
        by_seq = not self._quiet(band, now, self.config.prefill_lull_longest_first_s)

        def order(it: _Item) -> tuple[bool, int]:
            late = window is None or now - it.enqueued_at >= window
            return (late, it.seq if late and by_seq else it.cost)

        while True:
            held = [
                it
                for q in self._queues[band].values()
                for it in q
                if it.cost >= stage.min_tokens and not it.future.cancelled()
            ]
            items = [it for it in held if now - it.enqueued_at >= rule.after_s]
            if not items:
                # look again when the next one has waited long enough
                if held:
                    first = min(it.enqueued_at for it in held) + rule.after_s
                    self._spill_check_at = min(self._spill_check_at, first)
                return

            item = min(items, key=order)
            pending: dict[str, int] = {}
            for worker, cost in self._spilling.values():
                pending[worker] = pending.get(worker, 0) + cost
            target = stage.spill(item.cost, pending, lull)
            if target is None:
                # the decode workers' users may gain slack as they stream: look again soon
                self._spill_check_at = min(self._spill_check_at, now + SPILL_POLL_S)
                return
            self._dispatch(item, now)
            if item.ticket is not None:
                item.ticket.spill_to = target
                item.ticket.spill_lull = lull
                self._spilling[item.ticket] = (target, item.cost)
            self.spilled += 1
            self.lull_spilled += lull

    def _lull(self, band: Band, now: float) -> bool:
        """No new item of `band` has arrived for the spill's `lull_s`, and the pool is draining
        (module docstring, "The spill in a lull")."""
        rule = self._spill
        if rule is None or not self._quiet(band, now, rule.lull_s):
            return False
        share = self.config.prefill_spill_lull_below_peak
        if share is None or self.active_sessions is None:
            return True
        active, peak = self._active_peak(now)
        return active < share * peak

    def _active_peak(self, now: float) -> tuple[int, int]:
        """Sample the pool's active sessions: (their count now, their peak over
        `prefill_spill_lull_peak_s`); (0, 0) without a source."""
        if self.active_sessions is None:
            return 0, 0
        active = self.active_sessions()
        peaks = self._active_peaks
        while peaks and peaks[-1][1] <= active:
            peaks.pop()
        peaks.append((now, active))
        horizon = now - self.config.prefill_spill_lull_peak_s
        while peaks[0][0] < horizon:
            peaks.popleft()
        return active, peaks[0][1]

    def _lifo(self, band: Band, now: float) -> bool:
        """Adaptive LIFO (module docstring): `band` is below ``continuing`` and its oldest
        item has waited at least `lifo_after_s` but less than `lifo_max_wait_s` (or half the
        band's TTL, when that is less)."""
        after = self.config.lifo_after_s
        if after is None or band == "continuing":
            return False
        oldest = min(q[0].enqueued_at for q in self._queues[band].values())
        rescue = self._rescue_s(band)
        return after <= now - oldest < rescue

    # --- dispatch --------------------------------------------------------------------------------

    def _update_saturation(self, now: float) -> bool:
        saturated = self.saturation.saturated(now)
        if saturated and not self._was_saturated:
            self._room = 0  # room is what completions free *during* this saturated spell
        self._was_saturated = saturated
        return saturated

    def _pump(self) -> None:
        now = self._clock()
        self._expire(now)
        saturated = self._update_saturation(now)
        admits = getattr(self.saturation, "admits", None)
        levelled = admits is not None  # a measured level: room is for continuing turns
        admitted = getattr(self.saturation, "admitted", None)
        peers_busy = self.peers_busy
        held = self.config.hold_continuing
        # Two gates, two kinds of item: a staged item waits only for the prefill stage, any
        # other for the saturation gate and the pool's pace. One shut gate stops its own kind
        # (`skip`), not the other: a small first turn held for the decode workers' room must
        # not keep the prefill workers idle, nor a long one held for them the decode workers.
        skip: frozenset[bool] = frozenset()
        while (item := self._next_item(now, skip)) is not None:
            if item.future.cancelled():  # caller gone; its handler has not run yet
                self._drop(item, _CANCELLED)
                self._cancelled[item.band] += 1
                continue
            staged = self._staged(item)
            if staged and not self._stage_open():
                self._spill_held(item.band, now)
                skip |= {True}  # the prefill workers are busy: shortest first when one has room
                continue
            if item.band == "continuing" and not held:
                pass  # never held by the gate (module docstring, "Saturation gate")
            elif staged:
                pass  # its prefill runs on a prefill worker: the stage is its gate
            elif saturated:
                busy = bool(self._in_flight) or (peers_busy is not None and peers_busy())
                if levelled and item.band != "continuing" and busy:
                    skip |= {False}
                    continue
                if item.cost <= self._room or (self._room > 0 and not busy):
                    self._room = max(self._room - item.cost, 0)
                elif not self._borrow(item.cost):
                    skip |= {False}
                    continue
            elif admits is not None and not admits(item.cost):
                skip |= {False}  # the backlog goes at the pool's pace: next snapshot or release
                continue
            elif (
                admits is not None
                and item.band != "continuing"
                and self.older_peers is not None
                and (ahead := self.older_peers(item.band, item.enqueued_at))
                and not admits(item.cost * (ahead + 1), exempt_first=False)
            ):
                skip |= {False}  # older sessions queued at peers go first (module docstring)
                continue
            self._dispatch(item, now)
            if staged and item.ticket is not None:
                self._unrouted[item.ticket] = item.cost
            if admitted is not None:
                admitted(item.cost)
        self._arm_timer()
        if self.on_head is not None:
            self._report_heads(now)
        banked = self._room if saturated else 0  # outside a spell there is nothing to lend
        if self.on_room is not None and banked != self._reported_room:
            self._reported_room = banked
            self.on_room(banked)

    def _report_heads(self, now: float) -> None:
        if not self._heads_stale:  # the heads only move when a queue or a charge changes
            return
        self._heads_stale = False
        for band in BANDS[1:]:
            head = self._next_in(band, now)
            since = None if head is None else head.enqueued_at
            if self._reported_heads.get(band) != since:
                self._reported_heads[band] = since
                self.on_head(band, since)  # type: ignore[misc]

    def _borrow(self, cost: int) -> bool:
        """Cover `cost` with the own room and the peers' banked room, if together they do
        (module docstring, "Several replicas"); False: nothing is taken."""
        peer_room, claim = self.peer_room, self.on_borrow
        if peer_room is None or claim is None:
            return False
        need = cost - max(self._room, 0)
        offers = peer_room()
        if sum(tokens for _peer, tokens in offers) < need:
            return False
        self._room = min(self._room, 0)  # the own part first (a debt stays a debt)
        for peer, tokens in offers:
            part = min(tokens, need)
            claim(peer, part)
            need -= part
            if need <= 0:
                break
        return True

    def _dispatch(self, item: _Item, now: float) -> None:
        self._drop(item, _ADMITTED)
        ticket = Ticket(self, item.band, item.tenant, item.cost, now - item.enqueued_at)
        item.ticket = ticket
        self._admitted[item.band] += 1
        self._in_flight += 1
        self._in_flight_tokens += item.cost
        self._service.charge(item.tenant, item.cost, now)
        self._dispatches.append(now)
        item.future.set_result(ticket)

    def _on_release(self, ticket: Ticket, service_tokens: int) -> None:
        now = self._clock()
        self._in_flight -= 1
        self._in_flight_tokens -= ticket.cost_tokens
        self._service.charge(ticket.tenant, service_tokens - ticket.cost_tokens, now)
        self._heads_stale = True  # the charge may reorder a band's tenants
        released = getattr(self.saturation, "released", None)
        if released is not None:
            released(ticket.cost_tokens)
        if self._update_saturation(now):
            cost = ticket.cost_tokens
            spare = self.on_spare_room
            # Handed to the peers whose continuing turns wait: what they got leaves this room.
            given = spare(cost) if spare is not None else 0
            self._room += cost - min(max(given, 0), cost)
        self._pump()

    def grant_room(self, tokens: int) -> None:
        """Room another replica freed and could not use (`on_spare_room` there): while this
        replica is saturated it serves the queue as room freed here would; otherwise the gate
        is open anyway and the grant is dropped."""
        if tokens > 0 and self._update_saturation(self._clock()):
            self._room += tokens
            self._pump()

    def lend_room(self, tokens: int) -> None:
        """Peers borrowed `tokens` of this replica's banked room (`on_borrow` there): it
        leaves the room here, below zero if two borrowed the same room."""
        if tokens > 0:
            self._room -= tokens
            self._pump()

    def _on_caller_cancelled(self, item: _Item) -> None:
        if item.state == _QUEUED:
            self._drop(item, _CANCELLED)
            self._cancelled[item.band] += 1
        elif item.state == _ADMITTED and item.ticket is not None:
            item.ticket.release(0)  # dispatched, but the caller never got the ticket
        elif item.future.done() and not item.future.cancelled():
            item.future.exception()  # shed: mark the exception retrieved

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self._deadlines)
            if item.state != _QUEUED:
                continue
            self._drop(item, _SHED)
            if item.future.cancelled():
                item.state = _CANCELLED
                self._cancelled[item.band] += 1
                continue
            self._shed_item(item, "ttl", f"waited {now - item.enqueued_at:.1f}s in the queue")

    def _drain_rate(self, now: float) -> float:
        window = self.config.drain_window_s
        while self._dispatches and self._dispatches[0] < now - window:
            self._dispatches.popleft()
        return len(self._dispatches) / window

    def _arm_timer(self) -> None:
        """Keep one event-loop timer at the earliest live TTL deadline (or the prefill
        stage's next spill check, when sooner)."""
        while self._deadlines and self._deadlines[0][2].state != _QUEUED:
            heapq.heappop(self._deadlines)
        if self._loop is None or self._loop.is_closed():
            return
        deadline = self._deadlines[0][0] if self._deadlines else math.inf
        deadline = min(deadline, self._spill_check_at)
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline < math.inf:
            delay = max(deadline - self._clock(), 0.0) + 1e-3
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._spill_check_at = math.inf
        self._pump()
