"""`PoolSpec` validation: strict keys and types, engine rules, and messages that name the
field and the fix."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from beamserve.workers.launch import PoolSpec, PoolSpecError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

_spec = importlib.util.spec_from_file_location(
    "launch_specs", Path(__file__).resolve().parent / "launch_specs.py"
)
assert _spec is not None and _spec.loader is not None
launch_specs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_specs)

MINIMAL: dict[str, Any] = {"engine": "sglang", "role": "both", "model": {"path": "/m"}}


def problems(doc: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(PoolSpecError) as info:
        PoolSpec.parse(doc)
    return info.value.problems


def with_(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


def test_minimal_spec_takes_the_documented_defaults() -> None:
    s = PoolSpec.parse(MINIMAL)
    assert (s.parallel.tp_size, s.parallel.ep_size, s.parallel.dp_attention) == (1, 1, 1)
    assert (s.kv_cache.page_size, s.kv_cache.dtype, s.kv_cache.host_cache_gb) == (64, "bf16", 0)
    assert (s.transfer.backend, s.transfer.bootstrap_port, s.transfer.side_channel_port) == (
        "nixl",
        8998,
        5600,
    )
    assert (s.parsers.reasoning, s.parsers.tool_call) == ("beam", "beam")
    assert s.kv_events is None and s.speculative is None
    assert (s.host, s.port, s.pod_ip_env, s.metrics) == ("0.0.0.0", 8000, "POD_IP", True)


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("replicas", "replicas: unknown key; valid keys here are ['attention_backend'"),
        ("model.revision", "model.revision: unknown key; valid keys here are ['fingerprint'"),
        ("parallel.pp_size", "parallel.pp_size: unknown key; valid keys here are ['dp_attention'"),
        ("kv_events.hwm", "kv_events.hwm: unknown key; valid keys here are ['endpoint'"),
        ("speculative.num_steps", "speculative.num_steps: unknown key; valid keys here are"),
    ],
)
def test_unknown_keys_are_errors_that_list_the_valid_keys(path: str, where: str) -> None:
    doc = with_(MINIMAL, path, 1)
    if path.startswith("speculative"):
        doc["speculative"]["draft_model_path"] = "/d"
    assert any(line.startswith(where) for line in problems(doc)), problems(doc)


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("engine", "tgi", "engine: Input should be 'sglang' or 'vllm'"),
        ("role", "decoder", "role: Input should be 'prefill', 'decode' or 'both'"),
        ("model.format", "int4", "model.format: Input should be 'bf16', 'fp8' or 'nvfp4'"),
        ("parallel.tp_size", "4", "parallel.tp_size: Input should be a valid integer"),
        ("parallel.tp_size", 0, "parallel.tp_size: Input should be greater than or equal to 1"),
        ("port", True, "port: Input should be a valid integer"),
        ("port", 70000, "port: Input should be less than or equal to 65535"),
        ("kv_cache.page_size", 128, "kv_cache.page_size: Input should be 16, 32 or 64"),
        ("kv_cache.dtype", "fp8", "kv_cache.dtype: Input should be 'bf16' or 'fp8_e4m3'"),
        ("transfer.backend", "ucx", "transfer.backend: Input should be 'nixl' or 'mooncake'"),
        ("parsers.reasoning", "qwen3", "parsers.reasoning: Input should be 'beam'"),
        ("model.fingerprint", "XYZ", "model.fingerprint: expected 12–64 lowercase hex digits"),
        ("kv_events.endpoint", "localhost:5557", "kv_events.endpoint: 'localhost:5557' is not"),
        ("pod_ip_env", "pod-ip", "pod_ip_env: 'pod-ip' is not an environment variable name"),
    ],
)
def test_bad_values_name_the_field(path: str, value: Any, expect: str) -> None:
    lines = problems(with_(MINIMAL, path, value))
    assert any(line.startswith(expect) for line in lines), lines


def test_missing_required_fields_say_add_it() -> None:
    lines = problems({"engine": "vllm"})
    assert "role: required; add it" in lines
    assert "model: required; add it" in lines
    spec_lines = problems({**MINIMAL, "speculative": {"block_size": 8}})
    assert "speculative.draft_model_path: required; add it" in spec_lines


@pytest.mark.parametrize(
    ("engine", "parallel", "expect"),
    [
        ("sglang", {"tp_size": 8, "dp_attention": 3}, "choose one of [1, 2, 4, 8]"),
        ("sglang", {"tp_size": 8, "ep_size": 3}, "parallel.ep_size: 3 does not divide tp_size 8"),
        ("vllm", {"tp_size": 8, "ep_size": 4}, "set ep_size to 1 or 8"),
    ],
)
def test_parallel_rules_per_engine(engine: str, parallel: dict[str, int], expect: str) -> None:
    lines = problems({**MINIMAL, "engine": engine, "parallel": parallel})
    assert any(expect in line for line in lines), lines


def test_sglang_allows_ep_smaller_than_tp_vllm_does_not() -> None:
    doc = {**MINIMAL, "parallel": {"tp_size": 8, "ep_size": 4}}
    assert PoolSpec.parse(doc).parallel.ep_size == 4
    with pytest.raises(PoolSpecError):
        PoolSpec.parse({**doc, "engine": "vllm"})


def test_cross_field_rules() -> None:
    lines = problems({**MINIMAL, "chunked_prefill_size": 1000, "context_length": 32})
    assert (
        "chunked_prefill_size: 1000 is not a multiple of kv_cache.page_size 64; round it to 1024"
        in lines
    )
    assert any(line.startswith("context_length: 32 is shorter than one page") for line in lines)
    port_clash = {**MINIMAL, "role": "prefill", "port": 8998}
    assert problems(port_clash) == (
        "transfer.bootstrap_port: port 8998 is already taken by port; pick another",
    )
    events_clash = {**MINIMAL, "kv_events": {"endpoint": "tcp://*:8000"}}
    assert problems(events_clash) == (
        "kv_events.endpoint: port 8000 is already taken by port; pick another",
    )
    ib = {**MINIMAL, "engine": "vllm", "role": "decode", "transfer": {"ib_device": "mlx5_0"}}
    assert any("set UCX_NET_DEVICES" in line for line in problems(ib))


def test_ports_of_unused_transfer_channels_may_overlap() -> None:
    # a `both` pool opens no bootstrap server or side channel
    assert PoolSpec.parse({**MINIMAL, "port": 8998}).port == 8998


def test_every_problem_is_reported_at_once() -> None:
    doc = {
        "engine": "vllm",
        "role": "prefill",
        "model": {"path": "/m", "colour": "blue"},
        "parallel": {"tp_size": "2"},
        "extra": 1,
    }
    lines = problems(doc)
    assert len(lines) == 3
    assert {line.split(":")[0] for line in lines} == {"model.colour", "parallel.tp_size", "extra"}


def test_spec_is_frozen_and_round_trips() -> None:
    s = PoolSpec.parse({**MINIMAL, "speculative": {"draft_model_path": "/d"}})
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]
    assert PoolSpec.parse(s.model_dump()) == s
    assert PoolSpec.model_validate_json(s.model_dump_json()) == s


@settings(max_examples=150, deadline=None)
@given(launch_specs.spec_docs())
def test_generated_valid_specs_parse_and_round_trip(doc: dict[str, Any]) -> None:
    s = PoolSpec.parse(doc)
    assert PoolSpec.parse(s.model_dump()) == s
    assert s.parallel.attention_tp * s.parallel.dp_attention == s.parallel.tp_size
    assert s.topology().tp_size == s.parallel.attention_tp


@settings(max_examples=150, deadline=None)
@given(
    doc=launch_specs.spec_docs(),
    where=st.sampled_from(["", "model", "parallel", "kv_cache", "transfer", "parsers"]),
    key=st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True),
)
def test_any_unknown_key_anywhere_is_named(doc: dict[str, Any], where: str, key: str) -> None:
    node = doc[where] if where else doc
    if key in node or (not where and key in PoolSpec.model_fields):
        return
    node[key] = 0
    prefix = f"{where}.{key}" if where else key
    assert any(line.startswith(f"{prefix}: unknown key") for line in problems(doc))


@settings(max_examples=200, deadline=None)
@given(
    engine=st.sampled_from(["sglang", "vllm"]),
    tp=st.integers(1, 64),
    ep=st.integers(1, 64),
    dpa=st.integers(1, 64),
)
def test_parallel_validity_is_exactly_the_engine_rule(
    engine: str, tp: int, ep: int, dpa: int
) -> None:
    doc = {
        **MINIMAL,
        "engine": engine,
        "parallel": {"tp_size": tp, "ep_size": ep, "dp_attention": dpa},
    }
    ok_ep = tp % ep == 0 if engine == "sglang" else ep in (1, tp)
    should = tp % dpa == 0 and ok_ep
    try:
        PoolSpec.parse(doc)
        valid = True
    except PoolSpecError as exc:
        valid = False
        assert all(line.startswith("parallel.") for line in exc.problems), exc.problems
        assert all("choose" in line or "set ep_size" in line for line in exc.problems)
    assert valid == should


# -- what pods need: new fields and the engine rules they mirror --------------------------------


def test_new_fields_default_to_the_engines_choices() -> None:
    s = PoolSpec.parse(MINIMAL)
    assert (s.parallel.nodes, s.dist_init_port) == (1, 39746)
    assert (s.leader_address_env, s.node_rank_env) == ("LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX")
    assert s.gpu is None and s.attention_backend is None and s.resolved_attention_backend is None
    assert (s.mem_fraction_static, s.unified_memory, s.cache_report) == (None, False, False)
    assert (s.max_running_requests, s.cuda_graph_max_bs, s.prefill_decode_interval) == (
        None,
        None,
        None,
    )
    assert s.tokenizer_worker_num is None and s.env == {} and not s.multinode


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        (
            {"role": "decode", "kv_cache": {"host_cache_gb": 8}},
            "kv_cache.host_cache_gb: SGLang's decode pool runs without a radix cache, so it "
            "cannot keep a hierarchical host cache; set it to 0 on the decode pool",
        ),
        (
            {"kv_cache": {"host_cache_gb": 8, "prefix_caching": False}},
            "kv_cache.host_cache_gb: SGLang's hierarchical cache extends the radix (prefix) "
            "cache; set kv_cache.prefix_caching to true or host_cache_gb to 0",
        ),
        (
            {"role": "prefill", "unified_memory": True},
            "unified_memory: SGLang moves a unified pool between P/D pools only over mooncake, "
            "not nixl; set transfer.backend to mooncake or unified_memory to false",
        ),
        (
            {
                "role": "prefill",
                "unified_memory": True,
                "transfer": {"backend": "mooncake"},
                "speculative": {"draft_model_path": "/d"},
            },
            "unified_memory: SGLang's unified pool with P/D over mooncake does not support "
            "speculative decoding; remove speculative or unified_memory",
        ),
        (
            {"parallel": {"tp_size": 4, "nodes": 3}},
            "parallel.nodes: 3 nodes cannot split tp_size 4 evenly; choose nodes from [1, 2, 4]",
        ),
        ({"attention_backend": "flashmla"}, "attention_backend: 'flashmla' is not a sglang"),
        (
            {
                "speculative": {
                    "draft_model_path": "/d",
                    "draft_attention_backend": "flex_attention",
                }
            },
            "speculative.draft_attention_backend: 'flex_attention' cannot run a sglang DFlash",
        ),
        ({"node_rank_env": "rank-1"}, "node_rank_env: 'rank-1' is not an environment variable"),
        (
            {"parallel": {"tp_size": 8, "nodes": 2}, "dist_init_port": 8000},
            "dist_init_port: port 8000 is already taken by port; pick another",
        ),
        ({"env": {"SGLANG_HOST_IP": "x"}}, "env.SGLANG_HOST_IP: the launcher sets it itself"),
        ({"env": {"POD_IP": "x"}}, "env.POD_IP: names the pod's own address/rank variable"),
        ({"env": {"bad-name": "x"}}, "env.bad-name: not an environment variable name"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static: Input should be less than or equal"),
        ({"prefill_decode_interval": -1}, "prefill_decode_interval: Input should be greater"),
        ({"gpu": "a100"}, "gpu: Input should be 'gb300', 'gb200', 'b300', 'b200', 'h200' or"),
    ],
)
def test_sglang_rules_name_the_field_and_the_fix(over: dict[str, Any], expect: str) -> None:
    lines = problems({**MINIMAL, **over})
    assert any(line.startswith(expect) for line in lines), lines


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        ({"unified_memory": True}, "unified_memory: vLLM 0.33 has no unified KV memory pool"),
        ({"prefill_decode_interval": 0}, "prefill_decode_interval: vLLM 0.33 has no"),
        ({"tokenizer_worker_num": 2}, "tokenizer_worker_num: vLLM 0.33 tokenizes in its API"),
        (
            {"speculative": {"draft_model_path": "/d", "simulate_acceptance_length": 4}},
            "speculative.simulate_acceptance_length: only SGLang can simulate",
        ),
        (
            {"max_running_requests": 512, "chunked_prefill_size": 256},
            "chunked_prefill_size: vLLM needs at least max_running_requests (512) tokens per "
            "step; raise it to 512 or lower max_running_requests",
        ),
        ({"attention_backend": "trtllm_mha"}, "attention_backend: 'trtllm_mha' is not a vllm"),
    ],
)
def test_vllm_gaps_and_rules_name_the_field_and_the_fix(over: dict[str, Any], expect: str) -> None:
    lines = problems({**MINIMAL, "engine": "vllm", **over})
    assert any(line.startswith(expect) for line in lines), lines


def test_host_cache_stays_legal_where_the_engines_allow_it() -> None:
    for role in ("prefill", "both"):
        PoolSpec.parse({**MINIMAL, "role": role, "kv_cache": {"host_cache_gb": 8}})
    # vLLM's host cache is an OffloadingConnector, which its decode pools may run
    PoolSpec.parse(
        {**MINIMAL, "engine": "vllm", "role": "decode", "kv_cache": {"host_cache_gb": 8}}
    )
    # unified memory: aggregated anywhere, P/D over mooncake without speculation
    PoolSpec.parse({**MINIMAL, "unified_memory": True, "speculative": {"draft_model_path": "/d"}})
    PoolSpec.parse(
        {**MINIMAL, "role": "decode", "unified_memory": True, "transfer": {"backend": "mooncake"}}
    )


def test_vllm_backend_names_are_case_insensitive_and_gpu_picks_one() -> None:
    s = PoolSpec.parse({**MINIMAL, "engine": "vllm", "attention_backend": "flash_attn"})
    assert s.resolved_attention_backend == "flash_attn"
    s = PoolSpec.parse({**MINIMAL, "engine": "vllm", "gpu": "h100"})
    assert s.resolved_attention_backend == "FLASH_ATTN"


@settings(max_examples=200, deadline=None)
@given(
    engine=st.sampled_from(["sglang", "vllm"]),
    tp=st.sampled_from([1, 2, 4, 8, 16, 32]),
    nodes=st.integers(1, 16),
)
def test_nodes_validity_is_exactly_the_rule(engine: str, tp: int, nodes: int) -> None:
    doc = {**MINIMAL, "engine": engine, "parallel": {"tp_size": tp, "nodes": nodes}}
    try:
        s = PoolSpec.parse(doc)
        assert s.parallel.gpus_per_node * nodes == tp
        valid = True
    except PoolSpecError as exc:
        valid = False
        assert all(line.startswith("parallel.nodes: ") for line in exc.problems), exc.problems
    assert valid == (tp % nodes == 0)


def test_spec_stays_hashable_with_extra_env() -> None:
    a = PoolSpec.parse({**MINIMAL, "env": {"SGLANG_LOG_MS": "1"}})
    b = PoolSpec.parse({**MINIMAL, "env": {"SGLANG_LOG_MS": "1"}})
    assert a == b and len({a, b}) == 1
    assert hash(a) != hash(PoolSpec.parse(MINIMAL))


def test_kv_both_is_a_vllm_nixl_both_pool_only() -> None:
    vllm_both = {**MINIMAL, "engine": "vllm", "role": "both", "kv_both": True}
    spec = PoolSpec.parse(vllm_both)
    assert spec.kv_both and spec.hands_off_kv and not spec.disaggregated
    assert any(
        line.startswith("kv_both: SGLang fixes each server's part")
        for line in problems({**vllm_both, "engine": "sglang"})
    )
    assert any(
        line.startswith("kv_both: vLLM's mooncake connector is a producer or a consumer")
        for line in problems({**vllm_both, "transfer": {"backend": "mooncake"}})
    )
    assert any(
        line.startswith("kv_both: a decode pool already hands KV over")
        for line in problems({**vllm_both, "role": "decode"})
    )
    # it opens the NIXL side channel: the port must not clash
    assert problems({**vllm_both, "port": 5600}) == (
        "transfer.side_channel_port: port 5600 is already taken by port; pick another",
    )
