"""`beamserve bench route-overhead`: what one routing decision costs, and the index's memory.

Setup: 64 colocated workers, a warm `PrefixIndex` fed through `apply` with engine-format KV
events (`beamserve.kvwire.events`: each worker holds `prompts_per_worker` distinct
128K-token prompts, full-attention group for every block and the window group for the blocks
covering the last 512 tokens, as a Beam engine reports them), a `LoadBook` with work in flight
on every worker, and a `RoutingCore` with the policy under test (default `beamserve`, the
`sticky-until-saturated` default).

Measured (wall clock, this process):

* `decision_p50_ms` / `decision_p99_ms` — ``core.decide`` for a 128K-token prompt (2,048
  block hashes) that continues a prompt resident on one worker (its session's warm worker):
  index match over all 64 workers, views, policy. Hashing is *not* included. ``decisions``
  measured decisions (default 2,000, so that p99 is the 20th-slowest, not an outlier) after
  ``max(16, decisions/10)`` unmeasured warm-up ones; then ``gc.collect(); gc.freeze()``, as the
  router does once started (`RouterRuntime.start`, `RuntimeConfig.freeze_gc`);
* `decision_cpu_p99_ms` — the same decisions' p99 in this thread's CPU time: what a decision
  costs when other processes preempt this one (the wall-clock p99 includes the preemption);
* `hashing_ms` — ``beamserve.kvwire.hashing.block_hashes`` over the prompt's 131,072 token
  ids (vLLM's sha256 scheme), median of a few runs, reported separately;
* `dispatch_p99_ms` — ``core.dispatched`` (predictions for 2,048 blocks + load booking);
* `decisions_per_s` — 1 / mean decision time (one core, one thread);
* `index_mb_per_million_blocks` — `measure_index_memory` (tracemalloc) for `memory_blocks`
  blocks spread over 64 workers, scaled to MB (10⁶ B) per million indexed blocks.

Goals (issue 4): decision p99 ≤ 2 ms; ≤ 128 MB per million blocks.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from beamserve.kvwire.events import (
    FULL_ATTENTION_KIND,
    SLIDING_WINDOW_KIND,
    BlockStored,
    KVEventBatch,
)
from beamserve.kvwire.geometry import KVGeometry
from beamserve.kvwire.hashing import block_hashes
from beamserve.router.core import CoreConfig, RoutingCore
from beamserve.router.index.prefix_index import PrefixIndex, measure_index_memory
from beamserve.router.load import LoadBook
from beamserve.router.types import Endpoint, RouteRequest

from .replay import make_policy

PROMPT_TOKENS = 131_072
BLOCK = 64
WINDOW = 512
DECISION_P99_GOAL_MS = 2.0
INDEX_MB_GOAL = 128.0


@dataclass(frozen=True)
class OverheadResult:
    policy: str
    workers: int
    prompt_tokens: int
    indexed_blocks: int
    decisions: int
    decision_p50_ms: float
    decision_p99_ms: float
    decision_cpu_p99_ms: float
    dispatch_p99_ms: float
    hashing_ms: float
    decisions_per_s: float
    index_mb_per_million_blocks: float

    @property
    def goals_met(self) -> bool:
        return (
            self.decision_p99_ms <= DECISION_P99_GOAL_MS
            and self.index_mb_per_million_blocks <= INDEX_MB_GOAL
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["goals"] = {
            "decision_p99_ms_max": DECISION_P99_GOAL_MS,
            "index_mb_per_million_blocks_max": INDEX_MB_GOAL,
        }
        return out


def _stored(hashes: tuple[int, ...], group: int, kind: str) -> BlockStored:
    return BlockStored(
        hashes,
        None,
        (),
        BLOCK,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=WINDOW if kind == SLIDING_WINDOW_KIND else None,
    )


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def measure_overhead(
    *,
    policy: str = "beamserve",
    workers: int = 64,
    prompts_per_worker: int = 4,
    decisions: int = 2000,
    memory_blocks: int = 500_000,
    profile: str = "h200-bf16-tp8",
    seed: int = 0,
) -> OverheadResult:
    """Run the measurement (see the module docstring)."""
    rng = random.Random(seed)
    n_blocks = PROMPT_TOKENS // BLOCK
    endpoints = [Endpoint(id=f"w{i}", url=f"http://w{i}") for i in range(workers)]
    index = PrefixIndex()
    loads = LoadBook()
    core = RoutingCore(
        make_policy(policy, profile),
        index=index,
        loads=loads,
        config=CoreConfig(geometry=KVGeometry.of(BLOCK, WINDOW)),
    )
    # Each prompt is a chain: a shared 2K-token system prefix, then its own blocks.
    system = tuple(rng.getrandbits(64) for _ in range(32))
    resident: list[tuple[str, tuple[int, ...]]] = []
    window_blocks = WINDOW // BLOCK
    for e in endpoints:
        for _ in range(prompts_per_worker):
            chain = system + tuple(rng.getrandbits(64) for _ in range(n_blocks - len(system)))
            batch = KVEventBatch(
                0.0,
                (
                    _stored(chain, 0, FULL_ATTENTION_KIND),
                    _stored(chain[-window_blocks:], 1, SLIDING_WINDOW_KIND),
                ),
            )
            index.apply(e.id, batch)
            resident.append((e.id, chain))
        loads.start(e.id, rng.randrange(0, 60_000), rng.randrange(100_000, 2_000_000))
    indexed = index.stats().blocks

    # The queries: continue a resident prompt (its last 16 blocks are new tokens).
    queries = []
    for i in range(16):
        owner, chain = resident[rng.randrange(len(resident))]
        tail = tuple(rng.getrandbits(64) for _ in range(16))
        queries.append((owner, chain[: n_blocks - 16] + tail, i))
    times: list[float] = []
    cpu: list[float] = []
    dispatch: list[float] = []
    warmup = max(16, decisions // 10)  # warms caches and the allocator; not measured
    for k in range(warmup + decisions):
        if k == warmup:
            # As `RouterRuntime.start` does once the router is built (`freeze_gc`).
            gc.collect()
            gc.freeze()
        owner, hashes, i = queries[k % len(queries)]
        req = RouteRequest(f"r{k}", PROMPT_TOKENS, hashes, session_id=f"s{i}", turn=2)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        decision = core.decide(req, endpoints, warm=owner)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        flight = core.dispatched(req, decision)
        t2 = time.perf_counter()
        loads.finish(flight)
        if k >= warmup:
            times.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
            dispatch.append((t2 - t1) * 1e3)
    gc.unfreeze()
    warm = times

    tokens = [rng.randrange(151_936) for _ in range(PROMPT_TOKENS)]
    hash_ms = []
    for _ in range(3):
        t0 = time.perf_counter()
        block_hashes(tokens, block_size=BLOCK)
        hash_ms.append((time.perf_counter() - t0) * 1e3)

    mb = measure_index_memory(memory_blocks, workers)
    return OverheadResult(
        policy=policy,
        workers=workers,
        prompt_tokens=PROMPT_TOKENS,
        indexed_blocks=indexed,
        decisions=len(warm),
        decision_p50_ms=_pct(warm, 50),
        decision_p99_ms=_pct(warm, 99),
        decision_cpu_p99_ms=_pct(cpu, 99),
        dispatch_p99_ms=_pct(dispatch, 99),
        hashing_ms=statistics.median(hash_ms),
        decisions_per_s=1e3 / statistics.fmean(warm),
        index_mb_per_million_blocks=mb,
    )
