"""Picker `random-weighted`: draw a worker with probability proportional to its score.

Formula: ``P(w) = total(w)^(1/temperature) / Σ_v total(v)^(1/temperature)``; uniform when
every total is 0. The draw is seeded by ``stable_hash(seed, request_id)``, so the same request
replays to the same worker (reproducible benchmarks and debugging).

Intent: spread with preference — avoids herding when many requests see the same scores
between two load refreshes.

Data: the combined totals; `RouteRequest.request_id`.

| parameter | default | meaning |
|---|---|---|
| `temperature` | ``1.0`` | < 1 sharpens toward the best worker, > 1 flattens toward uniform |
| `seed` | ``""`` | mixed into every draw's seed |

Config example::

    picker:
      type: random-weighted
      params: {temperature: 0.5}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params, stable_hash
from beamserve.router.types import RouteRequest, WorkerView
from pydantic import Field

TYPE = "random-weighted"


class RandomWeightedParams(PluginParams):
    temperature: float = Field(default=1.0, gt=0.0)
    seed: str = ""


class RandomWeightedPicker:
    """Score-proportional draw, reproducible per request id."""

    type = TYPE
    reason = "random"

    def __init__(self, temperature: float = 1.0, seed: str = "") -> None:
        self.temperature = temperature
        self.seed = seed

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> RandomWeightedPicker:
        p = parse_params(RandomWeightedParams, params, f"picker {TYPE!r}")
        return cls(p.temperature, p.seed)

    def pick(
        self, request: RouteRequest, views: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> WorkerView:
        if not views:
            raise ValueError("random-weighted: no candidates to pick from")
        ordered = sorted(views, key=lambda v: v.endpoint.id)  # independent of input order
        power = 1.0 / self.temperature
        weights = [max(totals.get(v.endpoint.id, 0.0), 0.0) ** power for v in ordered]
        if sum(weights) <= 0.0:
            weights = [1.0] * len(ordered)
        rng = random.Random(stable_hash(self.seed, request.request_id))
        return rng.choices(ordered, weights=weights, k=1)[0]
