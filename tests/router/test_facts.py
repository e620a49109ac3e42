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


@pytest.mark.parametrize(
    ("models", "server_info", "want"),
    [
        ({"data": [{"id": "a", "prefix_caching": False}]}, None, False),  # vLLM surface
        (MODELS, info("decode", prefix_caching=False), False),  # beamserve's own field
        (MODELS, info("decode", disable_radix_cache=True), False),  # SGLang's
        (MODELS, info("prefill", disable_radix_cache=False), True),
        (MODELS, info("null", prefix_caching="no", disable_radix_cache="x"), None),  # junk
        (MODELS, None, None),  # not reported: assumed to cache
    ],
)
def test_prefix_caching_is_what_the_worker_says(
    models: Any, server_info: Any, want: bool | None
) -> None:
    f = facts_from(models, server_info)
    assert f.prefix_caching is want
    assert apply_facts(Endpoint("w", "http://w", role="decode"), f).prefix_caching is want


@pytest.mark.parametrize(
    ("models", "server_info", "want"),
    [
        ({"data": [{"id": "a", "max_num_batched_tokens": 8192}]}, None, 8192),  # vLLM surface
        (MODELS, info("null", chunked_prefill_size=16384), 16384),  # SGLang's own
        (MODELS, info("null", chunked_prefill_size=-1), None),  # SGLang: chunking off
        ({"data": [{"id": "a", "max_num_batched_tokens": 4096}]}, info("null"), 4096),
        ({"data": [{"id": "a", "max_num_batched_tokens": "many"}]}, None, None),  # junk
        (MODELS, None, None),  # not reported
    ],
)
def test_step_budget_is_what_the_worker_says(
    models: Any, server_info: Any, want: int | None
) -> None:
    f = facts_from(models, server_info)
    assert f.step_budget == want
    assert apply_facts(Endpoint("w", "http://w"), f).step_budget == want


def test_no_predictions_on_a_worker_that_keeps_no_prefix() -> None:
    """A P/D dispatch predicts the prompt's blocks on both workers, except on a decode worker
    that reported it caches nothing (a ref decode worker, SGLang with --disable-radix-cache):
    the next turn must not be sent there to find a prefix that is not there."""
    from beamserve.router.core import RoutingCore
    from beamserve.router.policy import ConditionalDisaggregation, build_policy
    from beamserve.router.types import RouteRequest

    hashes = tuple(range(1, 41))  # 40 blocks of 64 tokens
    for caching in (None, False):
        core = RoutingCore(
            build_policy("sticky-until-saturated"),
            disaggregation=ConditionalDisaggregation.from_params({"min_uncached_tokens": 100}),
        )
        p = Endpoint("p", "http://p", role="prefill", kv_send=True, kv_receive=False)
        d = Endpoint("d", "http://d", role="decode", kv_send=False, kv_receive=True,
                     prefix_caching=caching)  # fmt: skip
        req = RouteRequest("r0", prompt_tokens=2560, block_hashes=hashes, session_id="s")
        decision = core.decide(req, [p, d])
        assert decision.prefill is not None and decision.prefill.id == "p"
        core.dispatched(req, decision)
        nxt = RouteRequest("r1", prompt_tokens=2624, block_hashes=(*hashes, 41), session_id="s")
        hits = {v.endpoint.id: v.hit.full_blocks for v in core.views(nxt, [p, d])}
        assert hits["p"] == 40
        assert hits["d"] == (40 if caching is None else 0)


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
    sg = spawn_worker(
        "--engine", "sim", "--api", "sglang", "--role", "prefill", "--max-num-batched-tokens", "384"
    )

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
        assert f.prefix_caching is True  # the sim engine keeps a prefix cache by default
    # and its step budget: the profile's, or the flag's
    assert v.step_budget == get_profile("tiny-cpu").max_batched_tokens
    assert s.step_budget == 384
