"""`scripts/prefill-idle.py report`: a prefill worker idle while a split first turn waits in the
router counts as unused; idle with nothing waiting, or busy, does not."""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prefill-idle.py"


def _load():
    spec = importlib.util.spec_from_file_location("prefill_idle", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pi = _load()

T0 = 1_800_000_000.0  # the wall clock of the run's start


def decision(t: float, session: str, split: bool) -> str:
    stamp = datetime.datetime.fromtimestamp(t, tz=datetime.UTC).isoformat()
    return json.dumps(
        {
            "event": "router.decision",
            "session_id": session,
            "prefill": "p0" if split else None,
            "timestamp": stamp.replace("+00:00", "Z"),
        }
    )


def test_idle_while_a_split_first_turn_waits_is_counted(tmp_path: Path) -> None:
    run = tmp_path / "beamserve-2p2d-c2"
    run.mkdir()
    # s1 (split) sent at 0 s, decided at 4 s; s2 (local) sent at 0 s, decided at 0 s;
    # s1's second turn at 6 s. The router's first decision is at the run's 0 s.
    (run / "beamserve-2p2d.err").write_text(
        "\n".join(
            [
                "not json",
                decision(T0, "s2", False),
                decision(T0 + 4, "s1", True),
                decision(T0 + 6, "s1", False),
            ]
        )
    )
    (run / "w0.err").write_text("{}")
    reqs = [
        {"session": "s1", "turn": 0, "sent_s": 0.0},
        {"session": "s2", "turn": 0, "sent_s": 0.0},
        {"session": "s1", "turn": 1, "sent_s": 6.0},
    ]
    (run / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in reqs))
    samples = [
        (T0 + 1, "u", 0),  # idle while s1 waits: unused
        (T0 + 2, "u", 1),  # busy
        (T0 + 3, "u", 0),  # idle while s1 waits: unused
        (T0 + 5, "u", 0),  # idle, nothing waits
    ]
    watched = tmp_path / "w.json"
    watched.write_text(json.dumps(samples))
    out = pi.report(run, watched)
    assert out["samples"] == 4 and out["split_first_turns"] == 1
    assert out["idle_share"] == 0.75
    assert out["idle_while_first_turns_wait_share"] == 0.5
    assert out["mean_wait_s"] == 4.0


def split(t: float, worker: str, prompt: int, hit_blocks: int = 0) -> str:
    stamp = datetime.datetime.fromtimestamp(t, tz=datetime.UTC).isoformat()
    return json.dumps(
        {
            "event": "router.decision",
            "session_id": f"s{t}",
            "prefill": worker,
            "prompt_tokens": prompt,
            "hit_blocks": hit_blocks,
            "timestamp": stamp.replace("+00:00", "Z"),
        }
    )


def test_modeled_idle_is_the_gap_before_a_late_dispatch(tmp_path: Path) -> None:
    """`modeled`: prompts laid end to end from their dispatch at the sim's prefill time; a
    dispatch after the worker's modeled end is idle time, one before it is not."""
    from beamserve.workers.sim.latency import prefill_seconds
    from beamserve.workers.sim.profiles import get_profile

    cost = prefill_seconds(get_profile("h200-bf16-tp8"), 32_768)
    log = tmp_path / "router.err"
    log.write_text(
        "\n".join(
            [
                "not json",
                split(T0, "p0", 32_768),
                split(T0 + cost / 2, "p0", 32_768),  # queued behind the first: no gap
                split(T0 + 2 * cost + 0.25, "p0", 32_768),  # 0.25 s after the second ended
                split(T0 + 0.1, "p1", 32_768 + 1_024, hit_blocks=64),  # 1,024 cached
            ]
        )
    )
    out = pi.modeled(log)
    assert out["p0"]["dispatched"] == 3 and out["p0"]["gaps"] == 1
    assert abs(out["p0"]["idle_s"] - 0.25) < 1e-3
    assert abs(out["p0"]["busy_until_s"] - (3 * cost + 0.25)) < 1e-3
    assert out["p1"]["tokens"] == 32_768 and out["p1"]["idle_s"] == 0.0
