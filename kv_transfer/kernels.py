"""One-pass copies of many runs on the GPU: a Triton kernel, one launch for a whole read.

`copy_runs` on VRAM used to group a read's runs by length and move each group through
`index_select` into a temporary and `index_copy_` out of it: four passes over the bytes
(gather read and write, scatter read and write) plus one index upload and two kernels per
length class. The kernel here reads every run where it lies and writes it where it goes, so the
bytes cross the memory bus once each way, as in one `cudaMemcpy` of the same total:

* The host packs the runs into one ``(pieces, 3)`` int64 table — source offset, destination
  offset, length, in *elements* of the widest type that divides every offset and length
  (`element_bytes`: 8-byte words for KV pages, bytes in the worst case) — splitting runs longer
  than `PIECE_BYTES` so that no program copies much more than any other (`pack_pieces`, pure
  numpy, tested on the CPU). One upload, one launch.
* Program ``i`` copies piece ``i`` in ``STEPS`` unrolled steps of ``BLOCK`` elements (16 KiB),
  masked at its end; ``STEPS`` is the longest piece's (at most ``PIECE_BYTES / BLOCK_BYTES`` = 4),
  so the common plan of equal page runs compiles to one step. ``ALIGN`` tells
  the compiler that offsets and lengths are multiples of two words (16 bytes) where they are,
  so loads and stores are 16-byte vectors.

Engine choice (`engine()`): ``BEAMSERVE_KV_COPY=triton|torch|auto`` (default ``auto``: Triton
where it imports and its first launch succeeds, else the torch path). The choice is made once
per process and logged, and `copy_runs` reports which engine ran (`last_engine`), so a benchmark
says what it measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

log = structlog.get_logger(__name__)

I64 = npt.NDArray[np.int64]

PIECE_BYTES = 64 << 10  # the most one program copies (longer runs are split)
BLOCK_BYTES = 16 << 10  # bytes one program moves per loop step
ENGINES = ("auto", "triton", "torch")

_state: dict[str, Any] = {}


def _gcd(*arrays: I64) -> int:
    g = 0
    for a in arrays:
        if len(a):
            g = int(np.gcd(g, np.gcd.reduce(a)))
    return g


def _width(g: int) -> int:
    for e in (8, 4, 2):
        if g % e == 0:
            return e
    return 1


def element_bytes(*arrays: I64) -> int:
    """The widest of 8, 4, 2, 1 bytes dividing every value of `arrays`."""
    return _width(_gcd(*arrays))


def pack_pieces(
    src_off: I64, dst_off: I64, lengths: I64, elem: int, piece_bytes: int = PIECE_BYTES
) -> I64:
    """Runs as a C-contiguous ``(pieces, 3)`` table of (source, destination, length) in units of
    `elem` bytes, each run longer than `piece_bytes` split into pieces of at most that many bytes
    (in order). Every offset and length must be a multiple of `elem`; `piece_bytes` is rounded
    down to one."""
    piece = max(elem, piece_bytes - piece_bytes % elem) // elem
    so, do, n = src_off // elem, dst_off // elem, lengths // elem
    if not len(n) or int(n.max()) <= piece:
        return np.ascontiguousarray(np.stack((so, do, n), axis=1), dtype=np.int64)
    k = -(-n // piece)  # pieces per run (ceil); runs of length 0 keep one empty piece
    k = np.maximum(k, 1)
    rep = np.repeat(np.arange(len(n), dtype=np.int64), k)
    first = np.cumsum(k) - k
    within = (np.arange(len(rep), dtype=np.int64) - np.repeat(first, k)) * piece
    out = np.empty((len(rep), 3), dtype=np.int64)
    out[:, 0] = so[rep] + within
    out[:, 1] = do[rep] + within
    out[:, 2] = np.minimum(n[rep] - within, piece)
    return out


def configured_engine() -> str:
    value = os.environ.get("BEAMSERVE_KV_COPY", "auto").strip().lower() or "auto"
    if value not in ENGINES:
        raise ValueError(f"BEAMSERVE_KV_COPY: {value!r} unsupported; choose one of {list(ENGINES)}")
    return value


def _kernel() -> Any:
    """The Triton kernel (compiled per element type and alignment on first launch)."""
    if "kernel" in _state:
        return _state["kernel"]
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def copy_pieces(  # type: ignore[no-untyped-def]
        src, dst, table, ALIGN: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
        HINTS: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        so = tl.load(table + 3 * i)
        do = tl.load(table + 3 * i + 1)
        n = tl.load(table + 3 * i + 2)
        if HINTS:
            so = tl.multiple_of(so, ALIGN)
            do = tl.multiple_of(do, ALIGN)
            n = tl.multiple_of(n, ALIGN)
        for j in tl.static_range(STEPS):
            k = j * BLOCK + tl.arange(0, BLOCK)
            m = k < n
            tl.store(dst + do + k, tl.load(src + so + k, mask=m), mask=m)

    _state["kernel"] = copy_pieces
    return copy_pieces


_TORCH_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def _compact_kernel() -> Any:
    """The host-local driver's kernel: one launch copies a whole request, every program
    computing its piece's addresses from the compact plan's table (`compact.KernelTables`)."""
    if "compact" in _state:
        return _state["compact"]
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def copy_compact(  # type: ignore[no-untyped-def]
        base, tab, LOG2: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
        BLOCK: tl.constexpr, STEPS: tl.constexpr, HINTS: tl.constexpr, RUNS: tl.constexpr,
    ):  # fmt: skip
        total = tl.load(tab + 5)
        for r in tl.static_range(RUNS):
            # Program ids of the table (`compact.program_runs`): RUNS per launched program.
            pid = tl.program_id(0).to(tl.int64) * RUNS + r
            live = pid < total
            pid = tl.where(live, pid, total - 1)  # past the end: read in bounds, copy nothing
            # The segment: the last row whose first program is ≤ pid (padding: int64 max).
            k = pid * 0
            for j in tl.static_range(LOG2):
                cand = k + (ROWS >> (j + 1))
                k = tl.where(tl.load(tab + 8 + cand) <= pid, cand, k)
            start = tl.load(tab + 8 + k)
            ni = tl.load(tab + 8 + ROWS + k)
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
            if HINTS:
                so = tl.multiple_of(so, ALIGN)
                do = tl.multiple_of(do, ALIGN)
                n = tl.multiple_of(n, ALIGN)
            for j in tl.static_range(STEPS):
                e = j * BLOCK + tl.arange(0, BLOCK)
                m = e < n
                tl.store(base + do + e, tl.load(base + so + e, mask=m), mask=m)

    _state["compact"] = copy_compact
    return copy_compact


def _loop_kernel() -> Any:
    """The host-local loop kernel (`triton_loop.copy_compact_loop`, compiled per shape on
    first launch)."""
    if "loop" in _state:
        return _state["loop"]
    from beamserve.kv_transfer import triton_loop

    _state["loop"] = triton_loop.copy_compact_loop
    return triton_loop.copy_compact_loop


def triton_copy_runs(src: Any, dst: Any, src_off: I64, dst_off: I64, lengths: I64) -> None:
    """dst[dst_off[i]:+lengths[i]] = src[src_off[i]:+lengths[i]] for flat uint8 tensors `src`
    and `dst` (CUDA, or CPU under ``TRITON_INTERPRET=1``), one launch on the current stream."""
    import torch

    if not len(lengths):
        return
    g = _gcd(src_off, dst_off, lengths, np.array([src.numel(), dst.numel()], dtype=np.int64))
    elem = _width(g)
    table_h = pack_pieces(src_off, dst_off, lengths, elem)
    dtype = getattr(torch, _TORCH_DTYPES[elem])
    table = torch.from_numpy(table_h).to(dst.device, non_blocking=False)
    block = BLOCK_BYTES // elem
    steps = -(-int(table_h[:, 2].max()) // block)
    # Pieces split at PIECE_BYTES (a multiple of 16) keep the runs' 16-byte alignment.
    align = 2 if elem == 8 and g % 16 == 0 else 1
    _launch(src.view(dtype), dst.view(dtype), table, align, block, max(steps, 1))


def _launch(src: Any, dst: Any, table: Any, align: int, block: int, steps: int) -> None:
    hints = bool(_state.get("hints", True))
    _kernel()[(int(table.shape[0]),)](
        src, dst, table, ALIGN=align, BLOCK=block, STEPS=steps, HINTS=hints, num_warps=8
    )


def launch_compact(
    base: Any,
    table: Any,
    log2: int,
    elem: int,
    align: int,
    steps: int,
    programs: int,
    runs: int = 1,
    num_warps: int = 8,
) -> None:
    """One launch of the host-local kernel on the current stream: `base` is a flat uint8 CUDA
    tensor at the bound base address, `table` the bound table on the device (int64); each
    launched program copies `runs` consecutive pieces (`compact.program_runs` order)."""
    import torch

    if programs <= 0:
        return
    dtype = getattr(torch, _TORCH_DTYPES[elem])
    hints = bool(_state.get("hints", True))
    _compact_kernel()[(-(-programs // runs),)](
        base.view(dtype), table, LOG2=log2, ROWS=1 << log2, ALIGN=align,
        BLOCK=BLOCK_BYTES // elem, STEPS=steps, HINTS=hints, RUNS=runs, num_warps=num_warps,
    )  # fmt: skip


@dataclass(frozen=True)
class LocalShape:
    """How the host-local driver launches (environment, read once per driver):

    * ``BEAMSERVE_KV_LOCAL_KERNEL``: ``flat`` (default: one program per `runs` pieces) or
      ``loop`` (a fixed grid of `per_sm` programs per multiprocessor, each looping over pieces
      ``pid, pid + grid, …`` with the next piece's loads issued before the current piece's
      stores). Measured on the H200 on 2026-12-02 (docs/kv-transfer.md): the loop kernel was
      no faster at 8:4 bf16 (0.905–0.911 × a device copy against the flat kernel's
      0.890–0.936 ×) and slower for fp8 and 1:1, so flat is the default;
    * ``BEAMSERVE_KV_LOCAL_PER_SM`` (loop: programs per multiprocessor; keep it within what
      fits at once, or the last wave runs part-empty), ``BEAMSERVE_KV_LOCAL_WARPS``,
      ``BEAMSERVE_KV_LOCAL_MAXNREG`` (loop: a register cap per thread, 0 none, so that more
      programs fit), ``BEAMSERVE_KV_LOCAL_RUNS`` (flat: pieces per program),
      ``BEAMSERVE_KV_LOCAL_AHEAD`` (loop: 1 looks the next piece's table rows up one iteration
      early), ``BEAMSERVE_KV_LOCAL_EVICT`` (loop: 1 marks the copied bytes evict-first in L2,
      so the table stays cached);
    * ``BEAMSERVE_KV_LOCAL_GRAPH``: 1 (default) replays a CUDA graph of the launch (the loop
      kernel's grid is fixed, the flat kernel's is rounded up; the table buffer and the base
      address do not change between requests) instead of Triton's Python launch path; 0
      launches through Triton every time;
    * ``BEAMSERVE_KV_LOCAL_ORDER``: the order of each segment's pieces in the table
      (`compact.reorder_runs`): ``src`` (default: ascending source offset, so the programs
      running at once read neighbouring pages; 1.586 against 1.633 ms in the plan's order,
      one H200 run), ``plan`` or ``dst``.
    """

    kernel: str = "flat"
    per_sm: int = 2
    warps: int = 8
    maxnreg: int = 0
    runs: int = 1
    ahead: bool = True
    evict: bool = False
    graph: bool = True
    order: str = "src"


_SHAPE_ENV: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kernel", "BEAMSERVE_KV_LOCAL_KERNEL", ("loop", "flat")),
    ("per_sm", "BEAMSERVE_KV_LOCAL_PER_SM", tuple(str(i) for i in range(1, 33))),
    ("warps", "BEAMSERVE_KV_LOCAL_WARPS", ("2", "4", "8", "16")),
    (
        "maxnreg",
        "BEAMSERVE_KV_LOCAL_MAXNREG",
        ("0", "32", "40", "48", "56", "64", "80", "96", "128"),
    ),
    ("runs", "BEAMSERVE_KV_LOCAL_RUNS", ("1", "2", "4", "8")),
    ("ahead", "BEAMSERVE_KV_LOCAL_AHEAD", ("0", "1")),
    ("evict", "BEAMSERVE_KV_LOCAL_EVICT", ("0", "1")),
    ("graph", "BEAMSERVE_KV_LOCAL_GRAPH", ("0", "1")),
    ("order", "BEAMSERVE_KV_LOCAL_ORDER", ("plan", "src", "dst")),
)


def local_shape() -> LocalShape:
    """The host-local launch shape from the environment (`LocalShape`); an unsupported value
    raises `ValueError` naming the variable and the choices."""
    default = LocalShape()
    values: dict[str, Any] = {}
    for attr, name, allowed in _SHAPE_ENV:
        raw = os.environ.get(name, "").strip().lower()
        if not raw:
            continue
        if raw not in allowed:
            raise ValueError(f"{name}: {raw!r} unsupported; choose one of {list(allowed)}")
        kind = type(getattr(default, attr))
        values[attr] = raw if kind is str else (raw == "1" if kind is bool else int(raw))
    return LocalShape(**values)


def local_launch_shape() -> tuple[int, int]:
    """(pieces per program, warps) of the flat host-local kernel (`local_shape`)."""
    shape = local_shape()
    return shape.runs, shape.warps


def loop_block(elem: int, longest: int) -> int:
    """Elements one loop-kernel iteration moves: the longest piece rounded up to a power of
    two, at most `BLOCK_BYTES` (so fp8's 8 KiB head slices do not mask half of each step)."""
    cap = BLOCK_BYTES // elem
    return min(cap, 1 << max(0, (max(longest, 1) - 1).bit_length()))


def launch_compact_loop(
    base: Any,
    table: Any,
    log2: int,
    elem: int,
    align: int,
    block: int,
    grid: int,
    num_warps: int = 8,
    ahead: bool = True,
    evict: bool = False,
    maxnreg: int = 0,
) -> None:
    """One launch of the host-local loop kernel on the current stream: `grid` programs, each
    copying pieces ``pid, pid + grid, …`` of the bound `table` (`compact.program_runs` order;
    every piece at most `block` elements); `maxnreg` caps registers per thread (0: no cap).
    Same arguments otherwise as `launch_compact`."""
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[elem])
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    _loop_kernel()[(grid,)](
        base.view(dtype), table, LOG2=log2, ROWS=1 << log2, ALIGN=align, BLOCK=block,
        AHEAD=ahead, EVICT="evict_first" if evict else "", num_warps=num_warps, num_stages=1,
        **extra,
    )  # fmt: skip


