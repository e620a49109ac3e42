"""Continuous batching with chunked prefill over the two-group KV cache. No clock, no I/O.

Each step (`schedule(now)` → `StepPlan`, then `complete(plan, end)`) works like vLLM's v1
scheduler, with a token budget of `max_batched_tokens`:

1. running requests in their decode phase: each takes `q` tokens of the budget (the
   speculative block, or 1) and pages for the tokens it will emit;
2. running requests still in prefill, in admission order: a chunk of what is left of the budget;
3. waiting requests, first come first served, while fewer than `max_running` run: each is
   matched against the prefix cache, admitted only if its hit and first chunk fit in the page
   pools (head-of-line blocking otherwise), and gets a chunk of the budget.

When a running request cannot get pages, the most recently admitted request is preempted (its
pages are released, cached blocks stay in the prefix cache) and goes back to the head of the
queue; it later recomputes its prompt and the tokens it already emitted, reusing whatever of its
prefix is still cached. Requests whose KV must first arrive (host-tier hits, remote prefill)
hold their place and pages but sit out steps until `ready_at`.

Tokens: a prefill's last chunk emits the first token at the end of its step; a decode step emits
`acceptance_length` tokens per request when it speculates (fractions carry over, so 3.5
alternates 3 and 4), else 1, capped by the request's limit. A step speculates unless its decode
batch exceeds `spec.disable_by_batch_size`. The KV of emitted tokens counts from the step that
emits them.

Representation: requests in their decode phase live in `DecodeSlots`, a struct of arrays, so a
step over a large batch is a handful of numpy operations; only page-boundary crossings, window
slides and finishes touch individual requests. Each step's emissions go to a log from which a
request's token times are rebuilt when it leaves its slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from beamserve.workers.sim.config import EngineConfig
from beamserve.workers.sim.kv_cache import KVCacheManager, PrefixMatch, SeqKV
from beamserve.workers.sim.latency import LatencyModel, StepWork, causal_keys
from beamserve.workers.sim.request import FinishReason, RequestListener, SimRequest, token_seed

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Seq:
    """A request inside the engine (mutable; owned by the scheduler).

    While the request sits in a decode slot, its `out` / `acc` live in `DecodeSlots` and the
    fields here are stale; they are written back when it leaves the slot.
    """

    __slots__ = (
        "acc",
        "admit_no",
        "arrival",
        "computed",
        "device_cached",
        "done",
        "error",
        "finish_reason",
        "finish_time",
        "first_scheduled",
        "first_token",
        "hashes",
        "host_cached",
        "kv",
        "limit",
        "listener",
        "load_s",
        "out",
        "page_end",
        "preemptions",
        "prompt_len",
        "ready_at",
        "recompute",
        "remote_pending",
        "request",
        "running",
        "seed",
        "segments",
        "slide_at",
        "slot",
        "stream",
        "target",
        "token_cap",
        "transfer_s",
    )

    def __init__(
        self,
        request: SimRequest,
        hashes: tuple[int, ...],
        arrival: float,
        limit: int,
        listener: RequestListener | None,
        stream: bool = True,
    ) -> None:
        self.request = request
        self.seed = token_seed(request.request_id)
        self.hashes = hashes
        self.arrival = arrival
        self.listener = listener
        self.stream = stream
        self.prompt_len = request.prompt_tokens
        self.limit = limit
        self.target = self.prompt_len  # tokens to (re)compute before decoding
        self.computed = 0
        self.out = 0
        self.acc = 0.0
        self.kv: SeqKV | None = None
        self.slot: int | None = None
        self.admit_no = 0
        self.page_end = 0  # tokens the full pages held can take
        self.slide_at = 0  # sequence length at which the window next drops a page
        self.ready_at = 0.0
        self.running = False
        self.remote_pending = request.remote_prefill is not None
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.finish_time: float | None = None
        self.done: FinishReason | None = None  # set by the scheduler when generation ends
        self.finish_reason: FinishReason | None = None  # set by the engine when reported
        self.error: str | None = None
        self.segments: list[npt.NDArray[np.float64]] = []  # token times, in order
        self.token_cap: int | None = None  # tokens actually delivered, when fewer were made
        self.device_cached = 0
        self.host_cached = 0
        self.recompute = 0
        self.load_s = 0.0
        self.transfer_s = 0.0
        self.preemptions = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.out

    def token_times(self) -> tuple[float, ...]:
        if not self.segments:
            return ()
        times = np.concatenate(self.segments).tolist()
        if self.token_cap is not None:
            times = times[: self.token_cap]
        return tuple(times)


class DecodeSlots:
    """Requests in their decode phase as arrays indexed by slot, plus the emission log.

    `log[k − base, slot]` is how many tokens the request in `slot` emitted in step k (absolute
    step number), `ends[k − base]` when step k ended. A request's token times are the step ends
    repeated by its counts from the step it joined to the step it leaves.
    """

    def __init__(self, capacity: int, rows: int = 1024) -> None:
        self.capacity = capacity
        self.seqs: list[Seq | None] = [None] * capacity
        self.active = np.zeros(capacity, dtype=np.bool_)
        self.length = np.zeros(capacity, dtype=np.int64)
        self.out = np.zeros(capacity, dtype=np.int64)
        self.limit = np.zeros(capacity, dtype=np.int64)
        self.page_end = np.zeros(capacity, dtype=np.int64)
        self.slide_at = np.zeros(capacity, dtype=np.int64)
        self.acc = np.zeros(capacity, dtype=np.float64)
        self.joined = np.zeros(capacity, dtype=np.int64)
        self.order = np.zeros(capacity, dtype=np.int64)
        self.stream = np.zeros(capacity, dtype=np.bool_)
        self.gen = np.zeros(capacity, dtype=np.int64)  # bumped whenever a slot is vacated
        self.vacated = 0  # slots vacated so far (a plan made before a vacancy checks `gen`)
        self._free = list(range(capacity - 1, -1, -1))
        self.base = 0
        self.rows = 0
        self.log = np.zeros((rows, capacity), dtype=np.int16)
        self.ends = np.zeros(rows, dtype=np.float64)

    @property
    def count(self) -> int:
        return self.capacity - len(self._free)

    def enter(self, seq: Seq, step: int, page_size: int) -> None:
        """Seat `seq` (prefill done) in a free slot; it decodes from step `step` on."""
        slot = self._free.pop()
        assert seq.kv is not None
        self.seqs[slot] = seq
        self.active[slot] = True
        self.length[slot] = seq.prompt_len + seq.out
        self.out[slot] = seq.out
        self.limit[slot] = seq.limit
        self.page_end[slot] = seq.kv.full_pages * page_size
        self.slide_at[slot] = seq.slide_at
        self.acc[slot] = seq.acc
        self.joined[slot] = step
        self.order[slot] = seq.admit_no
        self.stream[slot] = seq.stream
        seq.slot = slot

    def leave(self, seq: Seq, step: int) -> None:
        """Vacate `seq`'s slot after step `step − 1`: write its state back, keep its token
        times."""
        slot = seq.slot
        assert slot is not None
        r0, r1 = int(self.joined[slot]) - self.base, step - self.base
        if r1 > r0:
            counts = self.log[r0:r1, slot]
            seq.segments.append(np.repeat(self.ends[r0:r1], counts))
        seq.out = int(self.out[slot])
        seq.acc = float(self.acc[slot])
        seq.slide_at = int(self.slide_at[slot])
        seq.page_end = int(self.page_end[slot])
        seq.computed = seq.prompt_len + seq.out
        seq.slot = None
        self.seqs[slot] = None
        self.active[slot] = False
        self.stream[slot] = False
        self.length[slot] = 0  # inactive slots hold length 0, so sums need no mask
        self.out[slot] = 0
        self.gen[slot] += 1
        self.vacated += 1
        self._free.append(slot)

    def record(self, step: int, end: float, n: IntArray) -> None:
        """Log step `step` (ended at `end`) with per-slot token counts `n`."""
        row = step - self.base
        if row >= len(self.ends):
            self._make_room(step)
            row = step - self.base
        self.log[row] = n
        self.ends[row] = end
        self.rows = row + 1

    def _make_room(self, step: int) -> None:
        live = self.joined[self.active]
        keep_from = int(live.min()) if live.size else step
        # A slot may have joined after the last logged row (a prefill-only step came right
        # before the log filled): keep at most the logged rows, never a negative count.
        keep_from = min(keep_from, self.base + self.rows)
        drop = keep_from - self.base
        kept = self.rows - drop
        rows = len(self.ends)
        if kept + 1 > rows // 2 or step - keep_from + 1 > rows:
            rows = max(rows * 2, step - keep_from + 1)
        log = np.zeros((rows, self.capacity), dtype=np.int16)
        ends = np.zeros(rows, dtype=np.float64)
        log[:kept] = self.log[drop : self.rows]
        ends[:kept] = self.ends[drop : self.rows]
        self.log, self.ends, self.base, self.rows = log, ends, keep_from, kept


@dataclass(slots=True)
class StepPlan:
    """One step: prefill chunks per request, and the decode slots with their token counts."""

    start: float
    prefill: dict[Seq, int] = field(default_factory=dict)
    mask: BoolArray | None = None  # decode slots in this step
    n: IntArray | None = None  # tokens each decode slot emits (0 outside `mask`)
    gen: IntArray | None = None  # slot generations when planned (a vacated slot drops out)
    vacated: int = 0  # `DecodeSlots.vacated` when planned
    accept: float = 1.0  # acceptance length of this step (1 without speculation)
    work: StepWork = field(default_factory=StepWork)

    @property
    def decode_requests(self) -> int:
        return 0 if self.mask is None else int(np.count_nonzero(self.mask))


#: `(seq, count, finished, total)`: `seq` emitted `count` tokens at the end of a step (`total`
#: so far) and ended there when `finished`.
Emission = tuple[Seq, int, bool, int]


@dataclass
class SchedulerCounters:
    """Monotonic counters (Prometheus-style totals)."""

    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    host_hits_tokens: int = 0
    window_recompute_tokens: int = 0
    busy_seconds: float = 0.0
    prefill_busy_seconds: float = 0.0  # steps that computed some prompt
    prefill_computed_tokens: int = 0  # prompt tokens computed (cache misses, recomputes)


class Scheduler:
    """Waiting queue, running set and the step logic. Single-threaded; deterministic."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, latency: LatencyModel) -> None:
        self.config = config
        self.kv = kv
        self.latency = latency
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order (the preemption order, newest last)
        self.prefilling: list[Seq] = []  # running and not yet decoding, admission order
        self.slots = DecodeSlots(config.max_running)
        self.counters = SchedulerCounters()
        spec = config.profile.spec
        self._q = latency.decode_query_tokens
        self._accept = spec.acceptance_length if spec else 1.0  # when speculating
        self._window = config.model.sliding_window
        self._P = config.page_size
        self._admitted = 0

    # --- queue ----------------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Seq) -> bool:
        """Take `seq` out (abort): release its pages. False when it is not here."""
        if seq.running:
            self._release(seq)
            return True
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute (the `queued_prefill_tokens` gauge): what is left of
        each running prefill, plus each waiting request's target beyond its prefix-cache hit as
        of now (matched without touching the cache). Requests whose KV arrives from a prefill
        worker compute nothing here and do not count."""
        n = 0
        for s in self.prefilling:
            if not s.remote_pending and s.computed < s.target:
                n += s.target - s.computed
        match = self.kv.match
        for s in self.waiting:
            if not s.remote_pending:
                n += s.target - match(s.hashes, s.target).start
        return n

    def next_ready_time(self, now: float) -> float | None:
        """Earliest time a running request that is waiting for KV becomes ready."""
        times = [s.ready_at for s in self.prefilling if s.ready_at > now]
        return min(times) if times else None

    # --- one step -------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan | None:
        """Form the next step at time `now`; None when nothing can run now."""
        plan = StepPlan(start=now)
        budget = self.config.max_batched_tokens
        P, W = self._P, self._window
        kv = self.kv
        S = self.slots
        for s in [s for s in self.prefilling if s.remote_pending and s.ready_at <= now]:
            self._remote_arrived(s)
        # 1. decodes (config guarantees max_running × block fits the budget)
        batch = S.count
        speculative = batch > 0 and self.latency.speculates(batch)
        q = self._q if speculative else 1
        accept = self._accept if speculative else 1.0
        plan.accept = accept
        if batch:
            act = S.active
            if accept == 1.0:
                n = act.astype(np.int64)
            else:
                n = np.floor(S.acc + accept).astype(np.int64)
                np.minimum(n, S.limit - S.out, out=n)
                np.maximum(n, 1, out=n)
                n[~act] = 0
            cross = (act & (S.length + n > S.page_end)).nonzero()[0]
            if cross.size:
                for slot in cross[np.argsort(S.order[cross], kind="stable")].tolist():
                    seq = S.seqs[slot]
                    if seq is None:  # preempted by an earlier crossing
                        continue
                    if self._grow(seq, int(S.length[slot] + n[slot])):
                        assert seq.kv is not None
                        S.page_end[slot] = seq.kv.full_pages * P
            plan.n = n
            budget -= batch * q
        # 2. running prefills
        for s in list(self.prefilling):
            if budget <= 0:
                break
            if not s.running or s.ready_at > now or s.computed >= s.target:
                continue
            chunk = min(s.target - s.computed, budget)
            if self._grow(s, s.computed + chunk):
                plan.prefill[s] = chunk
                budget -= chunk
        # 3. admissions
        while self.waiting and len(self.running) < self.config.max_running:
            s = self.waiting[0]
            remote = s.remote_pending
            if not remote and budget <= 0:
                break
            match = kv.match(s.hashes, s.target)
            if remote:
                chunk, end = 0, s.target
            else:
                chunk = min(s.target - match.start, budget)
                end = match.start + chunk
            if not kv.can_open(s.hashes, match, end):
                break
            self.waiting.popleft()
            self._admit(s, match, end, now)
            if s.ready_at <= now and not remote:
                plan.prefill[s] = chunk
                budget -= chunk
        # Decode slots as they stand after any preemption above.
        decoding = 0
        dctx = dwin = 0
        if batch:
            plan.mask = S.active.copy()
            plan.gen = S.gen.copy()
            plan.vacated = S.vacated
            decoding = S.count
            if decoding:
                dctx = int(S.length.sum())
                dwin = int(np.minimum(S.length, W).sum())
        if not decoding and not plan.prefill:
            return None
        pt = pkf = pkw = pctx = 0
        for s, chunk in plan.prefill.items():
            c0 = s.computed
            pt += chunk
            pkf += causal_keys(c0, chunk)
            pkw += causal_keys(c0, chunk, W)
            pctx += c0
        plan.work = StepWork(
            pt, pkf, pkw, pctx, decoding, q, dctx, dwin, draft=speculative and decoding > 0
        )
        return plan

    def complete(self, plan: StepPlan, end: float, report_all: bool = False) -> list[Emission]:
        """Apply a step that ended at `end`: KV becomes complete, tokens are emitted.

        Returns emissions for requests that finished, and for every other request that emitted
        tokens when it streams (or when `report_all`)."""
        c = self.counters
        step = c.steps
        c.steps += 1
        c.busy_seconds += end - plan.start
        if plan.work.prefill_tokens:
            c.prefill_busy_seconds += end - plan.start
            c.prefill_computed_tokens += plan.work.prefill_tokens
        kv = self.kv
        S = self.slots
        out: list[Emission] = []
        entering: list[Seq] = []
        for s, chunk in plan.prefill.items():
            if not s.running:
                continue
            old = s.computed
            s.computed = old + chunk
            assert s.kv is not None
            kv.commit(s.kv, old, s.computed)
            self._set_slide(s, s.computed)
            if s.computed < s.target:
                continue
            if s.out == 0:
                s.out = 1
                s.first_token = end
                s.segments.append(np.array([end]))
                c.generation_tokens += 1
                reason = self._done(s)
                if reason is not None:
                    self._finish(s, reason, end, step + 1)
                    out.append((s, 1, True, 1))
                    continue
                if s.stream or report_all:
                    out.append((s, 1, False, 1))
            entering.append(s)
        if plan.mask is not None and plan.n is not None and plan.gen is not None:
            if S.vacated == plan.vacated:  # the common case: nobody left mid-step
                valid, n = plan.mask, plan.n
            else:
                valid = plan.mask & (S.gen == plan.gen)
                n = np.where(valid, plan.n, 0)
            S.out += n
            S.length += n
            if plan.accept != 1.0:
                S.acc[valid] += plan.accept - n[valid]
            S.record(step, end, n)
            c.generation_tokens += int(n.sum())
            finished = valid & (S.out >= S.limit)
            slides = valid & (S.length >= S.slide_at)
            report = valid & ~finished if report_all else valid & S.stream & ~finished
            for slot in slides.nonzero()[0].tolist():
                seq = S.seqs[slot]
                assert seq is not None and seq.kv is not None
                new = int(S.length[slot])
                kv.commit(seq.kv, new - int(n[slot]), new)
                S.slide_at[slot] = self._next_slide(new)
            for slot in report.nonzero()[0].tolist():
                seq = S.seqs[slot]
                assert seq is not None
                out.append((seq, int(n[slot]), False, int(S.out[slot])))
            for slot in finished.nonzero()[0].tolist():
                seq = S.seqs[slot]
                assert seq is not None
                total = int(S.out[slot])
                seq.out = total
                reason = self._done(seq)
                assert reason is not None
                self._finish(seq, reason, end, step + 1)
                out.append((seq, int(n[slot]), True, total))
        for s in entering:
            self.prefilling.remove(s)
            S.enter(s, step + 1, self._P)
        return out

    # --- internals ------------------------------------------------------------------------

    def _done(self, s: Seq) -> FinishReason | None:
        """Why `s` ends after its latest tokens, or None when it goes on."""
        if self.config.role == "prefill":
            return "length"
        if s.out < s.limit:
            return None
        stop = s.request.output_tokens
        return "stop" if stop is not None and s.out >= stop else "length"

    def _grow(self, s: Seq, target: int) -> bool:
        """Pages for `s` up to `target` tokens, preempting the most recently admitted requests
        until they fit; False when `s` itself had to be preempted."""
        assert s.kv is not None
        kv = self.kv
        while not kv.grow(s.kv, target):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is s:
                return False
        s.page_end = s.kv.full_pages * self._P
        return True

    def _next_slide(self, seq_len: int) -> int:
        P, W = self._P, self._window
        return (max(0, seq_len - W) // P + 1) * P + W

    def _set_slide(self, s: Seq, seq_len: int) -> None:
        s.slide_at = self._next_slide(seq_len)

    def _admit(self, s: Seq, match: PrefixMatch, end: int, now: float) -> None:
        kv = self.kv
        s.kv = kv.open(s.hashes, s.request.token_ids, match)
        if not kv.grow(s.kv, end):  # can_open said yes: a failure here is a bug
            raise AssertionError("grow after can_open failed")
        s.page_end = s.kv.full_pages * self._P
        s.computed = match.start
        s.running = True
        s.ready_at = now
        self._admitted += 1
        s.admit_no = self._admitted
        self.running.append(s)
        self.prefilling.append(s)
        if s.first_scheduled is None:
            s.first_scheduled = now
            host = match.host_full * self._P
            s.host_cached = host
            s.device_cached = match.cached_tokens - host
            s.recompute = match.recompute_tokens
            c = self.counters
            c.prompt_tokens += s.prompt_len
            c.prefix_queries_tokens += s.prompt_len
            c.prefix_hits_tokens += match.cached_tokens
            c.host_hits_tokens += host
            c.window_recompute_tokens += match.recompute_tokens
        lat = self.latency
        load_bytes = lat.kv_bytes(match.host_full * self._P, match.host_window * self._P)
        load_s = lat.host_transfer_seconds(load_bytes)
        wait = load_s
        if s.remote_pending:
            rp = s.request.remote_prefill
            assert rp is not None
            if rp.transfer_seconds is not None:
                xfer = rp.transfer_seconds
            else:
                xfer = lat.pd_transfer_seconds(s.target, rp.prefill_tp, match.cached_tokens)
            s.transfer_s += xfer
            wait = max(wait, xfer)
        s.load_s += load_s
        s.ready_at = now + wait

    def _remote_arrived(self, s: Seq) -> None:
        """The prompt's KV has landed: it counts as computed, and the request decodes from the
        next step (its first token comes from this engine's first decode step)."""
        s.remote_pending = False
        old = s.computed
        s.computed = s.target
        assert s.kv is not None
        self.kv.commit(s.kv, old, s.computed)
        self._set_slide(s, s.computed)
        self.prefilling.remove(s)
        self.slots.enter(s, self.counters.steps, self._P)

    def _preempt(self, victim: Seq) -> None:
        """Release `victim`'s pages and put it back at the head of the queue to recompute."""
        self._release(victim)
        victim.computed = 0
        victim.target = victim.seq_len
        victim.ready_at = 0.0
        victim.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(victim)

    def _release(self, s: Seq, step: int | None = None) -> None:
        if s.slot is not None:
            self.slots.leave(s, self.counters.steps if step is None else step)
        else:
            self.prefilling.remove(s)
        assert s.kv is not None
        self.kv.close(s.kv)
        s.kv = None
        s.running = False
        self.running.remove(s)

    def _finish(self, s: Seq, reason: FinishReason, now: float, step: int) -> None:
        self._release(s, step)
        s.done = reason
        s.finish_time = now
