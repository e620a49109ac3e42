"""The renderers are pure functions of the spec: per engine, role, weight format and backend,
the right flags, JSON configs and environment — and nothing else."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from beamserve.workers.launch import (
    PRODUCTION_FLAGS,
    EngineEnvError,
    LaunchCommand,
    PoolSpec,
    render,
    render_sglang,
    render_sglang_production,
    render_vllm,
)
from hypothesis import given, settings

_path = Path(__file__).resolve().parent / "launch_specs.py"
_spec = importlib.util.spec_from_file_location("launch_specs", _path)
assert _spec is not None and _spec.loader is not None
launch_specs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_specs)
typical = launch_specs.typical

REPO = Path(__file__).resolve().parents[2]
ROLES = ["prefill", "decode", "both"]
FORMATS = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4"}


def spec(engine: str, role: str = "both", **over: Any) -> PoolSpec:
    doc: dict[str, Any] = {"engine": engine, "role": role, "model": {"path": "/m/beam"}}
    doc.update(over)
    return PoolSpec.parse(doc)


def flags(cmd: LaunchCommand) -> list[str]:
    return [a for a in cmd.argv if a.startswith("--")]


def json_flag(cmd: LaunchCommand, name: str) -> Any:
    value = cmd.flag(name)
    return None if value is None else json.loads(value)


# -- SGLang ----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_sglang_disaggregation_flags_per_role(role: str, backend: str) -> None:
    cmd = render_sglang(spec("sglang", role, transfer={"backend": backend, "bootstrap_port": 9100}))
    assert cmd.argv[:3] == ("python3", "-m", "sglang.launch_server")
    assert cmd.flag("--model-path") == "/m/beam"
    if role == "both":
        assert not [f for f in flags(cmd) if f.startswith("--disaggregation")]
        assert "SGLANG_HOST_IP" not in cmd.env
    else:
        assert cmd.flag("--disaggregation-mode") == role
        assert cmd.flag("--disaggregation-transfer-backend") == backend
        assert cmd.env["SGLANG_HOST_IP"] == "$(POD_IP)"
    assert (cmd.flag("--disaggregation-bootstrap-port") == "9100") == (role == "prefill")
    assert cmd.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert (cmd.ready_path, cmd.live_path, cmd.port) == ("/health_generate", "/health", 8000)


@pytest.mark.parametrize(("fmt", "quant"), FORMATS.items())
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_quantization_flag_per_checkpoint_format(engine: str, fmt: str, quant: str | None) -> None:
    cmd = render(spec(engine, model={"path": "/m/beam", "format": fmt}))
    assert cmd.flag("--quantization") == quant
    assert ("--quantization" in cmd.argv) == (quant is not None)


def test_sglang_parallel_cache_and_limits() -> None:
    cmd = render_sglang(
        spec(
            "sglang",
            parallel={"tp_size": 8, "dp_attention": 4, "ep_size": 8},
            kv_cache={"page_size": 32, "dtype": "fp8_e4m3", "host_cache_gb": 96},
            context_length=131072,
            chunked_prefill_size=8192,
        )
    )
    assert cmd.flag("--tp-size") == "8"
    assert cmd.flag("--attn-dp-size") == "4"
    assert "--enable-dp-attention" not in cmd.argv  # deprecated in 0.5.23
    assert cmd.flag("--ep-size") == "8"
    assert (cmd.flag("--page-size"), cmd.flag("--kv-cache-dtype")) == ("32", "fp8_e4m3")
    assert "--enable-hierarchical-cache" in cmd.argv and cmd.flag("--hicache-size") == "96"
    assert (cmd.flag("--context-length"), cmd.flag("--chunked-prefill-size")) == ("131072", "8192")
    plain = render_sglang(spec("sglang"))
    for absent in ("--attn-dp-size", "--ep-size", "--hicache-size", "--context-length"):
        assert absent not in plain.argv
    assert plain.flag("--kv-cache-dtype") == "bf16"


def test_sglang_events_metrics_parsers_speculative() -> None:
    cmd = render_sglang(
        spec(
            "sglang",
            kv_events={"endpoint": "tcp://*:6000", "topic": "t", "replay_endpoint": "tcp://*:6001"},
            speculative={"draft_model_path": "/m/draft", "block_size": 8},
        )
    )
    assert json_flag(cmd, "--kv-events-config") == {
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "topic": "t",
        "replay_endpoint": "tcp://*:6001",
    }
    assert "--enable-metrics" in cmd.argv
    assert (cmd.flag("--reasoning-parser"), cmd.flag("--tool-call-parser")) == ("beam", "beam")
    assert cmd.flag("--speculative-algorithm") == "DFLASH"
    assert cmd.flag("--speculative-draft-model-path") == "/m/draft"
    assert cmd.flag("--speculative-dflash-block-size") == "8"
    off = render_sglang(
        spec("sglang", metrics=False, parsers={"reasoning": None, "tool_call": None})
    )
    for absent in ("--enable-metrics", "--reasoning-parser", "--tool-call-parser"):
        assert absent not in off.argv


@pytest.mark.parametrize(("role", "flag"), [("prefill", True), ("both", True), ("decode", False)])
def test_sglang_prefix_caching_off(role: str, flag: bool) -> None:
    cmd = render_sglang(spec("sglang", role, kv_cache={"prefix_caching": False}))
    assert ("--disable-radix-cache" in cmd.argv) == flag


# -- vLLM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_vllm_nixl_connector_and_side_channel_env(role: str) -> None:
    cmd = render_vllm(spec("vllm", role, transfer={"side_channel_port": 5700}))
    assert cmd.argv[:3] == ("vllm", "serve", "/m/beam")
    assert "--model" not in cmd.argv  # deprecated for `serve`: the model is positional
    if role == "both":
        assert cmd.flag("--kv-transfer-config") is None
        assert dict(cmd.env) == {}
        return
    assert json_flag(cmd, "--kv-transfer-config") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    assert dict(cmd.env) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "$(POD_IP)",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700",
    }
    assert (cmd.ready_path, cmd.live_path) == ("/health", "/health")


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_vllm_mooncake_connector(role: str, kv_role: str) -> None:
    cmd = render_vllm(
        spec("vllm", role, transfer={"backend": "mooncake", "on_load_failure": "fail"})
    )
    assert json_flag(cmd, "--kv-transfer-config") == {
        "kv_connector": "MooncakeConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "fail",
    }
    assert dict(cmd.env) == {"VLLM_HOST_IP": "$(POD_IP)", "VLLM_MOONCAKE_BOOTSTRAP_PORT": "8998"}


def test_vllm_host_cache_is_a_connector_never_kv_offloading_size() -> None:
    pd = render_vllm(
        spec(
            "vllm",
            "prefill",
            parallel={"tp_size": 8, "dp_attention": 2},
            kv_cache={"host_cache_gb": 10},
        )
    )
    cfg = json_flag(pd, "--kv-transfer-config")
    assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"
    nixl, offload = cfg["kv_connector_extra_config"]["connectors"]
    assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    # 10 GB per GPU rank × 4 ranks of one engine (8 GPUs, 2 attention-DP engines)
    assert offload == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 40 * 10**9},
    }
    alone = render_vllm(spec("vllm", "both", kv_cache={"host_cache_gb": 10}))
    assert json_flag(alone, "--kv-transfer-config")["kv_connector"] == "OffloadingConnector"
    for cmd in (pd, alone):
        assert "--kv-offloading-size" not in cmd.argv


def test_vllm_parallel_cache_limits() -> None:
    cmd = render_vllm(
        spec(
            "vllm",
            parallel={"tp_size": 8, "dp_attention": 8, "ep_size": 8},
            kv_cache={"page_size": 16, "dtype": "fp8_e4m3", "prefix_caching": False},
            context_length=65536,
            chunked_prefill_size=4096,
        )
    )
    assert (cmd.flag("--tensor-parallel-size"), cmd.flag("--data-parallel-size")) == ("1", "8")
    assert "--enable-expert-parallel" in cmd.argv
    assert (cmd.flag("--block-size"), cmd.flag("--kv-cache-dtype")) == ("16", "fp8_e4m3")
    assert "--disable-prefix-caching" in cmd.argv and "--enable-prefix-caching" not in cmd.argv
    assert cmd.flag("--max-model-len") == "65536"
    assert "--enable-chunked-prefill" in cmd.argv and cmd.flag("--max-num-batched-tokens") == "4096"
    plain = render_vllm(spec("vllm"))
    assert plain.flag("--tensor-parallel-size") == "1"
    assert plain.flag("--kv-cache-dtype") == "bfloat16"
    assert "--enable-prefix-caching" in plain.argv
    for absent in (
        "--data-parallel-size",
        "--enable-expert-parallel",
        "--max-model-len",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
    ):
        assert absent not in plain.argv


def test_vllm_events_parsers_speculative() -> None:
    cmd = render_vllm(
        spec(
            "vllm",
            kv_events={"endpoint": "tcp://*:6000", "topic": "t"},
            speculative={"draft_model_path": "/m/draft", "block_size": 8},
        )
    )
    assert json_flag(cmd, "--kv-events-config") == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "topic": "t",
    }
    assert (cmd.flag("--reasoning-parser"), cmd.flag("--tool-call-parser")) == ("beam", "beam")
    assert "--enable-auto-tool-choice" in cmd.argv
    # a block of 8 is 1 bonus token + 7 drafted ones
    assert json_flag(cmd, "--speculative-config") == {
        "method": "dflash",
        "model": "/m/draft",
        "num_speculative_tokens": 7,
    }
    off = render_vllm(spec("vllm", parsers={"reasoning": None, "tool_call": None}))
    for absent in ("--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"):
        assert absent not in off.argv


# -- both ------------------------------------------------------------------------------------


def test_pod_ip_env_name_is_configurable() -> None:
    s = spec("vllm", "decode", pod_ip_env="MY_POD_IP")
    assert render_vllm(s).env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(MY_POD_IP)"
    s = spec("sglang", "decode", pod_ip_env="MY_POD_IP")
    assert render_sglang(s).env["SGLANG_HOST_IP"] == "$(MY_POD_IP)"


def test_wrong_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="use render_vllm"):
        render_sglang(spec("vllm"))
    with pytest.raises(ValueError, match="use render_sglang"):
        render_vllm(spec("sglang"))


def test_command_is_immutable() -> None:
    cmd = render(spec("vllm", "decode"))
    with pytest.raises(TypeError):
        cmd.env["X"] = "1"  # type: ignore[index]
    assert isinstance(cmd.argv, tuple)


@settings(max_examples=300, deadline=None)
@given(launch_specs.spec_docs())
def test_render_is_pure_and_well_formed(doc: dict[str, Any]) -> None:
    s = PoolSpec.parse(doc)
    before = s.model_dump()
    cmd = render(s)
    assert render(PoolSpec.parse(doc)) == cmd
    assert s.model_dump() == before
    fl = flags(cmd)
    assert len(fl) == len(set(fl)), f"a flag repeats: {fl}"
    assert all(a != "" for a in cmd.argv)
    for name in ("--kv-events-config", "--kv-transfer-config", "--speculative-config"):
        if cmd.flag(name) is not None:
            assert isinstance(json.loads(cmd.flag(name) or ""), dict)
    for value in cmd.env.values():
        assert "$(" not in value or value == f"$({s.pod_ip_env})"
    refs = {s.pod_ip_env, s.leader_address_env, s.node_rank_env}
    assert cmd.references <= refs
    assert (s.node_rank_env in cmd.references) == s.multinode
    assert cmd.port == s.port
    # the KV-relevant settings always reach the engine explicitly
    page = cmd.flag("--page-size") or cmd.flag("--block-size")
    assert page == str(s.kv_cache.page_size)
    assert cmd.flag("--kv-cache-dtype") is not None


def test_docs_show_the_rendered_typical_pair() -> None:
    """docs/engines.md quotes exactly what the renderers produce for the typical pair."""
    text = (REPO / "docs" / "engines.md").read_text()
    for engine in ("sglang", "vllm"):
        for role in ("prefill", "decode"):
            cmd = render(typical(engine, role))
            assert shell(cmd) in text, (
                f"docs/engines.md is stale for {engine} {role}:\n{shell(cmd)}"
            )


def shell(cmd: LaunchCommand) -> str:
    """The command as docs/engines.md writes it: env assignments, then argv, one flag a line."""
    env = [f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()]
    lines: list[str] = []
    argv = list(cmd.argv)
    head: list[str] = []
    while argv and not argv[0].startswith("--"):
        head.append(argv.pop(0))
    lines.append(" ".join([*env, *map(shlex.quote, head)]))
    while argv:
        item = [argv.pop(0)]
        while argv and not argv[0].startswith("--"):
            item.append(argv.pop(0))
        lines.append("  " + " ".join(map(shlex.quote, item)))
    return " \\\n".join(lines)


# -- what pods need ----------------------------------------------------------------------------

SEED = launch_specs.PRODUCTION_ARGV
SEED_DOC: dict[str, Any] = {
    "engine": "sglang",
    "role": "both",
    "model": {"path": "/models/beam-1.0-nvfp4", "format": "nvfp4"},
    "parallel": {"tp_size": 4},
    "gpu": "gb300",
    "kv_cache": {"page_size": 64, "host_cache_gb": 88},
    "mem_fraction_static": 0.8,
    "unified_memory": True,
    "speculative": {
        "draft_model_path": "/models/beam-1.0-dflash2",
        "block_size": 8,
        "draft_attention_backend": "trtllm_mha",
        "simulate_acceptance_length": 4,
    },
    "max_running_requests": 32,
    "cuda_graph_max_bs": 32,
    "context_length": 1048576,
    "chunked_prefill_size": 16384,
    "prefill_decode_interval": 0,
    "cache_report": True,
    "tokenizer_worker_num": 1,
}


def test_production_command_is_the_seed_command_flag_for_flag() -> None:
    cmd = render_sglang_production(PoolSpec.parse(SEED_DOC))
    assert list(cmd.argv) == ["python3", "-m", "sglang.launch_server", *SEED]
    assert cmd.env["SGLANG_SIMULATE_ACC_LEN"] == "4"
    # the flags keep PRODUCTION_FLAGS' order
    fl = flags(cmd)
    assert fl == [f for f in PRODUCTION_FLAGS if f in fl]


def test_pod_command_is_the_seed_command_plus_what_a_pod_needs() -> None:
    cmd = render_sglang(PoolSpec.parse(SEED_DOC))
    # the seed's flags, in order, minus the defaults SGLang has anyway …
    implicit = {"--ep-size", "--attn-dp-size", "--nnodes", "--node-rank", "--dist-init-addr"}
    seed = [f for f in SEED if f.startswith("--") and f not in implicit]
    seed = [
        "--speculative-dflash-block-size" if f.endswith("num-draft-tokens") else f for f in seed
    ]
    assert [f for f in flags(cmd) if f in seed] == seed
    # … then where to listen and the KV dtype
    assert flags(cmd)[len(seed) :] == ["--host", "--port", "--kv-cache-dtype"]


def test_production_command_keeps_what_its_shape_has_no_flag_for() -> None:
    cmd = render_sglang_production(
        PoolSpec.parse({**SEED_DOC, "role": "prefill", "unified_memory": False})
    )
    assert cmd.flag("--disaggregation-mode") == "prefill"
    assert "--host" not in cmd.argv  # as the seeds ran: SGLang's 127.0.0.1:30000


@pytest.mark.parametrize(
    ("gpu", "sglang_backend", "vllm_backend"),
    [
        ("gb300", "trtllm_mha", "FLASHINFER"),
        ("gb200", "trtllm_mha", "FLASHINFER"),
        ("b300", "trtllm_mha", "FLASHINFER"),
        ("b200", "trtllm_mha", "FLASHINFER"),
        ("h200", "fa3", "FLASH_ATTN"),
        ("h100", "fa3", "FLASH_ATTN"),
    ],
)
def test_attention_backend_per_gpu_generation(
    gpu: str, sglang_backend: str, vllm_backend: str
) -> None:
    assert render(spec("sglang", gpu=gpu)).flag("--attention-backend") == sglang_backend
    assert render(spec("vllm", gpu=gpu)).flag("--attention-backend") == vllm_backend
    # an explicit backend wins over the table; none at all leaves it to the engine
    assert render(spec("sglang", gpu=gpu, attention_backend="triton")).flag(
        "--attention-backend"
    ) == ("triton")
    assert "--attention-backend" not in render(spec("vllm")).argv


def test_vllm_equivalents_of_the_new_knobs() -> None:
    cmd = render_vllm(
        spec(
            "vllm",
            gpu="b200",
            mem_fraction_static=0.85,
            max_running_requests=64,
            cuda_graph_max_bs=32,
            cache_report=True,
            speculative={"draft_model_path": "/d", "draft_attention_backend": "flash_attn"},
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
        )
    )
    assert cmd.flag("--gpu-memory-utilization") == "0.85"
    assert (cmd.flag("--max-num-seqs"), cmd.flag("--max-cudagraph-capture-size")) == ("64", "32")
    assert "--enable-prompt-tokens-details" in cmd.argv
    assert json_flag(cmd, "--speculative-config")["attention_backend"] == "FLASH_ATTN"
    assert cmd.env["VLLM_LOGGING_LEVEL"] == "WARNING"
    plain = render_vllm(spec("vllm"))
    for absent in ("--gpu-memory-utilization", "--max-num-seqs", "--enable-prompt-tokens-details"):
        assert absent not in plain.argv


@pytest.mark.parametrize("node", ["leader", "worker"])
def test_multinode_ranks_are_kubelet_references(node: str) -> None:
    par = {"tp_size": 16, "nodes": 2}
    sg = render_sglang(spec("sglang", "decode", parallel=par), node=node)  # type: ignore[arg-type]
    assert (sg.flag("--nnodes"), sg.flag("--node-rank")) == ("2", "$(LWS_WORKER_INDEX)")
    assert sg.flag("--dist-init-addr") == "$(LWS_LEADER_ADDRESS):39746"
    assert sg.serves_http is (node == "leader")
    vl = render_vllm(spec("vllm", "decode", parallel=par), node=node)  # type: ignore[arg-type]
    assert (vl.flag("--nnodes"), vl.flag("--node-rank")) == ("2", "$(LWS_WORKER_INDEX)")
    assert (vl.flag("--master-addr"), vl.flag("--master-port")) == (
        "$(LWS_LEADER_ADDRESS)",
        "39746",
    )
    assert ("--headless" in vl.argv) is (node == "worker")
    assert vl.serves_http is (node == "leader")
    environ = {"LWS_LEADER_ADDRESS": "10.1.2.3", "LWS_WORKER_INDEX": "1"}
    assert "10.1.2.3:39746" in sg.resolve_argv(environ)
    assert vl.references == {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "POD_IP"}
    with pytest.raises(EngineEnvError, match=r"--node-rank: refers to \$\(LWS_WORKER_INDEX\)"):
        vl.resolve_argv({"LWS_LEADER_ADDRESS": "10.1.2.3"})
    single = render(spec("vllm", "decode"))
    assert "--nnodes" not in single.argv and single.resolve_argv({}) == single.argv


def test_custom_rank_variables_and_port() -> None:
    s = spec(
        "sglang",
        parallel={"tp_size": 8, "nodes": 2},
        leader_address_env="LEADER",
        node_rank_env="RANK",
        dist_init_port=29500,
    )
    cmd = render(s)
    assert (cmd.flag("--node-rank"), cmd.flag("--dist-init-addr")) == ("$(RANK)", "$(LEADER):29500")


def test_sglang_dflash_with_dp_attention_borrows_the_lm_head() -> None:
    sp = {"draft_model_path": "/d"}
    dpa = render_sglang(spec("sglang", parallel={"tp_size": 8, "dp_attention": 8}, speculative=sp))
    assert "--enable-dp-lm-head" in dpa.argv
    assert "--enable-dp-lm-head" not in render_sglang(spec("sglang", speculative=sp)).argv
