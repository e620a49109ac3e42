"""VRAM on a real GPU: device copies, CUDA IPC and NIXL VRAM transfers between rank processes.

Skipped where torch sees no CUDA device (CI). Each behaviour here has a CPU test too
(test_staging.py, test_staged_transfer.py); this module checks that the same code is right on
device memory: the plan is the same, the memory kind is the region's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from beamserve.kv_transfer.compact import compact_plan, kernel_tables
from beamserve.kv_transfer.cost import TransferPath
from beamserve.kv_transfer.errors import PeerLostError, TransferPlanError
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    PullResult,
    build_handshake_app,
)
from beamserve.kv_transfer.host_local import HostLocalDriver
from beamserve.kv_transfer.memory import Buffer, MemoryKind, allocate, copy_runs, cuda_available
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.kv_transfer.plan import bytes_minimum, plan_transfer
from beamserve.kv_transfer.rank import RankGroup
from beamserve.kv_transfer.staging import stage_plan
from beamserve.kv_transfer.topology import (
    KVDtype,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (torch)")

MODEL = BeamModelConfig(
    num_hidden_layers=6,
    layer_types=beam_layer_types(6, full_every=3),
    sliding_window=64,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
)
PAGE = 16
SEQ_LEN = 3000
SEED, SENTINEL = 21, 0x77


def layout(tp: int, dtype: KVDtype = KVDtype.BF16) -> PoolLayout:
    return PoolLayout(MODEL, PoolTopology(tp, PAGE, dtype), pages_needed(SEQ_LEN, PAGE) + 30, 9)


def pages(lay: PoolLayout, rng: np.random.Generator) -> RequestPages:
    n_full = pages_needed(SEQ_LEN, PAGE)
    n_win = n_full - first_window_page(SEQ_LEN, MODEL.sliding_window, PAGE)
    return RequestPages.of(
        rng.permutation(lay.full_pages)[:n_full], rng.permutation(lay.window_pages)[:n_win]
    )


@pytest.mark.parametrize("row", [8, 16, 256, 4096, 12])
def test_copy_runs_on_vram_matches_host(row: int) -> None:
    import torch

    rng = np.random.default_rng(row)
    n_rows = 4096
    host = rng.integers(0, 256, n_rows * row, dtype=np.uint8)
    so = rng.permutation(n_rows)[:1000].astype(np.int64) * row
    do = rng.permutation(n_rows)[:1000].astype(np.int64) * row
    n = np.full(1000, row, dtype=np.int64)
    n[::7] = row // 2 if row % 2 == 0 else row  # a second length class
    src_h = Buffer(MemoryKind.DRAM, host.copy())
    dst_h = Buffer(MemoryKind.DRAM, np.zeros_like(host))
    copy_runs(src_h, so, dst_h, do, n)
    src_d = Buffer(MemoryKind.VRAM, torch.from_numpy(host.copy()).cuda())
    dst_d = allocate(MemoryKind.VRAM, len(host))
    copy_runs(src_d, so, dst_d, do, n)
    torch.cuda.synchronize()
    assert np.array_equal(dst_d.host(), dst_h.data)


class Rig:
    def __init__(
        self,
        backend: str,
        src_tp: int,
        dst_tp: int,
        dtype: KVDtype,
        driver: str = "ranks",
        local_in: str = "rank0",
    ) -> None:
        self.src, self.dst = layout(src_tp, dtype), layout(dst_tp, dtype)
        stage = 64 << 20
        self.prefill = RankGroup("prefill", self.src, backend, MemoryKind.VRAM, stage)
        self.decode = RankGroup(
            "decode", self.dst, backend, MemoryKind.VRAM, stage, local_in=local_in
        )
        self.registry = PrefillKVRegistry(
            "prefill-gpu", self.src, backend, self.prefill.infos, stager=self.prefill,
            staging_bytes=stage, memory=MemoryKind.VRAM,
        )  # fmt: skip
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(self.decode, chunk_bytes=8 << 20, driver=driver)
        self.prefill.call_all("fill_random", 5)
        self.rng = np.random.default_rng([src_tp, dst_tp])
        self.n = 0

    def pull_and_verify(self, path: TransferPath) -> PullResult:
        self.n += 1
        rid, seed = f"gpu-{self.n}", SEED + self.n
        sp, dp = pages(self.src, self.rng), pages(self.dst, self.rng)
        self.prefill.call_all("write_request", SEQ_LEN, sp, seed)
        self.decode.call_all("fill_random", SENTINEL)
        self.registry.publish(rid, SEQ_LEN, sp)
        res = self.client.pull(self.server.url, rid, dp, 60.0, path=path)
        assert res.bytes_moved == bytes_minimum(self.dst, SEQ_LEN)
        if path is not TransferPath.AUTO:
            assert res.path is path
        for r, v in enumerate(self.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL)):
            assert v.ok, f"{path} decode rank {r}: {v}"
        for g in (self.prefill, self.decode):
            for s in g.call_all("pool_stats"):
                assert s.in_use_bytes == 0, s
        return res

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.decode.close()
        self.prefill.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "dtype"),
    [(8, 4, KVDtype.BF16), (4, 8, KVDtype.FP8_E4M3), (2, 2, KVDtype.BF16)],
)
def test_cuda_ipc_pulls_vram_by_every_path(src_tp: int, dst_tp: int, dtype: KVDtype) -> None:
    rig = Rig("cuda_ipc", src_tp, dst_tp, dtype)
    try:
        for path in (TransferPath.DIRECT, TransferPath.STAGED, TransferPath.AUTO):
            rig.pull_and_verify(path)
    finally:
        rig.close()


def _nixl_vram_registers() -> str | None:
    """None if this host's NIXL can register VRAM, else why not (checked in-process)."""
    try:
        from beamserve.kv_transfer.backends.nixl import NixlAgent
    except Exception as exc:
        return f"nixl_cu12 does not import here ({exc})"
    agent = NixlAgent("probe-vram")
    try:
        agent.register(allocate(MemoryKind.VRAM, 1 << 20))
    except Exception as exc:
        # Seen on the H200 image (2026-12-01): the UCX inside nixl-cu12 1.5.1 reports "VRAM
        # memory is detected as host by UCX" and NIXL_ERR_BACKEND (UCX without CUDA support
        # there); VRAM then goes over cuda_ipc.
        return f"NIXL cannot register VRAM here: {type(exc).__name__}: {exc}"
    finally:
        agent.close()
    return None


