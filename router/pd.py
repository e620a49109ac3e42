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
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import structlog
from beamserve.router.api.convert import UpstreamCall
from beamserve.router.api.errors import APIError
from beamserve.router.api.sse import UpstreamSSEDecoder
from beamserve.router.load import LoadBook
from beamserve.router.policy import pairs_with
from beamserve.router.policy.kv_compat import bootstrap_port_of
from beamserve.router.types import Endpoint, HandoffStyle, RouteDecision

log = structlog.get_logger(__name__)
FallbackHook = Callable[[str, str], None]  # (reason, failed worker id)


class UpstreamError(RuntimeError):
    """A worker failed before the first byte; `reason`: connect | timeout | status | protocol."""

    def __init__(self, worker: str, reason: str, message: str) -> None:
        super().__init__(f"{worker}: {message}")
        self.worker, self.reason = worker, reason


def handoff_style(ep: Endpoint) -> HandoffStyle:
    return ep.handoff_style


def bootstrap_port(ep: Endpoint) -> int:
    port = bootstrap_port_of(ep)
    if port is None:  # `pairs_with` never pairs such a worker; a direct caller gets the fix
        raise APIError(
            500,
            f"prefill worker {ep.id} has no bootstrap port; label it bootstrap_port=<port>",
            "api_error",
        )
    return port


class UpstreamChunks:
    """The decode worker's SSE stream as decoded chunks: `await first()`, then iterate."""

    def __init__(self, worker: str, response: httpx.Response) -> None:
        self.worker, self._resp = worker, response
        self._decoder = UpstreamSSEDecoder()
        self._it = response.aiter_bytes()
        self._pending: list[dict[str, Any]] = []

    async def first(self) -> list[dict[str, Any]]:
        try:
            while not self._pending and not self._decoder.done:
                data = await anext(self._it)
                self._pending = self._decoder.feed(data)
        except StopAsyncIteration as exc:
            raise UpstreamError(self.worker, "protocol", "stream ended before any data") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(self.worker, "connect", f"stream broke: {exc}") from exc
        out, self._pending = self._pending, []
        return out

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[dict[str, Any]]:
        async for data in self._it:
            for chunk in self._decoder.feed(data):
                yield chunk
            if self._decoder.done:
                return
        if not self._decoder.done:
            raise UpstreamError(self.worker, "protocol", "stream ended without [DONE]")

    async def aclose(self) -> None:
        await self._resp.aclose()


class Upstreams:
    def __init__(
        self,
        http: httpx.AsyncClient,
        endpoints: Callable[[], list[Endpoint]],
        loads: LoadBook,
        *,
        prefill_timeout_s: float = 30.0,
        first_byte_timeout_s: float = 120.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.http, self.endpoints, self.loads = http, endpoints, loads
        self.prefill_timeout_s = prefill_timeout_s
        self.timeout = httpx.Timeout(
            connect=connect_timeout_s, read=first_byte_timeout_s, write=30.0, pool=30.0
        )
        self._background: set[asyncio.Task[Any]] = set()

    # --- legs ------------------------------------------------------------------------------------
    async def _post(self, ep: Endpoint, path: str, body: dict[str, Any], timeout: Any) -> Any:
        try:
            r = await self.http.post(ep.url + path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise UpstreamError(ep.id, "timeout", f"no answer in time ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(ep.id, "connect", f"unreachable ({exc!r})") from exc
        _check_status(ep, r.status_code, r.text)
        try:
            return r.json()
        except ValueError as exc:
            raise UpstreamError(ep.id, "protocol", "answer is not JSON") from exc

    async def _prefill_leg(self, ep: Endpoint, call: UpstreamCall) -> dict[str, Any]:
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
        answer = await self._post(ep, call.path, body, self.prefill_timeout_s)
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
        self, d: RouteDecision, call: UpstreamCall, on_fallback: FallbackHook
    ) -> dict[str, Any]:
        """The decode leg's body, after the prefill leg (vLLM) or with it started (SGLang)."""
        body = dict(call.body)
        prefill = d.prefill
        if prefill is None:
            return body
        if handoff_style(prefill) == "sglang":
            host = urlsplit(prefill.url).hostname or "127.0.0.1"
            boot = {
                "bootstrap_host": host,
                "bootstrap_port": bootstrap_port(prefill),
                "bootstrap_room": secrets.randbits(63),
            }
            leg = {**body, **boot, "stream": False}
            leg.pop("stream_options", None)
            task = asyncio.create_task(self._post(prefill, call.path, leg, self.prefill_timeout_s))
            self._background.add(task)
            task.add_done_callback(lambda t: self._sglang_prefill_done(t, prefill, on_fallback))
            return {**body, **boot}
        tried: set[str] = set()
        ep: Endpoint | None = prefill
        while ep is not None:
            try:
                params = await self._prefill_leg(ep, call)
                self.loads.succeeded(ep.id)
                return {**body, "kv_transfer_params": params}
            except UpstreamError as err:
                log.warning("router.prefill_failed", worker=ep.id, error=str(err))
                on_fallback("prefill_failed", ep.id)
                tried.add(ep.id)
                ep = self._other_prefill(d.decode, tried)
        on_fallback("local_prefill", prefill.id)
        return body

    def _sglang_prefill_done(
        self, task: asyncio.Task[Any], ep: Endpoint, on_fallback: FallbackHook
    ) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.loads.succeeded(ep.id)
        else:
            log.warning("router.sglang_prefill_failed", worker=ep.id, error=str(exc))
            on_fallback("prefill_failed", ep.id)

    # --- public ----------------------------------------------------------------------------------
    async def unary(
        self, d: RouteDecision, call: UpstreamCall, on_fallback: FallbackHook
    ) -> dict[str, Any]:
        body = await self._decode_body(d, call, on_fallback)
        answer = await self._post(d.decode, call.path, body, self.timeout)
        if not isinstance(answer, dict):
            raise UpstreamError(d.decode.id, "protocol", "answer is not a JSON object")
        return answer

    async def stream(
        self, d: RouteDecision, call: UpstreamCall, on_fallback: FallbackHook
    ) -> UpstreamChunks:
        body = await self._decode_body(d, call, on_fallback)
        ep = d.decode
        req = self.http.build_request("POST", ep.url + call.path, json=body, timeout=self.timeout)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamError(ep.id, "timeout", f"no answer in time ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(ep.id, "connect", f"unreachable ({exc!r})") from exc
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            _check_status(ep, resp.status_code, text)
        return UpstreamChunks(ep.id, resp)

    async def aclose(self) -> None:
        for t in list(self._background):
            t.cancel()


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
