"""`beamserve sidecar` in front of real `beamserve worker --engine sim` processes, in both
handoff styles (vLLM: `--role prefill|decode`; SGLang: `--api sglang`, whose `/server_info`
reports the disaggregation mode): `x-prefiller-host-port` runs the prefill on the named worker
and the decode worker gets the KV (the workers' own counters say so); without the header the
request passes through; a bad header is a 400; every way the handoff cannot happen is served
colocated and counted; and the header the router's ext_proc picker sets, sent on as Envoy
would, really disaggregates."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from beamserve.router.sidecar import (
    BadPrefillerHeader,
    PrefillerAddress,
    handoff_refusal,
    parse_prefiller,
)
from beamserve.router.types import Endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.conftest import SpawnWorker, WorkerProc
from tests.router.test_grpc import envoy_request, set_headers, streamed
from tests.router.test_router_e2e import metric

STYLES = ("vllm", "sglang")
PROMPT_TOKENS = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}
TRANSFERS = "beamserve_worker_kv_transfers_total"
TRANSFER_BYTES = "beamserve_worker_kv_transfer_bytes_total"
RECOMPUTES = "beamserve_worker_kv_recompute_fallbacks_total"
FALLBACKS = "beamserve_sidecar_pd_fallbacks_total"
HEADER = "x-prefiller-host-port"
PROMPT = "refactor the parser and keep the tests green " * 40


def chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": "beam",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        **extra,
    }


def address(w: WorkerProc) -> str:
    return w.url.removeprefix("http://")


def style_args(style: str) -> tuple[str, ...]:
    return ("--api", "sglang") if style == "sglang" else ()


@dataclass
class Pod:
    """One prefill worker elsewhere; one decode worker with its sidecar in front."""

    style: str
    prefill: WorkerProc
    decode: WorkerProc
    sidecar: WorkerProc

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.sidecar.url + path, json=body, headers=headers or {}, timeout=60)

    def pd(self, body: Any, path: str = "/v1/chat/completions") -> httpx.Response:
        return self.post(path, body, {HEADER: address(self.prefill)})

    def prompt_tokens(self, w: WorkerProc) -> float:
        return metric(w.url, PROMPT_TOKENS[self.style])


def spawn_pod(
    spawn_worker: SpawnWorker,
    style: str,
    *sidecar_args: str,
    prefill_style: str | None = None,
    prefill_role: str = "prefill",
) -> Pod:
    with ThreadPoolExecutor(2) as pool:  # both start at once (each takes seconds)
        p = pool.submit(
            spawn_worker, "--engine", "sim", "--role", prefill_role,
            *style_args(prefill_style or style),
        )  # fmt: skip
        d = pool.submit(spawn_worker, "--engine", "sim", "--role", "decode", *style_args(style))
        prefill, decode = p.result(), d.result()
    sidecar = spawn_worker(
        "--decode", decode.url, "--host", "127.0.0.1", *sidecar_args, command="sidecar"
    )
    return Pod(style, prefill, decode, sidecar)


def sse_frames(text: str) -> list[str]:
    return [f.removeprefix("data: ") for f in text.split("\n\n") if f.startswith("data: ")]


def fallback_logs(sidecar: WorkerProc) -> list[dict[str, Any]]:
    """The sidecar's structured `sidecar.pd_fallback` lines (stops the process to read them)."""
    sidecar.stop()
    assert sidecar.proc.stderr is not None
    lines = [json.loads(x) for x in sidecar.proc.stderr.read().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("event") == "sidecar.pd_fallback"]


# --- the header, parsed -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "host", "port"),
    [
        ("10.0.1.7:8000", "10.0.1.7", 8000),
        (" prefill-0.beam.svc:8200 ", "prefill-0.beam.svc", 8200),
        ("[fd00::7]:65535", "fd00::7", 65535),
    ],
)
def test_prefiller_header_values(value: str, host: str, port: int) -> None:
    addr = parse_prefiller(value)
    assert (addr.host, addr.port) == (host, port)
    assert parse_prefiller(addr.address) == addr


@pytest.mark.parametrize(
    "value",
    ["", "10.0.1.7", "10.0.1.7:", ":8000", "10.0.1.7:0", "10.0.1.7:70000", "10.0.1.7:80a",
     "fd00::7:8000", "[fd00::7]8000", "[nothost]:8000", "http://10.0.1.7:8000",
     "10.0.1.7:8000/v1"],
)  # fmt: skip
def test_malformed_prefiller_header_values_name_the_header_and_the_form(value: str) -> None:
    with pytest.raises(BadPrefillerHeader, match=f"{HEADER}: expected host:port"):
        parse_prefiller(value)


