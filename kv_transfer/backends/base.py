"""The one small interface both transfer backends implement.

Lifecycle: `register` one KV region → publish `AgentInfo` → `connect` peers from their
`AgentInfo` → `post_read` descriptor lists → `poll` until DONE/ERR → `release` → `close`
(deregisters everything). `read_all` runs a batch of reads against a deadline and guarantees
that, on any outcome, no transfer handle is left alive.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.backends.names import ALL_BACKENDS as ALL_BACKENDS
from beamserve.kv_transfer.backends.names import BACKENDS as BACKENDS
from beamserve.kv_transfer.backends.names import SHARED_MEMORY as SHARED_MEMORY
from beamserve.kv_transfer.errors import (
    PeerLostError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.memory import Buffer, MemoryKind, as_buffer

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True)
class AgentInfo:
    """What a rank publishes so that peers can read its region."""

    backend: str
    name: str
    metadata: bytes
    base_addr: int
    region_bytes: int
    memory: str = MemoryKind.DRAM.value  # the region's kind: "dram" or "vram"
    device: int = 0


@dataclass(frozen=True)
class ReadOp:
    """Read `lengths` bytes at `remote_offsets` of `peer`'s region into `local_offsets` of ours."""

    peer: AgentInfo
    local_offsets: I64
    remote_offsets: I64
    lengths: I64


