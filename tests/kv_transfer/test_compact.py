"""The compact plan and the host-local kernel's addressing, on the CPU.

`compact_plan` keeps the plan as factors; the kernel computes each program's (source,
destination, length) from them (`compact.program_runs` is that computation in numpy, step for
step). Property-tested over the planner's cases (TP pairs including replicated heads, tokens at
page and window edges, both KV dtypes, HND and NHD, contiguous and scattered tables):

* `to_plan()` is `plan_transfer`'s plan, array for array;
* the kernel's runs, mapped back to (region, offset) and coalesced, are the plan's runs exactly;
* played over one address space they write exactly the bytes the plan's runs write.

The Triton kernel itself runs on the GPU (test_gpu.py) and here under Triton's CPU interpreter
where Triton is installed (not in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import numpy as np
import pytest
from beamserve.kv_transfer.bench import pool_for, scattered_pages
from beamserve.kv_transfer.compact import compact_plan, kernel_tables, program_runs
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs
from beamserve.kv_transfer.model import beam_1_0
from beamserve.kv_transfer.plan import TransferPlan, plan_transfer
from beamserve.kv_transfer.topology import KVDtype, KVLayout, RequestPages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_transfer.test_plan_fast import assert_same_plan
from tests.kv_transfer.test_plan_properties import EQUAL_HEAD_PAIRS, Case, cases

GAP = 1 << 12  # bytes between regions in the test address space


def coalesce(so: np.ndarray, do: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge neighbours contiguous on both sides (written here, not taken from the planner)."""
    if len(n) < 2:
        return so, do, n
    brk = (so[1:] != so[:-1] + n[:-1]) | (do[1:] != do[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    ends = np.append(starts[1:], len(n)) - 1
    return so[starts], do[starts], so[ends] + n[ends] - so[starts]


def address_space(plan: TransferPlan) -> tuple[list[int], list[int], int]:
    """Source then destination regions laid out back to back (with gaps) from address 0."""
    at, src, dst = 0, [], []
    for _ in range(plan.src.topology.tp_size):
        src.append(at)
        at += plan.src.region_bytes + GAP
    for _ in range(plan.dst.topology.tp_size):
        dst.append(at)
        at += plan.dst.region_bytes + GAP
    return src, dst, at


def kernel_runs_per_pair(case: Case, base: int = 0) -> tuple[TransferPlan, dict, int]:
    args = (case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    plan = plan_transfer(*args)
    t = kernel_tables(compact_plan(*args))
    src, dst, _ = address_space(plan)
    table = t.bind([a + base for a in src], [a + base for a in dst], base)
    so, do, n = (a * t.elem for a in program_runs(t, table))
    s_rank = np.searchsorted(np.array(src), so, side="right") - 1
    d_rank = np.searchsorted(np.array(dst), do, side="right") - 1
    out = {}
    for s in range(len(src)):
        for d in range(len(dst)):
            sel = (s_rank == s) & (d_rank == d)
            if sel.any():
                out[(s, d)] = coalesce(so[sel] - src[s], do[sel] - dst[d], n[sel])
    return plan, out, t.programs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_compact_plan_writes_out_to_the_direct_plan(case: Case) -> None:
    args = (case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    compact = compact_plan(*args)
    plan = plan_transfer(*args)
    assert_same_plan(compact.to_plan(), plan)
    assert compact.bytes_moved == plan.bytes_moved


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), base=st.sampled_from([0, 1 << 20, 1 << 40]))
def test_kernel_runs_are_the_plans_runs(case: Case, base: int) -> None:
    plan, got, _ = kernel_runs_per_pair(case, base)
    assert sorted(got) == [(p.src_rank, p.dst_rank) for p in plan.pairs]
    for p in plan.pairs:
        so, do, n = got[(p.src_rank, p.dst_rank)]
        np.testing.assert_array_equal(so, p.src_offsets)
        np.testing.assert_array_equal(do, p.dst_offsets)
        np.testing.assert_array_equal(n, p.lengths)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(layouts=(KVLayout.NHD,), pairs=EQUAL_HEAD_PAIRS))
def test_kernel_runs_are_the_plans_runs_nhd(case: Case) -> None:
    plan, got, _ = kernel_runs_per_pair(case)
    for p in plan.pairs:
        want = (p.src_offsets, p.dst_offsets, p.lengths)
        for a, b in zip(got[(p.src_rank, p.dst_rank)], want, strict=True):
            np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**32 - 1))
