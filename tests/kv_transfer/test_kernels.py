"""The one-launch device copy (`beamserve.kv_transfer.kernels`) on the CPU.

The piece table is pure numpy and tested here directly: played back row by row it must write
exactly what the runs say. The Triton kernel itself runs on the GPU (test_gpu.py's
`test_copy_runs_on_vram_matches_host` goes through it there) and, where Triton is installed,
here under Triton's CPU interpreter (`TRITON_INTERPRET=1`, in a subprocess: the flag is read
at import); CI has no Triton (a 640 MB install for this one test), so that one skips there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import numpy as np
import pytest
from beamserve.kv_transfer import kernels
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs
from hypothesis import given, settings
from hypothesis import strategies as st


def play(table: np.ndarray, src: np.ndarray, dst: np.ndarray, elem: int) -> None:
    """What the kernel does, one program (row) at a time, in bytes."""
    for so, do, n in table.tolist():
        dst[do * elem : (do + n) * elem] = src[so * elem : (so + n) * elem]


@st.composite
def runs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Non-overlapping destination runs over a 1 MiB buffer, of one alignment."""
    align = draw(st.sampled_from([1, 2, 4, 8, 16]))
    size = 1 << 20
    n = draw(st.integers(1, 40))
    lengths = [draw(st.integers(0, 200_000 // align)) * align for _ in range(n)]
    src, dst, at = [], [], 0
    for length in lengths:
        gap = draw(st.integers(0, 64)) * align
        if at + gap + length > size:
            break
        dst.append(at + gap)
        at += gap + length
        src.append(draw(st.integers(0, (size - length) // align)) * align)
    k = len(dst)
    return (
        np.array(src, dtype=np.int64),
        np.array(dst, dtype=np.int64),
        np.array(lengths[:k], dtype=np.int64),
        size,
    )


@settings(max_examples=150, deadline=None)
@given(runs(), st.sampled_from([4096, 65536, 100_000]))
def test_piece_table_writes_exactly_the_runs(case: tuple, piece: int) -> None:
    so, do, n, size = case
    rng = np.random.default_rng(len(n))
    src = rng.integers(0, 256, size, dtype=np.uint8)
    want = np.zeros(size, dtype=np.uint8)
    copy_runs(Buffer(MemoryKind.DRAM, src), so, Buffer(MemoryKind.DRAM, want), do, n)
    elem = kernels.element_bytes(so, do, n, np.array([size], dtype=np.int64))
    table = kernels.pack_pieces(so, do, n, elem, piece_bytes=piece)
    got = np.zeros(size, dtype=np.uint8)
    play(table, src, got, elem)
    assert np.array_equal(got, want)
    assert table.flags.c_contiguous and table.dtype == np.int64
    assert (table[:, 2] * elem <= max(piece - piece % elem, elem)).all()
    assert int(table[:, 2].sum()) * elem == int(n.sum())  # every byte once, none twice


def test_element_bytes_is_the_widest_common_word() -> None:
    a = np.array([16, 32, 4096], dtype=np.int64)
    assert kernels.element_bytes(a) == 8
    assert kernels.element_bytes(a, np.array([12], dtype=np.int64)) == 4
    assert kernels.element_bytes(a, np.array([6], dtype=np.int64)) == 2
    assert kernels.element_bytes(np.array([3, 16], dtype=np.int64)) == 1
    assert kernels.element_bytes(np.array([], dtype=np.int64)) == 8


def test_long_runs_split_in_order_and_short_ones_stay_whole() -> None:
    t = kernels.pack_pieces(
        np.array([0, 1 << 20], dtype=np.int64),
        np.array([8 << 20, 0], dtype=np.int64),
        np.array([200 << 10, 16 << 10], dtype=np.int64),
        8,
    )
    piece = kernels.PIECE_BYTES // 8
    assert t.tolist() == [
        [0, (8 << 20) // 8, piece],
        [piece, (8 << 20) // 8 + piece, piece],
        [2 * piece, (8 << 20) // 8 + 2 * piece, piece],
        [3 * piece, (8 << 20) // 8 + 3 * piece, (200 << 10) // 8 - 3 * piece],
        [(1 << 20) // 8, 0, (16 << 10) // 8],
    ]


def test_a_bad_engine_setting_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BEAMSERVE_KV_COPY", "cublas")
    with pytest.raises(ValueError, match=r"BEAMSERVE_KV_COPY: 'cublas'.*auto.*triton.*torch"):
        kernels.configured_engine()


def test_auto_falls_back_to_torch_and_forced_triton_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(kernels, "_probe", broken)
    kernels.reset()
    try:
        monkeypatch.setenv("BEAMSERVE_KV_COPY", "auto")
        assert kernels.engine() == "torch"
        kernels.reset()
        monkeypatch.setenv("BEAMSERVE_KV_COPY", "triton")
        with pytest.raises(RuntimeError, match="BEAMSERVE_KV_COPY=torch"):
            kernels.engine()
        kernels.reset()
        monkeypatch.setenv("BEAMSERVE_KV_COPY", "torch")
        assert kernels.engine() == "torch"
    finally:
        kernels.reset()


@pytest.mark.skipif(find_spec("triton") is None, reason="Triton is not installed (see docstring)")
def test_the_triton_kernel_under_the_cpu_interpreter() -> None:
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from beamserve.kv_transfer import kernels
        rng = np.random.default_rng(3)
        for row, count, size in ((16, 300, 1 << 16), (12, 200, 1 << 15), (4096, 40, 1 << 20),
                                 (200_000, 3, 1 << 21)):
            src = rng.integers(0, 256, size, dtype=np.uint8)
            slots = size // row
            so = rng.permutation(slots)[:count].astype(np.int64) * row
            do = rng.permutation(slots)[:count].astype(np.int64) * row
            n = np.full(len(so), row, dtype=np.int64)
            want = np.zeros(size, dtype=np.uint8)
            for a, b, k in zip(so, do, n):
                want[b:b + k] = src[a:a + k]
            dst = torch.zeros(size, dtype=torch.uint8)
            kernels.triton_copy_runs(torch.from_numpy(src), dst, so, do, n)
            assert np.array_equal(dst.numpy(), want), row
        assert kernels.engine() == "triton"
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", BEAMSERVE_KV_COPY="auto")
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --- the host-local launch shape and the loop kernel's helpers ----------------------------


def test_local_shape_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for _attr, name, _allowed in kernels._SHAPE_ENV:
        monkeypatch.delenv(name, raising=False)
    default = kernels.local_shape()
    assert default == kernels.LocalShape()
    assert (default.kernel, default.graph, default.order) == ("flat", True, "src")
    assert kernels.local_launch_shape() == (default.runs, default.warps)
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_KERNEL", "Flat")
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_PER_SM", "6")
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_GRAPH", "0")
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_MAXNREG", "0")
    got = kernels.local_shape()
    assert (got.kernel, got.per_sm, got.graph, got.maxnreg) == ("flat", 6, False, 0)
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_WARPS", "3")
    with pytest.raises(ValueError, match=r"BEAMSERVE_KV_LOCAL_WARPS.*'16'"):
        kernels.local_shape()
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_WARPS", "4")
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_PER_SM", "0")
    with pytest.raises(ValueError, match="BEAMSERVE_KV_LOCAL_PER_SM"):
        kernels.local_shape()


def test_loop_block_is_the_longest_piece_as_a_power_of_two() -> None:
    words = kernels.BLOCK_BYTES // 8
    assert kernels.loop_block(8, words) == words  # bf16 head slices: one 16 KiB step
    assert kernels.loop_block(8, words // 2) == words // 2  # fp8: 8 KiB, nothing masked
    assert kernels.loop_block(8, 3) == 4 and kernels.loop_block(8, 0) == 1
    assert kernels.loop_block(8, 10 * words) == words  # capped at one step
    assert kernels.loop_block(1, 100) == 128 and kernels.loop_block(1, 10**9) == 16384


def test_loop_probe_table_is_one_run_as_the_kernel_reads_it() -> None:
    from beamserve.kv_transfer.compact import KernelTables, program_runs

    table = kernels.loop_probe_table(2046, 2, 4096)
    t = KernelTables(table, np.zeros(1, np.int64), np.zeros(1, np.int64), 8, 2, 6, 1, 1, 16368)
    so, do, n = program_runs(t, table)
    assert (so.tolist(), do.tolist(), n.tolist()) == ([2], [4096], [2046])
    assert int(table[5]) == 1  # one piece: the kernel's bound
