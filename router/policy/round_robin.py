"""Picker `round-robin`: cycle through the candidates, ignoring scores (a benchmark baseline).

Formula: candidates sorted by `Endpoint.id`; pick ``sorted[n mod len]`` where ``n`` counts this
picker's previous picks. Stateful: one counter per picker instance (per router replica).

Intent: spread, blind — the baseline every cache-aware policy must beat.

Data: none beyond the candidates' ids.

Parameters: none.

Config example::

    picker:
      type: round-robin
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import RouteRequest, WorkerView

TYPE = "round-robin"


class RoundRobinParams(PluginParams):
    pass


class RoundRobinPicker:
    """Next candidate in id order, every call."""

    type = TYPE
    reason = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> RoundRobinPicker:
        parse_params(RoundRobinParams, params, f"picker {TYPE!r}")
        return cls()

    def pick(
        self, request: RouteRequest, views: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> WorkerView:
        if not views:
            raise ValueError("round-robin: no candidates to pick from")
        ordered = sorted(views, key=lambda v: v.endpoint.id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen
