"""Sending one routed request to its workers: plain, or prefill/decode disaggregated.

Handoff style per prefill worker's engine (DESIGN.md §3):

- vLLM style (vLLM, `sim`, `ref` workers): two legs. The prefill leg is the request with
  `max_tokens: 1`, `stream: false` and `kv_transfer_params: {do_remote_decode: true, …}`; its
  answer's `kv_transfer_params` go unchanged into the decode leg, which streams the answer.
  A failed or timed-out prefill leg is retried once on another prefill worker that pairs with
  the decode worker (same revision and KV layout); if none is left, the decode worker prefills
  locally (`pd_fallbacks_total{reason="local_prefill"}`) — the client never waits on a dead
  prefill worker longer than `prefill_timeout_s`.
- SGLang style (workers labelled `api=sglang`, or SGLang engines): both legs at once, carrying
  `bootstrap_host` / `bootstrap_port` (the prefill worker's bootstrap port, label
  `bootstrap_port`) / `bootstrap_room` (random u63); the decode leg's answer is streamed. If the
  prefill leg fails, the decode worker recomputes after its own KV deadline.

Errors: connection failures, timeouts and 5xx answers before the first byte raise
`UpstreamError` (the caller retries on another worker); a worker's 4xx is the client's fault and
is returned as an `APIError` in the client's shape; after the first byte the caller ends the
stream with an error event.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import structlog
from beamserve.router.api.convert import UpstreamCall
from beamserve.router.api.errors import APIError
from beamserve.router.api.sse import SSEScanner, UpstreamSSEDecoder
from beamserve.router.load import LoadBook
from beamserve.router.policy import pairs_with
from beamserve.router.policy.kv_compat import bootstrap_port_of
from beamserve.router.types import Endpoint, RouteDecision

log = structlog.get_logger(__name__)


def dump_body(body: Any) -> bytes:
    """A request body's bytes for a worker: orjson, or the standard encoder for what orjson
    cannot write (an integer outside 64 bits, which the body parser keeps exact)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


FallbackHook = Callable[[str, str], None]  # (reason, failed worker id)
PrefillDoneHook = Callable[[], None]  # the prefill leg answered (`RoutingCore.prefill_hook`)
SentHook = Callable[[], None]  # the decode call's body is on its way to the worker
# Worker calls are encoded with orjson (a 100K-token conversation is ~0.5 MB of JSON).
JSON_HEADERS = {"content-type": "application/json"}
KEEPALIVE_S = 4.0
# After a stream's `[DONE]`, how long to wait for the end of its HTTP body (to keep the
# connection: `UpstreamChunks.aclose`)
DRAIN_S = 1.0


class UpstreamError(RuntimeError):
    """A worker failed before the first byte; `reason`: connect | timeout | status | protocol."""

    def __init__(self, worker: str, reason: str, message: str) -> None:
        super().__init__(f"{worker}: {message}")
        self.worker, self.reason = worker, reason


def bootstrap_port(ep: Endpoint) -> int:
    port = bootstrap_port_of(ep)
    if port is None:  # `pairs_with` never pairs such a worker; a direct caller gets the fix
        raise APIError(
            500,
            f"prefill worker {ep.id} has no bootstrap port; label it bootstrap_port=<port>",
            "api_error",
        )
    return port


def prefill_leg_body(call: UpstreamCall) -> dict[str, Any]:
    """vLLM style: the prefill leg's body — the client's request with `max_tokens: 1`, no
    stream, and `kv_transfer_params` asking the worker to keep the KV for a remote decode."""
    body = {k: v for k, v in call.body.items() if k not in ("stream_options",)}
    body.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    body.pop("max_completion_tokens", None)
    return body


def sglang_bootstrap(prefill: Endpoint) -> dict[str, Any]:
    """SGLang style: the fields both legs carry — the prefill worker's host and bootstrap
    port, and a fresh random u63 room (raises `APIError` 500 without a bootstrap port)."""
    return {
        "bootstrap_host": urlsplit(prefill.url).hostname or "127.0.0.1",
        "bootstrap_port": bootstrap_port(prefill),
        "bootstrap_room": secrets.randbits(63),
    }


def sglang_prefill_leg_body(body: dict[str, Any], boot: dict[str, Any]) -> dict[str, Any]:
    """SGLang style: the prefill leg's body (the decode leg's, not streamed)."""
    leg = {**body, **boot, "stream": False}
    leg.pop("stream_options", None)
    return leg


class UpstreamChunks:
    """The decode worker's SSE stream: `await first()` (the first decoded events), then either
    iterate decoded chunks, or `raw()` for the whole body's bytes as they come (`head`: the
    bytes `first()` consumed) with `scanner` watching them. Transport errors surface as
    `UpstreamError`."""

    def __init__(self, worker: str, response: aiohttp.ClientResponse) -> None:
        self.worker, self._resp = worker, response
        self._decoder = UpstreamSSEDecoder()
        self._it = response.content.iter_any()
        self._pending: list[dict[str, Any]] = []
        self.head = b""
        self.scanner = SSEScanner()

    async def _next(self) -> bytes | None:
        try:
            return await anext(self._it, None)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(self.worker, "connect", f"stream broke: {exc!r}") from exc

    async def first(self) -> list[dict[str, Any]]:
        head: list[bytes] = []
        while not self._pending and not self._decoder.done:
            data = await self._next()
            if data is None:
                raise UpstreamError(self.worker, "protocol", "stream ended before any data")
            head.append(data)
            self._pending = self._decoder.feed(data)
        self.head = b"".join(head)
        out, self._pending = self._pending, []
        return out

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[dict[str, Any]]:
        while not self._decoder.done and (data := await self._next()) is not None:
            for chunk in self._decoder.feed(data):
                yield chunk
        if not self._decoder.done:
            raise UpstreamError(self.worker, "protocol", "stream ended without [DONE]")

    async def raw(self, *, strip_usage: bool = False) -> AsyncIterator[bytes]:
        """The whole body from its start (what `first()` read included), as the worker sent
        it (but for `SSEScanner.strip_usage`); raises `UpstreamError` if the stream ends
        without `[DONE]` (after an error event, say)."""
        scanner = self.scanner
        scanner.strip_usage = strip_usage
        if out := scanner.feed(self.head):
            yield out
        read = self._resp.content.readany  # what `iter_any` awaits, without its two frames
        while not scanner.done:
            try:
                data = await read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise UpstreamError(self.worker, "connect", f"stream broke: {exc!r}") from exc
            if not data:  # end of body
                if out := scanner.flush():
                    yield out
                break
            if out := scanner.feed(data):
                yield out
        if scanner.error is not None:
            raise UpstreamError(self.worker, "protocol", scanner.error)
        if not scanner.done:
            raise UpstreamError(self.worker, "protocol", "stream ended without [DONE]")

    async def aclose(self) -> None:
        """A stream read to its end gives its connection back for reuse; one cut short closes
        it, which is how the worker learns to abort the request. "Its end" is the end of the
        HTTP body, which can come just after the `[DONE]` event that ends the stream: a
        connection given back before it is closed instead (aiohttp reuses only a connection
        whose answer was read whole), and the next request to that worker pays for a new one
        (≈ 0.2 ms here, and the worker's accept). So it is read first, for up to `DRAIN_S`."""
        if not (self._decoder.done or self.scanner.done):
            self._resp.close()
            return
        content = self._resp.content
        try:
            async with asyncio.timeout(DRAIN_S):
                while not content.is_eof() and await content.readany():
                    pass
        except (TimeoutError, aiohttp.ClientError):
            self._resp.close()
            return
        self._resp.release()


def _sent_trace() -> aiohttp.TraceConfig:
    """Runs a request's `SentHook` (its `trace_request_ctx`) right after its body went to the
    socket: aiohttp signals a body chunk just before it writes it, synchronously, so the hook,
    scheduled for the loop's next turn from that signal, runs once the bytes are out."""

    async def on_chunk(_s: object, ctx: Any, _p: object) -> None:
        hook = ctx.trace_request_ctx
        if hook is not None:
            ctx.trace_request_ctx = None  # once per request
            asyncio.get_running_loop().call_soon(hook)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_chunk)
    return trace


