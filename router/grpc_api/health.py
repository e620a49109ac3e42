"""The standard gRPC health service (`grpc.health.v1.Health`: Check and Watch), built in Python.

The Gateway API Inference Extension requires an endpoint picker to serve gRPC health checks;
`grpcio-health-checking` is not a dependency, so this module builds the two messages itself (in
a private descriptor pool, so it never collides with that package when both are imported).

Service names the router reports (`HealthState` holds one status per name):

| name | SERVING when |
|---|---|
| `""` (overall) and `liveness` | the process answers |
| `readiness` | the router can route (discovery synced) |
| `envoy.service.ext_proc.v3.ExternalProcessor` | same as readiness |
| `beamserve.router.v1.Router` | same as readiness |

Check on an unknown name fails with NOT_FOUND; Watch on one streams SERVICE_UNKNOWN, as the
protocol says.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE_NAME = "grpc.health.v1.Health"
LIVENESS = "liveness"
READINESS = "readiness"

UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _build() -> tuple[Any, Any]:
    f = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(
        name="beamserve/_vendored/grpc/health/v1/health.proto",
        package="grpc.health.v1",
        syntax="proto3",
    )
    req = fd.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    resp = fd.message_type.add(name="HealthCheckResponse")
    enum = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        enum.value.add(name=name, number=number)
    resp.field.add(
        name="status",
        number=1,
        type=f.TYPE_ENUM,
        label=f.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")
        ),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
        ),
    )


HealthCheckRequest, HealthCheckResponse = _build()


class HealthState:
    """Serving status per service name; `set` wakes every `Watch` stream on that name."""

    def __init__(self, serving: Iterable[str] = ("", LIVENESS), not_serving: Iterable[str] = ()):
        self._status: dict[str, int] = {name: SERVING for name in serving}
        self._status.update({name: NOT_SERVING for name in not_serving})
        self._watchers: dict[str, set[asyncio.Queue[int]]] = {}

    def set(self, service: str, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        if self._status.get(service) == status:
            return
        self._status[service] = status
        for queue in self._watchers.get(service, ()):
            queue.put_nowait(status)

    def set_ready(self, ready: bool, services: Iterable[str] = ()) -> None:
        """Flip `readiness` and every named service (the served gRPC services) together."""
        for name in (READINESS, *services):
            self.set(name, ready)

    def status(self, service: str) -> int | None:
        return self._status.get(service)

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        watchers = self._watchers.setdefault(request.service, set())
        watchers.add(queue)
        try:
            last = self._status.get(request.service, SERVICE_UNKNOWN)
            yield HealthCheckResponse(status=last)
            while True:
                status = await queue.get()
                if status != last:
                    last = status
                    yield HealthCheckResponse(status=status)
        finally:
            watchers.discard(queue)


def health_handler(state: HealthState) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                state.Check,
                request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                state.Watch,
                request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
        },
    )
