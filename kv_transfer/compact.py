"""A transfer plan kept as factors: what the host-local driver's one kernel reads.

`plan_transfer` writes every descriptor out: at 8:4, 80K tokens, 189,824 rows of (source
offset, destination offset, length), 4.6 MB. But each (source rank, destination rank, layer
group) piece of it is a sum of two small factors — per (layer, K/V) block a base offset, per
(page, head) inside the block a run — and the blocks repeat the same runs:

    descriptor (b, i) of a segment  =  (src_base[b] + src_run[i],  dst_base[b] + dst_run[i],
                                        run_len[i])

`compact_plan` keeps the factors (`CompactPlan`, 8:4 at 80K: 16 segments, 832 bases, 10,312
runs, ≈ 260 KB; the page tables are folded into the runs). It is computed by the same code as
the plan (`plan.plan_pieces`), so `CompactPlan.to_plan()` is `plan_transfer`'s plan array for
array, and the runs the kernel copies, coalesced, are the plan's (tested with hypothesis).

`kernel_tables` turns a compact plan into the kernel's one int64 table, in elements (8-byte
words for KV pages); `KernelTables.bind` writes each segment's source and destination region
offsets (from the lowest region's address in the launching process) into its two region
columns:

    [header 8][seg_start S][seg_runs S][seg_boff S][seg_roff S][seg_src_off S][seg_dst_off S]
    [src_base B][dst_base B][src_run R][dst_run R][run_len R]

where S is a power of two ≥ the segment count (padded with `PAD`, so the kernel's binary search
has a fixed number of steps), runs longer than `kernels.BLOCK_BYTES` are split into pieces, and
program `p` of the launch copies piece `i` of block `b` of the segment whose `seg_start` is the
last one ≤ `p`. `program_runs` computes every program's (source, destination, length) the way
the kernel does, in numpy: the CPU tests run it against the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from beamserve.kv_transfer import kernels
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.plan import (
    PlanPiece,
    TransferPlan,
    assemble_plan,
    plan_pieces,
)
from beamserve.kv_transfer.topology import IntArray, PoolLayout, RequestPages

HEADER = 8  # int64 words before the segment columns: the columns' offsets, the program count
MIN_LOG2 = 6  # the segment columns hold at least 64 rows: one compiled variant for most plans
PAD = np.iinfo(np.int64).max  # seg_start of padding rows: never ≤ a program id


@dataclass(frozen=True)
class PlanSegment:
    """One (source rank, destination rank, layer group) piece of a plan, as factors.

    `flat` marks a piece that is not a product (a source that replicates heads, so the serving
    replica changes along (layer, K/V)): one block of base 0 holding every descriptor; the
    direct planner then coalesces the pair whole, and `to_plan` does the same.
    """

    src_rank: int
    dst_rank: int
    src_base: IntArray  # bytes, per (layer, K/V) block
    dst_base: IntArray
    src_run: IntArray  # bytes inside a block, per run
    dst_run: IntArray
    run_len: IntArray
    flat: bool = False

    @property
    def blocks(self) -> int:
        return len(self.src_base)

    @property
    def runs(self) -> int:
        return len(self.run_len)

    @property
    def count(self) -> int:
        return self.blocks * self.runs

    @property
    def nbytes(self) -> int:
        return self.blocks * int(self.run_len.sum())

    def expand(self) -> tuple[IntArray, IntArray, IntArray]:
        """The segment's descriptors in plan order (block-major), uncoalesced across blocks."""
        so = (self.src_base[:, None] + self.src_run[None, :]).reshape(-1)
        do = (self.dst_base[:, None] + self.dst_run[None, :]).reshape(-1)
        n = np.broadcast_to(self.run_len[None, :], (self.blocks, self.runs)).reshape(-1)
        return so, do, np.ascontiguousarray(n)

    def piece(self) -> PlanPiece:
        if self.flat:
            return PlanPiece(flat=(self.src_run, self.dst_run, self.run_len))
        return PlanPiece(self.src_base, self.dst_base, self.src_run, self.dst_run, self.run_len)


