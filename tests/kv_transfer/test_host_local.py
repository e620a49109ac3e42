"""The host-local driver on the CPU: its choice, its pulls and its faults.

On the GPU the driver maps CUDA IPC regions and launches one Triton kernel (test_gpu.py). Here
the same `HostLocalDriver` runs over host memory: regions are numpy buffers handed out by an
`open_region` callable, and `NumpyEngine` plays the kernel's table program by program
(`compact.program_runs`), so the control flow — connect once, owner checks, deadlines, typed
faults, nothing left mapped or live — and the client's choice of driver are what is tested.
The decode group in the end-to-end tests is an in-process stand-in that says its memory is VRAM.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from beamserve.kv_transfer import content, host_local
from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp
from beamserve.kv_transfer.bench import pool_for, scattered_pages
from beamserve.kv_transfer.compact import KernelTables, compact_plan, kernel_tables
from beamserve.kv_transfer.cost import (
    LinkModel,
    TransferPath,
    choose_host_local,
    choose_path,
    estimate_direct_compact,
    estimate_local,
    estimate_staged_floor,
    link_for,
)
from beamserve.kv_transfer.errors import (
    IncompatiblePeerError,
    PeerLostError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
)
from beamserve.kv_transfer.host_local import (
    GONE,
    HostLocalDriver,
    NumpyEngine,
    RegionOwner,
    host_identity,
    owner_alive,
    refusal,
    watch_owner,
)
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs
from beamserve.kv_transfer.model import beam_1_0
from beamserve.kv_transfer.plan import plan_transfer
from beamserve.kv_transfer.staging import stage_plan
from beamserve.kv_transfer.topology import PoolLayout, RequestPages

from tests.kv_transfer.small_model import beam_small

MODEL = beam_small(head_dim=8)
SEQ_LEN = 200
SEED, SENTINEL = 31, 0x51


def aligned(nbytes: int) -> Buffer:
    """A zeroed host buffer at a 4 KiB-aligned address (device allocations are aligned too)."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return Buffer(MemoryKind.DRAM, raw[start : start + nbytes])


def metadata(owner: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"owner": host_identity() if owner is None else owner}).encode()


def agent(name: str, buf: Buffer, owner: dict[str, Any] | None = None, **kw: Any) -> AgentInfo:
    fields = {"backend": "cuda_ipc", "memory": "vram", "device": 0, **kw}
    return AgentInfo(
        fields["backend"],
        name,
        metadata(owner),
        buf.addr,
        buf.nbytes,
        fields["memory"],
        fields["device"],
    )


def dead_owner() -> dict[str, Any]:
    """The identity of a process that ran on this host and is gone (exited and reaped)."""
    proc = subprocess.Popen(["sleep", "30"])
    proc.kill()
    proc.wait()
    return {**host_identity(), "pid": proc.pid}


@dataclass
class Pools:
    src: PoolLayout
    dst: PoolLayout
    src_bufs: list[Buffer]
    dst_bufs: list[Buffer]
    src_agents: list[AgentInfo]
    dst_agents: list[AgentInfo]
    sp: RequestPages
    dp: RequestPages

    def by_name(self) -> dict[str, Buffer]:
        named = zip(self.src_agents + self.dst_agents, self.src_bufs + self.dst_bufs, strict=True)
        return {a.name: b for a, b in named}

    def tables(self) -> KernelTables:
        return kernel_tables(compact_plan(self.src, self.dst, SEQ_LEN, self.sp, self.dp))

    def verify(self) -> bool:
        return all(
            content.verify_request(b.data, self.dst, r, SEQ_LEN, self.dp, SEED, SENTINEL).ok
            for r, b in enumerate(self.dst_bufs)
        )


