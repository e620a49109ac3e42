"""Envoy `ext_proc` v3 endpoint picker (Gateway API Inference Extension protocol).

A gateway (Envoy, or any data plane implementing the endpoint-picker protocol) opens one
`ExternalProcessor.Process` stream per HTTP request. The router reads the request, picks a
worker, and answers with the picked `ip:port` twice, as the protocol requires, with equal values:

* request header `x-gateway-destination-endpoint: ip:port` (set, overwriting a client's), and
* dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port"}}`.

A disaggregated pick also sets `x-prefiller-host-port: ip:port` (the prefill worker); the
decode pod's `beamserve sidecar` (`router/sidecar.py`) runs the prefill leg there — a decode
worker without one ignores the header and serves the request colocated.

Fallbacks go in the same value, comma-separated (`ip:port,ip:port`): the data plane tries them
in order. When no endpoint fits the router answers an `ImmediateResponse` with 503; when flow
control sheds the request, 429 (both with `Retry-After` when known and a JSON error body in the
shape of the client's API: Anthropic's for `/v1/messages`, OpenAI's otherwise).

Message sequence, `FULL_DUPLEX_STREAMED` request body mode (the supported mode)::

    data plane                                    router
    request_headers (end_of_stream=false)  ──▶    keep headers; no answer yet
    request_body chunk … (end_of_stream)   ──▶    buffer; at end of stream: pick(headers, body)
                                           ◀──    request_headers: HeadersResponse
                                                  (header mutation, clear_route_cache)
                                                  + dynamic_metadata
                                           ◀──    request_body: streamed_response chunks
                                                  (≤ 62,000 B each; the body byte-identical;
                                                  end_of_stream on the last)
    [request_trailers                      ──▶    pick at this point instead; body chunks end
                                                  without end_of_stream, then TrailersResponse]
    response_headers                       ──▶    HeadersResponse (continue)
    response_body chunk …                  ──▶    streamed_response echoing each chunk
    response_trailers                      ──▶    TrailersResponse (continue)

A request without a body (`end_of_stream` on its headers) is picked at once with an empty body.
`BUFFERED` mode (announced in `protocol_config`) works too: headers get a plain continue, the
single body message gets the header mutation, metadata and body in its BodyResponse. `NONE`
picks on headers. `STREAMED` / `BUFFERED_PARTIAL` / `GRPC` cannot work (headers leave before
the body is known) and end the stream with FAILED_PRECONDITION naming the fix. Without
`protocol_config` (older data planes) the processor assumes `FULL_DUPLEX_STREAMED`.

The data plane may restrict the choice with filter metadata
`{"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["ip:port", ...]}}`; the
picker sees it as the header `x-gateway-destination-endpoint-subset` (comma-separated; a
client-sent header of that name is dropped and removed upstream). An empty subset is answered
503 without calling the picker; a pick outside the subset is answered 503 too.

No Envoy binary is available here: tests drive this servicer over real gRPC with a client that
sends Envoy's documented message sequence. Envoy's `message_timeout` (200 ms by default) bounds
how long `pick` may take, queueing included: raise it in the gateway's ext_proc configuration
when flow control queues requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .errors import RouteRejected, retry_after_header

log = structlog.get_logger(__name__)

DESTINATION_ENDPOINT_KEY = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# Some data planes cap one streamed chunk at 64 KiB; stay under it with a margin.
STREAMED_CHUNK_BYTES = 62_000

_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


ResponseEvent = Literal["headers", "end", "closed"]
ResponseHook = Callable[[ResponseEvent, int], None]
"""`hook(event, status)`: ``headers`` when the upstream's response headers pass (`status` its
HTTP status), then ``end`` when the response ends (end of stream or trailers), or ``closed``
when the ext_proc stream ends without it. ``end`` / ``closed``: exactly one, once."""


@dataclass(frozen=True, slots=True)
class PickResult:
    """What the picker decided for one HTTP request.

    Either `endpoint` (`ip:port`, IPv6 as `[addr]:port`) with optional `fallbacks` and extra
    request headers to set upstream (`set_headers`, e.g. the prefill worker for P/D), or a
    refusal: `endpoint` None and `status` 4xx/5xx (503: nothing fits, 429: shed) with `message`
    and `retry_after_s`. `on_response`: told how the upstream's response goes (`ResponseHook`),
    so the picker can close what it booked for the request.
    """

    endpoint: str | None = None
    fallbacks: tuple[str, ...] = ()
    set_headers: tuple[tuple[str, str], ...] = ()
    status: int = 200
    message: str = ""
    retry_after_s: float | None = None
    on_response: ResponseHook | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.endpoint is None:
            if not 400 <= self.status <= 599:
                raise ValueError(
                    f"PickResult without endpoint needs an error status 400-599, got "
                    f"{self.status}; use PickResult.unavailable() or PickResult.shed()"
                )
            return
        if self.status != 200:
            raise ValueError(f"PickResult with an endpoint must have status 200, got {self.status}")
        for ep in (self.endpoint, *self.fallbacks):
            if not _valid_endpoint(ep):
                raise ValueError(f"endpoint {ep!r} is not ip:port (IPv6 as [addr]:port)")

    @classmethod
    def picked(
        cls,
        endpoint: str,
        *,
        fallbacks: Sequence[str] = (),
        set_headers: Sequence[tuple[str, str]] = (),
        on_response: ResponseHook | None = None,
    ) -> PickResult:
        return cls(
            endpoint=endpoint,
            fallbacks=tuple(fallbacks),
            set_headers=tuple(set_headers),
            on_response=on_response,
        )

    @classmethod
    def unavailable(cls, message: str, *, retry_after_s: float | None = None) -> PickResult:
        """503: no endpoint fits the request."""
        return cls(status=503, message=message, retry_after_s=retry_after_s)

    @classmethod
    def shed(cls, message: str, *, retry_after_s: float | None = 1.0) -> PickResult:
        """429: flow control drops the request."""
        return cls(status=429, message=message, retry_after_s=retry_after_s)

    @property
    def destination(self) -> str:
        """The protocol value: primary endpoint then fallbacks, comma-separated."""
        if self.endpoint is None:
            raise ValueError("a refused PickResult has no destination")
        return ",".join((self.endpoint, *self.fallbacks))


Pick = Callable[[Mapping[str, str], bytes], Awaitable[PickResult]]
"""`pick(headers, body)`: headers lower-cased (pseudo-headers `:path`, `:method`, `:authority`
included, repeated headers joined with `, `), body the complete request body. May raise
`RouteRejected` instead of returning a refusal."""


def _valid_endpoint(value: str) -> bool:
    m = _ENDPOINT_RE.match(value)
    return m is not None and 0 < int(m.group(2)) < 65536


@dataclass(frozen=True, slots=True)
class ExtProcConfig:
    """Limits and names of the endpoint picker (defaults follow the protocol).

    | parameter | default | meaning |
    |---|---|---|
    | `max_body_bytes` | 64 MiB | a longer request body is answered 413 |
    | `chunk_bytes` | 62,000 | largest streamed body chunk sent back |
    | `destination_header` | `x-gateway-destination-endpoint` | header and metadata key |
    | `metadata_namespace` | `envoy.lb` | dynamic metadata namespace of the pick |
    """

    max_body_bytes: int = 64 * 1024 * 1024
    chunk_bytes: int = STREAMED_CHUNK_BYTES
    destination_header: str = DESTINATION_ENDPOINT_KEY
    metadata_namespace: str = DESTINATION_METADATA_NAMESPACE

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.max_body_bytes <= 0:
            raise ValueError("chunk_bytes and max_body_bytes must be positive")


class ExternalProcessor:
    """`envoy.service.ext_proc.v3.ExternalProcessor` backed by an injected async `pick`."""

    def __init__(self, pick: Pick, config: ExtProcConfig | None = None) -> None:
        self._pick = pick
        self._config = config or ExtProcConfig()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self._pick, self._config)
        try:
            async for response in self._process(exchange, request_iterator, context):
                yield response
        finally:
            exchange.closed()

    async def _process(
        self,
        exchange: _Exchange,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for request in request_iterator:
            responses, done = await exchange.handle(request)
            if request.observability_mode:
                continue  # the data plane ignores answers in observability mode
            for response in responses:
                yield response
            if done:
                return
            if exchange.unsupported_mode is not None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request_body_mode {exchange.unsupported_mode} cannot carry an endpoint "
                    "pick (headers leave before the body is known); configure the gateway's "
                    "ext_proc processing_mode with request_body_mode FULL_DUPLEX_STREAMED",
                )


class _Exchange:
    """State of one HTTP request/response pair on one ext_proc stream."""

    def __init__(self, pick: Pick, config: ExtProcConfig) -> None:
        self._pick = pick
        self._config = config
        self._request_mode: int = _BodyMode.FULL_DUPLEX_STREAMED
        self._response_mode: int = _BodyMode.FULL_DUPLEX_STREAMED
        self._headers: dict[str, str] = {}
        self._client_sent_subset = False
        self._subset: tuple[str, ...] | None = None
        self._body = bytearray()
        self._picked = False
        self._hook: ResponseHook | None = None
        self.unsupported_mode: str | None = None

    def _tell(self, event: ResponseEvent, status: int = 0) -> None:
        hook = self._hook
        if hook is None:
            return
        if event != "headers":
            self._hook = None  # `end` or `closed`: once
        try:
            hook(event, status)
        except Exception:
            log.exception("ext_proc response hook failed", event=event)

    def closed(self) -> None:
        """The ext_proc stream ended (or broke): close what the pick opened, if still open."""
        self._tell("closed")

    async def handle(self, req: pb.ProcessingRequest) -> tuple[list[pb.ProcessingResponse], bool]:
        """Answers for one data-plane message, and whether the stream is finished."""
        if req.HasField("protocol_config"):
            self._request_mode = req.protocol_config.request_body_mode
            self._response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(req)
        if kind == "request_body":
            return await self._on_request_body(req.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind == "response_headers":
            self._tell("headers", _status_of(req.response_headers.headers))
            if req.response_headers.end_of_stream:
                self._tell("end")
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())], False
        if kind == "response_body":
            if req.response_body.end_of_stream:
                self._tell("end")
            return self._on_response_body(req.response_body), False
        if kind == "response_trailers":
            self._tell("end")
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())], False
        return [], False

    # -- request path ----------------------------------------------------------------------

    async def _on_request_headers(
        self, req: pb.ProcessingRequest
    ) -> tuple[list[pb.ProcessingResponse], bool]:
        self._headers, self._client_sent_subset = _read_headers(req.request_headers.headers)
        self._subset = _read_subset(req.metadata_context)
        if self._subset is not None:
            self._headers[SUBSET_HINT_KEY] = ",".join(self._subset)
        mode = self._request_mode
        if req.request_headers.end_of_stream or mode == _BodyMode.NONE:
            return await self._pick_and_answer(body_responses=False, eos=True)
        if mode == _BodyMode.BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())], False
        if mode != _BodyMode.FULL_DUPLEX_STREAMED:
            self.unsupported_mode = _BodyMode.Name(mode)
            return [], False
        return [], False

    async def _on_request_body(
        self, chunk: pb.HttpBody
    ) -> tuple[list[pb.ProcessingResponse], bool]:
        if self._picked:  # a data plane bug; answer the chunk unchanged rather than hang
            return [_body_response(chunk.body, chunk.end_of_stream)], False
        self._body += chunk.body
        if len(self._body) > self._config.max_body_bytes:
            return [
                self._refusal(
                    RouteRejected(
                        413,
                        f"request body over {self._config.max_body_bytes} bytes; raise "
                        "ExtProcConfig.max_body_bytes or send a shorter request",
                    )
                )
            ], True
        if self._request_mode == _BodyMode.BUFFERED:
            return await self._pick_and_answer(body_responses=True, eos=True, buffered=True)
        if chunk.end_of_stream:
            return await self._pick_and_answer(body_responses=True, eos=True)
        return [], False

    async def _on_request_trailers(self) -> tuple[list[pb.ProcessingResponse], bool]:
        trailers = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        if self._picked:
            return [trailers], False
        responses, done = await self._pick_and_answer(body_responses=True, eos=False)
        return ([*responses, trailers] if not done else responses), done

    async def _pick_and_answer(
        self, *, body_responses: bool, eos: bool, buffered: bool = False
    ) -> tuple[list[pb.ProcessingResponse], bool]:
        self._picked = True
        body = bytes(self._body)
        self._body.clear()
        result = await self._decide(body)
        self._hook = result.on_response
        if result.endpoint is None:
            return [
                self._refusal(
                    RouteRejected(result.status, result.message, retry_after_s=result.retry_after_s)
                )
            ], True
        # The body goes back unchanged; Content-Length is restated because the data plane drops
        # it when a processor may stream the body back (FULL_DUPLEX_STREAMED).
        body_len = len(body) if body_responses and not buffered else None
        common = pb.CommonResponse(
            header_mutation=self._header_mutation(result, body_len), clear_route_cache=True
        )
        metadata = self._dynamic_metadata(result.destination)
        log.debug("ext_proc picked", endpoint=result.destination, path=self._headers.get(":path"))
        if buffered:  # BUFFERED: header mutations ride on the body response; body untouched
            resp = pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
            )
            return [resp], False
        out = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        ]
        if body_responses:
            out.extend(_streamed_body(body, self._config.chunk_bytes, eos=eos))
        return out, False

    async def _decide(self, body: bytes) -> PickResult:
        if self._subset is not None and not self._subset:
            return PickResult.unavailable("the gateway's endpoint subset is empty")
        try:
            result = await self._pick(dict(self._headers), body)
        except RouteRejected as e:
            return PickResult(status=e.status, message=e.message, retry_after_s=e.retry_after_s)
        except Exception as e:
            log.exception("ext_proc pick failed", path=self._headers.get(":path"))
            return PickResult(status=500, message=f"endpoint picker error: {type(e).__name__}")
        if (
            result.endpoint is not None
            and self._subset is not None
            and result.endpoint not in self._subset
        ):
            log.warning("pick outside subset", endpoint=result.endpoint, subset=self._subset)
            if result.on_response is not None:
                result.on_response("closed", 0)  # nothing goes upstream: release the pick
            return PickResult.unavailable(
                f"picked endpoint {result.endpoint} is outside the gateway's endpoint subset"
            )
        return result

    def _header_mutation(self, result: PickResult, body_len: int | None) -> pb.HeaderMutation:
        sets = [(self._config.destination_header, result.destination), *result.set_headers]
        if body_len:
            sets.append(("content-length", str(body_len)))
        mutation = pb.HeaderMutation(set_headers=[_header_option(k, v) for k, v in sets])
        if self._client_sent_subset:
            mutation.remove_headers.append(SUBSET_HINT_KEY)
        return mutation

    def _dynamic_metadata(self, destination: str) -> struct_pb2.Struct:
        metadata = struct_pb2.Struct()
        metadata.update(
            {self._config.metadata_namespace: {self._config.destination_header: destination}}
        )
        return metadata

    def _refusal(self, rejection: RouteRejected) -> pb.ProcessingResponse:
        path = self._headers.get(":path", "")
        api: Literal["anthropic", "openai"] = (
            "anthropic" if path.split("?", 1)[0].rstrip("/").endswith("/v1/messages") else "openai"
        )
        log.info("ext_proc refused", status=rejection.status, reason=rejection.message, path=path)
        return immediate_response(
            rejection.status, rejection.message, retry_after_s=rejection.retry_after_s, api=api
        )

    # -- response path ---------------------------------------------------------------------

    def _on_response_body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._response_mode == _BodyMode.FULL_DUPLEX_STREAMED:
            return [
                pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(
                                streamed_response=pb.StreamedBodyResponse(
                                    body=chunk.body, end_of_stream=chunk.end_of_stream
                                )
                            )
                        )
                    )
                )
            ]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]


def _status_of(header_map: base_pb2.HeaderMap) -> int:
    """The `:status` pseudo-header of a response (0 when absent or not a number)."""
    for h in header_map.headers:
        if h.key == ":status":
            value = h.raw_value.decode("ascii", "replace") if h.raw_value else h.value
            return int(value) if value.isdigit() else 0
    return 0


def _read_headers(header_map: base_pb2.HeaderMap) -> tuple[dict[str, str], bool]:
    """Header dict (keys lower-case, repeats joined with `, `), and whether the client sent
    its own subset header (dropped: only the data plane's metadata may restrict the pick)."""
    headers: dict[str, str] = {}
    client_subset = False
    for h in header_map.headers:
        key = h.key.lower()
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        if key == SUBSET_HINT_KEY:
            client_subset = True
            continue
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers, client_subset


def _read_subset(metadata: base_pb2.Metadata) -> tuple[str, ...] | None:
    if SUBSET_HINT_NAMESPACE not in metadata.filter_metadata:
        return None
    ns = metadata.filter_metadata[SUBSET_HINT_NAMESPACE]
    if SUBSET_HINT_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_HINT_KEY]
    if value.WhichOneof("kind") == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    if value.WhichOneof("kind") == "string_value":  # tolerate "a:1,b:2"
        return tuple(s.strip() for s in value.string_value.split(",") if s.strip())
    return ()


