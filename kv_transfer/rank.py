"""One TP rank's KV memory and transfer agent, run as its own OS process.

A `RankGroup` spawns one process per rank (the way a TP engine has one process per GPU) and
talks to each over a pipe. Every call carries a deadline; a rank that does not answer in time
is killed, so a caller never hangs on a stuck backend.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import structlog
from beamserve.kv_transfer import content, host_local, kernels
from beamserve.kv_transfer.backends.base import (
    SHARED_MEMORY,
    AgentInfo,
    AgentStats,
    ReadOp,
    make_agent,
)
from beamserve.kv_transfer.compact import KernelTables
from beamserve.kv_transfer.errors import (
    KVTransferError,
    PeerLostError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.memory import MemoryKind, allocate, copy_runs
from beamserve.kv_transfer.staging import PoolStats, StagingPool
from beamserve.kv_transfer.topology import PoolLayout, RequestPages

log = structlog.get_logger(__name__)

# Extra seconds a rank gets past a call's own deadline before the group kills it.
GRACE_S = 5.0
STALE_PREPARED = "host_local: no pull prepared under this token here (another replaced it)"
START_TIMEOUT_S = 120.0
IDLE_POLL_S = 0.002


@dataclass(frozen=True)
class RankSpec:
    group: str
    rank: int
    layout: PoolLayout
    backend: str
    memory: MemoryKind = MemoryKind.DRAM
    staging_bytes: int = 0  # this rank's staging pool (0: the staged path is not served)
    device: int = 0


@dataclass(frozen=True)
class GatherJob:
    """Source side of one staged chunk: gather `src_offsets`/`lengths` (staging order)."""

    chunk_id: int
    src_offsets: np.ndarray[Any, np.dtype[np.int64]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]
    needs_gather: bool


@dataclass(frozen=True)
class StagedRead:
    """Destination side of one staged chunk: read `nbytes` at the peer's `remote_offset`, then
    scatter to `dst_offsets`/`lengths` (or read straight into the region when contiguous)."""

    peer: AgentInfo
    remote_offset: int
    dst_offsets: np.ndarray[Any, np.dtype[np.int64]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]
    needs_scatter: bool


@dataclass(frozen=True)
class StagedReadResult:
    bytes_moved: int
    transfer_s: float
    scatter_s: float
    staging_bytes: int


class _Rank:
    """State inside a rank process; each public method is one pipe command.

    The registered buffer is `[KV region][staging area]`: one registration covers both, and the
    staging pool hands out ranges of the second part.
    """

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        kv = spec.layout.region_bytes
        shared = spec.backend in SHARED_MEMORY  # a region other processes map (shm)
        self.buffer = allocate(spec.memory, kv + spec.staging_bytes, spec.device, shared)
        self.kv = self.buffer.view(0, kv)
        # Host view of the KV region: the region itself for DRAM, a mirror for VRAM.
        self.region = self.kv.data if spec.memory is MemoryKind.DRAM else np.zeros(kv, np.uint8)
        self.pool = StagingPool(kv, spec.staging_bytes)
        # The staging area as a buffer of its own (pool offsets minus `kv` index into it).
        self.stage = (
            self.buffer.alias(kv, kv + spec.staging_bytes)
            if spec.staging_bytes
            else self.buffer.view(kv, kv)
        )
        if spec.memory is MemoryKind.DRAM and spec.staging_bytes:
            # Fault the staging pages in now: a first touch inside a timed gather costs more
            # than the copy itself.
            self.buffer.data[kv:].fill(0xA5)
        self._held: dict[str, list[int]] = {}
        if spec.memory is MemoryKind.VRAM:
            kernels.engine()  # choose (and compile) the device copy engine before any timed copy
        self.agent = make_agent(spec.backend, f"{spec.group}-r{spec.rank}-{os.getpid()}")
        self.info = self.agent.register(self.buffer)
        self._scratch: Any = None
        self._driver: host_local.HostLocalDriver | None = None
        self._prepared: tuple[int, host_local.PreparedPull] | None = None

    def _upload(self) -> None:
        if self.spec.memory is MemoryKind.VRAM:
            self.kv.upload(self.region)
            self.kv.synchronize()

    def _download(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if self.spec.memory is MemoryKind.VRAM:
            self.region = self.kv.host()
        return self.region

    def fill_random(self, seed: int) -> None:
        content.fill_random(self.region, seed)
        self._upload()

    def write_request(self, seq_len: int, pages: RequestPages, seed: int) -> None:
        content.write_request(self.region, self.spec.layout, self.spec.rank, seq_len, pages, seed)
        self._upload()

    def read(self, ops: list[ReadOp], deadline_s: float) -> tuple[int, float]:
        t0 = time.perf_counter()
        moved = self.agent.read_all(ops, time.monotonic() + deadline_s)
        self.buffer.synchronize()
        return moved, time.perf_counter() - t0

    # -- the staged path -----------------------------------------------------------------------
    def gather(self, tag: str, jobs: list[GatherJob]) -> tuple[list[int], float]:
        """Gather each job into a staging buffer held under `tag`; returns each job's offset in
        the registered buffer (the region's own offset where no gather is needed) and seconds."""
        t0 = time.perf_counter()
        held = self._held.setdefault(tag, [])
        out = []
        try:
            for job in jobs:
                if not job.needs_gather:
                    out.append(int(job.src_offsets[0]))
                    continue
                off = self.pool.allocate(int(job.lengths.sum()))
                held.append(off)
                rel = off - self.pool.base
                stage = rel + np.concatenate(([0], np.cumsum(job.lengths)[:-1])).astype(np.int64)
                copy_runs(self.kv, job.src_offsets, self.stage, stage, job.lengths)
                out.append(off)
            self.buffer.synchronize()
        except BaseException:
            self.release_staging(tag)
            raise
        return out, time.perf_counter() - t0

    def release_staging(self, tag: str) -> int:
        """Return every buffer held under `tag` (idempotent); returns how many there were."""
        held = self._held.pop(tag, [])
        for off in held:
            self.pool.release(off)
        return len(held)

    def read_staged(self, reads: list[StagedRead], deadline_s: float) -> StagedReadResult:
        """Read each chunk as one descriptor, then scatter it; staging buffers are returned to
        the pool on every path (done, timed out, peer lost)."""
        local: list[int] = []
        taken: list[int] = []
        try:
            for r in reads:
                if r.needs_scatter:
                    off = self.pool.allocate(int(r.lengths.sum()))
                    taken.append(off)
                    local.append(off)
                else:
                    local.append(int(r.dst_offsets[0]))
            by_peer: dict[str, list[int]] = {}
            for i, r in enumerate(reads):
                by_peer.setdefault(r.peer.name, []).append(i)
            ops = [
                ReadOp(
                    reads[idx[0]].peer,
                    np.array([local[i] for i in idx], dtype=np.int64),
                    np.array([reads[i].remote_offset for i in idx], dtype=np.int64),
                    np.array([int(reads[i].lengths.sum()) for i in idx], dtype=np.int64),
                )
                for idx in by_peer.values()
            ]
            t0 = time.perf_counter()
            moved = self.agent.read_all(ops, time.monotonic() + deadline_s)
            self.buffer.synchronize()
            t1 = time.perf_counter()
            staged = 0
            for r, off in zip(reads, local, strict=True):
                if r.needs_scatter:
                    rel = off - self.pool.base
                    stage = rel + np.concatenate(([0], np.cumsum(r.lengths)[:-1])).astype(np.int64)
                    staged += copy_runs(self.stage, stage, self.kv, r.dst_offsets, r.lengths)
            self.buffer.synchronize()
            t2 = time.perf_counter()
            return StagedReadResult(moved, t1 - t0, t2 - t1, staged)
        finally:
            for off in taken:
                self.pool.release(off)

    # -- the host-local driver: this rank copies a whole request for every rank of both pools --
    def prepare_local(
        self,
        tables: KernelTables,
        src_agents: list[AgentInfo],
        dst_agents: list[AgentInfo],
        token: int,
    ) -> None:
        """`HostLocalDriver.prepare` here, kept under `token` for the `drive_local` after it."""
        if self._driver is None:
            self._driver = host_local.HostLocalDriver({self.info.name: self.buffer})
        self._prepared = (token, self._driver.prepare(tables, src_agents, dst_agents))

    def drive_local(
        self,
        tables: KernelTables | None,
        src_agents: list[AgentInfo],
        dst_agents: list[AgentInfo],
        deadline_s: float,
        token: int | None = None,
    ) -> host_local.LocalPullStats:
        """The pull; `tables` None: the one prepared under `token` (nothing big on the pipe)."""
        if self._driver is None:
            self._driver = host_local.HostLocalDriver({self.info.name: self.buffer})
        prepared = None
        if token is not None and self._prepared is not None and self._prepared[0] == token:
            prepared = self._prepared[1]
        self._prepared = None
        if tables is None:
            if prepared is None:
                raise TransferPlanError(STALE_PREPARED)
            tables = prepared.tables
        stats = self._driver.pull(
            tables, src_agents, dst_agents, time.monotonic() + deadline_s, prepared=prepared
        )
        return dataclasses.replace(stats, where="rank0")

    def driver_stats(self) -> host_local.DriverStats | None:
        return None if self._driver is None else self._driver.stats()

    def copy_engine(self) -> str:
        """What `copy_runs` uses here: "numpy" (DRAM), "triton" or "torch" (VRAM)."""
        return kernels.engine() if self.spec.memory is MemoryKind.VRAM else "numpy"

    def pool_stats(self) -> PoolStats:
        return self.pool.stats

    # -- the same-run VRAM baseline: one cudaMemcpy between two processes through CUDA IPC ------
    def export_scratch(self, nbytes: int) -> bytes:
        from beamserve.kv_transfer.backends.cuda_ipc import export_handle

        self._scratch = allocate(MemoryKind.VRAM, nbytes, self.spec.device).data
        self._scratch.fill_(7)
        return export_handle(self._scratch)

    def copy_from_scratch(self, blob: bytes, repeats: int = 3) -> float:
        """Median seconds of one device-to-device copy of the peer's whole scratch buffer."""
        import torch
        from beamserve.kv_transfer.backends.cuda_ipc import open_handle

        remote = open_handle(blob)
        local = torch.empty_like(remote)
        local.copy_(remote)
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            local.copy_(remote)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        ok = bool(torch.equal(local[:4096], remote[:4096]))
        del local, remote
        torch.cuda.synchronize()
        if not ok:
            raise KVTransferError("baseline: CUDA IPC copy read different bytes")
        return float(np.median(times))

    def drop_scratch(self) -> None:
        self._scratch = None
        if self.spec.memory is MemoryKind.VRAM:
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def verify(
        self, seq_len: int, pages: RequestPages, seed: int, sentinel_seed: int
    ) -> content.VerifyResult:
        return content.verify_request(
            self._download(), self.spec.layout, self.spec.rank, seq_len, pages, seed, sentinel_seed
        )

    def checksums(self, seq_len: int, pages: RequestPages) -> dict[content.SliceKey, int]:
        return content.slice_checksums(
            self._download(), self.spec.layout, self.spec.rank, seq_len, pages
        )

    def stats(self) -> AgentStats:
        return self.agent.stats()

    def close(self) -> AgentStats:
        for tag in list(self._held):
            self.release_staging(tag)
        if self._driver is not None:
            self._driver.close()
            self._driver = None
        self.agent.close()
        return self.agent.stats()


def _rank_main(conn: Connection, spec: RankSpec) -> None:
    try:
        rank = _Rank(spec)
    except BaseException as exc:  # report start-up failures instead of dying silently
        conn.send(("err", _portable(exc)))
        return
    conn.send(("ok", rank.info))
    while True:
        try:
            while not conn.poll(IDLE_POLL_S):
                rank.agent.idle_progress()
            cmd, args = conn.recv()
        except EOFError:
            rank.agent.close()
            return
        try:
            result = getattr(rank, cmd)(*args)
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("err", _portable(exc)))
        if cmd == "close":
            return


