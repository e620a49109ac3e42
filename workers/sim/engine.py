"""`SimEngine`: the simulated Beam engine — scheduler, KV cache and latency model on a clock.

The engine is written once against the `Clock` protocol: each step is formed at the current
time, its duration comes from the latency model, and its results are applied by a timer at the
step's end, after which the next step starts at once. Under a `VirtualClock` the replay jumps
from step end to step end; under a `RealClock` the same code serves behind HTTP.

**Host lateness.** Under a `RealClock` the timer of a step's end runs late when the host's
cores are busy (other processes, this one's own HTTP work). A GPU does not slow down because
its host process was descheduled, so by default the next step is timed from the late step's
*planned* end, not from when its timer ran: the simulated GPU keeps its pace and the lateness
does not accumulate (`catch_up_s`: lateness up to this much is caught up; a longer stall —
a stopped process, a debugger — restarts the clock at the late time; 0 turns catching up off).
The time lost is counted (`EngineStats.step_lag_seconds`, on `/metrics` as
`beamserve_worker_step_lag_seconds`: lateness not caught up, by which every later step ends
later — all of it with catching up off). Under a `VirtualClock` timers are never late and
none of this applies.

Threading: every method must be called on the clock's thread (the asyncio loop for
`RealClock`); listeners and the KV event sink are called there too and must not block.

Public surface (what an HTTP server, an admin endpoint and a router replay call):

- `submit(request, listener)`: queue a request; the listener gets a `RequestUpdate` for every
  step that emits its tokens and a final one (with `RequestMetrics`) when it ends;
- `abort(request_id)`; `stats()`; `ready` / `alive`;
- `set_faults(FaultConfig)` / `faults`; `kill(reason)` / `revive()`; `reset_prefix_cache()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from beamserve.kvwire.events import FULL_GROUP, WINDOW_GROUP, KVEventBatch, KVEventSink
from beamserve.workers.sim.clock import Clock, TimerHandle
from beamserve.workers.sim.config import EngineConfig
from beamserve.workers.sim.faults import FaultConfig, FaultInjector
from beamserve.workers.sim.kv_cache import KVCacheManager
from beamserve.workers.sim.latency import LatencyModel
from beamserve.workers.sim.request import (
    EngineDeadError,
    FinishReason,
    RequestListener,
    RequestMetrics,
    RequestUpdate,
    SimRequest,
    SimRequestError,
)
from beamserve.workers.sim.scheduler import Emission, Scheduler, Seq, StepPlan


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for `/metrics` (vLLM names in brackets).

    Gauges: `running` [num_requests_running], `waiting` [num_requests_waiting],
    `full_usage` / `window_usage` [kv_cache_usage_perc, as a fraction]: pages held by live
    requests over the pool (cached, evictable blocks do not count); `full_cached_pages` /
    `window_cached_pages`: evictable cached blocks; `host_full_blocks` / `host_window_blocks`.
    Counters: tokens in prompts, generated, queried against and hit in the prefix cache
    [prefix_cache_queries / prefix_cache_hits], host-tier hits, window tokens recomputed,
    preemptions, steps, finished / failed requests, KV batches emitted / dropped;
    `busy_seconds`: clock seconds spent in steps, `prefill_busy_seconds` those in steps that
    computed some prompt, `prefill_computed_tokens`: prompt tokens computed (misses and
    recomputes; cache hits are not). `queued_prefill_tokens`: prompt tokens still
    to compute for requests waiting or in prefill (`Scheduler.queued_prefill_tokens`; no vLLM
    or SGLang counterpart on `/metrics`). `step_lag_seconds`: time lost to late step-end
    timers (module docstring, "Host lateness").
    """

    time: float
    alive: bool
    running: int
    waiting: int
    full_pages: int
    window_pages: int
    full_usage: float
    window_usage: float
    full_cached_pages: int
    window_cached_pages: int
    host_full_blocks: int
    host_window_blocks: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    host_cache_hits_tokens: int
    window_recompute_tokens: int
    preemptions_total: int
    steps_total: int
    busy_seconds: float
    requests_finished_total: int
    requests_failed_total: int
    kv_event_batches_total: int
    kv_event_batches_dropped: int
    queued_prefill_tokens: int = 0
    step_lag_seconds: float = 0.0  # time lost to late step-end timers (module docstring)
    prefill_busy_seconds: float = 0.0
    prefill_computed_tokens: int = 0


