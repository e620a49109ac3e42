"""The host-local driver: one process copies a whole request, one kernel launch, on one GPU.

Where every prefill rank and every decode rank of a transfer keep their KV on the same GPU of
one host (one GPU shared by both pools, as on the H200 test machine), the direct path's cost
is not the copy: the client hands each decode rank process its ≈ 47K descriptors through a pipe
and waits for all of them, each builds and uploads its own table, and the processes take turns
on the GPU. Here one process (decode rank 0 in a `RankGroup`) maps every source and every
destination region once through CUDA IPC (`connect`, kept across requests), and a request is:

    decode client:  compact_plan → kernel_tables          (the plan, ≈ 260 KB at 8:4 / 80K)
    driver, prepare (while the client plans): owner checks → bind region offsets into the
                    pinned upload buffer → look the captured graph up
    driver, pull:   one graph launch (table upload + kernel, between its timing events) →
                    wait for its end event → owner checks again

`HostLocalDriver` is device-agnostic: regions are opened by an `open_region` callable and
copied by an engine — the Triton kernel (`kernels.launch_compact`) on VRAM, or a numpy player
of the same table (`compact.program_runs`) on DRAM, which is how the CPU tests drive it.

Faults stay typed: a region that cannot be mapped, or whose owner process is gone before or
after the copy, is a `PeerLostError` (the dead region is unmapped); a copy still running at the
deadline is waited out (queued device work cannot be recalled) and raised as
`TransferTimeoutError`; a CUDA error is a `PeerLostError`. Owners are read from the region's
cuda_ipc metadata (`host_identity`: boot id, pid, pid namespace); a pid is checked only where it
is in this process's pid namespace (one `kill(pid, 0)`: a zombie — exited, not yet reaped by
its parent — counts as alive until it is reaped).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog
from beamserve.kv_transfer import gate
from beamserve.kv_transfer.backends.base import AgentInfo
from beamserve.kv_transfer.compact import HEADER, KernelTables, program_runs
from beamserve.kv_transfer.errors import PeerLostError, TransferPlanError, TransferTimeoutError
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_threads
from numpy.lib.stride_tricks import as_strided

log = structlog.get_logger(__name__)

DRIVER = "host_local"
RANKS = "ranks"
DRIVERS = ("auto", RANKS, DRIVER)
SPIN_S = 0.05  # poll the copy's event without sleeping this long (copies take ms), then sleep
POLL_S = 50e-6
GRAPHS_KEPT = 8  # captured launches kept per engine (one per base region and table shape)


def configured_driver() -> str:
    """`BEAMSERVE_KV_DRIVER`: auto (the cost model decides), ranks or host_local."""
    value = os.environ.get("BEAMSERVE_KV_DRIVER", "auto").strip().lower() or "auto"
    if value not in DRIVERS:
        raise TransferPlanError(
            f"BEAMSERVE_KV_DRIVER: {value!r} unsupported; choose one of {list(DRIVERS)}"
        )
    return value


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_PID_NS: list[str] = []  # this process's pid namespace (it never changes), read once


def _pid_ns() -> str:
    if not _PID_NS:
        try:
            _PID_NS.append(os.readlink("/proc/self/ns/pid"))
        except OSError:
            _PID_NS.append("")
    return _PID_NS[0]


def host_identity() -> dict[str, Any]:
    """What a region's metadata says about its owner: host (boot id), pid, pid namespace."""
    return {"boot_id": boot_id(), "pid": os.getpid(), "pid_ns": _pid_ns()}


@dataclass(frozen=True)
class RegionOwner:
    boot_id: str
    pid: int
    pid_ns: str


def region_owner(info: AgentInfo) -> RegionOwner | None:
    """The owner named in a cuda_ipc region's metadata (None: an older peer, or not JSON)."""
    try:
        doc = json.loads(info.metadata)
        owner = doc["owner"]
        return RegionOwner(str(owner["boot_id"]), int(owner["pid"]), str(owner["pid_ns"]))
    except (ValueError, KeyError, TypeError):
        return None