@pytest.mark.timeout(300)
def test_nixl_pulls_vram_direct_and_staged() -> None:
    why = _nixl_vram_registers()
    if why is not None:
        pytest.skip(why)
    rig = Rig("nixl", 2, 1, KVDtype.BF16)
    try:
        for path in (TransferPath.DIRECT, TransferPath.STAGED):
            rig.pull_and_verify(path)
    finally:
        rig.close()


def test_mooncake_refuses_vram_with_the_fix() -> None:
    pytest.importorskip("mooncake.engine")
    from beamserve.kv_transfer.backends.mooncake import MooncakeAgent

    agent = MooncakeAgent("mc-vram")
    with pytest.raises(TransferPlanError, match="nixl or cuda_ipc"):
        agent.register(allocate(MemoryKind.VRAM, 1 << 20))


def test_plan_and_gather_at_80k_tokens_on_the_gpu() -> None:
    """Beam 1.0, 8:4, 80K tokens: the plan (host) plus one source rank's gather (device),
    timed; the gathered bytes are checked against a host gather of the same runs."""
    import torch

    m, rng = beam_1_0(), np.random.default_rng(0)
    full = pages_needed(81920, 64)
    src = PoolLayout(m, PoolTopology(8, 64), int(full * 1.1) + 1, 12)
    dst = PoolLayout(m, PoolTopology(4, 64), int(full * 1.1) + 1, 12)
    sp, dp = _beam_pages(src, rng), _beam_pages(dst, rng)
    plan_transfer(src, dst, 81920, sp, dp)  # warm numpy
    t0 = time.perf_counter()
    plan = plan_transfer(src, dst, 81920, sp, dp)
    staged = stage_plan(plan, 1 << 30)
    plan_ms = (time.perf_counter() - t0) * 1e3
    chunks = [c for c in staged.chunks if c.src_rank == 0]
    nbytes = sum(c.nbytes for c in chunks)
    host = np.random.default_rng(1).integers(0, 256, src.region_bytes, dtype=np.uint8)
    region = Buffer(MemoryKind.VRAM, torch.from_numpy(host).cuda())
    stage = allocate(MemoryKind.VRAM, nbytes)
    for _ in range(2):  # warm-up, then timed
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        base = 0
        for c in chunks:
            copy_runs(region, c.src_offsets, stage, base + c.stage_offsets, c.lengths)
            base += c.nbytes
        torch.cuda.synchronize()
        gather_ms = (time.perf_counter() - t1) * 1e3
    got = stage.host()
    want = np.concatenate(
        [host[a : a + n] for c in chunks for a, n in zip(c.src_offsets, c.lengths, strict=True)]
    )
    assert np.array_equal(got, want)
    print(
        f"\nplan {plan_ms:.2f} ms + gather {gather_ms:.2f} ms ({nbytes / 1e6:.0f} MB, "
        f"{nbytes / gather_ms / 1e6:.0f} GB/s) = {plan_ms + gather_ms:.2f} ms"
    )


