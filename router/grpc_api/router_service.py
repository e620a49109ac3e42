"""The native `beamserve.router.v1.Router` service, and one gRPC server for all router services.

`Route(RouteRequest) -> RouteDecision` (contract: `proto/beamserve/router/v1/router.proto`)
turns the wire message into a `RouteQuery`, awaits the injected `route(query) -> RouteDecision`
(`beamserve.router.types.RouteDecision`) and sends the decision back. A `RouteRejected` raised by
`route` becomes UNAVAILABLE (503) / RESOURCE_EXHAUSTED (429) / INVALID_ARGUMENT (400) with a
`retry-after` trailer when known; any other exception becomes INTERNAL.

`build_server` / `serve` bind, on one port: the Envoy ext_proc endpoint picker
(`ext_proc.ExternalProcessor`), this service, and the standard gRPC health service
(`health.HealthState`; pass `ready=False` and your own state to hold readiness at NOT_SERVING
(`readiness` and both services) until discovery has synced, then
`state.set_ready(True, [...])`).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast
from urllib.parse import urlsplit

import grpc
import structlog

from ..types import BANDS, Band, Endpoint, RouteDecision, RouteRequest
from . import ext_proc, health, router_v1
from .errors import RouteRejected, retry_after_header

log = structlog.get_logger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # long agent prompts travel as text or token ids


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """One `Route` call as the router sees it (the wire `RouteRequest`, validated).

    At most one prompt form is set (`prompt`, `token_ids`, `block_hashes`; None: not sent).
    `prompt_tokens`: as sent, or `len(token_ids)` when sent as 0 with token ids. `band` None:
    the router decides. `headers`: lower-case keys, read-only.
    """

    request_id: str
    model: str = ""
    session_id: str | None = None
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] | None = None
    prompt_tokens: int = 0
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    max_tokens: int = 0
    turn: int = 0
    band: Band | None = None

    def to_route_request(
        self,
        *,
        block_hashes: tuple[int, ...] | None = None,
        default_band: Band = "new",
        default_max_tokens: int = 256,
    ) -> RouteRequest:
        """The policies' `RouteRequest`; `block_hashes` overrides the sent ones (pass the
        hashes of `prompt` / `token_ids` once the caller has computed them)."""
        hashes = block_hashes if block_hashes is not None else (self.block_hashes or ())
        return RouteRequest(
            request_id=self.request_id,
            prompt_tokens=self.prompt_tokens,
            block_hashes=hashes,
            session_id=self.session_id,
            turn=self.turn,
            band=self.band or default_band,
            max_tokens=self.max_tokens or default_max_tokens,
            model=self.model,
        )


Route = Callable[[RouteQuery], Awaitable[RouteDecision]]


def query_from_message(msg: Any) -> RouteQuery:
    """Validate a wire `RouteRequest`; `RouteRejected(400)` names the offending field."""
    forms = [
        name
        for name, present in (
            ("prompt", bool(msg.prompt)),
            ("token_ids", len(msg.token_ids) > 0),
            ("block_hashes", len(msg.block_hashes) > 0),
        )
        if present
    ]
    if len(forms) > 1:
        raise RouteRejected(
            400, f"set at most one of prompt, token_ids, block_hashes; got {', '.join(forms)}"
        )
    if msg.band and msg.band not in BANDS:
        raise RouteRejected(400, f"unknown band {msg.band!r}; valid: {', '.join(BANDS)}")
    token_ids = tuple(msg.token_ids) if msg.token_ids else None
    prompt_tokens = msg.prompt_tokens or (len(token_ids) if token_ids else 0)
    return RouteQuery(
        request_id=msg.request_id or uuid.uuid4().hex,
        model=msg.model,
        session_id=msg.session_id or None,
        prompt=msg.prompt or None,
        token_ids=token_ids,
        block_hashes=tuple(msg.block_hashes) if msg.block_hashes else None,
        prompt_tokens=prompt_tokens,
        headers=MappingProxyType({k.lower(): v for k, v in msg.headers.items()}),
        max_tokens=msg.max_tokens,
        turn=msg.turn,
        band=cast(Band, msg.band) if msg.band else None,
    )


def endpoint_message(endpoint: Endpoint) -> Any:
    parts = urlsplit(endpoint.url)
    address = parts.netloc.rsplit("@", 1)[-1]
    return router_v1.Endpoint(
        id=endpoint.id,
        url=endpoint.url,
        address=address,
        role=endpoint.role,
        pool=endpoint.pool,
        revision=endpoint.revision,
        engine=endpoint.engine,
    )


def decision_message(decision: RouteDecision) -> Any:
    msg = router_v1.RouteDecision(
        decode_endpoint=endpoint_message(decision.decode),
        expected_hit_blocks=decision.expected_hit.full_blocks,
        expected_hit_kind=decision.expected_hit.kind,
        reason=decision.reason,
        explain=decision.explain,
        scores=dict(decision.scores),
    )
    if decision.prefill is not None:
        msg.prefill_endpoint.CopyFrom(endpoint_message(decision.prefill))
    return msg


class RouterService:
    """`beamserve.router.v1.Router` backed by an injected async `route`."""

    def __init__(self, route: Route) -> None:
        self._route = route

    async def Route(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            query = query_from_message(request)
            decision = await self._route(query)
        except RouteRejected as e:
            retry = retry_after_header(e.retry_after_s)
            if retry is not None:
                context.set_trailing_metadata((("retry-after", retry),))
            await context.abort(e.grpc_code, e.message)
        except Exception as e:
            log.exception("route failed", request_id=request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"route failed: {type(e).__name__}")
        return decision_message(decision)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            router_v1.SERVICE_NAME,
            {
                "Route": grpc.unary_unary_rpc_method_handler(
                    self.Route,
                    request_deserializer=router_v1.RouteRequest.FromString,
                    response_serializer=router_v1.RouteDecision.SerializeToString,
                )
            },
        )


class RouterStub:
    """Client for `beamserve.router.v1.Router` on a `grpc.aio.Channel`."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Route = channel.unary_unary(
            router_v1.ROUTE_METHOD,
            request_serializer=router_v1.RouteRequest.SerializeToString,
            response_deserializer=router_v1.RouteDecision.FromString,
        )


