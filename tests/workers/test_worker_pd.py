"""P/D handoff between `beamserve worker` processes over real HTTP: vLLM's two-leg
`kv_transfer_params`, SGLang's bootstrap (concurrent legs; driven by the real SGLang Model
Gateway, `sglang-router`), and a prefill worker lost before or in the middle of a transfer —
the decode side recomputes within its deadline, counts it, and still answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from tests.conftest import SpawnWorker, WorkerProc
from tests.workers.test_worker_http import LONG_PROMPT, metrics


def prefill_leg(p: WorkerProc, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    leg = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    r = httpx.post(p.url + path, json=leg, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def decode_leg(d: WorkerProc, body: dict[str, Any], params: Any, timeout: float = 60) -> Any:
    r = httpx.post(
        d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=timeout
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sim_vllm_two_leg_handoff(spawn_worker: SpawnWorker) -> None:
    p = spawn_worker("--engine", "sim", "--role", "prefill")
    d = spawn_worker("--engine", "sim", "--role", "decode")
    body = {"prompt": LONG_PROMPT, "max_tokens": 6}
    first = prefill_leg(p, body)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == p.handshake_port
    assert params["remote_num_tokens"] == first["usage"]["prompt_tokens"]
    assert metrics(p)["beamserve_worker_kv_leases_held"] == 1
    out = decode_leg(d, body, params)
    assert out["usage"]["completion_tokens"] == 6
    m = metrics(d)
    assert m["beamserve_worker_kv_transfers_total"] == 1
    assert m["beamserve_worker_kv_recompute_fallbacks_total"] == 0
    assert m["vllm:nixl_bytes_transferred_total"] > 0
    assert metrics(p)["beamserve_worker_kv_leases_held"] == 0  # released by the decode side


def test_sim_prefill_lost_decode_recomputes(spawn_worker: SpawnWorker) -> None:
    p = spawn_worker("--engine", "sim", "--role", "prefill")
    d = spawn_worker("--engine", "sim", "--role", "decode", "--kv-deadline-s", "3")
    body = {"prompt": LONG_PROMPT, "max_tokens": 4}
    params = prefill_leg(p, body)["kv_transfer_params"]
    p.kill()
    t0 = time.monotonic()
    out = decode_leg(d, body, params)
    assert time.monotonic() - t0 < 3 + 2
    assert out["usage"]["completion_tokens"] == 4
    m = metrics(d)
    assert m["beamserve_worker_kv_recompute_fallbacks_total"] == 1
    assert m["beamserve_worker_kv_transfers_total"] == 0


def test_sim_sglang_bootstrap_legs_race(spawn_worker: SpawnWorker) -> None:
    """SGLang style: the decode leg may arrive first and waits for the room's lease."""
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", "sglang")
    d = spawn_worker("--engine", "sim", "--role", "decode", "--api", "sglang")
    room = 123456789
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.handshake_port,
            "bootstrap_room": room}  # fmt: skip
    body = {"text": LONG_PROMPT, "sampling_params": {"max_new_tokens": 5}, **boot}
    result: dict[str, Any] = {}

    def decode() -> None:
        result["r"] = httpx.post(d.url + "/generate", json=body, timeout=30)

    t = threading.Thread(target=decode)
    t.start()
    time.sleep(0.5)  # decode is waiting now
    pr = httpx.post(p.url + "/generate", json=body, timeout=30)
    assert pr.status_code == 200
    t.join(30)
    r = result["r"]
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 5
    m = metrics(d)
    assert m["beamserve_worker_kv_transfers_total"] == 1
    assert m["beamserve_worker_kv_recompute_fallbacks_total"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sglang_model_gateway_drives_our_pd_workers(spawn_worker: SpawnWorker) -> None:
    """The real SGLang Model Gateway (`sglang-router`, PD mode) in front of our workers."""
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", "sglang")
    d = spawn_worker("--engine", "sim", "--role", "decode", "--api", "sglang")
    port = _free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", p.url, str(p.handshake_port), "--decode", d.url,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
        cwd="/",  # never `python -m` from the repository root (./operator shadows the stdlib)
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end and router.poll() is None, "sglang-router not ready"
            time.sleep(0.3)
        chat = {"model": "beam", "messages": [{"role": "user", "content": LONG_PROMPT}],
                "max_tokens": 5}  # fmt: skip
        r = None
        while time.monotonic() < end:  # the gateway activates workers after its health checks
            r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
            if r.status_code == 200:
                break
            time.sleep(0.5)
        assert r is not None and r.status_code == 200, r.text if r else None
        assert r.json()["usage"]["completion_tokens"] == 5
        g = httpx.post(
            url + "/generate",
            json={"text": "hello", "sampling_params": {"max_new_tokens": 3}},
            timeout=30,
        )
        assert g.status_code == 200 and len(g.json()["output_ids"]) == 3
        assert metrics(d)["beamserve_worker_kv_transfers_total"] == 2
        assert metrics(d)["beamserve_worker_kv_recompute_fallbacks_total"] == 0
    finally:
        router.terminate()
        router.wait(10)


@pytest.mark.integration
def test_ref_disaggregated_equals_colocated_and_survives_mid_transfer_death(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    ckpt = str(tiny_checkpoint)
    both = spawn_worker(
        "--engine", "ref", "--model", ckpt, "--kv-events-endpoint", "tcp://127.0.0.1:0"
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(str(both.info["kv_events"]))
    time.sleep(0.3)
    p = spawn_worker("--engine", "ref", "--role", "prefill", "--model", ckpt, "--tp", "2")
    d = spawn_worker("--engine", "ref", "--role", "decode", "--model", ckpt, "--tp", "1",
                     "--kv-deadline-s", "6")  # fmt: skip
    msgs = [{"role": "user", "content": "Write a function that adds two numbers in Python."}]
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0}
    want = httpx.post(both.url + "/v1/chat/completions", json=body, timeout=120).json()
    # The prefix cache published its blocks: 16-token pages, both KV lifetimes.
    groups: dict[int, int] = {}
    while sub.poll(2000):
        _topic, _seq, payload = sub.recv_multipart()
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if ev["type"] == "BlockStored":
                assert ev["block_size"] == 16
                groups[ev["group_idx"]] = groups.get(ev["group_idx"], 0) + len(ev["block_hashes"])
    sub.close(0)
    ctx.term()
    n = want["usage"]["prompt_tokens"]
    assert groups[0] == n // 16 and 0 < groups[1] <= groups[0]
    leg = prefill_leg(p, body, "/v1/chat/completions")
    got = httpx.post(
        d.url + "/v1/chat/completions",
        json={**body, "kv_transfer_params": leg["kv_transfer_params"]},
        timeout=120,
    ).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    m = metrics(d)
    assert m["beamserve_worker_kv_transfers_total"] == 1
    assert m["vllm:nixl_bytes_transferred_total"] > 0

    # The prefill worker dies after the decode side fetched the page table, before its reads.
    assert httpx.put(p.url + "/admin/faults", json={"die_after_lookup_s": 0.0}).status_code == 200
    leg = prefill_leg(p, body, "/v1/chat/completions")
    t0 = time.monotonic()
    got = httpx.post(
        d.url + "/v1/chat/completions",
        json={**body, "kv_transfer_params": leg["kv_transfer_params"]},
        timeout=120,
    ).json()
    assert time.monotonic() - t0 < 6 + 5
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    p.proc.wait(10)
    assert p.proc.returncode is not None  # it really died
    assert metrics(d)["beamserve_worker_kv_recompute_fallbacks_total"] == 1