def make_pools(src_tp: int = 4, dst_tp: int = 2, seed: int = 0) -> Pools:
    src, dst = pool_for(MODEL, src_tp, SEQ_LEN), pool_for(MODEL, dst_tp, SEQ_LEN)
    rng = np.random.default_rng(seed)
    sp, dp = scattered_pages(src, SEQ_LEN, rng), scattered_pages(dst, SEQ_LEN, rng)
    src_bufs = [aligned(src.region_bytes) for _ in range(src_tp)]
    dst_bufs = [aligned(dst.region_bytes) for _ in range(dst_tp)]
    for r, b in enumerate(src_bufs):
        content.fill_random(b.data, 99 + r)
        content.write_request(b.data, src, r, SEQ_LEN, sp, SEED)
    for b in dst_bufs:
        content.fill_random(b.data, SENTINEL)
    return Pools(
        src,
        dst,
        src_bufs,
        dst_bufs,
        [agent(f"prefill-r{r}", b) for r, b in enumerate(src_bufs)],
        [agent(f"decode-r{r}", b) for r, b in enumerate(dst_bufs)],
        sp,
        dp,
    )


def opener(pools: Pools, opened: list[str] | None = None) -> Any:
    regions = pools.by_name()

    def open_region(info: AgentInfo) -> Buffer:
        if opened is not None:
            opened.append(info.name)
        return regions[info.name]

    return open_region


def soon() -> float:
    return time.monotonic() + 10.0


# --- the driver ---------------------------------------------------------------------------


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 2), (2, 4), (1, 1), (16, 8), (8, 8)])
def test_driver_moves_exactly_the_plans_bytes(src_tp: int, dst_tp: int) -> None:
    pools = make_pools(src_tp, dst_tp, seed=src_tp * 10 + dst_tp)
    opened: list[str] = []
    own = {pools.dst_agents[0].name: pools.dst_bufs[0]}  # rank 0's region is the driver's own
    driver = HostLocalDriver(own, opener(pools, opened), NumpyEngine())
    t = pools.tables()
    stats = driver.pull(t, pools.src_agents, pools.dst_agents, soon())
    assert pools.verify()
    plan = plan_transfer(pools.src, pools.dst, SEQ_LEN, pools.sp, pools.dp)
    assert stats.bytes_moved == plan.bytes_moved == t.nbytes_moved
    assert stats.programs == t.programs and stats.table_bytes == t.nbytes
    assert pools.dst_agents[0].name not in opened  # a process cannot open its own handle
    assert set(stats.phases) == {"checks", "bind", "launch", "wait"}
    assert stats.entered <= stats.left
    assert stats.seconds == pytest.approx(stats.left - stats.entered)
    # Mapped once: a second pull opens nothing.
    n_opened = len(opened)
    driver.pull(t, pools.src_agents, pools.dst_agents, soon())
    assert len(opened) == n_opened
    s = driver.stats()
    assert (s.mapped_regions, s.live_launches, s.pulls) == (src_tp + dst_tp - 1, 0, 2)
    driver.close()
    assert driver.stats().mapped_regions == 0


def test_a_region_that_cannot_be_mapped_is_a_lost_peer() -> None:
    pools = make_pools()

    def refuse(info: AgentInfo) -> Buffer:
        if info.name == "prefill-r1":
            raise RuntimeError("cudaErrorInvalidValue")
        return pools.by_name()[info.name]

    driver = HostLocalDriver({}, refuse, NumpyEngine())
    with pytest.raises(PeerLostError, match="prefill-r1"):
        driver.pull(pools.tables(), pools.src_agents, pools.dst_agents, soon())
    assert driver.stats().live_launches == 0
    assert "prefill-r1" not in driver._mapped


def test_an_owner_gone_before_the_copy_is_a_lost_peer_and_unmapped() -> None:
    pools = make_pools()
    driver = HostLocalDriver({}, opener(pools), NumpyEngine())
    t = pools.tables()
    driver.pull(t, pools.src_agents, pools.dst_agents, soon())
    gone = replace(pools.src_agents[2], metadata=metadata(dead_owner()), name="prefill-r2-new")
    agents = [*pools.src_agents[:2], gone, *pools.src_agents[3:]]
    regions = {**pools.by_name(), gone.name: pools.src_bufs[2]}
    driver._open = lambda a: regions[a.name]
    with pytest.raises(PeerLostError, match="exited before"):
        driver.pull(t, agents, pools.dst_agents, soon())
    assert gone.name not in driver._mapped
    assert driver.stats().live_launches == 0


