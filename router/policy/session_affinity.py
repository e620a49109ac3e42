"""Scorer `session-affinity`: prefer the worker the session is bound to.

Formula: ``score = 1`` for the session's warm worker (`WorkerView.warm`), ``0`` otherwise;
every worker scores 0 for a request without a session.

Intent: affinity — a session's next turn extends its previous prompt, so its bound worker holds
that KV even when the prefix index has not yet seen the events (or was restarted). Combine
with `load` to leave a saturated worker, or use `sticky-until-saturated`, which does it by
estimated TTFT.

Data: `WorkerView.warm` (from the session store), `RouteRequest.session_id`.

Parameters: none.

Config example::

    scorers:
      - type: session-affinity
        weight: 2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import RouteRequest, WorkerView

TYPE = "session-affinity"


class SessionAffinityParams(PluginParams):
    pass


class SessionAffinityScorer:
    """Score = 1 on the session's warm worker, else 0."""

    type = TYPE
    reason = "sticky"

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> SessionAffinityScorer:
        parse_params(SessionAffinityParams, params, f"scorer {TYPE!r}")
        return cls()

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> dict[str, float]:
        has_session = request.session_id is not None
        return {v.endpoint.id: 1.0 if (has_session and v.warm) else 0.0 for v in views}
