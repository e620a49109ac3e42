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


def test_list_schedule_longest_first_ends_sooner_than_oldest_first() -> None:
    """Two workers free at 0, one long prompt sent last: oldest first leaves it to the end on
    one worker while the other idles; longest first starts it at once."""
    items = [(0.0, 1.0), (0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 4.0)]
    free = {"p0": 0.5, "p1": 0.5}
    oldest, _ = pi.list_schedule(free, items, longest_first=False)
    longest, _ = pi.list_schedule(free, items, longest_first=True)
    assert max(oldest.values()) == 6.5  # 1 + 1 then the 4: 0.5 + 2 + 4
    assert max(longest.values()) == 4.5  # the 4 on one worker, the four 1s on the other
    assert free == {"p0": 0.5, "p1": 0.5}  # not changed in place


def test_list_schedule_serves_the_overdue_first_and_waits_for_arrivals() -> None:
    # at 31 s the 1 s item (sent at 0) is overdue: it goes before the longer one
    ends, wait = pi.list_schedule({"p0": 31.0}, [(0.0, 1.0), (30.0, 5.0)], longest_first=True)
    assert ends == {"p0": 37.0} and wait == 31.0
    # nothing sent yet: the worker waits for the next arrival
    ends, wait = pi.list_schedule({"p0": 0.0}, [(2.0, 1.0)], longest_first=True)
    assert ends == {"p0": 3.0} and wait == 0.0


def test_lull_reads_the_held_prompts_from_the_last_new_session_on(tmp_path: Path) -> None:
    from beamserve.workers.sim.latency import prefill_seconds
    from beamserve.workers.sim.profiles import get_profile

    run = tmp_path / "beamserve-adaptive-spill-c2"
    run.mkdir()
    short, long = 8_192, 65_536
    c_short = prefill_seconds(get_profile("h200-bf16-tp8"), short)
    c_long = prefill_seconds(get_profile("h200-bf16-tp8"), long)

    def first(t: float, session: str, worker: str, prompt: int) -> str:
        stamp = datetime.datetime.fromtimestamp(T0 + t, tz=datetime.UTC).isoformat()
        return json.dumps({"event": "router.decision", "session_id": session, "prefill": worker,
                           "prompt_tokens": prompt, "hit_blocks": 0,
                           "timestamp": stamp.replace("+00:00", "Z")})  # fmt: skip

    # a (sent 0) dispatched at once; b, c, d sent by 1 s (the last new session), dispatched
    # after it oldest first: b and c to p0 and p1, then the long d to p0 after b
    lines = [first(0.0, "a", "p0", short), first(1.0, "b", "p0", short),
             first(1.0, "c", "p1", short), first(1.0 + c_short, "d", "p0", long)]  # fmt: skip
    (run / "router.err").write_text("\n".join(lines))
    (run / "w0.err").write_text("{}")
    reqs = [{"session": s, "turn": 0, "sent_s": t} for s, t in
            (("a", 0.0), ("b", 0.5), ("c", 0.6), ("d", 1.0))]  # fmt: skip
    (run / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in reqs))
    out = pi.lull(run)
    assert out["lull_at_s"] == 1.0 and out["held"] == 3
    assert abs(out["held_work_s"] - (2 * c_short + c_long)) < 1e-3
    # p0: a from 0, b from 1, d after b
    assert abs(out["as_dispatched"]["p0"] - (1.0 + c_short + c_long)) < 1e-3
    oldest = out["oldest_first"]["busy_until_s"]
    longest = out["longest_first"]["busy_until_s"]
    # oldest first: b and c at 1 s, then d after b; longest first: d at once, b then c on p1
    assert abs(max(oldest.values()) - (1.0 + c_short + c_long)) < 1e-3
    assert abs(max(longest.values()) - (1.0 + c_long)) < 1e-3