class Upstreams:
    def __init__(
        self,
        endpoints: Callable[[], list[Endpoint]],
        loads: LoadBook,
        *,
        prefill_timeout_s: float = 30.0,
        first_byte_timeout_s: float = 120.0,
        connect_timeout_s: float = 2.0,
        max_connections: int = 1000,
    ) -> None:
        self.endpoints, self.loads = endpoints, loads
        self.prefill_timeout_s = prefill_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # A decode stream may pause between tokens but never longer than the first byte.
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=first_byte_timeout_s
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def http(self) -> aiohttp.ClientSession:
        """Keep-alive connections to the workers (aiohttp: its C HTTP parser keeps the
        per-token cost of relaying a stream low). Created in the serving loop on first use."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections,
                    # Engines' uvicorn closes idle connections after 5 s: let them go first.
                    keepalive_timeout=KEEPALIVE_S,
                ),
                auto_decompress=False,
                trace_configs=[_sent_trace()],
            )
        return self._session

    # --- legs ------------------------------------------------------------------------------------
    async def post(
        self,
        ep: Endpoint,
        path: str,
        body: dict[str, Any],
        timeout: float,
        *,
        on_sent: SentHook | None = None,
    ) -> Any:
        """One non-streaming worker call, bounded by `timeout` s: the answer's JSON. Raises
        `UpstreamError` (unreachable, timeout, 5xx, not JSON) or `APIError` (the worker's 4xx).
        `on_sent`: called once the body went out."""
        t = aiohttp.ClientTimeout(total=timeout, connect=self.connect_timeout_s)
        try:
            async with self.http.post(
                ep.url + path,
                data=dump_body(body),
                headers=JSON_HEADERS,
                timeout=t,
                trace_request_ctx=on_sent,
            ) as r:
                status, raw = r.status, await r.read()
        except TimeoutError as exc:
            raise UpstreamError(ep.id, "timeout", f"no answer in {timeout} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(ep.id, "connect", f"unreachable ({exc!r})") from exc
        _check_status(ep, status, raw.decode(errors="replace"))
        try:
            return orjson.loads(raw)
        except ValueError as exc:
            raise UpstreamError(ep.id, "protocol", "answer is not JSON") from exc

    async def prefill_leg(self, ep: Endpoint, call: UpstreamCall) -> dict[str, Any]:
        """vLLM style: run the prefill leg on `ep` (`prefill_leg_body`, bounded by
        `prefill_timeout_s`) and return the `kv_transfer_params` its answer carries for the
        decode leg. Raises as `post`, and `UpstreamError("protocol")` when the answer carries
        none (the worker does not send KV)."""
        answer = await self.post(ep, call.path, prefill_leg_body(call), self.prefill_timeout_s)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise UpstreamError(ep.id, "protocol", "prefill answer has no kv_transfer_params")
        return params

    def _other_prefill(self, decode: Endpoint, tried: set[str]) -> Endpoint | None:
        options = [
            e
            for e in self.endpoints()
            if e.id not in tried and pairs_with(e, decode) and self.loads.healthy(e.id)
        ]
        if not options:
            return None
        return min(options, key=lambda e: self.loads.load(e.id).prefill_tokens)

    async def _decode_body(
        self,
        d: RouteDecision,
        call: UpstreamCall,
        on_fallback: FallbackHook,
        on_prefill_done: PrefillDoneHook | None = None,
    ) -> dict[str, Any]:
        """The decode leg's body, after the prefill leg (vLLM) or with it started (SGLang).
        `on_prefill_done` is called when the prefill leg answers successfully."""
        body = dict(call.body)
        prefill = d.prefill
        if prefill is None:
            return body
        if prefill.handoff_style == "sglang":
            boot = sglang_bootstrap(prefill)
            leg = sglang_prefill_leg_body(body, boot)
            task = asyncio.create_task(self.post(prefill, call.path, leg, self.prefill_timeout_s))
            self._background.add(task)
            task.add_done_callback(
                lambda t: self._sglang_prefill_done(t, prefill, on_fallback, on_prefill_done)
            )
            return {**body, **boot}
        tried: set[str] = set()
        ep: Endpoint | None = prefill
        while ep is not None:
            try:
                params = await self.prefill_leg(ep, call)
                self.loads.succeeded(ep.id)
                if on_prefill_done is not None and ep.id == prefill.id:
                    on_prefill_done()
                return {**body, "kv_transfer_params": params}
            except UpstreamError as err:
                log.warning("router.prefill_failed", worker=ep.id, error=str(err))
                on_fallback("prefill_failed", ep.id)
                tried.add(ep.id)
                ep = self._other_prefill(d.decode, tried)
        on_fallback("local_prefill", prefill.id)
        return body

    def _sglang_prefill_done(
        self,
        task: asyncio.Task[Any],
        ep: Endpoint,
        on_fallback: FallbackHook,
        on_prefill_done: PrefillDoneHook | None = None,
    ) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.loads.succeeded(ep.id)
            if on_prefill_done is not None:
                on_prefill_done()
        else:
            log.warning("router.sglang_prefill_failed", worker=ep.id, error=str(exc))
            on_fallback("prefill_failed", ep.id)

    # --- public ----------------------------------------------------------------------------------
    async def unary(
        self,
        d: RouteDecision,
        call: UpstreamCall,
        on_fallback: FallbackHook,
        on_prefill_done: PrefillDoneHook | None = None,
        on_sent: SentHook | None = None,
    ) -> dict[str, Any]:
        """The decode call, answered whole. `on_sent`: called once its body went out."""
        body = await self._decode_body(d, call, on_fallback, on_prefill_done)
        answer = await self.post(
            d.decode, call.path, body, self.first_byte_timeout_s, on_sent=on_sent
        )
        if not isinstance(answer, dict):
            raise UpstreamError(d.decode.id, "protocol", "answer is not a JSON object")
        return answer

    @property
    def first_byte_timeout_s(self) -> float:
        return float(self.timeout.sock_read or 0.0)

    async def stream(
        self,
        d: RouteDecision,
        call: UpstreamCall,
        on_fallback: FallbackHook,
        on_prefill_done: PrefillDoneHook | None = None,
        on_sent: SentHook | None = None,
    ) -> UpstreamChunks:
        """The decode call's stream, once its answer starts. `on_sent`: called once its body
        went out."""
        body = await self._decode_body(d, call, on_fallback, on_prefill_done)
        ep = d.decode
        return await self.open_stream(ep, self.http.post(
            ep.url + call.path, data=dump_body(body), headers=JSON_HEADERS,
            timeout=self.timeout, trace_request_ctx=on_sent,
        ))  # fmt: skip

    def post_now(
        self, ep: Endpoint, path: str, body: bytes, on_sent: SentHook | None = None
    ) -> asyncio.Future[Any]:
        """A streamed call of `body` (bytes as they are) to `ep`, started now (`on_sent`:
        called once its body went out); `open_stream` takes its answer, or cancelling the
        future calls it off (the worker sees its client go and aborts it)."""
        return asyncio.ensure_future(self.http.post(
            ep.url + path, data=body, headers=JSON_HEADERS, timeout=self.timeout,
            trace_request_ctx=on_sent,
        ))  # fmt: skip

    async def open_stream(self, ep: Endpoint, pending: Awaitable[Any]) -> UpstreamChunks:
        """The stream of a call to `ep` (`pending`: its response to come), once its answer
        starts; `UpstreamError` when it fails before that, `APIError` when the worker refuses
        the request."""
        try:
            resp = await pending
        except TimeoutError as exc:
            raise UpstreamError(ep.id, "timeout", "no answer in time") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(ep.id, "connect", f"unreachable ({exc!r})") from exc
        if resp.status != 200:
            try:
                text = (await resp.read()).decode(errors="replace")
            except (TimeoutError, aiohttp.ClientError):
                text = ""
            finally:
                resp.release()
            _check_status(ep, resp.status, text)
        return UpstreamChunks(ep.id, resp)

    async def aclose(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self._session is not None:
            await self._session.close()


def _check_status(ep: Endpoint, status: int, text: str) -> None:
    if status == 200:
        return
    if 400 <= status < 500 and status not in (408, 429):
        message = text[:500]
        try:
            err = json.loads(text).get("error", {})
            message = err.get("message", message) if isinstance(err, dict) else message
        except ValueError:
            pass
        raise APIError(status, f"the worker refused the request: {message}")
    raise UpstreamError(ep.id, "status", f"HTTP {status}: {text[:200]}")
