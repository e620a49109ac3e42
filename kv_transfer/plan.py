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

import itertools
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
    # The page tables planned from (None for plans built by hand): with the layouts and
    # seq_len they determine the plan, so `staging.plan_digest` hashes them, not the arrays.
    src_pages: RequestPages | None = None
    dst_pages: RequestPages | None = None

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
    pieces = plan_pieces(src, dst, seq_len, src_pages, dst_pages)
    return assemble_plan(src, dst, seq_len, pieces, src_pages, dst_pages)


def assemble_plan(
    src: PoolLayout,
    dst: PoolLayout,
    seq_len: int,
    pieces: dict[tuple[int, int], list[PlanPiece]],
    src_pages: RequestPages | None = None,
    dst_pages: RequestPages | None = None,
) -> TransferPlan:
    """Write `plan_pieces`' factors out as each pair's coalesced descriptor arrays."""
    # One allocation for every pair's arrays (views of it): a fresh 4–5 MB block per plan
    # faults in as a few huge pages where 24 small ones faulted 4 KiB at a time (≈ 2 ms).
    keys = sorted(pieces)
    sizes = [sum(p.size for p in pieces[k]) for k in keys]
    block = np.empty((3, sum(sizes)), dtype=np.int64)
    pairs, at = [], 0
    for (s, d), size in zip(keys, sizes, strict=True):
        out = block[:, at : at + size]
        pairs.append(PairDescriptors(s, d, *_assemble(pieces[(s, d)], out[0], out[1], out[2])))
        at += size
    return TransferPlan(src, dst, seq_len, tuple(pairs), src_pages, dst_pages)


def plan_pieces(
    src: PoolLayout,
    dst: PoolLayout,
    seq_len: int,
    src_pages: RequestPages,
    dst_pages: RequestPages,
) -> dict[tuple[int, int], list[PlanPiece]]:
    """The plan as factors, per (source rank, destination rank): its pieces (one per layer
    group, full layers first), each a (layer, K/V) block base plus the block's coalesced
    runs. `plan_transfer` writes them out as descriptor arrays; `compact.compact_plan` keeps
    them as they are. Checks the pair, `seq_len` and both page tables (`TransferPlanError`)."""
    check_pair(src, dst)
    if seq_len < 0:
        raise TransferPlanError(f"seq_len: must be ≥ 0, got {seq_len}")
    src_pages.check("src", src, seq_len)
    dst_pages.check("dst", dst, seq_len)
    pieces: dict[tuple[int, int], list[PlanPiece]] = {}
    if seq_len == 0:
        return pieces
    # Pass 1: per (destination rank, layer group, source rank) a piece, held as small factors
    # (its descriptors are their broadcast sums); pass 2 writes each pair's arrays once.
    groups = list(_groups(src, seq_len, src_pages, dst_pages))
    if (
        src.topology.layout is KVLayout.HND
        and src.topology.tp_size <= src.model.num_key_value_heads
    ):
        # Every head has one source rank: all destination ranks at once, per layer group.
        for gi, (group, spages, dpages, tokens) in enumerate(groups):
            for s, d, piece in _hnd_pieces(src, dst, group, spages, dpages, tokens):
                parts = pieces.setdefault((s, d), [])
                assert len(parts) == gi  # full layers' piece first, as the general path
                parts.append(piece)
    else:
        for d in range(dst.topology.tp_size):
            for group, spages, dpages, tokens in groups:
                for s, piece in _rank_group_pieces(src, dst, d, group, spages, dpages, tokens):
                    pieces.setdefault((s, d), []).append(piece)
    return pieces


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


