"""`scripts/router-tap.py`: what a router adds to one agent's turn, timed at a TCP tap in front
of its worker (a sim worker process, the tap's process, the router's, and the client in the
script). The tap sees every request the worker gets: the turns it reports are the client's,
in order, and each turn splits into the way to the worker, the worker's own time and the way
back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.router.test_router_timeline import report_of

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "router-tap.py"


def test_each_turn_splits_at_the_tap(tmp_path: Path) -> None:
    report = report_of(SCRIPT, tmp_path, "--routers", "direct,forwarder,beamserve-adaptive-spill",
                       "--tokens", "3000", "-n", "4", "--max-tokens", "8")  # fmt: skip
    rows = {r["router"]: r for r in report["rows"]}
    assert set(rows) == {"direct", "forwarder", "beamserve-adaptive-spill"}
    for r in rows.values():
        assert r["n"] == 4
        assert 0 < r["to_worker_ms"] < r["turn_ms"] and 0 < r["back_ms"] < r["turn_ms"]
        assert r["worker_ms"] > 0
    # one more hop: the router's request path comes on top of the tap's (the bare forwarder's
    # fraction of a millisecond is within four turns' noise)
    assert rows["beamserve-adaptive-spill"]["to_worker_ms"] > rows["direct"]["to_worker_ms"]


def test_unknown_routers_are_named() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--routers", "direct,nginx"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "unknown ['nginx']" in run.stderr


def test_first_turns_are_new_sessions_each_timed_at_the_tap(tmp_path: Path) -> None:
    """`--first-turns`: each measured turn a new session's cold first turn; the router's way
    in is still on top of the tap's."""
    report = report_of(SCRIPT, tmp_path, "--routers", "direct,beamserve-adaptive-spill",
                       "--tokens", "3000", "-n", "3", "--max-tokens", "8", "--first-turns",
                       "--warm", "2")  # fmt: skip
    assert report["first_turns"] is True and report["warm"] == 2
    rows = {r["router"]: r for r in report["rows"]}
    for r in rows.values():
        assert r["n"] == 3
        assert 0 < r["to_worker_ms"] < r["turn_ms"] and r["worker_ms"] > 0
    assert rows["beamserve-adaptive-spill"]["to_worker_ms"] > rows["direct"]["to_worker_ms"]


def test_a_negative_warm_up_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--first-turns", "--warm", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--warm: must be ≥ 0" in run.stderr
