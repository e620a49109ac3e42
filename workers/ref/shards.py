"""A worker's KV pool as TP shards in the `kv_transfer` page layout, all in one process.

A real TP engine has one process per GPU, each holding its heads' pages. The ref engine
computes in one process, but lays the KV out exactly as such an engine would: `tp_size`
regions (`np.uint8`, `PoolLayout.region_bytes` each, rank r holding `heads_of_rank(r)`), each
registered with **its own** transfer agent (NIXL or Mooncake). Every disaggregated request
therefore runs the same rank-to-rank plans a real TP engine needs.

`ShardedKV` satisfies `kv_transfer.handshake.KVShardGroup`, so `DecodeKVClient` pulls into it
as it would into a `RankGroup` (one process per rank): `read` runs each shard's
`agent.read_all` on its own thread, concurrently, against the deadline.

Pages: one `PagePool` for full-attention pages and one for window pages, shared by all shards
(a request's page table is the same on every rank). Pages are reference-counted so a prefix
cache can keep a finished request's pages alive and share them with later requests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer import content
from beamserve.kv_transfer.backends.base import (
    SHARED_MEMORY,
    AgentInfo,
    AgentStats,
    ReadOp,
    make_agent,
)
from beamserve.kv_transfer.errors import KVTransferError, TransferTimeoutError
from beamserve.kv_transfer.memory import MemoryKind, allocate
from beamserve.kv_transfer.model import FULL_ATTENTION
from beamserve.kv_transfer.topology import (
    IntArray,
    PoolLayout,
    RequestPages,
    first_window_page,
    pages_needed,
    window_start,
)
from beamserve.workers.ref.kv import LayerKV, RequestKV

# Extra seconds a shard's read thread gets past the deadline before the group gives up on it
# (read_all itself stops at the deadline; this only bounds a backend that ignores it).
GRACE_S = 5.0
IDLE_PROGRESS_S = 0.002

# The transfer backend this process has loaded. One per process: a process that created a
# NIXL UCX agent crashes at exit in the libnl-route bundled with nixl-cu12 (SIGSEGV in its
# destructor `rtnl_tc_unregister`, seen with gdb), and with Mooncake (Debian libfabric and its
# libnl) loaded as well it spins there forever instead. Worker processes skip the teardown
# (worker._exit_now); mixing the backends in one process is refused here.
_process_backend: str | None = None


class KVPoolExhaustedError(KVTransferError):
    """No free page of a kind is left (after the prefix cache gave back what it could)."""


class PagePool:
    """Free list and reference counts for one kind of page (`full` or `window`)."""

    def __init__(self, kind: str, pages: int) -> None:
        self.kind, self.size = kind, pages
        self._free: list[int] = list(range(pages - 1, -1, -1))  # pop() hands out 0, 1, 2, …
        self._refs = np.zeros(pages, dtype=np.int64)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> IntArray:
        if n > len(self._free):
            raise KVPoolExhaustedError(
                f"{self.kind} pages: {n} needed, {len(self._free)} of {self.size} free; raise "
                f"{self.kind}_pages or wait for leases to end"
            )
        pages = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
        self._refs[pages] = 1
        return pages

    def incref(self, pages: IntArray) -> None:
        if len(pages) and (self._refs[pages] <= 0).any():
            raise ValueError(f"{self.kind} pages: incref of a free page")
        np.add.at(self._refs, pages, 1)

    def decref(self, pages: IntArray) -> None:
        np.add.at(self._refs, pages, -1)
        if (self._refs < 0).any():
            raise ValueError(f"{self.kind} pages: freed more often than taken")
        for p in np.unique(pages):
            if self._refs[p] == 0:
                self._free.append(int(p))

    def refs(self, page: int) -> int:
        return int(self._refs[page])


class KVShard:
    """One TP rank's region and its own transfer agent."""

    def __init__(self, name: str, rank: int, layout: PoolLayout, backend: str) -> None:
        self.rank = rank
        buf = allocate(MemoryKind.DRAM, layout.region_bytes, shared=backend in SHARED_MEMORY)
        self.region = buf.data
        self.agent = make_agent(backend, name)
        self.info: AgentInfo = self.agent.register(buf)
        # Serialises the agent between read threads and the idle-progress thread.
        self.lock = threading.Lock()