def _beam_pages(lay: PoolLayout, rng: np.random.Generator) -> RequestPages:
    n_full = pages_needed(81920, 64)
    n_win = n_full - first_window_page(81920, lay.model.sliding_window, 64)
    return RequestPages.of(
        rng.permutation(lay.full_pages)[:n_full], rng.permutation(lay.window_pages)[:n_win]
    )


# --- the host-local driver: one process, one launch, every rank of both pools ---------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "dtype", "local_in"),
    [
        (8, 4, KVDtype.BF16, "rank0"),
        (4, 8, KVDtype.FP8_E4M3, "rank0"),
        (1, 1, KVDtype.BF16, "rank0"),
        (8, 4, KVDtype.BF16, "caller"),
        (8, 4, KVDtype.BF16, "auto"),  # the calling process holds CUDA here: the caller
    ],
)
def test_host_local_driver_pulls_vram(
    src_tp: int, dst_tp: int, dtype: KVDtype, local_in: str
) -> None:
    rig = Rig("cuda_ipc", src_tp, dst_tp, dtype, driver="auto", local_in=local_in)
    try:
        for path in (TransferPath.AUTO, TransferPath.DIRECT, TransferPath.AUTO):
            res = rig.pull_and_verify(path)
            assert res.driver == "host_local", res.choice
            assert res.path is TransferPath.DIRECT and res.kernel_ms > 0
            where = "caller" if local_in == "auto" else local_in
            assert res.driver_in == where and set(res.phases_ms) >= {"bind", "wait"}
        res = rig.pull_and_verify(TransferPath.STAGED)  # staging stays with the ranks
        assert res.driver == "ranks"
        if local_in in ("caller", "auto"):
            driver = rig.decode._caller_driver
            assert driver is not None
            stats = driver.stats()
            assert stats.mapped_regions == src_tp + dst_tp  # every region opened here
        else:
            stats = rig.decode.call([0], "driver_stats", lambda _r: (), 30.0)[0]
            assert stats.mapped_regions == src_tp + dst_tp - 1  # rank 0's own is not opened
        assert stats.live_launches == 0 and stats.pulls == 3
    finally:
        rig.close()


@pytest.mark.timeout(300)
def test_host_local_driver_prefill_rank_killed_is_a_lost_peer() -> None:
    rig = Rig("cuda_ipc", 2, 2, KVDtype.BF16, driver="host_local")
    try:
        rig.pull_and_verify(TransferPath.AUTO)
        rig.prefill.kill(1)
        rid = "gpu-killed"
        sp, dp = pages(rig.src, rig.rng), pages(rig.dst, rig.rng)
        rig.registry.publish(rid, SEQ_LEN, sp)
        with pytest.raises(PeerLostError, match="exited before"):
            rig.client.pull(rig.server.url, rid, dp, 30.0)
        assert rig.registry.held() == []
        stats = rig.decode.call([0], "driver_stats", lambda _r: (), 30.0)[0]
        assert stats.live_launches == 0 and stats.mapped_regions == 2  # the dead one unmapped
    finally:
        rig.client.close()
        rig.server.stop()
        rig.decode.close()
        rig.prefill.kill_all()


@dataclass
class OneProcessCase:
    """Device regions of both pools in this process (no IPC), the request's plan and tables,
    and what every destination region must hold after the pull (`want`; `blank` before)."""

    plan: Any
    tables: Any
    s_bufs: list[Buffer]
    d_bufs: list[Buffer]
    blank: list[Any]
    want: list[Any]
    s_agents: list[Any]
    d_agents: list[Any]
    own: dict[str, Buffer]


