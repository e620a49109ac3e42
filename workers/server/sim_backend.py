"""The `sim` engine behind the worker's HTTP surface, on the real-time clock.

The simulated engine (`beamserve.workers.sim`) runs on the server's asyncio loop; its KV events
go to a ZMQ publisher in vLLM's wire format (sequence numbers, replay socket); a prefill-role
worker serves its leases on a handshake server (see `backend` for the handoff). Generated
tokens are the simulator's deterministic ids, decoded through the worker's codec.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import structlog
from beamserve.kv_transfer.handshake import HandshakeServer
from beamserve.kvwire.codec import Codec
from beamserve.kvwire.events import KVEventBatch
from beamserve.workers.kv_events import KVEventPublisher
from beamserve.workers.server.backend import (
    BackendUnavailableError,
    GenerateEvent,
    GenerateInput,
    Handoff,
    LeaseWaitError,
    Role,
    SimLeaseRegistry,
    WorkerStats,
    release_lease,
    wait_for_lease,
)
from beamserve.workers.sim.clock import RealClock
from beamserve.workers.sim.config import EngineConfig
from beamserve.workers.sim.engine import DEFAULT_CATCH_UP_S, SimEngine
from beamserve.workers.sim.faults import FaultConfig
from beamserve.workers.sim.profiles import get_profile
from beamserve.workers.sim.request import (
    EngineDeadError,
    RemotePrefill,
    RequestUpdate,
    SimRequest,
)
from beamserve.workers.sim.streaming import stream

log = structlog.get_logger(__name__)


class SimBackend:
    """See the module docstring. Create, then `await start()` on the serving loop."""

    engine = "sim"

    def __init__(
        self,
        codec: Codec,
        *,
        role: Role = "both",
        profile: str = "tiny-cpu",
        model_name: str = "beam",
        page_size: int = 64,
        speed: float = 1.0,
        catch_up_s: float = DEFAULT_CATCH_UP_S,
        engine_overrides: dict[str, Any] | None = None,
        publisher: KVEventPublisher | None = None,
        handshake_host: str = "127.0.0.1",
        handshake_port: int = 0,
        advertise_host: str | None = None,
        lease_s: float = 30.0,
        kv_deadline_s: float = 10.0,
        engine_id: str | None = None,
    ) -> None:
        self.codec, self.role, self.model_name = codec, role, model_name
        self.page_size = page_size
        self._profile = get_profile(profile)
        self.tp_size = self._profile.gpus
        self._overrides = dict(engine_overrides or {})
        self._speed = speed
        self._catch_up_s = catch_up_s
        self._publisher = publisher
        self._hs_host, self._hs_port = handshake_host, handshake_port
        self._advertise = advertise_host
        self.engine_id = engine_id or f"sim-{role}-{os.getpid()}"
        self.kv_deadline_s = kv_deadline_s
        self.leases = SimLeaseRegistry(self.engine_id, self.tp_size, page_size, lease_s)
        self._handshake: HandshakeServer | None = None
        self.handshake_url: str | None = None
        self._engine: SimEngine | None = None
        self._http: httpx.AsyncClient | None = None
        self._counters = WorkerStats()
        self._words: list[int] | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        config = EngineConfig.from_profile(
            self._profile,
            role=self.role,
            page_size=self.page_size,
            vocab_size=self.codec.vocab_size,
            **self._overrides,
        )
        sink = self._publish if self._publisher is not None else None
        self._engine = SimEngine(
            config, RealClock(self._speed), kv_events=sink, catch_up_s=self._catch_up_s
        )
        self._http = httpx.AsyncClient()
        self._readable_ids()  # once at start, not on the first request
        if self.role in ("prefill", "both"):
            self._handshake = HandshakeServer(
                self.leases.app(), host=self._hs_host, port=self._hs_port
            )
            host = self._advertise or self._handshake.host
            self.handshake_url = f"http://{host}:{self._handshake.port}"

    async def close(self) -> None:
        if self._handshake is not None:
            self._handshake.stop()
            self._handshake = None
        if self._http is not None:
            await self._http.aclose()
        if self._publisher is not None:
            self._publisher.close()

    def _publish(self, batch: KVEventBatch) -> None:
        assert self._publisher is not None
        self._publisher.publish(batch)

    @property
    def sim(self) -> SimEngine:
        if self._engine is None:
            raise BackendUnavailableError("the engine has not started")
        return self._engine

    @property
    def ready(self) -> bool:
        return self._engine is not None and self._engine.ready

    @property
    def handshake_port(self) -> int | None:
        return None if self._handshake is None else int(self._handshake.port)

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        if inp.prefill_leg:
            async for ev in self._prefill_leg(inp):
                yield ev
        elif inp.handoff is not None:
            async for ev in self._decode_leg(inp, inp.handoff):
                yield ev
        else:
            async for ev in self._run(self._request(inp), "local"):
                yield ev

    def _request(
        self, inp: GenerateInput, rid: str | None = None, remote: RemotePrefill | None = None
    ) -> SimRequest:
        return SimRequest(
            request_id=rid or inp.request_id,
            token_ids=inp.prompt_ids,
            max_output_tokens=1 if inp.prefill_leg else inp.max_tokens,
            remote_prefill=remote,
        )

    async def _run(self, req: SimRequest, source: str) -> AsyncIterator[GenerateEvent]:
        try:
            updates = stream(self.sim, req)
            async for u in updates:
                yield self._event(u, source)
        except EngineDeadError as exc:
            raise BackendUnavailableError(str(exc)) from exc

    def _event(self, u: RequestUpdate, source: str) -> GenerateEvent:
        words = self._readable_ids()
        ids = [words[t % len(words)] for t in u.token_ids] if words else list(u.token_ids)
        ev = GenerateEvent(ids, kv_source=source)  # type: ignore[arg-type]
        if u.finished:
            ev.finish_reason = u.finish_reason
            ev.error = u.error
            ev.completion_tokens = u.num_output_tokens
            if u.metrics is not None:
                ev.prompt_tokens = u.metrics.prompt_tokens
                ev.cached_tokens = u.metrics.cached_tokens
        return ev

    def _readable_ids(self) -> list[int]:
        """The ids of the checkpoint's vocabulary that decode to a plain word: the simulator's
        output ids (uniform over the vocabulary) are mapped onto them, so answers read as words
        rather than byte fragments. Empty for the approximate codec (its decoding is words)."""
        if self._words is None:
            tok = getattr(self.codec, "tokenizer", None)
            words: list[int] = []
            if tok is not None:
                for i in range(self.codec.vocab_size):
                    text = tok.decode([i]).strip()
                    if len(text) >= 2 and text.isalpha() and text.isascii():
                        words.append(i)
            self._words = words
        return self._words

    async def _prefill_leg(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        lease_id = inp.lease_id or inp.request_id
        async for ev in self._run(self._request(inp), "local"):
            if ev.finish_reason is not None and ev.finish_reason != "error":
                n = len(inp.prompt_ids)
                self.leases.publish(lease_id, n)
                ev.kv_transfer_params = self.kv_transfer_params(lease_id, n)
            yield ev

    def kv_transfer_params(self, lease_id: str, num_tokens: int) -> dict[str, Any]:
        """What the prefill leg answers (vLLM NixlConnector's field names)."""
        assert self.handshake_url is not None
        host_port = self.handshake_url.removeprefix("http://")
        host, _, port = host_port.rpartition(":")
        pages = -(-num_tokens // self.page_size)
        window = min(pages, -(-512 // self.page_size) + 1)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": lease_id,
            "remote_host": host.strip("[]"),
            "remote_port": int(port),
            "remote_block_ids": [list(range(pages)), list(range(pages - window, pages))],
            "tp_size": self.tp_size,
            "remote_num_tokens": num_tokens,
        }

    async def _decode_leg(self, inp: GenerateInput, h: Handoff) -> AsyncIterator[GenerateEvent]:
        assert self._http is not None
        c = self._counters
        deadline = time.monotonic() + self.kv_deadline_s
        t0 = time.monotonic()
        updates: AsyncIterator[GenerateEvent] | None = None
        try:
            lease = await wait_for_lease(self._http, h, deadline)
            remote = RemotePrefill(prefill_tp=h.tp_size)
            updates = self._run(self._request(inp, remote=remote), "transfer")
            first: GenerateEvent | None = None
            async for ev in updates:
                first = ev
                break
            # The simulated transfer is over: it succeeded only if the source still holds the
            # KV (a prefill worker that died mid-transfer took its pages with it).
            if first is None or first.error is not None:
                raise LeaseWaitError(first.error if first else "no answer")
            await wait_for_lease(self._http, h, max(deadline, time.monotonic() + 1.0))
        except LeaseWaitError as exc:
            if updates is not None:
                await updates.aclose()  # type: ignore[attr-defined]
            c.transfer_failures += 1
            c.recompute_fallbacks += 1
            log.warning("kv_transfer_failed_recompute", request_id=inp.request_id, error=str(exc))
            await release_lease(self._http, h)
            async for ev in self._run(self._request(inp, rid=f"{inp.request_id}~r"), "recompute"):
                yield ev
            return
        c.transfers += 1
        c.transfer_seconds += time.monotonic() - t0
        n = int(lease.get("seq_len", len(inp.prompt_ids)))
        window = min(n, self.sim.config.model.sliding_window)
        c.transfer_bytes += self.sim.latency.kv_bytes(n, window)
        await release_lease(self._http, h)
        assert first is not None and updates is not None
        yield first
        async for ev in updates:
            yield ev

    # --- state, faults, admin --------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        s = self.sim.stats()
        c = self._counters
        return WorkerStats(
            running=s.running,
            waiting=s.waiting,
            kv_usage=max(s.full_usage, s.window_usage),
            prompt_tokens=s.prompt_tokens_total,
            generation_tokens=s.generation_tokens_total,
            prefix_queries_tokens=s.prefix_cache_queries_tokens,
            prefix_hits_tokens=s.prefix_cache_hits_tokens,
            preemptions=s.preemptions_total,
            requests_finished=s.requests_finished_total,
            requests_failed=s.requests_failed_total,
            transfers=c.transfers,
            transfer_bytes=c.transfer_bytes,
            transfer_seconds=c.transfer_seconds,
            transfer_failures=c.transfer_failures,
            recompute_fallbacks=c.recompute_fallbacks,
            leases_held=self.leases.held(),
            kv_event_batches=s.kv_event_batches_total,
            kv_event_batches_dropped=s.kv_event_batches_dropped,
            queued_prefill_tokens=s.queued_prefill_tokens,
            step_lag_seconds=s.step_lag_seconds,
            busy_seconds=s.busy_seconds,
            prefill_busy_seconds=s.prefill_busy_seconds,
            prefill_computed_tokens=s.prefill_computed_tokens,
        )

    def server_info(self) -> dict[str, Any]:
        cfg = self.sim.config
        return {
            "engine": "sim",
            "profile": self._profile.name,
            "prefix_caching": bool(cfg.enable_prefix_cache),
            "engine_id": self.engine_id,
            "tp_size": self.tp_size,
            "page_size": cfg.page_size,
            "max_running_requests": cfg.max_running,
            "chunked_prefill_size": cfg.max_batched_tokens,
            "max_total_num_tokens": cfg.full_pages * cfg.page_size,
            "sliding_window": cfg.model.sliding_window,
            "handshake_url": self.handshake_url,
            "kv_events_endpoint": self._publisher.bound_endpoint if self._publisher else None,
            "kv_replay_endpoint": (
                self._publisher.bound_replay_endpoint if self._publisher else None
            ),
        }

    def reset_prefix_cache(self) -> int:
        return self.sim.reset_prefix_cache()

    def set_faults(self, raw: dict[str, Any]) -> dict[str, Any]:
        self.sim.set_faults(FaultConfig.from_dict(raw))
        return self.faults()

    def faults(self) -> dict[str, Any]:
        return self.sim.faults.to_dict()

    def kill(self, reason: str) -> None:
        self.sim.kill(reason)

    def revive(self) -> None:
        self.sim.revive()
