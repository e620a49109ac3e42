"""One KV geometry per worker (`beamserve.kvwire.geometry`), learned from the worker.

The router's flags are the default geometry for workers that report none; the worker's own
report (HTTP facts, KV events) wins; the index match, the hasher, the policy and the
disaggregation decider all price a worker's hit with that worker's geometry; a pool of two
geometries is hashed once per geometry and each worker's hit is what a router of its geometry
alone would compute.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from beamserve.kvwire.events import (
    SPEC_KIND_FULL_ATTENTION,
    SPEC_KIND_SLIDING_WINDOW,
    BlockStored,
    KVEventBatch,
)
from beamserve.kvwire.geometry import DEFAULT_GEOMETRY, KVGeometry, KVGeometryError
from beamserve.kvwire.hashing import hash_blocks_sglang, hash_blocks_vllm
from beamserve.router.api.convert import UpstreamCall
from beamserve.router.cli import runtime_config
from beamserve.router.core import CoreConfig, RoutingCore
from beamserve.router.discovery import StaticDiscovery
from beamserve.router.facts import FactsBook, facts_from
from beamserve.router.index import PrefixIndex
from beamserve.router.policy import ConditionalDisaggregation, build_policy
from beamserve.router.prompt import PromptHasher
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.types import Endpoint, PrefixHit, RouteRequest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from beamserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


# --- the value ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"block_size": 0}, "block_size must be a positive number of tokens, got 0; use"),
        ({"block_size": True}, "block_size"),
        ({"sliding_window": -1}, "sliding_window must be ≥ 0 tokens, got -1; use config.json"),
        ({"hash_scheme": "sha1"}, "hash_scheme must be one of vllm, sglang, got 'sha1'"),
        ({"event_format": "kafka"}, "event_format must be one of vllm, sglang"),
    ],
)
def test_invalid_geometry_names_the_field_and_the_fix(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(KVGeometryError) as err:
        KVGeometry(**fields)
    assert needle in str(err.value)


def test_geometries_are_frozen_and_interned() -> None:
    g = KVGeometry.of(16, 128, "sglang")
    assert g is KVGeometry.of(16, 128, "sglang") and g.event_format == "sglang"
    assert g.with_(sliding_window=128) is g
    assert KVGeometry.of() is DEFAULT_GEOMETRY
    with pytest.raises(AttributeError):
        g.block_size = 64  # type: ignore[misc]


# --- defect: the flags never reached the policy ----------------------------------------------


def _partial_hit_runtime(config: RuntimeConfig) -> tuple[RouterRuntime, Endpoint]:
    """A runtime whose worker holds 10 blocks of the prompt in the full-attention group only
    (a partial hit: the window tail must be recomputed)."""
    ep = Endpoint("w0", "http://127.0.0.1:9")
    rt = RouterRuntime(StaticDiscovery([ep]), config)
    hashes = tuple(range(1, 21))
    rt.index.apply(
        "w0",
        KVEventBatch(
            0.0,
            (
                BlockStored(
                    hashes[:10],
                    None,
                    (),
                    config.block_size,
                    group_idx=0,
                    kv_cache_spec_kind=SPEC_KIND_FULL_ATTENTION,
                ),
            ),
        ),
    )
    return rt, ep


def _cached_tokens(rt: RouterRuntime, ep: Endpoint) -> str:
    req = RouteRequest("r", 2000, tuple(range(1, 21)))
    d = rt.core.decide(req, [ep])
    assert d.expected_hit == PrefixHit(10, False)
    return d.explain.split("cached=")[1].split()[0]


def test_cli_sliding_window_and_block_size_reach_the_default_policy() -> None:
    args = build_parser().parse_args(
        ["router", "--endpoints", "[]", "--sliding-window", "128", "--block-size", "16"]
    )

    async def main() -> str:
        rt, ep = _partial_hit_runtime(runtime_config(args))
        try:
            assert rt.core.views(RouteRequest("r", 1), [ep])[0].geometry == KVGeometry(16, 128)
            return _cached_tokens(rt, ep)
        finally:
            await rt.upstreams.aclose()
            rt.flow.close()

    # 10 blocks × 16 tokens − the 128-token window tail (not 10 × 64 − 512)
    assert asyncio.run(main()) == "32"


def test_window_defaults_to_the_tokenizers_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"sliding_window": 256}))
    assert RuntimeConfig(tokenizer=tmp_path).geometry() == KVGeometry(64, 256)
    assert RuntimeConfig(tokenizer=tmp_path, sliding_window=128).geometry().sliding_window == 128
    assert RuntimeConfig().geometry() is DEFAULT_GEOMETRY
    with pytest.raises(KVGeometryError, match="block_size"):
        RuntimeConfig(block_size=0).geometry()


def test_geometry_is_no_disaggregation_or_policy_parameter() -> None:
    from beamserve.router.policy import PolicyConfigError

    with pytest.raises(PolicyConfigError, match="unknown parameter 'sliding_window'; valid"):
        ConditionalDisaggregation.from_params({"sliding_window": 128})
    with pytest.raises(PolicyConfigError, match="unknown parameter 'block_size'; valid"):
        build_policy({"strategy": "sticky-until-saturated", "params": {"block_size": 16}})


# --- the worker's report wins ------------------------------------------------------------------


def _models(**extra: Any) -> dict[str, Any]:
    return {"data": [{"id": "beam", "max_model_len": 4096, **extra}]}


def test_worker_report_overrides_the_flags_and_a_mismatch_is_logged_once() -> None:
    flags = KVGeometry.of(64, 512)
    book = FactsBook(flags)
    ep = Endpoint("w0", "http://w0:1")
    facts = facts_from(_models(block_size=16, sliding_window=128, kv_hash_scheme="vllm"), None)
    with capture_logs() as logs:
        book.learned(ep, facts)
        book.learned(ep, facts)  # unchanged: nothing new
        eps = book.endpoints([ep])
        book.endpoints([ep])
    assert eps[0].geometry == KVGeometry(16, 128)
    assert [e["event"] for e in logs].count("worker.geometry_mismatch") == 1
    # the router's views price that worker in its own geometry
    core = RoutingCore(build_policy("sticky-until-saturated"), config=CoreConfig(flags))
    assert core.views(RouteRequest("r", 10), eps)[0].geometry == KVGeometry(16, 128)


def test_a_worker_that_reports_nothing_keeps_the_flags() -> None:
    flags = KVGeometry.of(32, 256)
    book = FactsBook(flags)
    ep = Endpoint("w0", "http://w0:1")
    book.learned(ep, facts_from(_models(), None))  # a real vLLM: no geometry in /v1/models
    (out,) = book.endpoints([ep])
    assert out.geometry is None
    core = RoutingCore(build_policy("sticky-until-saturated"), config=CoreConfig(flags))
    assert core.views(RouteRequest("r", 10), [out])[0].geometry is flags


def test_sglang_surface_page_size_and_scheme() -> None:
    info = {"disaggregation_mode": "null", "page_size": 32}
    g = facts_from(_models(), info).geometry(DEFAULT_GEOMETRY)
    assert g == KVGeometry(32, 512, "sglang", "sglang")
    # beamserve's sim worker on the SGLang surface hashes and publishes as vLLM does, and says so
    ours = {**info, "kv_hash_scheme": "vllm", "kv_event_format": "vllm", "sliding_window": 64}
    assert facts_from(_models(), ours).geometry(DEFAULT_GEOMETRY) == KVGeometry(32, 64)


def test_the_window_in_a_workers_kv_events_wins_over_the_flags() -> None:
    index = PrefixIndex()
    stored = BlockStored(
        (1,),
        None,
        (),
        64,
        group_idx=1,
        kv_cache_spec_kind=SPEC_KIND_SLIDING_WINDOW,
        kv_cache_spec_sliding_window=256,
    )
    index.apply("w0", KVEventBatch(0.0, (stored,)))
    book = FactsBook(DEFAULT_GEOMETRY)
    ep = Endpoint("w0", "http://w0:1")
    book.learned(ep, facts_from(_models(), None))
    assert book.endpoints([ep])[0].geometry is None
    book.event_windows(index.reported_windows)
    assert book.endpoints([ep])[0].geometry == KVGeometry(64, 256)
    index.remove_worker("w0")
    assert index.reported_windows == {}


# --- mixed pools --------------------------------------------------------------------------------

SGLANG16 = KVGeometry.of(16, 128, "sglang")
VLLM64 = KVGeometry.of(64, 512, "vllm")


def _hashes(tokens: list[int], g: KVGeometry) -> tuple[int, ...]:
    if g.hash_scheme == "sglang":
        pages = hash_blocks_sglang(tokens, g.block_size, include_partial=False)
        return tuple(b.event_id for b in pages)
    return tuple(b.event_id for b in hash_blocks_vllm(tokens, g.block_size))


def _stored(hashes: tuple[int, ...], g: KVGeometry, group: int) -> BlockStored:
    window = group == 1
    return BlockStored(
        hashes,
        None,
        (),
        g.block_size,
        group_idx=group,
        kv_cache_spec_kind=SPEC_KIND_SLIDING_WINDOW if window else SPEC_KIND_FULL_ATTENTION,
        kv_cache_spec_sliding_window=g.sliding_window if window else None,
    )


def _fill(index: PrefixIndex, worker: str, tokens: list[int], g: KVGeometry, cut: int, w: int):
    """`worker` holds the full-attention KV of its first `cut` tokens, the window KV of its
    first `w` tokens (both cut to whole blocks of `g`)."""
    hs = _hashes(tokens, g)
    events = [_stored(hs[: cut // g.block_size], g, 0), _stored(hs[: w // g.block_size], g, 1)]
    index.apply(worker, KVEventBatch(0.0, tuple(e for e in events if e.block_hashes)))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=0, max_size=600),
    cuts=st.lists(st.integers(0, 600), min_size=4, max_size=4),
    default_is_sglang=st.booleans(),
)
def test_mixed_pool_hits_equal_single_geometry_routers(
    tokens: list[int], cuts: list[int], default_is_sglang: bool
) -> None:
    default, other = (SGLANG16, VLLM64) if default_is_sglang else (VLLM64, SGLANG16)
    hasher = PromptHasher(block_size=default.block_size, scheme=default.hash_scheme)
    key = hasher.key(UpstreamCall("/v1/completions", {}, False, "completions", None, [], tokens))
    assert key.block_hashes == _hashes(tokens, default)
    a = Endpoint("a", "http://a:1")  # reports nothing: the router's default geometry
    b = Endpoint("b", "http://b:1", geometry=other)
    index = PrefixIndex(clock=lambda: 0.0)
    _fill(index, "a", tokens, default, cuts[0], cuts[1])
    _fill(index, "b", tokens, other, cuts[2], cuts[3])
    request = RouteRequest("r", len(tokens), key.block_hashes, hashes_for=key.hashes_for)
    policy = build_policy("sticky-until-saturated")
    mixed = RoutingCore(policy, index, config=CoreConfig(default), clock=lambda: 0.0)
    views = {v.endpoint.id: v for v in mixed.views(request, [a, b])}
    for ep, g in ((a, default), (b, other)):
        alone = RoutingCore(policy, index, config=CoreConfig(g), clock=lambda: 0.0)
        single = RouteRequest("r", len(tokens), _hashes(tokens, g))
        (want,) = alone.views(single, [Endpoint(ep.id, ep.url)])
        assert views[ep.id].hit == want.hit
        assert views[ep.id].geometry == g
    # predictions go in each worker's own hashes
    decision = mixed.decide(request, [b])
    mixed.dispatched(request, decision)
    n = len(tokens) // other.block_size
    assert mixed.views(request, [b])[0].hit.full_blocks == n


def test_one_geometry_pool_hashes_once() -> None:
    calls: list[KVGeometry] = []

    def hashes_for(g: KVGeometry) -> tuple[int, ...]:
        calls.append(g)
        return ()

    core = RoutingCore(build_policy("sticky-until-saturated"))
    eps = [Endpoint(f"w{i}", f"http://w{i}:1") for i in range(8)]
    eps += [Endpoint("x", "http://x:1", geometry=KVGeometry.of())]
    core.views(RouteRequest("r", 64, (1,), hashes_for=hashes_for), eps)
    assert calls == []
    core.views(RouteRequest("r", 64, (1,), hashes_for=hashes_for), [*eps, Endpoint(
        "s", "http://s:1", geometry=SGLANG16)])  # fmt: skip
    assert calls == [SGLANG16]


# --- the router imports no worker internals -----------------------------------------------------


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_the_router_imports_nothing_from_the_workers() -> None:
    # `router/bench/` is excluded: the benchmarks drive simulated workers in-process by design.
    files = [p for p in (REPO / "router").rglob("*.py") if "bench" not in p.relative_to(REPO).parts]
    assert len(files) > 30
    bad = {
        str(p.relative_to(REPO)): m
        for p in files
        for m in _imports(p)
        if m == "beamserve.workers" or m.startswith("beamserve.workers.")
    }
    assert bad == {}


def test_the_index_knows_nothing_of_zmq() -> None:
    assert not any("zmq" in m for m in _imports(REPO / "router/index/prefix_index.py"))