def one_process_case(
    m: BeamModelConfig, src_tp: int, dst_tp: int, seq: int, dtype: KVDtype, seed: int, gen_seed: int
) -> OneProcessCase:
    import torch
    from beamserve.kv_transfer.backends.base import AgentInfo
    from beamserve.kv_transfer.bench import pool_for, scattered_pages

    src, dst = pool_for(m, src_tp, seq, kv_dtype=dtype), pool_for(m, dst_tp, seq, kv_dtype=dtype)
    rng = np.random.default_rng(seed)
    sp, dp = scattered_pages(src, seq, rng), scattered_pages(dst, seq, rng)
    plan = plan_transfer(src, dst, seq, sp, dp)
    t = kernel_tables(compact_plan(src, dst, seq, sp, dp))
    gen = torch.Generator(device="cuda").manual_seed(gen_seed)
    s_bufs = [
        Buffer(MemoryKind.VRAM, torch.randint(0, 256, (src.region_bytes,), dtype=torch.uint8,
                                              device="cuda", generator=gen))
        for _ in range(src_tp)
    ]  # fmt: skip
    d_bufs = [allocate(MemoryKind.VRAM, dst.region_bytes) for _ in range(dst_tp)]
    for b in d_bufs:
        b.data.fill_(0x5A)
    blank = [b.host().copy() for b in d_bufs]
    want = [b.copy() for b in blank]
    hosts = [b.host() for b in s_bufs]
    for p in plan.pairs:
        copy_runs(
            Buffer(MemoryKind.DRAM, hosts[p.src_rank]), p.src_offsets,
            Buffer(MemoryKind.DRAM, want[p.dst_rank]), p.dst_offsets, p.lengths,
        )  # fmt: skip

    def info(name: str, b: Buffer) -> AgentInfo:
        return AgentInfo("cuda_ipc", name, b"{}", b.addr, b.nbytes, "vram", 0)

    s_agents = [info(f"s{r}", b) for r, b in enumerate(s_bufs)]
    d_agents = [info(f"d{r}", b) for r, b in enumerate(d_bufs)]
    own = {a.name: b for a, b in zip(s_agents + d_agents, s_bufs + d_bufs, strict=True)}
    return OneProcessCase(plan, t, s_bufs, d_bufs, blank, want, s_agents, d_agents, own)


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "dtype", "seq"),
    [(8, 4, KVDtype.BF16, 81920), (2, 2, KVDtype.FP8_E4M3, 3000), (1, 1, KVDtype.BF16, 3000)],
)
def test_compact_kernel_in_one_process(src_tp: int, dst_tp: int, dtype: KVDtype, seq: int) -> None:
    """The kernel over separately allocated device regions (no IPC): every destination byte
    checked against a host copy of the plan's runs; at 80K, its time beside one device copy of
    the same bytes."""
    import torch

    m = beam_1_0() if seq == 81920 else MODEL
    case = one_process_case(m, src_tp, dst_tp, seq, dtype, seq + src_tp, seq)
    plan, t, s_bufs, d_bufs, want = case.plan, case.tables, case.s_bufs, case.d_bufs, case.want
    s_agents, d_agents, own = case.s_agents, case.d_agents, case.own
    driver = HostLocalDriver(own)
    stats = driver.pull(t, s_agents, d_agents, time.monotonic() + 60)
    torch.cuda.synchronize()
    for r, b in enumerate(d_bufs):
        assert np.array_equal(b.host(), want[r]), f"destination rank {r}"
    engine = driver._engine
    assert engine is not None and engine.launches == 1 and engine.replays == 0
    if seq == 81920:
        times = [driver.pull(t, s_agents, d_agents, time.monotonic() + 60) for _ in range(5)]
        # The later launches are graph replays over the same buffers.
        assert engine.replays == (5 if engine.shape.graph else 0)
        for b in d_bufs:
            b.data.fill_(0x5A)  # on this stream: the driver's stream waits for it
        driver.pull(t, s_agents, d_agents, time.monotonic() + 60)
        torch.cuda.synchronize()
        for r, b in enumerate(d_bufs):
            assert np.array_equal(b.host(), want[r]), f"destination rank {r} after a replay"
        kernel = float(np.median([x.kernel_s for x in times]))
        flat_a = allocate(MemoryKind.VRAM, plan.bytes_moved).data
        flat_b = torch.empty_like(flat_a)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        flat_b.copy_(flat_a)
        ev[0].record()
        flat_b.copy_(flat_a)
        ev[1].record()
        ev[1].synchronize()
        copy = ev[0].elapsed_time(ev[1]) / 1e3
        print(
            f"\nhost-local kernel, 8:4 80K in one process: {kernel * 1e3:.3f} ms "
            f"({plan.bytes_moved / kernel / 1e9:.0f} GB/s; in the driver "
            f"{float(np.median([x.seconds for x in times])) * 1e3:.3f} ms) against one copy of "
            f"the same bytes {copy * 1e3:.3f} ms ({plan.bytes_moved / copy / 1e9:.0f} GB/s): "
            f"{copy / kernel:.3f} x"
        )
        # The launch's shape: pieces per program × warps (BEAMSERVE_KV_LOCAL_RUNS / _WARPS).
        from beamserve.kv_transfer import kernels

        base = min(s_bufs + d_bufs, key=lambda b: b.addr)
        bound = t.bind([b.addr for b in s_bufs], [b.addr for b in d_bufs], base.addr)
        dev = torch.from_numpy(bound).cuda()
        for runs in (1, 2, 4):
            for warps in (4, 8):
                ms = []
                for _ in range(6):
                    ev[0].record()
                    kernels.launch_compact(
                        base.data, dev, t.log2, t.elem, t.align, t.steps, t.programs, runs, warps
                    )
                    ev[1].record()
                    ev[1].synchronize()
                    ms.append(ev[0].elapsed_time(ev[1]))
                med = float(np.median(ms[1:]))
                print(f"  runs {runs} warps {warps}: {med:.3f} ms ({copy * 1e3 / med:.3f} x copy)")
        for r, b in enumerate(d_bufs):
            assert np.array_equal(b.host(), want[r]), f"destination rank {r} after the shapes"
    assert stats.bytes_moved == plan.bytes_moved