class KillingEngine(NumpyEngine):
    """Copies, then the source's process dies before the driver looks again."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def launch(self, *args: Any) -> Any:
        out = super().launch(*args)
        self.proc.kill()
        self.proc.wait()
        return out


def test_an_owner_gone_during_the_copy_voids_the_pull() -> None:
    pools = make_pools()
    proc = subprocess.Popen(["sleep", "30"])
    owner = {**host_identity(), "pid": proc.pid}
    agents = [replace(a, metadata=metadata(owner)) for a in pools.src_agents]
    driver = HostLocalDriver({}, opener(pools), KillingEngine(proc))
    with pytest.raises(PeerLostError, match="exited during"):
        driver.pull(pools.tables(), agents, pools.dst_agents, soon())
    assert driver.stats().live_launches == 0


@dataclass
class SlowLaunch:
    waited: bool = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.waited = True

    def kernel_s(self) -> float:
        return 0.0


class SlowEngine:
    def __init__(self) -> None:
        self.launches: list[SlowLaunch] = []

    def launch(self, *args: Any) -> SlowLaunch:
        self.launches.append(SlowLaunch())
        return self.launches[-1]


def test_a_copy_past_its_deadline_is_waited_out_then_a_timeout() -> None:
    pools = make_pools()
    engine = SlowEngine()
    driver = HostLocalDriver({}, opener(pools), engine)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="still running at the deadline"):
        driver.pull(pools.tables(), pools.src_agents, pools.dst_agents, t0 + 0.05)
    assert time.monotonic() - t0 < 2.0
    assert engine.launches[0].waited  # queued work finished before the error returned
    assert driver.stats().live_launches == 0
    with pytest.raises(TransferTimeoutError, match="before the copy"):
        driver.pull(pools.tables(), pools.src_agents, pools.dst_agents, time.monotonic() - 1)
    assert len(engine.launches) == 1


class FailingEngine:
    def launch(self, *args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_error_is_a_lost_peer() -> None:
    pools = make_pools()
    driver = HostLocalDriver({}, opener(pools), FailingEngine())
    with pytest.raises(PeerLostError, match="device copy failed"):
        driver.pull(pools.tables(), pools.src_agents, pools.dst_agents, soon())
    assert driver.stats().live_launches == 0


def test_a_plan_for_more_ranks_than_agents_is_refused() -> None:
    pools = make_pools()
    driver = HostLocalDriver({}, opener(pools), NumpyEngine())
    with pytest.raises(TransferPlanError, match="source rank 3"):
        driver.pull(pools.tables(), pools.src_agents[:2], pools.dst_agents, soon())


# --- eligibility ---------------------------------------------------------------------------


def test_refusal_names_why_a_region_cannot_be_driven_here() -> None:
    pools = make_pools()
    ok = pools.src_agents + pools.dst_agents
    assert refusal(ok, MemoryKind.VRAM, 0) is None
    # DRAM moves between shm regions only (the cuda_ipc agents here are refused, named).
    assert "dram between shm regions; prefill-r0 speaks cuda_ipc" in str(
        refusal(ok, MemoryKind.DRAM, 0)
    )
    shm = [replace(a, backend="shm", memory="dram") for a in ok]
    assert refusal(shm, MemoryKind.DRAM, 0) is None
    # A DRAM driver copies on the CPU: the regions' devices do not matter.
    assert refusal([replace(shm[0], device=1), *shm[1:]], MemoryKind.DRAM, 0) is None
    far = replace(ok[0], metadata=metadata({**host_identity(), "boot_id": "another-host"}))
    assert "another host" in str(refusal([far, *ok[1:]], MemoryKind.VRAM, 0))
    assert "GPU 1" in str(refusal([replace(ok[0], device=1), *ok[1:]], MemoryKind.VRAM, 0))
    old = replace(ok[0], metadata=b'{"fields": []}')
    assert "publishes no owner" in str(refusal([old, *ok[1:]], MemoryKind.VRAM, 0))
    nixl = replace(ok[0], backend="nixl")
    assert "vram between cuda_ipc regions; prefill-r0 speaks nixl" in str(
        refusal([nixl, *ok[1:]], MemoryKind.VRAM, 0)
    )


def test_owner_liveness() -> None:
    me = host_identity()
    assert owner_alive(RegionOwner(me["boot_id"], me["pid"], me["pid_ns"]))
    gone = dead_owner()
    assert not owner_alive(RegionOwner(gone["boot_id"], gone["pid"], gone["pid_ns"]))
    zombie = subprocess.Popen(["sleep", "30"])
    zombie.kill()
    time.sleep(0.2)  # exited, not reaped: the fast check cannot tell, the thorough one can
    z = RegionOwner(me["boot_id"], zombie.pid, me["pid_ns"])
    assert owner_alive(z) and not owner_alive(z, thorough=True)
    zombie.wait()
    assert not owner_alive(z)
    # Another pid namespace: its pids say nothing here, so the owner is taken as alive.
    assert owner_alive(RegionOwner(gone["boot_id"], gone["pid"], "pid:[1]"))


def test_owners_are_watched_through_pidfds() -> None:
    me = host_identity()
    fd = watch_owner(RegionOwner(me["boot_id"], me["pid"], me["pid_ns"]))
    if fd is None:
        pytest.skip("no pidfd_open here (the driver falls back to kill(pid, 0))")
    assert fd >= 0
    os.close(fd)
    gone = dead_owner()
    assert watch_owner(RegionOwner(gone["boot_id"], gone["pid"], gone["pid_ns"])) == GONE
    assert watch_owner(RegionOwner(gone["boot_id"], gone["pid"], "pid:[1]")) is None
    assert watch_owner(None) is None


class ZombieEngine(NumpyEngine):
    """Copies, then the source's process dies and stays unreaped (a zombie) while the driver
    looks again: `kill(pid, 0)` cannot tell, the pidfd can."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def launch(self, *args: Any) -> Any:
        out = super().launch(*args)
        self.proc.kill()
        time.sleep(0.2)
        return out


