"""beamserve.router.bench: routing benchmarks (`beamserve bench route`, `bench route-overhead`).

Trace replays through the real router (`RoutingCore`, `PrefixIndex` fed by engine KV events,
`LoadBook`, `MemorySessionStore`, `FlowController`) on simulated Beam engines on a virtual clock.

Modules: `traces` (loaders), `replay` (the in-process replay), `oracle` (simulator-independent
hit metrics), `capacity` (SLO capacity search), `overhead` (decision latency, index memory),
`report` (metrics, table, JSON, plot), `cli` (parsers and entry points).

Names below load lazily, so importing `beamserve.router.bench.cli` for its parsers stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CapacitySearch": "capacity",
    "Probe": "capacity",
    "meets": "capacity",
    "search_capacity": "capacity",
    "BlockHits": "oracle",
    "block_hit_unbounded": "oracle",
    "oracle_hits": "oracle",
    "POLICIES": "replay",
    "PolicyRun": "replay",
    "ReplayConfig": "replay",
    "ReplayError": "replay",
    "RequestRecord": "replay",
    "RouteResult": "report",
    "oracle_result": "report",
    "summarize": "report",
    "Trace": "traces",
    "TraceError": "traces",
    "TraceRequest": "traces",
    "load_trace": "traces",
    "OverheadResult": "overhead",
    "measure_overhead": "overhead",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
