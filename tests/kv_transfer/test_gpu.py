"""VRAM on a real GPU: device copies, CUDA IPC and NIXL VRAM transfers between rank processes.

Skipped where torch sees no CUDA device (CI). Each behaviour here has a CPU test too
(test_staging.py, test_staged_transfer.py); this module checks that the same code is right on
device memory: the plan is the same, the memory kind is the region's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from beamserve.kv_transfer.cost import TransferPath
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
)
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
    def __init__(self, backend: str, src_tp: int, dst_tp: int, dtype: KVDtype) -> None:
        self.src, self.dst = layout(src_tp, dtype), layout(dst_tp, dtype)
        stage = 64 << 20
        self.prefill = RankGroup("prefill", self.src, backend, MemoryKind.VRAM, stage)
        self.decode = RankGroup("decode", self.dst, backend, MemoryKind.VRAM, stage)
        self.registry = PrefillKVRegistry(
            "prefill-gpu", self.src, backend, self.prefill.infos, stager=self.prefill,
            staging_bytes=stage, memory=MemoryKind.VRAM,
        )  # fmt: skip
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(self.decode, chunk_bytes=8 << 20)
        self.prefill.call_all("fill_random", 5)
        self.rng = np.random.default_rng([src_tp, dst_tp])
        self.n = 0

    def pull_and_verify(self, path: TransferPath) -> None:
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
