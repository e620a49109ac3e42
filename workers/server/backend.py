"""The seam between the worker's HTTP surface and its engine, P/D handoff, and the `sim` backend.

A `Backend` turns a `GenerateInput` (prompt token ids, limits, and the P/D role this request
plays) into an async stream of `GenerateEvent`s. The HTTP layer knows nothing about engines; a
backend knows nothing about HTTP bodies.

P/D handoff (DESIGN.md §3), the same mechanics in both wire styles:

- the prefill side computes the prompt, keeps its KV under a lease and publishes the lease on
  its *handshake* server (`GET /kv/v1/requests/{id}`; `DELETE` releases it);
- vLLM style: the prefill leg carries `kv_transfer_params.do_remote_decode`; the answer's
  `kv_transfer_params` (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`,
  `remote_host`, `remote_port` = the handshake server, `remote_block_ids`, `tp_size`,
  `remote_num_tokens`) go to the decode leg unchanged;
- SGLang style: both legs carry `bootstrap_host` / `bootstrap_port` (= the prefill worker's
  handshake server) / `bootstrap_room`, and are sent at once: the decode side waits (bounded by
  its deadline) until the room's lease appears;
- the decode side pulls the KV (the `sim` engine simulates the transfer time from the bytes;
  `ref` moves real bytes over NIXL/Mooncake), then releases the lease. Any failure — prefill
  worker gone, lease missing or expired, deadline — makes it recompute the prefill locally,
  count it in `recompute_fallbacks`, and still answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
import structlog
from beamserve.kvwire.codec import Codec
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

log = structlog.get_logger(__name__)

Role = Literal["prefill", "decode", "both"]
HandoffStyle = Literal["vllm", "sglang"]


class HandoffError(ValueError):
    """`kv_transfer_params` or bootstrap fields that cannot be used; names the field."""


class BackendUnavailableError(RuntimeError):
    """The engine is dead or not ready (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """Where a decode request's prompt KV lives: the prefill worker's handshake server and
    the lease id there (`remote_request_id` or the bootstrap room)."""

    style: HandoffStyle
    host: str
    port: int
    lease_id: str
    engine_id: str | None = None
    tp_size: int | None = None
    num_tokens: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_kv_transfer_params(params: Any) -> tuple[bool, Handoff | None]:
    """vLLM `kv_transfer_params` → (this is a prefill leg, decode handoff or None)."""
    if params is None:
        return False, None
    if not isinstance(params, dict):
        raise HandoffError("kv_transfer_params: must be an object")
    if params.get("do_remote_decode"):
        return True, None
    if not params.get("do_remote_prefill"):
        return False, None
    missing = [
        k for k in ("remote_host", "remote_port", "remote_request_id") if params.get(k) is None
    ]
    if missing:
        raise HandoffError(
            f"kv_transfer_params: do_remote_prefill is set but {missing} are missing; pass the "
            "prefill response's kv_transfer_params unchanged"
        )
    try:
        port = int(params["remote_port"])
    except (TypeError, ValueError) as exc:
        raise HandoffError("kv_transfer_params.remote_port: must be an integer") from exc
    tp = params.get("tp_size")
    n = params.get("remote_num_tokens")
    return False, Handoff(
        "vllm",
        str(params["remote_host"]),
        port,
        str(params["remote_request_id"]),
        params.get("remote_engine_id"),
        int(tp) if tp is not None else None,
        int(n) if n is not None else None,
    )


def parse_bootstrap(body: dict[str, Any]) -> Handoff | None:
    """SGLang `bootstrap_host` / `bootstrap_port` / `bootstrap_room` → handoff (None: absent)."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is None and room is None:
        return None
    if host is None or room is None or port is None:
        raise HandoffError(
            "bootstrap_host, bootstrap_port and bootstrap_room: give all three (the prefill "
            "worker's host and bootstrap port, and one room id shared by both legs)"
        )
    try:
        return Handoff("sglang", str(host), int(port), str(int(room)))
    except (TypeError, ValueError) as exc:
        raise HandoffError("bootstrap_port and bootstrap_room: must be integers") from exc


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One generation: `prefill_leg` = compute the prompt, publish its KV under `lease_id`
    (default: the request id) and answer one token; `handoff` = the prompt's KV comes from a
    prefill worker (decode leg)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    prefill_leg: bool = False
    lease_id: str | None = None
    handoff: Handoff | None = None
    handoff_style: HandoffStyle = "vllm"


@dataclass(slots=True)
class GenerateEvent:
    """New tokens (possibly none), and on the last event the finish reason and usage."""

    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    kv_source: Literal["local", "transfer", "recompute"] = "local"


@dataclass
class WorkerStats:
    """Counters and gauges behind `/metrics` (engine names are chosen there)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    recompute_fallbacks: int = 0
    leases_held: int = 0
    kv_event_batches: int = 0
    kv_event_batches_dropped: int = 0
    queued_prefill_tokens: int | None = None  # None: the engine cannot tell (not exported)
    step_lag_seconds: float = 0.0  # sim: time lost to a busy host (`SimEngine`, "Host lateness")
    # sim: engine seconds spent in steps, those in steps with prefill, prompt tokens computed;
    # None: the engine cannot tell (not exported)
    busy_seconds: float | None = None
    prefill_busy_seconds: float | None = None
    prefill_computed_tokens: int | None = None


class Backend(Protocol):
    engine: str
    role: Role
    model_name: str
    codec: Codec
    page_size: int
    tp_size: int
    handshake_url: str | None

    @property
    def ready(self) -> bool: ...

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]: ...

    def stats(self) -> WorkerStats: ...

    def server_info(self) -> dict[str, Any]: ...

    def reset_prefix_cache(self) -> int: ...

    def set_faults(self, raw: dict[str, Any]) -> dict[str, Any]: ...

    def faults(self) -> dict[str, Any]: ...

    def kill(self, reason: str) -> None: ...

    def revive(self) -> None: ...

    async def close(self) -> None: ...


