"""The `ref` engine (a real tiny Beam on CPU) behind the worker's HTTP surface.

Compute is blocking, so every engine call runs on one dedicated thread (the NIXL/Mooncake
agents of the worker's KV shards are created and used there too). Roles:

- `both`: prefill through a `PrefillWorker` (prefix cache, KV events) and decode from the
  worker's own shards — no transfer;
- `prefill`: publish the prompt's KV under a lease on the handshake server (vLLM
  `kv_transfer_params` or SGLang bootstrap room) with the first token as aux data;
- `decode`: wait for the lease, pull the KV into this worker's TP layout through the handshake
  (`DecodeWorker`: real NIXL/Mooncake reads between processes), continue generating; if the
  transfer fails it recomputes the prefill, counts it, and still answers.

Tokens are produced all at once per request and then streamed (the reference engine is a
correctness tool, not a latency one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import structlog
from beamserve.kv_transfer.topology import RequestPages
from beamserve.kvwire.codec import Codec
from beamserve.kvwire.geometry import window_of_config
from beamserve.workers.kv_events import KVEventPublisher
from beamserve.workers.ref.engine import RefBeam
from beamserve.workers.ref.worker import DecodeWorker, PoolSpec, PrefillWorker
from beamserve.workers.server.backend import (
    BackendUnavailableError,
    GenerateEvent,
    GenerateInput,
    Handoff,
    LeaseWaitError,
    Role,
    WorkerStats,
    release_lease,
    wait_for_lease,
)

log = structlog.get_logger(__name__)
T = TypeVar("T")


class RefBackend:
    """See the module docstring. Create, then `await start()`."""

    engine = "ref"

    def __init__(
        self,
        model_dir: str | Path,
        codec: Codec,
        *,
        role: Role = "both",
        model_name: str = "beam",
        tp_size: int = 1,
        transfer_backend: str = "nixl",
        page_size: int = 16,
        full_pages: int = 512,
        window_pages: int = 256,
        publisher: KVEventPublisher | None = None,
        handshake_host: str = "127.0.0.1",
        handshake_port: int = 0,
        advertise_host: str | None = None,
        lease_s: float = 30.0,
        kv_deadline_s: float = 30.0,
    ) -> None:
        self.model_dir, self.codec, self.role, self.model_name = model_dir, codec, role, model_name
        self.tp_size, self.page_size = tp_size, page_size
        self._pool = PoolSpec(tp_size, transfer_backend, page_size, full_pages, window_pages)
        self._publisher = publisher
        self._hs = (handshake_host, handshake_port)
        self._advertise = advertise_host
        self.lease_s, self.kv_deadline_s = lease_s, kv_deadline_s
        self._pool_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ref-engine")
        self._prefill: PrefillWorker | None = None
        self._decode: DecodeWorker | None = None
        self._http: httpx.AsyncClient | None = None
        self.handshake_url: str | None = None
        self._alive = False
        self._die_after: float | None = None
        self._counters = WorkerStats()

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool_exec, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        def build() -> None:
            engine = RefBeam(self.model_dir, prefill_chunk=self.page_size)
            if self.role in ("prefill", "both"):
                sink = self._publisher.publish if self._publisher is not None else None
                self._prefill = PrefillWorker(
                    self.model_dir,
                    self._pool,
                    engine_id=f"ref-{self.role}-{os.getpid()}",
                    lease_s=self.lease_s,
                    host=self._hs[0],
                    handshake_port=self._hs[1],
                    engine=engine,
                    kv_events=sink,
                )
            if self.role == "decode":
                self._decode = DecodeWorker(self.model_dir, self._pool, engine=engine)

        await self._call(build)
        self._http = httpx.AsyncClient()
        if self._prefill is not None:
            port = self._prefill.server.port
            host = self._advertise or self._prefill.server.host
            self.handshake_url = f"http://{host}:{port}"
        self._alive = True

    async def close(self) -> None:
        self._alive = False
        if self._http is not None:
            await self._http.aclose()
        for w in (self._prefill, self._decode):
            if w is not None:
                await self._call(w.close)
        self._pool_exec.shutdown(wait=False)
        if self._publisher is not None:
            self._publisher.close()

    @property
    def ready(self) -> bool:
        return self._alive

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        if not self._alive:
            raise BackendUnavailableError("the engine is not serving (killed or not started)")
        ids = list(inp.prompt_ids)
        if inp.prefill_leg:
            yield await self._prefill_leg(inp, ids)
            return
        if inp.handoff is not None and self._decode is not None:
            tokens, source, cached = await self._decode_leg(inp, inp.handoff, ids)
        else:
            tokens, source, cached = await self._local(inp, ids)
        for i, t in enumerate(tokens):
            last = i == len(tokens) - 1
            ev = GenerateEvent([t], kv_source=source)  # type: ignore[arg-type]
            if last:
                ev.finish_reason = "length"
                ev.prompt_tokens, ev.cached_tokens = len(ids), cached
                ev.completion_tokens = len(tokens)
            yield ev

    async def _prefill_leg(self, inp: GenerateInput, ids: list[int]) -> GenerateEvent:
        w = self._prefill
        if w is None:
            raise BackendUnavailableError(f"role {self.role} does not prefill for others")
        lease_id = inp.lease_id or inp.request_id
        die, self._die_after = self._die_after, None
        r = await self._call(w.prefill, lease_id, ids, die)
        ev = GenerateEvent([r.first_token], finish_reason="length", kv_source="local")
        ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens = len(ids), r.cached_tokens, 1
        assert self.handshake_url is not None
        host, _, port = self.handshake_url.removeprefix("http://").rpartition(":")
        ev.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": r.engine_id,
            "remote_request_id": lease_id,
            "remote_host": host,
            "remote_port": int(port),
            "remote_block_ids": [],
            "tp_size": self.tp_size,
            "remote_num_tokens": len(ids),
        }
        return ev

    async def _local(self, inp: GenerateInput, ids: list[int]) -> tuple[list[int], str, int]:
        w = self._prefill
        if w is None:  # a decode worker asked to serve a whole request
            assert self._decode is not None
            engine = self._decode.engine
            tokens = await self._call(engine.generate, ids, inp.max_tokens)
            return list(tokens), "local", 0

        def run() -> tuple[list[int], int]:
            rid = f"{inp.request_id}~local"
            r = w.prefill(rid, ids)
            try:
                held = w.registry.lookup(rid)
                pages = RequestPages.of(held.full_pages, held.window_pages)
                kv = w.shards.read_kv(pages, len(ids))
                tokens = w.engine.decode_from(kv, len(ids), r.first_token, inp.max_tokens)
            finally:
                w.registry.release(rid)
            return tokens, r.cached_tokens

        tokens, cached = await self._call(run)
        return tokens, "local", cached

    async def _decode_leg(
        self, inp: GenerateInput, h: Handoff, ids: list[int]
    ) -> tuple[list[int], str, int]:
        assert self._decode is not None and self._http is not None
        c = self._counters
        deadline = time.monotonic() + self.kv_deadline_s
        try:
            lease = await wait_for_lease(self._http, h, deadline)
            first = int((lease.get("aux") or {})["first_token"])
        except (LeaseWaitError, KeyError, TypeError, ValueError) as exc:
            c.transfer_failures += 1
            c.recompute_fallbacks += 1
            log.warning("kv_lease_missing_recompute", request_id=inp.request_id, error=str(exc))
            await release_lease(self._http, h)
            tokens = await self._call(self._decode.engine.generate, ids, inp.max_tokens)
            return list(tokens), "recompute", 0
        left = max(0.5, deadline - time.monotonic())
        res = await self._call(
            self._decode.generate, h.lease_id, h.url, ids, first, inp.max_tokens, left
        )
        if res.source == "recompute":
            c.transfer_failures += 1
            c.recompute_fallbacks += 1
        else:
            c.transfers += 1
            c.transfer_bytes += res.bytes_moved
            c.transfer_seconds += res.transfer_s
        return list(res.tokens), res.source, 0

    # --- state, admin ----------------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        c = self._counters
        out = WorkerStats(
            transfers=c.transfers,
            transfer_bytes=c.transfer_bytes,
            transfer_seconds=c.transfer_seconds,
            transfer_failures=c.transfer_failures,
            recompute_fallbacks=c.recompute_fallbacks,
        )
        if self._prefill is not None:
            p = self._prefill.counters
            out.prompt_tokens = p.prompt_tokens
            out.prefix_queries_tokens = p.prompt_tokens
            out.prefix_hits_tokens = p.cached_tokens
            out.requests_finished = p.requests
            out.leases_held = len(self._prefill.registry.held())
        return out

    def server_info(self) -> dict[str, Any]:
        return {
            "engine": "ref",
            "tp_size": self.tp_size,
            # prefill and both keep a prefix cache (PrefillWorker); decode rebuilds each
            # request's KV from what it pulls and keeps none of it
            "prefix_caching": self.role != "decode",
            "page_size": self.page_size,
            "sliding_window": window_of_config(self.model_dir),
            "max_total_num_tokens": self._pool.full_pages * self.page_size,
            "max_running_requests": 1,
            "handshake_url": self.handshake_url,
            "transfer_backend": self._pool.backend,
            "kv_events_endpoint": self._publisher.bound_endpoint if self._publisher else None,
            "kv_replay_endpoint": (
                self._publisher.bound_replay_endpoint if self._publisher else None
            ),
        }

    def reset_prefix_cache(self) -> int:
        return 0 if self._prefill is None else self._prefill.clear_prefix_cache()

    def set_faults(self, raw: dict[str, Any]) -> dict[str, Any]:
        """One fault: `die_after_lookup_s` — the next published lease kills this worker
        process that many seconds after its decode side fetched the page table (mid-transfer:
        the reads are not served)."""
        from beamserve.workers.ref.worker import _FaultyRegistry
        from beamserve.workers.sim.faults import FaultConfigError

        unknown = sorted(set(raw) - {"die_after_lookup_s"})
        if unknown:
            raise FaultConfigError(f"{unknown}: unknown ref faults; valid: ['die_after_lookup_s']")
        v = raw.get("die_after_lookup_s")
        if v is not None and (not isinstance(v, (int, float)) or v < 0):
            raise FaultConfigError("die_after_lookup_s: must be a number ≥ 0 or null")
        if self.role == "decode" and v is not None:
            raise FaultConfigError("die_after_lookup_s: only a prefill worker can die mid-transfer")
        _FaultyRegistry.allow_self_kill = v is not None
        self._die_after = None if v is None else float(v)
        return self.faults()

    def faults(self) -> dict[str, Any]:
        return {"die_after_lookup_s": self._die_after}

    def kill(self, reason: str) -> None:
        self._alive = False

    def revive(self) -> None:
        self._alive = True
