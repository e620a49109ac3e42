"""Scorer `kv-usage`: prefer the worker with the most free KV cache.

Formula: ``score = 1 − kv_usage`` when the scrape is fresh (``scraped_age_s ≤ stale_after_s``),
else ``stale_score`` (unknown occupancy is neither rewarded nor punished).

Intent: spread — keep KV headroom even so long agent contexts are not preempted or evicted.

Data: `WorkerView.load.kv_usage`, `WorkerView.load.scraped_age_s`.

| parameter | default | meaning |
|---|---|---|
| `stale_after_s` | ``2.0`` | scrapes older than this count as unknown |
| `stale_score` | ``0.5`` | score of a worker with no fresh scrape, 0–1 |

Config example::

    scorers:
      - type: kv-usage
        weight: 1
        params: {stale_after_s: 1.0}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, clamp01, parse_params
from beamserve.router.policy.load import scrape_is_fresh
from beamserve.router.types import RouteRequest, WorkerView
from pydantic import Field

TYPE = "kv-usage"


class KVUsageParams(PluginParams):
    stale_after_s: float = Field(default=2.0, ge=0)
    stale_score: float = Field(default=0.5, ge=0.0, le=1.0)


class KVUsageScorer:
    """Score = 1 − KV usage (fresh scrapes only)."""

    type = TYPE
    reason = "load"

    def __init__(self, params: KVUsageParams | None = None) -> None:
        self.params = params or KVUsageParams()

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> KVUsageScorer:
        return cls(parse_params(KVUsageParams, params, f"scorer {TYPE!r}"))

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> dict[str, float]:
        c = self.params
        return {
            v.endpoint.id: clamp01(1.0 - v.load.kv_usage)
            if scrape_is_fresh(v.load, c.stale_after_s)
            else c.stale_score
            for v in views
        }
