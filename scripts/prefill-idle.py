#!/usr/bin/env python3
"""How often a P/D pool's prefill workers sit idle while new sessions' first turns wait.

    # beside a run (it finds the run's prefill-role workers itself):
    .venv/bin/python scripts/prefill-idle.py watch /tmp/watch.json &
    .venv/bin/beamserve bench agentic --routers beamserve-2p2d … --logs /tmp/logs
    # then:
    .venv/bin/python scripts/prefill-idle.py report /tmp/logs/beamserve-2p2d-c64 /tmp/watch.json

    # or from the router's log alone, any engine the sim models (`--profile`):
    .venv/bin/python scripts/prefill-idle.py modeled /tmp/logs/beamserve-adaptive-spill-c128
    # the end of the burst: the held first turns oldest first against longest first
    .venv/bin/python scripts/prefill-idle.py lull /tmp/logs/beamserve-adaptive-spill-c128

`modeled` needs no sampling: it lays each prefill worker's split prompts end to end from their
dispatch (`router.decision` lines with a `prefill` worker; uncached = prompt less the hit
blocks × `--block`), each priced by the sim's latency model (`LatencyModel.prefill_seconds`),
and reports the gaps in which a worker had nothing left to compute before the router's next
dispatch to it: the time it idled while the router held the next prompt back, as far as the
model's step times are the engine's (the sim's are).

`lull` takes the same prompts from the last new session's send on (the end of the burst, when
the first turns held in the router are all the new work left) and plays the stage's order on
the model: each prefill worker takes the next one when it frees, the overdue first (oldest),
then the oldest or the longest (`list_schedule`). It prints when each worker would have ended
either way, against when it did as dispatched: what the order of the last prompts costs the
end of the run (the router's `prefill_lull_longest_first_s`).

`watch` finds the processes started with `--role prefill` (pgrep), their listening ports (ss),
keeps those whose `/metrics` is SGLang-shaped, and samples `sglang:num_running_reqs` every
100 ms until they are gone. `report` takes the run's `requests.jsonl` and the router's log
(`router.decision` lines): a first turn the router split "waits" from its send time to its
decision. It prints the share of samples in which a prefill worker ran nothing, and the share
in which it ran nothing while some split first turn waited: prefill time the router left
unused.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUNNING = re.compile(r"^sglang:num_running_reqs\S*\s+(\S+)", re.M)


def _prefill_urls() -> list[str]:
    pids = subprocess.run(["pgrep", "-f", "role prefill"], capture_output=True, text=True)
    ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ports = []
    for pid in pids.stdout.split():
        ports += [int(ln.split()[3].rsplit(":", 1)[1]) for ln in ss if f"pid={pid}," in ln]
    return [f"http://127.0.0.1:{p}" for p in sorted(ports)]


async def watch(out: Path, interval_s: float = 0.1) -> None:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1)
    samples: list[tuple[float, str, float]] = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        urls: list[str] = []
        while not urls:  # wait for the run's prefill workers
            for u in _prefill_urls():
                try:
                    async with http.get(u + "/metrics") as r:
                        if r.status == 200 and RUNNING.search(await r.text()):
                            urls.append(u)
                except (aiohttp.ClientError, TimeoutError):
                    pass
            await asyncio.sleep(0.5)
        print(f"watching {', '.join(urls)}", file=sys.stderr)
        last_ok = time.time()
        while time.time() - last_ok < 5:
            t = time.time()
            for u in urls:
                try:
                    async with http.get(u + "/metrics") as r:
                        m = RUNNING.search(await r.text())
                except (aiohttp.ClientError, TimeoutError):
                    continue
                if m:
                    samples.append((t, u, float(m.group(1))))
                    last_ok = t
            await asyncio.sleep(interval_s)
    out.write_text(json.dumps(samples))


def _router_log(run: Path) -> Path:
    """The router's log in a run's log folder (the workers' are `w*.err`)."""
    return next(p for p in run.glob("*.err") if not p.name.startswith("w"))


def _decisions(router_log: Path) -> Iterator[tuple[float, dict[str, Any]]]:
    """The log's `router.decision` lines, with their time on the wall clock."""
    for line in router_log.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == "router.decision":
            stamp = d["timestamp"].replace("Z", "+00:00")
            yield datetime.datetime.fromisoformat(stamp).timestamp(), d


def _split(d: dict[str, Any], block: int) -> tuple[int, int]:
    """A split decision's prompt on its prefill worker: (uncached, cached) tokens."""
    cached = int(d.get("hit_blocks", 0)) * block
    return max(int(d["prompt_tokens"]) - cached, 0), cached


def report(run: Path, watched: Path) -> dict[str, float]:
    first_decision: dict[str, tuple[float, bool]] = {}
    t_first = None
    for t, d in _decisions(_router_log(run)):
        t_first = t if t_first is None else min(t_first, t)
        first_decision.setdefault(d["session_id"], (t, d["prefill"] is not None))
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines() if x]
    if t_first is None or not reqs:
        raise SystemExit(f"{run}: no router decisions or no requests")
    t0 = t_first - min(r["sent_s"] for r in reqs)  # the run's clock on the wall clock
    waits = []
    for r in reqs:
        if r["turn"] == 0 and r["session"] in first_decision:
            t, split = first_decision[r["session"]]
            if split:
                waits.append((t0 + r["sent_s"], t))
    samples = json.loads(watched.read_text())
    idle = [s for s in samples if s[2] == 0]
    unused = [s for s in idle if any(a <= s[0] < b for a, b in waits)]
    n = max(len(samples), 1)
    return {
        "samples": len(samples),
        "idle_share": len(idle) / n,
        "idle_while_first_turns_wait_share": len(unused) / n,
        "split_first_turns": len(waits),
        "mean_wait_s": sum(b - a for a, b in waits) / max(len(waits), 1),
    }


