"""The staged path without processes: staged plans, the staging pool, local copies, the cost model.

The staged plan is executed here with the same pieces the rank processes use (`copy_runs` on
host `Buffer`s and `StagingPool`), with a plain copy standing in for the wire. What it must
guarantee is checked against independent facts: `content.verify_request` (the destination
holds exactly the request's logical KV, and its sentinel everywhere else), a write counter
(every destination byte written at most once; exactly `bytes_minimum` bytes written), and the
direct plan (same runs, same total).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from beamserve.kv_transfer import content
from beamserve.kv_transfer.cost import (
    LinkModel,
    TransferPath,
    choose_path,
    estimate_direct,
    estimate_staged,
    link_for,
    parse_path,
)
from beamserve.kv_transfer.errors import KVTransferError, TopologyError, TransferPlanError
from beamserve.kv_transfer.memory import (
    Buffer,
    MemoryKind,
    allocate,
    copy_runs,
    cuda_available,
    parse_memory,
)
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.kv_transfer.plan import TransferPlan, bytes_minimum, plan_transfer
from beamserve.kv_transfer.staging import (
    ALIGN,
    StagedPlan,
    StagingExhaustedError,
    StagingPool,
    stage_plan,
)
from beamserve.kv_transfer.topology import (
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

TPS = (1, 2, 4, 8, 16)
TP_PAIRS = [(a, b) for a in TPS for b in TPS if max(a, b) % min(a, b) == 0]
PAGE = 16
SEED, SENTINEL = 5, 9


def small_model(window: int = 40, head_dim: int = 8) -> BeamModelConfig:
    return BeamModelConfig(
        num_hidden_layers=7,
        layer_types=beam_layer_types(7, full_every=3),
        sliding_window=window,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=head_dim,
    )


def layout_for(
    model: BeamModelConfig, tp: int, seq_max: int, dtype: KVDtype, hnd: bool, spare: int
) -> PoolLayout:
    n_full = pages_needed(seq_max, PAGE)
    n_win = pages_needed(model.sliding_window, PAGE) + 1
    topo = PoolTopology(tp, PAGE, dtype, KVLayout.HND if hnd else KVLayout.NHD)
    return PoolLayout(model, topo, n_full + spare, n_win + spare)


def pages_of(lay: PoolLayout, seq_len: int, rng: np.random.Generator) -> RequestPages:
    P, W = lay.topology.page_size, lay.model.sliding_window
    n_full = pages_needed(seq_len, P)
    n_win = n_full - first_window_page(seq_len, W, P) if seq_len else 0
    return RequestPages.of(
        rng.permutation(lay.full_pages)[:n_full], rng.permutation(lay.window_pages)[:n_win]
    )


def run_staged(
    staged: StagedPlan,
    src: list[Buffer],
    dst: list[Buffer],
    src_pools: list[StagingPool],
    dst_pools: list[StagingPool],
    writes: list[np.ndarray],
) -> int:
    """Execute a staged plan as the ranks do: per round gather, one copy per chunk, scatter.

    `src`/`dst` are each rank's registered buffer ([KV region][staging area]); `writes` counts,
    per destination KV byte, how often it was written. Returns bytes on the "wire"."""
    wire = 0
    for r in range(staged.rounds):
        held_src: list[tuple[int, int]] = []
        held_dst: list[tuple[int, int]] = []
        chunks = staged.in_round(r)
        where = {}
        for c in chunks:  # source side: gather (or read the region itself)
            if c.needs_gather:
                off = src_pools[c.src_rank].allocate(c.nbytes)
                held_src.append((c.src_rank, off))
                copy_runs(
                    src[c.src_rank],
                    c.src_offsets,
                    src[c.src_rank],
                    off + c.stage_offsets,
                    c.lengths,
                )
                where[c.chunk_id] = off
            else:
                where[c.chunk_id] = int(c.src_offsets[0])
        for c in chunks:  # destination side: one descriptor, then scatter
            if c.needs_scatter:
                local = dst_pools[c.dst_rank].allocate(c.nbytes)
                held_dst.append((c.dst_rank, local))
            else:
                local = int(c.dst_offsets[0])
            s, d = src[c.src_rank].data, dst[c.dst_rank].data
            d[local : local + c.nbytes] = s[where[c.chunk_id] : where[c.chunk_id] + c.nbytes]
            wire += c.nbytes
            if c.needs_scatter:
                copy_runs(
                    dst[c.dst_rank],
                    local + c.stage_offsets,
                    dst[c.dst_rank],
                    c.dst_offsets,
                    c.lengths,
                )
            count = writes[c.dst_rank]
            np.add.at(count, c.dst_offsets, 1)
            np.add.at(count, c.dst_offsets + c.lengths, -1)
        for rank, off in held_src:
            src_pools[rank].release(off)
        for rank, off in held_dst:
            dst_pools[rank].release(off)
    return wire


@st.composite
def staged_cases(draw: st.DrawFn) -> dict[str, object]:
    hnd = draw(st.booleans())
    pairs = TP_PAIRS if hnd else [(a, b) for a, b in TP_PAIRS if max(1, 8 // a) == max(1, 8 // b)]
    src_tp, dst_tp = draw(st.sampled_from(pairs))
    return {
        "src_tp": src_tp,
        "dst_tp": dst_tp,
        "hnd": hnd,
        "dtype": draw(st.sampled_from(list(KVDtype))),
        "window": draw(st.sampled_from([16, 40, 64])),
        "seq_len": draw(st.integers(0, 150)),
        "spare": draw(st.integers(0, 6)),
        "chunk": draw(st.sampled_from([ALIGN, 2 * ALIGN, 1 << 20])),
        "cap": draw(st.sampled_from([None, ALIGN, 3 * ALIGN, 1 << 20])),
        "seed": draw(st.integers(0, 2**16)),
        "contiguous": draw(st.booleans()),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staged_cases())
@example(
    {"src_tp": 8, "dst_tp": 4, "hnd": True, "dtype": KVDtype.BF16, "window": 40, "seq_len": 150,
     "spare": 3, "chunk": ALIGN, "cap": 3 * ALIGN, "seed": 1, "contiguous": False}
)  # fmt: skip
@example(
    {"src_tp": 1, "dst_tp": 16, "hnd": True, "dtype": KVDtype.FP8_E4M3, "window": 16,
     "seq_len": 149, "spare": 0, "chunk": 1 << 20, "cap": None, "seed": 2, "contiguous": True}
)  # fmt: skip
def test_staged_path_writes_every_needed_byte_exactly_once(case: dict[str, object]) -> None:
    model = small_model(int(case["window"]))  # type: ignore[call-overload]
    seq_len = int(case["seq_len"])  # type: ignore[call-overload]
    spare = int(case["spare"])  # type: ignore[call-overload]
    dtype = KVDtype(case["dtype"])
    src_l = layout_for(model, int(case["src_tp"]), 150, dtype, bool(case["hnd"]), spare)  # type: ignore[call-overload]
    dst_l = layout_for(model, int(case["dst_tp"]), 150, dtype, bool(case["hnd"]), spare)  # type: ignore[call-overload]
    rng = np.random.default_rng(int(case["seed"]))  # type: ignore[call-overload]
    if case["contiguous"]:
        sp = RequestPages.of(
            np.arange(pages_needed(seq_len, PAGE)), pages_of(src_l, seq_len, rng).window
        )
        dp = RequestPages.of(
            np.arange(pages_needed(seq_len, PAGE)), pages_of(dst_l, seq_len, rng).window
        )
        sp = RequestPages.of(sp.full, np.sort(sp.window))
        dp = RequestPages.of(dp.full, np.sort(dp.window))
    else:
        sp, dp = pages_of(src_l, seq_len, rng), pages_of(dst_l, seq_len, rng)
    plan = plan_transfer(src_l, dst_l, seq_len, sp, dp)
    cap = case["cap"]
    cap_i = None if cap is None else int(cap)  # type: ignore[call-overload]
    staged = stage_plan(plan, int(case["chunk"]), cap_i, cap_i)  # type: ignore[call-overload]

    # The plan: same bytes as the direct plan and the minimum; chunks within their limits.
    assert staged.bytes_moved == plan.bytes_moved == bytes_minimum(dst_l, seq_len)
    assert staged.descriptors_on_wire == len(staged.chunks)
    assert all(c.nbytes <= staged.chunk_bytes for c in staged.chunks)
    for side in ("src", "dst"):
        assert all(v <= (cap_i or 1 << 62) for v in staged.peak_staging(side).values())
    for pair in plan.pairs:
        mine = [
            c for c in staged.chunks if (c.src_rank, c.dst_rank) == (pair.src_rank, pair.dst_rank)
        ]
        assert sum(c.nbytes for c in mine) == pair.nbytes
    assert staged.digest() == stage_plan(plan, int(case["chunk"]), cap_i, cap_i).digest()  # type: ignore[call-overload]

    # Execute it and check the destination byte for byte.
    stage_area = cap_i if cap_i is not None else max(plan.bytes_moved, ALIGN) + 64 * ALIGN
    src = [
        Buffer(MemoryKind.DRAM, np.zeros(src_l.region_bytes + stage_area, np.uint8))
        for _ in range(src_l.topology.tp_size)
    ]
    dst = [
        Buffer(MemoryKind.DRAM, np.zeros(dst_l.region_bytes + stage_area, np.uint8))
        for _ in range(dst_l.topology.tp_size)
    ]
    for r, b in enumerate(src):
        content.fill_random(b.data[: src_l.region_bytes], 77)
        content.write_request(b.data[: src_l.region_bytes], src_l, r, seq_len, sp, SEED)
    for b in dst:
        content.fill_random(b.data, SENTINEL)
        b.data[dst_l.region_bytes :] = 0
    src_pools = [StagingPool(src_l.region_bytes, stage_area) for _ in src]
    dst_pools = [StagingPool(dst_l.region_bytes, stage_area) for _ in dst]
    writes = [np.zeros(dst_l.region_bytes + stage_area + 1, np.int64) for _ in dst]
    wire = run_staged(staged, src, dst, src_pools, dst_pools, writes)

    assert wire == bytes_minimum(dst_l, seq_len)
    written = 0
    for r, b in enumerate(dst):
        count = np.cumsum(writes[r])[: dst_l.region_bytes]
        assert count.max(initial=0) <= 1, f"rank {r}: a destination byte was written twice"
        assert count.min(initial=0) >= 0
        written += int(count.sum())
        res = content.verify_request(
            b.data[: dst_l.region_bytes], dst_l, r, seq_len, dp, SEED, SENTINEL
        )
        assert res.ok, f"rank {r}: {res}"
    assert written == bytes_minimum(dst_l, seq_len)
    for pool in (*src_pools, *dst_pools):
        assert pool.stats.in_use_bytes == 0 and pool.stats.buffers_in_use == 0
        assert pool.stats.allocations == pool.stats.releases
        assert pool.stats.peak_bytes <= pool.capacity


def beam_plan(src_tp: int, dst_tp: int, tokens: int, seed: int = 0, dtype: KVDtype = KVDtype.BF16):
    m = beam_1_0()
    rng = np.random.default_rng(seed)
    full = pages_needed(tokens, 64)
    lays = [
        PoolLayout(m, PoolTopology(tp, 64, dtype), int(full * 1.1) + 1, 12)
        for tp in (src_tp, dst_tp)
    ]
    sp, dp = (pages_of(lay, tokens, rng) for lay in lays)
    return plan_transfer(lays[0], lays[1], tokens, sp, dp)


def test_beam_8_to_4_at_80k_is_one_descriptor_per_pair() -> None:
    plan = beam_plan(8, 4, 81920)
    assert plan.descriptors == 189_824
    staged = stage_plan(plan, 1 << 30)
    # 4 destination ranks × 2 source ranks each: 8 descriptors on the wire, not 189,824.
    assert staged.descriptors_on_wire == 8 == len(plan.pairs)
    assert staged.rounds == 1
    assert staged.bytes_moved == 3_110_076_416 == plan.bytes_moved
    assert staged.gather_bytes == staged.scatter_bytes == staged.bytes_moved
    assert staged.staging_bytes == 2 * staged.bytes_moved


def test_bounded_pool_splits_into_rounds() -> None:
    plan = beam_plan(8, 4, 8192)
    cap = 16 << 20
    staged = stage_plan(plan, 8 << 20, cap, cap)
    assert staged.rounds > 1
    assert max(staged.peak_staging("src").values()) <= cap
    assert max(staged.peak_staging("dst").values()) <= cap
    assert all(c.nbytes <= 8 << 20 for c in staged.chunks)
    # Per destination rank and round: no more than its pool; every chunk is in one round.
    assert sorted(c.chunk_id for c in staged.chunks) == list(range(len(staged.chunks)))


def test_contiguous_sides_skip_the_copies() -> None:
    m = beam_1_0()
    lay = PoolLayout(m, PoolTopology(1, 64), 32, 8)
    pages = RequestPages.of(np.arange(32), np.arange(8))
    plan = plan_transfer(lay, lay, 2048, pages, pages)
    staged = stage_plan(plan, 1 << 30)
    # 1:1, a full pool on both sides: the plan coalesces to back-to-back runs, so the chunks
    # need no copies at all (the wire reads and writes the KV regions themselves).
    assert plan.descriptors == 1
    assert all(not c.needs_gather and not c.needs_scatter for c in staged.chunks)
    assert staged.staging_bytes == 0


def test_stage_plan_refuses_a_pool_too_small() -> None:
    plan = beam_plan(2, 1, 256)
    with pytest.raises(TransferPlanError, match="staging pool at least"):
        stage_plan(plan, 1 << 20, 1024, None)
    with pytest.raises(TransferPlanError, match="chunk_bytes"):
        stage_plan(plan, 100)


# --- the pool ------------------------------------------------------------------------------


def test_pool_allocates_aligned_first_fit_and_merges() -> None:
    pool = StagingPool(base=1 << 20, capacity=10 * ALIGN + 123)
    assert pool.capacity == 10 * ALIGN
    a = pool.allocate(1)
    b = pool.allocate(3 * ALIGN)
    c = pool.allocate(ALIGN + 1)
    assert (a, b, c) == (1 << 20, (1 << 20) + ALIGN, (1 << 20) + 4 * ALIGN)
    assert pool.stats.in_use_bytes == 6 * ALIGN and pool.stats.buffers_in_use == 3
    pool.release(b)
    pool.release(b)  # idempotent
    assert pool.stats.releases == 1
    assert pool.allocate(2 * ALIGN) == b  # first fit reuses the hole
    pool.release(a)
    pool.release(c)
    pool.release(b)
    assert pool.stats.in_use_bytes == 0
    assert pool.allocate(10 * ALIGN) == 1 << 20  # holes merged back into one range
    assert pool.stats.peak_bytes == 10 * ALIGN
    assert pool.stats.bytes_allocated_total == (1 + 3 + 2 + 2 + 10) * ALIGN


def test_pool_exhaustion_is_typed_and_names_the_fix() -> None:
    pool = StagingPool(0, 4 * ALIGN)
    pool.allocate(3 * ALIGN)
    with pytest.raises(StagingExhaustedError, match="--staging-bytes") as err:
        pool.allocate(2 * ALIGN)
    assert isinstance(err.value, KVTransferError)
    assert pool.release_all() == 1
    assert pool.stats.in_use_bytes == 0


def test_pool_is_thread_safe() -> None:
    pool = StagingPool(0, 64 * ALIGN)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(300):
                off = pool.allocate(ALIGN)
                pool.release(off)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.stats.in_use_bytes == 0 and pool.stats.allocations == 2400


# --- local copies --------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(st.integers(0, 63), st.sampled_from([8, 16, 24, 256, 4096, 8192])), max_size=40
    ),
    st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_copy_runs_matches_a_loop(runs: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    slot = 8192
    src = Buffer(MemoryKind.DRAM, rng.integers(0, 256, 64 * slot, dtype=np.uint8))
    dst = Buffer(MemoryKind.DRAM, np.zeros(64 * slot + slot, np.uint8))
    uniq = {}
    for s, n in runs:
        uniq.setdefault(s, n)
    src_slots = np.array(list(uniq), dtype=np.int64)
    lengths = np.array([uniq[s] for s in uniq], dtype=np.int64)
    shift = rng.integers(0, 4, len(src_slots)) * 8 if len(src_slots) else np.zeros(0, np.int64)
    so = src_slots * slot + np.minimum(shift, slot - lengths)
    do = rng.permutation(64)[: len(so)].astype(np.int64) * slot + 8
    expect = dst.data.copy()
    for a, b, n in zip(so, do, lengths, strict=True):
        expect[b : b + n] = src.data[a : a + n]
    assert copy_runs(src, so, dst, do, lengths) == int(lengths.sum())
    assert np.array_equal(dst.data, expect)


def test_copy_runs_refuses_mixed_kinds() -> None:
    a = Buffer(MemoryKind.DRAM, np.zeros(16, np.uint8))
    b = Buffer(MemoryKind.VRAM, np.zeros(16, np.uint8))
    with pytest.raises(KVTransferError, match="one memory kind"):
        copy_runs(a, np.zeros(1, np.int64), b, np.zeros(1, np.int64), np.ones(1, np.int64))


def test_memory_kind_errors_name_the_choices() -> None:
    with pytest.raises(TopologyError, match="dram"):
        parse_memory("hbm")
    if not cuda_available():
        with pytest.raises(TopologyError, match="--memory dram"):
            allocate(MemoryKind.VRAM, 4096)
    buf = allocate(MemoryKind.DRAM, 4096)
    assert buf.nbytes == 4096 and buf.addr == buf.data.ctypes.data


# --- the cost model ------------------------------------------------------------------------


def test_cost_model_stages_many_small_descriptors_on_vram_over_nixl() -> None:
    plan = beam_plan(8, 4, 81920)
    staged = stage_plan(plan, 1 << 30)
    choice = choose_path(plan, staged, link_for(MemoryKind.VRAM, "nixl"), TransferPath.AUTO)
    assert choice.path is TransferPath.STAGED
    assert choice.staged_s < choice.direct_s
    # Per destination rank: 189,824 / 4 descriptors at 6 µs ≈ 0.28 s direct.
    assert choice.direct_s == pytest.approx(47_456 * 6e-6 + plan.bytes_moved / 4 / 1.5e12, rel=1e-6)


def test_cost_model_keeps_direct_where_descriptors_are_few() -> None:
    m = beam_1_0()
    lay = PoolLayout(m, PoolTopology(1, 64), 40, 12)
    pages = RequestPages.of(np.arange(32), np.arange(8))
    plan = plan_transfer(lay, lay, 2048, pages, pages)
    staged = stage_plan(plan, 1 << 30)
    for memory, backend in ((MemoryKind.DRAM, "nixl"), (MemoryKind.VRAM, "nixl")):
        choice = choose_path(plan, staged, link_for(memory, backend), TransferPath.AUTO)
        assert choice.path is TransferPath.DIRECT, (memory, choice)


def test_cost_model_on_dram_here_prefers_direct_for_8_to_4() -> None:
    # Measured on the 2-core VM: two extra local copies at ~3 GB/s cost more than 189,824
    # CMA system calls (docs/kv-transfer.md); the model must not stage there.
    plan = beam_plan(8, 4, 81920)
    staged = stage_plan(plan, 128 << 20, 512 << 20, 512 << 20)
    choice = choose_path(plan, staged, link_for(MemoryKind.DRAM, "nixl"), TransferPath.AUTO)
    assert choice.path is TransferPath.DIRECT


def test_cost_model_arithmetic_and_forcing() -> None:
    plan = beam_plan(2, 1, 1024)
    staged = stage_plan(plan, 1 << 30)
    link = LinkModel(per_desc_s=1e-6, wire_Bps=1e9, copy_Bps=2e9, round_trip_s=1e-3)
    direct = plan.descriptors * 1e-6 + plan.bytes_moved / 1e9  # one destination rank
    gather = max(
        sum(c.gather_bytes for c in staged.chunks if c.src_rank == s) / 2e9 for s in (0, 1)
    )
    pull = sum(1e-6 + c.nbytes / 1e9 + c.scatter_bytes / 2e9 for c in staged.chunks)
    assert estimate_direct(plan, link) == pytest.approx(direct)
    assert estimate_staged(staged, link) == pytest.approx(1e-3 + gather + pull)
    for forced in (TransferPath.DIRECT, TransferPath.STAGED):
        assert choose_path(plan, staged, link, forced).path is forced
    empty = TransferPlan(plan.src, plan.dst, 0, ())
    none = stage_plan(empty)
    assert choose_path(empty, none, link, TransferPath.AUTO).path is TransferPath.DIRECT


def test_cost_model_errors_name_the_choices() -> None:
    with pytest.raises(TransferPlanError, match="direct"):
        parse_path("fastest")
    with pytest.raises(TransferPlanError, match="known"):
        link_for(MemoryKind.VRAM, "mooncake")
