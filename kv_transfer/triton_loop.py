"""The host-local loop kernel (Triton), in a module of its own: Triton resolves a kernel's
helper functions (`locate`) among the module's globals, and this module imports Triton at
import time, so only `kernels._loop_kernel` imports it (CI has no Triton).

A fixed grid; program ``pid`` copies pieces ``pid, pid + grid, …`` of the bound table
(`compact.program_runs` order). Per piece the lookups are `copy_compact`'s: one fixed-step
binary search over the segment column, then the block and run rows. The next piece's loads are
issued before the current piece's stores, so each program keeps a piece in flight while it
writes the one before; with ``AHEAD`` the lookups for the piece after that are done one
iteration early, off the path of the loads.
"""

# ruff: noqa
# mypy: ignore-errors
import triton
import triton.language as tl


@triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
def locate(tab, pid, total, LOG2: tl.constexpr, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]
    # (source, destination, length) of piece `pid`; past the end: in bounds, length 0.
    live = pid < total
    pid = tl.where(live, pid, total - 1)
    k = pid * 0
    for j in tl.static_range(LOG2):
        cand = k + (ROWS >> (j + 1))
        k = tl.where(tl.load(tab + 8 + cand) <= pid, cand, k)
    start = tl.load(tab + 8 + k)
    ni = tl.maximum(tl.load(tab + 8 + ROWS + k), 1)
    boff = tl.load(tab + 8 + 2 * ROWS + k)
    roff = tl.load(tab + 8 + 3 * ROWS + k)
    s_off = tl.load(tab + 8 + 4 * ROWS + k)
    d_off = tl.load(tab + 8 + 5 * ROWS + k)
    local = pid - start
    b = local // ni
    i = local - b * ni
    so = s_off + tl.load(tab + tl.load(tab) + boff + b)
    so += tl.load(tab + tl.load(tab + 2) + roff + i)
    do = d_off + tl.load(tab + tl.load(tab + 1) + boff + b)
    do += tl.load(tab + tl.load(tab + 3) + roff + i)
    n = tl.where(live, tl.load(tab + tl.load(tab + 4) + roff + i), 0)
    return so, do, n


@triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
def copy_compact_loop(  # type: ignore[no-untyped-def]
    base, tab, LOG2: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK: tl.constexpr, AHEAD: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    # Offsets and lengths are carried divided by ALIGN and multiplied back where used: the
    # compiler then knows them to be multiples of ALIGN (16-byte vectors for 8-byte elements)
    # also where they are loop-carried, which `tl.multiple_of` cannot say of a loop argument.
    total = tl.load(tab + 5)
    pid = tl.program_id(0).to(tl.int64)
    grid = tl.num_programs(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    so, do, n = locate(tab, pid, total, LOG2, ROWS)
    cur = tl.load(base + (so // ALIGN) * ALIGN + e, mask=e < (n // ALIGN) * ALIGN,
                  eviction_policy=EVICT)  # fmt: skip
    q_do = do // ALIGN
    q_n = n // ALIGN
    if AHEAD:
        so, do, n = locate(tab, pid + grid, total, LOG2, ROWS)
        a_so = so // ALIGN
        a_do = do // ALIGN
        a_n = n // ALIGN
    iters = (total - pid + grid - 1) // grid  # pieces of this program (0 past the end)
    for it in range(1, iters):
        if AHEAD:
            l_so = a_so
            l_do = a_do
            l_n = a_n
            so, do, n = locate(tab, pid + (it + 1) * grid, total, LOG2, ROWS)
            a_so = so // ALIGN
            a_do = do // ALIGN
            a_n = n // ALIGN
        else:
            so, do, n = locate(tab, pid + it * grid, total, LOG2, ROWS)
            l_so = so // ALIGN
            l_do = do // ALIGN
            l_n = n // ALIGN
        nxt = tl.load(base + l_so * ALIGN + e, mask=e < l_n * ALIGN, eviction_policy=EVICT)
        tl.store(base + q_do * ALIGN + e, cur, mask=e < q_n * ALIGN, eviction_policy=EVICT)
        cur = nxt
        q_do = l_do
        q_n = l_n
    tl.store(base + q_do * ALIGN + e, cur, mask=e < q_n * ALIGN, eviction_policy=EVICT)
