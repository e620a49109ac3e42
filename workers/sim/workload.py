"""Agentic session workloads and their closed-loop replay on a simulated engine.

A session is a sequence of turns; each turn's prompt extends the previous one (the agent's
context grows) and the next turn is sent `think_time_s` after the previous answer completes —
a closed loop, as agent harnesses behave. Block hashes are namespaced per session: block `j`
of session `s` has hash `base(s) + j` in every turn, where `base(s)` is a well-mixed 63-bit
number (SplitMix64 of `s`), so a turn hits exactly the blocks its predecessor completed,
sessions never share a prefix by accident, and the hashes spread like real 64-bit block
hashes in a hash table.

Shapes (docs/sim.md, "Workloads", gives the reasoning and the sensitivity):

- `OPENHANDS`: the seeds' OpenHands replay (data/traces/README.md): a 74K-token first
  prompt, +753 tokens and 220 output tokens per turn, 13 turns (≈92% prefix-cache hit). The
  tool time between turns is not published; 2.7 s (ASSUMED, set by the published throughput)
  — the claude-code set's think time has p10 4 s, OpenHands' local tools are quicker.
- `AGENTX`: not documented anywhere we can read. ASSUMED: the context shape of the claude-code
  trace set's main-agent turns (the set the README calls "the workload Beam was built for"):
  69K-token first prompt (p50 of first requests), +822 tokens per turn (p50 growth), 15 turns
  (p50); 880 output tokens per turn (a reasoning-heavy agent: the set's p90 is 866; the value
  is set by the published 96-session throughput) and no tool time (the next turn goes out as
  soon as the answer is complete).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from beamserve.workers.sim.clock import VirtualClock
from beamserve.workers.sim.engine import SimEngine
from beamserve.workers.sim.request import RequestMetrics, RequestUpdate, SimRequest, percentile

_MASK64 = (1 << 64) - 1


def session_hash_base(index: int) -> int:
    """SplitMix64 of `index`, shifted to 63 bits: where session `index`'s block hashes start."""
    z = (index * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class Turn:
    """One request of a session: its prompt (length and block hashes), its answer length, and
    the agent's pause after the answer before the next turn."""

    prompt_tokens: int
    block_hashes: tuple[int, ...]
    output_tokens: int
    think_time_s: float = 0.0


@dataclass(frozen=True)
class SessionShape:
    """A synthetic agent session: prompt `first_prompt_tokens + k · growth_tokens_per_turn` at
    turn k, `output_tokens_per_turn` tokens out, `think_time_s` between turns."""

    name: str
    first_prompt_tokens: int
    growth_tokens_per_turn: int
    output_tokens_per_turn: int
    turns: int
    think_time_s: float = 0.0
    source: str = ""

    def session(self, index: int, page_size: int = 64) -> list[Turn]:
        """Session `index`'s turns, with hashes namespaced by `index`."""
        base = session_hash_base(index)
        turns = []
        for k in range(self.turns):
            prompt = self.first_prompt_tokens + k * self.growth_tokens_per_turn
            hashes = tuple(range(base, base + prompt // page_size))
            turns.append(Turn(prompt, hashes, self.output_tokens_per_turn, self.think_time_s))
        return turns

    def cache_hit_ratio(self, page_size: int = 64) -> float:
        """Prompt tokens a perfect prefix cache serves, over all prompt tokens."""
        total = hit = 0
        prev = 0
        for k in range(self.turns):
            prompt = self.first_prompt_tokens + k * self.growth_tokens_per_turn
            total += prompt
            hit += min(prev, (prompt - 1) // page_size) * page_size
            prev = prompt // page_size
        return hit / total


OPENHANDS = SessionShape(
    name="openhands",
    first_prompt_tokens=74_000,
    growth_tokens_per_turn=753,
    output_tokens_per_turn=220,
    turns=13,
    think_time_s=2.7,
    source="data/traces/README.md (seeds' OpenHands replay)",
)

AGENTX = SessionShape(
    name="agentx",
    first_prompt_tokens=69_000,
    growth_tokens_per_turn=822,
    output_tokens_per_turn=880,
    turns=15,
    think_time_s=0.0,
    source="ASSUMED: claude-code trace set medians (docs/sim.md)",
)

SHAPES = {s.name: s for s in (OPENHANDS, AGENTX)}


@dataclass(frozen=True)
class ReplayResult:
    """A replay's requests and its clock span; throughput and per-user speeds derive from it.

    `wall_seconds` is the host time the replay took; `sim_seconds / wall_seconds` is the
    simulator's speed.
    """

    requests: tuple[RequestMetrics, ...]
    sim_seconds: float
    wall_seconds: float
    gpus: int

    @property
    def speedup(self) -> float:
        return self.sim_seconds / self.wall_seconds if self.wall_seconds > 0 else float("inf")

    @property
    def total_tokens(self) -> int:
        """Prompt tokens (cached ones included) plus output tokens."""
        return sum(r.prompt_tokens + r.output_tokens for r in self.requests)

    @property
    def total_tokens_per_gpu_s(self) -> float:
        """Total throughput per GPU, counting cache hits (the published metric)."""
        return self.total_tokens / self.sim_seconds / self.gpus

    @property
    def output_tokens_per_gpu_s(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.sim_seconds / self.gpus

    @property
    def cache_hit_ratio(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.requests)
        return sum(r.cached_tokens for r in self.requests) / prompt if prompt else 0.0

    def per_user_tokens_per_s(self, pct: float) -> float:
        """Per-user decode speed at percentile `pct` of the per-request time per output token
        (pct 50 = median user; pct 90 = the slowest 10% boundary): 1 / tpot_pct."""
        tpots = [t for r in self.requests if (t := r.tpot) is not None and t > 0]
        return 1.0 / percentile(tpots, pct)

    def ttft(self, pct: float) -> float:
        return percentile([t for r in self.requests if (t := r.ttft) is not None], pct)


def replay_sessions(
    engine: SimEngine,
    clock: VirtualClock,
    sessions: Sequence[Sequence[Turn]],
    *,
    start_times: Sequence[float] | None = None,
    on_finish: Callable[[RequestMetrics], None] | None = None,
) -> ReplayResult:
    """Run every session closed-loop on `engine` until all turns are answered.

    Session i starts at `start_times[i]` (default 0). Each turn is submitted when the previous
    answer has completed plus its think time. Returns the finished requests in completion order
    and the span from the first arrival to the last completion.
    """
    done: list[RequestMetrics] = []
    starts = list(start_times) if start_times is not None else [0.0] * len(sessions)
    t0 = clock.now()

    def submit(si: int, k: int, at: float) -> None:
        turn = sessions[si][k]
        request = SimRequest(
            request_id=f"s{si}-t{k}",
            prompt_tokens=turn.prompt_tokens,
            block_hashes=turn.block_hashes,
            max_output_tokens=turn.output_tokens,
            arrival_time=at,
        )

        def listener(u: RequestUpdate) -> None:
            if not u.finished or u.metrics is None:
                return
            done.append(u.metrics)
            if on_finish is not None:
                on_finish(u.metrics)
            if k + 1 < len(sessions[si]):
                submit(si, k + 1, u.time + turn.think_time_s)

        engine.submit(request, listener, stream=False)

    for si, session in enumerate(sessions):
        if session:
            submit(si, 0, t0 + starts[si])
    wall0 = time.perf_counter()
    # The replay allocates many small objects but builds no reference cycles worth chasing:
    # pausing the cyclic collector makes it markedly faster.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        clock.run()
    finally:
        if gc_was_on:
            gc.enable()
    wall = time.perf_counter() - wall0
    first = min((r.arrival_time for r in done), default=t0)
    last = max((r.finish_time for r in done), default=t0)
    return ReplayResult(tuple(done), last - first, wall, engine.config.profile.gpus)
