"""NIXL (UCX backend) transfer agent: DRAM↔DRAM reads between processes.

Agents run without NIXL's progress thread: NIXL's thread spins without a delay, and eight
spinning prefill ranks starve the readers on a small host. A reader drives progress from
`poll`; an idle rank calls `idle_progress` between commands, which is all UCX wire-up needs
from the target side (one-sided reads need nothing from it at all).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from beamserve.kv_transfer.backends.base import U8, AgentInfo, ReadOp, TransferAgent, XferState
from beamserve.kv_transfer.errors import PeerLostError


class NixlAgent(TransferAgent):
    backend = "nixl"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._reg: Any = None
        self._remote_names: dict[str, str] = {}

    def idle_progress(self) -> None:
        self._agent.get_new_notifs()  # drives the UCX worker

    def _register(self, region: U8) -> bytes:
        addr = int(region.ctypes.data)
        self._reg = self._agent.register_memory([(addr, len(region), 0, "")], "DRAM")
        return bytes(self._agent.get_agent_metadata())

    def _deregister(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def _connect(self, peer: AgentInfo) -> None:
        remote = self._agent.add_remote_agent(peer.metadata)
        self._remote_names[peer.name] = remote.decode() if isinstance(remote, bytes) else remote

    def _disconnect(self, peer: AgentInfo) -> None:
        remote = self._remote_names.pop(peer.name, None)
        if remote is not None:
            self._agent.remove_remote_agent(remote)

    def _post(self, op: ReadOp) -> Any:
        region = self._require_region()
        zeros = np.zeros(len(op.lengths), dtype=np.uint64)
        n = op.lengths.astype(np.uint64)
        local = np.stack(
            [op.local_offsets.astype(np.uint64) + np.uint64(region.ctypes.data), n, zeros], axis=1
        )
        remote = np.stack(
            [op.remote_offsets.astype(np.uint64) + np.uint64(op.peer.base_addr), n, zeros], axis=1
        )
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                self._remote_names[op.peer.name],
            )
            state = self._agent.transfer(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            self.disconnect(op.peer.name)
            raise PeerLostError(f"peer {op.peer.name}: NIXL refused the read ({exc})") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            self.disconnect(op.peer.name)
            raise PeerLostError(f"peer {op.peer.name}: NIXL failed to post the read")
        return handle

    def _poll(self, handle: Any) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except Exception:
            return XferState.ERR

    def _release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(handle)
