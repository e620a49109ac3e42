"""`beamserve sidecar`: the decode-side reverse proxy that makes P/D happen behind a gateway.

Behind Envoy with the router as its endpoint picker (`router/grpc_api/ext_proc.py`), a request
the policy disaggregates reaches the *decode* worker's pod carrying the request header
``x-prefiller-host-port: <ip>:<port>`` (the prefill worker the picker chose). This proxy runs
beside the decode worker (same pod; llm-d calls it the routing sidecar), receives the gateway's
request, and:

- **without the header** passes it to the decode worker unchanged — any method and path, the
  body and the answer as bytes (SSE untouched), the worker's status and headers;
- **with the header**, on a client API call (`POST` `/v1/chat/completions`, `/v1/completions`,
  `/v1/messages`, `/v1/responses`), runs the prefill leg on the named worker and then the
  decode leg on the local one, handing the KV over in the style both speak (`router.pd`, the
  code the router's HTTP door uses): vLLM style — the prefill leg with
  `kv_transfer_params.do_remote_decode`, `max_tokens: 1`, its answer's `kv_transfer_params`
  into the decode leg; SGLang style — both legs at once with `bootstrap_host` /
  `bootstrap_port` / `bootstrap_room`. Chat and completions go to the workers as they came
  and their answers come back as the worker gave them (SSE bytes untouched, but for the usage
  chunk a client did not ask for); Anthropic and Responses calls are translated to chat and
  back (`router.api`, as the router's HTTP door does), since the legs run on the workers' API.

The styles are learned from the workers, never guessed (`router.facts`, as the router does):
`/v1/models` and `/server_info` of the local decode worker (at start, again until it answers)
and of each named prefill worker (cached `facts_ttl_s`, forgotten when its prefill leg fails).
SGLang's `disaggregation_mode` says who sends and receives KV; the vLLM surface has no such
report, so there the named worker is taken as the sender the picker chose and its prefill leg
is the proof: a worker that does not send KV refuses the leg or answers without
`kv_transfer_params`.

Whenever the KV cannot be handed over the request is served colocated on the decode worker
(chat and completions passed through unchanged, the others translated), counted in
`beamserve_sidecar_pd_fallbacks_total{reason}` and logged (`sidecar.pd_fallback`, with the
reason and the fix). Reasons (`FALLBACK_REASONS`): `prefill_unreachable` (its `/v1/models`
did not answer), `decode_unprobed`, `same_worker`, `style_mismatch`, `not_a_sender`,
`decode_not_a_receiver`, `no_bootstrap_port`, `incompatible`, `prefill_failed` (the vLLM
prefill leg failed, timed out or was refused: the decode worker prefills), `sglang_prefill_failed`
(the SGLang prefill leg failed: the decode worker recomputes after its own KV deadline),
`unsupported_api` (the header on anything but a client API call: passed through).

Bounds: the prefill leg `prefill_timeout_s`; connecting `connect_timeout_s`; the decode leg's
first byte, and any pause between its bytes, `first_byte_timeout_s`. A client that leaves before
the answer starts cancels the legs in flight (their connections close: the workers abort the
requests); one that leaves mid-stream closes the decode stream.

A malformed header value → 400 in the client API's error shape (Anthropic's on `/v1/messages`,
else OpenAI's), naming the header and the expected ``host:port`` form.

`/metrics` is the decode worker's exposition (so a router or Prometheus scraping the pod reads
its load metrics unchanged) followed by the sidecar's own: `beamserve_sidecar_requests_total
{mode}` (`passthrough`, `disaggregated`, `colocated`, `rejected`),
`beamserve_sidecar_pd_fallbacks_total{reason}`, `beamserve_sidecar_disaggregated_total{style}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import structlog
from beamserve.router.api import errors as api_errors
from beamserve.router.api.convert import (
    UpstreamCall,
    to_anthropic_message,
    to_responses_object,
    to_upstream,
)
from beamserve.router.api.errors import APIError
from beamserve.router.api.models import (
    API_PATHS,
    ApiName,
    ParsedRequest,
    ResponsesRequest,
    parse_request,
)
from beamserve.router.api.sse import translator_for
from beamserve.router.app import ClosingStream, unless_disconnected
from beamserve.router.facts import WorkerFacts, apply_facts, probe_facts
from beamserve.router.load import LoadBook
from beamserve.router.pd import (
    UpstreamError,
    Upstreams,
    sglang_bootstrap,
    sglang_prefill_leg_body,
)
from beamserve.router.policy import pairs_with
from beamserve.router.policy.kv_compat import bootstrap_port_of
from beamserve.router.types import Endpoint, RouteDecision
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = structlog.get_logger(__name__)
T = TypeVar("T")

PREFILLER_HEADER = "x-prefiller-host-port"
FALLBACK_REASONS = (
    "prefill_unreachable",
    "decode_unprobed",
    "same_worker",
    "style_mismatch",
    "not_a_sender",
    "decode_not_a_receiver",
    "no_bootstrap_port",
    "incompatible",
    "prefill_failed",
    "sglang_prefill_failed",
    "unsupported_api",
)
# What each refusal means and how to fix it (the log line carries it).
_FIXES = {
    "prefill_unreachable": "the named prefill worker did not answer GET /v1/models; is it up "
    "and reachable from this pod?",
    "decode_unprobed": "the local decode worker has not answered GET /v1/models yet",
    "same_worker": "the header names this pod's own decode worker; the picker should name a "
    "prefill worker",
    "style_mismatch": "the prefill and decode workers speak different handoff styles (vLLM "
    "kv_transfer_params vs SGLang bootstrap); pair workers of one engine",
    "not_a_sender": "the named worker cannot send KV (SGLang disaggregation_mode is not "
    "prefill); start it with --disaggregation-mode prefill",
    "decode_not_a_receiver": "the local worker cannot receive KV (SGLang disaggregation_mode "
    "is not decode); start it with --disaggregation-mode decode",
    "no_bootstrap_port": "the SGLang prefill worker reports no disaggregation_bootstrap_port",
    "incompatible": "the workers' revision or KV layout differ",
    "prefill_failed": "the prefill leg failed or timed out; the decode worker prefilled locally",
    "sglang_prefill_failed": "the SGLang prefill leg failed; the decode worker recomputes after "
    "its KV deadline",
    "unsupported_api": "not a client API call (POST /v1/chat/completions, /v1/completions, "
    "/v1/messages, /v1/responses): passed through to the decode worker",
}
# The client APIs the sidecar splits into legs; the workers speak the first two themselves
# (their requests and answers pass as they are), the others are translated (`router.api`).
WORKER_APIS: frozenset[ApiName] = frozenset({"chat", "completions"})
_CLIENT_APIS: dict[str, ApiName] = {path: api for api, path in API_PATHS.items()}
# Not forwarded in either direction (connection-level, or set by the HTTP client/server).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "date",  # the sidecar's server sets its own
        "server",
        PREFILLER_HEADER,
    }
)


class BadPrefillerHeader(ValueError):
    """The `x-prefiller-host-port` value is not `host:port`; the message says what was wrong."""


@dataclass(frozen=True, slots=True)
class PrefillerAddress:
    """Where the picker says the prefill leg runs: `host` (name, IPv4, or IPv6 without
    brackets) and `port` (1–65535)."""

    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def parse_prefiller(value: str) -> PrefillerAddress:
    """Parse the header's value (`10.0.1.7:8000`, `prefill-0.beam:8000`, `[fd00::7]:8000`).
    Raises `BadPrefillerHeader` naming the header and the expected form."""
    text = value.strip()

    def bad(why: str) -> BadPrefillerHeader:
        return BadPrefillerHeader(
            f"{PREFILLER_HEADER}: expected host:port (e.g. 10.0.1.7:8000 or [fd00::7]:8000), "
            f"got {value!r}: {why}"
        )

    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise bad("an IPv6 address goes in brackets, followed by :port")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise bad(f"{host!r} is not an IPv6 address") from exc
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise bad("no port")
        if ":" in host:
            raise bad("put an IPv6 address in brackets")
        if not host or any(c.isspace() or c in "/?#@[]" for c in host):
            raise bad("no valid host")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise bad("the port must be an integer from 1 to 65535")
    return PrefillerAddress(host, int(port_text))


def handoff_refusal(
    prefill: Endpoint | None, decode: Endpoint | None, *, same_worker: bool = False
) -> str | None:
    """Why the KV cannot go from `prefill` to `decode` (a `FALLBACK_REASONS` entry), or None
    when it can (`pairs_with`). None for an endpoint: its worker has not answered."""
    if decode is None:
        return "decode_unprobed"
    if prefill is None:
        return "prefill_unreachable"
    if same_worker:
        return "same_worker"
    if prefill.handoff_style != decode.handoff_style:
        return "style_mismatch"
    if not prefill.sends_kv:
        return "not_a_sender"
    if not decode.receives_kv:
        return "decode_not_a_receiver"
    if prefill.handoff_style == "sglang" and bootstrap_port_of(prefill) is None:
        return "no_bootstrap_port"
    return None if pairs_with(prefill, decode) else "incompatible"


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "beamserve_sidecar_requests",
            "Requests by how they were served: passthrough (no header), disaggregated, "
            "colocated (the header was set but the KV could not be handed over), rejected.",
            ["mode"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "beamserve_sidecar_pd_fallbacks",
            "Requests with x-prefiller-host-port served colocated, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.disaggregated = Counter(
            "beamserve_sidecar_disaggregated",
            "Requests whose prefill ran on the named prefill worker, by handoff style.",
            ["style"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class SidecarConfig:
    """What `beamserve sidecar` takes (see its --help). Times in seconds."""

    decode_url: str
    prefill_timeout_s: float = 30.0
    first_byte_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    facts_ttl_s: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024


class Sidecar:
    """The proxy (an ASGI app). `start()` probes the decode worker; `aclose()` at the end."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = c = config
        self.decode_url = c.decode_url.rstrip("/")
        self.metrics = SidecarMetrics()
        # The router's P/D legs (`router.pd`).
        self.upstreams = Upstreams(
            _no_other_prefill,
            LoadBook(),
            prefill_timeout_s=c.prefill_timeout_s,
            first_byte_timeout_s=c.first_byte_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
        )
        self._decode_seed = Endpoint(id="decode", url=self.decode_url, role="decode")
        self._decode: Endpoint | None = None
        self._prefill_facts: dict[str, tuple[float, WorkerFacts]] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # --- what the workers are --------------------------------------------------------------------
    async def decode_endpoint(self) -> Endpoint | None:
        """The local decode worker with what it reported (None until it has answered)."""
        if self._decode is None:
            facts = await probe_facts(self.upstreams.http, self._decode_seed)
            if facts is not None:
                self._decode = apply_facts(self._decode_seed, facts)
                log.info("sidecar.decode_worker", url=self.decode_url, api=facts.api)
        return self._decode

    async def prefill_endpoint(self, addr: PrefillerAddress) -> Endpoint | None:
        """The named prefill worker with what it reported (None: it did not answer)."""
        seed = Endpoint(id=addr.address, url=addr.url, role="prefill")
        cached = self._prefill_facts.get(addr.address)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.config.facts_ttl_s:
            return apply_facts(seed, cached[1])
        facts = await probe_facts(self.upstreams.http, seed)
        if facts is None:
            self._prefill_facts.pop(addr.address, None)
            return None
        self._prefill_facts[addr.address] = (now, facts)
        return apply_facts(seed, facts)

    async def start(self) -> None:
        await self.decode_endpoint()

    async def aclose(self) -> None:
        for t in list(self._background):
            t.cancel()
        await self.upstreams.aclose()

    # --- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan and websockets: nothing to do
        request = Request(scope, receive)
        response = await self.handle(request)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return Response(await self._metrics_text(), media_type="text/plain; version=0.0.4")
        client_api = _CLIENT_APIS.get(path)
        dialect: api_errors.ErrorDialect = "anthropic" if client_api == "messages" else "openai"
        value = request.headers.get(PREFILLER_HEADER)
        try:
            if value is None:
                self.metrics.requests.labels("passthrough").inc()
                return await self._passthrough(request, dialect)
            try:
                addr = parse_prefiller(value)
            except BadPrefillerHeader as exc:
                self.metrics.requests.labels("rejected").inc()
                raise api_errors.invalid_request(None, str(exc), api=dialect) from exc
            api = client_api if request.method == "POST" else None
            if api is None:
                return await self._colocated(request, dialect, "unsupported_api", addr, path)
            return await self._disaggregated(request, api, dialect, addr)
        except APIError as exc:
            error = exc.for_api(dialect)
        except Exception as exc:  # never a bare 500 with a stack trace
            log.exception("sidecar.internal_error", path=path)
            error = api_errors.upstream_failed(str(exc), api=dialect)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    async def _metrics_text(self) -> bytes:
        """The decode worker's exposition (what a router or Prometheus scraping this pod's
        port expects: its load metrics) followed by the sidecar's own families."""
        own = self.metrics.render()
        t = aiohttp.ClientTimeout(total=2.0, connect=self.config.connect_timeout_s)
        try:
            async with self.upstreams.http.get(self.decode_url + "/metrics", timeout=t) as r:
                if r.status == 200:
                    worker = await r.read()
                    return worker + (b"" if worker.endswith(b"\n") or not worker else b"\n") + own
        except (TimeoutError, aiohttp.ClientError):
            pass
        return own

    # --- colocated: the request as it came --------------------------------------------------------
    async def _colocated(
        self,
        request: Request,
        dialect: api_errors.ErrorDialect,
        reason: str,
        addr: PrefillerAddress,
        path: str,
        body: bytes | None = None,
    ) -> Response:
        self._fallback(reason, addr, path=path)
        self.metrics.requests.labels("colocated").inc()
        return await self._passthrough(request, dialect, body)

    def _fallback(self, reason: str, addr: PrefillerAddress, **detail: Any) -> None:
        self.metrics.fallbacks.labels(reason).inc()
        log.warning(
            "sidecar.pd_fallback",
            reason=reason,
            prefiller=addr.address,
            decode=self.decode_url,
            fix=_FIXES[reason],
            **detail,
        )

    async def _passthrough(
        self, request: Request, dialect: api_errors.ErrorDialect, body: bytes | None = None
    ) -> Response:
        """The request to the decode worker as it came; its answer back as bytes."""
        raw = await request.body() if body is None else body
        url = self.decode_url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]

        async def call() -> aiohttp.ClientResponse:
            return await self.upstreams.http.request(
                request.method, url, data=raw, headers=headers, timeout=self.upstreams.timeout
            )

        try:
            resp = await unless_disconnected(request, call())
        except TimeoutError as exc:
            raise api_errors.upstream_failed("no answer in time", api=dialect) from exc
        except aiohttp.ClientError as exc:
            raise api_errors.upstream_failed(f"unreachable ({exc!r})", api=dialect) from exc
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}

        async def content() -> AsyncIterator[bytes]:
            try:
                async for data in resp.content.iter_any():
                    yield data
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("sidecar.stream_broke", url=url, error=repr(exc))

        async def closed() -> None:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()  # cut short: the worker learns to abort the request

        return ClosingStream(content(), closed, status_code=resp.status, headers=out_headers)

    # --- disaggregated: prefill there, decode here ------------------------------------------------
    async def _disaggregated(
        self,
        request: Request,
        api: ApiName,
        dialect: api_errors.ErrorDialect,
        addr: PrefillerAddress,
    ) -> Response:
        raw = await request.body()
        parsed = parse_request(api, raw, self.config.max_body_bytes)
        turn = _Turn(api, dialect, parsed, to_upstream(parsed))
        decode, prefill = await asyncio.gather(self.decode_endpoint(), self.prefill_endpoint(addr))
        same = decode is not None and _address_of(decode) == (addr.host, addr.port)
        reason = handoff_refusal(prefill, decode, same_worker=same)
        if reason is not None or decode is None or prefill is None:
            reason = reason or "incompatible"
            if api in WORKER_APIS:  # the workers speak it: the request as it came
                return await self._colocated(request, dialect, reason, addr, turn.call.path, raw)
            self._fallback(reason, addr, path=turn.call.path)
            self.metrics.requests.labels("colocated").inc()
            local = decode or self._decode_seed
            return await unless_disconnected(request, self._decode_leg(turn, local, None))
        legs: list[asyncio.Task[Any]] = []
        try:
            answer, handed_over = await unless_disconnected(
                request, self._legs(turn, prefill, decode, addr, legs)
            )
        except BaseException:
            for t in legs:  # the SGLang prefill leg runs beside the decode leg: stop it too
                t.cancel()
            raise
        if handed_over:
            self.metrics.requests.labels("disaggregated").inc()
            self.metrics.disaggregated.labels(prefill.handoff_style).inc()
        else:
            self.metrics.requests.labels("colocated").inc()
        return answer

    async def _legs(
        self,
        turn: _Turn,
        prefill: Endpoint,
        decode: Endpoint,
        addr: PrefillerAddress,
        legs: list[asyncio.Task[Any]],
    ) -> tuple[Response, bool]:
        """Run the handoff: the answer, and whether the prefill ran on `prefill` (False: the
        vLLM prefill leg failed and the decode worker prefilled locally)."""
        up, call = self.upstreams, turn.call
        if prefill.handoff_style == "sglang":
            boot = sglang_bootstrap(prefill)
            leg = sglang_prefill_leg_body(call.body, boot)
            task = asyncio.create_task(up.post(prefill, call.path, leg, up.prefill_timeout_s))
            legs.append(task)
            self._background.add(task)
            task.add_done_callback(lambda t: self._sglang_prefill_done(t, addr, call.path))
            return await self._decode_leg(turn, decode, {**call.body, **boot}, task), True
        try:
            params = await up.prefill_leg(prefill, call)
        except (UpstreamError, APIError) as err:
            # A worker that sends no KV refuses the leg (4xx) or answers without the params.
            self._fallback("prefill_failed", addr, path=call.path, error=str(err))
            self._prefill_facts.pop(addr.address, None)  # ask it again next time
            return await self._decode_leg(turn, decode, None), False
        body = {**call.body, "kv_transfer_params": params}
        return await self._decode_leg(turn, decode, body), True

    def _sglang_prefill_done(
        self, task: asyncio.Task[Any], addr: PrefillerAddress, path: str
    ) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            self._fallback("sglang_prefill_failed", addr, path=path, error=str(exc))
            self._prefill_facts.pop(addr.address, None)  # ask it again next time

    async def _decode_leg(
        self,
        turn: _Turn,
        decode: Endpoint,
        body: dict[str, Any] | None,
        prefill_task: asyncio.Task[Any] | None = None,
    ) -> Response:
        """The decode leg (`body`: the call's body with the handoff fields; None: as it came).
        On the workers' APIs answered as the worker answers — JSON, or its SSE bytes (minus a
        usage chunk the client did not ask for: `to_upstream` always asks the worker for one);
        on the others translated back into the client's API (`router.api`, as the router
        does)."""
        api, call, parsed = turn.api, turn.call, turn.parsed
        leg = dataclasses.replace(call, body=body if body is not None else call.body)
        d = RouteDecision(decode=decode)
        try:
            if not call.stream:
                answer = await self.upstreams.unary(d, leg, _no_fallback)
                return JSONResponse(_client_answer(turn, answer))
            chunks = await self.upstreams.stream(d, leg, _no_fallback)
        except UpstreamError as err:
            raise api_errors.upstream_failed(str(err)) from err
        translator = translator_for(
            api,
            model=parsed.model or "",
            request=parsed.request if isinstance(parsed.request, ResponsesRequest) else None,
            stop_sequences=call.stop_sequences,
            include_usage=call.client_wants_usage,
        )

        async def content() -> AsyncIterator[bytes]:
            try:
                if api in WORKER_APIS:
                    async for data in chunks.raw(strip_usage=not call.client_wants_usage):
                        yield data
                    return
                async for chunk in chunks:
                    for frame in translator.feed(chunk):
                        yield frame
                for frame in translator.finish():
                    yield frame
            except UpstreamError as exc:
                log.warning("sidecar.decode_stream_failed", error=str(exc))
                if api not in WORKER_APIS:
                    err = api_errors.upstream_failed(str(exc), api=turn.dialect)
                    for frame in translator.fail(err):
                        yield frame

        async def closed() -> None:
            await chunks.aclose()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()  # the answer is over: nothing waits for that leg now

        return ClosingStream(content(), closed, media_type="text/event-stream")