# --- the handshake server of a simulated prefill worker -----------------------------------------


@dataclass
class _SimLease:
    seq_len: int
    expires: float


class SimLeaseRegistry:
    """Leases of a simulated prefill worker: its KV 'lives' until released or expired."""

    def __init__(self, engine_id: str, tp_size: int, page_size: int, lease_s: float) -> None:
        self.engine_id, self.tp_size, self.page_size, self.lease_s = (
            engine_id,
            tp_size,
            page_size,
            lease_s,
        )
        self._leases: dict[str, _SimLease] = {}

    def publish(self, lease_id: str, seq_len: int) -> None:
        self._leases[lease_id] = _SimLease(seq_len, time.monotonic() + self.lease_s)

    def lookup(self, lease_id: str) -> dict[str, Any] | None:
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        return {
            "request_id": lease_id,
            "seq_len": lease.seq_len,
            "full_pages": [],
            "window_pages": [],
            "lease_remaining_s": max(0.0, lease.expires - time.monotonic()),
        }

    def release(self, lease_id: str) -> bool:
        return self._leases.pop(lease_id, None) is not None

    def held(self) -> int:
        self._expire()
        return len(self._leases)

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, v in self._leases.items() if v.expires <= now]:
            del self._leases[k]

    def app(self) -> FastAPI:
        app = FastAPI(title="beamserve sim prefill handshake")

        @app.get("/kv/v1/agents")
        def agents() -> dict[str, Any]:
            return {
                "engine_id": self.engine_id,
                "backend": "sim",
                "tp_size": self.tp_size,
                "page_size": self.page_size,
            }

        @app.get("/kv/v1/requests/{lease_id}", response_model=None)
        def request(lease_id: str) -> dict[str, Any] | JSONResponse:
            info = self.lookup(lease_id)
            if info is None:
                return JSONResponse(
                    status_code=404, content={"error": "unknown", "detail": lease_id}
                )
            return info

        @app.delete("/kv/v1/requests/{lease_id}")
        def release(lease_id: str) -> Response:
            self.release(lease_id)
            return Response(status_code=204)

        return app


class LeaseWaitError(RuntimeError):
    """The prefill side's lease never appeared, vanished, or its server is gone."""


async def wait_for_lease(
    client: httpx.AsyncClient, handoff: Handoff, deadline: float, poll_s: float = 0.02
) -> dict[str, Any]:
    """GET the lease until it exists (SGLang legs race; a vLLM lease exists already).

    Raises `LeaseWaitError` when the server is unreachable, the lease expired (410), or
    `deadline` (monotonic) passes."""
    path = f"{handoff.url}/kv/v1/requests/{handoff.lease_id}"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LeaseWaitError(f"lease {handoff.lease_id} not published before the deadline")
        try:
            r = await client.get(path, timeout=min(left, 2.0))
        except httpx.HTTPError as exc:
            raise LeaseWaitError(f"prefill handshake {handoff.url} unreachable: {exc}") from exc
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            return body
        if r.status_code != 404:
            raise LeaseWaitError(f"lease {handoff.lease_id}: HTTP {r.status_code} {r.text[:200]}")
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


async def release_lease(client: httpx.AsyncClient, handoff: Handoff) -> None:
    try:
        await client.delete(f"{handoff.url}/kv/v1/requests/{handoff.lease_id}", timeout=2.0)
    except httpx.HTTPError:
        pass  # the prefill side is gone; its lease went with it


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
