"""Deterministic KV content for end-to-end checks, and per-slice checksums.

A request's logical KV is a pure function of (seed, layer, K/V, global head, token): both sides
can compute it independently of any plan, so a destination is verified byte for byte without
trusting the planner. A *slice* is one (layer, K/V, global head) over the tokens the
destination needs (all tokens for full-attention layers, the window for sliding layers).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.topology import (
    KVLayout,
    PoolLayout,
    RequestPages,
    first_window_page,
    window_start,
)

U8 = npt.NDArray[np.uint8]
SliceKey = tuple[int, int, int]  # (layer, kv, global head)


@dataclass(frozen=True)
class SliceView:
    """Where one slice's tokens live in a rank's region."""

    layer: int
    kv: int
    head: int
    local_head: int
    tokens: range
    pages: npt.NDArray[np.int64]  # page id per token
    slots: npt.NDArray[np.int64]  # slot within page per token


def iter_slices(
    layout: PoolLayout, rank: int, seq_len: int, pages: RequestPages
) -> Iterator[SliceView]:
    """Every slice that `rank` holds for a request of `seq_len` tokens."""
    m, P = layout.model, layout.topology.page_size
    heads = layout.topology.heads_of_rank(m, rank)
    if seq_len == 0:
        return
    lo = window_start(seq_len, m.sliding_window)
    wfirst = first_window_page(seq_len, m.sliding_window, P)
    for layer, kind in enumerate(m.layer_types):
        if kind == "full_attention":
            tokens, table, first = range(0, seq_len), pages.full, 0
        else:
            tokens, table, first = range(lo, seq_len), pages.window, wfirst
        t = np.arange(tokens.start, tokens.stop, dtype=np.int64)
        page_ids, slots = table[t // P - first], t % P
        for j, h in enumerate(heads):
            for kv in (0, 1):
                yield SliceView(layer, kv, h, j, tokens, page_ids, slots)


def _slice_index(layout: PoolLayout, s: SliceView) -> npt.NDArray[np.int64]:
    """Byte offset of each token row of a slice in the region."""
    P, row, H = layout.topology.page_size, layout.row_bytes, layout.local_heads
    base = int(layout.layer_base[s.layer]) + s.kv * layout.kv_stride(s.layer)
    if layout.topology.layout is KVLayout.HND:
        return base + s.pages * layout.page_bytes + (s.local_head * P + s.slots) * row
    return base + s.pages * layout.page_bytes + (s.slots * H + s.local_head) * row


def _row_view(region: U8, layout: PoolLayout) -> U8:
    """The region as (rows, row_bytes): every token row starts on a row boundary."""
    return region.reshape(-1, layout.row_bytes)


def _row_ids(layout: PoolLayout, s: SliceView) -> npt.NDArray[np.int64]:
    return _slice_index(layout, s) // layout.row_bytes


def logical_rows(seed: int, s: SliceView, row_bytes: int) -> U8:
    """The slice's token rows: a pure function of (seed, layer, kv, head, first token)."""
    rng = np.random.default_rng([seed, s.layer, s.kv, s.head, s.tokens.start])
    data = rng.bytes(len(s.tokens) * row_bytes)
    return np.frombuffer(data, dtype=np.uint8).reshape(len(s.tokens), row_bytes)


def fill_random(region: U8, seed: int) -> None:
    """Overwrite a whole region with seeded noise (garbage or sentinel)."""
    rng = np.random.default_rng([seed, 0xFEED])
    step = 64 << 20
    for off in range(0, len(region), step):
        n = min(step, len(region) - off)
        region[off : off + n] = np.frombuffer(rng.bytes(n), dtype=np.uint8)


def write_request(
    region: U8, layout: PoolLayout, rank: int, seq_len: int, pages: RequestPages, seed: int
) -> None:
    """Write the request's logical KV into this rank's pages (what prefill would compute)."""
    rows = _row_view(region, layout)
    for s in iter_slices(layout, rank, seq_len, pages):
        rows[_row_ids(layout, s)] = logical_rows(seed, s, layout.row_bytes)


@dataclass(frozen=True)
class VerifyResult:
    bytes_checked: int
    mismatched_bytes: int
    untouched_bytes_changed: int

    @property
    def ok(self) -> bool:
        return self.mismatched_bytes == 0 and self.untouched_bytes_changed == 0


def verify_request(
    region: U8,
    layout: PoolLayout,
    rank: int,
    seq_len: int,
    pages: RequestPages,
    seed: int,
    sentinel_seed: int,
) -> VerifyResult:
    """Compare a destination region, byte for byte, with what it must hold: the request's
    logical KV in its pages and the untouched sentinel everywhere else."""
    expected = np.empty_like(region)
    fill_random(expected, sentinel_seed)
    write_request(expected, layout, rank, seq_len, pages, seed)
    if _chunked_equal(region, expected):
        return VerifyResult(len(region), 0, 0)
    needed = np.zeros(len(region) // layout.row_bytes, dtype=bool)
    for s in iter_slices(layout, rank, seq_len, pages):
        needed[_row_ids(layout, s)] = True
    needed_bytes = np.repeat(needed, layout.row_bytes)
    diff = region != expected
    return VerifyResult(
        bytes_checked=len(region),
        mismatched_bytes=int(np.count_nonzero(diff & needed_bytes)),
        untouched_bytes_changed=int(np.count_nonzero(diff & ~needed_bytes)),
    )


def _chunked_equal(a: U8, b: U8, step: int = 64 << 20) -> bool:
    return all(np.array_equal(a[i : i + step], b[i : i + step]) for i in range(0, len(a), step))


def slice_checksums(
    region: U8, layout: PoolLayout, rank: int, seq_len: int, pages: RequestPages
) -> dict[SliceKey, int]:
    """CRC-32 of every slice this rank holds, over its token rows in token order."""
    out: dict[SliceKey, int] = {}
    rows = _row_view(region, layout)
    for s in iter_slices(layout, rank, seq_len, pages):
        out[(s.layer, s.kv, s.head)] = zlib.crc32(rows[_row_ids(layout, s)].tobytes())
    return out
