"""The first planner (2026-12-01), kept as the oracle that `plan.plan_transfer` must match
array for array (tests/kv_transfer/test_plan_fast.py) and as the "before" of
`beamserve bench kv-plan`. Not used on any transfer path: it loops per destination rank and
layer group and selects per source rank with a mask over every descriptor (≈ 20–30 ms at 80K
tokens of Beam 1.0 on a 2-core host).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.plan import (
    PairDescriptors,
    TransferPlan,
    _groups,
    _Tokens,
    check_pair,
)
from beamserve.kv_transfer.topology import (
    IntArray,
    KVLayout,
    PoolLayout,
    RequestPages,
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
