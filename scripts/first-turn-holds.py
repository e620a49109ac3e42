#!/usr/bin/env python3
"""How long a `beamserve bench agentic --logs DIR` run's first turns waited in the router.

    .venv/bin/python scripts/first-turn-holds.py DIR/ROUTER-cN [...]

For a beamserve router's run directory (its `requests.jsonl` and the router's `ROUTER.err` log):
each first turn's wait from its send time to its `router.decision` log line (the two clocks
aligned on the shortest wait), split by where its prefill ran (on a prefill worker, or local on
its decode worker), and the time from the decision to its first token.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def report(run: Path) -> None:
    name = run.name.rsplit("-c", 1)[0]
    with (run / "requests.jsonl").open() as f:
        firsts = [r for r in map(json.loads, f) if r["turn"] == 0 and r["ttft_s"] is not None]
    decided: dict[str, tuple[float, dict[str, Any]]] = {}
    with (run / f"{name}.err").open() as f:
        for line in f:
            if '"router.decision"' not in line:
                continue
            e = json.loads(line)
            t = dt.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            decided.setdefault(e["session_id"], (t, e))  # its first decision: the first turn
    pairs = [(r, *decided[r["session"]]) for r in firsts if r["session"] in decided]
    if not pairs:
        print(f"{name}: no first turn with a router.decision line")
        return
    offset = min(t - r["sent_s"] for r, t, _e in pairs)
    for kind in ("split", "local"):
        rows = [(r, t) for r, t, e in pairs if (e["prefill"] is not None) == (kind == "split")]
        if not rows:
            continue
        held = [t - offset - r["sent_s"] for r, t in rows]
        after = [r["ttft_s"] - h for (r, _t), h in zip(rows, held, strict=True)]
        prompt = [float(r["prompt_tokens"]) for r, _t in rows]
        print(
            f"{name} first turns {kind}: n={len(rows)}"
            f"  held p50/p90 {quantile(held, 0.5)}/{quantile(held, 0.9)} s"
            f"  decision→first token p50/p90 {quantile(after, 0.5)}/{quantile(after, 0.9)} s"
            f"  prompt p50 {quantile(prompt, 0.5):.0f} tokens"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    for run in p.parse_args().runs:
        report(run)


if __name__ == "__main__":
    main()