@dataclass
class AgentStats:
    registered_regions: int = 0
    registered_bytes: int = 0
    live_transfers: int = 0
    peers: int = 0
    bytes_read: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class TransferAgent(ABC):
    backend: ClassVar[str]
    # Memory kinds this backend can register (a region of another kind is refused, typed).
    memory_kinds: ClassVar[tuple[MemoryKind, ...]] = (MemoryKind.DRAM,)
    # Seconds to sleep between polls: 0 where polling itself drives progress (NIXL/UCX).
    poll_interval: ClassVar[float] = 0.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._region: Buffer | None = None
        self._live: dict[int, Any] = {}
        self._peers: dict[str, AgentInfo] = {}
        self._bytes_read = 0

    # -- what a backend implements -------------------------------------------------------------
    def idle_progress(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Let the backend make progress while the owning process waits for work."""

    @abstractmethod
    def _register(self, region: Buffer) -> bytes:
        """Register the region with the backend; return this agent's metadata blob."""

    @abstractmethod
    def _deregister(self) -> None: ...

    @abstractmethod
    def _connect(self, peer: AgentInfo) -> None: ...

    @abstractmethod
    def _disconnect(self, peer: AgentInfo) -> None: ...

    @abstractmethod
    def _post(self, op: ReadOp) -> Any:
        """Start the reads; return a backend handle. Raise PeerLostError if refused."""

    @abstractmethod
    def _poll(self, handle: Any) -> XferState: ...

    @abstractmethod
    def _release(self, handle: Any) -> None:
        """Cancel if still running and free the handle; must not raise."""

    # -- the shared contract -------------------------------------------------------------------
    def register(self, region: U8 | Buffer) -> AgentInfo:
        """Register host memory (a numpy array or a DRAM `Buffer`) or GPU memory (a VRAM
        `Buffer`); the plan is the same either way, the memory kind is the region's."""
        if self._region is not None:
            raise RuntimeError(f"agent {self.name}: a region is already registered")
        buf = as_buffer(region)
        if buf.kind not in self.memory_kinds:
            raise TransferPlanError(
                f"memory: the {self.backend} backend here cannot register {buf.kind.value}; "
                f"it supports {[k.value for k in self.memory_kinds]} (use "
                f"{'nixl or cuda_ipc' if buf.kind is MemoryKind.VRAM else 'nixl'} for "
                f"{buf.kind.value})"
            )
        meta = self._register(buf)
        self._region = buf
        return AgentInfo(
            self.backend, self.name, meta, buf.addr, buf.nbytes, buf.kind.value, buf.device
        )

    def connect(self, peer: AgentInfo) -> None:
        if peer.backend != self.backend:
            raise TransferPlanError(
                f"backend: peer {peer.name} speaks {peer.backend}, we speak {self.backend}; "
                "configure both pools with the same transfer backend"
            )
        if peer.name not in self._peers:
            self._connect(peer)
            self._peers[peer.name] = peer

    def disconnect(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is not None:
            try:
                self._disconnect(peer)
            except Exception:  # the peer may already be gone; forgetting it is what matters
                pass

    def post_read(self, op: ReadOp) -> int:
        """Check bounds on both sides, post, and return a transfer id for `poll`/`release`."""
        region = self._require_region()
        n = op.lengths
        if len(n):
            if (op.local_offsets < 0).any() or int((op.local_offsets + n).max()) > len(region):
                raise TransferPlanError(f"local_offsets: outside this rank's {len(region)} B")
            if (op.remote_offsets < 0).any() or int((op.remote_offsets + n).max()) > (
                op.peer.region_bytes
            ):
                raise TransferPlanError(
                    f"remote_offsets: outside peer {op.peer.name}'s {op.peer.region_bytes} B"
                )
        self.connect(op.peer)
        handle = self._post(op)
        xid = id(handle)
        self._live[xid] = handle
        return xid

    def poll(self, xid: int) -> XferState:
        return self._poll(self._live[xid])

    def release(self, xid: int) -> None:
        handle = self._live.pop(xid, None)
        if handle is not None:
            self._release(handle)

    def read_all(self, ops: list[ReadOp], deadline: float) -> int:
        """Run every read to completion before `deadline` (time.monotonic()), or fail typed.

        Raises TransferTimeoutError past the deadline and PeerLostError when a backend reports
        a failure; in every case all handles are released before returning.
        """
        posted: list[tuple[int, ReadOp]] = []
        try:
            for op in ops:
                if len(op.lengths):
                    posted.append((self.post_read(op), op))
            pending = list(posted)
            while pending:
                still = []
                for xid, op in pending:
                    state = self.poll(xid)
                    if state is XferState.ERR:
                        self.disconnect(op.peer.name)
                        raise PeerLostError(
                            f"peer {op.peer.name}: {self.backend} reported a failed read; "
                            "the prefill rank is gone or unreachable"
                        )
                    if state is XferState.PROC:
                        still.append((xid, op))
                pending = still
                if pending and self.poll_interval:
                    time.sleep(self.poll_interval)
                if pending and time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"{len(pending)} of {len(posted)} reads still running at the deadline; "
                        "cancelled (raise the deadline or check the link)"
                    )
            moved = sum(int(op.lengths.sum()) for _, op in posted)
            self._bytes_read += moved
            return moved
        finally:
            for xid, _ in posted:
                self.release(xid)

    def close(self) -> None:
        for xid in list(self._live):
            self.release(xid)
        for name in list(self._peers):
            self.disconnect(name)
        if self._region is not None:
            self._deregister()
            self._region = None

    def stats(self) -> AgentStats:
        region = self._region
        return AgentStats(
            registered_regions=0 if region is None else 1,
            registered_bytes=0 if region is None else len(region),
            live_transfers=len(self._live),
            peers=len(self._peers),
            bytes_read=self._bytes_read,
        )

    def _require_region(self) -> Buffer:
        if self._region is None:
            raise RuntimeError(f"agent {self.name}: register a region first")
        return self._region


def make_agent(backend: str, name: str) -> TransferAgent:
    """Instantiate the named backend (`nixl`, `mooncake`, `cma`, `shm` or `cuda_ipc`)."""
    if backend == "shm":
        from beamserve.kv_transfer.backends.shm import ShmAgent

        return ShmAgent(name)
    if backend == "cma":
        from beamserve.kv_transfer.backends.cma import CmaAgent

        return CmaAgent(name)
    if backend == "cuda_ipc":
        from beamserve.kv_transfer.backends.cuda_ipc import CudaIpcAgent

        return CudaIpcAgent(name)
    if backend == "nixl":
        from beamserve.kv_transfer.backends.nixl import NixlAgent

        return NixlAgent(name)
    if backend == "mooncake":
        from beamserve.kv_transfer.backends.mooncake import MooncakeAgent

        return MooncakeAgent(name)
    raise TransferPlanError(
        f"backend: {backend!r} unknown; choose 'nixl', 'mooncake', 'cma', 'shm' or 'cuda_ipc'"
    )
