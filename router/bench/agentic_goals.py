"""The issue's goals, read off `beamserve bench agentic` results: per concurrency level, each of
our routers against the best peer router of the same run.

Which side a run is on: `side` in its JSON object ("ours" or "peer"; the bench writes it), or,
in files written before it did, `kind` ("beamserve" is ours). A level's rows are averaged over
their rounds (`--repeat N`) before they are compared, and

    best peer       = the peer with the highest mean throughput (tok/s per GPU) at that level
    × best peer     = our mean throughput ÷ the best peer's
    per round       = the same ratio within each round (ours ÷ the best peer *of that round*),
                      its least and greatest: the spread one comparison has on this machine
    p90             = our mean TTFT p90 against the best peer's ("equal or better": ≤)
    goodput ×       = our mean goodput ÷ the highest mean goodput of any peer

`throughput_met`: × best peer ≥ 1 at an equal or better p90. Whether a level is at or past
saturation (where the goodput goal applies) is the reader's call: the bench cannot know it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Side = str  # "ours" | "peer"


def side_of(data: Mapping[str, Any]) -> Side | None:
    """ "ours", "peer", or None (a row that says neither: left out)."""
    side = data.get("side")
    if side in ("ours", "peer"):
        return str(side)
    kind = data.get("kind")
    if kind is None:
        return None
    return "ours" if kind == "beamserve" else "peer"


@dataclass(frozen=True)
class Mean:
    """One router's runs at one level, averaged."""

    router: str
    side: Side
    runs: int
    tok_s_per_gpu: float
    ttft_p90_s: float
    goodput_rps: float
    by_round: Mapping[int, float]  # round → tok/s per GPU


@dataclass(frozen=True)
class GoalRow:
    concurrency: int
    router: str
    runs: int
    tok_s_per_gpu: float
    best_peer: str
    best_peer_tok_s_per_gpu: float
    ratio: float  # × best peer (means)
    round_ratio_min: float | None  # per round: ours ÷ that round's best peer
    round_ratio_max: float | None
    ttft_p90_s: float
    best_peer_ttft_p90_s: float
    goodput_ratio: float | None  # ÷ the best peer goodput (None: every peer had 0)

    @property
    def p90_ok(self) -> bool:
        return self.ttft_p90_s <= self.best_peer_ttft_p90_s

    @property
    def throughput_met(self) -> bool:
        return self.ratio >= 1.0 and self.p90_ok


def _usable(data: Mapping[str, Any]) -> bool:
    if data.get("skipped"):
        return False
    keys = ("total_tok_s_per_gpu", "ttft_p90_s", "goodput_rps")
    return all(isinstance(data.get(k), int | float) and math.isfinite(data[k]) for k in keys)


def means(rows: Iterable[Mapping[str, Any]]) -> dict[int, list[Mean]]:
    """Per level, each router's usable runs averaged (routers in first-seen order)."""
    grouped: dict[int, dict[tuple[str, Side], list[Mapping[str, Any]]]] = {}
    for d in rows:
        side = side_of(d)
        if side is None or not _usable(d):
            continue
        key = (str(d["router"]), side)
        grouped.setdefault(int(d["concurrency"]), {}).setdefault(key, []).append(d)
    out: dict[int, list[Mean]] = {}
    for level, by_router in sorted(grouped.items()):
        out[level] = [
            Mean(
                router=name,
                side=side,
                runs=len(ds),
                tok_s_per_gpu=statistics.fmean(float(d["total_tok_s_per_gpu"]) for d in ds),
                ttft_p90_s=statistics.fmean(float(d["ttft_p90_s"]) for d in ds),
                goodput_rps=statistics.fmean(float(d["goodput_rps"]) for d in ds),
                by_round={int(d.get("round", 0)): float(d["total_tok_s_per_gpu"]) for d in ds},
            )
            for (name, side), ds in by_router.items()
        ]
    return out


def goals(rows: Iterable[Mapping[str, Any]]) -> list[GoalRow]:
    """One row per (level, our router) that has at least one peer beside it at that level."""
    out: list[GoalRow] = []
    for level, ms in means(rows).items():
        peers = [m for m in ms if m.side == "peer"]
        if not peers:
            continue
        best = max(peers, key=lambda m: m.tok_s_per_gpu)
        best_good = max(m.goodput_rps for m in peers)
        for m in ms:
            if m.side != "ours":
                continue
            per_round = _round_ratios(m, peers)
            out.append(
                GoalRow(
                    concurrency=level,
                    router=m.router,
                    runs=m.runs,
                    tok_s_per_gpu=m.tok_s_per_gpu,
                    best_peer=best.router,
                    best_peer_tok_s_per_gpu=best.tok_s_per_gpu,
                    ratio=m.tok_s_per_gpu / best.tok_s_per_gpu,
                    round_ratio_min=min(per_round) if per_round else None,
                    round_ratio_max=max(per_round) if per_round else None,
                    ttft_p90_s=m.ttft_p90_s,
                    best_peer_ttft_p90_s=best.ttft_p90_s,
                    goodput_ratio=m.goodput_rps / best_good if best_good > 0 else None,
                )
            )
    return out


def _round_ratios(ours: Mean, peers: Sequence[Mean]) -> list[float]:
    """Ours ÷ the best peer of the same round, for every round some peer also ran."""
    ratios = []
    for rnd, tput in sorted(ours.by_round.items()):
        theirs = [p.by_round[rnd] for p in peers if rnd in p.by_round]
        if theirs and max(theirs) > 0:
            ratios.append(tput / max(theirs))
    return ratios


def table(rows: Sequence[GoalRow], title: str) -> Any:
    """The goal rows as a rich table."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("C", "router", "runs", "tok/s/GPU", "best peer", "× best peer", "per round",
              "p90 s ours / peer", "goodput ×", "met"):  # fmt: skip
        t.add_column(c, justify="left" if c in ("router", "best peer") else "right")
    for r in rows:
        t.add_row(*_cells(r))
    return t


def markdown(rows: Sequence[GoalRow]) -> str:
    head = ("agents", "router", "runs", "tok/s/GPU", "best peer", "× best peer", "per round",
            "p90 TTFT s, ours / peer's", "goodput × peer's", "throughput goal")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _cells(r: GoalRow) -> list[str]:
    spread = (
        f"{r.round_ratio_min:.3f}–{r.round_ratio_max:.3f}"
        if r.round_ratio_min is not None and r.round_ratio_max is not None and r.runs > 1
        else "—"
    )
    good = "—" if r.goodput_ratio is None else f"{r.goodput_ratio:.2f}"
    return [
        str(r.concurrency),
        r.router,
        str(r.runs),
        f"{r.tok_s_per_gpu:,.0f}",
        r.best_peer,
        f"{r.ratio:.3f}",
        spread,
        f"{r.ttft_p90_s:.2f} / {r.best_peer_ttft_p90_s:.2f}",
        good,
        "met" if r.throughput_met else "not met",
    ]