def _portable(exc: BaseException) -> BaseException:
    if isinstance(exc, KVTransferError | ValueError | RuntimeError):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


LOCAL_IN = ("auto", "rank0", "caller")


def _caller_engine(device: int) -> str:
    """The copy engine the host-local driver would use in this process (it starts CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "none (no CUDA in the calling process)"
        torch.cuda.set_device(device)
    except ImportError:
        return "none (no torch in the calling process)"
    try:
        return kernels.engine()
    except RuntimeError as exc:  # BEAMSERVE_KV_COPY=triton and the kernel failed here
        return f"none ({exc})"


class RankGroup:
    """The processes of one pool's TP group (one per rank), each with a registered KV region."""

    def __init__(
        self,
        group: str,
        layout: PoolLayout,
        backend: str,
        memory: MemoryKind = MemoryKind.DRAM,
        staging_bytes: int = 0,
        device: int = 0,
        local_in: str | None = None,
    ) -> None:
        self.group, self.layout, self.backend = group, layout, backend
        self.memory, self.staging_bytes = MemoryKind(memory), staging_bytes
        self.device = device
        self._engine0: str | None = None  # the host-local driver's copy engine, asked once
        # Where the host-local driver runs: in rank 0's process (a pipe round trip per pull),
        # in this, the calling process (no pipe; this process then holds a CUDA context), or
        # `auto` (the default): the caller where it can run the Triton engine itself (torch
        # with CUDA on this group's GPU, the kernel's self-check passed), else rank 0.
        raw = local_in or os.environ.get("BEAMSERVE_KV_LOCAL_IN", "auto") or "auto"
        self.local_in = raw.strip().lower()
        if self.local_in not in LOCAL_IN:
            raise KVTransferError(
                f"BEAMSERVE_KV_LOCAL_IN: {raw!r} unsupported; choose one of {LOCAL_IN}"
            )
        self._caller_driver: host_local.HostLocalDriver | None = None
        self._caller_prepared: tuple[int, host_local.PreparedPull] | None = None
        self._token = 0  # of the last prepare_local
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self.infos: list[AgentInfo] = []
        try:
            for r in range(layout.topology.tp_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_rank_main,
                    args=(
                        child,
                        RankSpec(group, r, layout, backend, self.memory, staging_bytes, device),
                    ),
                    name=f"{group}-rank{r}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self.infos = [self._recv(r, START_TIMEOUT_S) for r in range(self.size)]
        except BaseException:
            self.kill_all()
            raise

    @property
    def size(self) -> int:
        return self.layout.topology.tp_size

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def call(
        self,
        ranks: Sequence[int],
        cmd: str,
        args: Callable[[int], tuple[Any, ...]],
        timeout_s: float,
    ) -> list[Any]:
        """Send `cmd` to every rank in `ranks` at once, then collect answers in rank order."""
        sent: list[int] = []
        first_err: BaseException | None = None
        for r in ranks:
            try:
                self._send(r, cmd, args(r))
                sent.append(r)
            except PeerLostError as exc:  # still collect the ranks already sent to
                first_err = first_err or exc
        deadline = time.monotonic() + timeout_s
        results: list[Any] = []
        for r in ranks:
            if r not in sent:
                results.append(None)
                continue
            try:
                results.append(self._recv(r, max(0.0, deadline - time.monotonic())))
            except BaseException as exc:  # keep draining the others so pipes stay in step
                results.append(None)
                first_err = first_err or exc
        if first_err is not None:
            raise first_err
        return results

    def call_all(self, cmd: str, *args: Any, timeout_s: float = 600.0) -> list[Any]:
        return self.call(range(self.size), cmd, lambda _r: args, timeout_s)

    def read(self, ops_by_rank: dict[int, list[ReadOp]], deadline_s: float) -> list[Any]:
        """Each listed rank runs its reads; the group enforces the deadline from outside too."""
        ranks = sorted(ops_by_rank)
        return self.call(
            ranks, "read", lambda r: (ops_by_rank[r], deadline_s), deadline_s + GRACE_S
        )

    # -- the host-local driver (rank 0's process drives every rank's copy) ----------------------
    def host_local_refusal(self, peers: Sequence[AgentInfo]) -> str | None:
        """None if rank 0 can drive pulls from `peers` into this group with one launch."""
        why = host_local.refusal([*peers, *self.infos], self.memory, self.device)
        if why is None and self.memory is MemoryKind.DRAM:
            # DRAM: the copy threads run anywhere; the caller maps the regions itself.
            if self.local_in == "auto":
                self.local_in = "caller"
            return None
        if why is None:
            if self._engine0 is None:
                if self.local_in in ("caller", "auto"):
                    self._engine0 = _caller_engine(self.device)
                    if self.local_in == "auto":
                        # The caller when it runs the engine itself; rank 0 otherwise.
                        self.local_in = "caller" if self._engine0 == "triton" else "rank0"
                        log.info("kv_local_driver_place", place=self.local_in, caller=self._engine0)
                if self.local_in == "rank0":
                    self._engine0 = str(self.call([0], "copy_engine", lambda _r: (), 60.0)[0])
            if self._engine0 != "triton":
                why = (
                    f"host_local: needs the Triton copy engine; the driver ({self.local_in}) "
                    f"runs {self._engine0}"
                )
        return why

    def prepare_local(
        self, tables: KernelTables, src_agents: Sequence[AgentInfo], deadline_s: float
    ) -> int:
        """Make the pull of `tables` ready in the driver's process while the caller plans
        (`HostLocalDriver.prepare`: map, check owners, bind, look the launch up; from rank 0,
        the table crosses the pipe here, not in the pull). Returns the token for
        `drive_local`; one prepared pull at a time."""
        self._token += 1
        if self.local_in == "caller":
            if self._caller_driver is None:
                self._caller_driver = host_local.HostLocalDriver()
            self._caller_prepared = (
                self._token,
                self._caller_driver.prepare(tables, src_agents, self.infos),
            )
        else:
            token = self._token
            self.call(
                [0],
                "prepare_local",
                lambda _r: (tables, list(src_agents), list(self.infos), token),
                deadline_s + GRACE_S,  # as every rank call: past its deadline the rank is killed
            )
        return self._token

    def drive_local(
        self,
        tables: KernelTables,
        src_agents: Sequence[AgentInfo],
        deadline_s: float,
        token: int | None = None,
    ) -> host_local.LocalPullStats:
        """One launch copies the whole request into every rank of this group, from rank 0's
        process or (`local_in` "caller") from this one; `token`: `prepare_local`'s for these
        `tables` (a stale one is prepared again inside the pull)."""
        if self.local_in == "caller":
            if self._caller_driver is None:
                self._caller_driver = host_local.HostLocalDriver()
            ready = self._caller_prepared
            self._caller_prepared = None
            prepared = ready[1] if ready is not None and ready[0] == token else None
            stats = self._caller_driver.pull(
                tables, src_agents, self.infos, time.monotonic() + deadline_s, prepared
            )
            return dataclasses.replace(stats, where="caller")

        def ask(send: KernelTables | None) -> host_local.LocalPullStats:
            out: host_local.LocalPullStats = self.call(
                [0],
                "drive_local",
                lambda _r: (send, list(src_agents), list(self.infos), deadline_s, token),
                deadline_s + GRACE_S,
            )[0]
            return out

        if token is None:
            return ask(tables)
        try:
            return ask(None)  # the table crossed in prepare_local
        except TransferPlanError as exc:
            if str(exc) != STALE_PREPARED:
                raise
            return ask(tables)

    def kill(self, rank: int) -> None:
        proc = self._procs[rank]
        if proc.is_alive():
            proc.kill()
        proc.join(5)

    def kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)

    def close(self, timeout_s: float = 30.0) -> list[AgentStats | None]:
        """Deregister every rank's memory and end the processes; returns final agent stats."""
        if self._caller_driver is not None:
            self._caller_driver.close()  # unmap the ranks' regions before they go
            self._caller_driver = None
        final: list[AgentStats | None] = []
        for r, proc in enumerate(self._procs):
            if not proc.is_alive():
                final.append(None)
                continue
            try:
                self._send(r, "close", ())
                final.append(self._recv(r, timeout_s))
            except KVTransferError:
                final.append(None)
        for proc in self._procs:
            proc.join(timeout_s)
        self.kill_all()
        for c in self._conns:
            c.close()
        return final

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, r: int, cmd: str, args: tuple[Any, ...]) -> None:
        try:
            self._conns[r].send((cmd, args))
        except (BrokenPipeError, OSError) as exc:
            raise PeerLostError(f"{self.group} rank {r}: process is gone") from exc

    def _recv(self, r: int, timeout_s: float) -> Any:
        conn, proc = self._conns[r], self._procs[r]
        end = time.monotonic() + timeout_s
        while not conn.poll(min(0.05, max(0.0, end - time.monotonic()))):
            if not proc.is_alive():
                raise PeerLostError(f"{self.group} rank {r}: process exited ({proc.exitcode})")
            if time.monotonic() >= end:
                self.kill(r)
                raise TransferTimeoutError(
                    f"{self.group} rank {r}: no answer within {timeout_s:.1f}s; rank killed"
                )
        try:
            status, payload = conn.recv()
        except EOFError as exc:
            raise PeerLostError(f"{self.group} rank {r}: process exited") from exc
        if status == "err":
            raise payload
        return payload
