"""beamserve.router.flow: admission control in front of routing — priority bands, least
attained service between tenants, a saturation gate, bounded queues with TTL and shedding.

Entry point: ``ticket = await FlowController(...).admit(band, tenant, cost_tokens)``, then
``ticket.release(service_tokens)`` (or ``async with ticket:``); `Shed` when not admitted.
"""

from beamserve.router.flow.controller import (
    SHED_REASONS,
    FlowConfig,
    FlowController,
    FlowStats,
    PrefillStage,
    Shed,
    ShedReason,
    Ticket,
)
from beamserve.router.flow.fairness import AttainedService, service_tokens
from beamserve.router.flow.saturation import (
    FlowConfigError,
    SaturationConfig,
    SaturationDetector,
    SaturationSignal,
    worker_saturation,
)

__all__ = [
    "SHED_REASONS",
    "AttainedService",
    "FlowConfig",
    "FlowConfigError",
    "FlowController",
    "FlowStats",
    "PrefillStage",
    "SaturationConfig",
    "SaturationDetector",
    "SaturationSignal",
    "Shed",
    "ShedReason",
    "Ticket",
    "service_tokens",
    "worker_saturation",
]
