"""`scripts/router-timeline.py`: a long prompt's way through the router, stage by stage, over
real HTTP (a sim worker process, the router served by uvicorn in the script's process, a
client process). The order it reports is the dispatch path's contract: the index predictions
and the decision's record come after the upstream socket write, never between the decision and
the call to the worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "router-timeline.py"


def report_of(script: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    """`script` run with `args` and `--json`: its report (the run must succeed)."""
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_the_predictions_and_the_record_come_after_the_request_went_out(tmp_path: Path) -> None:
    report = report_of(SCRIPT, tmp_path, "--tokens", "4000", "-n", "4", "--no-speculate")
    stages = [r["stage"] for r in report["stages"]]
    assert all(r["n"] == 4 for r in report["stages"]), report["stages"]
    at = {s: i for i, s in enumerate(stages)}
    path = ["request in", "body read", "parsed", "hashed", "admitted", "decided",
            "routed (booked)", "upstream call", "socket write", "written"]  # fmt: skip
    assert [at[s] for s in path] == sorted(at[s] for s in path), stages
    assert at["predicted"] > at["written"] and at["decision recorded"] > at["written"]
    answer = ["worker answered", "first chunk", "response start", "first bytes sent",
              "client's first token"]  # fmt: skip
    assert [at[s] for s in answer] == sorted(at[s] for s in answer), stages
    assert at["first chunk"] > at["predicted"]


def test_a_speculative_turn_goes_out_before_it_is_parsed(tmp_path: Path) -> None:
    """The same prompt again and again under one session (a calm session's next turns): each
    goes to the worker right after its body is read, and is parsed, keyed, admitted and routed
    while the worker starts on it."""
    report = report_of(SCRIPT, tmp_path, "--tokens", "4000", "-n", "4", "--max-tokens", "4")
    at = {r["stage"]: i for i, r in enumerate(report["stages"])}
    path = ["body read", "upstream call", "socket write", "written", "parsed", "hashed",
            "admitted", "decided", "routed (booked)", "worker answered", "first chunk"]  # fmt: skip
    assert [at[s] for s in path] == sorted(at[s] for s in path), report["stages"]


def test_a_new_long_prompt_is_hashed_whole_only_after_it_went_out(tmp_path: Path) -> None:
    """`--cold`: each request starts a session with text never seen (24K characters, more than
    twice `HEAD_CHARS`): it goes out on its head, and its rest is tokenized and hashed after the
    socket write, before the worker's answer is handled."""
    report = report_of(SCRIPT, tmp_path, "--tokens", "8000", "-n", "3", "--cold")
    assert report["cold"] is True
    at = {r["stage"]: i for i, r in enumerate(report["stages"])}
    assert at["hashed"] < at["upstream call"] < at["written"] < at["rest hashed"]
    assert at["rest hashed"] < at["predicted"] < at["first chunk"]


def test_only_a_beamserve_router_can_be_looked_inside() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--router", "smg-cache_aware"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--router 'smg-cache_aware': use one of" in run.stderr
    assert "beamserve-adaptive-spill" in run.stderr


def test_a_growing_conversation_is_keyed_whole_before_it_goes_out(tmp_path: Path) -> None:
    """`--grow`: one session's continuing turns (its record read first): each is keyed whole
    before the call — no rest to hash after it — and the client's `[DONE]` is timed (not
    speculated: the order the router keeps when it decides first)."""
    report = report_of(SCRIPT, tmp_path, "--tokens", "8000", "-n", "3", "--grow",
                       "--max-tokens", "4", "--no-speculate")  # fmt: skip
    assert report["mode"] == "grow" and report["max_tokens"] == 4
    at = {r["stage"]: i for i, r in enumerate(report["stages"])}
    assert "rest hashed" not in at  # (the first turn, a warm-up, went on its head)
    assert at["hashed"] < at["upstream call"] < at["client's first token"] < at["client's [DONE]"]


def test_cold_and_grow_are_one_or_the_other() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--cold", "--grow"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "--cold and --grow: give one" in run.stderr
