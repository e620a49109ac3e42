"""`beamserve bench kv-transfer`: real transfers of Beam-shaped KV between rank processes.

For every (backend, memory, KV dtype, prefill TP : decode TP, tokens, path) the benchmark spawns
one process per rank on each side, with its KV region in host memory (`dram`) or on the GPU
(`vram`), writes a request's KV on the prefill side (random, non-contiguous page tables),
publishes it through the real HTTP handshake, lets the decode side plan and pull it by the
asked path (`direct`, `staged` or `auto`), then checks every destination byte (needed bytes
equal the source's, untouched bytes unchanged).

The same-run baseline moves the same number of bytes with no plan at all: for DRAM a plain
single-threaded memcpy in this process; for VRAM one device-to-device copy between a prefill
rank process and a decode rank process through CUDA IPC (`cudaMemcpy` of the whole size).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

import numpy as np
from beamserve.kv_transfer.cost import TransferPath
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
)
from beamserve.kv_transfer.memory import MemoryKind
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.rank import RankGroup
from beamserve.kv_transfer.topology import (
    KVDtype,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)

DEFAULT_TOKENS = (2048, 32768, 81920)
DEFAULT_PAIRS = ((8, 4), (4, 8), (2, 8), (8, 8), (1, 1))
DEFAULT_BACKENDS = ("nixl", "mooncake", "cma", "shm")
PAGE_SIZE = 64
GARBAGE_SEED, SENTINEL_SEED = 11, 13
# Staging pool per rank and wire chunk, by memory kind (host memory is scarcer than HBM here).
STAGING_BYTES = {MemoryKind.DRAM: 512 << 20, MemoryKind.VRAM: 4 << 30}
CHUNK_BYTES = {MemoryKind.DRAM: 128 << 20, MemoryKind.VRAM: 1 << 30}


@dataclass(frozen=True)
class TransferResult:
    backend: str
    src_tp: int
    dst_tp: int
    tokens: int
    bytes_moved: int  # on the wire
    bytes_minimum: int
    descriptors: int  # of the direct plan
    plan_ms: float
    seconds: float
    gbps: float
    memcpy_gbps: float  # the same-run baseline (see `baseline`), GB/s
    verified: bool
    memory: str = MemoryKind.DRAM.value
    kv_dtype: str = KVDtype.BF16.value
    path: str = TransferPath.DIRECT.value  # asked for
    path_taken: str = TransferPath.DIRECT.value
    descriptors_on_wire: int = 0
    staging_bytes: int = 0
    gather_ms: float = 0.0
    transfer_ms: float = 0.0
    scatter_ms: float = 0.0
    rounds: int = 0
    baseline: str = "memcpy"
    baseline_ratio: float = 0.0
    estimate_direct_ms: float = 0.0
    estimate_staged_ms: float = 0.0
    gather_rank_ms: float = 0.0  # gather copies alone on the slowest source rank (in gather_ms)
    copy_engine: str = ""  # what moved local copies on decode rank 0: numpy, triton or torch
    driver: str = "ranks"  # who copied: each decode rank, or one host_local launch
    kernel_ms: float = 0.0  # host_local: the one launch alone (device events)
    drive_ms: float = 0.0  # host_local: inside the driver process (bind, upload, launch, wait)
    estimate_local_ms: float = 0.0
    driver_in: str = ""  # host_local: "rank0" (decode rank 0's process) or "caller" (this one)
    local_phases_ms: dict[str, float] = dc_field(default_factory=dict)  # checks, bind, pipes…
    # `--repeats N`: the row is the median of N pulls (fresh requests), the baseline the median
    # of its N same-run measurements; every pull's seconds in the order they ran.
    repeats: int = 1
    seconds_each: list[float] = dc_field(default_factory=list)


def pool_for(
    model: BeamModelConfig,
    tp: int,
    max_tokens: int,
    slack: float = 0.1,
    kv_dtype: KVDtype = KVDtype.BF16,
) -> PoolLayout:
    """A pool with room for `max_tokens` plus `slack` spare pages (so tables are scattered)."""
    full = pages_needed(max_tokens, PAGE_SIZE)
    win = pages_needed(model.sliding_window, PAGE_SIZE) + 1
    return PoolLayout(
        model,
        PoolTopology(tp, PAGE_SIZE, kv_dtype),
        int(full * (1 + slack)) + 1,
        int(win * (1 + slack)) + 2,
    )


def scattered_pages(layout: PoolLayout, seq_len: int, rng: np.random.Generator) -> RequestPages:
    """Page tables drawn at random from the pool, as a long-running engine's would be."""
    P, W = layout.topology.page_size, layout.model.sliding_window
    n_full = pages_needed(seq_len, P)
    n_win = n_full - first_window_page(seq_len, W, P) if seq_len else 0
    return RequestPages.of(
        rng.permutation(layout.full_pages)[:n_full], rng.permutation(layout.window_pages)[:n_win]
    )


