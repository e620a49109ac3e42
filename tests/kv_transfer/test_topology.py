"""Pool topology: KV-head ownership under TP, the byte layout of a rank's region, page tables."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from beamserve.kv_transfer.errors import KVTransferError, TopologyError, TransferPlanError
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.kv_transfer.topology import (
    PAGE_SIZES,
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
    window_start,
)
from hypothesis import given, settings
from hypothesis import strategies as st

BEAM = beam_1_0()
TPS = (1, 2, 4, 8, 16, 32)


def small_model(window: int = 40, kv_heads: int = 8) -> BeamModelConfig:
    return BeamModelConfig(
        num_hidden_layers=7,
        layer_types=beam_layer_types(7, full_every=3),
        sliding_window=window,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=4,
    )


# --- KV-head ownership ---------------------------------------------------------------------


def design_heads(rank: int, t: int, k: int = 8) -> list[int]:
    """DESIGN.md §1: [r·k/t, (r+1)·k/t) for t ≤ k; head r·k // t for t > k."""
    if t <= k:
        return list(range(rank * k // t, (rank + 1) * k // t))
    return [rank * k // t]


@pytest.mark.parametrize("t", TPS)
def test_heads_of_rank_matches_design(t: int) -> None:
    topo = PoolTopology(t)
    topo.check_model(BEAM)
    for r in range(t):
        assert list(topo.heads_of_rank(BEAM, r)) == design_heads(r, t)
        assert len(topo.heads_of_rank(BEAM, r)) == topo.heads_per_rank(BEAM)


@pytest.mark.parametrize("t", TPS)
def test_ranks_of_head_is_the_inverse(t: int) -> None:
    topo = PoolTopology(t)
    reps = max(1, t // 8)
    assert topo.replicas_per_head(BEAM) == reps
    assert topo.heads_per_rank(BEAM) == max(1, 8 // t)
    seen: list[int] = []
    for h in range(8):
        ranks = topo.ranks_of_head(BEAM, h)
        assert len(ranks) == reps
        assert ranks == tuple(r for r in range(t) if h in design_heads(r, t))
        for r in ranks:
            assert h in topo.heads_of_rank(BEAM, r)
        seen.extend(ranks)
    # every rank holds at least one head; with t ≤ 8 each rank is listed once per head it owns
    assert set(seen) == set(range(t))
    assert len(seen) == max(t, 8)


@pytest.mark.parametrize("t", TPS)
def test_heads_of_rank_out_of_range(t: int) -> None:
    topo = PoolTopology(t)
    for r in (-1, t, t + 5):
        with pytest.raises(TopologyError, match="rank"):
            topo.heads_of_rank(BEAM, r)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16, 32])
def test_ownership_partitions_heads_for_other_head_counts(k: int, t: int) -> None:
    m = small_model(kv_heads=k)
    topo = PoolTopology(t)
    topo.check_model(m)
    owners: dict[int, list[int]] = {h: [] for h in range(k)}
    for r in range(t):
        hs = list(topo.heads_of_rank(m, r))
        assert hs == design_heads(r, t, k)
        for h in hs:
            owners[h].append(r)
    for h in range(k):
        assert tuple(owners[h]) == topo.ranks_of_head(m, h)
        assert len(owners[h]) == topo.replicas_per_head(m)


@pytest.mark.parametrize("t", [3, 5, 6, 7, 12, 20, 24 + 1, 40 + 2])
def test_invalid_tp_names_tp_size(t: int) -> None:
    topo = PoolTopology(t)
    with pytest.raises(TopologyError, match="tp_size") as info:
        topo.check_model(BEAM)
    assert str(t) in str(info.value)
    assert "1, 2, 4, 8" in str(info.value)  # the valid divisors are listed
    with pytest.raises(TopologyError, match="tp_size"):
        PoolLayout(BEAM, topo, full_pages=4, window_pages=4)


@pytest.mark.parametrize("t", [24, 40, 64])
def test_multiples_of_kv_heads_are_valid(t: int) -> None:
    PoolTopology(t).check_model(BEAM)


@pytest.mark.parametrize("t", [0, -1, -8])
def test_tp_below_one(t: int) -> None:
    with pytest.raises(TopologyError, match="tp_size"):
        PoolTopology(t)


@pytest.mark.parametrize("p", [0, 1, 8, 48, 128, 256, -16])
def test_invalid_page_size(p: int) -> None:
    with pytest.raises(TopologyError, match="page_size") as info:
        PoolTopology(8, page_size=p)
    assert "16, 32, 64" in str(info.value)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_valid_page_sizes(p: int) -> None:
    assert PoolTopology(8, page_size=p).page_size == p


def test_kv_dtype_and_layout_coercion() -> None:
    topo = PoolTopology(8, kv_dtype="fp8_e4m3", layout="NHD")  # type: ignore[arg-type]
    assert topo.kv_dtype is KVDtype.FP8_E4M3 and topo.layout is KVLayout.NHD
    assert KVDtype.BF16.nbytes == 2 and KVDtype.FP8_E4M3.nbytes == 1
    assert PoolTopology(8).kv_dtype is KVDtype.BF16 and PoolTopology(8).layout is KVLayout.HND
    assert PoolTopology(8, kv_dtype="fp8_e4m3") == PoolTopology(8, kv_dtype=KVDtype.FP8_E4M3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"kv_dtype": "fp16"}, "kv_dtype"),
        ({"kv_dtype": "bfloat16"}, "kv_dtype"),
        ({"layout": "HDN"}, "layout"),
        ({"layout": "hnd"}, "layout"),
    ],
)
def test_invalid_kv_dtype_and_layout(kw: dict[str, str], field: str) -> None:
    with pytest.raises(TopologyError, match=field) as info:
        PoolTopology(8, **kw)  # type: ignore[arg-type]
    assert isinstance(info.value, KVTransferError)


