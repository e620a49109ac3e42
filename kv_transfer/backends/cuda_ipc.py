"""CUDA IPC transfer agent: VRAM↔VRAM reads between processes of one host.

Each rank exports its registered VRAM with a CUDA IPC handle (through torch's
`UntypedStorage._share_cuda_`); a peer opens it once (`cudaIpcOpenMemHandle`) and then reads
the peer's memory directly from device kernels on its own stream: a read of many descriptors
is one row-gather kernel per length class (`memory.copy_runs`), not one `cudaMemcpyAsync` per
descriptor (which is how UCX's cuda_ipc transport serves NIXL's VRAM descriptors, and what the
`nixl` backend on VRAM measures). A read finishes with a CUDA event that `poll` queries.

The metadata blob is JSON (no pickle crosses the wire): the handle's fields, base64 where binary,
and the owner (boot id, pid, pid namespace) that `host_local` checks.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp, TransferAgent, XferState
from beamserve.kv_transfer.errors import PeerLostError
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs


def export_handle(tensor: Any) -> bytes:
    """A JSON blob another process can open with `open_handle` (the tensor must stay alive)."""
    fields = tensor.untyped_storage()._share_cuda_()
    enc = [
        {"b": base64.b64encode(f).decode()} if isinstance(f, bytes) else {"v": f} for f in fields
    ]
    from beamserve.kv_transfer.host_local import host_identity

    # The owner (host, pid) lets a host-local driver tell a peer on this host, and a gone one.
    doc = {"fields": enc, "nbytes": int(tensor.numel()), "owner": host_identity()}
    return json.dumps(doc).encode()


def open_handle(blob: bytes) -> Any:
    """Map a peer's exported VRAM into this process: a flat `torch.uint8` CUDA tensor."""
    import torch

    doc = json.loads(blob)
    fields = [base64.b64decode(f["b"]) if "b" in f else f["v"] for f in doc["fields"]]
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    device = int(doc["fields"][0]["v"])
    t = torch.empty((0,), dtype=torch.uint8, device=f"cuda:{device}")
    t.set_(storage, 0, (doc["nbytes"],), (1,))
    return t


class CudaIpcAgent(TransferAgent):
    backend = "cuda_ipc"
    memory_kinds = (MemoryKind.VRAM,)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        import torch

        self._torch = torch
        self._remote: dict[str, Any] = {}
        self._stream: Any = None

    def _register(self, region: Buffer) -> bytes:
        self._stream = self._torch.cuda.Stream(device=region.device)
        return export_handle(region.data)

    def _deregister(self) -> None:
        self._torch.cuda.synchronize()

    def _connect(self, peer: AgentInfo) -> None:
        try:
            self._remote[peer.name] = open_handle(peer.metadata)
        except Exception as exc:  # cudaErrorInvalidValue etc.: the exporting process is gone
            raise PeerLostError(
                f"peer {peer.name}: could not open its CUDA IPC handle ({exc}); the prefill "
                "rank is gone, or runs on another host (cuda_ipc is one host only: use nixl)"
            ) from exc

    def _disconnect(self, peer: AgentInfo) -> None:
        self._remote.pop(peer.name, None)
        self._torch.cuda.synchronize()

    def _post(self, op: ReadOp) -> _Job:
        remote = self._remote.get(op.peer.name)
        if remote is None:
            raise PeerLostError(f"peer {op.peer.name}: not connected")
        torch = self._torch
        local = self._require_region()
        job = _Job(op)
        try:
            with torch.cuda.stream(self._stream):
                copy_runs(
                    Buffer(MemoryKind.VRAM, remote, local.device),
                    op.remote_offsets,
                    local,
                    op.local_offsets,
                    op.lengths,
                )
                job.event = torch.cuda.Event()
                job.event.record(self._stream)
        except RuntimeError as exc:  # a CUDA error on the peer mapping
            self.disconnect(op.peer.name)
            raise PeerLostError(f"peer {op.peer.name}: CUDA IPC read failed ({exc})") from exc
        return job

    def _poll(self, handle: _Job) -> XferState:
        try:
            done = handle.event is None or bool(handle.event.query())
        except Exception:
            return XferState.ERR
        return XferState.DONE if done else XferState.PROC

    def _release(self, handle: _Job) -> None:
        if handle.event is not None:
            try:
                handle.event.synchronize()  # copies already queued cannot be recalled
            except Exception:
                pass
            handle.event = None


@dataclass
class _Job:
    op: ReadOp
    event: Any = None