def test_handoff_refusal_names_why() -> None:
    def ep(url: str, api: Any, send: bool, receive: bool, boot: int | None = None) -> Endpoint:
        role = "prefill" if "//p" in url else "decode"
        return Endpoint(
            id=url, url=url, role=role, api=api, kv_send=send, kv_receive=receive,
            bootstrap_port=boot,
        )  # fmt: skip

    vp, vd = ep("http://p:1", "vllm", True, False), ep("http://d:1", "vllm", False, True)
    sp = ep("http://p:1", "sglang", True, False, 9000)
    sd = ep("http://d:1", "sglang", False, True)
    assert handoff_refusal(vp, vd) is None and handoff_refusal(sp, sd) is None
    assert handoff_refusal(None, vd) == "prefill_unreachable"
    assert handoff_refusal(vp, None) == "decode_unprobed"
    assert handoff_refusal(vp, vd, same_worker=True) == "same_worker"
    assert handoff_refusal(vp, sd) == "style_mismatch"
    assert handoff_refusal(ep("http://p:1", "sglang", False, False), sd) == "not_a_sender"
    assert handoff_refusal(sp, ep("http://d:1", "sglang", False, False)) == (
        "decode_not_a_receiver"
    )
    no_port = ep("http://p:1", "sglang", True, False)
    assert handoff_refusal(no_port, sd) == "no_bootstrap_port"
    assert PrefillerAddress("fd00::7", 80).url == "http://[fd00::7]:80"


