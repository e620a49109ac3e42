"""Scorer `load`: prefer the least loaded worker, from router-tracked counts and, when fresh,
the engine's scraped metrics.

Formula::

    p = prefill_tokens / prefill_token_scale                  (router-tracked prefill backlog)
    d = decode_tokens  / decode_token_scale                   (router-tracked decode context)
    if the scrape is fresh (scraped_age_s ≤ stale_after_s):
        p = max(p, queue_len / queue_scale)                   (engine's waiting queue)
        d = max(d, kv_usage  / kv_scale)                      (engine's KV occupancy)
    score = 1 / (1 + p + d)

The router's counts cover only requests this replica sent but are always current; the scrape
also sees other replicas' requests but lags. Taking the larger of each pair adds what the
scrape knows without counting the same backlog twice. A scrape older than `stale_after_s` (or
none yet) is ignored in favour of the router-tracked counts. ``1 / (1 + load)`` keeps every
score in (0, 1], strictly decreasing in load, without a hard capacity at which scores clip.

Intent: spread — balance prefill backlog (TTFT) and decode occupancy (TPOT) across workers.

Data: `WorkerView.load` (`prefill_tokens`, `decode_tokens`, `queue_len`, `kv_usage`,
`scraped_age_s`).

| parameter | default | meaning |
|---|---|---|
| `prefill_token_scale` | ``32768`` | queued prefill tokens that count as one unit (≈ 1 s) |
| `decode_token_scale` | ``4194304`` | decode context tokens that count as one unit |
| `queue_scale` | ``4`` | engine-queued requests that count as one unit |
| `kv_scale` | ``0.8`` | KV usage fraction that counts as one unit |
| `stale_after_s` | ``2.0`` | scrapes older than this are ignored |

Config example::

    scorers:
      - type: load
        weight: 2
        params: {prefill_token_scale: 65536, stale_after_s: 1.0}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import RouteRequest, WorkerLoad, WorkerView
from pydantic import Field

TYPE = "load"


class LoadParams(PluginParams):
    prefill_token_scale: float = Field(default=32768.0, gt=0)
    decode_token_scale: float = Field(default=4194304.0, gt=0)
    queue_scale: float = Field(default=4.0, gt=0)
    kv_scale: float = Field(default=0.8, gt=0)
    stale_after_s: float = Field(default=2.0, ge=0)


def scrape_is_fresh(load: WorkerLoad, stale_after_s: float) -> bool:
    """True when the engine metrics were scraped at most `stale_after_s` seconds ago."""
    return load.scraped_age_s is not None and load.scraped_age_s <= stale_after_s


class LoadScorer:
    """Score = 1 / (1 + prefill load + decode load)."""

    type = TYPE
    reason = "load"

    def __init__(self, params: LoadParams | None = None) -> None:
        self.params = params or LoadParams()

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> LoadScorer:
        return cls(parse_params(LoadParams, params, f"scorer {TYPE!r}"))

    def load_units(self, load: WorkerLoad) -> float:
        """The ``p + d`` of the formula (≥ 0)."""
        c = self.params
        p = max(load.prefill_tokens, 0) / c.prefill_token_scale
        d = max(load.decode_tokens, 0) / c.decode_token_scale
        if scrape_is_fresh(load, c.stale_after_s):
            p = max(p, max(load.queue_len, 0) / c.queue_scale)
            d = max(d, max(load.kv_usage, 0.0) / c.kv_scale)
        return p + d

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> dict[str, float]:
        return {v.endpoint.id: 1.0 / (1.0 + self.load_units(v.load)) for v in views}
