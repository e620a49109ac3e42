#!/usr/bin/env python3
"""What any router could get at the knee: the HTTP bench's closed loop on virtual time, with
many placement and admission strategies in front of the same simulated workers.

    .venv/bin/python scripts/knee-search.py [--concurrency 64] [--sessions 192] [--max-turns 8]
        [--workers 4] [--budget N] [--seeds 3] [--strategies a,b,…] [--json FILE]

Workload: the sessions `beamserve bench agentic` replays, selected and scaled the same way
(`--token-scale 0.25`, 64 output tokens, think times × 0.02 capped at 2 s), played by
`--concurrency` agents that each take the next session when theirs ends, as the bench's
players do. Workers: `--workers` `SimEngine`s of the `h200-bf16-tp8` profile (the engine
behind `beamserve worker --engine sim`, its scheduler, prefix cache and latency model) on one
virtual clock, so a run of 1,419 requests takes seconds instead of minutes. Goodput counts
what the bench counts: TTFT ≤ 2 s and output tokens over (end − first token) ≥ 20 tok/s.

A strategy sees the whole state of every engine and the progress of every request in flight
(more than a router behind HTTP sees), and it knows each answer's length (the bench's
`max_tokens` is exactly what the sim generates). It may place a request, hold it (it is
offered again every 50 ms and after every finished request), or send it in another
shape (prefix priming, a prefill/decode split with the sim's own KV-transfer time). Sessions
stay on the worker they started on (the cache-hit ratio every row reaches is the workload's
0.845), so the strategies differ in where and when new sessions' long first prompts are
prefilled: 77 % of the prefill at 64 agents.

Families (`--strategies`, default all), by where a new session's first turn goes:
- `least-queued`: the worker with the fewest queued prefill tokens (a cache-aware gateway's
  choice when no worker holds the prefix);
- `round-robin`: the next worker in turn; `least-sessions`: the fewest active sessions;
  `least-inflight`: the fewest requests in flight;
- `harm-A[-rR]`: the least of the queued prefill's time plus A × its own prefill time for
  every request in flight there (and R × for every session of the worker between turns): the
  users its prefill would slow;
- `split-idle-Xk-mM`: homed on the worker with the fewest active sessions, but a first turn
  of X or more tokens is prefilled on the worker with the least in flight (requests, and
  queued prefill in 8K steps) when that is M less busy, its KV then handed over (a colocated
  pool's P/D split for one turn);
- `pace`, `pace-hold-T`: the worker where its prefill (and what is queued there) pushes the
  fewest decoding users under 20 tok/s; `-hold-T`: wait up to T s while every worker would;
  `pace-balanced-hold-1`: the same among workers within 2 active sessions of the fewest;
- `gate-X`, `gate-lifo-X`: least-queued, held while every worker has over X queued prefill
  tokens (newest first with `lifo`);
- `prime-K`, `pace-hold-1-prime-K`, `least-sessions-prime-K`: the prompt prefilled first as
  prefixes of K, 2K, … tokens (`max_tokens` 1 each, one after the other), then the request
  itself;
- `pd-1p3d`, `pd-2p2d`: prefilled on 1 (2) dedicated workers, decoded on the others after
  the KV transfer; `pd-2p2d-sjf-Xk`: the same, first turns held in the router while every
  prefill worker has X or more tokens queued, and released shortest first (what the router's
  flow controller does for a P/D pool: `FlowConfig.prefill_gate_tokens`);
- `pd-1p-overflow`: prefilled on 1 dedicated worker while its queue stays under 60K tokens,
  else on its decode worker;
- `pd-2p2d-legbooks-32k-local-8k`: the HTTP router's pool since 2026-12-05 (the gate reads
  its books, each prefill released when its leg answers; prompts under 8,192 tokens stay
  local); `…-split-continuing-8k`: its later turns with 8K+ new tokens split too (the rule
  before `keep_warm_local`); `…-cont-sticky-X`: later turns with X+ new tokens split to the
  prefill worker that prefilled the session's first turn; `…-cont-pace-hold-1024-1.5`: later
  turns with 1,024+ new tokens wait up to 1.5 s while their prefill would push a user of
  their decode worker under 20 tok/s (while their own prefill would still end within 1.5 s);
  `pd-2p2d-legbooks-window-2`: the HTTP router's pool since the afternoon of 2026-12-05 —
  that pace hold, and the held first turns shortest first only while they waited under 2 s,
  the others after them, oldest first.

Three rows are not router strategies but ceilings: `ceiling-first-turns-elsewhere` gives first
turns' prefill to hardware outside the pool (a cold prefill's time on an idle worker, then
the KV arrives): what the pool does if none of its time goes to new sessions' prompts.
`attribution-free-continuing` / `-small-first` do the same for the decode workers' own
prefills in `pd-2p2d-legbooks-32k-local-8k` (later turns' new parts / first turns under
8,192 tokens): what those prefills cost the pool.

Each strategy runs `--seeds` times: seed 0 plays the trace as it is, seed k > 0 adds
U(0, 20 ms) to every think time (the run-to-run spread of a real machine). The table shows
the mean goodput, its range, and the ratio to `least-queued`.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from beamserve.kvwire.codec import ApproxCodec
from beamserve.router.bench.agentic_workload import (
    PromptBuilder,
    Session,
    block_tokens_for,
    default_trace_dir,
    load_sessions,
)
from beamserve.workers.sim.clock import VirtualClock
from beamserve.workers.sim.config import EngineConfig
from beamserve.workers.sim.engine import SimEngine
from beamserve.workers.sim.latency import LatencyModel, StepWork, causal_keys
from beamserve.workers.sim.profiles import get_profile
from beamserve.workers.sim.request import RemotePrefill, RequestUpdate, SimRequest

SLO_TTFT_S = 2.0
SLO_TOK_S = 20.0
PAGE = 64


def page_hashes(namespace: str, ids: Sequence[int], ids_per_page: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full pages: page k is keyed by the session and every
    trace block up to its end, so two prompts share page k iff they share those blocks."""
    out: list[int] = []
    h = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    for k in range(len(ids) // ids_per_page):
        m = hashlib.blake2b(h, digest_size=8)
        m.update(repr(tuple(ids[k * ids_per_page : (k + 1) * ids_per_page])).encode())
        h = m.digest()
        out.append(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return tuple(out)


@dataclass(slots=True)
class Rec:
    """One request of the replay (virtual seconds)."""

    session: str
    turn: int
    prompt: int
    out: int
    sent: float
    req: SimRequest
    worker: str | None = None
    dispatched: float | None = None
    first: float | None = None
    end: float | None = None
    cached: int = 0
    ntok: int = 0

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def late(self) -> bool:
        return self.first is None or self.ttft > SLO_TTFT_S

    @property
    def good(self) -> bool:
        if self.late or self.end is None:
            return False
        assert self.first is not None
        span = self.end - self.first
        return self.ntok < 2 or span <= 0 or self.ntok / span >= SLO_TOK_S


class Strategy:
    """Where and when a request goes. `place` returns a worker, or None to hold it."""

    name = "base"

    def place(self, h: Loop, rec: Rec) -> str | None:
        home = h.home.get(rec.session)
        return home if home is not None else self.place_new(h, rec)

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        raise NotImplementedError

    def order(self, held: list[Rec]) -> list[Rec]:
        return held

    def send(self, h: Loop, worker: str, rec: Rec) -> None:
        h.submit(worker, rec, rec.req)


class LeastQueued(Strategy):
    name = "least-queued"

    def __init__(self, workers: Sequence[str] | None = None) -> None:
        self.workers = workers

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        pool = self.workers or list(h.engines)
        return min(pool, key=lambda w: (h.queued(w), len(h.inflight[w])))


class RoundRobin(Strategy):
    name = "round-robin"

    def __init__(self) -> None:
        self.i = 0

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        self.i += 1
        return list(h.engines)[self.i % len(h.engines)]


class LeastSessions(Strategy):
    name = "least-sessions"

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        act = h.active_sessions()
        return min(h.engines, key=lambda w: (act[w], h.queued(w)))


class Pace(Strategy):
    """Fewest decoding users pushed under the SLO's speed by this prefill plus the queued one."""

    def __init__(self, hold_s: float = 0.0, balance: int | None = None) -> None:
        self.hold_s, self.balance = hold_s, balance
        self.name = "pace" + ("-balanced" if balance is not None else "")
        self.name += f"-hold-{hold_s:g}" if hold_s else ""

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        now = h.clock.now()
        pool = list(h.engines)
        if self.balance is not None:
            act = h.active_sessions()
            least = min(act.values())
            pool = [w for w in pool if act[w] <= least + self.balance]

        def key(w: str) -> tuple[int, int]:
            cost = h.s_per_prefill_token * (rec.prompt + h.queued(w))
            return (sum(1 for s in h.slacks(w, now) if s < cost), h.queued(w))

        best = min(pool, key=key)
        if self.hold_s and key(best)[0] > 0 and now - rec.sent < self.hold_s:
            return None
        return best


class Harm(Strategy):
    """First turns where their prefill costs least: the prefill queued there, plus `alpha` ×
    its own prefill time for every request in flight there and `resting` for every session
    of the worker between turns (the users it would slow, or who will come back to it)."""

    def __init__(self, alpha: float, resting: float = 0.0) -> None:
        self.alpha, self.resting = alpha, resting
        self.name = f"harm-{alpha:g}" + (f"-r{resting:g}" if resting else "")

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        act = h.active_sessions()

        def key(w: str) -> float:
            q = h.s_per_prefill_token * h.queued(w)
            own = h.s_per_prefill_token * rec.prompt
            n = len(h.inflight[w])
            return q + self.alpha * own * (n + self.resting * max(0, act[w] - n))

        return min(h.engines, key=key)


class SplitIdle(Strategy):
    """First turns: prefilled where the fewest requests are in flight, decoded (KV handoff)
    on the worker with the fewest active sessions."""

    def __init__(self, min_tokens: int = 8192, margin: float = 1) -> None:
        self.min_tokens, self.margin = min_tokens, margin
        self.name = f"split-idle-{min_tokens // 1024}k-m{margin}"

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        act = h.active_sessions()
        return min(h.engines, key=lambda w: (act[w], h.queued(w)))

    def send(self, h: Loop, worker: str, rec: Rec) -> None:
        if rec.turn != 0 or rec.prompt < self.min_tokens:
            h.submit(worker, rec, rec.req)
            return

        def busy(w: str) -> float:
            return len(h.inflight[w]) + h.queued(w) / 8192.0

        p = min(h.engines, key=lambda w: (busy(w), h.queued(w)))
        if busy(worker) - busy(p) < self.margin:
            h.submit(worker, rec, rec.req)
            return
        prefill_leg(h, worker, rec, p)


def prefill_leg(
    h: Loop, worker: str, rec: Rec, p: str, answered: Callable[[], None] | None = None
) -> None:
    """Prefill `rec`'s whole prompt on `p` (its cache serves what it holds), then decode on
    `worker` once the KV moved (the sim's P/D transfer time); `answered` runs when the leg
    answers, before the decode is submitted."""
    leg = SimRequest(
        h.new_id("prefill"),
        prompt_tokens=rec.prompt,
        max_output_tokens=1,
        output_tokens=1,
        block_hashes=rec.req.block_hashes,
    )
    moved = replace(
        rec.req,
        remote_prefill=RemotePrefill(transfer_seconds=h.lat.pd_transfer_seconds(rec.prompt)),
    )

    def done(u: RequestUpdate) -> None:
        if u.finished:
            if answered is not None:
                answered()
            h.release_slot(worker, rec)
            h.submit(worker, rec, moved)

    h.hold_slot(worker, rec)
    h.engines[p].submit(leg, done, stream=False)


class LeastInflight(Strategy):
    name = "least-inflight"

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        return min(h.engines, key=lambda w: (len(h.inflight[w]), h.queued(w)))


class Gate(LeastQueued):
    def __init__(self, limit: int, lifo: bool = False) -> None:
        super().__init__()
        self.limit, self.lifo = limit, lifo
        self.name = f"gate-{'lifo-' if lifo else ''}{limit // 1024}k"

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        if min(h.queued(w) for w in h.engines) > self.limit:
            return None
        return super().place_new(h, rec)

    def order(self, held: list[Rec]) -> list[Rec]:
        return sorted(held, key=lambda r: -r.sent) if self.lifo else held


class Prime:
    """Wraps a strategy: first turns are prefilled as growing prefixes of `piece` tokens."""

    def __init__(self, inner: Strategy, piece: int) -> None:
        self.inner, self.piece = inner, piece
        prefix = "" if isinstance(inner, LeastQueued) else inner.name + "-"
        self.name = f"{prefix}prime-{piece // 1024}k"

    def place(self, h: Loop, rec: Rec) -> str | None:
        return self.inner.place(h, rec)

    def order(self, held: list[Rec]) -> list[Rec]:
        return self.inner.order(held)

    def send(self, h: Loop, worker: str, rec: Rec) -> None:
        send_in_pieces(h, worker, rec, 0 if rec.turn == 0 else rec.prompt, self.piece)


def send_in_pieces(h: Loop, worker: str, rec: Rec, cached: int, piece: int) -> None:
    """Send `rec` to `worker` after its prompt's prefixes past `cached` tokens, `piece` tokens
    longer each, one after the other (a one-token answer each); its slot is held meanwhile."""
    pages = rec.req.block_hashes or ()
    step = max(1, piece // PAGE)
    cuts = list(range(cached // PAGE + step, len(pages), step))

    def go(i: int) -> None:
        if i == len(cuts):
            h.release_slot(worker, rec)
            h.submit(worker, rec, rec.req)
            return
        n = cuts[i]
        leg = SimRequest(
            h.new_id("piece"),
            prompt_tokens=n * PAGE,
            max_output_tokens=1,
            output_tokens=1,
            block_hashes=pages[:n],
        )

        def answered(u: RequestUpdate) -> None:
            if not u.finished:
                return
            if h.piece_rtt_s > 0:  # the answer's way back and the next piece's way out
                h.clock.call_at(u.time + h.piece_rtt_s, lambda: go(i + 1))
            else:
                go(i + 1)

        h.engines[worker].submit(leg, answered, stream=False)

    h.hold_slot(worker, rec)
    go(0)


class Disaggregated(Strategy):
    """First turns prefilled on `prefill` workers, decoded on `decode` ones after the KV moves
    (the sim's P/D transfer time). `overflow`: over that many queued tokens on the least-queued
    prefill worker, the first turn is prefilled on its decode worker instead.

    The gate (`sjf_below`) reads each prefill worker's backlog: `books="engine"` the engine's
    queue; `"first-token"` what a router's books hold from dispatch to the decode worker's
    first token; `"leg"` from dispatch to the prefill leg's answer (the HTTP router since
    2026-12-05). `split_continuing` (with `"leg"`): later turns with that many new tokens
    or more are split too, to the least-booked prefill worker (`sticky=False`: it prefills the
    whole prompt again) or to the one that prefilled the session's first turn (`sticky=True`:
    its cache may hold the context). `free`: an attribution row, not a strategy — the
    decode workers' own prefills of that kind ("continuing": later turns' new parts;
    "small-first": first turns under `local_below`) cost them nothing (the KV arrives after
    that prefill's time on an idle worker). `loose`: decode workers whose users the spill
    keeps at `loose_tok_s` tokens/s instead of the SLO's speed (0: not at all); `cap`: new
    sessions go to the other decode workers while one has fewer than `cap` requests."""

    def __init__(
        self,
        name: str,
        prefill: Sequence[str],
        decode: Sequence[str],
        overflow: int = 0,
        sjf_below: int = 0,
        books: Literal["engine", "first-token", "leg"] = "engine",
        local_below: int = 0,
        split_continuing: int = 0,
        sticky: bool = False,
        free: str | None = None,
        pace_hold: tuple[int, float] | None = None,
        sjf_window: float | None = None,
        spill: tuple[float, int, float] | None = None,
        pieces: tuple[int, int] | None = None,
        spill_pieces: int = 0,
        loose: Sequence[str] = (),
        loose_tok_s: float = 0.0,
        cap: int = 0,
        spill_tok_s: float | None = None,
        spill_line: tuple[float, float] | None = None,
    ) -> None:
        self.name, self.prefill, self.decode, self.overflow = name, prefill, decode, overflow
        self.sjf_below, self.books, self.local_below = sjf_below, books, local_below
        self.split_continuing, self.sticky = split_continuing, sticky
        self.free, self.pace_hold, self.sjf_window = free, pace_hold, sjf_window
        self.spill, self.pieces, self.spill_pieces = spill, pieces, spill_pieces
        self.loose = set(loose)  # decode workers whose users the spill protects less
        self.loose_tok_s = loose_tok_s  # … at this speed (0: not at all)
        self.cap = cap  # new sessions go to the other decode workers while under this many
        self.spill_tok_s = spill_tok_s  # the spill's price of prefill (None: the loop's)
        # (at, stop): the spill acts from `at` active sessions a worker until under `stop` (the
        # router's `pool_roles.spill_at_sessions_per_worker` / `spill_stop_below_…`)
        self.spill_line, self.spilling = spill_line, spill_line is None
        self.spilled: set[int] = set()  # id() of first turns spilled to their decode worker
        self.now: Callable[[], float] = lambda: 0.0
        self.sent: dict[str, list[Rec]] = {p: [] for p in prefill}
        self.legs: dict[str, dict[int, int]] = {p: {} for p in prefill}
        self.last: dict[str, int] = {}  # session → its previous prompt's tokens
        self.home_prefill: dict[str, str] = {}  # session → where its first turn was prefilled

    def place(self, h: Loop, rec: Rec) -> str | None:
        """`pace_hold` (N, T): a later turn with N or more new tokens waits (while its own
        prefill would still end within T s of its sending) while its prefill, beside what its
        decode worker has queued, would push one of that worker's decoding users under the
        SLO's speed (the router's `flow.pace_hold`)."""
        home = h.home.get(rec.session)
        if home is None:
            return self.place_new(h, rec)
        if self.pace_hold is not None:
            least, hold_s = self.pace_hold
            new = rec.prompt - self.last.get(rec.session, 0)
            now = h.clock.now()
            # as the router's rule: until its own prefill would end hold_s after it was sent
            if new >= least and now - rec.sent + h.s_per_prefill_token * new < hold_s:
                cost = h.s_per_prefill_token * (new + h.queued(home))
                if any(s < cost for s in h.slacks(home, now)):
                    return None
        return home

    def backlog(self, h: Loop, p: str) -> int:
        """The engine's queued prefill, or what a router's books hold (class docstring)."""
        if self.books == "leg":
            return sum(self.legs[p].values())
        if self.books == "engine":
            return h.queued(p)
        self.sent[p] = [r for r in self.sent[p] if r.first is None]
        return sum(r.prompt for r in self.sent[p])

    def place_new(self, h: Loop, rec: Rec) -> str | None:
        self.now = h.clock.now
        staged = rec.prompt >= self.local_below
        if (
            staged
            and self.sjf_below
            and min(self.backlog(h, p) for p in self.prefill) >= (self.sjf_below)
        ):
            return self._spill_to(h, rec)
        if self.cap:
            firm = [w for w in self.decode if w not in self.loose and len(h.inflight[w]) < self.cap]
            if firm:
                return min(firm, key=lambda w: (len(h.inflight[w]), h.queued(w)))
        return min(self.decode, key=lambda w: (len(h.inflight[w]), h.queued(w)))

    def _spill_to(self, h: Loop, rec: Rec) -> str | None:
        """`spill` (after, most, margin): a held first turn that waited `after` s goes to the
        decode worker with the least queued prefill among those whose queue, with it, stays
        within `most` tokens and whose decoding users keep `margin` s of slack beyond that
        prefill; it is prefilled there (the router's `flow.prefill_spill_after_s`)."""
        if self.spill is None:
            return None
        after, most, margin = self.spill
        if self.spill_line is not None:
            at, stop = self.spill_line
            # the router's `LoadBook.active_sessions`: its requests admitted or waiting to be
            # (held first turns too) and the sessions resting between turns: every live session
            active, n = len(h.live), len(h.engines)
            self.spilling = active >= stop * n if self.spilling else active >= at * n
            if not self.spilling:
                return None
        now = h.clock.now()
        if now - rec.sent < after:
            return None
        best: tuple[int, str] | None = None
        for d in self.decode:
            queued = h.queued(d) + rec.prompt
            if queued > most:
                continue
            price = 1 / self.spill_tok_s if self.spill_tok_s else h.s_per_prefill_token
            cost = price * queued
            if d not in self.loose:
                if any(s < cost + margin for s in h.slacks(d, now)):
                    continue
            elif self.loose_tok_s and any(s < cost for s in h.slacks(d, now, self.loose_tok_s)):
                continue
            if best is None or (queued, d) < best:
                best = (queued, d)
        if best is None:
            return None
        self.spilled.add(id(rec))
        return best[1]

    def order(self, held: list[Rec]) -> list[Rec]:
        """Shortest first; with `sjf_window` W only among first turns that waited less than W
        s, the others after them, oldest first (the router's `prefill_sjf_window_s`)."""
        if not self.sjf_below:
            return held
        if self.sjf_window is None:
            return sorted(held, key=lambda r: (r.turn == 0, r.prompt if r.turn == 0 else 0))
        now, w = self.now(), self.sjf_window

        def key(r: Rec) -> tuple[bool, bool, float]:
            if r.turn != 0:
                return (False, False, 0.0)
            late = now - r.sent >= w
            return (True, late, r.sent if late else r.prompt)

        return sorted(held, key=key)

    def send(self, h: Loop, worker: str, rec: Rec) -> None:
        new = rec.prompt - self.last.get(rec.session, 0)
        self.last[rec.session] = rec.prompt
        if rec.turn != 0:
            if self.free == "continuing":
                self._remote(h, worker, rec, h.lat.prefill_seconds(max(new, 1)))
            elif self.split_continuing and new >= self.split_continuing:
                p = self.home_prefill.get(rec.session) if self.sticky else None
                if self.sticky and p is None:  # its first turn was prefilled locally
                    h.submit(worker, rec, rec.req)
                else:
                    self._leg(h, worker, rec, p or self._least_booked(h), new)
            elif self.pieces is not None and new >= self.pieces[1]:
                # `pieces` (piece, least): a later turn with `least` or more new tokens is
                # prefilled a piece at a time (the router's `flow.prefill_piece_*`)
                send_in_pieces(h, worker, rec, rec.prompt - new, self.pieces[0])
            else:
                h.submit(worker, rec, rec.req)
            return
        if id(rec) in self.spilled and self.spill_pieces:
            # `spill_pieces` P: a spilled first turn is prefilled a piece of P tokens at a time
            send_in_pieces(h, worker, rec, 0, self.spill_pieces)
            return
        if rec.prompt < self.local_below or id(rec) in self.spilled:
            if self.free == "small-first" and id(rec) not in self.spilled:
                self._remote(h, worker, rec, h.lat.prefill_seconds(rec.prompt))
            else:
                h.submit(worker, rec, rec.req)
            return
        p = self._least_booked(h)
        self.home_prefill[rec.session] = p
        self.sent[p].append(rec)
        if self.overflow and h.queued(p) + rec.prompt > self.overflow:
            h.submit(worker, rec, rec.req)
            return
        self._leg(h, worker, rec, p, rec.prompt)

    def _least_booked(self, h: Loop) -> str:
        return min(self.prefill, key=lambda x: self.backlog(h, x))

    def _remote(self, h: Loop, worker: str, rec: Rec, seconds: float) -> None:
        h.submit(worker, rec, replace(rec.req, remote_prefill=RemotePrefill(seconds)))

    def _leg(self, h: Loop, worker: str, rec: Rec, p: str, booked: int) -> None:
        """Prefill `rec`'s whole prompt on `p` (its cache serves what it holds), then decode on
        `worker` once the KV moved; `booked` tokens count on `p` until the leg answers."""
        key = id(rec)
        self.legs[p][key] = booked
        prefill_leg(h, worker, rec, p, lambda: self.legs[p].pop(key, None))


class FirstTurnsElsewhere(LeastQueued):
    """The ceiling row: first turns' prefill costs these workers nothing."""

    name = "ceiling-first-turns-elsewhere"

    def send(self, h: Loop, worker: str, rec: Rec) -> None:
        if rec.turn != 0:
            h.submit(worker, rec, rec.req)
            return
        t = h.lat.prefill_seconds(rec.prompt)
        h.submit(worker, rec, replace(rec.req, remote_prefill=RemotePrefill(transfer_seconds=t)))


def strategies(workers: int) -> dict[str, Callable[[], Any]]:
    ws = [f"w{i}" for i in range(workers)]
    out: dict[str, Callable[[], Any]] = {
        "least-queued": LeastQueued,
        "round-robin": RoundRobin,
        "least-sessions": LeastSessions,
        "pace": Pace,
        "pace-hold-0.5": lambda: Pace(0.5),
        "pace-hold-1": lambda: Pace(1.0),
        "pace-hold-1.5": lambda: Pace(1.5),
        "pace-balanced-hold-1": lambda: Pace(1.0, balance=2),
        "gate-8k": lambda: Gate(8192),
        "gate-32k": lambda: Gate(32768),
        "gate-lifo-32k": lambda: Gate(32768, lifo=True),
        "prime-2k": lambda: Prime(LeastQueued(), 2048),
        "prime-4k": lambda: Prime(LeastQueued(), 4096),
        "pace-hold-1-prime-4k": lambda: Prime(Pace(1.0), 4096),
        "prime-3k": lambda: Prime(LeastQueued(), 3072),
        "prime-8k": lambda: Prime(LeastQueued(), 8192),
        "least-sessions-prime-4k": lambda: Prime(LeastSessions(), 4096),
        "least-inflight": LeastInflight,
        "harm-1": lambda: Harm(1.0),
        "harm-0.3": lambda: Harm(0.3),
        "harm-1-r0.5": lambda: Harm(1.0, 0.5),
        "harm-0.5-r0.5": lambda: Harm(0.5, 0.5),
        "harm-2-r0.5": lambda: Harm(2.0, 0.5),
        "harm-1-r1": lambda: Harm(1.0, 1.0),
        "split-idle-8k-m1": lambda: SplitIdle(8192, 1),
        "split-idle-8k-m2": lambda: SplitIdle(8192, 2),
        "split-idle-32k-m1": lambda: SplitIdle(32768, 1),
    }
    if workers >= 4:
        out["pd-1p3d"] = lambda: Disaggregated("pd-1p3d", ws[:1], ws[1:])
        out["pd-2p2d"] = lambda: Disaggregated("pd-2p2d", ws[:2], ws[2:])
        for q in (1, 8192, 32768):
            out[f"pd-2p2d-sjf-{q // 1024}k"] = lambda q=q: Disaggregated(
                f"pd-2p2d-sjf-{q // 1024}k", ws[:2], ws[2:], sjf_below=q
            )
        out["pd-2p2d-books-32k-local-8k"] = lambda: Disaggregated(
            "pd-2p2d-books-32k-local-8k",
            ws[:2],
            ws[2:],
            sjf_below=32768,
            books="first-token",
            local_below=8192,
        )
        out["pd-2p2d-sjf-8k-local-8k"] = lambda: Disaggregated(
            "pd-2p2d-sjf-8k-local-8k", ws[:2], ws[2:], sjf_below=8192, local_below=8192
        )
        out["pd-1p-overflow"] = lambda: Disaggregated("pd-1p-overflow", ws[:1], ws[1:], 60_000)
        # The HTTP router's pool since 2026-12-05, and what was tried around it.
        twin: dict[str, Any] = {"sjf_below": 32768, "local_below": 8192, "books": "leg"}
        out["pd-2p2d-legbooks-32k-local-8k"] = lambda: Disaggregated(
            "pd-2p2d-legbooks-32k-local-8k", ws[:2], ws[2:], **twin
        )
        out["pd-2p2d-legbooks-split-continuing-8k"] = lambda: Disaggregated(
            "pd-2p2d-legbooks-split-continuing-8k", ws[:2], ws[2:], split_continuing=8192, **twin
        )
        for x in (256, 1024, 4096):
            out[f"pd-2p2d-legbooks-cont-sticky-{x}"] = lambda x=x: Disaggregated(
                f"pd-2p2d-legbooks-cont-sticky-{x}",
                ws[:2],
                ws[2:],
                split_continuing=x,
                sticky=True,
                **twin,
            )
        out["pd-2p2d-legbooks-cont-pace-hold-1024-1.5"] = lambda: Disaggregated(
            "pd-2p2d-legbooks-cont-pace-hold-1024-1.5",
            ws[:2],
            ws[2:],
            pace_hold=(1024, 1.5),
            **twin,
        )
        # … since 2026-12-05 (afternoon): the pace hold, and shortest first only among the
        # first turns that waited under 2 s (`prefill_sjf_window_s`)
        built: dict[str, Any] = {**twin, "pace_hold": (1024, 1.5), "sjf_window": 2.0}
        out["pd-2p2d-legbooks-window-2"] = lambda: Disaggregated(
            "pd-2p2d-legbooks-window-2", ws[:2], ws[2:], **built
        )
        # … since 2026-12-05 (evening): first turns held 1 s spill to a decode worker with room
        out["pd-2p2d-spill"] = lambda: Disaggregated(
            "pd-2p2d-spill", ws[:2], ws[2:], spill=(1.0, 49152, 0.5), **built
        )
        # … and later turns with 4,096+ new tokens prefilled in 1,024-token pieces
        out["pd-2p2d-pieces-1k-4k"] = lambda: Disaggregated(
            "pd-2p2d-pieces-1k-4k", ws[:2], ws[2:], pieces=(1024, 4096), **built
        )
        both: dict[str, Any] = {**built, "pieces": (1024, 4096)}
        for after, most, margin, sp in (
            (1.0, 49152, 0.5, 0),
            (0.3, 49152, 0.5, 0),
            (0.3, 98304, 0.0, 0),
            (0.3, 49152, 0.5, 1024),
            (0.3, 98304, 0.0, 1024),
            (0.0, 10**9, 0.0, 1024),
            (1.0, 10**9, 0.0, 1024),
            (2.0, 10**9, 0.0, 1024),
        ):
            tag = f"pd-2p2d-pieces-spill-{after}-{most // 1024}k-{margin}-p{sp}"
            out[tag] = lambda tag=tag, after=after, most=most, margin=margin, sp=sp: Disaggregated(
                tag, ws[:2], ws[2:], spill=(after, most, margin), spill_pieces=sp, **both
            )
        out["pd-1p3d-pieces-spill-0.3-96k-0.0-p1024"] = lambda: Disaggregated(
            "pd-1p3d-pieces-spill-0.3-96k-0.0-p1024",
            ws[:1],
            ws[1:],
            spill=(0.3, 98304, 0.0),
            spill_pieces=1024,
            **both,
        )

        # 2026-12-06: the HTTP router's shipped pool (2 prefill + 2 decode, the spill after 0.3 s
        # within 96K tokens, spilled first turns in pieces) with `over` in its place
        def shipped(tag: str, **over: Any) -> Callable[[], Disaggregated]:
            kw: dict[str, Any] = {"spill": (0.3, 98304, 0.0), "spill_pieces": 1024, **both}
            return lambda: Disaggregated(tag, ws[:2], ws[2:], **(kw | over))

        # … one decode worker whose users the spill protects less (`lt` tokens/s; 0: not at
        # all), new sessions kept off it while the other has under `cap` …
        for lt in (0, 10):
            for cap in (0, 32, 48, 64):
                tag = f"pd-2p2d-pieces-spill-loose1-32k-{lt}-cap{cap}"
                out[tag] = shipped(
                    tag, spill=(0.3, 32768, 0.0), loose=ws[3:], loose_tok_s=lt, cap=cap
                )
        # … the pace hold shorter or off …
        for hold in (None, 0.5):
            tag = f"pd-2p2d-pieces-spill-0.3-96k-0.0-p1024-hold-{hold or 'off'}"
            out[tag] = shipped(tag, pace_hold=(1024, hold) if hold else None)
        # … held first turns oldest first, none ahead for being short (`sjf_window` 0) …
        tag = "pd-2p2d-pieces-spill-0.3-96k-0.0-p1024-fifo"
        out[tag] = shipped(tag, sjf_window=0.0)
        # … the spill priced as the HTTP router's (`prefill_spill_tok_s`) …
        for tok_s in (60_000, 100_000):
            tag = f"pd-2p2d-pieces-spill-0.3-96k-0.0-p1024-price-{tok_s // 1000}k"
            out[tag] = shipped(tag, spill_tok_s=tok_s)
        # … and so, spilling only from 24 active sessions a worker until under 12 (the router's
        # pool roles line)
        for at in (12, 16, 24):
            tag = f"pd-2p2d-pieces-spill-0.3-96k-0.0-p1024-price-100k-line-{at}"
            out[tag] = shipped(tag, spill_tok_s=100_000, spill_line=(float(at), at / 2))
        # … and the spill keeping every decode worker's users at `lt` tokens/s (20: the SLO's)
        for lt in (10, 12, 15, 16, 17, 18, 19, 20):
            tag = f"pd-2p2d-pieces-spill-all-96k-{lt}"
            out[tag] = shipped(tag, loose=ws[2:], loose_tok_s=lt)
        out["pd-2p2d-spill-no-bound"] = lambda: Disaggregated(
            "pd-2p2d-spill-no-bound", ws[:2], ws[2:], spill=(0.0, 10**9, 0.0), **built
        )
        for what in ("continuing", "small-first"):
            out[f"attribution-free-{what}"] = lambda what=what: Disaggregated(
                f"attribution-free-{what}", ws[:2], ws[2:], free=what, **twin
            )
    out["ceiling-first-turns-elsewhere"] = FirstTurnsElsewhere
    return out


def step_costs(lat: LatencyModel, budget: int, batch: int = 16, context: int = 28_000):
    """(s a decode step of `batch` users, s each prefill token adds to a step beside them)."""
    decode = StepWork(
        decode_requests=batch,
        decode_query_tokens=1,
        decode_context=batch * context,
        decode_window=batch * min(context, lat.window),
    )
    chunk = budget - batch
    mixed = decode._replace(
        prefill_tokens=chunk,
        prefill_keys_full=causal_keys(0, chunk),
        prefill_keys_window=causal_keys(0, chunk, lat.window),
    )
    t_d, t_c = lat.step_seconds(decode), lat.step_seconds(mixed)
    return t_d, (t_c - t_d) / chunk


class Loop:
    """The bench's closed loop on a virtual clock (module docstring)."""

    def __init__(
        self,
        sessions: Sequence[Session],
        strategy: Any,
        *,
        concurrency: int,
        workers: int = 4,
        profile: str = "h200-bf16-tp8",
        budget: int | None = None,
        token_scale: float = 0.25,
        seed: int = 0,
        jitter_s: float = 0.02,
        tick_s: float = 0.05,
        piece_rtt_s: float = 0.0,
        own_pace: bool = False,
    ) -> None:
        prof = get_profile(profile)
        #: seconds between a piece's answer and the next piece reaching the engine (over HTTP:
        #: the answer's way to the router and the next piece's way back; 0: the same instant)
        self.piece_rtt_s = piece_rtt_s
        #: a user's slack reckoned at its own pace so far (the HTTP router's
        #: `pace_hold.slack_s`) instead of an idle worker's decode step
        self.own_pace = own_pace
        over: dict[str, object] = {"page_size": PAGE}
        if budget:
            over["max_batched_tokens"] = budget
        cfg = EngineConfig.from_profile(prof, **over)
        self.clock = VirtualClock()
        self.engines = {f"w{i}": SimEngine(cfg, self.clock) for i in range(workers)}
        self.lat = LatencyModel(prof)
        self.s_per_decode_step, self.s_per_prefill_token = step_costs(
            self.lat, cfg.max_batched_tokens
        )
        self.strategy = strategy
        self.concurrency, self.tick_s = concurrency, tick_s
        self.builder = PromptBuilder(block_tokens_for(token_scale))
        self.ids_per_page = max(1, PAGE // self.builder.block_tokens)
        codec = ApproxCodec()
        self.wrapper = len(codec.encode(codec.render([{"role": "user", "content": ""}])))
        self.queue = collections.deque(sessions)
        self.rng = random.Random(seed)
        self.jitter_s = jitter_s if seed else 0.0
        self.recs: list[Rec] = []
        self.home: dict[str, str] = {}
        self.live: set[str] = set()
        self.inflight: dict[str, list[Rec]] = {w: [] for w in self.engines}
        self.held: list[Rec] = []
        self._cont: dict[int, tuple[Session, int]] = {}
        self._ids = 0
        self._ticking = False

    # --- what strategies read ---------------------------------------------------------------

    def queued(self, worker: str) -> int:
        return self.engines[worker].stats().queued_prefill_tokens

    def active_sessions(self) -> dict[str, int]:
        act = {w: 0 for w in self.engines}
        for s in self.live:
            w = self.home.get(s)
            if w is not None:
                act[w] += 1
        return act

    def slacks(self, worker: str, now: float, tok_s: float = SLO_TOK_S) -> list[float]:
        """Seconds each decoding request on `worker` can still lose and end at `tok_s` (default
        the SLO's speed)."""
        out = []
        for r in self.inflight[worker]:
            if r.first is None:
                continue
            step = self.s_per_decode_step
            if self.own_pace and r.ntok >= 2 and now - r.first >= 0.25:
                step = (now - r.first) / (r.ntok - 1)  # as the HTTP router reckons it
            deadline = r.first + r.out / tok_s
            out.append(deadline - now - (r.out - r.ntok) * step)
        return out

    def new_id(self, kind: str) -> str:
        self._ids += 1
        return f"{kind}-{self._ids}"

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> list[Rec]:
        for _ in range(self.concurrency):
            self._next_session()
        self.clock.run()
        if self.held or any(self.inflight.values()):
            raise RuntimeError(f"{self.strategy.name}: requests left held or in flight")
        return self.recs

    def write_records(self, path: Path) -> None:
        """The run's requests, one JSON line each, in the HTTP bench's `requests.jsonl` form
        (`--logs`), so that one analysis reads both; plus where each went, when it was
        dispatched, and whether it was spilled."""
        spilled = getattr(self.strategy, "spilled", set())
        with open(path, "w") as fh:
            for r in self.recs:
                span = (r.end or 0.0) - (r.first or 0.0)
                row = {
                    "session": r.session,
                    "turn": r.turn,
                    "status": "ok",
                    "sent_s": r.sent,
                    "ttft_s": r.ttft if r.first is not None else None,
                    "end_s": r.end,
                    "user_tok_s": r.ntok / span if span > 0 else None,
                    "prompt_tokens": r.prompt,
                    "cached_tokens": r.cached,
                    "output_tokens": r.ntok,
                    "worker": r.worker,
                    "dispatched_s": r.dispatched,
                    "spilled": id(r) in spilled,
                }
                fh.write(json.dumps(row) + "\n")

    def engine_totals(self) -> dict[str, dict[str, float]]:
        """Per engine at the end of the run: prompt tokens, of them computed (not prefix
        hits), generated tokens, busy seconds and preemptions."""
        out = {}
        for w, e in sorted(self.engines.items()):
            st = e.stats()
            out[w] = {
                "prompt_tokens": st.prompt_tokens_total,
                "computed_tokens": st.prompt_tokens_total - st.prefix_cache_hits_tokens,
                "generated_tokens": st.generation_tokens_total,
                "busy_s": round(st.busy_seconds, 2),
                "preemptions": st.preemptions_total,
            }
        return out

    def _next_session(self) -> None:
        if self.queue:
            self._send(self.queue.popleft(), 0)

    def _send(self, s: Session, k: int) -> None:
        t = s.turns[k]
        self.live.add(s.name)
        prompt = self.builder.prompt_tokens(t.hash_ids) + self.wrapper
        req = SimRequest(
            self.new_id("req"),
            prompt_tokens=prompt,
            max_output_tokens=t.max_tokens,
            output_tokens=t.max_tokens,
            block_hashes=page_hashes(s.name, t.hash_ids, self.ids_per_page),
        )
        rec = Rec(s.name, k, prompt, t.max_tokens, self.clock.now(), req)
        self._cont[id(rec)] = (s, k)
        self.recs.append(rec)
        self.held.append(rec)
        self.pump()

    def pump(self) -> None:
        if not self.held:
            return
        keep = []
        for rec in self.strategy.order(self.held):
            w = self.strategy.place(self, rec)
            if w is None:
                keep.append(rec)
                continue
            rec.worker = w
            rec.dispatched = self.clock.now()
            self.home[rec.session] = w
            self.strategy.send(self, w, rec)
        self.held = keep
        if keep and not self._ticking:
            self._ticking = True
            self.clock.call_at(self.clock.now() + self.tick_s, self._tick)

    def _tick(self) -> None:
        self._ticking = False
        self.pump()

    def hold_slot(self, worker: str, rec: Rec) -> None:
        self.inflight[worker].append(rec)

    def release_slot(self, worker: str, rec: Rec) -> None:
        self.inflight[worker].remove(rec)

    def submit(self, worker: str, rec: Rec, req: SimRequest) -> None:
        if rec not in self.inflight[worker]:
            self.inflight[worker].append(rec)
        s, k = self._cont.pop(id(rec))

        def listener(u: RequestUpdate) -> None:
            if rec.first is None and u.num_output_tokens > 0:
                rec.first = u.time
            rec.ntok = u.num_output_tokens
            if not u.finished:
                return
            rec.end = u.time
            if u.metrics is not None:
                rec.cached = u.metrics.cached_tokens
            self.inflight[worker].remove(rec)
            if k + 1 < len(s.turns):
                pause = s.turns[k + 1].think_s + self.rng.uniform(0, self.jitter_s)
                self.clock.call_at(u.time + pause, lambda: self._send(s, k + 1))
            else:
                self.live.discard(s.name)
                self._next_session()
            self.pump()

        self.engines[worker].submit(req, listener, stream=True)


# --- summary --------------------------------------------------------------------------------


def summarize(recs: Sequence[Rec]) -> dict[str, Any]:
    """The bench's figures for one run, and the misses split by turn and kind."""
    t0 = min(r.sent for r in recs)
    t1 = max(r.end or r.sent for r in recs)
    run_s = t1 - t0
    first = [r for r in recs if r.turn == 0]
    later = [r for r in recs if r.turn > 0]

    def split(rs: Sequence[Rec]) -> dict[str, int]:
        good = sum(r.good for r in rs)
        late = sum(r.late for r in rs)
        return {"good": good, "slow": len(rs) - good - late, "late": late}

    ttfts = sorted(r.ttft for r in recs if r.first is not None)
    good = sum(r.good for r in recs)
    return {
        "requests": len(recs),
        "run_s": run_s,
        "goodput_rps": good / run_s if run_s > 0 else 0.0,
        "attainment": good / len(recs) if recs else 0.0,
        "hit": sum(r.cached for r in recs) / max(1, sum(r.prompt for r in recs)),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "output_tok_s": sum(r.ntok for r in recs) / run_s if run_s > 0 else 0.0,
        "continuing": split(later),
        "first": split(first),
    }


def search(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> list[dict]:
    sessions = load_sessions(
        args.trace or default_trace_dir(),
        sessions=args.sessions,
        max_turns=args.max_turns,
        token_scale=args.token_scale,
        think_scale=0.02,
        max_think_s=2.0,
    )
    table = strategies(args.workers)
    names = args.strategies.split(",") if args.strategies else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(
            f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(table)}"
        )
    rows = []
    for name in names:
        runs = []
        for seed in range(args.seeds):
            loop = Loop(
                sessions,
                table[name](),
                concurrency=args.concurrency,
                workers=args.workers,
                budget=args.budget,
                token_scale=args.token_scale,
                seed=seed,
                piece_rtt_s=getattr(args, "piece_rtt_ms", 0.0) / 1000,
                own_pace=getattr(args, "own_pace", False),
            )
            summary = summarize(loop.run())
            if getattr(args, "engine_stats", False):
                summary["engines"] = loop.engine_totals()
            if seed == 0 and getattr(args, "records", None):
                folder = args.records / f"{name}-c{args.concurrency}"
                folder.mkdir(parents=True, exist_ok=True)
                loop.write_records(folder / "requests.jsonl")
            runs.append(summary)
            if progress:
                progress(name)
        g = [r["goodput_rps"] for r in runs]
        rows.append(
            {
                "strategy": name,
                "goodput_mean": statistics.fmean(g),
                "goodput_min": min(g),
                "goodput_max": max(g),
                "runs": runs,
            }
        )
    base = next((r["goodput_mean"] for r in rows if r["strategy"] == "least-queued"), None)
    for r in rows:
        r["vs_least_queued"] = r["goodput_mean"] / base if base else None
    return rows


def print_table(rows: Sequence[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in (
        "strategy",
        "goodput r/s",
        "range",
        "× least-queued",
        "attain",
        "run s",
        "TTFT p90",
        "continuing good/slow/late",
        "first good/slow/late",
    ):
        t.add_column(c, justify="left" if c == "strategy" else "right")
    for r in rows:
        a = r["runs"][0]
        c, f = a["continuing"], a["first"]
        t.add_row(
            r["strategy"],
            f"{r['goodput_mean']:.2f}",
            f"{r['goodput_min']:.2f}–{r['goodput_max']:.2f}",
            f"{r['vs_least_queued']:.3f}" if r["vs_least_queued"] else "–",
            f"{statistics.fmean(x['attainment'] for x in r['runs']):.3f}",
            f"{statistics.fmean(x['run_s'] for x in r['runs']):.1f}",
            f"{a['ttft_p90_s']:.2f}",
            f"{c['good']}/{c['slow']}/{c['late']}",
            f"{f['good']}/{f['slow']}/{f['late']}",
        )
    Console(width=200).print(t)


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r["goodput_mean"] for r in rows if r["strategy"] == "least-queued"), None)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["strategy"] for r in rows][::-1]
    means = [r["goodput_mean"] for r in rows][::-1]
    lo = [r["goodput_mean"] - r["goodput_min"] for r in rows][::-1]
    hi = [r["goodput_max"] - r["goodput_mean"] for r in rows][::-1]
    ax.barh(names, means, xerr=[lo, hi], color="#4c72b0")
    if base:
        ax.axvline(base, color="grey", ls=":", label="least-queued")
        ax.axvline(1.25 * base, color="#c44e52", ls="--", label="1.25 × least-queued")
        ax.legend(loc="lower right")
    ax.set_xlabel("goodput (requests/s meeting TTFT ≤ 2 s and ≥ 20 tok/s)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=None, help="default: the bundled claude-code set")
    p.add_argument("--sessions", type=int, default=192)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--token-scale", type=float, default=0.25)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--budget", type=int, default=None, help="tokens a step (default: profile's)")
    p.add_argument("--seeds", type=int, default=3, help="runs per strategy (seed 0: no jitter)")
    p.add_argument("--strategies", default=None, help="comma-separated; default all")
    p.add_argument("--json", type=Path, default=None, help="write the rows here (and a .png)")
    p.add_argument(
        "--piece-rtt-ms",
        type=float,
        default=0.0,
        help="ms from a piece's answer to the next piece at its engine (HTTP's round trip; "
        "default 0: the same instant)",
    )
    p.add_argument(
        "--own-pace",
        action="store_true",
        help="reckon a user's slack at its own pace so far, as the HTTP router does (default: "
        "at the decode step of 16 users)",
    )
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        help="write each strategy's seed-0 requests to DIR/STRATEGY-cN/requests.jsonl (the "
        "HTTP bench's --logs form)",
    )
    p.add_argument(
        "--engine-stats",
        action="store_true",
        help="print and keep each engine's totals (computed prompt tokens, busy seconds, …)",
    )
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds: give at least 1")
    if args.concurrency < 1:
        p.error("--concurrency: give at least 1")
    from rich.progress import Progress

    n = len(args.strategies.split(",")) if args.strategies else len(strategies(args.workers))
    with Progress(transient=True) as bar:
        task = bar.add_task("strategies × seeds", total=n * args.seeds)
        rows = search(args, lambda _name: bar.advance(task))
    title = (
        f"{args.sessions} sessions, {args.concurrency} agents, {args.workers} sim workers, "
        f"budget {args.budget or 'profile'}, {args.seeds} seeds"
    )
    print_table(rows, title)
    if args.engine_stats:
        for row in rows:
            for seed, run in enumerate(row["runs"]):
                for w, t in run["engines"].items():
                    print(row["strategy"], f"seed {seed}", w, t)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "rows": rows,
                },
                indent=1,
            )
        )
        plot(rows, args.json.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
