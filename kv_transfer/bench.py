"""`beamserve bench kv-transfer`: real transfers of Beam-shaped KV between rank processes.

For every (backend, prefill TP : decode TP, tokens) the benchmark spawns one process per rank
on each side, writes a request's KV on the prefill side (random, non-contiguous page tables),
publishes it through the real HTTP handshake, lets the decode side plan and pull it, then
checks every destination byte (needed bytes equal the source's, untouched bytes unchanged).
A plain single-threaded memcpy of the same number of bytes is timed in the same run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
)
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.rank import RankGroup
from beamserve.kv_transfer.topology import (
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)

DEFAULT_TOKENS = (2048, 32768, 81920)
DEFAULT_PAIRS = ((8, 4), (4, 8), (2, 8), (8, 8), (1, 1))
DEFAULT_BACKENDS = ("nixl", "mooncake")
PAGE_SIZE = 64
GARBAGE_SEED, SENTINEL_SEED = 11, 13


@dataclass(frozen=True)
class TransferResult:
    backend: str
    src_tp: int
    dst_tp: int
    tokens: int
    bytes_moved: int
    bytes_minimum: int
    descriptors: int
    plan_ms: float
    seconds: float
    gbps: float
    memcpy_gbps: float
    verified: bool


def pool_for(model: BeamModelConfig, tp: int, max_tokens: int, slack: float = 0.1) -> PoolLayout:
    """A pool with room for `max_tokens` plus `slack` spare pages (so tables are scattered)."""
    full = pages_needed(max_tokens, PAGE_SIZE)
    win = pages_needed(model.sliding_window, PAGE_SIZE) + 1
    return PoolLayout(
        model, PoolTopology(tp, PAGE_SIZE), int(full * (1 + slack)) + 1, int(win * (1 + slack)) + 2
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


class PairRig:
    """A prefill group, a decode group and the handshake between them, reused across sizes."""

    def __init__(
        self, model: BeamModelConfig, src_tp: int, dst_tp: int, backend: str, max_tokens: int
    ) -> None:
        self.backend = backend
        self.src = pool_for(model, src_tp, max_tokens)
        self.dst = pool_for(model, dst_tp, max_tokens)
        self.prefill = RankGroup("prefill", self.src, backend)
        try:
            self.decode = RankGroup("decode", self.dst, backend)
        except BaseException:
            self.prefill.close()
            raise
        self.prefill.call_all("fill_random", GARBAGE_SEED)
        self.registry = PrefillKVRegistry(
            f"prefill-{backend}", self.src, backend, self.prefill.infos
        )
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(self.decode)
        self._rng = np.random.default_rng(0)
        self._n = 0

    def run(self, tokens: int, deadline_s: float = 300.0, verify: bool = True) -> TransferResult:
        self._n += 1
        rid, seed = f"bench-{self._n}", 1000 + self._n
        sp = scattered_pages(self.src, tokens, self._rng)
        dp = scattered_pages(self.dst, tokens, self._rng)
        self.prefill.call_all("write_request", tokens, sp, seed)
        self.decode.call_all("fill_random", SENTINEL_SEED)
        self.registry.publish(rid, tokens, sp)
        res = self.client.pull(self.server.url, rid, dp, deadline_s)
        ok = True
        if verify:
            ok = all(v.ok for v in self.decode.call_all("verify", tokens, dp, seed, SENTINEL_SEED))
        gbps = res.bytes_moved / res.seconds / 1e9 if res.seconds > 0 else 0.0
        return TransferResult(
            backend=self.backend,
            src_tp=self.src.topology.tp_size,
            dst_tp=self.dst.topology.tp_size,
            tokens=tokens,
            bytes_moved=res.bytes_moved,
            bytes_minimum=bytes_minimum(self.dst, tokens),
            descriptors=res.plan.descriptors,
            plan_ms=round(res.plan_ms, 3),
            seconds=round(res.seconds, 4),
            gbps=round(gbps, 3),
            memcpy_gbps=round(memcpy_gbps(res.bytes_moved), 3),
            verified=ok,
        )

    def warm_up(self) -> None:
        """One small transfer so that connection set-up is not in the measured runs."""
        self.run(PAGE_SIZE, verify=False)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.decode.close()
        self.prefill.close()


def run_bench(
    tokens: Sequence[int] = DEFAULT_TOKENS,
    pairs: Sequence[tuple[int, int]] = DEFAULT_PAIRS,
    backends: Sequence[str] = DEFAULT_BACKENDS,
    model: BeamModelConfig | None = None,
    on_result: Callable[[TransferResult], None] | None = None,
) -> Iterator[TransferResult]:
    model = model or beam_1_0()
    for backend in backends:
        for src_tp, dst_tp in pairs:
            rig = PairRig(model, src_tp, dst_tp, backend, max(tokens))
            try:
                rig.warm_up()
                for n in tokens:
                    result = rig.run(n)
                    if on_result:
                        on_result(result)
                    yield result
            finally:
                rig.close()


def write_json(results: Sequence[TransferResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


def plot(results: Sequence[TransferResult], path: Path) -> None:
    """Throughput against tokens, one line per (backend, pair), memcpy as the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, backend in zip(axes, ("nixl", "mooncake"), strict=True):
        rows = [r for r in results if r.backend == backend]
        for pair in sorted({(r.src_tp, r.dst_tp) for r in rows}):
            pts = sorted((r.tokens, r.gbps) for r in rows if (r.src_tp, r.dst_tp) == pair)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=f"TP {pair[0]}→{pair[1]}",
            )
        if rows:
            sizes = sorted({r.tokens for r in rows})
            ref = [float(np.median([r.memcpy_gbps for r in rows if r.tokens == n])) for n in sizes]
            ax.plot(sizes, ref, "k:", label="memcpy, median (same run)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{backend}: Beam KV pull, prefill→decode")
        ax.set_xlabel("tokens in request")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
