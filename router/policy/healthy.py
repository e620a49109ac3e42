"""Filter `healthy`: drop workers that must not receive traffic.

Formula: keep ``v`` iff ``v.load.healthy``.

Intent: never route to a worker that failed its health checks or whose circuit breaker is open.
The load tracker folds both into `WorkerLoad.healthy` (health probe failing *or* circuit open →
``False``), so this filter needs no other input.

Data: `WorkerView.load.healthy`.

Parameters: none.

Config example::

    filters:
      - type: healthy
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import RouteRequest, WorkerView

TYPE = "healthy"


class HealthyParams(PluginParams):
    pass


class HealthyFilter:
    """Keeps the healthy workers, in order."""

    type = TYPE

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> HealthyFilter:
        parse_params(HealthyParams, params, f"filter {TYPE!r}")
        return cls()

    def filter(self, request: RouteRequest, views: Sequence[WorkerView]) -> tuple[WorkerView, ...]:
        return tuple(v for v in views if v.load.healthy)
