"""The router end to end over real HTTP: the official OpenAI and Anthropic SDKs through
`beamserve router` to `beamserve worker` processes (sim engine, precise mode with the tiny
checkpoint's tokenizer), session affinity, error shapes, a worker dying mid-stream, P/D."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from beamserve.workers.sim.profiles import get_profile
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SpawnWorker, WorkerProc

# The sim's tiny-cpu profile keeps a 128-token window (the tiny checkpoint only lends its
# tokenizer): the workers report it (`/v1/models`), or the router is told it.
SIM_WINDOW = get_profile("tiny-cpu").model.sliding_window
SYSTEM = "You are a coding agent. " + " ".join(f"rule{i}" for i in range(300))


def spec(w: WorkerProc, role: str = "both", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"url": w.url, "role": role, "engine": "sim"}
    if w.info.get("kv_events"):
        out["kv_events"] = w.info["kv_events"]
        out["kv_replay"] = w.info["kv_replay"]
    out.update(extra)
    return out


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def route_of(headers: httpx.Headers | Any) -> dict[str, str]:
    raw = headers.get("x-beamserve-route", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


@pytest.fixture
def pool(spawn_worker: SpawnWorker, tiny_checkpoint: Path) -> tuple[WorkerProc, list[WorkerProc]]:
    args = ["--engine", "sim", "--model", str(tiny_checkpoint), "--kv-events-endpoint",
            "tcp://127.0.0.1:0", "--kv-replay-endpoint", "tcp://127.0.0.1:0"]  # fmt: skip
    workers = [spawn_worker(*args) for _ in range(2)]
    router = spawn_worker(
        "--endpoints",
        json.dumps([spec(w) for w in workers]),
        "--tokenizer",
        str(tiny_checkpoint),
        "--scrape-interval-s",
        "0.5",
        command="router",
    )  # fmt: skip  (no --sliding-window: each worker reports its own window)
    return router, workers


def test_sdks_through_the_router(pool: tuple[WorkerProc, list[WorkerProc]]) -> None:
    router, _ = pool
    oa = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["beam"]
    r = oa.chat.completions.create(
        model="beam",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        max_tokens=6,
        tools=[{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
    )
    assert r.choices[0].finish_reason == "length" and r.usage and r.usage.completion_tokens == 6
    stream = oa.chat.completions.create(
        model="beam", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    ac = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0)
    msg = ac.messages.create(
        model="beam", max_tokens=5, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    with ac.messages.stream(
        model="beam", max_tokens=5, messages=[{"role": "user", "content": "hello"}]
    ) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens == 5 and final.content[0].type == "text"
    resp = oa.responses.create(model="beam", input="hello", max_output_tokens=4)
    assert resp.usage is not None and resp.usage.output_tokens == 4


def test_session_stays_on_its_warm_worker(pool: tuple[WorkerProc, list[WorkerProc]]) -> None:
    router, _ = pool
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "turn 0"}]  # fmt: skip
    seen = []
    for turn in range(4):
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "beam", "messages": msgs, "max_tokens": 3},
            headers={"x-session-id": "s-affinity"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        route = route_of(r.headers)
        seen.append(route["decode"])
        if turn > 0:
            assert route["band"] == "continuing"
            assert route["hit"].startswith("full:"), route  # the window tail is resident too
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"turn {turn}"}]
    assert len(set(seen)) == 1
    assert metric(router.url, "beamserve_router_prefix_hits_total", kind="full") >= 3
    # between turns the session rests on its worker (its next turn is expected back there)
    resting = metric(router.url, "beamserve_router_worker_resting_sessions", worker=seen[0])
    assert resting >= 1
    # another session with the same opening shares its prefix: routed to the same worker
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "beam", "messages": msgs[:2], "max_tokens": 2},
        headers={"x-session-id": "s-other"},
    )
    assert route_of(r.headers)["decode"] == seen[0]


def test_bad_requests_get_each_apis_error_shape(pool: tuple[WorkerProc, list[WorkerProc]]) -> None:
    router, _ = pool
    r = httpx.post(router.url + "/v1/chat/completions", content=b"{nope",
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json() and "message" in r.json()["error"]
    r = httpx.post(router.url + "/v1/messages", json={"model": "beam", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    big = {"model": "beam", "messages": [{"role": "user", "content": "x" * (33 * 2**20)}]}
    r = httpx.post(router.url + "/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413
    nope = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(router.url + "/v1/chat/completions", json=nope)
    assert r.status_code == 404 and "beam" in r.json()["error"]["message"]


def test_worker_dying_mid_stream_and_after(pool: tuple[WorkerProc, list[WorkerProc]]) -> None:
    router, workers = pool
    body = {"model": "beam", "messages": [{"role": "user", "content": "die"}], "max_tokens": 40,
            "stream": True}  # fmt: skip
    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": False,
                   "max_tokens": 1}, headers={"x-session-id": "s-die"})  # fmt: skip
    victim_id = route_of(r.headers)["decode"]
    victim = next(w for w in workers if w.url.endswith(victim_id.split(":")[-1]))
    httpx.put(victim.url + "/admin/faults", json={"die_after_tokens": 3})
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                      headers={"x-session-id": "s-die"}, timeout=30) as s:  # fmt: skip
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    assert "error" in events[-1], lines[-3:]  # the client learns of it, and does not hang
    # the worker is dead now: the next turn of that session goes elsewhere and succeeds
    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": False},
                   headers={"x-session-id": "s-die"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    assert route_of(r.headers)["decode"] != victim_id


def test_disaggregated_prefill_and_fallback(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--model", str(tiny_checkpoint))
    d = spawn_worker("--engine", "sim", "--role", "decode", "--model", str(tiny_checkpoint))
    router = spawn_worker(
        "--endpoints", json.dumps([spec(p, "prefill"), spec(d, "decode")]),
        "--tokenizer", str(tiny_checkpoint), "--sliding-window", str(SIM_WINDOW),
        "--disaggregation", json.dumps({"min_uncached_tokens": 64, "require": "either"}),
        "--prefill-timeout-s", "3", command="router",
    )  # fmt: skip
    body = {"model": "beam", "messages": [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "go"}], "max_tokens": 4}  # fmt: skip
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert route_of(r.headers)["prefill"] != "-"
    assert metric(d.url, "beamserve_worker_kv_transfers_total") == 1
    p.kill()  # the prefill pool is gone: the decode worker prefills locally, the client is served
    body["messages"][1]["content"] = "again, something new"
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert time.monotonic() - t0 < 10
    assert metric(router.url, "beamserve_router_pd_fallbacks_total") >= 1


def test_sglang_style_pd_through_the_router(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    """SGLang-mode workers: the router sends both legs at once with bootstrap fields."""
    m = str(tiny_checkpoint)
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", "sglang", "--model", m)
    d = spawn_worker("--engine", "sim", "--role", "decode", "--api", "sglang", "--model", m)
    labels = {"api": "sglang", "bootstrap_port": str(p.handshake_port)}
    router = spawn_worker(
        "--endpoints", json.dumps([spec(p, "prefill", labels=labels),
                                   spec(d, "decode", labels={"api": "sglang"})]),
        "--tokenizer", m, "--sliding-window", str(SIM_WINDOW),
        "--disaggregation", json.dumps({"min_uncached_tokens": 64, "require": "either"}),
        command="router",
    )  # fmt: skip
    oa = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        oa.chat.completions.create(
            model="beam", max_tokens=5, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}],
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert metric(d.url, "beamserve_worker_kv_transfers_total") == 1
    assert metric(d.url, "beamserve_worker_kv_recompute_fallbacks_total") == 0
    assert metric(router.url, "beamserve_router_disaggregated_total") == 1


def test_client_disconnect_cancels_upstream_work(spawn_worker: SpawnWorker) -> None:
    w = spawn_worker("--engine", "sim", "--faults", json.dumps({"slowdown": 20}))
    router = spawn_worker("--endpoints", json.dumps([spec(w)]), command="router")
    body = {"model": "beam", "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 2000, "stream": True}  # fmt: skip
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # tokens are flowing; now walk away
    deadline = time.monotonic() + 10
    while metric(w.url, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the worker kept generating for a gone client"
        time.sleep(0.2)
    assert metric(w.url, "vllm:generation_tokens_total") < 2000
    assert metric(router.url, "beamserve_router_in_flight") == 0


@pytest.mark.integration
def test_ref_engine_disaggregated_through_the_router(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    """Real tiny Beam: the router splits prefill (TP2) from decode (TP1), the KV moves over
    NIXL between the worker processes, and greedy output equals the colocated worker's."""
    m = str(tiny_checkpoint)
    both = spawn_worker("--engine", "ref", "--model", m)
    p = spawn_worker("--engine", "ref", "--role", "prefill", "--model", m, "--tp", "2",
                     "--kv-events-endpoint", "tcp://127.0.0.1:0")  # fmt: skip
    d = spawn_worker("--engine", "ref", "--role", "decode", "--model", m, "--tp", "1")
    ref = {"engine": "ref"}  # the ref workers report their 16-token pages themselves
    router = spawn_worker(
        "--endpoints", json.dumps([spec(p, "prefill", **ref), spec(d, "decode", **ref)]),
        "--tokenizer", m,
        "--disaggregation", json.dumps({"min_uncached_tokens": 16, "require": "either"}),
        command="router",
    )  # fmt: skip
    ask = [{"role": "user", "content": "Write a function that adds two numbers."}]
    body = {"model": "beam", "max_tokens": 8, "temperature": 0, "messages": ask}
    want = httpx.post(both.url + "/v1/chat/completions", json=body, timeout=120).json()
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert route_of(r.headers)["prefill"] != "-"
    assert r.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert metric(d.url, "beamserve_worker_kv_transfers_total") == 1
    assert metric(d.url, "vllm:nixl_bytes_transferred_total") > 0