def build_server(
    port: int,
    ext_proc_pick: ext_proc.Pick | None,
    route: Route | None,
    *,
    host: str = "[::]",
    health_state: health.HealthState | None = None,
    ready: bool = True,
    ext_proc_config: ext_proc.ExtProcConfig | None = None,
) -> tuple[grpc.aio.Server, int, health.HealthState]:
    """A not-yet-started server with the given services bound; returns it, the bound port (`port`
    0 picks a free one) and its health state. Call inside the event loop that will serve it."""
    served = [
        name
        for name, on in ((EXT_PROC_SERVICE, ext_proc_pick), (router_v1.SERVICE_NAME, route))
        if on is not None
    ]
    if not served:
        raise ValueError("build_server needs ext_proc_pick, route, or both")
    state = health_state or health.HealthState()
    state.set_ready(ready, served)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    if ext_proc_pick is not None:
        ext_proc.add_to_server(server, ext_proc_pick, ext_proc_config)
    handlers = [health.health_handler(state)]
    if route is not None:
        handlers.append(RouterService(route).handler())
    server.add_generic_rpc_handlers(tuple(handlers))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}; choose a free port")
    return server, bound, state


async def serve(
    port: int,
    ext_proc_pick: ext_proc.Pick | None,
    route: Route | None,
    *,
    host: str = "[::]",
    health_state: health.HealthState | None = None,
    ready: bool = True,
    ext_proc_config: ext_proc.ExtProcConfig | None = None,
) -> grpc.aio.Server:
    """Bind and start the router's gRPC services on `port`; stop with `await server.stop(grace)`."""
    server, bound, _ = build_server(
        port,
        ext_proc_pick,
        route,
        host=host,
        health_state=health_state,
        ready=ready,
        ext_proc_config=ext_proc_config,
    )
    await server.start()
    log.info("grpc serving", port=bound)
    return server
