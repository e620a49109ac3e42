"""The vectorised planner (`plan.plan_transfer`) gives array for array the plan of the first
planner (`plan_reference.plan_transfer`), and the staged plan's digest is a hash of its inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from beamserve.kv_transfer import plan_reference
from beamserve.kv_transfer.bench import pool_for, scattered_pages
from beamserve.kv_transfer.memory import length_classes
from beamserve.kv_transfer.model import beam_1_0
from beamserve.kv_transfer.plan import TransferPlan, plan_transfer
from beamserve.kv_transfer.staging import PLANNER_VERSION, plan_digest, stage_plan
from beamserve.kv_transfer.topology import (
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_transfer.test_plan_properties import EQUAL_HEAD_PAIRS, Case, cases


def assert_same_plan(new: TransferPlan, old: TransferPlan) -> None:
    assert [(p.src_rank, p.dst_rank) for p in new.pairs] == [
        (p.src_rank, p.dst_rank) for p in old.pairs
    ]
    for p, q in zip(new.pairs, old.pairs, strict=True):
        for a, b in (
            (p.src_offsets, q.src_offsets),
            (p.dst_offsets, q.dst_offsets),
            (p.lengths, q.lengths),
        ):
            assert a.dtype == b.dtype == np.int64
            np.testing.assert_array_equal(a, b)


def both(case: Case) -> tuple[TransferPlan, TransferPlan]:
    args = (case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    return plan_transfer(*args), plan_reference.plan_transfer(*args)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_same_plan_as_the_reference(case: Case) -> None:
    assert_same_plan(*both(case))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(layouts=(KVLayout.NHD,), pairs=EQUAL_HEAD_PAIRS))
def test_same_plan_as_the_reference_nhd(case: Case) -> None:
    assert_same_plan(*both(case))


def test_contiguous_tables_merge_across_k_and_v() -> None:
    """A page table that is the whole pool, in order: each K buffer's last run ends where its
    V buffer's first starts, and the layers follow each other, so runs merge across (layer,
    K/V) blocks (the case the fast planner hands to the whole-pair coalesce)."""
    m = beam_1_0()
    n_full, seq = 10, 640
    src = PoolLayout(m, PoolTopology(1, 64), n_full, 8)
    dst = PoolLayout(m, PoolTopology(1, 64), n_full, 12)
    win = np.arange(8)
    args = (
        src, dst, seq,
        RequestPages.of(np.arange(n_full), win),
        RequestPages.of(np.arange(n_full), win[::-1] + 4),
    )  # fmt: skip
    new, old = plan_transfer(*args), plan_reference.plan_transfer(*args)
    assert_same_plan(new, old)
    # Every full layer's K and V, all layers: one run on both sides.
    full_bytes = 2 * len(m.full_layers) * n_full * src.page_bytes
    assert int(new.pairs[0].lengths[0]) == full_bytes


@pytest.mark.parametrize(("s_tp", "d_tp"), [(8, 4), (4, 8), (16, 4), (1, 1)])
@pytest.mark.parametrize("dtype", list(KVDtype))
def test_beam_80k_same_plan_as_the_reference(s_tp: int, d_tp: int, dtype: KVDtype) -> None:
    m = beam_1_0()
    src = pool_for(m, s_tp, 81920, kv_dtype=dtype)
    dst = pool_for(m, d_tp, 81920, kv_dtype=dtype)
    rng = np.random.default_rng(s_tp * 31 + d_tp)
    sp, dp = scattered_pages(src, 81920, rng), scattered_pages(dst, 81920, rng)
    args = (src, dst, 81920, sp, dp)
    assert_same_plan(plan_transfer(*args), plan_reference.plan_transfer(*args))


@given(st.lists(st.integers(1, 6), min_size=1, max_size=300))
def test_length_classes_longest_first_plan_order_inside(values: list[int]) -> None:
    n = np.array(values, dtype=np.int64) * 256
    got = length_classes(n)
    want = [np.flatnonzero(n == v) for v in np.unique(n)[::-1]]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_length_classes_many_lengths() -> None:
    n = np.random.default_rng(5).integers(1, 40, 2000).astype(np.int64)
    got = np.concatenate(length_classes(n))
    np.testing.assert_array_equal(got, np.argsort(-n, kind="stable"))


def _plan_8_4() -> tuple[TransferPlan, tuple]:
    m = beam_1_0()
    src, dst = pool_for(m, 8, 4096), pool_for(m, 4, 4096)
    rng = np.random.default_rng(9)
    sp, dp = scattered_pages(src, 4096, rng), scattered_pages(dst, 4096, rng)
    return plan_transfer(src, dst, 4096, sp, dp), (src, dst, 4096, sp, dp)


def test_digest_is_a_hash_of_the_inputs() -> None:
    plan, (src, dst, seq, sp, dp) = _plan_8_4()
    staged = stage_plan(plan, 1 << 20, 8 << 20, 4 << 20)
    d = staged.digest()
    assert d == plan_digest(src, dst, seq, sp, dp, 1 << 20, 8 << 20, 4 << 20)
    assert d == stage_plan(plan_transfer(src, dst, seq, sp, dp), 1 << 20, 8 << 20, 4 << 20).digest()
    # Any input that changes the plan changes the digest.
    other = RequestPages.of(dp.full[::-1], dp.window)
    assert plan_digest(src, dst, seq, sp, other, 1 << 20, 8 << 20, 4 << 20) != d
    assert stage_plan(plan, 1 << 21, 8 << 20, 4 << 20).digest() != d
    assert stage_plan(plan, 1 << 20, 8 << 20, 8 << 20).digest() != d
    assert plan_digest(dst, src, seq, dp, sp, 1 << 20, 8 << 20, 4 << 20) != d
    assert PLANNER_VERSION


def test_digest_of_a_plan_without_page_tables_hashes_its_arrays() -> None:
    plan, _ = _plan_8_4()
    bare = dataclasses.replace(plan, src_pages=None, dst_pages=None)
    a = stage_plan(bare, 1 << 20).digest()
    assert a == stage_plan(bare, 1 << 20).digest()
    p0 = bare.pairs[0]
    moved = dataclasses.replace(p0, dst_offsets=p0.dst_offsets + 4096)
    changed = dataclasses.replace(bare, pairs=(moved, *bare.pairs[1:]))
    assert stage_plan(changed, 1 << 20).digest() != a
