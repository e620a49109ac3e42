"""One TP rank's KV memory and transfer agent, run as its own OS process.

A `RankGroup` spawns one process per rank (the way a TP engine has one process per GPU) and
talks to each over a pipe. Every call carries a deadline; a rank that does not answer in time
is killed, so a caller never hangs on a stuck backend.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from beamserve.kv_transfer import content
from beamserve.kv_transfer.backends.base import AgentInfo, AgentStats, ReadOp, make_agent
from beamserve.kv_transfer.errors import KVTransferError, PeerLostError, TransferTimeoutError
from beamserve.kv_transfer.topology import PoolLayout, RequestPages

# Extra seconds a rank gets past a call's own deadline before the group kills it.
GRACE_S = 5.0
START_TIMEOUT_S = 120.0
IDLE_POLL_S = 0.002


@dataclass(frozen=True)
class RankSpec:
    group: str
    rank: int
    layout: PoolLayout
    backend: str


class _Rank:
    """State inside a rank process; each public method is one pipe command."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.region = np.zeros(spec.layout.region_bytes, dtype=np.uint8)
        self.agent = make_agent(spec.backend, f"{spec.group}-r{spec.rank}-{os.getpid()}")
        self.info = self.agent.register(self.region)

    def fill_random(self, seed: int) -> None:
        content.fill_random(self.region, seed)

    def write_request(self, seq_len: int, pages: RequestPages, seed: int) -> None:
        content.write_request(self.region, self.spec.layout, self.spec.rank, seq_len, pages, seed)

    def read(self, ops: list[ReadOp], deadline_s: float) -> tuple[int, float]:
        t0 = time.perf_counter()
        moved = self.agent.read_all(ops, time.monotonic() + deadline_s)
        return moved, time.perf_counter() - t0

    def verify(
        self, seq_len: int, pages: RequestPages, seed: int, sentinel_seed: int
    ) -> content.VerifyResult:
        return content.verify_request(
            self.region, self.spec.layout, self.spec.rank, seq_len, pages, seed, sentinel_seed
        )

    def checksums(self, seq_len: int, pages: RequestPages) -> dict[content.SliceKey, int]:
        return content.slice_checksums(
            self.region, self.spec.layout, self.spec.rank, seq_len, pages
        )

    def stats(self) -> AgentStats:
        return self.agent.stats()

    def close(self) -> AgentStats:
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


class RankGroup:
    """The processes of one pool's TP group (one per rank), each with a registered KV region."""

    def __init__(self, group: str, layout: PoolLayout, backend: str) -> None:
        self.group, self.layout, self.backend = group, layout, backend
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self.infos: list[AgentInfo] = []
        try:
            for r in range(layout.topology.tp_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_rank_main,
                    args=(child, RankSpec(group, r, layout, backend)),
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
        for r in ranks:
            self._send(r, cmd, args(r))
        deadline = time.monotonic() + timeout_s
        results, first_err = [], None
        for r in ranks:
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