# --- against real workers ------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_header_runs_the_prefill_on_the_named_worker(
    spawn_worker: SpawnWorker, style: str, stream: bool
) -> None:
    pod = spawn_pod(spawn_worker, style)
    r = pod.pd(chat(stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        frames = sse_frames(r.text)
        assert frames[-1] == "[DONE]"
        chunks = [json.loads(f) for f in frames[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not any(c.get("usage") for c in chunks)  # the client did not ask for usage
    else:
        assert r.json()["usage"]["completion_tokens"] == 4
    # the prefill worker computed the prompt; the decode worker pulled its KV, not recomputed
    assert pod.prompt_tokens(pod.prefill) > 500
    assert metric(pod.decode.url, TRANSFERS) == 1
    assert metric(pod.decode.url, TRANSFER_BYTES) > 0
    assert metric(pod.decode.url, RECOMPUTES) == 0
    s = pod.sidecar.url
    assert metric(s, "beamserve_sidecar_disaggregated_total", style=style) == 1
    assert metric(s, "beamserve_sidecar_requests_total", mode="disaggregated") == 1
    assert metric(s, FALLBACKS) == 0


@pytest.mark.parametrize("style", STYLES)
def test_anthropic_and_responses_calls_are_split_and_translated(
    spawn_worker: SpawnWorker, style: str
) -> None:
    """The workers speak chat: the sidecar runs both legs in it and answers in the client's API
    (the official SDKs parse the answers)."""
    pod = spawn_pod(spawn_worker, style)
    headers = {HEADER: address(pod.prefill)}
    ac = anthropic.Anthropic(
        base_url=pod.sidecar.url, api_key="x", max_retries=0, default_headers=headers
    )
    messages: Any = [{"role": "user", "content": PROMPT}]
    msg = ac.messages.create(model="beam", max_tokens=5, system="be brief", messages=messages)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    with ac.messages.stream(model="beam", max_tokens=3, messages=messages) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 3 and final.content[0].type == "text"
    oa = openai.OpenAI(
        base_url=pod.sidecar.url + "/v1", api_key="x", max_retries=0, default_headers=headers
    )
    resp = oa.responses.create(model="beam", input=PROMPT, max_output_tokens=4)
    assert resp.usage is not None and resp.usage.output_tokens == 4
    assert metric(pod.decode.url, TRANSFERS) == 3 and metric(pod.decode.url, RECOMPUTES) == 0
    assert pod.prompt_tokens(pod.prefill) > 3 * 500
    assert metric(pod.sidecar.url, "beamserve_sidecar_disaggregated_total", style=style) == 3
    # The prefill worker gone: its leg fails (the sidecar still knew it), then it is not asked
    # again; colocated answers, still in the client's API.
    pod.prefill.kill()
    for _ in range(2):
        msg = ac.messages.create(model="beam", max_tokens=2, messages=messages)
        assert msg.usage.output_tokens == 2
    failed = "sglang_prefill_failed" if style == "sglang" else "prefill_failed"
    assert metric(pod.sidecar.url, FALLBACKS, reason=failed) == 1
    assert metric(pod.sidecar.url, FALLBACKS, reason="prefill_unreachable") == 1
    assert metric(pod.decode.url, TRANSFERS) == 3


@pytest.mark.parametrize("style", STYLES)
def test_without_the_header_the_request_passes_through(
    spawn_worker: SpawnWorker, style: str
) -> None:
    pod = spawn_pod(spawn_worker, style)
    r = pod.post("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.text)
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["usage"]["completion_tokens"] == 4
    # the worker's own answers, as it gave them: its models list, its error shape and status
    assert (
        httpx.get(pod.sidecar.url + "/v1/models").json()
        == httpx.get(pod.decode.url + "/v1/models").json()
    )
    bad = {"model": "beam", "messages": [], "max_tokens": 2}
    direct = httpx.post(pod.decode.url + "/v1/chat/completions", json=bad)
    relayed = pod.post("/v1/chat/completions", bad)
    assert (relayed.status_code, relayed.content) == (direct.status_code, direct.content)
    assert relayed.json()["error"]["type"] == "BadRequestError"  # the worker's, not the router's
    assert pod.prompt_tokens(pod.prefill) == 0  # the prefill worker saw nothing
    assert pod.prompt_tokens(pod.decode) > 500 and metric(pod.decode.url, TRANSFERS) == 0
    assert metric(pod.sidecar.url, "beamserve_sidecar_requests_total", mode="passthrough") == 3
    # its /metrics is the decode worker's (a router scraping the pod reads its load), plus its own
    assert pod.prompt_tokens(pod.sidecar) == pod.prompt_tokens(pod.decode)


def test_a_malformed_header_is_a_400_in_the_clients_shape(spawn_worker: SpawnWorker) -> None:
    pod = spawn_pod(spawn_worker, "vllm")
    r = pod.post("/v1/chat/completions", chat(), {HEADER: "10.0.1.7"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert HEADER in err["message"] and "host:port" in err["message"]
    anthropic = {"model": "beam", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = pod.post("/v1/messages", anthropic, {HEADER: "prefill:http"})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert HEADER in body["error"]["message"] and "host:port" in body["error"]["message"]
    assert pod.prompt_tokens(pod.prefill) == 0 and pod.prompt_tokens(pod.decode) == 0
    assert metric(pod.sidecar.url, "beamserve_sidecar_requests_total", mode="rejected") == 2


@pytest.mark.parametrize("style", STYLES)
def test_a_dead_prefill_worker_is_served_colocated_and_counted(
    spawn_worker: SpawnWorker, style: str
) -> None:
    pod = spawn_pod(spawn_worker, style)
    pod.prefill.kill()
    t0 = time.monotonic()
    r = pod.pd(chat())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 5  # no wait for a worker that is not there
    assert pod.prompt_tokens(pod.decode) > 500 and metric(pod.decode.url, TRANSFERS) == 0
    assert metric(pod.decode.url, RECOMPUTES) == 0  # colocated from the start: no KV awaited
    s = pod.sidecar.url
    assert metric(s, FALLBACKS, reason="prefill_unreachable") == 1
    assert metric(s, "beamserve_sidecar_requests_total", mode="colocated") == 1
    logs = fallback_logs(pod.sidecar)
    assert [(x["reason"], x["prefiller"]) for x in logs] == [
        ("prefill_unreachable", address(pod.prefill))
    ]


def test_a_failing_or_slow_prefill_leg_is_served_colocated_in_bounded_time(
    spawn_worker: SpawnWorker,
) -> None:
    pod = spawn_pod(spawn_worker, "vllm", "--prefill-timeout-s", "1.5")
    faults = pod.prefill.url + "/admin/faults"
    httpx.put(faults, json={"fail_next": 1}).raise_for_status()
    r = pod.pd(chat())
    assert r.status_code == 200, r.text
    httpx.put(faults, json={"slowdown": 10_000}).raise_for_status()
    t0 = time.monotonic()
    r = pod.pd(chat())
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 6  # the prefill leg's timeout, then the local prefill
    assert metric(pod.decode.url, TRANSFERS) == 0
    assert metric(pod.sidecar.url, FALLBACKS, reason="prefill_failed") == 2
    logs = fallback_logs(pod.sidecar)
    assert [x["reason"] for x in logs] == ["prefill_failed", "prefill_failed"]
    assert "503" in logs[0]["error"] and "no answer in 1.5 s" in logs[1]["error"]


@pytest.mark.parametrize(
    ("style", "prefill_style", "prefill_role", "reason"),
    [
        ("sglang", "vllm", "prefill", "style_mismatch"),
        ("vllm", "sglang", "prefill", "style_mismatch"),
        ("sglang", "sglang", "both", "not_a_sender"),
    ],
)
def test_workers_that_cannot_hand_kv_over_are_served_colocated(
    spawn_worker: SpawnWorker, style: str, prefill_style: str, prefill_role: str, reason: str
) -> None:
    pod = spawn_pod(spawn_worker, style, prefill_style=prefill_style, prefill_role=prefill_role)
    r = pod.pd(chat())
    assert r.status_code == 200, r.text
    assert metric(pod.prefill.url, PROMPT_TOKENS[prefill_style]) == 0  # never asked
    assert pod.prompt_tokens(pod.decode) > 500 and metric(pod.decode.url, TRANSFERS) == 0
    assert metric(pod.sidecar.url, FALLBACKS, reason=reason) == 1
    assert [x["reason"] for x in fallback_logs(pod.sidecar)] == [reason]


def test_a_client_gone_mid_stream_aborts_the_decode_leg(spawn_worker: SpawnWorker) -> None:
    pod = spawn_pod(spawn_worker, "vllm")
    running = "vllm:num_requests_running"
    with httpx.stream(
        "POST",
        pod.sidecar.url + "/v1/chat/completions",
        json=chat(max_tokens=5000, stream=True),
        headers={HEADER: address(pod.prefill)},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # (a dropped iterator would close the stream at once)
        next(chunks)
        deadline = time.monotonic() + 10
        while metric(pod.decode.url, running) != 1:  # the KV arrives, then it decodes
            assert time.monotonic() < deadline, "the decode leg never ran"
            time.sleep(0.05)
        next(chunks)
    deadline = time.monotonic() + 10
    while metric(pod.decode.url, running) != 0:
        assert time.monotonic() < deadline, "the decode worker kept generating"
        time.sleep(0.1)
    assert metric(pod.decode.url, "vllm:generation_tokens_total") < 5000


# --- behind the router's ext_proc endpoint picker -------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_the_pickers_header_sent_on_as_envoy_would_disaggregates(
    spawn_worker: SpawnWorker, style: str
) -> None:
    pod = spawn_pod(spawn_worker, style)
    # As in a pod: the decode endpoint the router discovers is the sidecar's port (the router
    # probes and scrapes the decode worker through it).
    specs = [
        {"url": pod.prefill.url, "id": "prefill-0", "role": "prefill"},
        {"url": pod.sidecar.url, "id": "decode-0", "role": "decode"},
    ]
    router = spawn_worker(
        "--endpoints", json.dumps(specs), "--grpc-port", "0",
        "--disaggregation", json.dumps({"min_uncached_tokens": 64}), command="router",
    )  # fmt: skip
    body = json.dumps(chat()).encode()
    channel = grpc.insecure_channel(f"127.0.0.1:{router.info['grpc_port']}")
    try:
        stub = pb_grpc.ExternalProcessorStub(channel)
        resps = list(stub.Process(iter(envoy_request(body, [200, 700])), timeout=20))
    finally:
        channel.close()
    picked = next(set_headers(r) for r in resps if r.HasField("request_headers"))
    destination = picked["x-gateway-destination-endpoint"]
    assert destination == address(pod.sidecar)
    assert picked[HEADER] == address(pod.prefill)
    # Envoy: the body the picker streamed back, to the picked endpoint, with the headers the
    # picker set.
    forwarded = b"".join(s.body for s in streamed(resps) if s.body)
    assert json.loads(forwarded) == json.loads(body)
    r = httpx.post(
        f"http://{destination}/v1/chat/completions",
        content=forwarded,
        headers={"content-type": "application/json", **picked},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert pod.prompt_tokens(pod.prefill) > 500
    assert metric(pod.decode.url, TRANSFERS) == 1 and metric(pod.decode.url, RECOMPUTES) == 0
    assert metric(pod.sidecar.url, "beamserve_sidecar_disaggregated_total", style=style) == 1
