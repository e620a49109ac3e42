"""`beamserve worker` over real HTTP: the OpenAI API through the official SDK, health, metrics
with vLLM's and SGLang's names, KV events decoded by an independent msgpack decoder, admin
faults, and malformed bodies (4xx in the OpenAI error shape, never 5xx)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
import zmq
from beamserve.workers.sim.profiles import get_profile
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SpawnWorker, WorkerProc

LONG_PROMPT = " ".join(f"token{i}" for i in range(400))  # ≈ 800 pseudo-tokens: 12 blocks of 64


def metrics(w: WorkerProc) -> dict[str, float]:
    text = httpx.get(w.url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture
def sim(spawn_worker: SpawnWorker) -> WorkerProc:
    return spawn_worker(
        "--engine", "sim", "--kv-events-endpoint", "tcp://127.0.0.1:0",
        "--kv-replay-endpoint", "tcp://127.0.0.1:0",
    )  # fmt: skip


def test_openai_sdk_chat_completions_and_streaming(sim: WorkerProc) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["beam"]
    r = client.chat.completions.create(
        model="beam", messages=[{"role": "user", "content": "hello"}], max_tokens=7
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="beam",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}


def test_completions_accepts_text_and_token_ids(sim: WorkerProc) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused")
    a = client.completions.create(model="beam", prompt="def f(x):", max_tokens=3)
    b = client.completions.create(model="beam", prompt=[11, 12, 13, 14], max_tokens=3)
    assert a.usage is not None and a.usage.completion_tokens == 3
    assert b.usage is not None and b.usage.prompt_tokens == 4


def test_prefix_cache_hits_show_in_usage_and_metrics(sim: WorkerProc) -> None:
    body = {"prompt": LONG_PROMPT, "max_tokens": 2}
    first = httpx.post(sim.url + "/v1/completions", json=body, timeout=30).json()
    again = httpx.post(sim.url + "/v1/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 64 * 64
    m = metrics(sim)
    assert m["vllm:prefix_cache_hits_total"] > 0
    assert m["vllm:prompt_tokens_total"] == 2 * n
    # the engine computed the first prompt whole and the second past its cached blocks
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert m["beamserve_worker_prefill_computed_tokens_total"] == 2 * n - cached
    busy, prefill_busy = (
        m[f"beamserve_worker_{k}_total"] for k in ("busy_seconds", "prefill_busy_seconds")
    )
    assert 0 < prefill_busy <= busy
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                 "beamserve_worker_kv_recompute_fallbacks_total"):  # fmt: skip
        assert name in m, name


def test_kv_events_decode_with_plain_msgpack(sim: WorkerProc) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(str(sim.info["kv_events"]))
    time.sleep(0.3)  # PUB/SUB joins late
    try:
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
        blocks = r.json()["usage"]["prompt_tokens"] // 64
        stored: dict[int, list[dict[str, Any]]] = {}
        seqs = []
        end = time.monotonic() + 10

        def full_blocks() -> int:
            return sum(len(e["block_hashes"]) for e in stored.get(0, []))

        while time.monotonic() < end and not (full_blocks() >= blocks and 1 in stored):
            if not sub.poll(500):
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            ts, events, _rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            assert isinstance(ts, float)
            for ev in events:
                if ev["type"] == "BlockStored":
                    stored.setdefault(ev["group_idx"], []).append(ev)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        full, window = stored[0][0], stored[1][0]
        assert full["kv_cache_spec_kind"] == "full_attention" and full["block_size"] == 64
        assert window["kv_cache_spec_kind"] == "sliding_window"
        window_size = get_profile("tiny-cpu").model.sliding_window
        assert window["kv_cache_spec_sliding_window"] == window_size
        assert full_blocks() == blocks >= 10
        parents = [e["parent_block_hash"] for e in stored[0]]
        assert parents[0] is None and all(isinstance(p, int) for p in parents[1:])
    finally:
        sub.close(0)
        ctx.term()


def test_malformed_bodies_get_openai_errors(sim: WorkerProc) -> None:
    cases = [
        (b"{not json", "body"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": [{"content": "x"}]}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
         "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), "n"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}],
                     "kv_transfer_params": {"do_remote_prefill": True}}).encode(),
         "kv_transfer_params"),
    ]  # fmt: skip
    for raw, field in cases:
        r = httpx.post(
            sim.url + "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400, (raw, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError"
        assert field in err["message"], (field, err)
    huge = {"prompt": "word " * 200_000, "max_tokens": 1}
    r = httpx.post(sim.url + "/v1/completions", json=huge, timeout=30)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_admin_faults_fail_and_die_mid_stream(sim: WorkerProc) -> None:
    bad = httpx.put(sim.url + "/admin/faults", json={"slowdown": 0})
    assert bad.status_code == 400 and "slowdown" in bad.json()["error"]["message"]
    assert httpx.put(sim.url + "/admin/faults", json={"fail_next": 1}).status_code == 200
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503
    httpx.put(sim.url + "/admin/faults", json={"die_after_tokens": 2})
    body = {"prompt": "hello", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", sim.url + "/v1/completions", json=body, timeout=30) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert "error" in json.loads(lines[-1][6:])  # the stream ends with an error event
    assert httpx.get(sim.url + "/health").status_code == 503
    assert metrics(sim)["beamserve_worker_ready"] == 0
    httpx.post(sim.url + "/admin/revive")
    httpx.put(sim.url + "/admin/faults", json={})
    assert httpx.get(sim.url + "/health").status_code == 200


def test_sglang_surface(spawn_worker: SpawnWorker, tiny_checkpoint: Path) -> None:
    w = spawn_worker("--engine", "sim", "--api", "sglang", "--model", str(tiny_checkpoint))
    info = httpx.get(w.url + "/get_server_info").json()
    assert info["disaggregation_mode"] == "null" and info["page_size"] == 64
    assert httpx.get(w.url + "/get_model_info").json()["is_generation"] is True
    assert httpx.get(w.url + "/health_generate").status_code == 200
    r = httpx.post(
        w.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    ).json()
    assert len(r["output_ids"]) == 4 and r["meta_info"]["finish_reason"]["type"] == "length"
    assert r["text"].replace(" ", "").isalpha()  # simulated output reads as words
    with httpx.stream(
        "POST",
        w.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}, "stream": True},
    ) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(json.loads(lines[-2][6:])["output_ids"]) == 3
    m = metrics(w)
    assert "sglang:num_queue_reqs" in m and "sglang:token_usage" in m
    load = httpx.get(w.url + "/get_load").json()
    assert load[0]["num_reqs"] == 0
