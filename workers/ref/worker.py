"""Prefill and decode workers of the reference engine, and the processes that run them.

`PrefillWorker`: loads the checkpoint, computes a prompt's KV and first token (resuming from
its prefix cache when it can), lays the KV out in its TP shards, publishes it with a
`PrefillKVRegistry` lease and serves the handshake over HTTP.

`DecodeWorker`: allocates pages in its own TP layout, pulls through `DecodeKVClient` against a
deadline, rebuilds the cache from the pulled pages and decodes. If the pull fails for any
transfer reason (prefill worker gone, lease expired, deadline, checksum), it recomputes the
prefill locally, counts it in `recompute_fallbacks`, and still answers.

`WorkerProcess` runs either worker in its own OS process (multiprocessing, spawn) and talks to
it over a pipe; every call carries a timeout and a dead process surfaces as `WorkerLostError`;
a worker process runs one transfer backend and ends with `os._exit` once closed. The
HTTP surface of a serving worker (OpenAI API, metrics) is not here: this is compute, KV and
handshake.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import numpy as np
from beamserve.kv_transfer.errors import KVTransferError
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    RequestKVInfo,
    build_handshake_app,
    published_checksums,
)
from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.topology import (
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)
from beamserve.kvwire.events import (
    FULL_ATTENTION_KIND,
    FULL_GROUP,
    SLIDING_WINDOW_KIND,
    WINDOW_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventSink,
)
from beamserve.workers.ref.engine import RefBeam
from beamserve.workers.ref.prefix_cache import HASH_SOURCE, CachedBlock, PrefixCache, block_hashes
from beamserve.workers.ref.shards import KVPoolExhaustedError, PagePool, ShardedKV

START_TIMEOUT_S = 180.0
IDLE_POLL_S = 0.05
EXIT_WAIT_S = 0.25


@dataclass(frozen=True)
class PoolSpec:
    """One worker's KV pool: TP size, transfer backend and pages per rank."""

    tp_size: int
    backend: str = "nixl"
    page_size: int = 16
    full_pages: int = 256
    window_pages: int = 128
    layout: str = "HND"

    def pool_layout(self, model: BeamModelConfig) -> PoolLayout:
        topo = PoolTopology(self.tp_size, self.page_size, KVDtype.BF16, KVLayout(self.layout))
        return PoolLayout(model, topo, self.full_pages, self.window_pages)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    engine_id: str
    url: str
    seq_len: int
    first_token: int
    cached_tokens: int  # prompt tokens resumed from the prefix cache
    computed_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeResult:
    request_id: str
    tokens: list[int]
    source: Literal["transfer", "recompute"]
    bytes_moved: int
    bytes_minimum: int
    transfer_s: float
    seconds: float
    deadline_s: float
    error: str | None = None

    @property
    def deadline_met(self) -> bool:
        return self.seconds <= self.deadline_s


@dataclass
class PrefillStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_blocks: int = 0
    leases_held: int = 0
    free_full_pages: int = 0
    free_window_pages: int = 0
    hash_source: str = HASH_SOURCE


@dataclass
class DecodeStats:
    requests: int = 0
    transfers: int = 0
    recompute_fallbacks: int = 0
    bytes_pulled: int = 0
    errors: list[str] = field(default_factory=list)


class _FaultyRegistry(PrefillKVRegistry):
    """The registry, plus one fault: die a given time after serving a request's page table
    (the decode side has started the transfer and holds the page table, its reads not yet
    served). Only a worker process may arm it: it SIGKILLs its own process."""

    allow_self_kill = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.die_after_lookup: dict[str, float] = {}

    def lookup(self, request_id: str) -> RequestKVInfo:
        info = super().lookup(request_id)
        delay = self.die_after_lookup.pop(request_id, None)
        if delay is not None:
            threading.Thread(target=_die_after, args=(delay,), daemon=True).start()
        return info


def _die_after(delay_s: float) -> None:
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGKILL)