def owner_alive(owner: RegionOwner, thorough: bool = False) -> bool:
    """False only where the owner is provably gone: its pid is in our pid namespace and no
    longer exists. One `kill(pid, 0)` (a pull checks every region twice: this is its cost);
    `thorough` also reads /proc to call a zombie (exited, not yet reaped) gone."""
    if owner.pid_ns != _pid_ns() or not owner.pid_ns:
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    if not thorough:
        return True
    try:
        with open(f"/proc/{owner.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


GONE = -1  # `watch_owner`: the owner had exited already


def watch_owner(owner: RegionOwner | None) -> int | None:
    """A pidfd of `owner` (readable once it exits: zombies count as exited), `GONE` where it
    has exited already, or None where a pidfd cannot tell (no owner, another pid namespace,
    a kernel or Python without `pidfd_open`): then `owner_alive` is asked each time."""
    if owner is None or owner.pid_ns != _pid_ns() or not owner.pid_ns:
        return None
    try:
        return os.pidfd_open(owner.pid)
    except ProcessLookupError:
        return GONE
    except (AttributeError, OSError):
        return None


# The backend whose regions the driver maps, per memory kind.
REGION_BACKEND = {MemoryKind.VRAM: "cuda_ipc", MemoryKind.DRAM: "shm"}


def refusal(agents: Sequence[AgentInfo], memory: MemoryKind, device: int) -> str | None:
    """None where the host-local driver can move between these regions, else why not: VRAM
    regions exported through cuda_ipc on one GPU, or DRAM regions in shared memory (shm), all
    owned by processes of this host."""
    need = REGION_BACKEND[memory]
    here = boot_id()
    for a in agents:
        if a.backend != need:
            return (
                f"host_local: moves {memory.value} between {need} regions; {a.name} speaks "
                f"{a.backend}"
            )
        owner = region_owner(a)
        if owner is None:
            return f"host_local: {a.name} publishes no owner (an older beamserve); use ranks"
        if owner.boot_id != here or not here:
            return f"host_local: {a.name} lives on another host; use the ranks driver"
        if memory is MemoryKind.VRAM and a.device != device:
            return (
                f"host_local: {a.name} is on GPU {a.device}, the driver on GPU {device}; one "
                "launch serves one GPU (use the ranks driver)"
            )
    return None


@dataclass(frozen=True)
class LocalPullStats:
    bytes_moved: int
    seconds: float  # bind + upload + launch + wait, inside the driver
    kernel_s: float  # the launch alone (device events; 0 on the numpy engine)
    programs: int
    table_bytes: int
    # Where the time went inside the driver (seconds): owner checks, bind, upload + launch
    # call, wait; and when the pull entered and left the driver (time.perf_counter(), one
    # clock for every process of a host), so a caller can tell its pipe from the driver.
    phases: dict[str, float] = field(default_factory=dict)
    entered: float = 0.0
    left: float = 0.0
    where: str = ""  # which process drove: "rank0" or "caller" (a RankGroup's), or ""


@dataclass
class PreparedPull:
    """A pull made ready ahead of its copy (`HostLocalDriver.prepare`)."""

    tables: KernelTables
    involved: list[AgentInfo]
    regions: list[Buffer]
    base: Buffer | None  # None: nothing to copy
    table: Any  # the bound table, in the engine's upload buffer where it has one
    launch: Any  # the engine's launch looked up ahead (`TritonEngine.prepare`), or None
    generation: int
    phases: dict[str, float] = field(default_factory=dict)  # checks, bind, lookup (seconds)

    def valid(self, generation: int, tables: KernelTables) -> bool:
        return self.generation == generation and self.tables is tables


@dataclass
class DriverStats:
    mapped_regions: int
    live_launches: int
    pulls: int
    bytes_moved: int


class CopyLaunch(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def kernel_s(self) -> float: ...


class CopyEngine(Protocol):
    """Runs one bound table over the regions (`regions[i]` at `addrs[i]`, base = min);
    `prep` is what its `prepare` (where it has one) returned for that table."""

    def launch(
        self,
        t: KernelTables,
        table: Any,
        regions: Sequence[Buffer],
        base: Buffer,
        prep: Any = None,
    ) -> CopyLaunch: ...


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def kernel_s(self) -> float:
        return 0.0


class NumpyEngine:
    """The kernel's addressing played on host memory, program by program (tests, CPU)."""

    def launch(
        self,
        t: KernelTables,
        table: Any,
        regions: Sequence[Buffer],
        base: Buffer,
        prep: Any = None,
    ) -> CopyLaunch:
        so, do, n = program_runs(t, table)
        starts = np.array([r.addr for r in regions], dtype=np.int64)
        order = np.argsort(starts)
        sorted_starts = starts[order]
        e = t.elem
        for s_el, d_el, n_el in zip(so.tolist(), do.tolist(), n.tolist(), strict=True):
            src, s0 = self._locate(base.addr + s_el * e, n_el * e, regions, order, sorted_starts)
            dst, d0 = self._locate(base.addr + d_el * e, n_el * e, regions, order, sorted_starts)
            dst.data[d0 : d0 + n_el * e] = src.data[s0 : s0 + n_el * e]
        return _Done()

    @staticmethod
    def _locate(
        addr: int, nbytes: int, regions: Sequence[Buffer], order: Any, starts: Any
    ) -> tuple[Buffer, int]:
        j = int(np.searchsorted(starts, addr, side="right")) - 1
        if j < 0:
            raise TransferPlanError(f"host_local: address {addr:#x} below every region")
        region = regions[int(order[j])]
        off = addr - region.addr
        if off + nbytes > region.nbytes:
            raise TransferPlanError(f"host_local: run at {addr:#x} (+{nbytes}) outside its region")
        return region, off


class _Part:
    """One thread's share of a CPU copy: runs of segments, each segment a pair of views."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any, bool, list[tuple[int, int, int]]]] = []
        self.nbytes = 0


@dataclass(frozen=True)
class _CpuPrep:
    parts: list[_Part]
    nbytes: int


class _ThreadLaunch:
    def __init__(self, futures: list[Any], stop: threading.Event, t0: float) -> None:
        self.futures, self.stop, self.t0 = futures, stop, t0

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        concurrent.futures.wait(self.futures)

    def cancel(self) -> None:
        self.stop.set()

    def wait_for(self, timeout_s: float) -> bool:
        """Block until the copy ends or `timeout_s` passes; True if it ended."""
        concurrent.futures.wait(self.futures, timeout=max(0.0, timeout_s))
        return self.done()

    def kernel_s(self) -> float:
        """The copy's time (first thread start to last thread end); a thread's error here."""
        ends = [f.result() for f in self.futures]
        return max(ends, default=self.t0) - self.t0


class StridedEngine:
    """The table's copies on host memory (DRAM regions mapped from shared memory), in a few
    threads. A segment's block bases step by one stride on each side (one per (layer, K/V):
    its pages are laid out back to back), so each run of the segment is one strided copy of
    `blocks` rows (`D[:, d:d+n] = S[:, s:s+n]` over views of stride the block step): 8:4 at
    80K tokens is ≈ 10K numpy copies of 18 × 16 KiB instead of 190K of 16 KiB. Pieces split
    off one run, and runs that touch on both sides, are merged first. numpy leaves the GIL
    while it copies, so the threads copy at once; each takes an equal share of the bytes.
    A segment whose bases do not step evenly is copied block by block."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads if threads is not None else copy_threads()
        if self.threads < 1:
            raise TransferPlanError(f"copy threads: {self.threads}; at least 1")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def prepare(
        self, t: KernelTables, table: Any, base: Buffer, regions: Sequence[Buffer] = ()
    ) -> _CpuPrep:
        by_addr = {r.addr: r for r in regions}
        tab, rows, e = table, 1 << t.log2, t.elem
        o_bsrc, o_bdst, o_rsrc, o_rdst, o_rlen = (int(v) for v in tab[:5])
        starts = [int(v) for v in tab[HEADER : HEADER + t.segments]] + [t.programs]
        segs = []
        for k in range(t.segments):
            col = [int(tab[HEADER + c * rows + k]) for c in range(1, 6)]
            ni, boff, roff, s_off, d_off = col
            if ni == 0:
                continue
            nb = (starts[k + 1] - starts[k]) // ni
            src = by_addr.get(base.addr + s_off * e)
            dst = by_addr.get(base.addr + d_off * e)
            if src is None or dst is None:
                raise TransferPlanError(f"host_local: segment {k} names a region not given")
            bs = tab[o_bsrc + boff : o_bsrc + boff + nb] * e
            bd = tab[o_bdst + boff : o_bdst + boff + nb] * e
            rs = tab[o_rsrc + roff : o_rsrc + roff + ni] * e
            rd = tab[o_rdst + roff : o_rdst + roff + ni] * e
            rl = tab[o_rlen + roff : o_rlen + roff + ni] * e
            rs, rd, rl = _merge_runs(rs, rd, rl)
            for buf, b, r, side in ((src, bs, rs, "source"), (dst, bd, rd, "destination")):
                lo, hi = int(b.min() + r.min()), int(b.max() + (r + rl).max())
                if lo < 0 or hi > buf.nbytes:
                    raise TransferPlanError(
                        f"host_local: segment {k} reaches [{lo}, {hi}) of a {buf.nbytes} B "
                        f"{side} region"
                    )
            segs.extend(_segment_items(src.data, dst.data, bs, bd, rs, rd, rl))
        total = sum(nbytes for *_x, nbytes in segs)
        return _CpuPrep(_split(segs, self.threads, total), total)

    def launch(
        self,
        t: KernelTables,
        table: Any,
        regions: Sequence[Buffer],
        base: Buffer,
        prep: Any = None,
    ) -> CopyLaunch:
        if not isinstance(prep, _CpuPrep):
            prep = self.prepare(t, table, base, regions)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="kv-copy"
            )
        stop = threading.Event()
        t0 = time.perf_counter()
        futures = [self._pool.submit(_copy_part, p, stop) for p in prep.parts if p.items]
        return _ThreadLaunch(futures, stop, t0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _merge_runs(rs: Any, rd: Any, rl: Any) -> tuple[Any, Any, Any]:
    """Runs in source order, neighbours that touch on both sides merged into one."""
    order = np.argsort(rs, kind="stable")
    rs, rd, rl = rs[order], rd[order], rl[order]
    if len(rs) < 2:
        return rs, rd, rl
    joins = (rs[:-1] + rl[:-1] == rs[1:]) & (rd[:-1] + rl[:-1] == rd[1:])
    first = np.concatenate(([True], ~joins))
    group = np.cumsum(first) - 1
    lengths = np.bincount(group, weights=rl).astype(np.int64)
    return rs[first], rd[first], lengths


def _steps(b: Any) -> int | None:
    """The one positive step between consecutive bases, or None."""
    if len(b) < 2:
        return None
    d = np.diff(b)
    step = int(d[0])
    return step if step > 0 and bool((d == step).all()) else None


def _segment_items(
    src: Any, dst: Any, bs: Any, bd: Any, rs: Any, rd: Any, rl: Any
) -> list[tuple[Any, Any, bool, list[tuple[int, int, int]], int]]:
    """(source view, destination view, 2-D?, runs, bytes) for one segment: one pair of
    strided views where both sides' bases step evenly, else a pair of flat views a block."""
    runs = list(zip(rs.tolist(), rd.tolist(), rl.tolist(), strict=True))
    per_block = int(rl.sum())
    ss, sd = _steps(bs), _steps(bd)
    nb = len(bs)
    if nb > 1 and ss is not None and sd is not None:
        span_s, span_d = int((rs + rl).max()), int((rd + rl).max())
        s_view = as_strided(src[int(bs[0]) :], shape=(nb, span_s), strides=(ss, 1), writeable=False)
        d_view = as_strided(dst[int(bd[0]) :], shape=(nb, span_d), strides=(sd, 1))
        return [(s_view, d_view, True, runs, per_block * nb)]
    return [
        (src[int(b0) :], dst[int(b1) :], False, runs, per_block)
        for b0, b1 in zip(bs.tolist(), bd.tolist(), strict=True)
    ]


def _split(
    items: list[tuple[Any, Any, bool, list[tuple[int, int, int]], int]], n: int, total: int
) -> list[_Part]:
    """`n` parts of about `total / n` bytes each, in order, cutting an item's runs where a
    part's share ends."""
    parts = [_Part() for _ in range(n)]
    share = total / n if total else 1.0
    done = 0
    for s_view, d_view, two_d, runs, nbytes in items:
        rows = nbytes // max(1, sum(r[2] for r in runs))  # blocks each of the item's runs covers
        i = 0
        while i < len(runs):
            k = min(n - 1, int(done // share))
            limit = (k + 1) * share if k < n - 1 else float("inf")
            j, got = i, 0
            while j < len(runs) and (j == i or done + got < limit):
                got += runs[j][2] * rows
                j += 1
            parts[k].items.append((s_view, d_view, two_d, runs[i:j]))
            parts[k].nbytes += got
            done += got
            i = j
    return parts


def _copy_part(part: _Part, stop: threading.Event) -> float:
    for s_view, d_view, two_d, runs in part.items:
        if stop.is_set():
            break
        if two_d:
            for so, do, n in runs:
                d_view[:, do : do + n] = s_view[:, so : so + n]
        else:
            for so, do, n in runs:
                d_view[do : do + n] = s_view[so : so + n]
    return time.perf_counter()


class _CudaLaunch:
    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end
        self.detail: dict[str, float] = {}
        self.replayed = False

    def done(self) -> bool:
        return bool(self.end.query())

    def wait(self) -> None:
        self.end.synchronize()

    def kernel_s(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1e3


@dataclass(frozen=True)
class _Prep:
    """A Triton launch looked up ahead (`TritonEngine.prepare`)."""

    key: tuple[int, ...]
    words: int  # table words uploaded (rounded up: `upload_words`)
    fn: Callable[..., None]
    args: tuple[Any, ...]
    graph: Any  # the captured upload + launch, or None (the first launch of this key)
    gate: int = 0  # the gate value its queued replay waits for (`gate.py`); 0: not queued


class TritonEngine:
    """One host-local launch on the calling thread's current stream, between two timing events.

    Per request: the bound table is written (by `bind`, through `upload_buffer`) straight into
    one pinned host buffer; the launch copies it into one device buffer and runs the kernel over
    it, both on the current stream of the engine's GPU (made the process's current device), so
    work this process queued there before (a region written here) comes first with no event or
    stream switch. The launch's grid and the table's length
    are rounded up (≤ 1/8 more: idle programs read the table and copy nothing; table words past
    the request's are never read), and the pinned buffer, the device buffer and the base region
    do not change between requests, so after its first launch for a (base, table length, grid)
    key, the upload *and* the kernel are captured in one CUDA graph, between its two timing
    events (`external` events: record nodes of the graph), and replayed: one `cudaGraphLaunch`
    per request, not two event records, a copy call and Triton's Python launch path. Buffers are
    reused only after the previous launch finished (the driver waits for every launch).

    With a graph for the key, `prepare` also *queues* its replay on a stream of its own behind
    a gate (`gate.py`: a stream memory wait on pinned host memory), after the work this
    process queued on the current stream so far; the pull's launch is then one store that
    opens the gate. A queued replay that the pull does not open in time, or that another
    prepare replaces, is disarmed (its table's run lengths zeroed, then released: it copies
    nothing). `BEAMSERVE_KV_LOCAL_GATE=0` switches it off.
    """

    def __init__(self, device: int, shape: Any = None) -> None:
        import torch
        from beamserve.kv_transfer import kernels

        self._torch = torch
        self.device = device
        # Every call of a launch goes to the current stream of the current device: this
        # process's (the driver's: decode rank 0's, or the coordinator's) is the group's GPU.
        torch.cuda.set_device(device)
        self.shape = kernels.local_shape() if shape is None else shape
        if self.shape.kernel == "loop" and not kernels.loop_available():
            self.shape = dataclasses.replace(self.shape, kernel="flat")
        self._capture_stream = torch.cuda.Stream(device=device)
        props = torch.cuda.get_device_properties(device)
        self.grid = int(props.multi_processor_count) * self.shape.per_sm
        self._host = torch.empty(0, dtype=torch.int64)
        self._host_np: Any = self._host.numpy()
        self._dev = torch.empty(0, dtype=torch.int64, device=f"cuda:{device}")
        try:  # timing events that a capture records as nodes of the graph: one call a pull
            self._start = torch.cuda.Event(enable_timing=True, external=True)
            self._end = torch.cuda.Event(enable_timing=True, external=True)
            self._events_in_graph = True
        except TypeError:  # an older torch: recorded around the replay
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._events_in_graph = False
        self._graphs: dict[tuple[int, ...], Any] = {}
        self._graph_on = bool(self.shape.graph)
        self.launches = 0
        self.replays = 0
        self.gated = 0  # launches that were one store opening a queued replay
        self._gate: gate.GateKeeper | None = None
        gate_on, hold_s = gate.gate_settings()
        if gate_on and self._graph_on and self._events_in_graph:
            try:
                bell = gate.CudaDoorbell(torch, device)
                self._gate = gate.GateKeeper(bell, lambda: self._host_np, hold_s)
                self._gate_stream = torch.cuda.Stream(device=device)
            except gate.GateError as exc:  # the pull replays its graph itself
                log.warning("kv_local_gate_off", error=str(exc))

    def _finished(self) -> None:
        """Wait for the last queued launch (from any thread: the gate's watchdog too)."""
        self._torch.cuda.set_device(self.device)
        self._end.synchronize()

    def upload_buffer(self, n: int) -> Any:
        """The pinned host buffer's first `n` words, for `KernelTables.bind(out=…)`. A
        replay still queued behind the gate is disarmed first (it reads this buffer)."""
        torch = self._torch
        if self._gate is not None:
            self._gate.disarm()
        if self._host.numel() < upload_words(n):
            size = 1 << max(16, (upload_words(n) - 1).bit_length())
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._host_np = self._host.numpy()
            self._dev = torch.empty(size, dtype=torch.int64, device=f"cuda:{self.device}")
            self._graphs.clear()  # they name the old buffers
        return self._host_np[:n]

    def prepare(
        self, t: KernelTables, table: Any, base: Buffer, regions: Sequence[Buffer] = ()
    ) -> _Prep:
        """What a launch of `t` over `base` needs, looked up before the pull: the upload's
        length, the kernel and its arguments, and the captured graph if there is one — which,
        with the gate on, is queued behind it here (`table` must be the bound upload buffer)."""
        prep = self._lookup(t, table, base)
        g = self._gate
        if g is None or prep.graph is None or len(table) == 0:
            return prep
        if table.ctypes.data != self._host_np.ctypes.data:
            return prep  # bound elsewhere: the launch copies it in first
        torch, graph, stream = self._torch, prep.graph, self._gate_stream
        lengths = (int(table[4]), len(table))  # the run lengths: the table's last section

        def enqueue() -> None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after this process's work
            with torch.cuda.stream(stream):
                graph.replay()

        try:
            value = g.arm(stream, lengths, enqueue, self._finished)
        except gate.GateError as exc:
            log.warning("kv_local_gate_off", error=str(exc))
            self._gate = None
            return prep
        return dataclasses.replace(prep, gate=value)

    def close(self) -> None:
        """Disarm a queued replay and stop the gate's watchdog."""
        if self._gate is not None:
            self._gate.close()

    def _lookup(self, t: KernelTables, table: Any, base: Buffer) -> _Prep:
        from beamserve.kv_transfer import kernels

        s, words = self.shape, upload_words(len(table))
        common = (base.addr, self._host.data_ptr(), self._dev.data_ptr(), words)
        if s.kernel == "flat" or t.steps > 1:  # pieces longer than one loop step: flat
            grid = upload_words(-(-t.programs // s.runs), floor=1)  # rounded up as the table
            key: tuple[int, ...] = (0, *common, t.log2, t.elem, t.align, t.steps, grid)
            fn: Any = kernels.launch_compact
            args: tuple[Any, ...] = (base.data, self._dev, t.log2, t.elem, t.align, t.steps,
                                     grid * s.runs, s.runs, s.warps)  # fmt: skip
        else:
            block = kernels.loop_block(t.elem, t.longest)
            key = (1, *common, t.log2, t.elem, t.align, block)
            fn = kernels.launch_compact_loop
            args = (base.data, self._dev, t.log2, t.elem, t.align, block, self.grid, s.warps,
                    s.ahead, s.evict, s.maxnreg)  # fmt: skip
        return _Prep(key, words, fn, args, self._graphs.get(key))

    def launch(
        self,
        t: KernelTables,
        table: Any,
        regions: Sequence[Buffer],
        base: Buffer,
        prep: Any = None,
    ) -> CopyLaunch:
        n = len(table)
        if prep is not None and prep.gate and self._gate is not None:
            t0 = time.perf_counter()
            if self._gate.open(prep.gate) is not None:  # one store: the replay queued ahead runs
                self.launches += 1
                self.replays += 1
                self.gated += 1
                launch = _CudaLaunch(self._start, self._end)
                launch.detail = {"open": time.perf_counter() - t0}
                launch.replayed = True
                return launch
            # Disarmed meanwhile (held past the gate's hold): wait for that empty run to end
            # (it reads the buffer), then put back the run lengths it zeroed.
            self._finished()
            lo = int(table[4])
            table[lo:] = t.table[lo:]  # binding leaves the run lengths as they are
        buf = self.upload_buffer(n)
        if table.ctypes.data != buf.ctypes.data:  # bound elsewhere: one copy into the buffer
            buf[:] = table
            prep = None  # the buffers may have moved
        if prep is None or (prep.graph is None and prep.key in self._graphs):
            prep = self._lookup(t, buf, base)
        t0 = time.perf_counter()
        whole = prep.graph is not None and self._events_in_graph  # one call: events inside
        if not whole:
            self._start.record()  # the current stream, as every call below
        t1 = time.perf_counter()
        self.launches += 1
        if prep.graph is not None:
            prep.graph.replay()
            self.replays += 1
        else:
            self._dev[: prep.words].copy_(self._host[: prep.words], non_blocking=True)
            prep.fn(*prep.args)
            if self._graph_on:
                self._capture(prep.key, prep.words, prep.fn, prep.args)
        t2 = time.perf_counter()
        if not whole:
            self._end.record()
        launch = _CudaLaunch(self._start, self._end)
        launch.detail = {"upload": t1 - t0, "kernel_call": t2 - t1}
        launch.replayed = prep.graph is not None
        return launch

    def _capture(
        self, key: tuple[int, ...], words: int, fn: Callable[..., None], args: tuple[Any, ...]
    ) -> None:
        """Record the upload and the launch just made into one graph for the next requests of
        this key (the capture records, it does not run: it overlaps the copy in flight)."""
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if self._events_in_graph:
                        self._start.record()  # event record nodes (`external` events)
                    self._dev[:words].copy_(self._host[:words], non_blocking=True)
                    fn(*args)
                    if self._events_in_graph:
                        self._end.record()
                finally:
                    graph.capture_end()
        except Exception as exc:  # no graphs here: a copy and Triton's launch path every time
            self._graph_on = False
            log.warning("kv_local_graph_off", error=repr(exc))
            return
        if len(self._graphs) >= GRAPHS_KEPT:
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = graph


def upload_words(n: int, floor: int = 0) -> int:
    """`n` rounded up to a multiple of 1/8 of its power of two (at least `floor`): how many
    table words a launch uploads, and its grid, so that requests of similar size share one
    captured graph (at most 1/8 more than needed)."""
    n = max(n, floor)
    unit = 1 << max(0, n.bit_length() - 4)
    return -(-n // unit) * unit


def open_cuda_ipc(info: AgentInfo) -> Buffer:
    from beamserve.kv_transfer.backends.cuda_ipc import open_handle

    return Buffer(MemoryKind.VRAM, open_handle(info.metadata), info.device)


def open_region(info: AgentInfo) -> Buffer:
    """Map a peer's region by its backend: a cuda_ipc handle, or a shm region (mapped
    writable: the driver writes destination regions and only reads source ones)."""
    if info.backend == "shm":
        from beamserve.kv_transfer.backends import shm

        return shm.open_region(info, writable=True)
    return open_cuda_ipc(info)


class HostLocalDriver:
    """Maps regions once and moves whole requests between them with one launch each.

    `own` holds the regions of this process by agent name (opened as they are: a process
    cannot open its own IPC handle). Not thread-safe: one pull at a time.
    """

    def __init__(
        self,
        own: dict[str, Buffer] | None = None,
        open_region: Callable[[AgentInfo], Buffer] = open_region,
        engine: CopyEngine | None = None,
    ) -> None:
        self._own = dict(own or {})
        self._open = open_region
        self._engine = engine
        self._mapped: dict[str, Buffer] = {}
        self._owners: dict[str, RegionOwner | None] = {}
        # Per mapped region: a pidfd of its owner (readable once the owner exits), GONE where
        # the owner had exited when it was mapped, None where only `kill(pid, 0)` can tell.
        self._watch: dict[str, int | None] = {}
        self._polls: dict[tuple[str, ...], tuple[Any, dict[int, str], list[str]]] = {}
        self._live = 0
        self._pulls = 0
        self._bytes = 0
        self._generation = 0  # bumped by every prepare and every pull: one prepared pull live

    def connect(self, agents: Sequence[AgentInfo]) -> None:
        """Map every region not mapped yet (once per peer: not in a request's timed path)."""
        for a in agents:
            if a.name in self._mapped or a.name in self._own:
                continue
            try:
                self._mapped[a.name] = self._open(a)
            except Exception as exc:  # the exporter is gone, or on another host
                raise PeerLostError(
                    f"host_local: could not map {a.name}'s region ({exc}); its process is gone"
                ) from exc
            self._owners[a.name] = owner = region_owner(a)
            self._watch[a.name] = watch_owner(owner)

    def disconnect(self, name: str) -> None:
        self._mapped.pop(name, None)
        self._owners.pop(name, None)
        fd = self._watch.pop(name, None)
        if fd is not None and fd >= 0:
            os.close(fd)
        self._polls.clear()

    def prepare(
        self,
        tables: KernelTables,
        src_agents: Sequence[AgentInfo],
        dst_agents: Sequence[AgentInfo],
    ) -> PreparedPull:
        """Everything of a pull that needs no KV yet, done while the decode side plans: map
        the regions, check their owners, bind the table into the engine's upload buffer and
        look its launch up. Source rank r's region is `src_agents[r]`'s, destination rank d's
        `dst_agents[d]`'s. Valid until the next `prepare` (one upload buffer): `pull` of an
        older one prepares again."""
        t0 = time.perf_counter()
        used_s = sorted({int(r) for r in tables.seg_src_rank})
        used_d = sorted({int(r) for r in tables.seg_dst_rank})
        for r, agents, side in ((used_s, src_agents, "source"), (used_d, dst_agents, "dest")):
            if r and r[-1] >= len(agents):
                raise TransferPlanError(
                    f"host_local: the plan names {side} rank {r[-1]}; {len(agents)} agents given"
                )
        involved = [src_agents[r] for r in used_s] + [dst_agents[r] for r in used_d]
        self.connect(involved)
        self._check_owners(involved, "before")
        t_check = time.perf_counter()
        self._generation += 1
        s_bufs = {r: self._region(src_agents[r]) for r in used_s}
        d_bufs = {r: self._region(dst_agents[r]) for r in used_d}
        regions = list(s_bufs.values()) + list(d_bufs.values())
        base = min(regions, key=lambda b: b.addr) if regions else None
        if base is None or tables.programs == 0:
            return PreparedPull(tables, involved, regions, None, None, None, self._generation)
        src_addrs = [s_bufs[r].addr if r in s_bufs else base.addr for r in range(len(src_agents))]
        dst_addrs = [d_bufs[r].addr if r in d_bufs else base.addr for r in range(len(dst_agents))]
        engine = self._engine_for(base)
        upload = getattr(engine, "upload_buffer", None)  # bind straight into the upload buffer
        out = upload(len(tables.table)) if upload is not None else None
        table = tables.bind(src_addrs, dst_addrs, base.addr, out=out)
        t_bind = time.perf_counter()
        ahead = getattr(engine, "prepare", None)
        prep = ahead(tables, table, base, regions) if ahead is not None else None
        t_end = time.perf_counter()
        phases = {"checks": t_check - t0, "bind": t_bind - t_check, "lookup": t_end - t_bind}
        return PreparedPull(tables, involved, regions, base, table, prep, self._generation, phases)

    def pull(
        self,
        tables: KernelTables,
        src_agents: Sequence[AgentInfo],
        dst_agents: Sequence[AgentInfo],
        deadline: float,
        prepared: PreparedPull | None = None,
    ) -> LocalPullStats:
        """Copy the request `tables` describes (see `prepare`; `prepared`: its result for these
        tables, else it is done here, inside the pull's time). `deadline` is time.monotonic().
        The owners are checked again after the copy: one that exited at any time since the
        `prepare` voids the pull."""
        t0 = time.perf_counter()
        if time.monotonic() >= deadline:
            raise TransferTimeoutError("host_local: deadline spent before the copy")
        ahead = prepared is not None and prepared.valid(self._generation, tables)
        if not ahead:
            prepared = self.prepare(tables, src_agents, dst_agents)
        assert prepared is not None
        t_ready = time.perf_counter()
        if prepared.base is None:
            return LocalPullStats(0, time.perf_counter() - t0, 0.0, 0, tables.nbytes)
        engine = self._engine_for(prepared.base)
        self._live += 1
        try:
            try:
                launch = engine.launch(
                    tables, prepared.table, prepared.regions, prepared.base, prepared.launch
                )
                t_launch = time.perf_counter()
                block = getattr(launch, "wait_for", None)  # CPU copies: block, do not spin
                if block is not None:  # (a spinning waiter holds the GIL the copiers need)
                    block(deadline - time.monotonic())
                while not launch.done():
                    if time.monotonic() >= deadline:
                        cancel = getattr(launch, "cancel", None)
                        if cancel is not None:  # CPU copies stop between runs
                            cancel()
                            launch.wait()
                            raise TransferTimeoutError(
                                "host_local: the copy was stopped at the deadline (raise it)"
                            )
                        launch.wait()  # queued device work cannot be recalled
                        raise TransferTimeoutError(
                            "host_local: the copy was still running at the deadline (it "
                            "finished before this returned; raise the deadline)"
                        )
                    if time.perf_counter() - t_launch > SPIN_S:
                        time.sleep(POLL_S)
                t_wait = time.perf_counter()
                kernel_s = launch.kernel_s()
            except RuntimeError as exc:  # a CUDA error on a mapped region
                raise PeerLostError(f"host_local: the device copy failed ({exc})") from exc
        finally:
            self._live -= 1
        self._check_owners(prepared.involved, "during")
        self._generation += 1  # the upload buffer is free again; a prepared pull runs once
        self._pulls += 1
        self._bytes += tables.nbytes_moved
        t_end = time.perf_counter()
        before = prepared.phases
        phases = {
            # Done ahead (in the decode side's planning): reported, not in this pull's time.
            **({f"ahead.{k}": v for k, v in before.items()} if ahead else {}),
            "checks": (0.0 if ahead else before.get("checks", 0.0)) + (t_end - t_wait),
            "bind": 0.0 if ahead else before.get("bind", 0.0) + before.get("lookup", 0.0),
            "launch": t_launch - t_ready,
            "wait": t_wait - t_launch,
        }
        # The engine's own split of the launch (upload call, kernel call or graph replay).
        detail = getattr(launch, "detail", None)
        if detail:
            phases.update({f"launch.{k}": v for k, v in detail.items()})
        return LocalPullStats(
            tables.nbytes_moved, t_end - t0, kernel_s, tables.programs, tables.nbytes,
            phases, t0, t_end,
        )  # fmt: skip

    def close(self) -> None:
        for name in list(self._mapped):
            self.disconnect(name)
        self._mapped.clear()
        self._owners.clear()
        stop = getattr(self._engine, "close", None)
        if stop is not None:
            stop()

    def stats(self) -> DriverStats:
        return DriverStats(len(self._mapped), self._live, self._pulls, self._bytes)

    def _region(self, a: AgentInfo) -> Buffer:
        return self._own[a.name] if a.name in self._own else self._mapped[a.name]

    def _check_owners(self, agents: Sequence[AgentInfo], when: str) -> None:
        """Raise `PeerLostError` (and unmap the region) where a region's owner has exited:
        one `poll(2)` over the owners' pidfds, `kill(pid, 0)` for owners without one."""
        key = tuple(a.name for a in agents)
        polled = self._polls.get(key)
        if polled is None:  # once per set of regions: a poller of their pidfds, and the rest
            poller, by_fd, rest = select.poll(), {}, []
            for a in agents:
                if a.name in self._own:
                    continue
                fd = self._watch.get(a.name)
                if fd is not None and fd >= 0:
                    poller.register(fd, select.POLLIN)
                    by_fd[fd] = a.name
                else:
                    rest.append(a.name)
            polled = self._polls[key] = (poller, by_fd, rest)
        poller, by_fd, rest = polled
        gone = [by_fd[fd] for fd, _ in poller.poll(0)] if by_fd else []
        for name in rest:  # exited when mapped, or no pidfd: `kill(pid, 0)`
            fd, owner = self._watch.get(name), self._owners.get(name)
            if fd == GONE or (owner is not None and not owner_alive(owner)):
                gone.append(name)
        if gone:
            name = gone[0]
            owner = self._owners.get(name)
            self.disconnect(name)
            pid = owner.pid if owner is not None else "?"
            raise PeerLostError(
                f"host_local: {name} (pid {pid}) exited {when} the copy; the pull "
                "is void (decode recomputes the prefill)"
            )

    def _engine_for(self, base: Buffer) -> CopyEngine:
        if self._engine is None:
            self._engine = (
                TritonEngine(base.device) if base.kind is MemoryKind.VRAM else StridedEngine()
            )
        return self._engine