def loop_probe_table(words: int, src: int, dst: int) -> I64:
    """A bound loop-kernel table of one segment, one block and one run: `words` 8-byte
    elements from element `src` to element `dst` of the base (the self-check's and the
    compile-ahead's table; the layout is `compact.kernel_tables`')."""
    rows = 1 << 6
    o_bsrc = 8 + 6 * rows
    table = np.zeros(o_bsrc + 5, dtype=np.int64)
    table[:6] = (o_bsrc, o_bsrc + 1, o_bsrc + 2, o_bsrc + 3, o_bsrc + 4, 1)
    table[8 : 8 + rows] = np.iinfo(np.int64).max
    table[8] = 0  # seg_start
    table[8 + rows] = 1  # seg_runs
    table[8 + 4 * rows], table[8 + 5 * rows] = src, dst  # region offsets
    table[o_bsrc + 4] = words  # the run's length (bases and run offsets 0)
    return table


def engine() -> str:
    """The engine `copy_runs` uses on VRAM in this process: "triton" or "torch"."""
    chosen = _state.get("engine")
    if chosen is not None:
        return str(chosen)
    want = configured_engine()
    chosen = "torch"
    if want != "torch":
        try:
            try:
                _probe()
            except ImportError:
                raise
            except Exception as exc:  # the alignment hints refused by this Triton: without
                log.warning("kv_copy_triton_hints_off", error=repr(exc))
                _state["hints"] = False
                _probe()
            chosen = "triton"
        except Exception as exc:  # no triton, no compiler, an unsupported GPU
            if want == "triton":
                raise RuntimeError(
                    f"BEAMSERVE_KV_COPY=triton, but the Triton copy kernel failed: {exc!r}; "
                    "install triton or set BEAMSERVE_KV_COPY=torch"
                ) from exc
            log.warning("kv_copy_triton_unavailable", error=repr(exc), engine="torch")
    _state["engine"] = chosen
    log.info("kv_copy_engine", engine=chosen, hints=bool(_state.get("hints", True)))
    return chosen


