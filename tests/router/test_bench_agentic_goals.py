"""`beamserve bench agentic`: the goals table (ours against the best peer, rounds averaged) and
`--repeat` (rounds with the routers' order rotated)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from beamserve.router.bench import agentic
from beamserve.router.bench.agentic import AgenticConfig, run_agentic
from beamserve.router.bench.agentic_goals import goals, side_of
from beamserve.router.bench.agentic_workload import default_trace_dir, load_sessions
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import RunBeamserve


def row(router: str, side: str, tput: float, p90: float = 1.0, good: float = 5.0,
        level: int = 16, rnd: int = 0, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "router": router, "side": side, "concurrency": level, "round": rnd,
        "total_tok_s_per_gpu": tput, "ttft_p90_s": p90, "goodput_rps": good, **extra,
    }  # fmt: skip


def test_ours_against_the_peer_with_the_best_mean_throughput() -> None:
    rows = [
        row("ours", "ours", 102.0, p90=0.8, good=9.0, rnd=0),
        row("ours", "ours", 98.0, p90=0.9, good=8.0, rnd=1),
        row("a", "peer", 101.0, p90=1.0, good=6.0, rnd=0),
        row("a", "peer", 97.0, p90=1.2, good=7.0, rnd=1),
        row("b", "peer", 90.0, p90=0.5, good=10.0, rnd=0),
        row("b", "peer", 99.0, p90=0.5, good=10.0, rnd=1),
    ]
    (g,) = goals(rows)
    # a's mean (99.0) beats b's (94.5): a is the best peer, though b won round 1
    assert g.best_peer == "a" and g.runs == 2
    assert g.ratio == pytest.approx(100.0 / 99.0)
    assert g.round_ratio_min == pytest.approx(98.0 / 99.0)  # round 1: b's 99 was the best
    assert g.round_ratio_max == pytest.approx(102.0 / 101.0)
    assert g.ttft_p90_s == pytest.approx(0.85) and g.best_peer_ttft_p90_s == pytest.approx(1.1)
    assert g.goodput_ratio == pytest.approx(8.5 / 10.0)  # the best goodput of any peer (b)
    assert g.p90_ok and g.throughput_met


def test_a_worse_p90_or_a_lower_throughput_is_not_met() -> None:
    slower = goals([row("ours", "ours", 99.0, p90=0.5), row("p", "peer", 100.0, p90=1.0)])
    later = goals([row("ours", "ours", 101.0, p90=1.01), row("p", "peer", 100.0, p90=1.0)])
    level = goals([row("ours", "ours", 100.0, p90=1.0), row("p", "peer", 100.0, p90=1.0)])
    assert not slower[0].throughput_met and slower[0].p90_ok
    assert not later[0].throughput_met and not later[0].p90_ok
    assert level[0].throughput_met  # equal counts ("≥ at equal or better")


def test_levels_apart_skipped_runs_and_rows_without_a_side_are_left_out() -> None:
    rows = [
        row("ours", "ours", 100.0, level=8),
        row("p", "peer", 50.0, level=8),
        row("ours", "ours", 100.0, level=16),  # no peer at 16: no row
        {"router": "p", "concurrency": 8, "side": "peer", "skipped": "did not start"},
        {**row("q", "peer", 1e9, level=8), "side": None},  # neither side: left out
        row("p", "peer", float("nan"), level=8, rnd=1),  # a broken figure: left out
    ]
    (g,) = goals(rows)
    assert (g.concurrency, g.best_peer, g.runs, g.ratio) == (8, "p", 1, 2.0)
    assert goals([row("ours", "ours", 1.0)]) == []


def test_files_written_before_the_side_field_read_it_from_the_kind() -> None:
    assert side_of({"kind": "beamserve"}) == "ours"
    assert side_of({"kind": "sglang-router"}) == "peer"
    assert side_of({"side": "peer", "kind": "beamserve"}) == "peer"  # the field wins
    assert side_of({}) is None
    old = [
        {k: v for k, v in row("b", "", 100.0).items() if k not in ("side", "round")}
        | {"kind": "beamserve"},
        {k: v for k, v in row("g", "", 80.0).items() if k not in ("side", "round")}
        | {"kind": "smg"},
    ]
    (g,) = goals(old)
    assert g.router == "b" and g.ratio == pytest.approx(1.25) and g.runs == 1
    assert g.round_ratio_min == g.round_ratio_max == pytest.approx(1.25)


tputs = st.lists(st.floats(1.0, 1e5), min_size=1, max_size=4)


@given(ours=tputs, peers=st.lists(tputs, min_size=1, max_size=3))
def test_the_ratio_is_of_the_means_and_every_round_ratio_brackets_nothing_outside(
    ours: list[float], peers: list[list[float]]
) -> None:
    rows = [row("ours", "ours", t, rnd=k) for k, t in enumerate(ours)]
    for i, ts in enumerate(peers):
        rows += [row(f"p{i}", "peer", t, rnd=k) for k, t in enumerate(ts)]
    (g,) = goals(rows)
    best = max(statistics.fmean(ts) for ts in peers)
    assert g.ratio == pytest.approx(statistics.fmean(ours) / best)
    assert g.best_peer_tok_s_per_gpu == pytest.approx(best)
    per_round = [
        t / max(ts[k] for ts in peers if k < len(ts))
        for k, t in enumerate(ours)
        if any(k < len(ts) for ts in peers)
    ]
    assert g.round_ratio_min == pytest.approx(min(per_round))
    assert g.round_ratio_max == pytest.approx(max(per_round))
    assert g.throughput_met == (g.ratio >= 1.0)  # every p90 here is equal


def test_rounds_rotate_the_routers_order_and_name_their_logs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The round loop, with each run's I/O (`_one_run`: processes, HTTP) replaced by a record of
    the call."""
    calls: list[tuple[str, int, str]] = []

    def one_run(cfg: Any, level: int, spec: Any, url: Any, *_: Any) -> dict[str, Any]:
        suffix = _[-1] if _ else ""
        calls.append((spec.name if spec is not None else url, level, suffix))
        return {"total_tok_s_per_gpu": 1.0, "ttft_p90_s": 1.0, "goodput_rps": 1.0}

    monkeypatch.setattr(agentic, "_one_run", one_run)
    monkeypatch.setenv("BEAMSERVE_PEERS_VENV", "/nonexistent/venv")  # peers: not installed
    cfg = AgenticConfig(
        sessions=load_sessions(default_trace_dir(), sessions=1, max_turns=1), block_tokens=16,
        concurrency=[4, 8], routers=["beamserve", "beamserve-2p2d", "beamserve-adaptive",
                                     "smg-cache_aware"], repeat=3,
    )  # fmt: skip
    results = run_agentic(cfg, say=lambda _: None)
    ran = [c for c in calls if c[1] == 4]
    names = ["beamserve", "beamserve-2p2d", "beamserve-adaptive"]
    assert [c[0] for c in ran] == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert [c[2] for c in ran] == ["-r1"] * 3 + ["-r2"] * 3 + ["-r3"] * 3
    assert len(calls) == 18
    done = [r for r in results if not r.skipped]
    assert {(r.data["round"], r.data["rounds"]) for r in done} == {(0, 3), (1, 3), (2, 3)}
    assert {r.data["side"] for r in done} == {"ours"}
    # the peer that is not installed: skipped once a level, as without rounds
    assert [r.concurrency for r in results if r.skipped] == [4, 8]
    labels = {agentic._label(r) for r in done}
    assert labels == {f"{n} #{k}" for n in names for k in (1, 2, 3)}


