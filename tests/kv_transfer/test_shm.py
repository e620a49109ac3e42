"""The shm backend and the host-local driver on DRAM.

The shm agent itself runs every shared integration and fault test (`BACKENDS`, through the
ranks). Here: shared memory mapped between real processes; the metadata checks; the strided
copy engine against the kernel's reference player (`NumpyEngine`) on random plans, its bounds
and its cancel; and whole pulls between rank processes through the host-local driver in the
calling process, with an owner killed between the prepare and the pull, and a deadline.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from beamserve.kv_transfer import content, host_local
from beamserve.kv_transfer.backends.base import AgentInfo, make_agent
from beamserve.kv_transfer.backends.shm import open_region
from beamserve.kv_transfer.compact import compact_plan, kernel_tables
from beamserve.kv_transfer.cost import TransferPath, choose_host_local, link_for
from beamserve.kv_transfer.errors import (
    PeerLostError,
    TopologyError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
)
from beamserve.kv_transfer.host_local import HostLocalDriver, NumpyEngine, StridedEngine
from beamserve.kv_transfer.memory import Buffer, MemoryKind, allocate, copy_threads, map_shared
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.rank import RankGroup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_transfer.test_host_local import (
    SEED,
    SENTINEL,
    SEQ_LEN,
    Pools,
    make_pools,
    soon,
)
from tests.kv_transfer.test_staged_transfer import layout, pages

CHILD = """
import sys, time
from beamserve.kv_transfer.memory import MemoryKind, allocate
buf = allocate(MemoryKind.DRAM, 1 << 16, shared=True)
buf.data[:] = 7
print(buf.fd, flush=True)
sys.stdin.readline()          # the parent has written through its mapping
print(int(buf.data[123]), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    fd = int(proc.stdout.readline())
    try:
        yield proc, fd
    finally:
        proc.kill()
        proc.wait()


# --- shared memory between processes -------------------------------------------------------


def test_another_process_maps_the_region_and_sees_its_bytes(
    child: tuple[subprocess.Popen[str], int],
) -> None:
    proc, fd = child
    ro = map_shared(proc.pid, fd, 1 << 16, writable=False)
    assert (ro == 7).all() and not ro.flags.writeable
    rw = map_shared(proc.pid, fd, 1 << 16, writable=True)
    rw[123] = 42
    assert ro[123] == 42  # one memory, two mappings
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert int(proc.stdout.readline()) == 42  # and the owner sees the write
    with pytest.raises(FileNotFoundError, match="fewer than"):
        map_shared(proc.pid, fd, 1 << 20, writable=False)  # more than the region holds


def test_a_gone_owner_cannot_be_mapped(child: tuple[subprocess.Popen[str], int]) -> None:
    proc, fd = child
    info = AgentInfo("shm", "prefill-r0", _meta(proc.pid, fd), 0, 1 << 16)
    assert (open_region(info).data == 7).all()
    proc.kill()
    proc.wait()
    with pytest.raises(PeerLostError, match="cannot be mapped"):
        open_region(info)


def test_metadata_is_checked_before_any_mapping() -> None:
    far = {**host_local.host_identity(), "boot_id": "another-host"}
    info = AgentInfo("shm", "p", json.dumps({"owner": far, "fd": 3}).encode(), 0, 10)
    with pytest.raises(TransferPlanError, match=r"another host.*nixl or mooncake"):
        open_region(info)
    with pytest.raises(TransferPlanError, match="shm metadata is unreadable"):
        open_region(replace(info, metadata=b'{"pid": 1}'))
    agent = make_agent("shm", "x")
    with pytest.raises(TransferPlanError, match="shared=True"):
        agent.register(np.zeros(4096, np.uint8))  # private memory cannot be shared


def test_copy_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BEAMSERVE_KV_COPY_THREADS", "3")
    assert copy_threads() == 3
    monkeypatch.setenv("BEAMSERVE_KV_COPY_THREADS", "many")
    with pytest.raises(TopologyError, match="BEAMSERVE_KV_COPY_THREADS"):
        copy_threads()
    monkeypatch.delenv("BEAMSERVE_KV_COPY_THREADS")
    assert 1 <= copy_threads() <= 4


def _meta(pid: int, fd: int) -> bytes:
    return json.dumps({"owner": {**host_local.host_identity(), "pid": pid}, "fd": fd}).encode()


# --- the strided engine -------------------------------------------------------------------


def _shm_agents(pools: Pools) -> Pools:
    """The same pools, the agents speaking shm (the driver gets the buffers themselves)."""
    return dataclasses.replace(
        pools,
        src_agents=[replace(a, backend="shm", memory="dram") for a in pools.src_agents],
        dst_agents=[replace(a, backend="shm", memory="dram") for a in pools.dst_agents],
    )


def _pull(pools: Pools, engine: Any, tables: Any) -> list[np.ndarray]:
    driver = HostLocalDriver(pools.by_name(), engine=engine)
    try:
        driver.pull(tables, pools.src_agents, pools.dst_agents, soon())
    finally:
        driver.close()
    return [b.data.copy() for b in pools.dst_bufs]


PAIRS = [(4, 2), (2, 4), (1, 1), (16, 8), (8, 8), (2, 1), (1, 2), (8, 2)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pair=st.sampled_from(PAIRS),
    seed=st.integers(0, 10_000),
    threads=st.integers(1, 4),
    shuffle=st.booleans(),
)
def test_strided_engine_writes_what_the_kernel_would(
    pair: tuple[int, int], seed: int, threads: int, shuffle: bool
) -> None:
    """Every destination byte the same as the kernel's reference player leaves it — every
    byte of the request written, nothing else touched — whatever the TP pair, the pages, the
    threads, and whether a segment's bases step evenly (`shuffle` permutes them: the engine
    then copies block by block)."""
    pools = _shm_agents(make_pools(*pair, seed=seed))
    plan = compact_plan(pools.src, pools.dst, SEQ_LEN, pools.sp, pools.dp)
    if shuffle:
        rng = np.random.default_rng(seed)
        segs = []
        for s in plan.segments:
            perm = rng.permutation(s.blocks)
            segs.append(replace(s, src_base=s.src_base[perm], dst_base=s.dst_base[perm]))
        plan = replace(plan, segments=tuple(segs))
    tables = kernel_tables(plan)
    want = _pull(pools, NumpyEngine(), tables)
    for b in pools.dst_bufs:
        content.fill_random(b.data, SENTINEL)
    got = _pull(pools, StridedEngine(threads), tables)
    for r, (w, g) in enumerate(zip(want, got, strict=True)):
        assert np.array_equal(w, g), f"destination rank {r}"
    assert pools.verify()


def test_a_table_reaching_outside_a_region_is_refused_before_any_copy() -> None:
    pools = _shm_agents(make_pools(4, 2, seed=3))
    tables = pools.tables()
    short = pools.dst_bufs[1]
    regions = {**pools.by_name(), pools.dst_agents[1].name: short.view(0, short.nbytes // 2)}
    before = [b.data.copy() for b in pools.dst_bufs]
    driver = HostLocalDriver(regions, engine=StridedEngine(2))
    with pytest.raises(TransferPlanError, match="destination region"):
        driver.pull(tables, pools.src_agents, pools.dst_agents, soon())
    assert all(np.array_equal(a, b.data) for a, b in zip(before, pools.dst_bufs, strict=True))
    driver.close()


def test_a_cpu_copy_at_its_deadline_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    real = host_local._copy_part

    def late(part: Any, stop: Any) -> float:
        time.sleep(0.3)  # the deadline passes before this thread copies anything
        return real(part, stop)

    monkeypatch.setattr(host_local, "_copy_part", late)
    pools = _shm_agents(make_pools(4, 2, seed=4))
    before = [b.data.copy() for b in pools.dst_bufs]
    driver = HostLocalDriver(pools.by_name(), engine=StridedEngine(2))
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="stopped at the deadline"):
        driver.pull(pools.tables(), pools.src_agents, pools.dst_agents, t0 + 0.05)
    assert all(np.array_equal(a, b.data) for a, b in zip(before, pools.dst_bufs, strict=True))
    assert driver.stats().live_launches == 0
    driver.close()


def test_the_cost_model_takes_the_driver_for_a_scattered_8_to_4_request() -> None:
    from tests.kv_transfer.test_host_local import beam_compact

    plan, _full = beam_compact(8, 4)
    link = link_for(MemoryKind.DRAM, "shm")
    assert link.lanes >= 1 and link.local_Bps >= link.wire_Bps
    for want in (TransferPath.AUTO, TransferPath.DIRECT):
        choice = choose_host_local(plan, link, want, staging=True)
        assert choice is not None and choice.driver == "host_local", want
    assert choose_host_local(plan, link, TransferPath.STAGED) is None


# --- whole pulls between rank processes -----------------------------------------------------


class Rig:
    def __init__(self, src_tp: int = 4, dst_tp: int = 2) -> None:
        self.src, self.dst = layout(src_tp), layout(dst_tp)
        self.prefill = RankGroup("prefill", self.src, "shm")
        self.decode = RankGroup("decode", self.dst, "shm")
        self.registry = PrefillKVRegistry("prefill-0", self.src, "shm", self.prefill.infos)
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(self.decode, driver="auto")
        self.rng = np.random.default_rng([src_tp, dst_tp])
        self.n = 0

    def request(self) -> tuple[str, int, Any]:
        from tests.kv_transfer.test_staged_transfer import SEQ_LEN as N

        self.n += 1
        rid, seed = f"req-{self.n}", SEED + self.n
        sp, dp = pages(self.src, self.rng), pages(self.dst, self.rng)
        self.prefill.call_all("write_request", N, sp, seed)
        self.decode.call_all("fill_random", SENTINEL)
        self.registry.publish(rid, N, sp)
        return rid, seed, dp

    def verify(self, seed: int, dp: Any) -> None:
        from tests.kv_transfer.test_staged_transfer import SEQ_LEN as N

        for r, v in enumerate(self.decode.call_all("verify", N, dp, seed, SENTINEL)):
            assert v.ok, f"decode rank {r}: {v}"

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        for g in (self.decode, self.prefill):
            g.close(timeout_s=10)
        assert self.registry.held() == []


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_pulls_between_processes_go_through_the_driver_in_the_caller(rig: Rig) -> None:
    from tests.kv_transfer.test_staged_transfer import SEQ_LEN as N

    for _ in range(2):
        rid, seed, dp = rig.request()
        res = rig.client.pull(rig.server.url, rid, dp, 30.0)
        assert (res.driver, res.driver_in) == ("host_local", "caller")
        assert res.path is TransferPath.DIRECT
        assert res.bytes_moved == bytes_minimum(rig.dst, N)
        rig.verify(seed, dp)
    drv = rig.decode._caller_driver
    assert drv is not None
    stats = drv.stats()
    # Every rank of both pools mapped once, in this process; no read through a rank.
    assert (stats.mapped_regions, stats.pulls, stats.live_launches) == (6, 2, 0)
    assert all(s.bytes_read == 0 for s in rig.decode.call_all("stats"))


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_owner_killed_between_prepare_and_pull_voids_it_and_the_next_maps_anew(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid, _seed, dp = rig.request()
    rig.client.pull(rig.server.url, rid, dp, 30.0)  # every region mapped
    real = rig.decode.drive_local

    def kill_first(*args: Any, **kw: Any) -> Any:
        rig.prefill.kill(1)
        return real(*args, **kw)

    monkeypatch.setattr(rig.decode, "drive_local", kill_first)
    rid, _seed, dp = rig.request()
    with pytest.raises(PeerLostError, match="prefill-r1"):
        rig.client.pull(rig.server.url, rid, dp, 30.0)
    drv = rig.decode._caller_driver
    assert drv is not None and drv.stats().live_launches == 0
    assert not any(name.startswith("prefill-r1") for name in drv._mapped)  # unmapped
    assert rig.server.url not in rig.client._peers  # the next pull fetches fresh metadata
    assert rig.registry.held() == []


def test_a_dram_buffer_view_keeps_no_fd() -> None:
    buf = allocate(MemoryKind.DRAM, 8192, shared=True)
    assert buf.fd >= 0 and buf.view(0, 4096).fd == -1
    assert isinstance(buf, Buffer)
