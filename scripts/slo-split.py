#!/usr/bin/env python3
"""Which part of the SLO each request of a `beamserve bench agentic --logs DIR` run missed.

    python3 scripts/slo-split.py DIR/ROUTER-cN [...] [--ttft-s 2] [--tok-s 20]

For each run directory (its `requests.jsonl`), first turns (turn 0) and continuing turns apart:
how many met both parts (`good`), only the TTFT bound (`slow-decode`), only the per-user speed
(`late`), neither (`both`); their TTFT and per-user tok/s medians; and good requests per second
of the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--ttft-s", type=float, default=2.0)
    p.add_argument("--tok-s", type=float, default=20.0)
    a = p.parse_args()

    def kind(r: dict) -> str:
        fast, quick = r["ttft_s"] <= a.ttft_s, (r["user_tok_s"] or 0.0) >= a.tok_s
        return "good" if fast and quick else "slow-decode" if fast else "late" if quick else "both"

    for run in a.runs:
        path = run / "requests.jsonl" if run.is_dir() else run
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ok = [r for r in rows if r["status"] == "ok"]
        if not ok:
            print(f"{run}: no successful requests")
            continue
        span = max(r["end_s"] for r in ok) - min(r["sent_s"] for r in ok)
        print(
            f"{run}: {len(ok)}/{len(rows)} ok, {span:.1f} s, "
            f"goodput {sum(kind(r) == 'good' for r in ok) / span:.2f} r/s"
        )
        for name, turns in (
            ("first", [r for r in ok if r["turn"] == 0]),
            ("continuing", [r for r in ok if r["turn"] > 0]),
        ):
            if not turns:
                continue
            counts = {
                k: sum(kind(r) == k for r in turns) for k in ("good", "slow-decode", "late", "both")
            }
            print(
                f"  {name:<10} n={len(turns):<5} "
                + " ".join(f"{k}={v}" for k, v in counts.items())
                + f"  TTFT p50 {statistics.median(r['ttft_s'] for r in turns):.3f} s"
                + f"  user tok/s p50 {statistics.median(r['user_tok_s'] or 0.0 for r in turns):.1f}"
            )


if __name__ == "__main__":
    main()