class PrefillWorker:
    """Prefill role: compute, lay out in shards, publish, serve the handshake."""

    def __init__(
        self,
        model_dir: str | Path,
        pool: PoolSpec,
        engine_id: str | None = None,
        lease_s: float = 30.0,
        prefix_cache: bool = True,
        checksums: bool = True,
        host: str = "127.0.0.1",
        engine: RefBeam | None = None,
        handshake_port: int = 0,
        kv_events: KVEventSink | None = None,
    ) -> None:
        self.engine = engine or RefBeam(model_dir, prefill_chunk=pool.page_size)
        self.lease_s, self.host, self.handshake_port = lease_s, host, handshake_port
        self.kv_events = kv_events
        self.use_prefix_cache, self.checksums = prefix_cache, checksums
        self._base_id = engine_id or f"ref-prefill-{os.getpid()}"
        self._generation = 0
        self._open(pool)

    def _open(self, pool: PoolSpec) -> None:
        self._generation += 1
        self.pool = pool
        self.engine_id = f"{self._base_id}-g{self._generation}"
        self.layout = pool.pool_layout(self.engine.kv_config)
        self.shards = ShardedKV(self.engine_id, self.layout, pool.backend)
        self.registry = _FaultyRegistry(
            self.engine_id, self.layout, pool.backend, self.shards.infos, self.lease_s
        )
        self.server = HandshakeServer(
            build_handshake_app(self.registry), host=self.host, port=self.handshake_port
        )
        self.url = self.server.url
        self.cache = PrefixCache()
        self._held: dict[str, RequestPages] = {}
        self.counters = PrefillStats()

    def _close(self) -> None:
        self.server.stop()
        self.shards.close()

    def reconfigure(self, pool: PoolSpec) -> str:
        """Re-shard: a fresh pool (regions, agents, handshake server, prefix cache) for another
        TP size or backend, keeping the loaded model. Returns the new handshake URL."""
        self._close()
        self._open(pool)
        return self.url

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "engine_id": self.engine_id, "pid": os.getpid()}

    # -- serving -------------------------------------------------------------------------------
    def prefill(
        self,
        request_id: str,
        token_ids: list[int],
        die_after_lookup_s: float | None = None,
        publish: bool = True,
    ) -> PrefillResult:
        """Compute and publish one prompt's KV; the decode side pulls it by `request_id`."""
        t0 = time.perf_counter()
        self._reap()
        if die_after_lookup_s is not None and not _FaultyRegistry.allow_self_kill:
            raise RuntimeError("die_after_lookup_s: only a prefill worker process may die")
        P, n = self.pool.page_size, len(token_ids)
        hashes = block_hashes(token_ids, P) if self.use_prefix_cache else []
        prefix = self._resumable(hashes, n)
        done = len(prefix) * P
        prefix_kv = None
        if prefix:
            win0 = first_window_page(done, self.layout.model.sliding_window, P)
            wins = [b.window_page for b in prefix[win0:]]
            if None in wins:  # _resumable only returns prefixes whose window tail is cached
                raise RuntimeError("internal: a resumable prefix lacks a window page")
            table = RequestPages.of(
                [b.full_page for b in prefix], [w for w in wins if w is not None]
            )
            prefix_kv = self.shards.read_kv(table, done)
        out = self.engine.prefill(token_ids, prefix_kv)
        pages = self._alloc(n, prefix)
        try:
            self.shards.write(out.kv, pages, from_token=done)
            sums = published_checksums(self.shards, n, pages) if self.checksums else None
            if die_after_lookup_s is not None:
                self.registry.die_after_lookup[request_id] = die_after_lookup_s
            self.registry.publish(request_id, n, pages, sums, {"first_token": out.first_token})
        except BaseException:
            self.shards.free(pages)
            raise
        self._held[request_id] = pages
        if self.use_prefix_cache:
            self._insert(hashes, pages, n, token_ids)
        c = self.counters
        c.requests, c.prompt_tokens, c.cached_tokens = (
            c.requests + 1,
            c.prompt_tokens + n,
            c.cached_tokens + done,
        )
        return PrefillResult(
            request_id,
            self.engine_id,
            self.url,
            n,
            out.first_token,
            done,
            out.computed_tokens,
            time.perf_counter() - t0,
        )

    def stats(self) -> PrefillStats:
        self._reap()
        c = self.counters
        c.cached_blocks, c.leases_held = len(self.cache), len(self._held)
        c.free_full_pages, c.free_window_pages = self.shards.full.free, self.shards.window.free
        return c

    def clear_prefix_cache(self) -> int:
        """Drop every cached block (their pages return to the pools once no lease holds
        them); returns how many blocks were dropped."""
        dropped = 0
        while (victim := self.cache.pop_lru()) is not None:
            self._drop(victim[1], victim[0])
            dropped += 1
        self._emit(AllBlocksCleared())
        return dropped

    def close(self) -> None:
        self._close()

    # -- pages and the prefix cache ------------------------------------------------------------
    def _reap(self) -> None:
        """Free the pages of requests whose lease ended (released by decode, or expired)."""
        held = set(self.registry.held())
        for rid in [r for r in self._held if r not in held]:
            self.shards.free(self._held.pop(rid))

    def _resumable(self, hashes: list[int], n: int) -> list[CachedBlock]:
        """The longest cached prefix this prompt can resume from: whole prefill chunks, at
        least one token left to compute, and the window tail's pages resident."""
        chunk = self.engine.prefill_chunk
        if not hashes or chunk is None:
            return []
        P, W = self.pool.page_size, self.layout.model.sliding_window
        hit = self.cache.match(hashes)
        for k in range(min(len(hit), (n - 1) // P), 0, -1):
            if (k * P) % chunk:
                continue
            lo = first_window_page(k * P, W, P)
            if all(hit[b].window_page is not None for b in range(lo, k)):
                return hit[:k]
        return []

    def _alloc(self, n: int, prefix: list[CachedBlock]) -> RequestPages:
        """Page tables for `n` tokens: the prefix's cached pages (shared, one more reference)
        and fresh pages for the rest, evicting cache entries when a pool runs dry."""
        P, W = self.pool.page_size, self.layout.model.sliding_window
        k, n_full, wfirst = len(prefix), pages_needed(n, P), first_window_page(n, W, P)
        shared_full = np.array([b.full_page for b in prefix], dtype=np.int64)
        shared_win = np.array(
            [b.window_page for b in prefix[wfirst:]], dtype=np.int64
        )  # logical pages wfirst..k-1
        sf, sw = self.shards.full, self.shards.window
        sf.incref(shared_full)
        sw.incref(shared_win)
        try:
            new_full = self._take(sf, n_full - k)
            try:
                new_win = self._take(sw, n_full - max(wfirst, k))
            except BaseException:
                sf.decref(new_full)
                raise
        except BaseException:
            sf.decref(shared_full)
            sw.decref(shared_win)
            raise
        return RequestPages.of(
            np.concatenate([shared_full, new_full]), np.concatenate([shared_win, new_win])
        )

    def _take(self, pool: PagePool, count: int) -> Any:
        while True:
            try:
                return pool.alloc(count)
            except KVPoolExhaustedError:
                victim = self.cache.pop_lru()
                if victim is None:
                    raise
                self._drop(victim[1], victim[0])

    def _drop(self, block: CachedBlock, block_hash: int | None = None) -> None:
        self.shards.full.decref(np.array([block.full_page], dtype=np.int64))
        if block.window_page is not None:
            self.shards.window.decref(np.array([block.window_page], dtype=np.int64))
        if block_hash is not None:
            self._emit(BlockRemoved((block_hash,), group_idx=FULL_GROUP))
            if block.window_page is not None:
                self._emit(BlockRemoved((block_hash,), group_idx=WINDOW_GROUP))

    def _emit(self, *events: KVEvent) -> None:
        """KV events of the prefix cache (vLLM semantics: blocks of `page_size` tokens, the
        full-attention group and the window group separately)."""
        if self.kv_events is not None and events:
            self.kv_events(KVEventBatch(time.time(), tuple(events)))

    def _stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], group: int
    ) -> BlockStored:
        P, W = self.pool.page_size, self.layout.model.sliding_window
        return BlockStored(
            tuple(hashes),
            parent,
            tuple(token_ids),
            P,
            group_idx=group,
            kv_cache_spec_kind=FULL_ATTENTION_KIND if group == FULL_GROUP else SLIDING_WINDOW_KIND,
            kv_cache_spec_sliding_window=None if group == FULL_GROUP else W,
        )

    def _insert(
        self, hashes: list[int], pages: RequestPages, n: int, token_ids: list[int] | None = None
    ) -> None:
        """Cache every full block of the prompt: its full page, and its window page when the
        block lies on the request's window pages (whole pages: fully written)."""
        P, W = self.pool.page_size, self.layout.model.sliding_window
        wfirst = first_window_page(n, W, P)
        one = np.zeros(1, dtype=np.int64)
        new_full: list[int] = []
        new_window: list[int] = []
        for b, h in enumerate(hashes[: n // P]):
            wp = int(pages.window[b - wfirst]) if b >= wfirst else None
            entry = self.cache.get(h)
            if entry is None:
                self.cache.put(h, CachedBlock(int(pages.full[b]), wp))
                self.shards.full.incref(one + pages.full[b])
                new_full.append(b)
                if wp is not None:
                    self.shards.window.incref(one + wp)
                    new_window.append(b)
            elif entry.window_page is None and wp is not None:
                entry.window_page = wp
                self.shards.window.incref(one + wp)
                new_window.append(b)
        self.cache.touch_chain(hashes[: n // P])
        if self.kv_events is not None and token_ids is not None:
            self._emit(
                *(
                    self._stored(
                        [hashes[b] for b in blocks],
                        hashes[blocks[0] - 1] if blocks[0] > 0 else None,
                        [t for b in blocks for t in token_ids[b * P : (b + 1) * P]],
                        group,
                    )
                    for group, blocks in ((FULL_GROUP, new_full), (WINDOW_GROUP, new_window))
                    if blocks
                )
            )


class DecodeWorker:
    """Decode role: pull into its own TP layout, rebuild, decode; recompute on failure."""

    def __init__(
        self,
        model_dir: str | Path,
        pool: PoolSpec,
        engine_id: str | None = None,
        pull_share: float = 0.5,
        verify_checksums: bool = True,
        engine: RefBeam | None = None,
    ) -> None:
        if not 0 < pull_share <= 1:
            raise ValueError(f"pull_share: {pull_share} outside (0, 1]")
        self.engine = engine or RefBeam(model_dir, prefill_chunk=pool.page_size)
        self.pull_share, self.verify_checksums = pull_share, verify_checksums
        self._base_id = engine_id or f"ref-decode-{os.getpid()}"
        self._generation = 0
        self.counters = DecodeStats()
        self._open(pool)

    def _open(self, pool: PoolSpec) -> None:
        self._generation += 1
        self.pool = pool
        self.engine_id = f"{self._base_id}-g{self._generation}"
        self.layout = pool.pool_layout(self.engine.kv_config)
        self.shards = ShardedKV(self.engine_id, self.layout, pool.backend)
        self.client = DecodeKVClient(self.shards)

    def _close(self) -> None:
        self.client.close()
        self.shards.close()

    def reconfigure(self, pool: PoolSpec) -> str:
        self._close()
        self._open(pool)
        return self.engine_id

    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "pid": os.getpid()}

    def generate(
        self,
        request_id: str,
        prefill_url: str,
        token_ids: list[int],
        first_token: int,
        max_tokens: int,
        deadline_s: float = 30.0,
        read_delay_s: float = 0.0,
    ) -> DecodeResult:
        """Answer `max_tokens` tokens (the first is prefill's `first_token`) within
        `deadline_s`: the pull gets `pull_share` of it, the rest is room to recompute.

        `read_delay_s` injects a slow link: the reads start that much later (fault tests)."""
        t0 = time.monotonic()
        n = len(token_ids)
        c = self.counters
        c.requests += 1
        pages = self.shards.alloc(n)
        moved, xfer_s, error = 0, 0.0, None
        source: Literal["transfer", "recompute"] = "transfer"
        self.shards.read_delay_s = read_delay_s
        try:
            try:
                pull = self.client.pull(
                    prefill_url,
                    request_id,
                    pages,
                    deadline_s * self.pull_share,
                    verify_checksums=self.verify_checksums,
                )
                moved, xfer_s = pull.bytes_moved, pull.seconds
                kv = self.shards.read_kv(pages, n)
                tokens = self.engine.decode_from(kv, n, first_token, max_tokens)
                c.transfers += 1
                c.bytes_pulled += moved
            except KVTransferError as exc:
                source, error = "recompute", f"{type(exc).__name__}: {exc}"
                c.recompute_fallbacks += 1
                c.errors = [*c.errors[-9:], error]
                out = self.engine.prefill(token_ids)
                tokens = self.engine.decode_from(out.kv, n, out.first_token, max_tokens)
        finally:
            self.shards.read_delay_s = 0.0
            self.shards.free(pages)
        return DecodeResult(
            request_id,
            tokens,
            source,
            moved,
            bytes_minimum(self.layout, n),
            xfer_s,
            time.monotonic() - t0,
            deadline_s,
            error,
        )

    def stats(self) -> DecodeStats:
        return self.counters

    def close(self) -> None:
        self._close()


# -- worker processes ---------------------------------------------------------------------------


class WorkerLostError(RuntimeError):
    """A worker process died or stopped answering."""


@dataclass(frozen=True)
class WorkerSpec:
    role: Literal["prefill", "decode"]
    model_dir: str
    pool: PoolSpec
    lease_s: float = 30.0
    prefix_cache: bool = True
    pull_share: float = 0.5
    log_path: str | None = None  # the process's stdout/stderr (backends log there), if set


def _worker_main(conn: Connection, spec: WorkerSpec) -> None:
    worker: PrefillWorker | DecodeWorker
    if spec.log_path:
        fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        if spec.role == "prefill":
            _FaultyRegistry.allow_self_kill = True
            worker = PrefillWorker(
                spec.model_dir, spec.pool, lease_s=spec.lease_s, prefix_cache=spec.prefix_cache
            )
        else:
            worker = DecodeWorker(spec.model_dir, spec.pool, pull_share=spec.pull_share)
        conn.send(("ok", worker.info()))
    except BaseException as exc:  # report start-up failures instead of dying silently
        conn.send(("err", _portable(exc)))
        return
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            worker.close()
            _exit_now()
        try:
            conn.send(("ok", getattr(worker, cmd)(*args)))
        except BaseException as exc:
            conn.send(("err", _portable(exc)))
        if cmd == "close":
            _exit_now()


def _exit_now() -> None:
    """End a worker process whose regions are deregistered and agents closed, skipping the
    interpreter's teardown: a process that created a NIXL UCX agent crashes there (SIGSEGV in
    the libnl-route bundled with nixl-cu12 1.5.1, `rtnl_tc_unregister`), and Mooncake's engine
    destructors take about 1 s each."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _portable(exc: BaseException) -> BaseException:
    if isinstance(exc, KVTransferError | ValueError | RuntimeError):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


class WorkerProcess:
    """A prefill or decode worker in its own process (spawned), driven over a pipe."""

    def __init__(self, spec: WorkerSpec, name: str | None = None) -> None:
        self.spec = spec
        self.name = name or f"ref-{spec.role}-{uuid.uuid4().hex[:6]}"
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc: Any = ctx.Process(
            target=_worker_main, args=(child, spec), name=self.name, daemon=True
        )
        self._proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        self.info = self._recv(timeout_s)
        return self.info

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    @property
    def alive(self) -> bool:
        return bool(self._proc.is_alive())

    @property
    def exitcode(self) -> int | None:
        code = self._proc.exitcode
        return None if code is None else int(code)

    def call(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> Any:
        try:
            self._conn.send((cmd, args))
        except (BrokenPipeError, OSError) as exc:
            raise WorkerLostError(f"{self.name}: process is gone") from exc
        return self._recv(timeout_s)

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)

    def close(self, timeout_s: float = 30.0) -> None:
        close_all([self], timeout_s)

    def _begin_close(self) -> bool:
        if not self._proc.is_alive():
            return False
        try:
            self._conn.send(("close", ()))
        except (BrokenPipeError, OSError):
            return False
        return True

    def _finish_close(self, sent: bool, timeout_s: float) -> None:
        if sent:
            try:
                self._recv(timeout_s)  # regions deregistered, handshake server stopped
            except (WorkerLostError, KVTransferError, RuntimeError):
                pass
            # Backend destructors at interpreter exit can take seconds (Mooncake's engine
            # removes its segments one by one); everything that matters is released by now.
            self._proc.join(EXIT_WAIT_S)
        self.kill()
        self._conn.close()

    def _recv(self, timeout_s: float) -> Any:
        end = time.monotonic() + timeout_s
        while not self._conn.poll(min(IDLE_POLL_S, max(0.0, end - time.monotonic()))):
            if not self._proc.is_alive():
                raise WorkerLostError(f"{self.name}: process exited ({self._proc.exitcode})")
            if time.monotonic() >= end:
                self.kill()
                raise WorkerLostError(f"{self.name}: no answer within {timeout_s:.0f} s; killed")
        try:
            status, payload = self._conn.recv()
        except EOFError as exc:
            raise WorkerLostError(f"{self.name}: process exited") from exc
        if status == "err":
            raise payload
        return payload


def close_all(workers: list[WorkerProcess], timeout_s: float = 30.0) -> None:
    """Close several worker processes at once (each deregisters its regions, then exits)."""
    sent = [w._begin_close() for w in workers]
    for w, s in zip(workers, sent, strict=True):
        w._finish_close(s, timeout_s)
