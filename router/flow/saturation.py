"""Saturation detection: is the pool too busy to take more work right now?

Formula, over the snapshot of `WorkerLoad`s last given to `observe` (one per worker)::

    per healthy worker w:
        s_w = effective_prefill_tokens / max_prefill_tokens           (always used)
        if w's scrape is fresh (scraped_age_s ≤ stale_after_s):
            s_w = max(s_w, queue_len / max_queue_len, kv_usage / max_kv_usage)
        if max_decode_itl_s is set, w has a recent decode pace (decode_itl_s), and w is not
        slower than that alone (decode_itl_alone_s < max_decode_itl_s, or not known):
            s_w = max(s_w, decode_itl_s / max_decode_itl_s)

``effective_prefill_tokens`` is the replica's own in-flight prefill tokens plus, while the scrape
is fresh, the other replicas' seen by it; ``queue_len`` the scraped waiting requests plus this
replica's own changes since the scrape (`beamserve.router.load.effective_load`): with N router
replicas behind a plain balancer, each sees the whole pool's load, not its 1/N share.
    level     = mean_w min(s_w, threshold)      (∞ when no worker is healthy: nothing can serve)
    saturated = level ≥ threshold    ⇔ every healthy worker is full

A worker past full counts as full (`cap_workers_at_threshold`): its overload is its own queue,
not the other workers'. Without the cap one worker holding a 144K-token prompt (2.2 × full)
beside an idle one averaged to 1.1, and the gate held every new session while a worker idled
— seen over HTTP at 128 agents, when a split pool had gone back to colocated at the end of a
burst (docs/bench/agentic.md, "A saturation gate that counts a worker at most full"). The projection
below still meters how much is let through before the next snapshot.

Between snapshots the detector also projects the work admitted since the last one, which the
snapshot cannot show yet (admission happens before routing books the request's load)::

    projected = level + pending_tokens / (healthy workers · max_prefill_tokens)
    pending_tokens: cost of the requests admitted since the last snapshot, minus the cost of
                    requests released since then (≥ 0); reset by each snapshot
    admits(cost)  ⇔  pending_tokens = 0  OR  projected + cost / (healthy · max_prefill_tokens)
                                                < threshold
    (with ``exempt_first=False`` the first alternative does not apply)

`admits` is what the flow controller asks before each dispatch while the pool is not saturated:
without it, the first snapshot below the threshold would release the whole backlog at once (at 1.5×
overload that is minutes of prefill queued inside the engines, where no band priority applies, and
continuing turns wait behind it). The cost is the prefill the request is expected to add, in the
level's own unit (uncached prompt tokens): `RouteRequest.admission_tokens`, the prompt past what its
session's previous turn reached — a new session's whole prompt, a continuing turn's new part
(charging a continuing turn its whole, mostly cached prompt held continuing turns back at a pool
with room: at 64 agents over HTTP their TTFT p50 was 0.40 s, 0.25 s at this cost, 0.19 s with the
gate off — docs/bench/agentic.md). The first admission after a snapshot always passes, so a request
larger than the headroom is never starved.

The per-worker terms and defaults follow llm-d's detector (``max(queue/5, kv/0.8)``, pool
average). Unlike llm-d, a stale scrape does not make a worker count as saturated: this router
always has its own in-flight prefill tokens per worker, so a scraper outage degrades to those
counts instead of stopping all admissions. Before the first snapshot the pool counts as not
saturated (start-up must be able to admit).

| parameter | default | meaning |
|---|---|---|
| `max_prefill_tokens` | ``65536`` | queued prefill tokens at which a worker is full (≈ 1.6 s) |
| `max_queue_len` | ``5`` | engine-queued requests per worker at which it is full |
| `max_kv_usage` | ``0.8`` | KV usage fraction at which a worker is full |
| `stale_after_s` | ``2.0`` | scrapes older than this are ignored |
| `threshold` | ``1.0`` | pool level at or above which the pool is saturated |
| `max_decode_itl_s` | ``0.05`` | decode seconds per token at which a worker is full (None: off) |
| `cap_workers_at_threshold` | ``true`` | a worker counts at most `threshold` in the mean |

The decode-pace term. The other terms measure prefill and queueing: they keep TTFT in bounds,
but not the speed at which each user then receives tokens. Past saturation on agent traffic
that speed is what fails first: every admitted session adds a decode to some worker's batch
and its cold prompt's prefill chunks to the steps beside the others' decodes, and at 128
agents on 4 workers most continuing turns decoded under 20 tokens/s behind every router while
their TTFT stayed near 0.2 s (docs/bench/agentic.md). `decode_itl_s` is the worker's recent
seconds per output token as this router timed its own finished requests (`LoadBook.decoded`);
with `max_decode_itl_s` set, a worker whose users decode slower than that counts as full, so
new sessions wait in the router (continuing turns are not held: `FlowConfig.hold_continuing`)
until the running ones' pace recovers — the number of sessions decoding at once settles where
they keep the pace. A worker that decodes slower than the limit even with nothing beside it
(`decode_itl_alone_s`: a CPU engine, a large model on few GPUs) is left out of the term: no
number of sessions meets the limit there, and holding them would only serialise them. The
default, 0.05 s (20 tokens/s per user), is the interactivity floor of the goodput SLO the
benchmarks use; set your own SLO's, or null to turn the term off. Not seen through Envoy
(`ext_proc`): the picker does not see the response stream, so no pace is measured there.

What it trades, measured over HTTP beside the gateways (docs/bench/agentic.md, "Decode pace"):
at 128 agents in steady state it raised goodput from 6.60 to 10.46 r/s (the best gateway 8.59)
at 0.84 × the throughput, every held new session's first turn missing the SLO instead of most
continuing turns; at 64 agents, the knee, where the gateways meet the SLO for 80 % of
continuing turns, its holds cost goodput (10.43 against 11.44 r/s without it) and first-turn
TTFT. Limits of 0.035–0.06 s and a pool-wide instead of per-worker term moved along the same
curve: more gain at 128 agents came with more loss at 64.

Config example::

    saturation: {max_queue_len: 8, max_kv_usage: 0.85}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from beamserve.router.types import WorkerLoad
from pydantic import BaseModel, ConfigDict, Field, ValidationError

M = TypeVar("M", bound=BaseModel)


class FlowConfigError(ValueError):
    """A flow-control configuration that cannot be used; names the key and the valid ones."""


def parse_strict(model: type[M], values: Mapping[str, Any] | None, where: str) -> M:
    """Validate `values` against `model`; unknown keys and bad values raise `FlowConfigError`."""
    values = dict(values or {})
    valid = sorted(model.model_fields)
    unknown = sorted(str(k) for k in set(values) - set(valid))
    if unknown:
        raise FlowConfigError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(valid)}"
        )
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise FlowConfigError(f"{where}: {key!r}: {first['msg']}") from exc


class SaturationSignal(Protocol):
    """What the flow controller asks before dispatching (a fake in tests)."""

    def saturated(self, now: float) -> bool: ...


class SaturationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_prefill_tokens: float = Field(default=65536.0, gt=0)
    max_queue_len: float = Field(default=5.0, gt=0)
    max_kv_usage: float = Field(default=0.8, gt=0)
    stale_after_s: float = Field(default=2.0, ge=0)
    threshold: float = Field(default=1.0, gt=0)
    max_decode_itl_s: float | None = Field(default=0.05, gt=0)
    cap_workers_at_threshold: bool = True

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> SaturationConfig:
        return parse_strict(cls, values, "saturation")


def worker_saturation(load: WorkerLoad, config: SaturationConfig) -> float:
    """``s_w`` of the formula (0 = idle, 1 = full)."""
    s = (max(load.prefill_tokens, 0) + max(load.foreign_prefill_tokens, 0)) / (
        config.max_prefill_tokens
    )
    if load.scraped_age_s is not None and load.scraped_age_s <= config.stale_after_s:
        s = max(s, load.queue_len / config.max_queue_len, load.kv_usage / config.max_kv_usage)
    limit = config.max_decode_itl_s
    if limit is not None and load.decode_itl_s is not None:
        alone = load.decode_itl_alone_s
        if alone is None or alone < limit:  # a limit the worker cannot meet alone steers nothing
            s = max(s, load.decode_itl_s / limit)
    return s


class SaturationDetector:
    """Pool saturation from load snapshots (formula in the module docstring)."""

    def __init__(self, config: SaturationConfig | None = None) -> None:
        self.config = config or SaturationConfig()
        self._level = 0.0
        self._observed_at: float | None = None
        self._capacity_tokens = 0.0  # healthy workers · max_prefill_tokens (0: no snapshot)
        self._pending = 0  # admitted − released since the last snapshot (tokens)

    def observe(self, loads: Sequence[WorkerLoad], now: float | None = None) -> float:
        """Take a new pool snapshot; returns the pool level."""
        healthy = [w for w in loads if w.healthy]
        if not healthy:
            self._level = math.inf
        else:
            c = self.config
            cap = c.threshold if c.cap_workers_at_threshold else math.inf
            terms = [min(worker_saturation(w, c), cap) for w in healthy]
            # every worker full is the threshold exactly (a float mean of equal terms can round
            # under it)
            self._level = cap if min(terms) >= cap else sum(terms) / len(terms)
        self._observed_at = now
        self._capacity_tokens = len(healthy) * self.config.max_prefill_tokens
        self._pending = 0
        return self._level

    def projected(self) -> float:
        """The level plus the work admitted since the last snapshot (formula above)."""
        if self._capacity_tokens <= 0:
            return self._level
        return self._level + self._pending / self._capacity_tokens

    def admits(self, cost_tokens: int, *, exempt_first: bool = True) -> bool:
        """May a request of `cost_tokens` be dispatched now without the projection reaching
        the threshold? Always True for the first admission after a snapshot, unless
        `exempt_first` is False (the caller asks for room for more than its own request)."""
        if self._capacity_tokens <= 0:
            return True
        if self._pending <= 0 and exempt_first:
            return True
        return self.projected() + cost_tokens / self._capacity_tokens < self.config.threshold

    def admitted(self, cost_tokens: int) -> None:
        """A request of `cost_tokens` was dispatched (counts until the next snapshot)."""
        self._pending += max(cost_tokens, 0)

    def released(self, cost_tokens: int) -> None:
        """A request of `cost_tokens` ended: its work has left the pool."""
        self._pending = max(self._pending - max(cost_tokens, 0), 0)

    def level(self, now: float | None = None) -> float:
        """The pool level of the last snapshot (0 before the first)."""
        return self._level

    def saturated(self, now: float) -> bool:
        return self._level >= self.config.threshold