def memcpy_gbps(nbytes: int, chunk: int = 256 << 20) -> float:
    """Single-threaded plain copy of `nbytes` (in `chunk`-sized pieces), GB/s."""
    n = max(1, min(nbytes, chunk))
    a = np.ones(n, dtype=np.uint8)
    b = np.zeros(n, dtype=np.uint8)
    np.copyto(b, a)  # fault the pages in before timing
    done, t0 = 0, time.perf_counter()
    while done < nbytes:
        np.copyto(b, a)
        done += n
    return done / (time.perf_counter() - t0) / 1e9


def ipc_baseline_gbps(prefill: RankGroup, decode: RankGroup, nbytes: int) -> float:
    """One device-to-device copy of `nbytes` from prefill rank 0's process into decode rank 0's
    through CUDA IPC (median of three, CUDA events), GB/s."""
    blob = prefill.call([0], "export_scratch", lambda _r: (nbytes,), 120.0)[0]
    try:
        secs = decode.call([0], "copy_from_scratch", lambda _r: (blob,), 120.0)[0]
    finally:
        prefill.call([0], "drop_scratch", lambda _r: (), 60.0)
        decode.call([0], "drop_scratch", lambda _r: (), 60.0)
    return float(nbytes / secs / 1e9) if secs > 0 else 0.0


