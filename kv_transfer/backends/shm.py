"""Shared-memory transfer agent: DRAM regions that every process of one host maps and copies
in user space.

`cma` and UCX read a peer's DRAM with `process_vm_readv`: the kernel pins and copies page by
page, ≈ 5.5 GB/s a core here against ≈ 8 GB/s for a user-space memcpy. Here a rank's region
lives in a memfd (`memory.allocate(..., shared=True)`); a reader maps the peer's memfd once at
`connect` (through ``/proc/PID/fd/FD``, page tables populated then, not in a timed read) and a
read is a plain copy between the two mappings (`memory.copy_runs`). The host-local driver
(`host_local.py`) maps every region of a request this way and copies the whole request with a
few threads (`host_local.StridedEngine`).

The metadata blob is JSON: the owner (`host_local.host_identity`: boot id, pid, pid namespace)
and the memfd's number in the owner's process. A peer on another host is refused at `connect`
(`TransferPlanError` naming nixl/mooncake). A mapping keeps the memory alive after its owner
exits, so a read never faults; instead the owner is checked (its pidfd, one `poll`) after each
read, and a read that ends after the owner exited fails (`PeerLostError`): the bytes it copied
may be from a prefill that no longer vouches for them. Opening another process's fd needs the
access that reading its memory needs (same user; PermissionError → `TransferPlanError` naming
the fix).
"""

from __future__ import annotations

import json
import os
import select
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp, TransferAgent, XferState
from beamserve.kv_transfer.errors import PeerLostError, TransferPlanError
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs, map_shared

CHUNK_BYTES = 64 << 20  # copied per poll: deadlines and cancels are honoured between chunks


@dataclass(frozen=True)
class ShmPeer:
    """What a shm region's metadata names: its owner's host and pid, and the owner's memfd."""

    boot_id: str
    pid: int
    fd: int


def parse_metadata(info: AgentInfo) -> ShmPeer:
    try:
        doc = json.loads(info.metadata)
        owner = doc["owner"]
        return ShmPeer(str(owner["boot_id"]), int(owner["pid"]), int(doc["fd"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferPlanError(
            f"peer {info.name}: its shm metadata is unreadable ({exc}); both pools must run "
            "this beamserve's shm backend"
        ) from None


def open_region(info: AgentInfo, writable: bool = False) -> Buffer:
    """Map a shm peer's region (see `memory.map_shared`), refusing a peer of another host
    (`TransferPlanError`); a gone owner or fd is `PeerLostError`. The mapping goes when the
    last array over it does."""
    from beamserve.kv_transfer.host_local import boot_id

    peer = parse_metadata(info)
    if peer.boot_id != boot_id():
        raise TransferPlanError(
            f"peer {info.name} runs on another host (boot id {peer.boot_id}): shm maps memory "
            "only between processes of one host; use the nixl or mooncake backend across hosts"
        )
    try:
        arr = map_shared(peer.pid, peer.fd, info.region_bytes, writable)
    except PermissionError:
        raise TransferPlanError(
            f"peer {info.name} (pid {peer.pid}): no permission to open its memory "
            f"(/proc/{peer.pid}/fd/{peer.fd}); shm needs both ranks under one user in one pid "
            "namespace, else use the cma or nixl backend"
        ) from None
    except (FileNotFoundError, ProcessLookupError, OSError) as exc:
        raise PeerLostError(
            f"peer {info.name} (pid {peer.pid}): its region cannot be mapped ({exc}); the "
            "process is gone"
        ) from None
    return Buffer(MemoryKind.DRAM, arr)


class ShmAgent(TransferAgent):
    backend = "shm"
    memory_kinds = (MemoryKind.DRAM,)

    def __init__(self, name: str, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(name)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._maps: dict[str, _Mapped] = {}

    def _register(self, region: Buffer) -> bytes:
        from beamserve.kv_transfer.host_local import host_identity

        if region.fd < 0:
            raise TransferPlanError(
                f"agent {self.name}: the shm backend registers shared memory only; allocate "
                "the region with memory.allocate(..., shared=True)"
            )
        return json.dumps({"owner": host_identity(), "fd": region.fd}).encode()

    def _deregister(self) -> None:
        for name in list(self._maps):
            self._drop(name)

    def _connect(self, peer: AgentInfo) -> None:
        from beamserve.kv_transfer import host_local

        buf = open_region(peer)
        owner = host_local.region_owner(peer)
        watch = host_local.watch_owner(owner)
        if watch == host_local.GONE:
            raise PeerLostError(f"peer {peer.name}: its process exited")
        self._maps[peer.name] = _Mapped(buf, owner, watch)

    def _disconnect(self, peer: AgentInfo) -> None:
        self._drop(peer.name)

    def _drop(self, name: str) -> None:
        got = self._maps.pop(name, None)
        if got is not None and got.watch is not None and got.watch >= 0:
            os.close(got.watch)  # the mapping goes with the last array over it

    def _post(self, op: ReadOp) -> _Job:
        got = self._maps.get(op.peer.name)
        if got is None:
            raise PeerLostError(f"peer {op.peer.name}: not connected")
        lengths = np.asarray(op.lengths, dtype=np.int64)
        return _Job(
            op.peer.name,
            got,
            np.asarray(op.local_offsets, dtype=np.int64),
            np.asarray(op.remote_offsets, dtype=np.int64),
            lengths,
            np.cumsum(lengths),
        )

    def _poll(self, handle: _Job) -> XferState:
        """Copy about `chunk_bytes` more, the owner checked before each chunk and after the
        last: bytes copied once the owner is gone are void."""
        job = handle
        if job.failed is not None:
            return XferState.ERR
        if not job.src.alive():
            pid = job.src.owner.pid if job.src.owner is not None else "?"
            job.failed = f"peer {job.peer} (pid {pid}) exited during the read"
            return XferState.ERR
        n = len(job.lengths)
        if job.next == n:
            return XferState.DONE
        done = int(job.ends[job.next - 1]) if job.next else 0
        stop = int(np.searchsorted(job.ends, done + self.chunk_bytes, side="right"))
        stop = min(n, max(stop, job.next + 1))
        sel = slice(job.next, stop)
        local = self._require_region()
        copy_runs(job.src.buf, job.remote[sel], local, job.local[sel], job.lengths[sel])
        self._bytes_read += int(job.lengths[sel].sum())
        job.next = stop
        return XferState.PROC  # the next poll checks the owner once more, then says DONE

    def _release(self, handle: _Job) -> None:
        handle.next = len(handle.lengths)


@dataclass
class _Mapped:
    buf: Buffer
    owner: Any  # host_local.RegionOwner | None
    watch: int | None  # the owner's pidfd, or None where only `kill(pid, 0)` can tell

    def alive(self) -> bool:
        from beamserve.kv_transfer import host_local

        if self.watch is not None and self.watch >= 0:
            p = select.poll()
            p.register(self.watch, select.POLLIN)
            return not p.poll(0)  # readable once the owner exited
        return self.owner is None or host_local.owner_alive(self.owner)


@dataclass
class _Job:
    peer: str
    src: _Mapped
    local: Any
    remote: Any
    lengths: Any
    ends: Any
    next: int = 0
    failed: str | None = field(default=None)