def test_an_owner_exited_but_unreaped_during_the_copy_voids_the_pull() -> None:
    pools = make_pools()
    proc = subprocess.Popen(["sleep", "30"])
    owner = {**host_identity(), "pid": proc.pid}
    if watch_owner(RegionOwner(owner["boot_id"], proc.pid, owner["pid_ns"])) is None:
        proc.kill()
        proc.wait()
        pytest.skip("no pidfd_open here")
    agents = [replace(a, metadata=metadata(owner)) for a in pools.src_agents]
    driver = HostLocalDriver({}, opener(pools), ZombieEngine(proc))
    try:
        with pytest.raises(PeerLostError, match="exited during"):
            driver.pull(pools.tables(), agents, pools.dst_agents, soon())
        assert agents[0].name not in driver._mapped and agents[0].name not in driver._watch
    finally:
        proc.wait()
    driver.close()
    assert driver._watch == {} and driver.stats().mapped_regions == 0


class UploadEngine(NumpyEngine):
    """An engine with an upload buffer (as the Triton engine's pinned one)."""

    def __init__(self) -> None:
        self.buf = np.zeros(0, dtype=np.int64)
        self.seen: list[bool] = []

    def upload_buffer(self, n: int) -> Any:
        if len(self.buf) < n:
            self.buf = np.zeros(2 * n, dtype=np.int64)
        return self.buf[:n]

    def launch(self, t: Any, table: Any, regions: Any, base: Any, prep: Any = None) -> Any:
        self.seen.append(bool(np.shares_memory(table, self.buf)))
        return super().launch(t, table, regions, base)


def test_the_table_is_bound_straight_into_the_engines_upload_buffer() -> None:
    pools = make_pools()
    engine = UploadEngine()
    driver = HostLocalDriver({}, opener(pools), engine)
    t = pools.tables()
    driver.pull(t, pools.src_agents, pools.dst_agents, soon())
    assert pools.verify()
    assert engine.seen == [True]
    addrs = [b.addr for b in pools.src_bufs], [b.addr for b in pools.dst_bufs]
    base = min(b.addr for b in pools.src_bufs + pools.dst_bufs)
    np.testing.assert_array_equal(engine.buf[: len(t.table)], t.bind(*addrs, base))