class ShardedKV:
    """`tp_size` shards of one pool, their page pools, and KV ↔ pages conversion."""

    def __init__(self, name: str, layout: PoolLayout, backend: str) -> None:
        global _process_backend
        if _process_backend not in (None, backend):
            raise KVTransferError(
                f"backend: this process already runs {_process_backend}; NIXL and Mooncake in "
                "one process hang it at exit (libnl-route), so run each backend in its own "
                "worker process"
            )
        _process_backend = backend
        self.name, self.layout, self.backend = name, layout, backend
        self.full = PagePool("full", layout.full_pages)
        self.window = PagePool("window", layout.window_pages)
        # Fault injection ("slow link"): seconds every `read` waits before posting its reads.
        self.read_delay_s = 0.0
        self.shards: list[KVShard] = []
        try:
            self.shards = _make_shards(name, layout, backend)
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._idle_progress, daemon=True)
        self._progress.start()

    # -- the KVShardGroup protocol (what DecodeKVClient needs) --------------------------------
    @property
    def size(self) -> int:
        return self.layout.topology.tp_size

    @property
    def infos(self) -> list[AgentInfo]:
        return [s.info for s in self.shards]

    def read(self, ops_by_rank: dict[int, list[ReadOp]], deadline_s: float) -> list[Any]:
        """Run each listed shard's reads on its own thread, concurrently; returns
        `(bytes, seconds)` per listed rank in rank order, or raises the first failure."""
        if self.read_delay_s > 0:
            time.sleep(min(self.read_delay_s, deadline_s))
            deadline_s = max(0.0, deadline_s - self.read_delay_s)
        deadline = time.monotonic() + deadline_s
        ranks = sorted(ops_by_rank)
        results: dict[int, tuple[int, float]] = {}
        errors: dict[int, BaseException] = {}

        def run(r: int) -> None:
            shard = self.shards[r]
            t0 = time.perf_counter()
            try:
                with shard.lock:
                    moved = shard.agent.read_all(ops_by_rank[r], deadline)
                results[r] = (moved, time.perf_counter() - t0)
            except BaseException as exc:  # handed to the caller below
                errors[r] = exc

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline + GRACE_S - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TransferTimeoutError(
                f"{self.name}: a shard's reads did not return within the deadline plus "
                f"{GRACE_S:.0f} s; its backend ignored the deadline"
            )
        if errors:
            raise errors[min(errors)]
        return [results[r] for r in ranks]

    def call_all(self, cmd: str, *args: Any, timeout_s: float = 600.0) -> list[Any]:
        """`checksums(seq_len, pages)` or `stats()` on every shard, in rank order."""
        del timeout_s  # in-process: nothing to wait for
        if cmd == "checksums":
            seq_len, pages = args
            return [
                content.slice_checksums(s.region, self.layout, s.rank, seq_len, pages)
                for s in self.shards
            ]
        if cmd == "stats":
            return [self.stats(s.rank) for s in self.shards]
        raise ValueError(f"{cmd!r}: a shard group answers 'checksums' and 'stats'")

    def stats(self, rank: int) -> AgentStats:
        shard = self.shards[rank]
        with shard.lock:
            return shard.agent.stats()

    # -- pages ---------------------------------------------------------------------------------
    def window_count(self, seq_len: int) -> int:
        m, P = self.layout.model, self.layout.topology.page_size
        return pages_needed(seq_len, P) - first_window_page(seq_len, m.sliding_window, P)

    def alloc(self, seq_len: int) -> RequestPages:
        """Fresh pages for a request of `seq_len` tokens (all-or-nothing)."""
        full = self.full.alloc(pages_needed(seq_len, self.layout.topology.page_size))
        try:
            window = self.window.alloc(self.window_count(seq_len))
        except KVPoolExhaustedError:
            self.full.decref(full)
            raise
        return RequestPages(full, window)

    def free(self, pages: RequestPages) -> None:
        self.full.decref(pages.full)
        self.window.decref(pages.window)

    # -- KV ↔ pages ----------------------------------------------------------------------------
    def write(self, kv: RequestKV, pages: RequestPages, from_token: int = 0) -> int:
        """Lay out tokens `[from_token, seq_len)` of `kv` in `pages` on every shard (sliding
        layers: only tokens on the request's window pages). Returns bytes written."""
        m, P = self.layout.model, self.layout.topology.page_size
        seq_len = kv.seq_len
        pages.check("kv", self.layout, seq_len)
        wfirst = first_window_page(seq_len, m.sliding_window, P)
        written = 0
        for layer, (kind, lkv) in enumerate(zip(m.layer_types, kv.layers, strict=True)):
            full = kind == FULL_ATTENTION
            lo = from_token if full else max(from_token, wfirst * P)
            if lo >= seq_len:
                continue
            if lkv.start > lo:
                raise ValueError(
                    f"layer {layer}: KV starts at token {lkv.start}, pages need it from {lo}"
                )
            t = np.arange(lo, seq_len, dtype=np.int64)
            table, first = (pages.full, 0) if full else (pages.window, wfirst)
            page_ids, slots = table[t // P - first], t % P
            for shard in self.shards:
                rows = shard.region.reshape(-1, self.layout.row_bytes)
                heads = self.layout.topology.heads_of_rank(m, shard.rank)
                for j, h in enumerate(heads):
                    for kvi, arr in ((0, lkv.keys), (1, lkv.values)):
                        ids = self._row_ids(layer, kvi, j, page_ids, slots)
                        data = np.ascontiguousarray(arr[h, lo - lkv.start :])
                        rows[ids] = data.view(np.uint8).reshape(len(t), -1)
                        written += data.nbytes
        return written

    def read_kv(self, pages: RequestPages, seq_len: int) -> RequestKV:
        """Gather a request's KV from the shards into full-head arrays: every token for full
        layers, tokens `[max(0, seq_len − window), seq_len)` for sliding layers."""
        m, P = self.layout.model, self.layout.topology.page_size
        pages.check("kv", self.layout, seq_len)
        wfirst = first_window_page(seq_len, m.sliding_window, P)
        lo_win = window_start(seq_len, m.sliding_window)
        topo = self.layout.topology
        layers = []
        for layer, kind in enumerate(m.layer_types):
            full = kind == FULL_ATTENTION
            lo = 0 if full else lo_win
            t = np.arange(lo, seq_len, dtype=np.int64)
            table, first = (pages.full, 0) if full else (pages.window, wfirst)
            page_ids, slots = table[t // P - first], t % P
            out = np.empty((2, m.num_key_value_heads, len(t), m.head_dim), dtype=np.uint16)
            for h in range(m.num_key_value_heads):
                rank = topo.ranks_of_head(m, h)[0]
                j = h - topo.heads_of_rank(m, rank).start
                rows = self.shards[rank].region.reshape(-1, self.layout.row_bytes)
                for kvi in (0, 1):
                    ids = self._row_ids(layer, kvi, j, page_ids, slots)
                    out[kvi, h] = rows[ids].view(np.uint16).reshape(len(t), m.head_dim)
            layers.append(LayerKV(lo, out[0], out[1]))
        return RequestKV(seq_len, tuple(layers))

    def _row_ids(
        self, layer: int, kv: int, local_head: int, page_ids: IntArray, slots: IntArray
    ) -> npt.NDArray[np.int64]:
        """Row index (offset / row_bytes) of each (page, slot), from `PoolLayout.token_offset`:
        the layout's own strides, whatever HND or NHD."""
        off = self.layout.token_offset
        base = off(layer, kv, 0, local_head, 0)
        page_stride = off(layer, kv, 1, local_head, 0) - base
        slot_stride = off(layer, kv, 0, local_head, 1) - base
        offsets = base + page_ids * page_stride + slots * slot_stride
        return offsets // self.layout.row_bytes

    # -- lifecycle -----------------------------------------------------------------------------
    def _idle_progress(self) -> None:
        # NIXL runs without its progress thread (see backends/nixl.py): UCX wire-up needs the
        # target side to make progress while peers connect, as an idle rank process would.
        while not self._stop.wait(IDLE_PROGRESS_S):
            for shard in self.shards:
                if shard.lock.acquire(blocking=False):
                    try:
                        shard.agent.idle_progress()
                    finally:
                        shard.lock.release()

    def close(self) -> list[AgentStats]:
        """Stop progress, deregister every region; returns each agent's final stats."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._progress.join(5)
        final = []
        for shard in self.shards:
            with shard.lock:
                shard.agent.close()
                final.append(shard.agent.stats())
        return final


def _make_shards(name: str, layout: PoolLayout, backend: str) -> list[KVShard]:
    """One shard per rank. Mooncake engines start side by side: started one after another,
    each engine after the first takes about 1 s to initialise (measured here), 3 s at TP 4."""
    tp = layout.topology.tp_size
    if backend != "mooncake" or tp == 1:
        return [KVShard(f"{name}-r{r}", r, layout, backend) for r in range(tp)]
    made: list[KVShard | None] = [None] * tp
    errors: list[BaseException] = []

    def make(r: int) -> None:
        try:
            made[r] = KVShard(f"{name}-r{r}", r, layout, backend)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shards = [m for m in made if m is not None]
    if errors:
        for shard in shards:
            shard.agent.close()
        raise errors[0]
    return shards