# --- the region layout ---------------------------------------------------------------------


def test_pool_layout_page_counts_validated() -> None:
    for fp, wp in ((0, 4), (4, 0), (-1, 4)):
        with pytest.raises(TopologyError, match="full_pages/window_pages"):
            PoolLayout(BEAM, PoolTopology(8), full_pages=fp, window_pages=wp)


@pytest.mark.parametrize(
    ("t", "dtype", "row", "heads"),
    [(8, KVDtype.BF16, 256, 1), (4, KVDtype.FP8_E4M3, 128, 2), (16, KVDtype.BF16, 256, 1)],
)
def test_beam_layout_sizes(t: int, dtype: KVDtype, row: int, heads: int) -> None:
    lay = PoolLayout(BEAM, PoolTopology(t, page_size=64, kv_dtype=dtype), 100, 9)
    assert lay.local_heads == heads
    assert lay.row_bytes == row
    assert lay.page_bytes == heads * 64 * row
    assert lay.region_bytes == 2 * lay.page_bytes * (9 * 100 + 43 * 9)
    # full layers first, then sliding layers, each [K pages][V pages]
    full, sliding = BEAM.full_layers, BEAM.sliding_layers
    for i, layer in enumerate(full):
        assert lay.layer_base[layer] == i * 2 * 100 * lay.page_bytes
        assert lay.kv_stride(layer) == 100 * lay.page_bytes
    start = len(full) * 2 * 100 * lay.page_bytes
    for i, layer in enumerate(sliding):
        assert lay.layer_base[layer] == start + i * 2 * 9 * lay.page_bytes
        assert lay.kv_stride(layer) == 9 * lay.page_bytes


@settings(max_examples=25, deadline=None)
@given(
    t=st.sampled_from([1, 2, 4, 8, 16]),
    page=st.sampled_from(PAGE_SIZES),
    dtype=st.sampled_from(list(KVDtype)),
    layout=st.sampled_from(list(KVLayout)),
    full_pages=st.integers(1, 4),
    window_pages=st.integers(1, 3),
)
def test_token_offset_is_a_bijection_onto_the_region(
    t: int, page: int, dtype: KVDtype, layout: KVLayout, full_pages: int, window_pages: int
) -> None:
    m = small_model()
    lay = PoolLayout(m, PoolTopology(t, page, dtype, layout), full_pages, window_pages)
    row, H, P = lay.row_bytes, lay.local_heads, page
    offsets = []
    for layer in range(m.num_hidden_layers):
        pages = full_pages if layer in m.full_layers else window_pages
        for kv, pg, h in itertools.product(range(2), range(pages), range(H)):
            for slot in range(P):
                off = lay.token_offset(layer, kv, pg, h, slot)
                offsets.append(off)
                # documented in-page order
                page_base = lay.token_offset(layer, kv, pg, 0, 0)
                inner = (h * P + slot) if layout is KVLayout.HND else (slot * H + h)
                assert off == page_base + inner * row
    arr = np.sort(np.array(offsets))
    assert len(arr) * row == lay.region_bytes
    assert np.array_equal(arr, np.arange(len(arr)) * row)