def test_a_pull_prepared_ahead_copies_the_same_bytes_and_binds_nothing_in_its_time() -> None:
    """`prepare` (the decode side's planning) maps, checks and binds; the pull then only
    launches and waits, and copies exactly what an unprepared pull copies."""
    pools = make_pools(seed=7)
    engine = UploadEngine()
    driver = HostLocalDriver({}, opener(pools), engine)
    t = pools.tables()
    ready = driver.prepare(t, pools.src_agents, pools.dst_agents)
    assert driver.stats().mapped_regions == len(pools.src_agents) + len(pools.dst_agents)
    assert set(ready.phases) == {"checks", "bind", "lookup"}
    stats = driver.pull(t, pools.src_agents, pools.dst_agents, soon(), prepared=ready)
    assert pools.verify() and engine.seen == [True]
    assert stats.phases["bind"] == 0.0 and "ahead.bind" in stats.phases
    assert stats.bytes_moved == t.nbytes_moved
    # A prepared pull runs once: handed in again, it is prepared afresh inside the pull.
    again = driver.pull(t, pools.src_agents, pools.dst_agents, soon(), prepared=ready)
    assert again.phases["bind"] > 0.0 and "ahead.bind" not in again.phases
    assert pools.verify()


def test_a_pull_prepared_before_another_prepare_is_bound_again() -> None:
    """One upload buffer: a second `prepare` overwrites the first's table, so the first's
    pull binds its own table again (its bytes, not the second request's)."""
    first, second = make_pools(seed=1), make_pools(seed=2)
    both = {**first.by_name(), **{f"b-{k}": v for k, v in second.by_name().items()}}
    rename = {a.name: replace(a, name=f"b-{a.name}") for a in second.src_agents + second.dst_agents}
    s_agents = [rename[a.name] for a in second.src_agents]
    d_agents = [rename[a.name] for a in second.dst_agents]
    engine = UploadEngine()
    driver = HostLocalDriver({}, lambda info: both[info.name], engine)
    t1, t2 = first.tables(), second.tables()
    ready1 = driver.prepare(t1, first.src_agents, first.dst_agents)
    ready2 = driver.prepare(t2, s_agents, d_agents)
    stats = driver.pull(t1, first.src_agents, first.dst_agents, soon(), prepared=ready1)
    assert "ahead.bind" not in stats.phases  # stale: bound again inside the pull
    assert first.verify()
    assert not second.verify()  # nothing of the second request was copied yet
    driver.pull(t2, s_agents, d_agents, soon(), prepared=ready2)  # stale too: the pull ran
    assert second.verify()


def test_an_owner_that_exits_between_prepare_and_pull_voids_the_pull() -> None:
    pools = make_pools()
    proc = subprocess.Popen(["sleep", "30"])
    owner = {**host_identity(), "pid": proc.pid}
    agents = [replace(a, metadata=metadata(owner)) for a in pools.src_agents]
    driver = HostLocalDriver({}, opener(pools), NumpyEngine())
    t = pools.tables()
    ready = driver.prepare(t, agents, pools.dst_agents)
    proc.kill()
    proc.wait()
    with pytest.raises(PeerLostError, match=f"pid {proc.pid}"):
        driver.pull(t, agents, pools.dst_agents, soon(), prepared=ready)
    assert agents[0].name not in driver._mapped
    assert driver.stats().live_launches == 0
    driver.close()


def test_configured_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BEAMSERVE_KV_DRIVER", raising=False)
    assert host_local.configured_driver() == "auto"
    monkeypatch.setenv("BEAMSERVE_KV_DRIVER", "Host_Local")
    assert host_local.configured_driver() == "host_local"
    monkeypatch.setenv("BEAMSERVE_KV_DRIVER", "fast")
    with pytest.raises(TransferPlanError, match="ranks"):
        host_local.configured_driver()


# --- the cost model ------------------------------------------------------------------------


def beam_compact(src_tp: int, dst_tp: int, n: int = 81920) -> Any:
    m = beam_1_0()
    src, dst = pool_for(m, src_tp, n), pool_for(m, dst_tp, n)
    rng = np.random.default_rng(7)
    sp, dp = scattered_pages(src, n, rng), scattered_pages(dst, n, rng)
    return compact_plan(src, dst, n, sp, dp), plan_transfer(src, dst, n, sp, dp)


