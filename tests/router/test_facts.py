"""What workers say about themselves (`router.facts`): the pure parse and fold, then the probe
against real worker processes of both API surfaces."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from beamserve.kvwire.geometry import KVGeometry
from beamserve.router.facts import FactsBook, apply_facts, facts_from, probe_facts
from beamserve.router.policy import pairs_with
from beamserve.router.types import Endpoint
from beamserve.workers.sim.profiles import get_profile

from tests.conftest import SpawnWorker

MODELS = {"object": "list", "data": [{"id": "beam", "max_model_len": 4096}]}


def info(mode: str, port: int | None = 8998, **extra: Any) -> dict[str, Any]:
    return {"disaggregation_mode": mode, "disaggregation_bootstrap_port": port, **extra}


def test_vllm_surface_keeps_the_deployment_role() -> None:
    f = facts_from(MODELS, None)
    assert (f.api, f.max_model_len, f.disaggregation_mode) == ("vllm", 4096, None)
    p = apply_facts(Endpoint("p", "http://p", role="prefill"), f)
    d = apply_facts(Endpoint("d", "http://d", role="decode"), f)
    b = apply_facts(Endpoint("b", "http://b"), f)
    assert (p.kv_send, d.kv_receive, b.kv_send, b.kv_receive) == (True, True, False, False)
    assert pairs_with(p, d) and not pairs_with(b, d)
    kv_both = apply_facts(Endpoint("k", "http://k", labels=(("kv_role", "kv_both"),)), f)
    assert kv_both.kv_send and kv_both.kv_receive


def test_sglang_surface_is_taken_at_its_word() -> None:
    # Labelled vLLM-style `prefill`, but the worker reports SGLang's surface in mode null.
    ep = Endpoint("x", "http://x", role="prefill")
    null = apply_facts(ep, facts_from(MODELS, info("null")))
    assert null.api == "sglang" and not null.kv_send and not null.kv_receive
    p = apply_facts(ep, facts_from(MODELS, info("prefill")))
    d = apply_facts(Endpoint("d", "http://d", role="decode"), facts_from(MODELS, info("decode")))
    assert p.bootstrap_port == 8998 and pairs_with(p, d)
    no_port = apply_facts(ep, facts_from(MODELS, info("prefill", port=None)))
    assert not no_port.kv_send  # a sender with no bootstrap server cannot hand KV over


@pytest.mark.parametrize(
    ("models", "server_info", "want"),
    [
        ({"data": [{"id": "a", "max_model_len": 9}, {"id": "b", "max_model_len": 5}]}, None, 5),
        ({"data": [{"id": "a"}]}, info("null", context_length=777), 777),
        ({"data": "nonsense"}, None, None),
        ({"data": [{"id": "a", "max_model_len": True}]}, None, None),
        ({"data": [{"id": "a", "max_model_len": -3}]}, None, None),
    ],
)
def test_max_model_len(models: Any, server_info: Any, want: int | None) -> None:
    assert facts_from(models, server_info).max_model_len == want


def test_unprobed_workers_serve_colocated_only() -> None:
    p = apply_facts(Endpoint("p", "http://p", role="prefill"), None)
    d = apply_facts(Endpoint("d", "http://d", role="decode"), None)
    assert not pairs_with(p, d)


def test_facts_book_rebuilds_only_on_change() -> None:
    book = FactsBook()
    eps = [Endpoint("p", "http://p", role="prefill")]
    first = book.endpoints(eps)
    assert book.endpoints(eps) is first  # per request: no rebuild
    book.learned(eps[0], facts_from(MODELS, None))
    assert book.endpoints(eps) is not first and book.endpoints(eps)[0].kv_send
    book.forget([])
    assert book.get(eps[0]) is None


def test_probe_against_real_workers(spawn_worker: SpawnWorker) -> None:
    vllm = spawn_worker("--engine", "sim", "--max-model-len", "8192")
    sg = spawn_worker("--engine", "sim", "--api", "sglang", "--role", "prefill")

    async def main() -> list[Any]:
        async with aiohttp.ClientSession() as http:
            return [
                await probe_facts(http, Endpoint("v", vllm.url)),
                await probe_facts(http, Endpoint("s", sg.url, role="prefill")),
                await probe_facts(http, Endpoint("gone", "http://127.0.0.1:9")),
            ]

    v, s, gone = asyncio.run(main())
    assert v.api == "vllm" and v.max_model_len == 8192
    assert s.api == "sglang" and s.disaggregation_mode == "prefill"
    assert s.bootstrap_port == sg.handshake_port
    assert gone is None
    # each reports its KV geometry: 64-token pages, the sim profile's window, vLLM's hashes
    # and events (on the SGLang surface too: the sim engine hashes as vLLM does)
    window = get_profile("tiny-cpu").model.sliding_window
    for f in (v, s):
        assert f.geometry(KVGeometry.of(16, 512, "sglang")) == KVGeometry(64, window)
