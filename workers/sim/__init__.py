"""`sim` — the simulated Beam engine: the test and benchmark backend.

A pure, deterministic core (continuous batching with chunked prefill, Beam's two-group paged KV
cache with a prefix cache and host tier, a roofline latency model with hardware profiles) on a
`Clock`: `VirtualClock` for in-process replays far faster than real time, `RealClock` for
serving behind HTTP. See docs/sim.md.
"""

from beamserve.workers.sim.clock import Clock, RealClock, TimerHandle, VirtualClock
from beamserve.workers.sim.config import EngineConfig, EngineConfigError, PageBudget, page_budget
from beamserve.workers.sim.engine import EngineStats, SimEngine
from beamserve.workers.sim.faults import FaultConfig, FaultConfigError
from beamserve.workers.sim.latency import LatencyModel, StepWork, pd_transfer_seconds
from beamserve.workers.sim.profiles import (
    PROFILES,
    HardwareProfile,
    MoEShape,
    ProfileError,
    SpecDecode,
    get_profile,
)
from beamserve.workers.sim.request import (
    EngineDeadError,
    RemotePrefill,
    RequestListener,
    RequestMetrics,
    RequestUpdate,
    SimRequest,
    SimRequestError,
)
from beamserve.workers.sim.streaming import stream
from beamserve.workers.sim.workload import (
    AGENTX,
    OPENHANDS,
    ReplayResult,
    SessionShape,
    Turn,
    replay_sessions,
)

__all__ = [
    "AGENTX",
    "OPENHANDS",
    "PROFILES",
    "Clock",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineStats",
    "FaultConfig",
    "FaultConfigError",
    "HardwareProfile",
    "LatencyModel",
    "MoEShape",
    "PageBudget",
    "ProfileError",
    "RealClock",
    "RemotePrefill",
    "ReplayResult",
    "RequestListener",
    "RequestMetrics",
    "RequestUpdate",
    "SessionShape",
    "SimEngine",
    "SimRequest",
    "SimRequestError",
    "SpecDecode",
    "StepWork",
    "TimerHandle",
    "Turn",
    "VirtualClock",
    "get_profile",
    "page_budget",
    "pd_transfer_seconds",
    "replay_sessions",
    "stream",
]