@pytest.mark.parametrize("want", [TransferPath.AUTO, TransferPath.DIRECT])
def test_one_host_vram_takes_the_host_local_driver_at_8_to_4(want: TransferPath) -> None:
    compact, plan = beam_compact(8, 4)
    link = link_for(MemoryKind.VRAM, "cuda_ipc")
    choice = choose_host_local(compact, link, want, staging=True)
    assert choice is not None and choice.driver == "host_local"
    assert choice.path is TransferPath.DIRECT
    # One device moves all 3.1 GB: 1.5 ms + 3.11e9 / 1.5e12 ≈ 3.6 ms; through the ranks the
    # fixed 5 ms alone is more.
    assert choice.local_s == pytest.approx(1.5e-3 + plan.bytes_moved / 1.5e12)
    assert choice.local_s < choice.direct_s
    if want is TransferPath.AUTO:
        assert choice.local_s < choice.staged_s == estimate_staged_floor(compact, link)
    # The ranks' direct estimate from the compact plan is the plan's.
    staged = stage_plan(plan, 1 << 30, 4 << 30, 4 << 30)
    full = choose_path(plan, staged, link, TransferPath.DIRECT)
    assert estimate_direct_compact(compact, link) == pytest.approx(full.direct_s)


def test_staged_is_never_driven_host_locally_and_forcing_wins() -> None:
    compact, _ = beam_compact(8, 4, 4096)
    link = link_for(MemoryKind.VRAM, "cuda_ipc")
    assert choose_host_local(compact, link, TransferPath.STAGED, forced=True) is None
    slow = LinkModel(2e-9, 1.5e12, 1.5e12, direct_fixed_s=0.0, local_fixed_s=1.0)
    assert choose_host_local(compact, slow, TransferPath.AUTO) is None
    forced = choose_host_local(compact, slow, TransferPath.AUTO, forced=True)
    assert forced is not None and forced.driver == "host_local" and "forced" in forced.reason
    assert estimate_local(compact, slow) == pytest.approx(1.0 + compact.bytes_moved / 1.5e12)
    with pytest.raises(TransferPlanError, match="host-local"):
        estimate_local(compact, link_for(MemoryKind.DRAM, "nixl"))


def test_through_the_ranks_cuda_ipc_still_prefers_direct_to_staged() -> None:
    _, plan = beam_compact(8, 4)
    staged = stage_plan(plan, 1 << 30, 4 << 30, 4 << 30)
    choice = choose_path(plan, staged, link_for(MemoryKind.VRAM, "cuda_ipc"), TransferPath.AUTO)
    assert choice.path is TransferPath.DIRECT and choice.driver == "ranks"


# --- end to end through DecodeKVClient ----------------------------------------------------


class InProcessDecode:
    """A decode group whose ranks live in this process: `read` is the ranks driver, and
    `drive_local` a `HostLocalDriver` over host memory (the group says its memory is VRAM so
    that the client's host-local choice is what runs)."""

    backend = "cuda_ipc"
    staging_bytes = 0

    def __init__(self, pools: Pools, memory: MemoryKind = MemoryKind.VRAM) -> None:
        self.pools, self.memory = pools, memory
        self.layout, self.size = pools.dst, pools.dst.topology.tp_size
        self.regions = pools.by_name()
        own = {pools.dst_agents[0].name: pools.dst_bufs[0]}
        self.driver = HostLocalDriver(own, lambda a: self.regions[a.name], NumpyEngine())
        self.ranks_reads = 0
        self.local_pulls = 0

    def read(self, ops_by_rank: dict[int, list[ReadOp]], deadline_s: float) -> list[Any]:
        for r, ops in ops_by_rank.items():
            for op in ops:
                src = self.regions[op.peer.name]
                dst = self.pools.dst_bufs[r]
                copy_runs(src, op.remote_offsets, dst, op.local_offsets, op.lengths)
        self.ranks_reads += 1
        return [None] * len(ops_by_rank)

    def call_all(self, cmd: str, *args: Any, timeout_s: float = 600.0) -> list[Any]:
        raise NotImplementedError(cmd)

    def host_local_refusal(self, peers: list[AgentInfo]) -> str | None:
        return refusal([*peers, *self.pools.dst_agents], self.memory, 0)

    def drive_local(
        self, tables: KernelTables, src_agents: list[AgentInfo], deadline_s: float
    ) -> host_local.LocalPullStats:
        self.local_pulls += 1
        return self.driver.pull(
            tables, src_agents, self.pools.dst_agents, time.monotonic() + deadline_s
        )


