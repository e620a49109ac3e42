"""The router on the wire, over real HTTP to `beamserve worker` processes: every outcome of a
request releases what the router booked for it; disaggregation only between workers that can
hand KV to each other (learned from the workers); impossible prompts refused before any
upstream call; a huge body does not stall the event loop."""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import SpawnWorker, WorkerProc
from tests.router.test_router_e2e import SYSTEM, metric, route_of, spec

EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-replay-endpoint", "tcp://127.0.0.1:0"]


def router_books(router: WorkerProc) -> dict[str, dict[str, Any]]:
    return {w["id"]: w["load"] for w in httpx.get(router.url + "/debug/workers").json()}


def assert_books_empty(router: WorkerProc) -> None:
    deadline = time.monotonic() + 5  # a stream's close runs just after its last byte
    while True:
        books = router_books(router)
        busy = {
            w: ld
            for w, ld in books.items()
            if ld["in_flight"] or ld["prefill_tokens"] or ld["decode_tokens"]
        }
        if not busy and metric(router.url, "beamserve_router_in_flight") == 0:
            return
        assert time.monotonic() < deadline, f"load left booked: {busy}"
        time.sleep(0.1)


def chat(text: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": "beam",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_every_outcome_releases_the_books(spawn_worker: SpawnWorker, api: str) -> None:
    workers = [
        spawn_worker("--engine", "sim", "--api", api, "--max-model-len", "4096", *EVENTS)
        for _ in range(2)
    ]
    router = spawn_worker(
        "--endpoints", json.dumps([spec(w) for w in workers]), "--scrape-interval-s", "0.3",
        command="router",
    )  # fmt: skip
    url = router.url + "/v1/chat/completions"
    # Success, unary and streamed.
    assert httpx.post(url, json=chat("one"), timeout=30).status_code == 200
    assert httpx.post(url, json=chat("two", stream=True), timeout=30).status_code == 200
    # Refused by the worker (approximate mode forwards what it cannot count exactly): 400.
    r = httpx.post(url, json=chat("three", max_tokens=4000), timeout=30)
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    r = httpx.post(url, json=chat("four", max_tokens=4000, stream=True), timeout=30)
    assert r.status_code == 400, r.text
    # A worker failing (5xx) on every request: retried elsewhere, then a 5xx, nothing left.
    for w in workers:
        httpx.put(w.url + "/admin/faults", json={"fail_next": 100})
    r = httpx.post(url, json=chat("five", stream=True), timeout=30)
    assert r.status_code >= 500, r.text
    for w in workers:
        httpx.put(w.url + "/admin/faults", json={"fail_next": 0, "slowdown": 20})
    # The client walks away mid-stream.
    with httpx.stream("POST", url, json=chat("six", max_tokens=500, stream=True), timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    # The client walks away before the first byte (the worker is slow).
    for w in workers:
        httpx.put(w.url + "/admin/faults", json={"slowdown": 2000})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=chat("seven", max_tokens=500, stream=True), timeout=0.3)
    assert_books_empty(router)
    for w in workers:
        httpx.put(w.url + "/admin/faults", json={"slowdown": 1})
    # The refusals did not trip a breaker (the 5xx counted once per worker, under threshold).
    assert all(ld["healthy"] for ld in router_books(router).values())
    assert httpx.post(url, json=chat("eight"), timeout=30).status_code == 200
    assert_books_empty(router)


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_both_role_workers_are_never_disaggregated(spawn_worker: SpawnWorker, api: str) -> None:
    """The default configuration over `both`-role workers: long cold prompts stay colocated,
    no prefill runs twice, nothing falls back."""
    workers = [spawn_worker("--engine", "sim", "--api", api, *EVENTS) for _ in range(2)]
    router = spawn_worker("--endpoints", json.dumps([spec(w) for w in workers]), command="router")
    url = router.url + "/v1/chat/completions"
    sent = 0
    for i in range(4):
        cold = " ".join(f"w{i}x{j}" for j in range(3000))  # ≥ 2,048 uncached tokens
        stream = {"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {}
        r = httpx.post(url, json=chat(cold, **stream), timeout=60)
        assert r.status_code == 200, r.text
        assert route_of(r.headers)["prefill"] == "-"
        if stream:
            last = [ln for ln in r.text.splitlines() if ln.startswith("data: {")][-1]
            sent += json.loads(last[6:])["usage"]["prompt_tokens"]
        else:
            sent += r.json()["usage"]["prompt_tokens"]
    assert metric(router.url, "beamserve_router_disaggregated_total") == 0
    assert metric(router.url, "beamserve_router_pd_fallbacks_total") == 0
    # no prompt's tokens computed twice (a first turn beside the session before it may go in
    # pieces: the worker then sees its prefixes as requests, and computes each token once)
    computed = sum(metric(w.url, "beamserve_worker_prefill_computed_tokens_total") for w in workers)
    assert sent > 4 * 3000 and 0 < computed <= sent
    assert_books_empty(router)


def test_sglang_pd_is_learned_from_the_workers(spawn_worker: SpawnWorker) -> None:
    """No labels: the router reads `disaggregation_mode` and the bootstrap port from each
    worker's `/server_info`, and runs SGLang-style P/D between them with no fallback."""
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", "sglang", *EVENTS)
    d = spawn_worker("--engine", "sim", "--role", "decode", "--api", "sglang", *EVENTS)
    both = spawn_worker("--engine", "sim", "--api", "sglang", *EVENTS)
    eps = [spec(p, "prefill"), spec(d, "decode"), spec(both, "both")]
    router = spawn_worker("--endpoints", json.dumps(eps), command="router")
    url = router.url + "/v1/chat/completions"
    for i in range(3):
        cold = " ".join(f"q{i}y{j}" for j in range(3000))
        r = httpx.post(url, json=chat(cold), headers={"x-session-id": f"pd{i}"}, timeout=60)
        assert r.status_code == 200, r.text
        route = route_of(r.headers)
        if route["decode"] == d.url.removeprefix("http://"):
            assert route["prefill"] == p.url.removeprefix("http://")
        else:
            assert route["prefill"] == "-"  # the `both` worker is never split
    assert metric(router.url, "beamserve_router_pd_fallbacks_total") == 0
    assert metric(d.url, "beamserve_worker_kv_recompute_fallbacks_total") == 0
    assert metric(d.url, "beamserve_worker_kv_transfers_total") == metric(
        router.url, "beamserve_router_disaggregated_total"
    )
    assert_books_empty(router)


def test_impossible_prompts_are_refused_before_any_upstream_call(
    spawn_worker: SpawnWorker, tiny_checkpoint: Any
) -> None:
    m = str(tiny_checkpoint)
    w = spawn_worker("--engine", "sim", "--model", m, "--max-model-len", "2048")
    router = spawn_worker("--endpoints", json.dumps([spec(w)]), "--tokenizer", m, command="router")
    models = httpx.get(router.url + "/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 2048
    before = metric(w.url, "vllm:prompt_tokens_total")
    long = " ".join(f"tok{j}" for j in range(3000))
    for path, body in [
        ("/v1/chat/completions", chat(long)),
        ("/v1/chat/completions", chat("short", max_tokens=2047)),
        ("/v1/completions", {"model": "beam", "prompt": list(range(16, 3016)), "max_tokens": 4}),
    ]:
        r = httpx.post(router.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "maximum context length is 2048" in err["message"]
        assert err["code"] == "context_length_exceeded"
    r = httpx.post(
        router.url + "/v1/messages",
        json={"model": "beam", "max_tokens": 4, "messages": [{"role": "user", "content": long}]},
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "2048" in r.json()["error"]["message"]
    assert metric(w.url, "vllm:prompt_tokens_total") == before  # nothing reached the worker
    assert httpx.post(router.url + "/v1/chat/completions", json=chat("ok")).status_code == 200
    assert_books_empty(router)


def test_a_huge_body_does_not_stall_the_router(spawn_worker: SpawnWorker) -> None:
    """While a 20 MB request is parsed and tokenized (approximate mode: every piece counted),
    `/health` stays about as fast as when idle (a ratio, not a timed assert), and the big
    request ends in a 400 all the same."""
    w = spawn_worker("--engine", "sim")
    router = spawn_worker("--endpoints", json.dumps([spec(w)]), command="router")

    # one keep-alive client for both measurements: a new connection per call would time the
    # TCP handshake under load too, on the busy side only
    health = httpx.Client()

    def health_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            assert health.get(router.url + "/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)
        return out

    health_times(1)  # the connection
    idle = statistics.median(health_times(20))
    result: dict[str, Any] = {}

    def big() -> None:
        result["r"] = httpx.post(
            router.url + "/v1/chat/completions",
            content=HUGE_BODY,
            headers={"content-type": "application/json"},
            timeout=300,
        )

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the body is in and being handled
    busy: list[float] = []
    while t.is_alive() and len(busy) < 40:
        busy.extend(health_times(1))
    t.join(300)
    health.close()
    assert result["r"].status_code == 400, result["r"].text[:300]
    assert "maximum context length" in result["r"].json()["error"]["message"]
    assert len(busy) >= 5, "the big request ended before /health could be measured"
    ratio = statistics.median(busy) / idle
    assert ratio < 25, f"/health {statistics.median(busy) * 1e3:.1f} ms busy, {idle * 1e3:.1f} idle"


HUGE_BODY = json.dumps(chat("x" * 8 + " lorem ipsum dolor sit amet" * 740_000)).encode()


def test_a_huge_prompt_is_refused_without_tokenizing_it(
    spawn_worker: SpawnWorker, tiny_checkpoint: Any
) -> None:
    """Precise mode: a prompt longer than any tokenization of it could fit (its characters over
    the vocabulary's longest token) is refused at once, the limit and the count named."""
    m = str(tiny_checkpoint)
    w = spawn_worker("--engine", "sim", "--model", m)
    router = spawn_worker("--endpoints", json.dumps([spec(w)]), "--tokenizer", m, command="router")
    assert 19e6 < len(HUGE_BODY) < 32 * 1024 * 1024
    r = httpx.post(
        router.url + "/v1/chat/completions",
        content=HUGE_BODY,
        headers={"content-type": "application/json"},
        timeout=300,
    )
    assert r.status_code == 400, r.text[:300]
    assert "at least" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    assert_books_empty(router)


@pytest.mark.parametrize("gate", [8192, None])
def test_a_prompt_burst_on_a_pd_pool_queues_in_the_router_not_past_the_kv_deadline(
    spawn_worker: SpawnWorker, gate: int | None
) -> None:
    """SGLang's handoff sends both legs at once and the decode worker waits only its KV
    deadline (1 s here). A burst of long cold prompts into one prefill worker's own queue
    makes the later ones wait longer and be prefilled twice (gate off: `None`); the flow
    controller's prefill stage, with a gate under what the prefill worker does in that time,
    keeps them in the router instead and lets them go shortest first, so every one is handed
    over and none falls back."""
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", "sglang", *EVENTS)
    d = spawn_worker(
        "--engine", "sim", "--role", "decode", "--api", "sglang", "--kv-deadline-s", "1", *EVENTS
    )
    eps = [spec(p, "prefill"), spec(d, "decode")]
    flow = json.dumps({"prefill_gate_tokens": gate})
    router = spawn_worker("--endpoints", json.dumps(eps), "--flow", flow, command="router")
    url = router.url + "/v1/chat/completions"
    sizes = [9000, 3000, 7000, 4000, 8000, 5000, 6000, 9500]  # words; ≈ 2 tokens each
    results: dict[int, tuple[int, float]] = {}

    def send(i: int, words: int) -> None:
        cold = " ".join(f"b{i}w{j}" for j in range(words))
        t0 = time.monotonic()
        r = httpx.post(url, json=chat(cold), headers={"x-session-id": f"burst{i}"}, timeout=120)
        results[i] = (r.status_code, time.monotonic() - t0)

    threads = [threading.Thread(target=send, args=(i, n)) for i, n in enumerate(sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(status == 200 for status, _ in results.values()), results
    fallbacks = metric(d.url, "beamserve_worker_kv_recompute_fallbacks_total")
    if gate is None:
        assert fallbacks > 0  # the burst queued in the prefill worker, past the deadline
    else:
        assert fallbacks == 0
        assert metric(d.url, "beamserve_worker_kv_transfers_total") == len(sizes)
    assert metric(router.url, "beamserve_router_pd_fallbacks_total") == 0
    assert_books_empty(router)