def _header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _body_response(body: bytes, eos: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=eos)
                )
            )
        )
    )


def _streamed_body(body: bytes, chunk_bytes: int, *, eos: bool) -> list[pb.ProcessingResponse]:
    """The body as streamed_response chunks of at most `chunk_bytes`; `eos` on the last one.
    An empty body still gets one (empty) chunk so the data plane sees the end of stream."""
    if not body:
        return [_body_response(b"", eos)]
    starts = range(0, len(body), chunk_bytes)
    last = starts[-1]
    return [_body_response(body[i : i + chunk_bytes], eos and i == last) for i in starts]


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def error_body(status: int, message: str, api: Literal["openai", "anthropic"] = "openai") -> bytes:
    """A JSON error in the client API's own shape."""
    if api == "anthropic":
        etype = _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        return json.dumps({"type": "error", "error": {"type": etype, "message": message}}).encode()
    etype = _OPENAI_ERROR_TYPES.get(status, "server_error")
    payload = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return json.dumps(payload).encode()


def immediate_response(
    status: int,
    message: str,
    *,
    retry_after_s: float | None = None,
    api: Literal["openai", "anthropic"] = "openai",
) -> pb.ProcessingResponse:
    """An `ImmediateResponse` with `status`, a JSON error body and `Retry-After` when known."""
    headers = [("content-type", "application/json")]
    retry = retry_after_header(retry_after_s)
    if retry is not None:
        headers.append(("retry-after", retry))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_header_option(k, v) for k, v in headers]),
            body=error_body(status, message, api),
            details=f"beamserve_picker_{status}",
        )
    )


def add_to_server(server: grpc.aio.Server, pick: Pick, config: ExtProcConfig | None = None) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(pick, config), server)