class PreparingDecode(InProcessDecode):
    """The same group with `prepare_local` (as `RankGroup` has): the client makes each pull
    ready while it plans."""

    def __init__(self, pools: Pools) -> None:
        super().__init__(pools)
        self.prepared: list[tuple[int, host_local.PreparedPull]] = []

    def prepare_local(
        self, tables: KernelTables, src_agents: list[AgentInfo], deadline_s: float
    ) -> int:
        ready = self.driver.prepare(tables, src_agents, self.pools.dst_agents)
        self.prepared.append((len(self.prepared) + 1, ready))
        return len(self.prepared)

    def drive_local(  # type: ignore[override]
        self,
        tables: KernelTables,
        src_agents: list[AgentInfo],
        deadline_s: float,
        token: int | None = None,
    ) -> host_local.LocalPullStats:
        self.local_pulls += 1
        ready = dict(self.prepared).get(token) if token is not None else None
        return self.driver.pull(
            tables, src_agents, self.pools.dst_agents, time.monotonic() + deadline_s, ready
        )


@dataclass
class Stand:
    pools: Pools
    registry: PrefillKVRegistry
    server: HandshakeServer
    decode: InProcessDecode
    n: int = 0

    def publish(self) -> str:
        self.n += 1
        rid = f"req-{self.n}"
        for b in self.pools.dst_bufs:
            content.fill_random(b.data, SENTINEL)
        self.registry.publish(rid, SEQ_LEN, self.pools.sp)
        return rid


@pytest.fixture
def stand() -> Iterator[Stand]:
    pools = make_pools(4, 2, seed=5)
    registry = PrefillKVRegistry(
        "prefill-cpu", pools.src, "cuda_ipc", pools.src_agents, memory=MemoryKind.VRAM
    )
    server = HandshakeServer(build_handshake_app(registry))
    try:
        yield Stand(pools, registry, server, InProcessDecode(pools))
    finally:
        server.stop()


@pytest.mark.parametrize("path", [TransferPath.AUTO, TransferPath.DIRECT])
def test_client_pulls_through_the_host_local_driver(stand: Stand, path: TransferPath) -> None:
    client = DecodeKVClient(stand.decode, driver="auto")
    try:
        for _ in range(2):
            res = client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0, path=path)
            assert res.driver == "host_local" and res.path is TransferPath.DIRECT
            assert res.choice is not None and res.choice.driver == "host_local"
            assert stand.pools.verify()
    finally:
        client.close()
    plan = plan_transfer(stand.pools.src, stand.pools.dst, SEQ_LEN, stand.pools.sp, stand.pools.dp)
    assert res.bytes_moved == plan.bytes_moved and res.descriptors_on_wire == plan.descriptors
    assert (stand.decode.local_pulls, stand.decode.ranks_reads) == (2, 0)
    assert stand.registry.held() == []


def test_client_prepares_the_host_local_pull_while_it_plans(stand: Stand) -> None:
    decode = PreparingDecode(stand.pools)
    client = DecodeKVClient(decode, driver="auto")
    try:
        for n in (1, 2):
            res = client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0)
            assert res.driver == "host_local" and stand.pools.verify()
            assert len(decode.prepared) == n  # one prepare per pull, inside the plan's time
            assert res.phases_ms["bind"] == 0.0 and "ahead.bind" in res.phases_ms
    finally:
        client.close()
    assert decode.local_pulls == 2 and decode.ranks_reads == 0
    assert stand.registry.held() == []


def test_client_driver_ranks_and_staged_keep_the_ranks(stand: Stand) -> None:
    client = DecodeKVClient(stand.decode, driver="ranks")
    try:
        res = client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0)
        assert res.driver == "ranks" and stand.pools.verify()
    finally:
        client.close()
    client = DecodeKVClient(stand.decode, driver="auto")
    try:
        with pytest.raises(IncompatiblePeerError, match="staging pool"):
            client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0, path="staged")
    finally:
        client.close()
    assert stand.decode.local_pulls == 0 and stand.decode.ranks_reads == 1