def test_host_local_gate_queues_the_pull_at_prepare_and_opens_it_in_the_pull() -> None:
    """The gate (`gate.py`) on the device: `prepare` queues the graph replay behind a stream
    wait, nothing is copied before the pull opens it, a prepare that replaces it and a hold
    that runs out disarm it (it copies nothing; the pull then launches by itself), and a
    device-wide synchronize while one is queued returns once the hold runs out."""
    import torch

    case = one_process_case(MODEL, 2, 2, SEQ_LEN, KVDtype.BF16, 11, 11)
    t, d_bufs, want = case.tables, case.d_bufs, case.want
    s_agents, d_agents, own = case.s_agents, case.d_agents, case.own
    blank = case.blank
    driver = HostLocalDriver(own)
    driver.pull(t, s_agents, d_agents, time.monotonic() + 60)  # the first launch: captured
    engine = driver._engine
    assert engine is not None
    if engine._gate is None:
        pytest.skip("no gate here (BEAMSERVE_KV_LOCAL_GATE=0, no graphs, or no stream waits)")
    keeper = engine._gate
    keeper.hold_s = 5.0

    def reset() -> None:
        for b in d_bufs:
            b.data.fill_(0x5A)
        torch.cuda.current_stream().synchronize()

    def state() -> list[Any]:
        return [b.host() for b in d_bufs]

    # Queued at prepare, not run before the pull opens it.
    reset()
    ready = driver.prepare(t, s_agents, d_agents)
    assert ready.launch is not None and ready.launch.gate and keeper.armed is not None
    time.sleep(0.05)
    assert all(np.array_equal(h, w) for h, w in zip(state(), blank, strict=True))
    stats = driver.pull(t, s_agents, d_agents, time.monotonic() + 60, prepared=ready)
    assert engine.gated == 1 and "launch.open" in stats.phases and stats.kernel_s > 0
    assert all(np.array_equal(h, w) for h, w in zip(state(), want, strict=True))

    # Replaced by another prepare: the first is disarmed (copies nothing), the second copies.
    reset()
    first = driver.prepare(t, s_agents, d_agents)
    second = driver.prepare(t, s_agents, d_agents)
    assert keeper.disarmed >= 1 and first.launch.gate != second.launch.gate
    assert all(np.array_equal(h, w) for h, w in zip(state(), blank, strict=True))
    driver.pull(t, s_agents, d_agents, time.monotonic() + 60, prepared=second)
    assert engine.gated == 2
    assert all(np.array_equal(h, w) for h, w in zip(state(), want, strict=True))

    # Held past its hold: disarmed by the watchdog; the pull then launches by itself.
    reset()
    keeper.hold_s = 0.05
    expired = keeper.expired
    late = driver.prepare(t, s_agents, d_agents)
    t0 = time.monotonic()
    torch.cuda.synchronize()  # waits for the gated stream too: until the hold runs out
    assert time.monotonic() - t0 < 2.0 and keeper.expired == expired + 1
    assert all(np.array_equal(h, w) for h, w in zip(state(), blank, strict=True))
    driver.pull(t, s_agents, d_agents, time.monotonic() + 60, prepared=late)
    assert engine.gated == 2  # not through the gate
    assert all(np.array_equal(h, w) for h, w in zip(state(), want, strict=True))
    driver.close()
    assert keeper.armed is None
