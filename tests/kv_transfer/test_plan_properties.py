"""Heterogeneous-TP transfer plans, checked byte for byte against an independent oracle.

The oracle knows only the documented layout (topology.py's module docstring): per rank one
region `[full-attention layers][sliding layers]`, each layer `[K pages][V pages]`, each page HND
`[local_heads, page_size, head_dim]` or NHD `[page_size, local_heads, head_dim]`, and DESIGN.md
§1's head ownership. It never calls the planner's offset helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from beamserve.kv_transfer.errors import KVTransferError, TransferPlanError
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.kv_transfer.plan import (
    PairDescriptors,
    TransferPlan,
    bytes_minimum,
    check_pair,
    plan_transfer,
)
from beamserve.kv_transfer.topology import (
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

KV_HEADS = 8
TPS = (1, 2, 4, 8, 16)
TP_PAIRS = [(a, b) for a in TPS for b in TPS if max(a, b) % min(a, b) == 0]
EQUAL_HEAD_PAIRS = tuple(
    (a, b) for a, b in TP_PAIRS if max(1, KV_HEADS // a) == max(1, KV_HEADS // b)
)
SENTINEL = 0xC3


def small_model(window: int) -> BeamModelConfig:
    """Beam-shaped but tiny: 7 layers (full at 2, 5, 6), GQA 16/8, head_dim 4."""
    return BeamModelConfig(
        num_hidden_layers=7,
        layer_types=beam_layer_types(7, full_every=3),
        sliding_window=window,
        num_attention_heads=16,
        num_key_value_heads=KV_HEADS,
        head_dim=4,
    )


# --- the oracle ----------------------------------------------------------------------------


def owned_heads(tp: int, rank: int, k: int = KV_HEADS) -> list[int]:
    """DESIGN.md §1: [r·k/t, (r+1)·k/t) for t ≤ k, else head r·k // t."""
    return list(range(rank * k // tp, (rank + 1) * k // tp)) if tp <= k else [rank * k // tp]


@dataclass(frozen=True)
class Side:
    """One pool as the oracle sees it, plus the request's page tables on it."""

    model: BeamModelConfig
    tp: int
    page: int
    row: int  # bytes per (token, head)
    nhd: bool
    full_pages: int
    window_pages: int
    full_table: np.ndarray
    window_table: np.ndarray

    @property
    def heads(self) -> int:
        return max(1, KV_HEADS // self.tp)

    @property
    def page_bytes(self) -> int:
        return self.heads * self.page * self.row

    def layer_base(self, layer: int) -> int:
        off = 0
        m = self.model
        order = [*m.full_layers, *m.sliding_layers]
        for other in order:
            if other == layer:
                return off
            pages = self.full_pages if other in m.full_layers else self.window_pages
            off += 2 * pages * self.page_bytes
        raise AssertionError(layer)

    @property
    def region_bytes(self) -> int:
        m = self.model
        pages = len(m.full_layers) * self.full_pages + len(m.sliding_layers) * self.window_pages
        return 2 * pages * self.page_bytes

    def offset(self, layer: int, kv: int, phys: np.ndarray, j: int, slot: np.ndarray):
        """Byte offset of (layer, kv, physical page, local head j, slot)."""
        m, P = self.model, self.page
        pages = self.full_pages if layer in m.full_layers else self.window_pages
        inner = slot * self.heads + j if self.nhd else j * P + slot
        base = self.layer_base(layer) + kv * pages * self.page_bytes + phys * self.page_bytes
        return base + inner * self.row

    def row_offsets(
        self, layer: int, kv: int, j: int, tokens: np.ndarray, seq_len: int
    ) -> np.ndarray:
        """Byte offset of (layer, kv, local head j, token) for tokens of a `seq_len` request."""
        m, P = self.model, self.page
        if layer in m.full_layers:
            phys = self.full_table[tokens // P]
        else:
            first = max(0, seq_len - m.sliding_window) // P
            phys = self.window_table[tokens // P - first]
        return self.offset(layer, kv, phys, j, tokens % P)


def row_content(layer: np.ndarray | int, kv: int, head: int, tokens: np.ndarray, row: int):
    """Distinct, non-zero bytes for every (layer, K/V, global head, token) row."""
    ids = ((((np.int64(layer) * 2 + kv) * KV_HEADS + head) << 16) + tokens + 1).astype("<u8")
    raw = ids.view(np.uint8).reshape(-1, 8)
    return raw[:, :row] if row <= 8 else np.tile(raw, (1, -(-row // 8)))[:, :row]


def byte_index(offsets: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
    """Flat byte indices of the ranges [offsets[i], offsets[i] + lengths[i])."""
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), offsets.shape)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(total, dtype=np.int64)


def stored_tokens(side: Side, layer: int, seq_len: int) -> np.ndarray:
    """Tokens the pool physically holds in the request's pages for `layer`."""
    m, P = side.model, side.page
    if layer in m.full_layers:
        return np.arange(seq_len, dtype=np.int64)
    first = max(0, seq_len - m.sliding_window) // P
    return np.arange(first * P, seq_len, dtype=np.int64)


def needed_tokens(model: BeamModelConfig, layer: int, seq_len: int) -> np.ndarray:
    if layer in model.full_layers:
        return np.arange(seq_len, dtype=np.int64)
    return np.arange(max(0, seq_len - model.sliding_window), seq_len, dtype=np.int64)


def fill_source(side: Side, rank: int, seq_len: int, rng: np.random.Generator):
    """Garbage everywhere, then the true row for every token the rank holds in the request's
    pages (including the stale head of the first window page). Returns (region, needed mask)."""
    region = rng.integers(0, 256, side.region_bytes, dtype=np.uint8)
    needed = np.zeros(side.region_bytes, dtype=bool)
    for layer in range(side.model.num_hidden_layers):
        held = stored_tokens(side, layer, seq_len)
        want = needed_tokens(side.model, layer, seq_len)
        for kv in (0, 1):
            for j, h in enumerate(owned_heads(side.tp, rank)):
                if len(held):
                    off = side.row_offsets(layer, kv, j, held, seq_len)
                    region[byte_index(off, side.row)] = row_content(
                        layer, kv, h, held, side.row
                    ).reshape(-1)
                if len(want):
                    off = side.row_offsets(layer, kv, j, want, seq_len)
                    needed[byte_index(off, side.row)] = True
    return region, needed


def expected_destination(side: Side, rank: int, seq_len: int):
    """The destination region after a correct transfer, and the mask of needed bytes."""
    region = np.full(side.region_bytes, SENTINEL, dtype=np.uint8)
    needed = np.zeros(side.region_bytes, dtype=bool)
    for layer in range(side.model.num_hidden_layers):
        want = needed_tokens(side.model, layer, seq_len)
        if not len(want):
            continue
        for kv in (0, 1):
            for j, h in enumerate(owned_heads(side.tp, rank)):
                idx = byte_index(side.row_offsets(layer, kv, j, want, seq_len), side.row)
                assert not needed[idx].any(), "oracle layout overlaps itself"
                region[idx] = row_content(layer, kv, h, want, side.row).reshape(-1)
                needed[idx] = True
    return region, needed


# --- strategies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    model: BeamModelConfig
    seq_len: int
    src: PoolLayout
    dst: PoolLayout
    src_pages: RequestPages
    dst_pages: RequestPages
    src_side: Side
    dst_side: Side
    seed: int


def _table(draw: st.DrawFn, pool: int, need: int) -> np.ndarray:
    if draw(st.booleans()):  # contiguous, anywhere in the pool
        start = draw(st.integers(0, pool - need))
        return np.arange(start, start + need, dtype=np.int64)
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).permutation(pool)[:need].astype(np.int64)


@st.composite
def cases(
    draw: st.DrawFn,
    layouts: tuple[KVLayout, ...] = (KVLayout.HND, KVLayout.NHD),
    pairs: tuple[tuple[int, int], ...] = tuple(TP_PAIRS),
) -> Case:
    window = draw(st.sampled_from([16, 40, 64]))
    P = draw(st.sampled_from([16, 32, 64]))
    s_tp, d_tp = draw(st.sampled_from(pairs))
    dtype = draw(st.sampled_from(list(KVDtype)))
    equal_heads = max(1, KV_HEADS // s_tp) == max(1, KV_HEADS // d_tp)
    layout = draw(st.sampled_from([x for x in layouts if x is KVLayout.HND or equal_heads]))
    w = window
    special = sorted(
        {0, 1, 2, w - 1, w, w + 1, P - 1, P, P + 1, 2 * P, w + P - 1, w + P, w + P + 1}
        | {k * P + e for k in (3, 5) for e in (-1, 0, 1)}
        | {w + 3 * P + 1, 257, 320, 383, 384, 385, 449}
    )
    seq_len = draw(st.one_of(st.sampled_from(special), st.integers(0, 450)))
    model = small_model(window)

    need_full = -(-seq_len // P)
    need_win = 0 if seq_len == 0 else need_full - max(0, seq_len - window) // P
    sides = []
    for tp in (s_tp, d_tp):
        full_pages = max(1, need_full + draw(st.integers(0, 4)))
        window_pages = max(1, need_win + draw(st.integers(0, 3)))
        topo = PoolTopology(tp, P, dtype, layout)
        lay = PoolLayout(model, topo, full_pages, window_pages)
        ft, wt = _table(draw, full_pages, need_full), _table(draw, window_pages, need_win)
        side = Side(
            model, tp, P, 4 * dtype.nbytes, layout is KVLayout.NHD, full_pages, window_pages, ft, wt
        )
        sides.append((lay, RequestPages.of(ft, wt), side))
    (src, sp, ss), (dst, dp, ds) = sides
    return Case(model, seq_len, src, dst, sp, dp, ss, ds, draw(st.integers(0, 2**32 - 1)))


# --- applying a plan -----------------------------------------------------------------------


def apply_plan(case: Case, plan: TransferPlan, src_regions, src_needed):
    """Copy every descriptor; return destination regions and per-byte write counts."""
    dst_regions = [
        np.full(case.dst_side.region_bytes, SENTINEL, dtype=np.uint8)
        for _ in range(case.dst_side.tp)
    ]
    cover = [np.zeros(case.dst_side.region_bytes + 1, dtype=np.int64) for _ in dst_regions]
    for p in plan.pairs:
        assert 0 <= p.src_rank < case.src_side.tp and 0 <= p.dst_rank < case.dst_side.tp
        assert p.src_offsets.shape == p.dst_offsets.shape == p.lengths.shape
        assert (p.lengths > 0).all()
        assert (p.src_offsets >= 0).all() and (p.dst_offsets >= 0).all()
        assert (p.src_offsets + p.lengths <= case.src_side.region_bytes).all()
        assert (p.dst_offsets + p.lengths <= case.dst_side.region_bytes).all()
        s_idx = byte_index(p.src_offsets, p.lengths)
        d_idx = byte_index(p.dst_offsets, p.lengths)
        # (c) reads lie in the request's pages, on needed token slots of heads the rank holds
        assert src_needed[p.src_rank][s_idx].all(), "read outside the needed source rows"
        dst_regions[p.dst_rank][d_idx] = src_regions[p.src_rank][s_idx]
        # (b) coverage through a difference array
        np.add.at(cover[p.dst_rank], p.dst_offsets, 1)
        np.add.at(cover[p.dst_rank], p.dst_offsets + p.lengths, -1)
    return dst_regions, [np.cumsum(c)[:-1] for c in cover]


def formula_bytes(case: Case) -> int:
    """Σ over dst ranks of 2·local_heads·row·(n_full·seq_len + n_sliding·min(seq_len, window))."""
    m, d = case.model, case.dst_side
    per_rank = (
        2
        * d.heads
        * d.row
        * (
            len(m.full_layers) * case.seq_len
            + len(m.sliding_layers) * min(case.seq_len, m.sliding_window)
        )
    )
    return d.tp * per_rank


def check_coalesced(p: PairDescriptors) -> None:
    so, do, n = p.src_offsets, p.dst_offsets, p.lengths
    both = (so[:-1] + n[:-1] == so[1:]) & (do[:-1] + n[:-1] == do[1:])
    assert not both.any(), f"pair {p.src_rank}->{p.dst_rank}: uncoalesced neighbours"


# --- the core property ---------------------------------------------------------------------


def check_case(case: Case) -> TransferPlan:
    plan = plan_transfer(case.src, case.dst, case.seq_len, case.src_pages, case.dst_pages)
    rng = np.random.default_rng(case.seed)
    src = [fill_source(case.src_side, r, case.seq_len, rng) for r in range(case.src_side.tp)]
    src_regions = [s[0] for s in src]
    src_needed = [s[1] for s in src]
    dst_regions, cover = apply_plan(case, plan, src_regions, src_needed)

    # (g) pairs are unique, sorted, non-empty and fully coalesced
    keys = [(p.src_rank, p.dst_rank) for p in plan.pairs]
    assert keys == sorted(set(keys))
    for p in plan.pairs:
        assert p.count > 0
        check_coalesced(p)

    for d in range(case.dst_side.tp):
        want, needed = expected_destination(case.dst_side, d, case.seq_len)
        # (b) each byte written at most once, exactly the needed ones
        assert cover[d].max(initial=0) <= 1, f"dst rank {d}: a byte is written twice"
        assert np.array_equal(cover[d] == 1, needed), f"dst rank {d}: wrong bytes written"
        # (a) every needed row holds the owning source's bytes; (b) the rest keeps the sentinel
        if not np.array_equal(dst_regions[d], want):
            bad = np.flatnonzero(dst_regions[d] != want)
            raise AssertionError(f"dst rank {d}: {len(bad)} wrong bytes, first at {bad[0]}")
        # (c)/(e) per layer: only the layer's needed tokens arrive (window only on sliding)
        for layer in range(case.model.num_hidden_layers):
            base = case.dst_side.layer_base(layer)
            pages = (
                case.dst_side.full_pages
                if layer in case.model.full_layers
                else case.dst_side.window_pages
            )
            span = 2 * pages * case.dst_side.page_bytes
            got = int(cover[d][base : base + span].sum())
            n_tok = len(needed_tokens(case.model, layer, case.seq_len))
            assert got == 2 * case.dst_side.heads * case.dst_side.row * n_tok

    # (d) byte totals
    assert plan.bytes_moved == bytes_minimum(case.dst, case.seq_len) == formula_bytes(case)
    assert sum(int(c.sum()) for c in cover) == plan.bytes_moved
    for d in range(case.dst_side.tp):
        assert sum(p.nbytes for p in plan.for_dst(d)) == formula_bytes(case) // case.dst_side.tp

    # (f) replicated source heads: every replica is read, load spread evenly
    if case.src_side.tp > KV_HEADS and case.seq_len > 0:
        check_replica_balance(case.src, case.seq_len, plan)
    return plan


def check_replica_balance(src: PoolLayout, seq_len: int, plan: TransferPlan) -> None:
    """Every source rank is read; per layer group, per-rank bytes differ by ≤ one (layer, K/V)
    buffer of one head (the unit a replica is chosen for)."""
    m, row = src.model, src.row_bytes
    t = src.topology.tp_size
    full_end = int(min(src.layer_base[list(m.sliding_layers)], default=src.region_bytes))
    per_group = np.zeros((2, t), dtype=np.int64)
    for p in plan.pairs:
        in_full = p.src_offsets < full_end
        per_group[0, p.src_rank] += int(p.lengths[in_full].sum())
        per_group[1, p.src_rank] += int(p.lengths[~in_full].sum())
    totals = per_group.sum(axis=0)
    # A replica is chosen per (destination rank, layer, K/V): all of them can be read only when
    # some layer group has at least that many choices per head.
    reps = t // m.num_key_value_heads
    sharing = max(1, plan.dst.topology.tp_size // m.num_key_value_heads)
    choices = max(2 * len(g) * sharing for g in (m.full_layers, m.sliding_layers))
    if choices >= reps:
        assert (totals > 0).all(), f"replicas never read: {np.flatnonzero(totals == 0).tolist()}"
    buffers = (row * seq_len, row * min(seq_len, m.sliding_window))
    for g, buf in enumerate(buffers):
        spread = int(per_group[g].max() - per_group[g].min())
        assert spread <= buf, f"group {g}: replica load {per_group[g].tolist()} (buffer {buf})"


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_plan_moves_exactly_the_needed_bytes(case: Case) -> None:
    check_case(case)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(layouts=(KVLayout.NHD,), pairs=EQUAL_HEAD_PAIRS))
def test_plan_nhd_equal_heads(case: Case) -> None:
    assert case.src.topology.layout is KVLayout.NHD
    check_case(case)


@pytest.mark.parametrize(("s_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("seq_len", [1, 40, 105])
def test_every_tp_pair_both_directions(s_tp: int, d_tp: int, seq_len: int) -> None:
    """Deterministic sweep over all TP pairs, with scattered (reversed, interleaved) pages."""
    window, P = 40, 16
    model = small_model(window)
    need_full = -(-seq_len // P)
    need_win = need_full - max(0, seq_len - window) // P
    src_full = np.arange(need_full)[::-1] * 2 + 1  # odd pages, reversed
    dst_full = np.arange(need_full) * 3  # every third page
    src_win = np.arange(need_win)[::-1] + 1
    dst_win = np.arange(need_win) * 2
    sides = []
    for tp, ft, wt in ((s_tp, src_full, src_win), (d_tp, dst_full, dst_win)):
        fp, wp = int(ft.max()) + 2, int(wt.max()) + 1
        lay = PoolLayout(model, PoolTopology(tp, P, KVDtype.BF16, KVLayout.HND), fp, wp)
        side = Side(model, tp, P, 8, False, fp, wp, ft.astype(np.int64), wt.astype(np.int64))
        sides.append((lay, RequestPages.of(ft, wt), side))
    (src, sp, ss), (dst, dp, ds) = sides
    plan = check_case(Case(model, seq_len, src, dst, sp, dp, ss, ds, seed=s_tp * 100 + d_tp))
    assert plan.src.topology.tp_size == s_tp and plan.dst.topology.tp_size == d_tp


@settings(max_examples=30, deadline=None)
@given(
    s_tp=st.sampled_from([16, 32, 64]),
    d_tp=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    n_layers=st.integers(2, 13),
    full_every=st.integers(2, 6),
    seq_len=st.integers(1, 300),
    window=st.sampled_from([16, 40, 64]),
)
def test_replicas_share_the_load(
    s_tp: int, d_tp: int, n_layers: int, full_every: int, seq_len: int, window: int
) -> None:
    """(f) for wider replication too, and layer counts with odd numbers of full layers."""
    model = BeamModelConfig(
        num_hidden_layers=n_layers,
        layer_types=beam_layer_types(n_layers, full_every),
        sliding_window=window,
        num_attention_heads=16,
        num_key_value_heads=KV_HEADS,
        head_dim=4,
    )
    P = 16
    need_full = -(-seq_len // P)
    need_win = need_full - max(0, seq_len - window) // P
    src = PoolLayout(model, PoolTopology(s_tp, P), need_full, need_win)
    dst = PoolLayout(model, PoolTopology(d_tp, P), need_full, need_win)
    pages = RequestPages.of(np.arange(need_full), np.arange(need_win))
    plan = plan_transfer(src, dst, seq_len, pages, pages)
    assert plan.bytes_moved == bytes_minimum(dst, seq_len)
    check_replica_balance(src, seq_len, plan)


# --- Beam 1.0 at agent-turn scale ----------------------------------------------------------


def _beam_plan(s_tp: int, d_tp: int, seq_len: int, dtype: KVDtype = KVDtype.BF16):
    m = beam_1_0()
    P = 64
    need_full = -(-seq_len // P)
    need_win = need_full - max(0, seq_len - m.sliding_window) // P
    src = PoolLayout(m, PoolTopology(s_tp, P, dtype), need_full + 3, need_win + 1)
    dst = PoolLayout(m, PoolTopology(d_tp, P, dtype), need_full, need_win)
    rng = np.random.default_rng(seq_len)
    sp = RequestPages.of(
        rng.permutation(need_full + 3)[:need_full], rng.permutation(need_win + 1)[:need_win]
    )
    dp = RequestPages.of(np.arange(need_full), np.arange(need_win))
    return plan_transfer(src, dst, seq_len, sp, dp)


def test_beam_1_0_80k_tokens_8_to_4() -> None:
    seq_len = 81_920
    # DESIGN.md §1 by hand: full-attention KV is 9·2·8·128·2 B per token over all 8 heads;
    # the 43 sliding layers hold 43·2·8·128·2·512 B per request.
    full_per_token = 9 * 2 * 8 * 128 * 2
    assert full_per_token == 36_864
    window_bytes = 43 * 2 * 8 * 128 * 2 * 512
    # = 86 MiB. (DESIGN.md's prose says "≈ 43 MiB", half of its own product: the product —
    # K and V, bf16 — is what a request's window state occupies, and what must move.)
    assert window_bytes == 90_177_536 == 86 * 2**20
    total = seq_len * full_per_token + window_bytes
    assert total == 3_110_076_416

    plan = _beam_plan(8, 4, seq_len)
    assert plan.bytes_moved == bytes_minimum(plan.dst, seq_len) == total
    # each decode rank owns 2 of the 8 heads: a quarter; each prefill rank holds one head: an eighth
    for d in range(4):
        assert sum(p.nbytes for p in plan.for_dst(d)) == total * 2 // 8
    assert plan.bytes_per_src_rank() == {s: total // 8 for s in range(8)}
    # rank s's head goes to decode rank s // 2 only
    assert {(p.src_rank, p.dst_rank) for p in plan.pairs} == {(s, s // 2) for s in range(8)}


@pytest.mark.parametrize(
    ("s_tp", "d_tp", "dtype", "copies"),
    [
        (4, 8, KVDtype.BF16, 1),
        (16, 8, KVDtype.BF16, 1),
        (8, 16, KVDtype.BF16, 2),  # decode replicates every head twice
        (8, 4, KVDtype.FP8_E4M3, 1),
    ],
)
def test_beam_1_0_80k_other_pairs(s_tp: int, d_tp: int, dtype: KVDtype, copies: int) -> None:
    seq_len = 81_920
    total = seq_len * 36_864 + 43 * 2 * 8 * 128 * 2 * 512
    total = total * copies // (2 // dtype.nbytes)
    plan = _beam_plan(s_tp, d_tp, seq_len, dtype)
    assert plan.bytes_moved == bytes_minimum(plan.dst, seq_len) == total
    per_src = plan.bytes_per_src_rank()
    assert sorted(per_src) == list(range(s_tp))
    if s_tp > 8:  # both replicas of every head serve exactly half
        assert set(per_src.values()) == {total // s_tp}


# --- invalid pairs and requests ------------------------------------------------------------


def _pool(model=None, tp=8, page=64, dtype=KVDtype.BF16, layout=KVLayout.HND) -> PoolLayout:
    return PoolLayout(model or small_model(40), PoolTopology(tp, page, dtype, layout), 8, 4)


def _plan_error(src: PoolLayout, dst: PoolLayout, *words: str) -> str:
    with pytest.raises(TransferPlanError) as info:
        check_pair(src, dst)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert isinstance(info.value, KVTransferError) and isinstance(info.value, ValueError)
    # plan_transfer refuses the same pair, before looking at page tables
    empty = RequestPages.of([], [])
    with pytest.raises(TransferPlanError, match=words[0]):
        plan_transfer(src, dst, 0, empty, empty)
    return msg


def test_page_size_mismatch() -> None:
    _plan_error(_pool(page=64), _pool(page=16), "page_size", "64", "16", "32")


def test_kv_dtype_mismatch() -> None:
    _plan_error(_pool(), _pool(dtype=KVDtype.FP8_E4M3), "kv_dtype", "bf16", "fp8_e4m3")


def test_layout_mismatch() -> None:
    _plan_error(_pool(layout=KVLayout.NHD), _pool(), "layout", "NHD", "HND")


@pytest.mark.parametrize(("s_tp", "d_tp"), [(8, 4), (4, 8), (1, 2), (16, 4), (2, 16)])
def test_nhd_with_unequal_heads_per_rank(s_tp: int, d_tp: int) -> None:
    _plan_error(
        _pool(tp=s_tp, layout=KVLayout.NHD), _pool(tp=d_tp, layout=KVLayout.NHD), "layout", "HND"
    )


@pytest.mark.parametrize(("s_tp", "d_tp"), [(8, 8), (16, 8), (8, 16), (16, 16), (2, 2)])
def test_nhd_with_equal_heads_per_rank_is_allowed(s_tp: int, d_tp: int) -> None:
    check_pair(_pool(tp=s_tp, layout=KVLayout.NHD), _pool(tp=d_tp, layout=KVLayout.NHD))


@pytest.mark.parametrize(("s_tp", "d_tp"), [(16, 24), (24, 16), (32, 24), (24, 64)])
def test_tp_sizes_that_do_not_divide(s_tp: int, d_tp: int) -> None:
    msg = _plan_error(_pool(tp=s_tp), _pool(tp=d_tp), "tp_size", str(s_tp), str(d_tp))
    # valid choices are offered, and each one divides (or is a multiple of) the other side
    choices = [int(x) for x in msg.rsplit("[", 1)[1].rstrip("]").split(",")]
    lo, hi = min(s_tp, d_tp), max(s_tp, d_tp)
    assert choices and lo not in choices
    for c in choices:
        assert hi % c == 0 or c % hi == 0
        assert KV_HEADS % c == 0 or c % KV_HEADS == 0


@pytest.mark.parametrize(
    "other",
    [
        small_model(64),  # sliding_window differs
        BeamModelConfig(7, beam_layer_types(7, full_every=2), 40, 16, 8, 4),
        BeamModelConfig(7, beam_layer_types(7, full_every=3), 40, 32, 8, 4),
        BeamModelConfig(7, beam_layer_types(7, full_every=3), 40, 16, 8, 8),
    ],
)
def test_different_models(other: BeamModelConfig) -> None:
    _plan_error(_pool(), _pool(model=other), "model")


def test_negative_seq_len() -> None:
    empty = RequestPages.of([], [])
    with pytest.raises(TransferPlanError, match="seq_len"):
        plan_transfer(_pool(), _pool(), -1, empty, empty)


def test_seq_len_zero_is_an_empty_plan() -> None:
    empty = RequestPages.of([], [])
    for s_tp, d_tp in ((8, 4), (16, 1), (1, 16)):
        plan = plan_transfer(_pool(tp=s_tp), _pool(tp=d_tp), 0, empty, empty)
        assert plan.pairs == () and plan.seq_len == 0
        assert plan.bytes_moved == 0 == bytes_minimum(plan.dst, 0)
        assert plan.descriptors == 0 and plan.bytes_per_src_rank() == {}
        assert plan.for_dst(0) == []


@pytest.mark.parametrize(
    ("sp", "dp", "field"),
    [
        (([0, 1], [0, 1]), ([0], [0]), "src_pages.full"),
        (([0], [0, 1]), ([0], [0]), "src_pages.window"),
        (([0], [0]), ([0], [4]), "dst_pages.window"),
        (([0], [0]), ([9], [0]), "dst_pages.full"),
    ],
)
def test_bad_page_tables_are_refused(sp, dp, field: str) -> None:
    with pytest.raises(TransferPlanError, match=field.replace(".", r"\.")):
        plan_transfer(_pool(), _pool(tp=4), 10, RequestPages.of(*sp), RequestPages.of(*dp))


# --- the oracle itself ---------------------------------------------------------------------


@example(window=40, page=16, tp=2, fp8=False, nhd=False)
@settings(max_examples=15, deadline=None)
@given(
    window=st.sampled_from([16, 40, 64]),
    page=st.sampled_from([16, 32, 64]),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    fp8=st.booleans(),
    nhd=st.booleans(),
)
def test_oracle_agrees_with_token_offset(
    window: int, page: int, tp: int, fp8: bool, nhd: bool
) -> None:
    """The oracle's independent layout and PoolLayout.token_offset describe the same bytes."""
    m = small_model(window)
    dtype = KVDtype.FP8_E4M3 if fp8 else KVDtype.BF16
    lay = PoolLayout(m, PoolTopology(tp, page, dtype, KVLayout.NHD if nhd else KVLayout.HND), 3, 2)
    side = Side(m, tp, page, 4 * dtype.nbytes, nhd, 3, 2, np.arange(3), np.arange(2))
    assert side.region_bytes == lay.region_bytes
    for layer in range(m.num_hidden_layers):
        assert side.layer_base(layer) == int(lay.layer_base[layer])
        n_pages = 3 if layer in m.full_layers else 2
        slots = np.arange(page, dtype=np.int64)
        for kv in (0, 1):
            for j in range(side.heads):
                for pg in range(n_pages):
                    mine = side.offset(layer, kv, np.int64(pg), j, slots).tolist()
                    theirs = [lay.token_offset(layer, kv, pg, j, s) for s in range(page)]
                    assert mine == theirs