def _probe() -> None:
    """Compile the common variant (8-byte words, 16-byte aligned) and check one launch."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.arange(4096, dtype=torch.uint8, device=dev)
    dst = torch.zeros(4096, dtype=torch.uint8, device=dev)
    so = np.array([0, 1024], dtype=np.int64)
    do = np.array([2048, 0], dtype=np.int64)
    n = np.array([1024, 2048], dtype=np.int64)
    triton_copy_runs(src, dst, so, do, n)
    if dev == "cuda":
        torch.cuda.synchronize()
    got, want = dst.cpu().numpy(), np.zeros(4096, dtype=np.uint8)
    s = np.arange(4096, dtype=np.uint8)
    want[2048:3072], want[0:2048] = s[0:1024], s[1024:3072]
    if not np.array_equal(got, want):
        raise RuntimeError("the Triton copy kernel wrote wrong bytes in its self-check")
    if dev == "cuda":
        # Compile every unrolled length of the common variant now (page runs: 8-byte words,
        # 16-byte aligned), so no timed read pays a first-launch compile.
        words = torch.zeros(4 * BLOCK_BYTES // 8, dtype=torch.int64, device=dev)
        table = torch.zeros((1, 3), dtype=torch.int64, device=dev)
        for steps in range(1, PIECE_BYTES // BLOCK_BYTES + 1):
            _launch(words, words, table, 2, BLOCK_BYTES // 8, steps)
        torch.cuda.synchronize()
        try:
            _probe_loop(dev)
        except Exception as exc:  # the flat kernel still serves the host-local driver
            _state["loop_ok"] = False
            log.warning("kv_local_loop_kernel_unavailable", error=repr(exc), kernel="flat")


def _probe_loop(dev: str) -> None:
    """Check the host-local loop kernel in the configured shape (`local_shape`) on one run,
    compiling its bf16 and fp8 page variants (16 and 8 KiB steps) before any timed copy."""
    import torch

    shape = local_shape()
    if shape.kernel != "loop":
        return
    n = BLOCK_BYTES // 8
    for block in (n, n // 2):
        space = torch.arange(4 * n, dtype=torch.int64, device=dev)
        table = torch.from_numpy(loop_probe_table(block - 2, 2, 2 * n)).to(dev)
        launch_compact_loop(
            space.view(torch.uint8), table, 6, 8, 2, block, 3, shape.warps, shape.ahead,
            shape.evict, shape.maxnreg,
        )  # fmt: skip
        torch.cuda.synchronize()
        want = np.arange(4 * n, dtype=np.int64)
        want[2 * n : 2 * n + block - 2] = np.arange(2, block)
        if not np.array_equal(space.cpu().numpy(), want):
            raise RuntimeError("the host-local loop kernel wrote wrong words in its self-check")


def loop_available() -> bool:
    """False where the loop kernel failed its self-check in this process (`engine()`)."""
    return bool(_state.get("loop_ok", True))


def reset() -> None:
    """Forget the engine choice (tests)."""
    _state.pop("engine", None)
    _state.pop("hints", None)
    _state.pop("loop_ok", None)