# --- helpers and page tables ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "w", "p", "ws", "need", "first"),
    [
        (0, 512, 64, 0, 0, 0),
        (1, 512, 64, 0, 1, 0),
        (512, 512, 64, 0, 8, 0),
        (513, 512, 64, 1, 9, 0),
        (575, 512, 64, 63, 9, 0),
        (576, 512, 64, 64, 9, 1),
        (81_920, 512, 64, 81_408, 1280, 1272),
        (100, 40, 16, 60, 7, 3),
    ],
)
def test_window_helpers(n: int, w: int, p: int, ws: int, need: int, first: int) -> None:
    assert window_start(n, w) == ws
    assert pages_needed(n, p) == need
    assert first_window_page(n, w, p) == first


def _layout(window: int = 40, page: int = 16, full_pages: int = 40, window_pages: int = 5):
    return PoolLayout(small_model(window), PoolTopology(8, page), full_pages, window_pages)


def test_request_pages_of_flattens_to_int64() -> None:
    rp = RequestPages.of([[1, 2], [3, 4]], (7,))
    assert rp.full.dtype == np.int64 and rp.full.tolist() == [1, 2, 3, 4]
    assert rp.window.tolist() == [7]


@pytest.mark.parametrize(
    ("seq_len", "n_full", "n_win"),
    [(0, 0, 0), (1, 1, 1), (16, 1, 1), (17, 2, 2), (40, 3, 3), (41, 3, 3), (60, 4, 3),
     (64, 4, 3), (65, 5, 4), (100, 7, 4), (300, 19, 3)],
)  # fmt: skip
def test_request_pages_exact_cover_is_accepted(seq_len: int, n_full: int, n_win: int) -> None:
    lay = _layout()
    RequestPages.of(np.arange(n_full)[::-1], np.arange(n_win)).check("src", lay, seq_len)
    for side in ("src", "dst"):
        for df, dw, name in ((1, 0, "full"), (0, 1, "window")):
            bad = RequestPages.of(np.arange(n_full + df), np.arange(n_win + dw))
            with pytest.raises(TransferPlanError, match=rf"{side}_pages\.{name}") as info:
                bad.check(side, lay, seq_len)
            assert f"seq_len {seq_len}" in str(info.value)
            if n_full + n_win:
                short = RequestPages.of(np.arange(max(0, n_full - df)), np.arange(n_win - dw))
                if len(short.full) != n_full or len(short.window) != n_win:
                    with pytest.raises(TransferPlanError, match=rf"{side}_pages\.{name}"):
                        short.check(side, lay, seq_len)


@pytest.mark.parametrize(
    ("full", "window", "field"),
    [
        ([0, 1, 40], [0, 1, 2], "src_pages.full"),
        ([0, -1, 2], [0, 1, 2], "src_pages.full"),
        ([0, 1, 2], [0, 1, 5], "src_pages.window"),
        ([0, 1, 2], [-3, 1, 2], "src_pages.window"),
        ([0, 1, 1], [0, 1, 2], "src_pages.full"),
        ([0, 1, 2], [4, 4, 2], "src_pages.window"),
    ],
)
def test_request_pages_range_and_duplicates(full: list[int], window: list[int], field: str) -> None:
    lay = _layout()  # 40 full pages, 5 window pages; seq_len 40 needs 3 and 3
    with pytest.raises(TransferPlanError) as info:
        RequestPages.of(full, window).check("src", lay, 40)
    assert field in str(info.value)
    assert isinstance(info.value, KVTransferError) and isinstance(info.value, ValueError)
    with pytest.raises(TransferPlanError, match=field.replace("src", "dst").replace(".", r"\.")):
        RequestPages.of(full, window).check("dst", lay, 40)


def test_request_pages_range_message_gives_the_limit() -> None:
    with pytest.raises(TransferPlanError, match=r"\[0, 5\)"):
        RequestPages.of([0, 1, 2], [0, 1, 5]).check("src", _layout(), 40)
