"""`beamserve bench agentic` / `wire-overhead`: the prompt builder against the sim's tokenizer,
the held-out session subset, the statistics on synthetic records, peers that are not
installed, and tiny real runs of the self-contained mode (beamserve router only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from beamserve.kvwire.codec import ApproxCodec
from beamserve.router.bench.agentic import AgenticConfig, last_session, run_agentic
from beamserve.router.bench.agentic_procs import ROUTERS, busy_figures
from beamserve.router.bench.agentic_stats import (
    RequestRecord,
    is_token_chunk,
    meets_slo,
    percentile,
    summarize,
)
from beamserve.router.bench.agentic_workload import (
    PromptBuilder,
    WorkloadError,
    block_tokens_for,
    default_trace_dir,
    held_out,
    load_sessions,
    session_files,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import RunBeamserve

TRACE = default_trace_dir()
CODEC = ApproxCodec()


def wrapper_tokens() -> int:
    return len(CODEC.encode(CODEC.render([{"role": "user", "content": ""}])))


# --- prompts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.05, 0.25, 0.3, 1.0])
def test_block_text_tokenizes_to_exactly_the_block_size(scale: float) -> None:
    bt = block_tokens_for(scale)
    assert bt == round(64 * scale)
    b = PromptBuilder(bt)
    for h in range(50):
        assert len(CODEC.encode(b.block_text("s", h))) == bt
    ids = list(range(300))
    text = b.text("s", ids)
    assert len(CODEC.encode(text)) == 300 * bt == b.prompt_tokens(ids)
    rendered = CODEC.encode(CODEC.render(b.messages("s", ids)))
    assert len(rendered) == 300 * bt + wrapper_tokens()


def test_equal_hash_ids_equal_text_and_namespaces_apart() -> None:
    b = PromptBuilder(16)
    assert b.text("trace_0002", [1, 2, 3]) == PromptBuilder(16).text("trace_0002", [1, 2, 3])
    assert b.block_text("trace_0002", 7) != b.block_text("trace_0002", 8)
    assert b.block_text("trace_0002", 7) != b.block_text("trace_0006", 7)  # local ids
    assert b.block_text("a", 1) != PromptBuilder(16, salt="run2").block_text("a", 1)
    with pytest.raises(WorkloadError):
        block_tokens_for(0.01)


def test_later_turns_extend_earlier_ones_as_the_hash_ids_say() -> None:
    (session,) = load_sessions(TRACE, sessions=1)
    b = PromptBuilder(16)
    pairs = 0
    for prev, cur in zip(session.turns, session.turns[1:], strict=False):
        common = 0
        for x, y in zip(prev.hash_ids, cur.hash_ids, strict=False):
            if x != y:
                break
            common += 1
        p_ids = CODEC.encode(b.text(session.name, prev.hash_ids))
        c_ids = CODEC.encode(b.text(session.name, cur.hash_ids))
        assert p_ids[: common * 16] == c_ids[: common * 16]
        if common < min(len(prev.hash_ids), len(cur.hash_ids)):
            assert p_ids[: (common + 1) * 16] != c_ids[: (common + 1) * 16]
        if common == len(prev.hash_ids):
            pairs += 1
            assert b.text(session.name, cur.hash_ids).startswith(
                b.text(session.name, prev.hash_ids)
            )
    assert pairs > 0


def test_held_out_subset_is_spread_deterministic_and_not_the_first_files() -> None:
    files = [Path(f"trace_{i:04d}.json") for i in range(64)]
    got = held_out(files, 8)
    assert got == held_out(list(reversed(files)), 8)
    assert [int(p.stem[-4:]) for p in got] == [4, 12, 20, 28, 36, 44, 52, 60]
    assert held_out(files, None) == files and held_out(files, 100) == files
    assert len(set(held_out(files, 7))) == 7


def test_sessions_past_the_set_are_copies_with_their_own_names_and_texts() -> None:
    files = [Path(f"trace_{i:04d}.json") for i in range(64)]
    assert session_files(files, 8) == [(f, f.stem) for f in held_out(files, 8)]
    got = session_files(files, 136)  # two rounds and a held-out 8
    names = [n for _, n in got]
    assert len(got) == 136 and len(set(names)) == 136
    assert names[:64] == [f.stem for f in files] and names[64] == "trace_0000~1"
    assert [f for f, n in got if n.endswith("~2")] == held_out(files, 8)
    sessions = load_sessions(TRACE, sessions=len(list(TRACE.glob("*.json"))) + 1, max_turns=2)
    first, copy = sessions[0], sessions[-1]
    assert copy.name.endswith("~1") and copy.turns == next(
        s.turns for s in sessions if s.name == copy.name.split("~")[0]
    )
    b = PromptBuilder(16)
    assert b.text(copy.name, copy.turns[0].hash_ids) != b.text(
        copy.name.split("~")[0], copy.turns[0].hash_ids
    )
    assert first.name == sorted(TRACE.glob("*.json"))[0].stem


def test_sessions_scale_outputs_and_think_times() -> None:
    raw = json.loads(sorted(TRACE.glob("*.json"))[0].read_text())["requests"]
    (s,) = load_sessions(
        sorted(TRACE.glob("*.json"))[0], token_scale=0.25, output_cap=64, think_scale=0.5,
        max_think_s=4.0, max_turns=6,
    )  # fmt: skip
    assert len(s.turns) == 6 and s.turns[0].think_s == 0
    for t, r in zip(s.turns, raw, strict=False):
        assert t.max_tokens == max(1, min(64, round(r["out"] * 0.25)))
        assert t.hash_ids == tuple(r["hash_ids"])
    assert [t.think_s for t in s.turns[1:]] == [min(r["think_time"] * 0.5, 4.0) for r in raw[1:6]]


# --- statistics --------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_token_chunks_are_told_from_the_role_chunk() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not is_token_chunk(role) and not is_token_chunk({"choices": [], "usage": {}})
    assert is_token_chunk({"choices": [{"delta": {"content": "we "}}]})
    assert is_token_chunk({"choices": [{"delta": {"content": ""}}]})  # a token with no text
    assert is_token_chunk({"choices": [{"delta": {}, "finish_reason": "length"}]})


def rec(ttft: float, out: int, decode_s: float, status: str = "ok", **kw: int) -> RequestRecord:
    return RequestRecord(
        "s", 0, sent=0.0, first_token=ttft, end=ttft + decode_s, status=status,
        output_tokens=out, **kw,
    )  # fmt: skip


def test_summary_goodput_errors_cache_hits() -> None:
    records = [
        rec(0.5, 64, 1.0, prompt_tokens=1000, cached_tokens=900),  # 64 tok/s: good
        rec(2.5, 64, 1.0, prompt_tokens=1000, cached_tokens=0),  # TTFT too long
        rec(1.0, 64, 8.0, prompt_tokens=1000, cached_tokens=500),  # 8 tok/s: too slow
        rec(0.1, 1, 0.0, prompt_tokens=1000, cached_tokens=1000),  # one token: meets tok/s
        RequestRecord("s", 1, sent=0.0, end=0.2, status="429"),
        RequestRecord("s", 2, sent=0.0, end=0.2, status="connect"),
        RequestRecord("s", 3, sent=0.0, end=0.2, status="429"),
    ]
    assert [meets_slo(r) for r in records[:4]] == [True, False, False, True]
    st = summarize(records, gpus=16, duration_s=10.0)
    assert st.requests == 7 and st.ok == 4
    assert st.errors == {"429": 2, "connect": 1}
    assert st.goodput_rps == pytest.approx(0.2)
    assert st.goodput_fraction == pytest.approx(2 / 7)
    assert st.cache_hit_ratio == pytest.approx(2400 / 4000)
    assert st.output_tok_s == pytest.approx(193 / 10)
    assert st.total_tok_s_per_gpu == pytest.approx(4193 / 10 / 16)
    assert st.ttft_p50_s == pytest.approx(0.75)
    assert st.user_tok_s_p50 == pytest.approx(64.0)


def test_the_last_session_is_what_ends_the_run() -> None:
    records = [
        RequestRecord("a", 0, sent=10.0, end=12.0),
        RequestRecord("b", 0, sent=10.5, end=11.0),
        RequestRecord("b", 1, sent=13.0, end=19.5),  # b ends last: started at 0.5, ran 9 s
        RequestRecord("c", 0, sent=14.0, end=15.0),
    ]
    assert last_session(records) == {
        "session": "b", "start_s": 0.5, "span_s": 9.0, "others_done_s": 5.0
    }  # fmt: skip
    assert last_session(records[:1])["others_done_s"] is None  # type: ignore[index]
    assert last_session([]) is None


def test_busy_figures_from_two_workers_samples() -> None:
    samples = [
        (0.0, [(10.0, 4.0, 1000.0), (0.0, 0.0, 0.0)]),
        (2.0, [(12.0, 5.0, 3000.0), (1.0, 0.0, 0.0)]),
        (4.0, [(13.0, 5.0, 3000.0), (3.0, 2.0, 500.0)]),
    ]
    f = busy_figures(samples)
    assert f["worker_busy_s"] == [3.0, 3.0]  # counted from the first sample, not from zero
    assert f["worker_prefill_busy_s"] == [1.0, 2.0]
    assert f["worker_prefill_computed_tokens"] == [2000, 500]
    assert f["worker_busy_share"] == pytest.approx(6.0 / (4.0 * 2))
    assert f["worker_busy_timeline"] == {"t": [2.0, 4.0], "busy": [[1.0, 0.5], [0.5, 1.0]]}
    assert busy_figures(samples[:1]) == {}  # one sample: no span
    idle = [(0.0, [(0.0, 0.0, 0.0)]), (2.0, [(0.0, 0.0, 0.0)])]
    assert busy_figures(idle) == {}  # workers without the counters (peers' engines, ref)


_counter_steps = st.lists(
    st.lists(st.floats(0.0, 3.0), min_size=2, max_size=2), min_size=1, max_size=12
)


@given(_counter_steps, st.lists(st.floats(0.5, 3.0), min_size=12, max_size=12))
def test_busy_figures_shares_stay_in_range_and_add_up(
    steps: list[list[float]], gaps: list[float]
) -> None:
    t, c = 0.0, [1.0, 1.0]
    samples = [(t, [(c[0], 0.0, 0.0), (c[1], 0.0, 0.0)])]
    for step, gap in zip(steps, gaps, strict=False):
        t += gap
        c = [c[0] + step[0], c[1] + step[1]]
        samples.append((t, [(c[0], 0.0, 0.0), (c[1], 0.0, 0.0)]))
    f = busy_figures(samples)
    assert f["worker_busy_s"] == pytest.approx([c[0] - 1.0, c[1] - 1.0])
    assert all(0.0 <= x <= 1.0 for row in f["worker_busy_timeline"]["busy"] for x in row)
    assert len(f["worker_busy_timeline"]["t"]) == len(steps)
    assert f["worker_busy_share"] == pytest.approx(sum(f["worker_busy_s"]) / (2 * t))


def test_peer_not_installed_is_skipped_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BEAMSERVE_PEERS_VENV", "/nonexistent/venv")
    why = ROUTERS["smg-cache_aware"].unavailable()
    assert why is not None and "make peers" in why
    said: list[str] = []
    cfg = AgenticConfig(
        sessions=load_sessions(TRACE, sessions=1, max_turns=1), block_tokens=16,
        concurrency=[1, 2], routers=["smg-cache_aware", "vllm-router-sticky_least_loaded"],
    )  # fmt: skip
    results = run_agentic(cfg, say=said.append)
    assert len(results) == 4 and all(r.skipped for r in results)
    assert len(said) == 2 and all("make peers" in s for s in said)


# --- real runs ---------------------------------------------------------------------------------

FIELDS = {
    "router", "concurrency", "requests", "ok", "errors", "duration_s", "total_tok_s",
    "output_tok_s", "total_tok_s_per_gpu", "output_tok_s_per_gpu", "ttft_p50_s", "ttft_p90_s",
    "ttft_p99_s", "user_tok_s_p50", "user_tok_s_p90", "cache_hit_ratio", "goodput_rps",
    "router_cpu_s", "router_cpu_s_per_request", "command", "versions", "gpus", "router_command",
}  # fmt: skip


def test_self_contained_run_through_the_beamserve_router(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    out = tmp_path / "agentic.json"
    r = beamserve(
        "bench", "agentic", "--routers", "beamserve", "--workers", "2", "--sessions", "2",
        "--max-turns", "4", "--concurrency", "1", "--token-scale", "0.05", "--think-scale", "0",
        "--worker-max-num-batched-tokens", "4096",
        "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["worker_max_num_batched_tokens"] == 4096
    for w in ("w0", "w1"):  # the started workers run with it (their ready lines say so)
        ready = (tmp_path / "logs" / "beamserve-c1" / f"{w}.out").read_text().splitlines()[0]
        assert json.loads(ready)["chunked_prefill_size"] == 4096
    lines = (tmp_path / "logs" / "beamserve-c1" / "requests.jsonl").read_text().splitlines()
    reqs = [json.loads(x) for x in lines]
    assert len(reqs) == 8 and {r["status"] for r in reqs} == {"ok"}
    assert sorted(r["turn"] for r in reqs) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(r["ttft_s"] > 0 and r["end_s"] >= r["sent_s"] for r in reqs)
    assert (tmp_path / "logs" / "beamserve-c1" / "beamserve.err").exists()
    assert set(row) >= FIELDS, FIELDS - set(row)
    assert row["router"] == "beamserve" and row["errors"] == {}
    assert row["requests"] == row["ok"] == 8
    last = row["last_session"]  # one agent: the second session starts when the first is done
    assert last["start_s"] > 0 and last["others_done_s"] <= last["start_s"] + 0.01
    assert last["start_s"] + last["span_s"] == pytest.approx(row["duration_s"], abs=0.05)
    assert row["gpus"] == 16 and row["block_tokens"] == 3
    assert row["ttft_p50_s"] > 0 and row["output_tok_s"] > 0 and row["router_cpu_s"] > 0
    assert row["cache_hit_ratio"] is not None and row["cache_hit_ratio"] > 0  # turns extend
    assert row["versions"]["beamserve"]
    # the sim workers' busy seconds, sampled over the run
    assert 0 < row["worker_busy_share"] <= 1 and len(row["worker_busy_s"]) == 2
    assert sum(row["worker_prefill_computed_tokens"]) > 0
    assert row["worker_busy_timeline"]["t"] and len(row["worker_busy_timeline"]["busy"][0]) == 2
    assert (tmp_path / "agentic.png").stat().st_size > 1000
    assert (tmp_path / "agentic-busy.png").stat().st_size > 1000  # the busy share over the run
    md = tmp_path / "agentic.md"
    r = beamserve("bench", "agentic", "--from-json", str(out), "--markdown", str(md), timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    text = md.read_text()
    assert "**Concurrency 1**" in text and "| beamserve | 8/8 | 0 |" in text


def test_a_2p2d_run_starts_the_same_workers_as_prefill_and_decode_and_splits_first_turns(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    """`beamserve-2p2d`: half the run's workers prefill, half decode; the router learns the
    roles and splits the long cold first turns, with no fallback."""
    out = tmp_path / "pd.json"
    r = beamserve(
        "bench", "agentic", "--routers", "beamserve-2p2d", "--workers", "4", "--sessions", "3",
        "--max-turns", "3", "--concurrency", "3", "--token-scale", "0.25", "--think-scale", "0",
        "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["ok"] == row["requests"] == 9 and row["errors"] == {}
    logs = tmp_path / "logs" / "beamserve-2p2d-c3"
    roles = [json.loads((logs / f"w{i}.out").read_text().splitlines()[0])["role"] for i in range(4)]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    decisions = [
        json.loads(x)
        for x in (logs / "beamserve-2p2d.err").read_text().splitlines()
        if '"router.decision"' in x
    ]
    first = [d for d in decisions if d["band"] == "new" and d["prompt_tokens"] >= 8192]
    assert first and all(d["prefill"] is not None for d in first)
    # the run records what the router itself counted: its splits, no fallback
    counters = row["router_counters"]
    assert counters["beamserve_router_disaggregated_total"] == len(first)
    assert not any(v for k, v in counters.items() if k.startswith("beamserve_router_pd_fallbacks"))
    for w in ("w2", "w3"):  # no decode worker gave up waiting for its KV
        assert "kv_transfer_failed" not in (logs / f"{w}.err").read_text()


def test_an_adaptive_run_starts_a_kv_both_pool_and_serves_it_colocated_while_light(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    """`beamserve-adaptive`: every worker role both on vLLM's surface with a KV handshake
    server; the router takes them as a pool that can swing (no `pool.roles_fixed` warning) and,
    3 sessions on 4 workers being under its split line, serves it colocated: nothing split."""
    out = tmp_path / "adaptive.json"
    r = beamserve(
        "bench", "agentic", "--routers", "beamserve-adaptive", "--workers", "4", "--sessions",
        "3", "--max-turns", "2", "--concurrency", "3", "--token-scale", "0.25", "--think-scale",
        "0", "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["ok"] == row["requests"] == 6 and row["errors"] == {}
    logs = tmp_path / "logs" / "beamserve-adaptive-c3"
    ready = [json.loads((logs / f"w{i}.out").read_text().splitlines()[0]) for i in range(4)]
    assert [w["role"] for w in ready] == ["both"] * 4
    assert all(w["handshake_url"] and w["api"] == "vllm" for w in ready)
    assert "pool.roles_fixed" not in (logs / "beamserve-adaptive.err").read_text()
    counters = row["router_counters"]
    assert counters["beamserve_router_pool_mode_switches_total"] == 0
    assert counters["beamserve_router_disaggregated_total"] == 0


def test_two_router_replicas_behind_haproxy_share_sessions(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    """`beamserve-x2`: two router processes, one Redis, HAProxy (`balance random`) in front.
    Both replicas route, and every session's turns land on one worker whichever replica
    decided them (the shared session store)."""
    out = tmp_path / "x2.json"
    r = beamserve(
        "bench", "agentic", "--routers", "beamserve-x2", "--workers", "2", "--sessions", "4",
        "--max-turns", "4", "--concurrency", "4", "--token-scale", "0.05", "--think-scale", "0",
        "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["router"] == "beamserve-x2" and row["ok"] == row["requests"] == 16
    run = tmp_path / "logs" / "beamserve-x2-c4"
    assert "balance random" in (run / "haproxy.cfg").read_text()
    workers_of: dict[str, set[str]] = {}
    deciders = set()
    for i in (0, 1):
        for line in (run / f"beamserve-x2-{i}.err").read_text().splitlines():
            if '"router.decision"' not in line:
                continue
            d = json.loads(line)
            if not d["session_id"].startswith("trace_"):  # the bench's readiness probe
                continue
            deciders.add(i)
            workers_of.setdefault(d["session_id"], set()).add(d["decode"])
    assert deciders == {0, 1}  # random balancing over 16 requests: both take some
    assert len(workers_of) == 4 and all(len(w) == 1 for w in workers_of.values()), workers_of


def test_wire_overhead_through_the_beamserve_router(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    out = tmp_path / "wire.json"
    r = beamserve(
        "bench", "wire-overhead", "--routers", "beamserve", "--tokens", "4000", "-n", "4",
        "--json", str(out), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["errors"] == 0 and len(row["router_ms"]) == len(row["direct_ms"]) == 4
    assert row["added_p50_ms"] == pytest.approx(
        row["router_ttft_p50_ms"] - row["direct_ttft_p50_ms"]
    )


def test_worker_settings_are_refused_for_workers_the_bench_does_not_start(
    beamserve: RunBeamserve,
) -> None:
    r = beamserve(
        "bench", "agentic", "--target", "http://127.0.0.1:9", "--concurrency", "1",
        "--worker-max-num-batched-tokens", "2048", timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--worker-max-num-batched-tokens" in r.stdout + r.stderr


def test_the_shipped_router_runs_beside_another_build_of_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`beamserve-adaptive-spill-baseline`: the shipped router's arguments, with the
    executable `BEAMSERVE_BASELINE` names; without one, the router cannot start."""
    shipped, base = (
        ROUTERS["beamserve-adaptive-spill"],
        ROUTERS["beamserve-adaptive-spill-baseline"],
    )
    assert base.extra_args == shipped.extra_args and base.kv_both
    monkeypatch.delenv("BEAMSERVE_BASELINE", raising=False)
    assert base.exe() is None
    exe = tmp_path / "beamserve"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setenv("BEAMSERVE_BASELINE", str(exe))
    assert base.exe() == str(exe)
    assert shipped.exe() != str(exe)