@dataclass(frozen=True)
class CompactPlan:
    """A request's transfer plan as `PlanSegment`s, in the direct plan's pair order (source
    rank, destination rank), full-attention layers before sliding ones inside a pair."""

    src: PoolLayout
    dst: PoolLayout
    seq_len: int
    segments: tuple[PlanSegment, ...]
    src_pages: RequestPages | None = None
    dst_pages: RequestPages | None = None

    @property
    def bytes_moved(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def descriptors(self) -> int:
        """Runs the kernel copies before splitting: the direct plan's descriptors, except where
        a pair's blocks touch (the direct planner then merges across them; same bytes)."""
        return sum(s.count for s in self.segments)

    @property
    def table_words(self) -> int:
        """int64 words of the factors (what crosses a pipe, before the kernel's table)."""
        return sum(2 * s.blocks + 3 * s.runs for s in self.segments)

    def per_dst_rank(self) -> dict[int, tuple[int, int]]:
        """(descriptors, bytes) per destination rank."""
        out: dict[int, tuple[int, int]] = {}
        for s in self.segments:
            c, b = out.get(s.dst_rank, (0, 0))
            out[s.dst_rank] = (c + s.count, b + s.nbytes)
        return out

    def src_ranks(self) -> list[int]:
        return sorted({s.src_rank for s in self.segments})

    def dst_ranks(self) -> list[int]:
        return sorted({s.dst_rank for s in self.segments})

    def to_plan(self) -> TransferPlan:
        """The direct plan: `plan_transfer`'s arrays, written out from the factors."""
        pieces: dict[tuple[int, int], list[PlanPiece]] = {}
        for s in self.segments:
            pieces.setdefault((s.src_rank, s.dst_rank), []).append(s.piece())
        return assemble_plan(
            self.src, self.dst, self.seq_len, pieces, self.src_pages, self.dst_pages
        )


def compact_plan(
    src: PoolLayout,
    dst: PoolLayout,
    seq_len: int,
    src_pages: RequestPages,
    dst_pages: RequestPages,
) -> CompactPlan:
    """`plan_transfer`'s plan without writing its descriptors out (same checks, same errors)."""
    pieces = plan_pieces(src, dst, seq_len, src_pages, dst_pages)
    segments = []
    for (s, d), parts in sorted(pieces.items()):
        for p in parts:
            if p.flat is not None:
                so, do, n = p.flat
                zero = np.zeros(1, dtype=np.int64)
                segments.append(PlanSegment(s, d, zero, zero, so, do, n, flat=True))
                continue
            assert p.src_b is not None and p.dst_b is not None
            assert p.src_i is not None and p.dst_i is not None and p.len_i is not None
            n = np.ascontiguousarray(np.broadcast_to(p.len_i, p.src_i.shape))
            segments.append(PlanSegment(s, d, p.src_b, p.dst_b, p.src_i, p.dst_i, n))
    return CompactPlan(src, dst, seq_len, tuple(segments), src_pages, dst_pages)


@dataclass(frozen=True)
class KernelTables:
    """The host-local kernel's input: one int64 table (see the module docstring) and the
    launch's compile-time shape, in `elem`-byte elements. Built from the plan alone (no
    addresses: the decode side builds it while it plans); `bind` writes each segment's region
    offsets into it in the process that launches."""

    table: IntArray
    seg_src_rank: IntArray  # per segment: the source rank whose region it reads
    seg_dst_rank: IntArray
    elem: int  # bytes per element: the widest of 8, 4, 2, 1 dividing every offset and length
    align: int  # elements every offset and length is a multiple of (2: 16-byte vectors)
    log2: int  # the segment columns hold 2**log2 rows
    steps: int  # unrolled BLOCK steps of the longest piece
    programs: int  # pieces: one per (segment, block, piece); the flat kernel's grid
    nbytes_moved: int
    longest: int = 0  # elements of the longest piece (the loop kernel's step, `loop_block`)

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    @property
    def segments(self) -> int:
        return len(self.seg_src_rank)

    def bind(
        self,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        base_addr: int,
        out: IntArray | None = None,
    ) -> IntArray:
        """A copy of the table with source rank r's region at device address `src_addrs[r]`,
        destination rank d's at `dst_addrs[d]`, offsets counted from `base_addr` (the lowest
        of them), written into `out` where given (the driver's pinned upload buffer: one copy
        of the table per request, not two). Raises `TransferPlanError` for an address the
        table's element width does not divide (regions are allocated at least 512-byte
        aligned, so it does not happen) or an `out` of another length."""
        rel_s = np.asarray(src_addrs, dtype=np.int64) - base_addr
        rel_d = np.asarray(dst_addrs, dtype=np.int64) - base_addr
        s_off, d_off = rel_s[self.seg_src_rank], rel_d[self.seg_dst_rank]
        unit = self.elem * self.align
        if (s_off < 0).any() or (d_off < 0).any() or (s_off % unit).any() or (d_off % unit).any():
            raise TransferPlanError(
                f"kernel tables: a region address is below base_addr or not {unit}-byte "
                "aligned; regions must be allocated by the device allocator"
            )
        rows, k = 1 << self.log2, self.segments
        if out is None:
            out = self.table.copy()
        elif out.shape != self.table.shape or out.dtype != self.table.dtype:
            raise TransferPlanError(
                f"kernel tables: bind into {out.dtype}{list(out.shape)}, the table is "
                f"{self.table.dtype}{list(self.table.shape)}"
            )
        else:
            out[:] = self.table
        out[HEADER + 4 * rows : HEADER + 4 * rows + k] = s_off // self.elem
        out[HEADER + 5 * rows : HEADER + 5 * rows + k] = d_off // self.elem
        return out


SEG_COLUMNS = 6  # seg_start, seg_runs, seg_boff, seg_roff, seg_src_off, seg_dst_off


ORDERS = ("plan", "src", "dst")


def kernel_tables(
    plan: CompactPlan,
    piece_bytes: int = kernels.BLOCK_BYTES,
    block_bytes: int = kernels.BLOCK_BYTES,
    order: str = "plan",
) -> KernelTables:
    """The kernel table for `plan`, its region columns zero (see `KernelTables.bind`). Runs
    are split into pieces of at most `piece_bytes` (default one 16 KiB step: the loop kernel
    moves one step per piece; the flat kernel unrolls ``steps`` steps for longer pieces).
    `order` other than "plan" sorts each segment's runs (`reorder_runs`)."""
    if order not in ORDERS:
        raise TransferPlanError(f"kernel tables: order {order!r}; choose one of {list(ORDERS)}")
    segs = [s for s in plan.segments if s.count]
    every = np.concatenate(
        [np.zeros(1, dtype=np.int64)]
        + [a for s in segs for a in (s.src_base, s.dst_base, s.src_run, s.dst_run, s.run_len)]
    )
    g = int(np.gcd.reduce(every)) if len(every) > 1 else 0
    # 16-byte vectors where every offset and length allows (KV rows are ≥ 128 B).
    elem = 8 if g == 0 else kernels.element_bytes(np.array([g], dtype=np.int64))
    align = 2 if elem == 8 and g % 16 == 0 else 1
    runs = [kernels.pack_pieces(s.src_run, s.dst_run, s.run_len, elem, piece_bytes) for s in segs]
    n_seg = len(segs)
    log2 = max(MIN_LOG2, (max(n_seg, 1) - 1).bit_length())
    rows = 1 << log2
    n_base = sum(s.blocks for s in segs)
    n_run = sum(len(r) for r in runs)
    o_bsrc = HEADER + SEG_COLUMNS * rows
    o_bdst = o_bsrc + n_base
    o_rsrc = o_bdst + n_base
    o_rdst = o_rsrc + n_run
    o_rlen = o_rdst + n_run
    table = np.zeros(o_rlen + n_run, dtype=np.int64)
    table[:5] = (o_bsrc, o_bdst, o_rsrc, o_rdst, o_rlen)
    table[HEADER : HEADER + rows] = PAD
    starts = np.zeros(n_seg, dtype=np.int64)
    counts = np.zeros(n_seg, dtype=np.int64)
    boffs = np.zeros(n_seg, dtype=np.int64)
    roffs = np.zeros(n_seg, dtype=np.int64)
    prog = boff = roff = 0
    longest = 0
    for k, (s, r) in enumerate(zip(segs, runs, strict=True)):
        starts[k], counts[k], boffs[k], roffs[k] = prog, len(r), boff, roff
        table[o_bsrc + boff : o_bsrc + boff + s.blocks] = s.src_base // elem
        table[o_bdst + boff : o_bdst + boff + s.blocks] = s.dst_base // elem
        table[o_rsrc + roff : o_rsrc + roff + len(r)] = r[:, 0]
        table[o_rdst + roff : o_rdst + roff + len(r)] = r[:, 1]
        table[o_rlen + roff : o_rlen + roff + len(r)] = r[:, 2]
        if len(r):
            longest = max(longest, int(r[:, 2].max()))
        prog += s.blocks * len(r)
        boff += s.blocks
        roff += len(r)
    for col, values in enumerate((starts, counts, boffs, roffs)):
        table[HEADER + col * rows : HEADER + col * rows + n_seg] = values
    table[5] = prog  # programs: the kernel's bound when one launched program copies several
    block = block_bytes // elem
    out = KernelTables(
        table,
        np.array([s.src_rank for s in segs], dtype=np.int64),
        np.array([s.dst_rank for s in segs], dtype=np.int64),
        elem,
        align,
        log2,
        max(1, -(-longest // block)),
        prog,
        sum(s.nbytes for s in segs),
        longest,
    )
    return out if order == "plan" else reorder_runs(out, order)


def reorder_runs(t: KernelTables, by: str) -> KernelTables:
    """The same copies in another order: each segment's runs (and so every block's pieces)
    sorted by their source ("src") or destination ("dst") offset, so that the programs running
    at one time touch neighbouring pages on that side. The bytes each program pair moves are
    unchanged; only which program moves them is (tested: the same multiset of runs, the same
    bytes written)."""
    if by == "plan":
        return t
    if by not in ORDERS:
        raise TransferPlanError(f"kernel tables: order {by!r}; choose one of {list(ORDERS)}")
    table = t.table.copy()
    rows = 1 << t.log2
    o_rsrc, o_rdst, o_rlen = (int(v) for v in table[2:5])
    key_at = o_rsrc if by == "src" else o_rdst
    for k in range(t.segments):
        cnt, roff = int(table[HEADER + rows + k]), int(table[HEADER + 3 * rows + k])
        order = np.argsort(table[key_at + roff : key_at + roff + cnt], kind="stable")
        for at in (o_rsrc, o_rdst, o_rlen):
            table[at + roff : at + roff + cnt] = table[at + roff : at + roff + cnt][order]
    return dataclasses.replace(t, table=table)


def program_runs(t: KernelTables, table: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """(source, destination, length) in elements from the bound base address, for every
    program of the launch over `table` (`t.bind(...)`), computed as the kernel computes them:
    the same fixed-step binary search, the same sums."""
    tab, rows = table, 1 << t.log2
    o_bsrc, o_bdst, o_rsrc, o_rdst, o_rlen = (int(v) for v in tab[:5])
    pid = np.arange(t.programs, dtype=np.int64)
    k = np.zeros_like(pid)
    for j in range(t.log2):
        cand = k + (rows >> (j + 1))
        k = np.where(tab[HEADER + cand] <= pid, cand, k)
    col = [tab[HEADER + c * rows + k] for c in range(SEG_COLUMNS)]
    start, ni, boff, roff, s_off, d_off = col
    local = pid - start
    b = local // ni
    i = local - b * ni
    so = s_off + tab[o_bsrc + boff + b] + tab[o_rsrc + roff + i]
    do = d_off + tab[o_bdst + boff + b] + tab[o_rdst + roff + i]
    return so, do, tab[o_rlen + roff + i]
