"""The router's gRPC services: the Envoy ext_proc endpoint picker (Gateway API Inference
Extension protocol), the native `beamserve.router.v1.Router` service, and gRPC health.

Public API::

    serve(port, ext_proc_pick, route, *, host, health_state, ready, ext_proc_config)
        -> grpc.aio.Server (started)
    build_server(...) -> (grpc.aio.Server, bound_port, HealthState)   # not started
    ExternalProcessor(pick, config)       # envoy.service.ext_proc.v3 servicer
    PickResult.picked / .unavailable / .shed;  Pick = async (headers, body) -> PickResult
    RouterService(route), RouterStub(channel);  Route = async (RouteQuery) -> RouteDecision
    RouteRejected(status, message, retry_after_s=None)   # raise from pick or route
    HealthState
"""

from .errors import RouteRejected
from .ext_proc import ExternalProcessor, ExtProcConfig, Pick, PickResult
from .health import HealthState
from .router_service import (
    Route,
    RouteQuery,
    RouterService,
    RouterStub,
    build_server,
    serve,
)

__all__ = [
    "ExtProcConfig",
    "ExternalProcessor",
    "HealthState",
    "Pick",
    "PickResult",
    "Route",
    "RouteQuery",
    "RouteRejected",
    "RouterService",
    "RouterStub",
    "build_server",
    "serve",
]