def test_client_forced_host_local_refused_with_the_reason() -> None:
    pools = make_pools(2, 1, seed=9)
    registry = PrefillKVRegistry("prefill-cpu", pools.src, "cuda_ipc", pools.src_agents)
    server = HandshakeServer(build_handshake_app(registry))
    decode = InProcessDecode(pools, memory=MemoryKind.DRAM)
    try:
        with pytest.raises(TransferPlanError, match="driver"):
            DecodeKVClient(decode, driver="fastest")
        auto = DecodeKVClient(decode, driver="auto")
        registry.publish("a", SEQ_LEN, pools.sp)
        assert auto.pull(server.url, "a", pools.dp, 10.0).driver == "ranks"  # DRAM: the ranks
        auto.close()
        forced = DecodeKVClient(decode, driver="host_local")
        registry.publish("b", SEQ_LEN, pools.sp)
        with pytest.raises(IncompatiblePeerError, match="no host-local driver for dram"):
            forced.pull(server.url, "b", pools.dp, 10.0)
        forced.close()
        assert registry.held() == []  # the lease is released on the refusal too
    finally:
        server.stop()


def test_client_prefill_rank_gone_is_a_lost_peer_and_forgotten(stand: Stand) -> None:
    client = DecodeKVClient(stand.decode, driver="auto")
    try:
        client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0)
        # Prefill restarts rank 1 under a new process that then dies: its region is gone.
        gone = replace(
            stand.pools.src_agents[1], name="prefill-r1-b", metadata=metadata(dead_owner())
        )
        stand.decode.regions[gone.name] = stand.pools.src_bufs[1]
        stand.registry.agents[1] = gone
        client.peer(stand.server.url, refresh=True)
        with pytest.raises(PeerLostError, match="prefill-r1-b"):
            client.pull(stand.server.url, stand.publish(), stand.pools.dp, 10.0)
        assert stand.server.url not in client._peers  # the next pull fetches fresh metadata
        assert stand.decode.driver.stats().live_launches == 0
        assert "prefill-r1-b" not in stand.decode.driver._mapped
        assert stand.registry.held() == []
    finally:
        client.close()


def test_rank_group_refuses_an_unknown_driver_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from beamserve.kv_transfer.errors import KVTransferError
    from beamserve.kv_transfer.rank import RankGroup

    lay = pool_for(MODEL, 1, 64)
    with pytest.raises(KVTransferError, match="rank0"):
        RankGroup("decode", lay, "cma", local_in="elsewhere")  # refused before any process
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_IN", "gpu")
    with pytest.raises(KVTransferError, match="caller"):
        RankGroup("decode", lay, "cma")


@pytest.mark.parametrize(
    ("caller_engine", "place"),
    [("triton", "caller"), ("none (no CUDA in the calling process)", "rank0")],
)
def test_driver_place_auto_is_the_caller_where_it_runs_the_engine(
    monkeypatch: pytest.MonkeyPatch, caller_engine: str, place: str
) -> None:
    """`auto` (the default place) drives from the calling process where it runs the Triton
    engine itself, else from decode rank 0 (asked for its engine through the pipe)."""
    from beamserve.kv_transfer import rank

    monkeypatch.delenv("BEAMSERVE_KV_LOCAL_IN", raising=False)
    group = rank.RankGroup.__new__(rank.RankGroup)  # no processes: the choice alone
    group.memory, group.device, group.infos = MemoryKind.VRAM, 0, []
    group.local_in, group._engine0 = "auto", None
    asked: list[str] = []
    group.call = lambda ranks, cmd, args, timeout_s: asked.append(cmd) or ["triton"]  # type: ignore[method-assign]
    monkeypatch.setattr(rank.host_local, "refusal", lambda *a: None)
    monkeypatch.setattr(rank, "_caller_engine", lambda device: caller_engine)
    assert group.host_local_refusal([]) is None
    assert group.local_in == place
    assert asked == ([] if place == "caller" else ["copy_engine"])