def modeled(
    router_log: Path, profile: str = "h200-bf16-tp8", block: int = 16
) -> dict[str, dict[str, float]]:
    """Per prefill worker: its split prompts (`dispatched`, their `tokens` uncached), the
    seconds of prefill they cost on the model (`work_s`), when the last ended had each
    started at its dispatch or at the end of the one before (`busy_until_s`, from the first
    dispatch of the run), and the `idle_s` between (in `gaps`, their median `gap_p50_s`)."""
    from beamserve.workers.sim.latency import LatencyModel
    from beamserve.workers.sim.profiles import get_profile

    model = LatencyModel(get_profile(profile))
    sent: list[tuple[float, str, int, int]] = []
    for t, d in _decisions(router_log):
        if d.get("prefill"):
            sent.append((t, d["prefill"], *_split(d, block)))
    if not sent:
        raise SystemExit(f"{router_log}: no split decisions")
    t0 = min(x[0] for x in sent)
    out: dict[str, dict[str, float]] = {}
    for worker in sorted({x[1] for x in sent}):
        busy = idle = work = 0.0
        gaps: list[float] = []
        mine = sorted(x for x in sent if x[1] == worker)
        for t, _, uncached, cached in mine:
            at = t - t0
            if at > busy:
                if work > 0:
                    gaps.append(at - busy)
                    idle += at - busy
                busy = at
            cost = model.prefill_seconds(uncached, cached)
            busy += cost
            work += cost
        gaps.sort()
        out[worker] = {
            "dispatched": len(mine),
            "tokens": sum(x[2] for x in mine),
            "work_s": round(work, 3),
            "busy_until_s": round(busy, 3),
            "idle_s": round(idle, 3),
            "gaps": len(gaps),
            "gap_p50_s": round(gaps[len(gaps) // 2], 3) if gaps else 0.0,
        }
    return out


def list_schedule(
    free: dict[str, float],
    items: list[tuple[float, float]],
    *,
    longest_first: bool,
    rescue_s: float = 30.0,
) -> tuple[dict[str, float], float]:
    """The prefill stage's order played on the model: each prefill worker takes its next item
    when it frees (`free`: when each does first), from `items` (sent at, seconds of prefill)
    already sent by then — those that waited `rescue_s` first, oldest first (the router's
    overdue rule), then the longest (`longest_first`) or the oldest. Returns each worker's
    busy-until and the longest wait. Pure."""
    free, left = dict(free), sorted(items)
    longest_wait = 0.0
    while left:
        worker = min(free, key=lambda w: (free[w], w))
        now = free[worker]
        ready = [it for it in left if it[0] <= now]
        if not ready:
            free[worker] = left[0][0]
            continue
        overdue = [it for it in ready if now - it[0] >= rescue_s]
        if overdue:
            item = overdue[0]
        elif longest_first:
            item = max(ready, key=lambda it: (it[1], -it[0]))
        else:
            item = ready[0]
        left.remove(item)
        longest_wait = max(longest_wait, now - item[0])
        free[worker] = now + item[1]
    return free, longest_wait


def lull(
    run: Path, profile: str = "h200-bf16-tp8", block: int = 16, rescue_s: float = 30.0
) -> dict[str, Any]:
    """The end of a burst: from the last new session's send (the lull, when the held first
    turns are all the new work there is), each prefill worker's busy-until as the router
    dispatched (each split prompt from its dispatch or the end of the one before, priced by the
    sim's model as in `modeled`), and as list scheduling would have it from the same instant
    with the prompts not yet dispatched then, oldest first and longest first (`list_schedule`).
    Times are from the run's first send (`requests.jsonl`)."""
    from beamserve.workers.sim.latency import LatencyModel
    from beamserve.workers.sim.profiles import get_profile

    model = LatencyModel(get_profile(profile))
    decisions = list(_decisions(_router_log(run)))
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines() if x]
    if not decisions or not reqs:
        raise SystemExit(f"{run}: no router decisions or no requests")
    t0 = min(t for t, _ in decisions) - min(r["sent_s"] for r in reqs)
    sent = {r["session"]: r["sent_s"] for r in reqs if r["turn"] == 0}
    first: dict[str, tuple[float, dict[str, Any]]] = {}
    for t, d in decisions:
        first.setdefault(d["session_id"], (t - t0, d))
    jobs = []  # (sent, dispatched, worker, seconds)
    for session, (at, d) in first.items():
        if d.get("prefill") and session in sent:
            cost = model.prefill_seconds(*_split(d, block))
            jobs.append((sent[session], at, d["prefill"], cost))
    if not jobs:
        raise SystemExit(f"{run}: no split first turns")
    start = max(sent.values())
    workers = sorted({j[2] for j in jobs})
    busy = dict.fromkeys(workers, 0.0)
    actual = dict.fromkeys(workers, 0.0)
    for _, at, worker, cost in sorted(jobs, key=lambda j: j[1]):
        actual[worker] = max(actual[worker], at) + cost
        if at < start:
            busy[worker] = actual[worker]
    held = [(s, c) for s, at, _, c in jobs if at >= start]
    free = {w: max(b, start) for w, b in busy.items()}
    out: dict[str, Any] = {
        "lull_at_s": round(start, 3),
        "held": len(held),
        "held_work_s": round(sum(c for _, c in held), 3),
        "as_dispatched": {w: round(b, 3) for w, b in actual.items()},
    }
    for name, longest in (("oldest_first", False), ("longest_first", True)):
        ends, wait = list_schedule(free, held, longest_first=longest, rescue_s=rescue_s)
        out[name] = {"busy_until_s": {w: round(b, 3) for w, b in ends.items()},
                     "longest_wait_s": round(wait, 3)}  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="sample the prefill workers until they are gone")
    w.add_argument("out", type=Path)
    r = sub.add_parser("report", help="idle shares of one run")
    r.add_argument("run", type=Path, help="the run's log folder (ROUTER-cN)")
    r.add_argument("watched", type=Path)
    on_model = argparse.ArgumentParser(add_help=False)  # a run's log priced by the sim's model
    on_model.add_argument("run", type=Path, help="the run's log folder (ROUTER-cN)")
    on_model.add_argument("--profile", default="h200-bf16-tp8", help="the sim's hardware profile")
    on_model.add_argument("--block", type=int, default=16, help="the router's block size (tokens)")
    sub.add_parser(
        "modeled", parents=[on_model], help="idle gaps of the prefill workers, by the sim's model"
    )
    lu = sub.add_parser(
        "lull",
        parents=[on_model],
        help="the end of a burst: the held first turns oldest or longest first",
    )
    lu.add_argument("--rescue-s", type=float, default=30.0, help="the router's lifo_max_wait_s")
    a = p.parse_args()
    if a.cmd == "watch":
        asyncio.run(watch(a.out))
    elif a.cmd == "modeled":
        print(json.dumps(modeled(_router_log(a.run), a.profile, a.block), indent=1))
    elif a.cmd == "lull":
        print(json.dumps(lull(a.run, a.profile, a.block, a.rescue_s), indent=1))
    else:
        print(json.dumps(report(a.run, a.watched), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
