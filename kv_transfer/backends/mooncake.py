"""Mooncake transfer-engine agent (TCP transport, P2P handshake; no metadata server).

Mooncake's batch calls are synchronous and its TCP transport rejects very large batches, so a
read runs on a worker thread in chunks of `CHUNK` descriptors; `release` stops it between
chunks, which bounds cancellation latency to one chunk.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp, TransferAgent, XferState
from beamserve.kv_transfer.errors import KVTransferError
from beamserve.kv_transfer.memory import Buffer, MemoryKind

CHUNK = 512


@dataclass
class _Job:
    op: ReadOp
    cancel: threading.Event = field(default_factory=threading.Event)
    state: XferState = XferState.PROC
    thread: threading.Thread | None = None


class MooncakeAgent(TransferAgent):
    backend = "mooncake"
    # The build this project pins (mooncake-transfer-engine-efa-non-cuda) has no CUDA support:
    # it cannot register VRAM. Mooncake's CUDA builds (mooncake-transfer-engine, cu12) can; they
    # are not installable next to nixl-cu12 here, so VRAM goes through nixl or cuda_ipc.
    memory_kinds = (MemoryKind.DRAM,)
    poll_interval = 0.0005

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        super().__init__(name)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", "3")
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise KVTransferError(f"mooncake: TransferEngine.initialize failed ({rc})")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._addr = 0

    def _register(self, region: Buffer) -> bytes:
        self._addr = region.addr
        rc = self._engine.register_memory(self._addr, region.nbytes)
        if rc != 0:
            raise KVTransferError(f"mooncake: register_memory failed ({rc})")
        return self._session.encode()

    def _deregister(self) -> None:
        self._engine.unregister_memory(self._addr)

    def _connect(self, peer: AgentInfo) -> None:
        pass  # P2P handshake happens on first use of the session id

    def _disconnect(self, peer: AgentInfo) -> None:
        pass

    def _post(self, op: ReadOp) -> _Job:
        job = _Job(op)
        job.thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        job.thread.start()
        return job

    def _run(self, job: _Job) -> None:
        op = job.op
        target = op.peer.metadata.decode()
        local = (op.local_offsets + self._addr).tolist()
        remote = (op.remote_offsets + op.peer.base_addr).tolist()
        lengths = op.lengths.tolist()
        for i in range(0, len(lengths), CHUNK):
            if job.cancel.is_set():
                return
            rc = self._engine.batch_transfer_sync_read(
                target, local[i : i + CHUNK], remote[i : i + CHUNK], lengths[i : i + CHUNK]
            )
            if rc != 0:
                job.state = XferState.ERR
                return
        job.state = XferState.DONE

    def _poll(self, handle: _Job) -> XferState:
        return handle.state

    def _release(self, handle: _Job) -> None:
        handle.cancel.set()
        if handle.thread is not None:
            # Bounded: one chunk, or MC_TRANSFER_TIMEOUT if the peer hangs mid-chunk.
            handle.thread.join(timeout=float(os.environ["MC_TRANSFER_TIMEOUT"]) + 1)
