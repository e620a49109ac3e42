"""Memory that KV lives in: host DRAM (numpy) or GPU VRAM (torch CUDA tensors), one interface.

A `Buffer` is a flat byte range with an address, a size, a kind and a device. Plans never look at
the kind: offsets are bytes either way; the kind decides how a backend registers the memory
(NIXL `DRAM` or `VRAM`) and which copy engine `copy_runs` uses (numpy on the host; on the GPU
one Triton kernel launch for all runs, `beamserve.kv_transfer.kernels`, or where Triton is
missing torch `index_select` / `index_copy_` kernels).

`copy_runs` moves many (source offset, destination offset, length) runs in a few vectorised
operations: runs are grouped by length, and each group is one row gather over a row view whose
row size is the largest unit that divides every offset and length of the group.
"""

from __future__ import annotations

import enum
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.errors import KVTransferError, TopologyError

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class MemoryKind(enum.StrEnum):
    DRAM = "dram"
    VRAM = "vram"

    @property
    def nixl(self) -> str:
        """NIXL's memory-type string for this kind."""
        return "DRAM" if self is MemoryKind.DRAM else "VRAM"


def parse_memory(value: str) -> MemoryKind:
    try:
        return MemoryKind(value)
    except ValueError:
        raise TopologyError(
            f"memory: {value!r} unsupported; choose one of {[k.value for k in MemoryKind]}"
        ) from None


@dataclass
class Buffer:
    """A flat, byte-addressed range of host or device memory.

    `data` is a 1-D `np.uint8` array (DRAM) or a 1-D `torch.uint8` CUDA tensor (VRAM).
    """

    kind: MemoryKind
    data: Any
    device: int = 0
    # DRAM in shared memory (`allocate(..., shared=True)`): the memfd that holds it, which
    # other processes of the host map (`map_shared`); -1 for private memory and for views.
    fd: int = -1

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])

    @property
    def addr(self) -> int:
        if self.kind is MemoryKind.DRAM:
            return int(self.data.ctypes.data)
        return int(self.data.data_ptr())

    def __len__(self) -> int:
        return self.nbytes

    def view(self, start: int, stop: int) -> Buffer:
        return Buffer(self.kind, self.data[start:stop], self.device)

    def alias(self, start: int, stop: int) -> Buffer:
        """Bytes [start, stop) as a buffer of their own. For VRAM the tensor gets its own torch
        storage over the same device memory: torch refuses `index_select(..., out=)` between two
        views of one storage even where they do not overlap (the staging area and the KV
        region live in one registered allocation)."""
        if self.kind is MemoryKind.DRAM:
            return self.view(start, stop)
        import torch

        owner = _DeviceSpan(self.addr + start, stop - start, self.data)
        t = torch.as_tensor(owner, device=f"cuda:{self.device}")
        return Buffer(self.kind, t, self.device)

    def host(self) -> U8:
        """The bytes as a host array (a copy for VRAM)."""
        if self.kind is MemoryKind.DRAM:
            return self.data  # type: ignore[no-any-return]
        return self.data.cpu().numpy()  # type: ignore[no-any-return]

    def upload(self, host: U8, start: int = 0) -> None:
        """Copy host bytes into this buffer at `start` (a no-op copy target for DRAM views)."""
        if self.kind is MemoryKind.DRAM:
            self.data[start : start + len(host)] = host
            return
        import torch

        self.data[start : start + len(host)].copy_(torch.from_numpy(host), non_blocking=False)

    def synchronize(self) -> None:
        if self.kind is MemoryKind.VRAM:
            import torch

            torch.cuda.synchronize(self.device)


class _DeviceSpan:
    """A raw device byte range exposed through `__cuda_array_interface__` (keeps its parent
    tensor alive), so that torch wraps it in a new storage."""

    def __init__(self, ptr: int, nbytes: int, parent: Any) -> None:
        self.parent = parent
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def as_buffer(region: U8 | Buffer) -> Buffer:
    """Accept a bare host array where a `Buffer` is expected (older callers pass numpy)."""
    if isinstance(region, Buffer):
        return region
    return Buffer(MemoryKind.DRAM, region)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def allocate(kind: MemoryKind, nbytes: int, device: int = 0, shared: bool = False) -> Buffer:
    """Zeroed memory of `kind`. VRAM needs torch with CUDA and a visible GPU. `shared` DRAM
    lives in a memfd (anonymous shared memory) that other processes of this host can map
    (`map_shared`, the `shm` backend); its pages are populated here, not at first touch."""
    if kind is MemoryKind.DRAM:
        if shared:
            return _allocate_shared(nbytes)
        return Buffer(kind, np.zeros(nbytes, dtype=np.uint8))
    if not cuda_available():
        raise TopologyError(
            "memory: vram needs a CUDA GPU visible to torch (torch.cuda.is_available() is "
            "False here); run on a GPU host or use --memory dram"
        )
    import torch

    torch.cuda.set_device(device)
    return Buffer(kind, torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}"), device)


