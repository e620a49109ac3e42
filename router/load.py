"""Per-worker load and health as the router sees it (`LoadBook`).

Router-tracked load: for every request it sends, the router adds the request's uncached prompt
tokens to the worker's *prefill* tokens until the first token arrives, then moves its context
(prompt + max output) to *decode* tokens until the request ends. These counts are exact for this
router replica and never stale.

Scraped load: `queue_len`, `running` and `kv_usage` from the engine's `/metrics` (vLLM or SGLang
names), stamped with the scrape time; consumers see their age and discount stale scrapes.

Health: a circuit breaker per worker. `failure_threshold` consecutive failures (connection
errors, 5xx before the first byte, failed health checks) open it for `open_s` seconds; then one
probe is let through (half-open); a success closes it, a failure re-opens it. Active health
checks (`/health`) feed the same breaker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from beamserve.router.types import WorkerLoad

# Engine metric names → what they mean (REFERENCE.md, "Metrics names engines expose").
QUEUE_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
LOAD_METRICS = QUEUE_METRICS + RUNNING_METRICS + KV_USAGE_METRICS


@dataclass
class _Worker:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    in_flight: int = 0
    queue_len: int = 0
    running: int = 0
    kv_usage: float = 0.0
    scraped_at: float | None = None
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False
    served: int = 0


_IDLE = WorkerLoad()  # a worker the book has never seen: no load, never scraped, healthy


@dataclass(frozen=True)
class BreakerParams:
    failure_threshold: int = 3
    open_s: float = 10.0


@dataclass
class Flight:
    """One request's contribution to a worker's load (see `LoadBook.start`)."""

    worker: str
    prefill_tokens: int
    context_tokens: int
    prefilling: bool = True
    done: bool = False
    prefill_worker: str | None = None


@dataclass
class LoadBook:
    """See the module docstring. Single-threaded (the router's event loop)."""

    breaker: BreakerParams = field(default_factory=BreakerParams)
    clock: Callable[[], float] = time.monotonic
    _workers: dict[str, _Worker] = field(default_factory=dict)

    def _w(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        return w

    def forget(self, keep: Iterable[str]) -> None:
        """Drop workers that left (discovery)."""
        keep = set(keep)
        for wid in [w for w in self._workers if w not in keep]:
            del self._workers[wid]

    # --- router-tracked load -------------------------------------------------------------------
    def start(
        self,
        decode: str,
        uncached_tokens: int,
        context_tokens: int,
        prefill: str | None = None,
    ) -> Flight:
        """A request was sent: its uncached prompt counts as prefill work on `prefill` (or on
        `decode` when it prefills locally)."""
        f = Flight(decode, uncached_tokens, context_tokens, prefill_worker=prefill)
        for wid in (decode, prefill):
            if wid is not None:
                self.probing(wid)  # a half-open breaker lets only this request through
        target = self._w(prefill or decode)
        target.prefill_tokens += uncached_tokens
        d = self._w(decode)
        d.in_flight += 1
        if prefill is not None:
            target.in_flight += 1
        return f

    def first_token(self, f: Flight) -> None:
        """The prefill part is done: its context now loads the decode worker."""
        if not f.prefilling or f.done:
            return
        f.prefilling = False
        p = self._w(f.prefill_worker or f.worker)
        p.prefill_tokens -= f.prefill_tokens
        if f.prefill_worker is not None:
            p.in_flight -= 1
        self._w(f.worker).decode_tokens += f.context_tokens

    def finish(self, f: Flight) -> None:
        if f.done:
            return
        if f.prefilling:
            p = self._w(f.prefill_worker or f.worker)
            p.prefill_tokens -= f.prefill_tokens
            if f.prefill_worker is not None:
                p.in_flight -= 1
        else:
            self._w(f.worker).decode_tokens -= f.context_tokens
        d = self._w(f.worker)
        d.in_flight -= 1
        d.served += 1
        f.done = True

    # --- scraped load ----------------------------------------------------------------------------
    def scraped(self, worker: str, samples: dict[str, float], now: float | None = None) -> None:
        """Record an engine `/metrics` scrape (sample name → value, summed over labels)."""
        w = self._w(worker)
        for names, attr in (
            (QUEUE_METRICS, "queue_len"),
            (RUNNING_METRICS, "running"),
            (KV_USAGE_METRICS, "kv_usage"),
        ):
            for n in names:
                if n in samples:
                    v = samples[n]
                    setattr(w, attr, v if attr == "kv_usage" else int(v))
                    break
        w.scraped_at = self.clock() if now is None else now

    # --- health ----------------------------------------------------------------------------------
    def succeeded(self, worker: str) -> None:
        w = self._w(worker)
        w.failures, w.open_until, w.probing = 0, 0.0, False

    def failed(self, worker: str) -> None:
        w = self._w(worker)
        w.failures += 1
        w.probing = False
        if w.failures >= self.breaker.failure_threshold:
            w.open_until = self.clock() + self.breaker.open_s

    def healthy(self, worker: str, now: float | None = None) -> bool:
        """False while the breaker is open; when it times out, one probe request passes."""
        w = self._workers.get(worker)
        if w is None or w.failures < self.breaker.failure_threshold:
            return True
        now = self.clock() if now is None else now
        if now < w.open_until:
            return False
        return not w.probing  # half-open: the caller that picks it is the probe

    def probing(self, worker: str) -> None:
        w = self._w(worker)
        if w.failures >= self.breaker.failure_threshold:
            w.probing = True

    def breaker_open(self, worker: str) -> bool:
        return not self.healthy(worker)

    # --- views -----------------------------------------------------------------------------------
    def load(self, worker: str, now: float | None = None) -> WorkerLoad:
        w = self._workers.get(worker)
        if w is None:
            return _IDLE
        now = self.clock() if now is None else now
        at = w.scraped_at
        return WorkerLoad(
            w.prefill_tokens if w.prefill_tokens > 0 else 0,
            w.decode_tokens if w.decode_tokens > 0 else 0,
            w.in_flight if w.in_flight > 0 else 0,
            w.queue_len,
            w.running,
            w.kv_usage,
            None if at is None else (now - at if now > at else 0.0),
            # `healthy`, inlined for the common closed breaker (this runs per worker per route).
            w.failures < self.breaker.failure_threshold or self.healthy(worker, now),
        )

    def served(self, worker: str) -> int:
        w = self._workers.get(worker)
        return 0 if w is None else w.served
