"""Least-attained-service (LAS) accounting: how much service each tenant received lately.

Formula: each tenant's attained service ``a`` (tokens) decays exponentially with half-life
``h``::

    a(t) = a(t₀) · 2^(−(t − t₀) / h)            then a ← max(0, a + Δ) at each charge

Charges: the flow controller charges a request's `cost_tokens` when it dispatches it
(provisional, so a tenant with many requests in flight is not treated as idle) and corrects by
``service_tokens − cost_tokens`` when its ticket is released. `service_tokens` is what the
request consumed; llm-d counts ``input + 2 × output`` tokens (`service_tokens`). Within a band,
the queued request whose tenant has the least decayed service goes first; the half-life (60 s,
llm-d's) forgets old service so a tenant that was busy a while ago is not starved now.
"""

from __future__ import annotations

DEFAULT_HALF_LIFE_S = 60.0
_PRUNE_AT = 10_000  # tenants remembered before forgotten ones (< 1 token) are dropped


def service_tokens(input_tokens: int, output_tokens: int, *, output_weight: float = 2.0) -> int:
    """Service a finished request received: ``input + output_weight × output`` tokens."""
    return int(max(input_tokens, 0) + output_weight * max(output_tokens, 0))


class AttainedService:
    """Per-tenant decayed service counters (formula in the module docstring)."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, not {half_life_s}")
        self.half_life_s = half_life_s
        self._value: dict[str, tuple[float, float]] = {}  # tenant → (value, as of time)

    def value(self, tenant: str, now: float) -> float:
        v, t = self._value.get(tenant, (0.0, now))
        decay: float = 0.5 ** (max(now - t, 0.0) / self.half_life_s)
        return v * decay

    def charge(self, tenant: str, tokens: float, now: float) -> None:
        """Add `tokens` (may be negative: a correction) to the tenant's decayed value, ≥ 0."""
        self._value[tenant] = (max(self.value(tenant, now) + tokens, 0.0), now)
        if len(self._value) > _PRUNE_AT:
            self._value = {
                k: (v, t) for k, (v, t) in self._value.items() if self.value(k, now) >= 1.0
            }

    def __len__(self) -> int:
        return len(self._value)
