#!/usr/bin/env python3
"""How much prefill an agentic workload asks of each worker, against how much a worker can do
while its users keep their decode speed — the arithmetic behind the goodput ceiling.

    .venv/bin/python scripts/prefill-budget.py [--sessions 192] [--max-turns 8]
        [--token-scale 0.25] [--output-tokens 64] [--workers 4] [--profile h200-bf16-tp8]
        [--budget N] [--decode-batch 16] [--slo-tok-s 20] [--duration-s 87]

Workload: the claude-code sessions `beamserve bench agentic` replays (same selection, scaling
and block texts). Every prompt is split into what a perfect prefix cache (a session's previous
turn fully resident, no eviction) would still have to prefill: a first turn's whole prompt, a
continuing turn's part past the longest prefix of blocks it shares with the turn before (the
chat wrapper's tokens counted as new, the engine's page rounding not: each within 64 tokens a
turn, under 5 % of the total here). That is the prefill every router must get done, whatever it
does; the printed hit ratio is the best any router can reach.

Worker: the sim's latency model for the profile (`beamserve.workers.sim.latency`), a decode
batch of `--decode-batch` users beside prefill chunks of the engine's token budget (`--budget`,
the workers' `--max-num-batched-tokens`; default the profile's `max_batched_tokens`). A user
decoding on a worker where a fraction x of the steps carry a chunk gets one token per step,
so it keeps `--slo-tok-s` only while

    (1 − x) · t_decode + x · t_chunk ≤ 1 / slo_tok_s,

which caps the prefill the worker can do beside its decodes at

    x_max · chunk / ((1 − x_max) · t_decode + x_max · t_chunk)   tokens/s.

With `--duration-s` (a run's measured duration), the workload's demand per worker over that
time is printed beside the cap: a demand near or above it means no placement or admission
order keeps every user at the SLO's speed without the run taking longer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from beamserve.kvwire.codec import ApproxCodec
from beamserve.router.bench.agentic_workload import (
    PromptBuilder,
    block_tokens_for,
    default_trace_dir,
    load_sessions,
)
from beamserve.workers.sim.latency import LatencyModel, StepWork, causal_keys
from beamserve.workers.sim.profiles import get_profile


def chat_wrapper_tokens() -> int:
    """Tokens the bench's workers (the sim's codec, no checkpoint) add around one message."""
    codec = ApproxCodec()
    return len(codec.encode(codec.render([{"role": "user", "content": ""}])))


def uncached_parts(args: argparse.Namespace) -> tuple[list[int], list[int], int, int]:
    """(first-turn prompts, continuing turns' new parts, all prompt tokens, requests)."""
    sessions = load_sessions(
        args.trace,
        sessions=args.sessions,
        token_scale=args.token_scale,
        output_cap=args.output_tokens,
        max_turns=args.max_turns,
    )
    builder = PromptBuilder(block_tokens_for(args.token_scale))
    block, wrapper = builder.block_tokens, chat_wrapper_tokens()
    first: list[int] = []
    later: list[int] = []
    total = requests = 0
    for session in sessions:
        previous: tuple[int, ...] = ()
        for turn in session.turns:
            prompt = builder.prompt_tokens(turn.hash_ids) + wrapper
            shared = 0
            for a, b in zip(previous, turn.hash_ids, strict=False):
                if a != b:
                    break
                shared += 1
            (first if turn.index == 0 else later).append(prompt - shared * block)
            total += prompt
            requests += 1
            previous = turn.hash_ids
    return first, later, total, requests


def pace_cap(
    lat: LatencyModel, budget: int, batch: int, context: int, slo_tok_s: float
) -> tuple[float, float, float, float]:
    """(t_decode, t_chunk, x_max, prefill tokens/s) for `batch` users of `context` tokens."""
    window = lat.window
    decode = StepWork(
        decode_requests=batch,
        decode_query_tokens=1,
        decode_context=batch * context,
        decode_window=batch * min(context, window),
    )
    chunk = budget - batch  # decodes take their tokens of the budget first
    mixed = decode._replace(
        prefill_tokens=chunk,
        prefill_keys_full=causal_keys(0, chunk),
        prefill_keys_window=causal_keys(0, chunk, window),
    )
    t_d, t_c = lat.step_seconds(decode), lat.step_seconds(mixed)
    x = min(max((1.0 / slo_tok_s - t_d) / (t_c - t_d), 0.0), 1.0)
    rate = x * chunk / ((1 - x) * t_d + x * t_c)
    return t_d, t_c, x, rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=None, help="default: the bundled claude-code set")
    p.add_argument("--sessions", type=int, default=192)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--token-scale", type=float, default=0.25)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="h200-bf16-tp8")
    p.add_argument("--budget", type=int, default=None, help="tokens a step (default: profile's)")
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--context", type=int, default=28_000, help="tokens per decoding user")
    p.add_argument("--slo-tok-s", type=float, default=20.0)
    p.add_argument("--duration-s", type=float, default=None)
    args = p.parse_args()
    args.trace = args.trace or default_trace_dir()

    first, later, total, requests = uncached_parts(args)
    profile = get_profile(args.profile)
    lat = LatencyModel(profile)
    budget = args.budget or profile.max_batched_tokens
    uncached = sum(first) + sum(later)
    print(f"workload: {requests} requests, {total:,} prompt tokens")
    print(f"  first turns      {len(first):5d}  {sum(first):12,} tokens to prefill")
    print(f"  continuing turns {len(later):5d}  {sum(later):12,} tokens to prefill")
    print(f"  perfect-cache hit ratio {1 - uncached / total:.3f}")
    t_d, t_c, x, rate = pace_cap(lat, budget, args.decode_batch, args.context, args.slo_tok_s)
    alone = budget / lat.prefill_seconds(budget)
    print(
        f"worker ({args.profile}, budget {budget:,} tokens a step, {args.decode_batch} users "
        f"of {args.context:,} tokens): decode step {t_d * 1e3:.1f} ms, with a full chunk "
        f"{t_c * 1e3:.1f} ms"
    )
    print(f"  prefill alone: {alone:,.0f} tokens/s")
    print(
        f"  prefill beside decodes at ≥ {args.slo_tok_s:g} tok/s per user: at most "
        f"{x:.0%} of steps with a chunk, {rate:,.0f} tokens/s"
    )
    if args.duration_s:
        demand = uncached / args.workers / args.duration_s
        print(
            f"demand over {args.duration_s:g} s on {args.workers} workers: {demand:,.0f} "
            f"tokens/s per worker = {demand / rate:.2f} × the pace-keeping cap, "
            f"{demand / alone:.2f} × prefill alone"
        )


if __name__ == "__main__":
    main()
