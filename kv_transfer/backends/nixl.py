"""NIXL (UCX backend) transfer agent: DRAM↔DRAM reads between processes.

Agents run without NIXL's progress thread: NIXL's thread spins without a delay, and eight
spinning prefill ranks starve the readers on a small host. A reader drives progress from
`poll`; an idle rank calls `idle_progress` between commands, which is all UCX wire-up needs
from the target side (one-sided reads need nothing from it at all).

A read is posted in chunks (`CHUNK_DESCS`, `CHUNK_BYTES`), the next when the previous is done,
so that a deadline can interrupt it.

On a host without RDMA devices (no `/sys/class/infiniband/*`) UCX's InfiniBand modules are
left unloaded (`UCX_MODULES=^ib`, unless the environment sets `UCX_MODULES`): they have nothing
to drive there, and the libnl-route that the wheel bundles for them crashes in its destructor
when the process exits (SIGSEGV in `rtnl_tc_unregister` from `_dl_fini`: exit status 139, or a
process that spins forever where another SIGSEGV handler returns into the fault).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp, TransferAgent, XferState
from beamserve.kv_transfer.errors import PeerLostError
from beamserve.kv_transfer.memory import Buffer, MemoryKind

# One NIXL transfer covers at most this many descriptors / about this many bytes. On one host
# UCX copies through CMA inside `transfer()` itself, so a posted transfer cannot be stopped;
# posting a read a chunk at a time lets `read_all` check its deadline, and cancel, between
# chunks (a chunk is ~10 ms of copying).
CHUNK_DESCS = 4096
CHUNK_BYTES = 64 << 20


RDMA_CLASS = "/sys/class/infiniband"


def ucx_environment(environ: MutableMapping[str, str], rdma_class: str = RDMA_CLASS) -> None:
    """Before UCX starts: leave its InfiniBand modules out where the host has no RDMA device
    (module docstring). An explicit ``UCX_MODULES`` is the operator's and stays as it is."""
    if "UCX_MODULES" in environ:
        return
    try:
        devices = os.listdir(rdma_class)
    except OSError:
        devices = []
    if not devices:
        environ["UCX_MODULES"] = "^ib"


class NixlAgent(TransferAgent):
    backend = "nixl"
    # DRAM through UCX CMA on one host; VRAM through UCX's cuda_ipc/cuda_copy transports (the
    # memory kind is the region's: NIXL registers and describes it as "DRAM" or "VRAM").
    memory_kinds = (MemoryKind.DRAM, MemoryKind.VRAM)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        ucx_environment(os.environ)
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._reg: Any = None
        self._remote_names: dict[str, str] = {}

    def idle_progress(self) -> None:
        self._agent.get_new_notifs()  # drives the UCX worker

    def _register(self, region: Buffer) -> bytes:
        self._reg = self._agent.register_memory(
            [(region.addr, region.nbytes, region.device, "")], region.kind.nixl
        )
        return bytes(self._agent.get_agent_metadata())

    def _deregister(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def _connect(self, peer: AgentInfo) -> None:
        try:
            remote = self._agent.add_remote_agent(peer.metadata)
        except Exception as exc:  # nixlBackendError: UCX cannot reach the peer's worker
            raise PeerLostError(
                f"peer {peer.name}: NIXL could not connect ({exc}); the prefill rank is gone "
                "or unreachable"
            ) from exc
        self._remote_names[peer.name] = remote.decode() if isinstance(remote, bytes) else remote

    def _disconnect(self, peer: AgentInfo) -> None:
        remote = self._remote_names.pop(peer.name, None)
        if remote is not None:
            self._agent.remove_remote_agent(remote)

    def _post(self, op: ReadOp) -> _Job:
        region = self._require_region()
        n = op.lengths.astype(np.uint64)
        ldev = np.full(len(n), region.device, dtype=np.uint64)
        rdev = np.full(len(n), op.peer.device, dtype=np.uint64)
        local = np.stack(
            [op.local_offsets.astype(np.uint64) + np.uint64(region.addr), n, ldev], axis=1
        )
        remote = np.stack(
            [op.remote_offsets.astype(np.uint64) + np.uint64(op.peer.base_addr), n, rdev], axis=1
        )
        job = _Job(op, local, remote, _chunk_bounds(op.lengths))
        job.local_kind = region.kind.nixl
        job.remote_kind = MemoryKind(op.peer.memory).nixl
        self._post_chunk(job)
        return job

    def _post_chunk(self, job: _Job) -> None:
        """Post the job's next chunk; on failure forget the peer and raise PeerLostError."""
        peer = job.op.peer.name
        lo, hi = job.bounds[job.next], job.bounds[job.next + 1]
        handle = None
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(job.local[lo:hi], job.local_kind),
                self._agent.get_xfer_descs(job.remote[lo:hi], job.remote_kind),
                self._remote_names[peer],
            )
            state = self._agent.transfer(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            if handle is not None:  # created but never handed out: free it here
                self._release_handle(handle)
            self.disconnect(peer)
            raise PeerLostError(f"peer {peer}: NIXL refused the read ({exc})") from exc
        if state == "ERR":
            self._release_handle(handle)
            self.disconnect(peer)
            raise PeerLostError(f"peer {peer}: NIXL failed to post the read")
        job.handle, job.next = handle, job.next + 1

    def _poll(self, handle: _Job) -> XferState:
        try:
            state = XferState(self._agent.check_xfer_state(handle.handle))
        except Exception:
            return XferState.ERR
        if state is XferState.DONE and handle.next < len(handle.bounds) - 1:
            self._release_handle(handle.handle)
            handle.handle = None
            try:
                self._post_chunk(handle)
            except PeerLostError:
                return XferState.ERR
            return XferState.PROC
        return state

    def _release(self, handle: _Job) -> None:
        if handle.handle is not None:
            self._release_handle(handle.handle)
            handle.handle = None

    def _release_handle(self, xfer: Any) -> None:
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(xfer)


@dataclass
class _Job:
    """One read, posted to NIXL a chunk at a time (`bounds` delimit the chunks)."""

    op: ReadOp
    local: npt.NDArray[np.uint64]  # (n, 3) rows: address, length, device id
    remote: npt.NDArray[np.uint64]
    bounds: list[int]
    next: int = 0  # index of the next chunk to post
    handle: Any = None  # the posted chunk's NIXL transfer handle
    local_kind: str = "DRAM"
    remote_kind: str = "DRAM"


def _chunk_bounds(lengths: npt.NDArray[np.int64]) -> list[int]:
    """Split descriptors into runs of at most CHUNK_DESCS descriptors and about CHUNK_BYTES."""
    n = len(lengths)
    if n == 0:
        return [0, 0]
    ends = np.cumsum(lengths)
    bounds = [0]
    while bounds[-1] < n:
        lo = bounds[-1]
        by_bytes = int(np.searchsorted(ends, ends[lo] - lengths[lo] + CHUNK_BYTES, side="right"))
        bounds.append(min(n, lo + CHUNK_DESCS, max(lo + 1, by_bytes)))
    return bounds
