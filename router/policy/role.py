"""Filter `role`: keep the workers that can play one role (and, optionally, sit in one pool).

Formula: keep ``v`` iff ``role == "decode"`` and ``v.endpoint.can_decode``, or
``role == "prefill"`` and ``v.endpoint.can_prefill``; and, when `pool` is set,
``v.endpoint.pool == pool``. Workers with role ``both`` pass either way.

Intent: the decode step picks among decode-capable workers; the disaggregation step picks its
prefill worker among prefill-capable ones.

Data: `Endpoint.role`, `Endpoint.pool`.

| parameter | default | meaning |
|---|---|---|
| `role` | ``"decode"`` | ``"decode"`` or ``"prefill"`` |
| `pool` | ``None`` | only this pool (``None``: any) |

Config example::

    filters:
      - type: role
        params: {role: decode}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import RouteRequest, WorkerView

TYPE = "role"


class RoleParams(PluginParams):
    role: Literal["decode", "prefill"] = "decode"
    pool: str | None = None


class RoleFilter:
    """Keeps the workers able to play `role` (in `pool`, when given), in order."""

    type = TYPE

    def __init__(self, role: Literal["decode", "prefill"] = "decode", pool: str | None = None):
        self.role = role
        self.pool = pool

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> RoleFilter:
        p = parse_params(RoleParams, params, f"filter {TYPE!r}")
        return cls(p.role, p.pool)

    def filter(self, request: RouteRequest, views: Sequence[WorkerView]) -> tuple[WorkerView, ...]:
        def ok(v: WorkerView) -> bool:
            able = v.endpoint.can_decode if self.role == "decode" else v.endpoint.can_prefill
            return able and (self.pool is None or v.endpoint.pool == self.pool)

        return tuple(v for v in views if ok(v))
