#!/usr/bin/env python3
"""Print the disaggregated-vs-colocated table of docs/bench/agentic.md from the per-request
records of `beamserve bench agentic --target SPEC --logs DIR` (DIR/RUN/requests.jsonl, copied
to docs/bench/agentic-target-<topology>-c<level>.jsonl).

    .venv/bin/python scripts/gen-topology-table.py docs/bench/agentic-target-*-c*.jsonl

Per file (one topology at one concurrency level):

- first turns: TTFT of each session's turn 0 (a long prompt, cold everywhere);
- later turns: TTFT of the other turns (mostly cached on the session's worker);
- decode under a burst: per-user decode speed (output tokens / (end − first token)) of later
  turns whose decode overlapped the prefill (sent … first token) of some other session's
  first turn; "quiet" the later turns whose decode overlapped none.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def row(path: Path) -> dict[str, Any]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ok = [r for r in recs if r["status"] == "ok" and r["ttft_s"] is not None]
    first = [r for r in ok if r["turn"] == 0]
    later = [r for r in ok if r["turn"] > 0]
    prefills = [(r["session"], r["sent_s"], r["sent_s"] + r["ttft_s"]) for r in first]

    def in_burst(r: dict[str, Any]) -> bool:
        a, b = r["sent_s"] + r["ttft_s"], r["end_s"]
        return any(s != r["session"] and lo < b and hi > a for s, lo, hi in prefills)

    speed = [r for r in later if r.get("user_tok_s")]
    burst = [r["user_tok_s"] for r in speed if in_burst(r)]
    quiet = [r["user_tok_s"] for r in speed if not in_burst(r)]
    m = re.search(r"agentic-target-(.+)-c(\d+)\.jsonl$", path.name)
    return {
        "topology": m.group(1) if m else path.stem,
        "c": int(m.group(2)) if m else 0,
        "ok": f"{len(ok)}/{len(recs)}",
        "first_p50": pct([r["ttft_s"] for r in first], 0.5),
        "first_p90": pct([r["ttft_s"] for r in first], 0.9),
        "later_p50": pct([r["ttft_s"] for r in later], 0.5),
        "later_p90": pct([r["ttft_s"] for r in later], 0.9),
        "burst_n": len(burst),
        "burst_p10": pct(burst, 0.1),
        "burst_p50": pct(burst, 0.5),
        "quiet_p50": pct(quiet, 0.5),
        "all_p50": statistics.median([r["user_tok_s"] for r in speed]) if speed else None,
    }


def main() -> int:
    rows = sorted((row(Path(p)) for p in sys.argv[1:]), key=lambda r: (r["c"], r["topology"]))
    print(
        "| topology | C | ok/req | first-turn TTFT p50 s | p90 | later-turn TTFT p50 s | p90 "
        "| decode tok/s/user in a burst p10 | p50 (n) | quiet p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['topology']} | {r['c']} | {r['ok']} | {fmt(r['first_p50'])} | "
            f"{fmt(r['first_p90'])} | {fmt(r['later_p50'], 3)} | {fmt(r['later_p90'], 3)} | "
            f"{fmt(r['burst_p10'], 1)} | {fmt(r['burst_p50'], 1)} ({r['burst_n']}) | "
            f"{fmt(r['quiet_p50'], 1)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