def _allocate_shared(nbytes: int) -> Buffer:
    if not hasattr(os, "memfd_create"):
        raise TopologyError(
            "memory: shared DRAM needs memfd_create (Linux); use the cma or nixl backend here"
        )
    fd = os.memfd_create("beamserve-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        m = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.close(fd)
        raise
    _populate_writable(m)
    _MAPS[fd] = m  # the mapping lives as long as this process (a region is never freed)
    return Buffer(MemoryKind.DRAM, np.frombuffer(m, dtype=np.uint8, count=nbytes), fd=fd)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value
_MAPS: dict[int, mmap.mmap] = {}


def _populate_writable(m: mmap.mmap) -> None:
    """MAP_POPULATE maps a shared mapping's pages read-only (a read fault each), so the first
    write to each page would still fault; populate them writable now, content untouched
    (Linux ≥ 5.14; elsewhere the first copy pays the faults)."""
    try:
        m.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass


def map_shared(pid: int, fd: int, nbytes: int, writable: bool) -> U8:
    """Map `nbytes` of the memfd `fd` of process `pid` on this host (through
    /proc/PID/fd/FD, which needs the same access as reading that process's memory), its page
    tables populated now so that no copy pays the first-touch faults. The mapping is unmapped
    when the last array over it goes. Raises
    FileNotFoundError/ProcessLookupError where the process or the fd is gone and
    PermissionError where access is refused."""
    path = f"/proc/{pid}/fd/{fd}"
    f = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        if os.fstat(f).st_size < nbytes:
            raise FileNotFoundError(f"{path} holds fewer than {nbytes} bytes: not the region")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = mmap.mmap(f, nbytes, mmap.MAP_SHARED | _POPULATE, prot)
    finally:
        os.close(f)
    if writable:
        _populate_writable(m)
    arr = np.frombuffer(m, dtype=np.uint8, count=nbytes)
    if not writable:
        arr.flags.writeable = False
    return arr


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def copy_threads() -> int:
    """Threads a host-local copy on the CPU uses: `BEAMSERVE_KV_COPY_THREADS`, else the host's
    cores up to 4 (a memory bus is saturated by a few copying cores)."""
    raw = os.environ.get("BEAMSERVE_KV_COPY_THREADS", "").strip()
    if not raw:
        return min(4, host_cores())
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise TopologyError(
            f"BEAMSERVE_KV_COPY_THREADS: {raw!r} is not a positive integer (threads per copy)"
        )
    return n


ROW_LOOP_BYTES = 4096


def _unit(*arrays: I64, cap: int = 1 << 16) -> int:
    g = 0
    for a in arrays:
        if len(a):
            g = int(np.gcd(g, np.gcd.reduce(a)))
    g = int(np.gcd(g, cap)) if g else cap
    # Row views need a power of two that divides the buffer sizes (regions are multiples of 4 KiB).
    return 1 << (g & -g).bit_length() - 1


def length_classes(lengths: I64) -> list[I64]:
    """Indices of runs grouped by length (longest first; plan order kept inside a group)."""
    if not len(lengths):
        return []
    top = lengths.max()
    if top == lengths.min():
        return [np.arange(len(lengths), dtype=np.int64)]
    # Plans hold few lengths (whole pages, a partial page or two, a few merged runs): peel
    # classes off longest first, each pass over what is left, rather than sort everything.
    out: list[I64] = []
    idx = np.arange(len(lengths), dtype=np.int64)
    rest = lengths
    while len(rest):
        if len(out) == 8:  # many lengths after all: sort what is left
            out += [idx[rest == v] for v in np.unique(rest)[::-1]]
            break
        hit = rest == top
        out.append(idx[hit])
        keep = ~hit
        idx, rest = idx[keep], rest[keep]
        if len(rest):
            top = rest.max()
    return out


def copy_runs(src: Buffer, src_off: I64, dst: Buffer, dst_off: I64, lengths: I64) -> int:
    """dst[dst_off[i] : +lengths[i]] = src[src_off[i] : +lengths[i]] for every run; returns bytes.

    Both buffers must be of the same kind (the local side of a transfer). Runs must not overlap on
    the destination. On VRAM with Triton: one kernel launch, every byte read and written once
    (`kernels.triton_copy_runs`); otherwise vectorised: one gather per group of equal-length runs.
    """
    if src.kind is not dst.kind:
        raise KVTransferError(
            f"copy_runs: source is {src.kind.value}, destination {dst.kind.value}; local copies "
            "stay within one memory kind (transfers cross kinds)"
        )
    if len(lengths) and int(lengths.min()) <= 0:  # empty runs copy nothing (row views would)
        keep = lengths > 0
        src_off, dst_off, lengths = src_off[keep], dst_off[keep], lengths[keep]
    if dst.kind is MemoryKind.VRAM and len(lengths):
        from beamserve.kv_transfer import kernels

        if kernels.engine() == "triton":
            kernels.triton_copy_runs(src.data, dst.data, src_off, dst_off, lengths)
            return int(lengths.sum())
    total = 0
    for sel in length_classes(lengths):
        so, do, n = src_off[sel], dst_off[sel], lengths[sel]
        L = int(n[0])
        u = _unit(so, do, n[:1], np.array([src.nbytes, dst.nbytes], dtype=np.int64))
        r = L // u
        s_rows = so // u
        d_rows = do // u
        if r > 1:
            step = np.arange(r, dtype=np.int64)
            s_idx = (s_rows[:, None] + step[None, :]).reshape(-1)
            d_idx = (d_rows[:, None] + step[None, :]).reshape(-1)
        else:
            s_idx, d_idx = s_rows, d_rows
        _copy_rows(src, dst, u, s_idx, d_idx)
        total += L * len(sel)
    return total


def _contiguous_start(idx: I64) -> int | None:
    """The first index if `idx` is one ascending run of consecutive integers, else None."""
    n = len(idx)
    if n and int(idx[-1]) - int(idx[0]) == n - 1 and (n < 3 or bool((np.diff(idx) == 1).all())):
        return int(idx[0])
    return None


def _copy_rows(src: Buffer, dst: Buffer, u: int, s_idx: I64, d_idx: I64) -> None:
    n = len(s_idx)
    s0, d0 = _contiguous_start(s_idx), _contiguous_start(d_idx)
    if src.kind is MemoryKind.DRAM:
        s_rows = src.data.reshape(-1, u)
        d_rows = dst.data.reshape(-1, u)
        if d0 is not None and s0 is not None:
            d_rows[d0 : d0 + n] = s_rows[s0 : s0 + n]
        elif u >= ROW_LOOP_BYTES:
            # Large rows: one memcpy per row beats numpy's fancy indexing, which copies through
            # a temporary (measured 2.6 vs 1.7 GB/s for 16 KiB rows on the 2-core VM).
            for i, j in zip(d_idx.tolist(), s_idx.tolist(), strict=True):
                d_rows[i] = s_rows[j]
        elif d0 is not None:  # gather into a contiguous staging slice
            d_rows[d0 : d0 + n] = s_rows[s_idx]
        elif s0 is not None:  # scatter out of a contiguous staging slice
            d_rows[d_idx] = s_rows[s0 : s0 + n]
        else:
            d_rows[d_idx] = s_rows[s_idx]
        return
    import torch

    wide = torch.int64 if u % 8 == 0 else torch.uint8
    w = u // 8 if wide is torch.int64 else u
    s_rows = src.data.view(wide).view(-1, w) if wide is torch.int64 else src.data.view(-1, u)
    d_rows = dst.data.view(wide).view(-1, w) if wide is torch.int64 else dst.data.view(-1, u)
    dev = dst.data.device
    if d0 is not None and s0 is not None:
        d_rows[d0 : d0 + n].copy_(s_rows[s0 : s0 + n])
    elif d0 is not None:
        torch.index_select(
            s_rows, 0, torch.from_numpy(s_idx).to(dev, non_blocking=True), out=d_rows[d0 : d0 + n]
        )
    elif s0 is not None:
        di = torch.from_numpy(d_idx).to(dev, non_blocking=True)
        d_rows.index_copy_(0, di, s_rows[s0 : s0 + n])
    else:
        si = torch.from_numpy(s_idx).to(dev, non_blocking=True)
        di = torch.from_numpy(d_idx).to(dev, non_blocking=True)
        d_rows.index_copy_(0, di, s_rows.index_select(0, si))