def test_kernel_played_over_one_address_space_writes_the_plans_bytes(case: Case, seed: int) -> None:
    args = (case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    plan = plan_transfer(*args)
    t = kernel_tables(compact_plan(*args))
    src, dst, size = address_space(plan)
    space = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    want = space.copy()
    for p in plan.pairs:
        s0, d0 = src[p.src_rank], dst[p.dst_rank]
        copy_runs(
            Buffer(MemoryKind.DRAM, space[s0 : s0 + plan.src.region_bytes]),
            p.src_offsets,
            Buffer(MemoryKind.DRAM, want[d0 : d0 + plan.dst.region_bytes]),
            p.dst_offsets,
            p.lengths,
        )
    got = space.copy()
    writes = np.zeros(size, dtype=np.int32)
    e = t.elem
    for so, do, n in zip(*(a.tolist() for a in program_runs(t, t.bind(src, dst, 0))), strict=True):
        got[do * e : (do + n) * e] = space[so * e : (so + n) * e]
        writes[do * e : (do + n) * e] += 1
    np.testing.assert_array_equal(got, want)
    assert writes.max(initial=0) <= 1  # every destination byte written at most once
    assert int(writes.sum()) == plan.bytes_moved


def test_beam_80k_8_to_4_fits_a_few_hundred_kb() -> None:
    """The numbers the docs quote: 189,824 descriptors (4.6 MB as a table) become 16 segments
    and a 264 KB kernel table; one program per descriptor, 16-byte vectors, one step each."""
    m, n = beam_1_0(), 81920
    src, dst = pool_for(m, 8, n), pool_for(m, 4, n)
    rng = np.random.default_rng(0)
    sp, dp = scattered_pages(src, n, rng), scattered_pages(dst, n, rng)
    plan = plan_transfer(src, dst, n, sp, dp)
    compact = compact_plan(src, dst, n, sp, dp)
    t = kernel_tables(compact)
    assert plan.descriptors == compact.descriptors == t.programs == 189_824
    assert len(compact.segments) == t.segments == 16
    assert t.nbytes < 300_000 < 24 * plan.descriptors
    assert (t.elem, t.align, t.steps, t.longest) == (8, 2, 1, 2048)
    assert t.nbytes_moved == plan.bytes_moved == 3_110_076_416


def test_pieces_are_one_loop_step_at_most() -> None:
    """1:1 at 80K: a page's 8 heads are one 128 KiB run; the table splits it into 16 KiB
    pieces (one loop-kernel step each), which the kernel's runs still coalesce back into."""
    m, n = beam_1_0(), 81920
    src, dst = pool_for(m, 1, n), pool_for(m, 1, n)
    rng = np.random.default_rng(3)
    sp, dp = scattered_pages(src, n, rng), scattered_pages(dst, n, rng)
    plan = plan_transfer(src, dst, n, sp, dp)
    t = kernel_tables(compact_plan(src, dst, n, sp, dp))
    assert (t.steps, t.longest) == (1, 2048)
    assert t.programs == 8 * plan.descriptors
    big = kernel_tables(compact_plan(src, dst, n, sp, dp), piece_bytes=64 << 10)
    assert (big.steps, big.longest, big.programs) == (4, 8192, 2 * plan.descriptors)


def test_bind_into_a_given_buffer_writes_what_bind_returns() -> None:
    m = beam_1_0()
    src, dst = pool_for(m, 2, 512), pool_for(m, 1, 512)
    rng = np.random.default_rng(4)
    sp, dp = scattered_pages(src, 512, rng), scattered_pages(dst, 512, rng)
    t = kernel_tables(compact_plan(src, dst, 512, sp, dp))
    addrs = ([1 << 30, 3 << 30], [5 << 30])
    want = t.bind(*addrs, 1 << 30)
    out = np.full(len(t.table) + 10, -7, dtype=np.int64)
    got = t.bind(*addrs, 1 << 30, out=out[: len(t.table)])
    assert got is not None and np.shares_memory(got, out)
    np.testing.assert_array_equal(out[: len(t.table)], want)
    assert (out[len(t.table) :] == -7).all()  # nothing written past the table
    assert not (want == t.table).all()  # the region columns were written
    with pytest.raises(TransferPlanError, match="bind into"):
        t.bind(*addrs, 1 << 30, out=out)


def test_same_errors_as_the_planner() -> None:
    m = beam_1_0()
    src, dst = pool_for(m, 8, 1024), pool_for(m, 4, 1024)
    bad = RequestPages.of(np.arange(3), np.arange(3))
    with pytest.raises(TransferPlanError, match=r"src_pages\.full"):
        compact_plan(src, dst, 1024, bad, bad)
    other = pool_for(m, 4, 1024, kv_dtype=KVDtype.FP8_E4M3)
    pages = scattered_pages(src, 1024, np.random.default_rng(1))
    with pytest.raises(TransferPlanError, match="kv_dtype"):
        compact_plan(src, other, 1024, pages, pages)
    assert compact_plan(src, dst, 0, *(RequestPages.of([], []),) * 2).segments == ()


def test_bind_refuses_a_misaligned_or_low_region() -> None:
    m = beam_1_0()
    src, dst = pool_for(m, 2, 256), pool_for(m, 1, 256)
    rng = np.random.default_rng(2)
    sp, dp = scattered_pages(src, 256, rng), scattered_pages(dst, 256, rng)
    t = kernel_tables(compact_plan(src, dst, 256, sp, dp))
    with pytest.raises(TransferPlanError, match="aligned"):
        t.bind([0, 1 << 30], [(2 << 30) + 8], 0)
    with pytest.raises(TransferPlanError, match="below base_addr"):
        t.bind([1 << 20, 1 << 30], [2 << 30], 1 << 21)


INTERPRETED = """
import numpy as np, torch
import triton.runtime.interpreter as ti

# Triton 3.6's interpreter turns a scalar (a 1-element array there) into a loop bound with
# int(array), which NumPy >= 2.4 refuses for arrays of one dimension: take the element.
_patch = ti._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patched

from beamserve.kv_transfer import kernels
from beamserve.kv_transfer.bench import pool_for, scattered_pages
from beamserve.kv_transfer.compact import compact_plan, kernel_tables, program_runs
from beamserve.kv_transfer.model import BeamModelConfig, beam_layer_types

m = BeamModelConfig(num_hidden_layers=7, layer_types=beam_layer_types(7, full_every=3),
                    sliding_window=40, num_attention_heads=16, num_key_value_heads=8, head_dim=4)
for s_tp, d_tp, seq in ((8, 4, 300), (2, 1, 129), (1, 1, 77)):
    src, dst = pool_for(m, s_tp, seq), pool_for(m, d_tp, seq)
    rng = np.random.default_rng(seq)
    sp, dp = scattered_pages(src, seq, rng), scattered_pages(dst, seq, rng)
    t = kernel_tables(compact_plan(src, dst, seq, sp, dp))
    offs = [i * (src.region_bytes + 64) for i in range(s_tp)]
    d0 = offs[-1] + src.region_bytes + 64
    doffs = [d0 + i * (dst.region_bytes + 64) for i in range(d_tp)]
    size = doffs[-1] + dst.region_bytes
    host = rng.integers(0, 256, size + 64, dtype=np.uint8)
    table = t.bind(offs, doffs, 0)
    want = host.copy()
    e = t.elem
    for a, b, n in zip(*(x.tolist() for x in program_runs(t, table))):
        want[b * e : (b + n) * e] = want[a * e : (a + n) * e]
    for runs in (1, 4):  # pieces per launched program (the last program partly idle)
        space = torch.from_numpy(host.copy())
        kernels.launch_compact(space, torch.from_numpy(table), t.log2, t.elem, t.align,
                               t.steps, t.programs, runs)
        assert np.array_equal(space.numpy(), want), (s_tp, d_tp, seq, runs)
    # The loop kernel: grids smaller than, equal to and larger than the piece count, with
    # and without the look-ahead; and a table whose runs are split into many short pieces.
    block = kernels.loop_block(t.elem, t.longest)
    for grid, ahead in ((1, True), (5, False), (t.programs, True), (t.programs + 3, False)):
        space = torch.from_numpy(host.copy())
        kernels.launch_compact_loop(space, torch.from_numpy(table), t.log2, t.elem, t.align,
                                    block, grid, 4, ahead, grid == 5)
        assert np.array_equal(space.numpy(), want), (s_tp, d_tp, seq, grid, ahead)
    short = kernel_tables(compact_plan(src, dst, seq, sp, dp), piece_bytes=48, block_bytes=48)
    bound = short.bind(offs, doffs, 0)
    assert short.programs > t.programs and short.longest * short.elem <= 48
    space = torch.from_numpy(host.copy())
    kernels.launch_compact_loop(space, torch.from_numpy(bound), short.log2, short.elem,
                                short.align, kernels.loop_block(short.elem, short.longest), 7)
    assert np.array_equal(space.numpy(), want), (s_tp, d_tp, seq, "short pieces")
# A kernel that copies nothing fails the comparison: the check can fail.
space = torch.from_numpy(host.copy())
table0 = table.copy()
table0[5] = 0
kernels.launch_compact_loop(space, torch.from_numpy(table0), t.log2, t.elem, t.align, block, 3)
assert not np.array_equal(space.numpy(), want)
print("ok")
"""


@pytest.mark.skipif(find_spec("triton") is None, reason="Triton is not installed (CI)")
def test_compact_kernel_under_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INTERPRETED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
        cwd="/",
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), by=st.sampled_from(["src", "dst"]), seed=st.integers(0, 2**32 - 1))
def test_reordered_tables_move_the_same_runs_and_bytes(case: Case, by: str, seed: int) -> None:
    """Sorting each segment's runs changes which program copies what, nothing else."""
    args = (case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    plan = plan_transfer(*args)
    t = kernel_tables(compact_plan(*args))
    r = kernel_tables(compact_plan(*args), order=by)
    assert (r.programs, r.nbytes, r.steps, r.longest) == (t.programs, t.nbytes, t.steps, t.longest)
    src, dst, size = address_space(plan)
    a = np.stack(program_runs(t, t.bind(src, dst, 0)), axis=1)
    b = np.stack(program_runs(r, r.bind(src, dst, 0)), axis=1)
    np.testing.assert_array_equal(np.unique(a, axis=0), np.unique(b, axis=0))
    assert len(np.unique(b, axis=0)) == len(b)  # no piece twice
    if len(b) > 1 and plan.src.topology.tp_size <= 8:  # sorted inside each segment's block
        rows = 1 << r.log2
        for k in range(r.segments):
            start, cnt = int(r.table[8 + k]), int(r.table[8 + rows + k])
            col = 0 if by == "src" else 1
            seg = b[start : start + cnt, col]
            assert (np.diff(seg) > 0).all()
    space = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    got_t, got_r = space.copy(), space.copy()
    for got, runs in ((got_t, a), (got_r, b)):
        for so, do, n in (runs * t.elem).tolist():
            got[do : do + n] = space[so : so + n]
    np.testing.assert_array_equal(got_t, got_r)
    with pytest.raises(TransferPlanError, match="order"):
        kernel_tables(compact_plan(*args), order="random")