# Step-end lateness up to this is caught up (module docstring, "Host lateness"): far above a
# busy host's scheduling delays (milliseconds), far below a stopped process's.
DEFAULT_CATCH_UP_S = 0.25


class SimEngine:
    """One simulated engine instance (one TP group) on a clock. See the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Clock,
        *,
        kv_events: KVEventSink | None = None,
        faults: FaultConfig | None = None,
        catch_up_s: float = DEFAULT_CATCH_UP_S,
    ) -> None:
        if catch_up_s < 0:
            raise ValueError(f"catch_up_s: must be ≥ 0 (0 = off), got {catch_up_s}")
        self.config = config
        self.clock = clock
        self.catch_up_s = catch_up_s
        self._lag_s = 0.0
        self.latency = LatencyModel(config.profile)
        self._sink = kv_events
        self._faults = FaultInjector(faults)
        self._kv = self._new_cache()
        self._sched = Scheduler(config, self._kv, self.latency)
        self._seqs: dict[str, Seq] = {}
        self._alive = True
        self._death: str | None = None
        self._in_flight: StepPlan | None = None
        self._timer: TimerHandle | None = None
        self._timer_at = 0.0
        self._in_callback = False
        self._finished = 0
        self._failed = 0
        self._batches = 0
        self._dropped = 0

    # --- public surface -------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def ready(self) -> bool:
        """True while the engine can serve (what a readiness probe reports)."""
        return self._alive

    @property
    def faults(self) -> FaultConfig:
        return self._faults.config

    def set_faults(self, faults: FaultConfig) -> None:
        """Replace the injected faults (the admin endpoint's call); takes effect at once."""
        self._faults.set(faults)

    def submit(
        self,
        request: SimRequest,
        listener: RequestListener | None = None,
        *,
        stream: bool = True,
    ) -> None:
        """Queue `request` (at `request.arrival_time` if that is later than now).

        The listener gets an update for every step that emits tokens (`stream=True`) or only
        the final one (`stream=False`, cheaper for replays).

        Raises `SimRequestError` for a request the engine can never serve (duplicate id, prompt
        larger than the page budget) and `EngineDeadError` after the engine died. Injected
        request failures arrive through the listener (finish reason `error`), never raised.
        """
        if not self._alive:
            raise EngineDeadError(f"engine is dead ({self._death}); revive() it first")
        rid = request.request_id
        if rid in self._seqs:
            raise SimRequestError(f"{rid}: a request with this id is already in the engine")
        P = self.config.page_size
        hashes = request.hashes(P)
        if len(set(hashes)) != len(hashes):
            raise SimRequestError(f"{rid}: block_hashes repeat; give one distinct id per block")
        limit = 1 if self.config.role == "prefill" else request.output_limit
        need = -(-(request.prompt_tokens + limit) // P)
        if need > self.config.full_pages:
            raise SimRequestError(
                f"{rid}: needs {need} full-attention pages for {request.prompt_tokens} prompt + "
                f"{limit} output tokens but the engine has {self.config.full_pages}; shorten "
                "the prompt or give the engine more KV memory"
            )
        now = self.clock.now()
        arrival = now if request.arrival_time is None else max(now, request.arrival_time)
        if request.remote_prefill is not None and self.config.role == "prefill":
            request = _without_remote(request)
        seq = Seq(request, hashes, arrival, limit, listener, stream)
        self._seqs[rid] = seq
        if arrival > now:
            self.clock.call_at(arrival, lambda: self._arrive(seq))
        else:
            self._arrive(seq)

    def abort(self, request_id: str) -> bool:
        """End a request now (finish reason `abort`); False when it is unknown or done."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return False
        self._sched.remove(seq)
        self._end(seq, "abort", None)
        self._flush_events()
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (vLLM `/reset_prefix_cache`); emits
        `AllBlocksCleared`. Returns the device pages freed."""
        freed = self._kv.clear()
        self._flush_events()
        return freed

    def kill(self, reason: str = "killed") -> None:
        """Die now: every request ends with an error, new ones are refused, no more events."""
        if not self._alive:
            return
        self._alive = False
        self._death = reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._in_flight = None
        for seq in list(self._seqs.values()):
            if seq.finish_reason is None:
                if seq.running or seq in self._sched.waiting:
                    self._sched.remove(seq)
                self._end(seq, "error", f"engine died: {reason}")
        self._kv.take_events()

    def revive(self) -> None:
        """Come back empty after `kill` (a restart): fresh cache, `AllBlocksCleared` sent."""
        if self._alive:
            return
        self._kv = self._new_cache()
        self._sched = Scheduler(self.config, self._kv, self.latency)
        self._seqs.clear()
        self._alive = True
        self._death = None
        self._kv.clear()
        self._flush_events()

    def stats(self) -> EngineStats:
        kv, c, cfg = self._kv, self._sched.counters, self.config
        return EngineStats(
            time=self.clock.now(),
            alive=self._alive,
            running=len(self._sched.running),
            waiting=len(self._sched.waiting),
            full_pages=cfg.full_pages,
            window_pages=cfg.window_pages,
            full_usage=(kv.used(FULL_GROUP) - kv.evictable(FULL_GROUP)) / cfg.full_pages,
            window_usage=(kv.used(WINDOW_GROUP) - kv.evictable(WINDOW_GROUP)) / cfg.window_pages,
            full_cached_pages=kv.evictable(FULL_GROUP),
            window_cached_pages=kv.evictable(WINDOW_GROUP),
            host_full_blocks=len(kv.host[FULL_GROUP]),
            host_window_blocks=len(kv.host[WINDOW_GROUP]),
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            prefix_cache_queries_tokens=c.prefix_queries_tokens,
            prefix_cache_hits_tokens=c.prefix_hits_tokens,
            host_cache_hits_tokens=c.host_hits_tokens,
            window_recompute_tokens=c.window_recompute_tokens,
            preemptions_total=c.preemptions,
            steps_total=c.steps,
            busy_seconds=c.busy_seconds,
            requests_finished_total=self._finished,
            requests_failed_total=self._failed,
            kv_event_batches_total=self._batches,
            kv_event_batches_dropped=self._dropped,
            queued_prefill_tokens=self._sched.queued_prefill_tokens(),
            step_lag_seconds=self._lag_s,
            prefill_busy_seconds=c.prefill_busy_seconds,
            prefill_computed_tokens=c.prefill_computed_tokens,
        )

    @property
    def kv_cache(self) -> KVCacheManager:
        """The cache itself, for tests and introspection (read only)."""
        return self._kv

    # --- the step loop --------------------------------------------------------------------

    def _new_cache(self) -> KVCacheManager:
        cfg = self.config
        return KVCacheManager(
            cfg.model,
            page_size=cfg.page_size,
            full_pages=cfg.full_pages,
            window_pages=cfg.window_pages,
            host_full_pages=cfg.host_full_pages,
            host_window_pages=cfg.host_window_pages,
            enable_prefix_cache=cfg.enable_prefix_cache,
        )

    def _arrive(self, seq: Seq) -> None:
        if not self._alive or seq.finish_reason is not None:
            return
        if self._faults.request_fails():
            self._failed += 1
            self._end(seq, "error", "injected failure")
            return
        self._sched.add(seq)
        self._kick()

    def _kick(self) -> None:
        """Make sure a step starts now unless one is running or about to start."""
        if self._in_flight is not None or self._in_callback or not self._alive:
            return
        now = self.clock.now()
        if self._timer is not None:
            if self._timer_at <= now:
                return
            self._timer.cancel()
        self._set_timer(now, self._on_wake)

    def _set_timer(self, when: float, callback: Callable[[], None]) -> None:
        self._timer_at = when
        self._timer = self.clock.call_at(when, callback)

    def _on_wake(self) -> None:
        self._timer = None
        self._in_callback = True
        try:
            self._start_step()
        finally:
            self._in_callback = False

    def _start_step(self, resume_at: float | None = None) -> None:
        """Form and time the next step. `resume_at`: the previous step's planned end, when its
        timer ran late (module docstring, "Host lateness"): this step's time runs from there."""
        if not self._alive:
            return
        now = self.clock.now()
        plan = self._sched.schedule(now)
        if plan is None:
            self._flush_events()
            wake = self._sched.next_ready_time(now)
            if wake is not None:
                self._set_timer(wake, self._on_wake)
            return
        self._in_flight = plan
        dt = self.latency.step_seconds(plan.work) * self._faults.slowdown
        self._set_timer((now if resume_at is None else resume_at) + dt, self._on_step_end)

    def _on_step_end(self) -> None:
        self._timer = None
        plan = self._in_flight
        self._in_flight = None
        if plan is None or not self._alive:
            return
        self._in_callback = True
        try:
            now = self.clock.now()
            late = now - self._timer_at
            resume_at = None
            if 0 < late <= self.catch_up_s:
                resume_at = self._timer_at  # caught up: the next step keeps the GPU's pace
            elif late > 0:
                self._lag_s += late  # lost: every later step ends this much later
            dying = self._faults.token_allowance() is not None
            emissions = self._sched.complete(plan, now, report_all=dying)
            self._deliver(emissions, now, dying)
            self._flush_events()
            self._start_step(resume_at)
        finally:
            self._in_callback = False

    def _deliver(self, emissions: list[Emission], now: float, dying: bool) -> None:
        vocab = self.config.vocab_size
        allowance = self._faults.token_allowance() if dying else None
        for k, (seq, count, done, total) in enumerate(emissions):
            if allowance == 0:
                self._die_before(emissions[k:])
                return
            n = count
            if allowance is not None:
                n = min(count, allowance)
                allowance -= n
                if n < count:  # dies mid-step: only `n` of these tokens leave the engine
                    seq.token_cap = total - (count - n)
                    total -= count - n
            if n > 0:
                if done and n == count:
                    self._end(seq, seq.done or "length", None, n)
                elif seq.stream and seq.listener is not None:
                    seq.listener(
                        RequestUpdate(
                            seq.request_id, now, n, total, token_seed=seq.seed, vocab_size=vocab
                        )
                    )
            if dying and self._faults.tokens_emitted(n):
                self._die_before(emissions[k + 1 :])
                return

    def _die_before(self, undelivered: list[Emission]) -> None:
        """Die now: the tokens of `undelivered` never left the engine."""
        for seq, count, _, total in undelivered:
            seq.token_cap = total - count
        self.kill("injected: die_after_tokens")

    def _end(
        self,
        seq: Seq,
        reason: FinishReason,
        error: str | None,
        new_tokens: int = 0,
    ) -> None:
        now = self.clock.now()
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = now
        self._seqs.pop(seq.request_id, None)
        if reason in ("stop", "length"):
            self._finished += 1
        metrics = _metrics(seq, now)
        if seq.listener is not None:
            seq.listener(
                RequestUpdate(
                    seq.request_id,
                    now,
                    new_tokens,
                    metrics.output_tokens,
                    finished=True,
                    finish_reason=reason,
                    error=error,
                    metrics=metrics,
                    token_seed=seq.seed,
                    vocab_size=self.config.vocab_size,
                )
            )

    def _flush_events(self) -> None:
        events = self._kv.take_events()
        if not events or not self._alive:
            return
        batch = KVEventBatch(self.clock.now(), tuple(events), self.config.data_parallel_rank)
        self._batches += 1
        if self._faults.kv_batch_fate() == "drop":
            self._dropped += 1
            return
        sink = self._sink
        if sink is None:
            return
        delay = self._faults.kv_event_delay_s
        if delay > 0:
            self.clock.call_at(batch.ts + delay, lambda: sink(batch))
        else:
            sink(batch)


def _without_remote(request: SimRequest) -> SimRequest:
    from dataclasses import replace

    return replace(request, remote_prefill=None)


def _metrics(seq: Seq, now: float) -> RequestMetrics:
    times = seq.token_times()
    return RequestMetrics(
        request_id=seq.request_id,
        arrival_time=seq.arrival,
        first_scheduled_time=seq.first_scheduled,
        first_token_time=times[0] if times else None,
        finish_time=now,
        token_times=times,
        prompt_tokens=seq.prompt_len,
        device_cached_tokens=seq.device_cached,
        host_cached_tokens=seq.host_cached,
        window_recompute_tokens=seq.recompute,
        host_load_seconds=seq.load_s,
        kv_transfer_seconds=seq.transfer_s,
        preemptions=seq.preemptions,
        finish_reason=seq.finish_reason or "error",
        error=seq.error,
    )
