"""Saturation detection: is the pool too busy to take more work right now?

Formula, over the snapshot of `WorkerLoad`s last given to `observe` (one per worker)::

    per healthy worker w:
        s_w = prefill_tokens / max_prefill_tokens                     (router-tracked, always used)
        if w's scrape is fresh (scraped_age_s ≤ stale_after_s):
            s_w = max(s_w, queue_len / max_queue_len, kv_usage / max_kv_usage)
    level     = mean_w s_w           (∞ when no worker is healthy: nothing can serve)
    saturated = level ≥ threshold

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

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> SaturationConfig:
        return parse_strict(cls, values, "saturation")


def worker_saturation(load: WorkerLoad, config: SaturationConfig) -> float:
    """``s_w`` of the formula (0 = idle, 1 = full)."""
    s = max(load.prefill_tokens, 0) / config.max_prefill_tokens
    if load.scraped_age_s is not None and load.scraped_age_s <= config.stale_after_s:
        s = max(s, load.queue_len / config.max_queue_len, load.kv_usage / config.max_kv_usage)
    return s


class SaturationDetector:
    """Pool saturation from load snapshots (formula in the module docstring)."""

    def __init__(self, config: SaturationConfig | None = None) -> None:
        self.config = config or SaturationConfig()
        self._level = 0.0
        self._observed_at: float | None = None

    def observe(self, loads: Sequence[WorkerLoad], now: float | None = None) -> float:
        """Take a new pool snapshot; returns the pool level."""
        healthy = [w for w in loads if w.healthy]
        if not healthy:
            self._level = math.inf
        else:
            self._level = sum(worker_saturation(w, self.config) for w in healthy) / len(healthy)
        self._observed_at = now
        return self._level

    def level(self, now: float | None = None) -> float:
        """The pool level of the last snapshot (0 before the first)."""
        return self._level

    def saturated(self, now: float) -> bool:
        return self._level >= self.config.threshold
