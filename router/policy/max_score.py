"""Picker `max-score`: the worker with the highest combined score; ties broken by a stable hash.

Formula: ``tied = {w : total(w) ≥ max_total − tie_epsilon}``; pick
``argmin_{w ∈ tied} stable_hash(session_id or request_id, w.id)``.

Intent: deterministic — identical inputs give identical picks on every router replica and after
restarts — yet not biased to the first worker: requests (or sessions) with different ids spread
over tied workers, so a cold start or an all-miss request does not pile onto one worker
(sglang#32983). A session breaks its ties the same way every turn.

Data: the combined totals; `RouteRequest.session_id` / `request_id`.

| parameter | default | meaning |
|---|---|---|
| `tie_epsilon` | ``1e-9`` | totals this close to the best count as tied |

Config example::

    picker:
      type: max-score
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, break_tie, parse_params
from beamserve.router.types import RouteRequest, WorkerView
from pydantic import Field

TYPE = "max-score"


class MaxScoreParams(PluginParams):
    tie_epsilon: float = Field(default=1e-9, ge=0.0)


class MaxScorePicker:
    """Highest total wins; ties broken by `break_tie`."""

    type = TYPE
    reason = "tie"

    def __init__(self, tie_epsilon: float = 1e-9) -> None:
        self.tie_epsilon = tie_epsilon

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> MaxScorePicker:
        return cls(parse_params(MaxScoreParams, params, f"picker {TYPE!r}").tie_epsilon)

    def pick(
        self, request: RouteRequest, views: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> WorkerView:
        if not views:
            raise ValueError("max-score: no candidates to pick from")
        best = max(totals.get(v.endpoint.id, 0.0) for v in views)
        tied = [v for v in views if totals.get(v.endpoint.id, 0.0) >= best - self.tie_epsilon]
        return break_tie(request, tied)
