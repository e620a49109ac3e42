"""Heterogeneous-TP transfer plans: which bytes each decode rank reads from which prefill rank.

`plan_transfer` is pure: two pool layouts, a sequence length and both sides' page tables in,
per-(source rank, destination rank) descriptor lists out. Guarantees (property-tested):

* every destination byte the request needs is written exactly once: full-attention layers get
  every token of every head the destination rank owns; sliding layers only the last
  `sliding_window` tokens (partial pages are cut to the token, so nothing extra moves);
* nothing outside the request's pages is read or written;
* total bytes equal `bytes_minimum(dst, seq_len)`;
* a head that the source replicates (source TP > KV heads) is read from a replica chosen per
  (destination rank, layer), so replicas share the load;
* descriptors that are contiguous on both sides are coalesced.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.topology import (
    IntArray,
    KVLayout,
    PoolLayout,
    RequestPages,
    first_window_page,
    pages_needed,
    window_start,
)


@dataclass(frozen=True)
class PairDescriptors:
    """Descriptors for one (source rank, destination rank): byte offsets into each rank's region."""

    src_rank: int
    dst_rank: int
    src_offsets: IntArray
    dst_offsets: IntArray
    lengths: IntArray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @property
    def count(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class TransferPlan:
    src: PoolLayout
    dst: PoolLayout
    seq_len: int
    pairs: tuple[PairDescriptors, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(p.nbytes for p in self.pairs)

    @property
    def descriptors(self) -> int:
        return sum(p.count for p in self.pairs)

    def for_dst(self, dst_rank: int) -> list[PairDescriptors]:
        return [p for p in self.pairs if p.dst_rank == dst_rank]

    def bytes_per_src_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.pairs:
            out[p.src_rank] = out.get(p.src_rank, 0) + p.nbytes
        return out


def bytes_minimum(dst: PoolLayout, seq_len: int) -> int:
    """Bytes the destination pool must receive: its share of full-attention KV for every
    token plus its share of window KV (replicated heads count once per replica)."""
    m = dst.model
    heads = dst.topology.tp_size * dst.local_heads
    per_token = 2 * heads * dst.row_bytes
    return per_token * (
        len(m.full_layers) * seq_len + len(m.sliding_layers) * min(seq_len, m.sliding_window)
    )


def check_pair(src: PoolLayout, dst: PoolLayout) -> None:
    """Raise `TransferPlanError` naming the field and the valid choices for an invalid pair."""
    if src.model.fingerprint() != dst.model.fingerprint():
        raise TransferPlanError(
            "model: prefill and decode describe different models (fingerprints "
            f"{src.model.fingerprint()[:12]} ≠ {dst.model.fingerprint()[:12]}); "
            "serve the same checkpoint on both pools"
        )
    st, dt = src.topology, dst.topology
    if st.page_size != dt.page_size:
        raise TransferPlanError(
            f"page_size: prefill uses {st.page_size}, decode uses {dt.page_size}; "
            f"set both pools to the same page_size (16, 32 or 64)"
        )
    if st.kv_dtype != dt.kv_dtype:
        raise TransferPlanError(
            f"kv_dtype: prefill uses {st.kv_dtype.value}, decode uses {dt.kv_dtype.value}; "
            "set both pools to the same kv_dtype (bf16 or fp8_e4m3)"
        )
    if st.layout != dt.layout:
        raise TransferPlanError(
            f"layout: prefill uses {st.layout.value}, decode uses {dt.layout.value}; "
            "use the same layout on both pools (HND recommended)"
        )
    a, b = st.tp_size, dt.tp_size
    if max(a, b) % min(a, b):
        lo, hi = min(a, b), max(a, b)
        ok = [
            d
            for d in range(1, 2 * hi + 1)
            if (hi % d == 0 or d % hi == 0)
            and (d % src.model.num_key_value_heads == 0 or src.model.num_key_value_heads % d == 0)
        ]
        side = "decode" if b == lo else "prefill"
        raise TransferPlanError(
            f"tp_size: {side} TP {lo} does not divide {'prefill' if side == 'decode' else 'decode'}"
            f" TP {hi}; choose {side} TP from {ok}"
        )
    if st.layout is KVLayout.NHD and src.local_heads != dst.local_heads:
        raise TransferPlanError(
            f"layout: NHD pages interleave heads per token, so a {src.local_heads}-head page "
            f"cannot be sliced into {dst.local_heads}-head pages; use layout HND on both "
            "pools, or equal TP sizes"
        )


def plan_transfer(
    src: PoolLayout,
    dst: PoolLayout,
    seq_len: int,
    src_pages: RequestPages,
    dst_pages: RequestPages,
) -> TransferPlan:
    """Plan the reads that move one request's KV from the `src` pool to the `dst` pool."""
    check_pair(src, dst)
    if seq_len < 0:
        raise TransferPlanError(f"seq_len: must be ≥ 0, got {seq_len}")
    src_pages.check("src", src, seq_len)
    dst_pages.check("dst", dst, seq_len)
    if seq_len == 0:
        return TransferPlan(src, dst, 0, ())

    chunks: dict[tuple[int, int], list[tuple[IntArray, IntArray, IntArray]]] = {}
    for d in range(dst.topology.tp_size):
        for group, spages, dpages, tokens in _groups(src, seq_len, src_pages, dst_pages):
            for s, so, do, n in _rank_group_descs(src, dst, d, group, spages, dpages, tokens):
                chunks.setdefault((s, d), []).append((so, do, n))

    pairs = []
    for (s, d), parts in sorted(chunks.items()):
        so = np.concatenate([p[0] for p in parts])
        do = np.concatenate([p[1] for p in parts])
        n = np.concatenate([p[2] for p in parts])
        pairs.append(PairDescriptors(s, d, *_coalesce(so, do, n)))
    return TransferPlan(src, dst, seq_len, tuple(pairs))


_Tokens = tuple[IntArray, IntArray]  # (first slot in page, token count) per logical page


def _groups(
    src: PoolLayout, seq_len: int, sp: RequestPages, dp: RequestPages
) -> Iterator[tuple[IntArray, IntArray, IntArray, _Tokens]]:
    m, P = src.model, src.topology.page_size
    n_pages = pages_needed(seq_len, P)
    if m.full_layers:
        logical = np.arange(n_pages, dtype=np.int64)
        yield np.array(m.full_layers), sp.full, dp.full, _token_spans(logical, 0, seq_len, P)
    if m.sliding_layers:
        first = first_window_page(seq_len, m.sliding_window, P)
        logical = np.arange(first, n_pages, dtype=np.int64)
        lo = window_start(seq_len, m.sliding_window)
        yield (
            np.array(m.sliding_layers),
            sp.window,
            dp.window,
            _token_spans(logical, lo, seq_len, P),
        )


def _token_spans(logical: IntArray, lo: int, hi: int, P: int) -> _Tokens:
    start = np.maximum(logical * P, lo)
    end = np.minimum((logical + 1) * P, hi)
    return start - logical * P, end - start


def _rank_group_descs(
    src: PoolLayout,
    dst: PoolLayout,
    d: int,
    layers: IntArray,
    spages: IntArray,
    dpages: IntArray,
    tokens: _Tokens,
) -> Iterator[tuple[int, IntArray, IntArray, IntArray]]:
    """Descriptors that destination rank `d` needs for one layer group, split by source rank.

    Built as arrays of shape (layers, K/V, pages, units) with units innermost, so that heads a
    source rank holds side by side come out adjacent and coalesce.
    """
    m, st, row = src.model, src.topology, src.row_bytes
    P = st.page_size
    slot0, count = tokens
    dheads = dst.topology.heads_of_rank(m, d)
    if st.layout is KVLayout.HND:
        units = [(h, j, 1) for j, h in enumerate(dheads)]
    else:  # NHD: equal heads per rank on both sides (check_pair), move whole token rows
        units = [(dheads[0], 0, dst.local_heads)]

    n_units = len(units)
    # Source rank per (layer, K/V, unit): replicas take turns along (layer, K/V), continuing
    # the count across destination ranks (offset d·2·layers, not d: destination ranks that
    # share a replicated head are consecutive, so one round-robin runs over all their reads),
    # so each replica serves an equal share (±1 buffer) of every destination rank's reads and of
    # the pool's.
    n_turns = 2 * len(layers)
    turn = (d * n_turns + 2 * np.arange(len(layers))[:, None] + np.arange(2)[None, :]).astype(
        np.int64
    )
    src_rank = np.empty((len(layers), 2, n_units), dtype=np.int64)
    src_j = np.empty(n_units, dtype=np.int64)
    dst_j = np.empty(n_units, dtype=np.int64)
    width = np.empty(n_units, dtype=np.int64)
    for u, (h, j, w) in enumerate(units):
        owners = np.array(st.ranks_of_head(m, h), dtype=np.int64)
        src_rank[:, :, u] = owners[turn % len(owners)]
        src_j[u] = h - st.heads_of_rank(m, int(owners[0])).start
        dst_j[u] = j
        width[u] = w

    if st.layout is KVLayout.HND:
        src_in = (src_j[None, :] * P + slot0[:, None]) * row
        dst_in = (dst_j[None, :] * P + slot0[:, None]) * row
        nbytes = np.broadcast_to(count[:, None] * row, src_in.shape)
    else:
        src_in = (slot0[:, None] * src.local_heads + src_j[None, :]) * row
        dst_in = (slot0[:, None] * dst.local_heads + dst_j[None, :]) * row
        nbytes = count[:, None] * width[None, :] * row

    kv = np.arange(2, dtype=np.int64)
    s_kv = np.array([src.kv_stride(int(layers[0]))], dtype=np.int64) * kv
    d_kv = np.array([dst.kv_stride(int(layers[0]))], dtype=np.int64) * kv
    s_off = (
        src.layer_base[layers][:, None, None, None]
        + s_kv[None, :, None, None]
        + (spages * src.page_bytes)[None, None, :, None]
        + src_in[None, None, :, :]
    )
    d_off = (
        dst.layer_base[layers][:, None, None, None]
        + d_kv[None, :, None, None]
        + (dpages * dst.page_bytes)[None, None, :, None]
        + dst_in[None, None, :, :]
    )
    shape = s_off.shape
    n_all = np.broadcast_to(nbytes[None, None, :, :], shape).reshape(-1)
    r_all = np.broadcast_to(src_rank[:, :, None, :], shape).reshape(-1)
    s_all, d_all = s_off.reshape(-1), d_off.reshape(-1)
    for s in np.unique(r_all):
        sel = r_all == s
        yield int(s), s_all[sel], d_all[sel], n_all[sel]


def _coalesce(so: IntArray, do: IntArray, n: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Merge neighbours that are contiguous on both sides (order is preserved)."""
    if len(n) < 2:
        return so, do, n
    ends_s, ends_d = so[:-1] + n[:-1], do[:-1] + n[:-1]
    brk = (so[1:] != ends_s) | (do[1:] != ends_d)
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    return so[starts], do[starts], np.add.reduceat(n, starts)
