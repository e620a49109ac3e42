#!/usr/bin/env python3
"""Where a closed-loop `beamserve bench agentic --logs DIR` run spends its end: the share of its
tokens done by each time, a steady-state rate, and the sessions that finish last.

    .venv/bin/python scripts/run-tail.py DIR/ROUTER-cN [...] [--steady 40 110] [--gpus 32]

For each router's run directory (its `requests.jsonl`):
- `done by t`: requests finished by t seconds and their share of the run's tokens (prompt,
  cached included, plus output: what the bench's throughput counts), every 10 s;
- `steady`: tokens of the requests that finished inside the window, per second and GPU — a
  diagnostic of the middle of the run, not the bench's figure (that one is the whole run's);
- `last open` / `end`: when the last session sent its first turn, when the last request ended;
- `last 20`: the 20 sessions that finished last: when they opened, how long they took, and
  their first turn's TTFT (how long it waited before anything happened).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def tokens(r: dict[str, Any]) -> int:
    return int(r["prompt_tokens"]) + int(r["output_tokens"])


def report(run: Path, steady: tuple[float, float], gpus: int) -> None:
    with (run / "requests.jsonl").open() as f:
        rs = [json.loads(line) for line in f]
    ok = [r for r in rs if r["end_s"] is not None]
    total = sum(tokens(r) for r in ok)
    end = max(r["end_s"] for r in ok)

    def done(t: float) -> int:
        return sum(tokens(r) for r in ok if r["end_s"] <= t)

    marks = " ".join(
        f"{t}:{sum(1 for r in ok if r['end_s'] <= t)}/{done(t) / total:.2f}"
        for t in range(20, int(end) + 10, 10)
    )
    lo, hi = steady
    rate = (done(hi) - done(lo)) / (hi - lo) / gpus
    firsts = [r for r in rs if r["turn"] == 0]
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        sessions[r["session"]].append(r)
    last = sorted(sessions.values(), key=lambda v: max(r["end_s"] for r in v))[-20:]
    opened = [min(r["sent_s"] for r in v) for v in last]
    took = [max(r["end_s"] for r in v) - o for v, o in zip(last, opened, strict=True)]
    first_ttft = [min(v, key=lambda r: r["turn"])["ttft_s"] or 0.0 for v in last]
    n = len(last)
    print(f"{run.name}")
    print(f"  done by t (requests/share of tokens): {marks}")
    print(
        f"  steady {lo:g}-{hi:g} s: {rate:,.0f} tok/s/GPU   last open "
        f"{max(r['sent_s'] for r in firsts):.1f} s   end {end:.1f} s"
    )
    print(
        f"  last {n} sessions: opened {sum(opened) / n:.0f} s, took {sum(took) / n:.1f} s, "
        f"first turn TTFT {sum(first_ttft) / n:.1f} s (means)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--steady", nargs=2, type=float, default=(40.0, 110.0), metavar=("FROM", "TO"))
    p.add_argument("--gpus", type=int, default=32, help="simulated GPUs of the run (default 32)")
    a = p.parse_args()
    for run in a.runs:
        report(run, (a.steady[0], a.steady[1]), a.gpus)


if __name__ == "__main__":
    main()