class PairRig:
    """A prefill group, a decode group and the handshake between them, reused across sizes."""

    def __init__(
        self,
        model: BeamModelConfig,
        src_tp: int,
        dst_tp: int,
        backend: str,
        max_tokens: int,
        memory: MemoryKind = MemoryKind.DRAM,
        kv_dtype: KVDtype = KVDtype.BF16,
        staging_bytes: int | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self.backend, self.memory = backend, MemoryKind(memory)
        self.kv_dtype = KVDtype(kv_dtype)
        stage = STAGING_BYTES[self.memory] if staging_bytes is None else staging_bytes
        self.src = pool_for(model, src_tp, max_tokens, kv_dtype=self.kv_dtype)
        self.dst = pool_for(model, dst_tp, max_tokens, kv_dtype=self.kv_dtype)
        self.prefill = RankGroup("prefill", self.src, backend, self.memory, stage)
        try:
            self.decode = RankGroup("decode", self.dst, backend, self.memory, stage)
        except BaseException:
            self.prefill.close()
            raise
        self.prefill.call_all("fill_random", GARBAGE_SEED)
        self.registry = PrefillKVRegistry(
            f"prefill-{backend}",
            self.src,
            backend,
            self.prefill.infos,
            stager=self.prefill if stage > 0 else None,
            staging_bytes=stage,
            memory=self.memory,
        )
        self.server = HandshakeServer(build_handshake_app(self.registry))
        chunk = CHUNK_BYTES[self.memory] if chunk_bytes is None else chunk_bytes
        self.client = DecodeKVClient(self.decode, chunk_bytes=chunk)
        self._rng = np.random.default_rng(0)
        self._n = 0
        self.copy_engine = str(self.decode.call([0], "copy_engine", lambda _r: (), 60.0)[0])

    def run(
        self,
        tokens: int,
        deadline_s: float = 300.0,
        verify: bool = True,
        path: TransferPath = TransferPath.DIRECT,
    ) -> TransferResult:
        self._n += 1
        rid, seed = f"bench-{self._n}", 1000 + self._n
        sp = scattered_pages(self.src, tokens, self._rng)
        dp = scattered_pages(self.dst, tokens, self._rng)
        self.prefill.call_all("write_request", tokens, sp, seed)
        self.decode.call_all("fill_random", SENTINEL_SEED)
        self.registry.publish(rid, tokens, sp)
        res = self.client.pull(self.server.url, rid, dp, deadline_s, path=path)
        ok = True
        if verify:
            ok = all(v.ok for v in self.decode.call_all("verify", tokens, dp, seed, SENTINEL_SEED))
        gbps = res.bytes_moved / res.seconds / 1e9 if res.seconds > 0 else 0.0
        if self.memory is MemoryKind.VRAM:
            base = "cuda_ipc"
            base_gbps = ipc_baseline_gbps(self.prefill, self.decode, res.bytes_moved)
        else:
            base, base_gbps = "memcpy", memcpy_gbps(res.bytes_moved)
        choice = res.choice
        return TransferResult(
            backend=self.backend,
            src_tp=self.src.topology.tp_size,
            dst_tp=self.dst.topology.tp_size,
            tokens=tokens,
            bytes_moved=res.bytes_moved,
            bytes_minimum=bytes_minimum(self.dst, tokens),
            descriptors=res.plan.descriptors,
            plan_ms=round(res.plan_ms, 3),
            seconds=round(res.seconds, 5),
            gbps=round(gbps, 3),
            memcpy_gbps=round(base_gbps, 3),
            verified=ok,
            memory=self.memory.value,
            kv_dtype=self.kv_dtype.value,
            path=TransferPath(path).value,
            path_taken=res.path.value,
            descriptors_on_wire=res.descriptors_on_wire,
            staging_bytes=res.staging_bytes,
            gather_ms=round(res.gather_ms, 3),
            transfer_ms=round(res.transfer_ms, 3),
            scatter_ms=round(res.scatter_ms, 3),
            rounds=res.rounds,
            baseline=base,
            baseline_ratio=round(gbps / base_gbps, 3) if base_gbps else 0.0,
            estimate_direct_ms=round(choice.direct_s * 1e3, 3) if choice else 0.0,
            estimate_staged_ms=round(choice.staged_s * 1e3, 3) if choice else 0.0,
            gather_rank_ms=round(res.gather_rank_ms, 3),
            copy_engine=self.copy_engine,
            driver=res.driver,
            kernel_ms=round(res.kernel_ms, 3),
            drive_ms=round(res.drive_ms, 3),
            estimate_local_ms=round(choice.local_s * 1e3, 3) if choice else 0.0,
            driver_in=res.driver_in,
            local_phases_ms=dict(res.phases_ms),
        )

    def pool_stats(self) -> list[object]:
        """Staging pools of every rank, prefill first (for leak checks)."""
        return list(self.prefill.call_all("pool_stats")) + list(self.decode.call_all("pool_stats"))

    def warm_up(self, paths: Sequence[TransferPath] = (TransferPath.DIRECT,)) -> None:
        """One small transfer per path so that connection set-up is not in the measured runs."""
        for path in paths:
            self.run(PAGE_SIZE, verify=False, path=path)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.decode.close()
        self.prefill.close()


def combine(runs: Sequence[TransferResult]) -> TransferResult:
    """One row for `runs` of the same (backend, pair, size, path): the median pull (the lower
    middle of an even count: a pull that happened, with its own phases), against the median
    of the runs' same-run baselines; verified only if every pull was."""
    if not runs:
        raise ValueError("combine: no runs")
    first = runs[0]
    keys = {(r.backend, r.src_tp, r.dst_tp, r.tokens, r.path, r.kv_dtype) for r in runs}
    if len(keys) != 1:
        raise ValueError(f"combine: runs of different rows {sorted(keys)}")
    ranked = sorted(runs, key=lambda r: r.seconds)
    mid = ranked[(len(ranked) - 1) // 2]
    base = float(np.median([r.memcpy_gbps for r in runs]))
    same = all(r.bytes_moved == first.bytes_moved for r in runs)
    return dataclasses.replace(
        mid,
        memcpy_gbps=round(base, 3),
        baseline_ratio=round(mid.gbps / base, 3) if base else 0.0,
        verified=all(r.verified for r in runs),
        bytes_moved=first.bytes_moved if same else -1,  # -1 never equals bytes_minimum
        repeats=len(runs),
        seconds_each=[r.seconds for r in runs],
    )


def run_bench(
    tokens: Sequence[int] = DEFAULT_TOKENS,
    pairs: Sequence[tuple[int, int]] = DEFAULT_PAIRS,
    backends: Sequence[str] = DEFAULT_BACKENDS,
    model: BeamModelConfig | None = None,
    on_result: Callable[[TransferResult], None] | None = None,
    memory: MemoryKind = MemoryKind.DRAM,
    paths: Sequence[TransferPath] = (TransferPath.DIRECT,),
    kv_dtypes: Sequence[KVDtype] = (KVDtype.BF16,),
    staging_bytes: int | None = None,
    chunk_bytes: int | None = None,
    repeats: int = 1,
) -> Iterator[TransferResult]:
    """Rows in (backend, dtype, pair, size, path) order; each the median of `repeats` pulls of
    fresh requests (`combine`)."""
    model = model or beam_1_0()
    for backend in backends:
        for dtype in kv_dtypes:
            for src_tp, dst_tp in pairs:
                rig = PairRig(
                    model, src_tp, dst_tp, backend, max(tokens), memory, dtype,
                    staging_bytes, chunk_bytes,
                )  # fmt: skip
                try:
                    rig.warm_up(paths)
                    for n in tokens:
                        for path in paths:
                            result = combine([rig.run(n, path=path) for _ in range(repeats)])
                            if on_result:
                                on_result(result)
                            yield result
                finally:
                    rig.close()


def write_json(results: Sequence[TransferResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


def plot(results: Sequence[TransferResult], path: Path) -> None:
    """Throughput against tokens, one line per (backend, pair), the baseline as the reference;
    with a single token count, bars per (pair, KV dtype) and path, and the phases of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len({r.tokens for r in results}) == 1 and results:
        _plot_bars(results, path, plt)
        return
    panels = sorted({(r.backend, r.memory, r.path) for r in results})
    fig, axes_ = plt.subplots(1, max(2, len(panels)), figsize=(6 * max(2, len(panels)), 4.5))
    axes = list(axes_)
    for ax, (backend, memory, way) in zip(axes, panels, strict=False):
        rows = [r for r in results if (r.backend, r.memory, r.path) == (backend, memory, way)]
        for pair in sorted({(r.src_tp, r.dst_tp, r.kv_dtype) for r in rows}):
            pts = sorted(
                (r.tokens, r.gbps) for r in rows if (r.src_tp, r.dst_tp, r.kv_dtype) == pair
            )
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=f"TP {pair[0]}→{pair[1]} {pair[2]}",
            )
        if rows:
            sizes = sorted({r.tokens for r in rows})
            ref = [float(np.median([r.memcpy_gbps for r in rows if r.tokens == n])) for n in sizes]
            ax.plot(sizes, ref, "k:", label=f"{rows[0].baseline}, median (same run)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{backend} {memory} --path {way}: Beam KV pull")
        ax.set_xlabel("tokens in request")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bars(results: Sequence[TransferResult], path: Path, plt: Any) -> None:
    groups = sorted({(r.backend, r.memory, r.kv_dtype, r.src_tp, r.dst_tp) for r in results})
    paths = [p for p in ("direct", "staged", "auto") if any(r.path == p for r in results)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(12, 1.4 * len(groups) * 2), 5))
    width = 0.8 / max(1, len(paths))
    for i, way in enumerate(paths):
        ys = []
        for g in groups:
            hit = [r for r in results if (r.backend, r.memory, r.kv_dtype, r.src_tp, r.dst_tp) == g]
            ys.append(next((r.gbps for r in hit if r.path == way), 0.0))
        ax.bar(np.arange(len(groups)) + i * width, ys, width, label=f"--path {way}")
    base = float(np.median([r.memcpy_gbps for r in results]))
    ax.axhline(base, color="k", ls=":", label=f"{results[0].baseline} (same run), median")
    labels = [f"{g[3]}:{g[4]}\n{g[2]}" for g in groups]
    ax.set_xticks(np.arange(len(groups)) + width * (len(paths) - 1) / 2, labels, fontsize=8)
    ax.set_ylabel("GB/s (bytes on the wire / pull seconds)")
    ax.set_yscale("log")
    ax.set_title(f"{results[0].backend} {results[0].memory}: {results[0].tokens:,}-token Beam KV")
    ax.legend(fontsize=8)
    staged = [r for r in results if r.path_taken == "staged"]
    names = [f"{r.src_tp}:{r.dst_tp} {r.kv_dtype}" for r in staged]
    bottom = np.zeros(len(staged))
    for field, label in (
        ("plan_ms", "plan (decode)"),
        ("gather_ms", "stage call (HTTP, prefill plan, gather)"),
        ("transfer_ms", "transfer (wire)"),
        ("scatter_ms", "scatter"),
    ):
        vals = np.array([getattr(r, field) for r in staged])
        bx.barh(names, vals, left=bottom, label=label)
        bottom += vals
    bx.set_xlabel("ms")
    bx.set_title("staged path: where the time goes")
    bx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