def test_one_round_keeps_the_names_and_folders_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def one_run(cfg: Any, level: int, spec: Any, url: Any, *rest: Any) -> dict[str, Any]:
        calls.append(rest[-1] if rest else "")
        return {"total_tok_s_per_gpu": 1.0, "ttft_p90_s": 1.0, "goodput_rps": 1.0}

    monkeypatch.setattr(agentic, "_one_run", one_run)
    cfg = AgenticConfig(
        sessions=load_sessions(default_trace_dir(), sessions=1, max_turns=1), block_tokens=16,
        concurrency=[1], routers=["beamserve"],
    )  # fmt: skip
    (r,) = run_agentic(cfg, say=lambda _: None)
    assert calls == [""] and agentic._label(r) == "beamserve"


def test_the_goals_table_from_an_earlier_json(beamserve: RunBeamserve, tmp_path: Path) -> None:
    base = {"requests": 10, "ok": 10, "errors": {}, "output_tok_s_per_gpu": 1.0,
            "ttft_p50_s": 0.1, "ttft_p99_s": 2.0, "user_tok_s_p50": 50.0, "user_tok_s_p90": 60.0,
            "cache_hit_ratio": 0.8, "router_cpu_s_per_request": 0.01, "rounds": 2}  # fmt: skip
    rows = [
        base | row("beamserve-x", "ours", 1010.0, p90=0.7, good=9.0, rnd=0),
        base | row("gw", "peer", 1000.0, p90=0.8, good=6.0, rnd=0),
        base | row("gw", "peer", 1040.0, p90=0.8, good=6.0, rnd=1),
        base | row("beamserve-x", "ours", 1010.0, p90=0.7, good=9.0, rnd=1),
    ]
    src = tmp_path / "runs.json"
    src.write_text(json.dumps(rows))
    md = tmp_path / "runs.md"
    r = beamserve("bench", "agentic", "--from-json", str(src), "--markdown", str(md), timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    # (the title wraps where the temporary path makes it longer than the console)
    assert "against the best peer" in " ".join(r.stdout.split())
    text = md.read_text()
    assert "| beamserve-x #1 | 10/10 |" in text and "| gw #2 | 10/10 |" in text
    # 1010 ÷ 1020 (gw's mean); the rounds: 1010/1000 and 1010/1040
    want = (
        "| 16 | beamserve-x | 2 | 1,010 | gw | 0.990 | 0.971–1.010 | 0.70 / 0.80 | 1.50 | not met |"
    )
    assert want in text


def test_repeat_over_http_runs_each_level_in_rounds(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    out = tmp_path / "rounds.json"
    r = beamserve(
        "bench", "agentic", "--routers", "beamserve", "--workers", "1", "--sessions", "1",
        "--max-turns", "2", "--concurrency", "1", "--token-scale", "0.05", "--think-scale", "0",
        "--repeat", "2", "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(d["round"], d["rounds"], d["side"]) for d in rows] == [(0, 2, "ours"), (1, 2, "ours")]
    assert all(d["ok"] == d["requests"] == 2 for d in rows)
    for k in (1, 2):  # each round's own workers, logs and request records
        assert (tmp_path / "logs" / f"beamserve-c1-r{k}" / "requests.jsonl").is_file()
    assert "beamserve #2" in r.stdout
    assert "against the best peer" not in r.stdout  # no peer ran beside it