@dataclass(frozen=True, slots=True)
class _Turn:
    """One client request on its way to the workers."""

    api: ApiName
    dialect: api_errors.ErrorDialect
    parsed: ParsedRequest
    call: UpstreamCall


def _client_answer(turn: _Turn, upstream: dict[str, Any]) -> dict[str, Any]:
    """A worker's chat completion in the client's API (as it came for the workers' APIs)."""
    model = turn.parsed.model or str(upstream.get("model") or "")
    if turn.api == "messages":
        upstream.pop("kv_transfer_params", None)
        return to_anthropic_message(upstream, model=model, stop_sequences=turn.call.stop_sequences)
    request = turn.parsed.request
    if turn.api == "responses" and isinstance(request, ResponsesRequest):
        upstream.pop("kv_transfer_params", None)
        return to_responses_object(upstream, request=request, model=model)
    return upstream


def _no_fallback(reason: str, worker: str) -> None:
    """`Upstreams` reports fallbacks only for decisions with a prefill worker: none here."""


def _address_of(ep: Endpoint) -> tuple[str | None, int | None]:
    parts = urlsplit(ep.url)
    return parts.hostname, parts.port


def _no_other_prefill() -> list[Endpoint]:
    """The picker named the prefill worker: a failed leg is not retried on another one."""
    return []


# --- `beamserve sidecar` -----------------------------------------------------------------------


def sidecar_main(args: argparse.Namespace) -> int:
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(args))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    sidecar = Sidecar(
        SidecarConfig(
            decode_url=args.decode,
            prefill_timeout_s=args.prefill_timeout_s,
            first_byte_timeout_s=args.first_byte_timeout_s,
            max_body_bytes=args.max_body_bytes,
        )
    )
    await sidecar.start()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            sidecar,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            http="httptools",
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve.done():
        await asyncio.sleep(0.01)
    decode = sidecar._decode
    host = f"[{args.host}]" if ":" in args.host else args.host
    ready = {
        "event": "sidecar_ready",
        "url": f"http://{host}:{port}",
        "decode": sidecar.decode_url,
        "decode_api": decode.api if decode is not None else None,
    }
    print(json.dumps(ready), flush=True)
    log.info("sidecar_ready", **{k: v for k, v in ready.items() if k != "event"})
    try:
        await serve
    finally:
        with contextlib.suppress(Exception):
            await sidecar.aclose()
    return 0