@dataclass(frozen=True)
class PlanPiece:
    """One (destination rank, layer group, source rank) run of descriptors, in plan order.

    Dense: descriptor (b, i) is `src_b[b] + src_i[i]` (and so on), b over (layer, K/V) blocks,
    i over the block's runs, already coalesced inside a block (the blocks differ only by a
    constant, so one block's merges are every block's). Masked (a source that replicates heads,
    so the serving replica changes along (layer, K/V)): the flat arrays, uncoalesced.
    """

    src_b: IntArray | None = None
    dst_b: IntArray | None = None
    src_i: IntArray | None = None
    dst_i: IntArray | None = None
    len_i: IntArray | None = None
    flat: tuple[IntArray, IntArray, IntArray] | None = None

    @property
    def size(self) -> int:
        if self.flat is not None:
            return len(self.flat[2])
        assert self.src_b is not None and self.src_i is not None
        return len(self.src_b) * len(self.src_i)

    def write(self, so: IntArray, do: IntArray, n: IntArray) -> None:
        if self.flat is not None:
            so[:], do[:], n[:] = self.flat
            return
        assert self.src_b is not None and self.dst_b is not None
        assert self.src_i is not None and self.dst_i is not None and self.len_i is not None
        shape = (len(self.src_b), len(self.src_i))
        np.add(self.src_b[:, None], self.src_i[None, :], out=so.reshape(shape))
        np.add(self.dst_b[:, None], self.dst_i[None, :], out=do.reshape(shape))
        np.copyto(n.reshape(shape), self.len_i[None, :])

    def ends(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """(src, dst, length) of the last descriptor and (src, dst) of the first."""
        if self.flat is not None:
            so, do, n = self.flat
            return (int(so[-1]), int(do[-1]), int(n[-1])), (int(so[0]), int(do[0]))
        assert self.src_b is not None and self.dst_b is not None
        assert self.src_i is not None and self.dst_i is not None and self.len_i is not None
        last = (
            int(self.src_b[-1] + self.src_i[-1]),
            int(self.dst_b[-1] + self.dst_i[-1]),
            int(self.len_i[-1]),
        )
        return last, (int(self.src_b[0] + self.src_i[0]), int(self.dst_b[0] + self.dst_i[0]))

    def blocks_touch(self) -> bool:
        """Whether a block's last run is contiguous (both sides) with the next block's first."""
        if self.flat is not None:
            return True  # unknown: the pair is coalesced as a whole
        assert self.src_b is not None and self.dst_b is not None
        assert self.src_i is not None and self.dst_i is not None and self.len_i is not None
        if len(self.src_b) < 2:
            return False
        gap_s = self.src_i[-1] + self.len_i[-1] - self.src_i[0]
        gap_d = self.dst_i[-1] + self.len_i[-1] - self.dst_i[0]
        return bool(
            (
                (self.src_b[1:] == self.src_b[:-1] + gap_s)
                & (self.dst_b[1:] == self.dst_b[:-1] + gap_d)
            ).any()
        )


def _assemble(
    parts: list[PlanPiece], so: IntArray, do: IntArray, n: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """One pair's coalesced descriptor arrays, written once from its pieces' factors into
    `so`/`do`/`n` (sized for the uncoalesced pieces)."""
    at = 0
    for p in parts:
        p.write(so[at : at + p.size], do[at : at + p.size], n[at : at + p.size])
        at += p.size
    # Runs are coalesced inside blocks already; merges across blocks or pieces are rare (a
    # K buffer's last page next to the V buffer's first, say) and then the pair is coalesced
    # whole (merging is associative, so the result is the same).
    again = any(p.blocks_touch() for p in parts)
    for prev, nxt in itertools.pairwise(parts):
        (ps, pd, pn), _ = prev.ends()
        _, (ns, nd) = nxt.ends()
        again |= ps + pn == ns and pd + pn == nd
    return _coalesce(so, do, n) if again else (so, do, n)


def _hnd_pieces(
    src: PoolLayout,
    dst: PoolLayout,
    layers: IntArray,
    spages: IntArray,
    dpages: IntArray,
    tokens: _Tokens,
) -> Iterator[tuple[int, int, PlanPiece]]:
    """`_rank_group_pieces` for every destination rank, HND pages, one source rank per head:
    the (pages × heads) offsets are computed once for the group, and each (source, destination)
    piece takes the columns of the heads both own (a contiguous range)."""
    m, row, P = src.model, src.row_bytes, src.topology.page_size
    k, s_per, d_tp = m.num_key_value_heads, src.local_heads, dst.topology.tp_size
    slot0, count = tokens
    heads = np.arange(k, dtype=np.int64)
    # A head's index inside its rank's pages: h mod heads-per-rank (0 where a rank holds one).
    s_local = heads % s_per
    d_local = heads % dst.local_heads
    src_ph = (spages * src.page_bytes)[:, None] + (s_local[None, :] * P + slot0[:, None]) * row
    dst_ph = (dpages * dst.page_bytes)[:, None] + (d_local[None, :] * P + slot0[:, None]) * row
    run = count * row
    kv = np.arange(2, dtype=np.int64)
    first = int(layers[0])
    src_b = (src.layer_base[layers][:, None] + src.kv_stride(first) * kv[None, :]).reshape(-1)
    dst_b = (dst.layer_base[layers][:, None] + dst.kv_stride(first) * kv[None, :]).reshape(-1)
    for d in range(d_tp):
        dh = dst.topology.heads_of_rank(m, d)
        for s in range(dh.start // s_per, (dh.stop - 1) // s_per + 1):
            lo, hi = max(dh.start, s * s_per), min(dh.stop, (s + 1) * s_per)
            w = hi - lo
            piece = PlanPiece(
                src_b,
                dst_b,
                *_coalesce(
                    src_ph[:, lo:hi].reshape(-1),
                    dst_ph[:, lo:hi].reshape(-1),
                    np.repeat(run, w) if w > 1 else run,
                ),
            )
            yield s, d, piece


def _rank_group_pieces(
    src: PoolLayout,
    dst: PoolLayout,
    d: int,
    layers: IntArray,
    spages: IntArray,
    dpages: IntArray,
    tokens: _Tokens,
) -> Iterator[tuple[int, PlanPiece]]:
    """Descriptors that destination rank `d` needs for one layer group, split by source rank
    (ascending).

    Laid out as (layers, K/V, pages, units) with units innermost, so that heads a source rank
    holds side by side come out adjacent and coalesce. Only arrays of (layers, K/V) and
    (pages, units) are computed here; the full grid is materialised once, by `PlanPiece.write`,
    into the pair's output arrays.
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
    n_layers = len(layers)
    # Source rank per (layer, K/V, unit): replicas take turns along (layer, K/V), continuing
    # the count across destination ranks (offset d·2·layers, not d: destination ranks that
    # share a replicated head are consecutive, so one round-robin runs over all their reads),
    # so each replica serves an equal share (±1 buffer) of every destination rank's reads and of
    # the pool's.
    n_turns = 2 * n_layers
    turn = d * n_turns + 2 * np.arange(n_layers, dtype=np.int64)[:, None] + np.arange(2)[None, :]
    src_rank = np.empty((n_layers, 2, n_units), dtype=np.int64)
    src_j = np.empty(n_units, dtype=np.int64)
    dst_j = np.empty(n_units, dtype=np.int64)
    width = np.empty(n_units, dtype=np.int64)
    replicated = False
    for u, (h, j, w) in enumerate(units):
        owners = st.ranks_of_head(m, h)
        replicated |= len(owners) > 1
        src_rank[:, :, u] = np.asarray(owners, dtype=np.int64)[turn % len(owners)]
        src_j[u] = h - st.heads_of_rank(m, owners[0]).start
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
    first = int(layers[0])
    src_b = (src.layer_base[layers][:, None] + src.kv_stride(first) * kv[None, :]).reshape(-1)
    dst_b = (dst.layer_base[layers][:, None] + dst.kv_stride(first) * kv[None, :]).reshape(-1)
    src_pu = (spages * src.page_bytes)[:, None] + src_in
    dst_pu = (dpages * dst.page_bytes)[:, None] + dst_in

    if not replicated:
        # The serving rank depends on the unit alone: each source's piece is a slice of units,
        # the same (pages, units) runs in every (layer, K/V) block.
        by_unit = src_rank[0, 0]
        for s in np.unique(by_unit):
            sel = np.flatnonzero(by_unit == s)
            yield (
                int(s),
                PlanPiece(
                    src_b,
                    dst_b,
                    *_coalesce(
                        src_pu[:, sel].reshape(-1),
                        dst_pu[:, sel].reshape(-1),
                        np.ascontiguousarray(nbytes[:, sel]).reshape(-1),
                    ),
                ),
            )
        return

    shape = (n_layers, 2, len(spages), n_units)
    s_all = (src_b.reshape(n_layers, 2)[:, :, None, None] + src_pu[None, None]).reshape(-1)
    d_all = (dst_b.reshape(n_layers, 2)[:, :, None, None] + dst_pu[None, None]).reshape(-1)
    n_all = np.broadcast_to(nbytes[None, None], shape).reshape(-1)
    r_all = np.broadcast_to(src_rank[:, :, None, :], shape).reshape(-1)
    for s in np.unique(src_rank):
        sel = r_all == s
        yield int(s), PlanPiece(flat=(s_all[sel], d_all[sel], n_all[sel]))


def _coalesce(so: IntArray, do: IntArray, n: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Merge neighbours that are contiguous on both sides (order is preserved)."""
    if len(n) < 2:
        return so, do, n
    head = n[:-1]
    brk = so[1:] != so[:-1] + head
    brk |= do[1:] != do[:-1] + head
    if brk.all():
        return so, do, n
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    # A merged run's length is where its last piece ends minus where it starts.
    last = np.empty_like(starts)
    last[:-1] = starts[1:] - 1
    last[-1] = len(n) - 1
    s0 = so[starts]
    return s0, do[starts], so[last] + n[last] - s0
