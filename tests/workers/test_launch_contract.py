"""Contract: the rendered command lines parse with the engines' REAL parsers, and pass the
engines' own cross-field checks.

SGLang 0.5.23's `ServerArgs` parser runs in `.venv-sglang`, vLLM 0.33.0's `vllm serve` parser
(+ its `validate()`) in `.venv-vllm` (`make install` builds both; their pins conflict with
ours). Each parser is built once per session by a checker process
(workers/launch/contract/check_*.py) that answers one JSON line per command; besides parsing,
it checks exact option strings, registries (KV connectors, speculative methods, parsers,
quantization methods, KV-event publishers) and the environment variables, then runs the
engine's resolution pass: SGLang's `run_resolution_pipeline` hooks that need no checkpoint,
vLLM's `create_engine_config` against a Beam 1.0-shaped config without weights. The negative
cases prove each check can fail; the mirrored rules prove the pure validation (`PoolSpec`)
refuses exactly what the engine itself refuses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from beamserve.workers.launch import (
    LaunchCommand,
    PoolSpec,
    PoolSpecError,
    render,
    render_sglang,
    render_sglang_production,
    render_vllm,
)
from hypothesis import HealthCheck, given, settings

_path = Path(__file__).resolve().parent / "launch_specs.py"
_spec = importlib.util.spec_from_file_location("launch_specs", _path)
assert _spec is not None and _spec.loader is not None
launch_specs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_specs)
typical = launch_specs.typical

REPO = Path(__file__).resolve().parents[2]
CONTRACT = REPO / "workers" / "launch" / "contract"
POD_IP = "192.0.2.7"  # TEST-NET-1: never contacted, only read back
LEADER = "192.0.2.1"
ENVIRON = {
    "POD_IP": POD_IP,
    "MY_POD_IP": POD_IP,
    "LWS_LEADER_ADDRESS": LEADER,
    "LWS_WORKER_INDEX": "1",
}
PRODUCTION = launch_specs.PRODUCTION_ARGV
# Hooks of SGLang's resolution pipeline that must run here (the rules mirrored in PoolSpec).
SGLANG_HOOKS = {
    "handle_pd_disaggregation",
    "handle_hicache_ratio_default",
    "handle_hicache",
    "handle_cache_compatibility",
    "handle_unified_memory_pool",
    "validate_prefill_decode_interval",
    "handle_kv_cache_sharding",
    "handle_platform_defaults",
    "handle_other_validations",
}


class Checker:
    """One long-lived checker process inside an engine's parser venv."""

    def __init__(
        self, venv: str, script: str, tmp: Path, env: dict[str, str] | None = None
    ) -> None:
        python = REPO / venv / "bin" / "python"
        if not python.exists():
            pytest.fail(
                f"{venv}/ is missing: run `make install` (it builds the engine parser venvs)"
            )
        self.log = tmp / f"{script}.stderr"
        self.proc = subprocess.Popen(
            [str(python), str(CONTRACT / script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("wb"),
            env={
                **os.environ,
                "VLLM_TARGET_DEVICE": "cpu",
                "PYTHONHASHSEED": "0",
                **(env or {}),
            },
            cwd=tmp,
            text=True,
        )
        hello = self._read(timeout_s=120)
        assert hello.get("ready"), hello
        self.version = str(hello["version"])

    def check(
        self, argv: list[str] | tuple[str, ...], env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        assert self.proc.stdin is not None
        req = {"argv": list(argv), "env": env or {}, "environ": ENVIRON}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s=60)

    def command(self, cmd: LaunchCommand) -> dict[str, Any]:
        return self.check(cmd.argv, dict(cmd.env))

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                pytest.fail(f"checker silent for {timeout_s} s; log: {self.tail()}")
            line = self.proc.stdout.readline()
            if not line:
                pytest.fail(f"checker exited {self.proc.wait()}; log: {self.tail()}")
            if line.strip():
                return dict(json.loads(line))

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checker]:
    checker = Checker(".venv-sglang", "check_sglang.py", tmp_path_factory.mktemp("sglang"))
    yield checker
    checker.close()


def beam_shaped_config(directory: Path) -> Path:
    """Beam 1.0's architecture in `config.json`, a real tokenizer, no weights: what vLLM's
    config resolution reads (heads vs TP, experts vs EP, layer types, 1M positions)."""
    from beamserve.kv_transfer.model import beam_1_0, beam_layer_types
    from beamserve.workers.ref.checkpoint import make_tiny

    make_tiny(directory)
    (directory / "model.safetensors").unlink()
    beam = beam_1_0()
    cfg = json.loads((directory / "config.json").read_text())
    n = beam.num_hidden_layers
    cfg.update(
        num_hidden_layers=n,
        layer_types=list(beam_layer_types(n)),
        mlp_layer_types=["dense"] * 3 + ["sparse"] * (n - 3),
        num_attention_heads=beam.num_attention_heads,
        num_key_value_heads=beam.num_key_value_heads,
        head_dim=beam.head_dim,
        hidden_size=beam.num_attention_heads * beam.head_dim,
        sliding_window=beam.sliding_window,
        num_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        max_position_embeddings=1048576,
    )
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checker]:
    model = beam_shaped_config(tmp_path_factory.mktemp("beam-shape"))
    checker = Checker(
        ".venv-vllm",
        "check_vllm.py",
        tmp_path_factory.mktemp("vllm"),
        env={"BEAM_CONFIG_DIR": str(model)},
    )
    yield checker
    checker.close()


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["ok"], answer["problems"]
    return answer


def rejected(answer: dict[str, Any], *needles: str) -> str:
    assert not answer["ok"], "the real parser accepted a command it must reject"
    text = "\n".join(answer["problems"])
    for needle in needles:
        assert needle in text, text
    return text


def with_flag(cmd: LaunchCommand, flag: str, value: str | None) -> list[str]:
    """argv with `flag`'s value replaced (or the flag appended)."""
    argv = list(cmd.argv)
    if flag in argv and value is not None:
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag] + ([value] if value is not None else [])


# -- SGLang 0.5.23 ---------------------------------------------------------------------------


def test_sglang_version_is_the_pinned_one(sglang: Checker) -> None:
    assert sglang.version == "0.5.23"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_typical_pair_parses_to_the_intended_values(sglang: Checker, role: str) -> None:
    s = typical("sglang", role)
    got = ok(sglang.command(render_sglang(s)))
    p = got["parsed"]
    assert (p["model_path"], p["served_model_name"]) == (s.model.path, "beam")
    assert (p["tp_size"], p["ep_size"], p["attn_dp_size"]) == (4, 4, 1)
    assert (p["quantization"], p["page_size"], p["kv_cache_dtype"]) == (
        "modelopt_fp4",
        64,
        "fp8_e4m3",
    )
    assert (p["context_length"], p["chunked_prefill_size"]) == (262144, 16384)
    assert p["disaggregation_mode"] == role
    assert p["disaggregation_transfer_backend"] == "nixl"
    assert p["disaggregation_bootstrap_port"] == 8998
    assert json.loads(p["kv_events_config"])["replay_endpoint"] == "tcp://*:5558"
    assert p["enable_metrics"] is True
    assert (p["reasoning_parser"], p["tool_call_parser"]) == ("beam", "beam")
    assert (p["speculative_algorithm"], p["speculative_dflash_block_size"]) == ("DFLASH", 8)
    assert p["speculative_draft_model_path"] == launch_specs.DRAFT
    assert p["enable_hierarchical_cache"] is (role == "prefill")
    assert got["env"] == {
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": False,
        "SGLANG_HOST_IP": POD_IP,
    }


def test_sglang_dp_attention_uses_the_current_flag(sglang: Checker) -> None:
    s = PoolSpec.parse(
        {
            "engine": "sglang",
            "role": "decode",
            "model": {"path": "/m"},
            "parallel": {"tp_size": 8, "dp_attention": 8, "ep_size": 8},
            "transfer": {"backend": "mooncake", "ib_device": "mlx5_0,mlx5_1"},
            "kv_cache": {"prefix_caching": False},
        }
    )
    p = ok(sglang.command(render_sglang(s)))["parsed"]
    assert (p["tp_size"], p["attn_dp_size"], p["dp_size"], p["enable_dp_attention"]) == (
        8,
        8,
        1,
        False,
    )
    assert (p["disaggregation_transfer_backend"], p["disaggregation_ib_device"]) == (
        "mooncake",
        "mlx5_0,mlx5_1",
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(doc=launch_specs.spec_docs(engine="sglang"))
def test_sglang_every_generated_spec_parses(sglang: Checker, doc: dict[str, Any]) -> None:
    s = PoolSpec.parse(doc)
    got = ok(sglang.command(render_sglang(s)))
    p = got["parsed"]
    assert (p["tp_size"], p["page_size"], p["port"]) == (
        s.parallel.tp_size,
        s.kv_cache.page_size,
        s.port,
    )
    assert p["disaggregation_mode"] == (s.role if s.disaggregated else "null")
    assert set(got["resolution"]["ran"]) >= SGLANG_HOOKS, got["resolution"]
    assert p["attention_backend"] == s.resolved_attention_backend
    if s.multinode:
        assert (p["nnodes"], p["node_rank"]) == (s.parallel.nodes, 1)
        assert p["dist_init_addr"] == f"{LEADER}:{s.dist_init_port}"


def test_sglang_rejects_what_it_must(sglang: Checker) -> None:
    cmd = render_sglang(typical("sglang", "prefill"))
    # unknown flag, and a prefix the parser would silently accept
    rejected(sglang.check([*cmd.argv, "--tp-sizee", "2"]), "unrecognized arguments: --tp-sizee")
    rejected(
        sglang.check(with_flag(cmd, "--enable-metric", None)), "flag --enable-metric: not an exact"
    )
    # a value outside the parser's choices
    rejected(sglang.check(with_flag(cmd, "--quantization", "nvfp4")), "invalid choice: 'nvfp4'")
    rejected(
        sglang.check(with_flag(cmd, "--disaggregation-mode", "both")), "invalid choice: 'both'"
    )
    rejected(sglang.check(with_flag(cmd, "--reasoning-parser", "beam2")), "invalid choice: 'beam2'")
    # broken or foreign KV-events JSON (SGLang's model would ignore unknown keys)
    rejected(
        sglang.check(with_flag(cmd, "--kv-events-config", "{publisher: zmq}")), "kv_events_config"
    )
    foreign = json.dumps({"publisher": "zmq", "enable_kv_cache_events": True})
    rejected(sglang.check(with_flag(cmd, "--kv-events-config", foreign)), "enable_kv_cache_events")
    rejected(
        sglang.check(with_flag(cmd, "--kv-events-config", json.dumps({"publisher": "kafka"}))),
        "publisher: 'kafka' not registered",
    )
    # an algorithm SGLang does not know (DFlash2 is DFLASH with a DFlash2 draft)
    rejected(sglang.check(with_flag(cmd, "--speculative-algorithm", "DFLASH2")), "DFLASH2")
    # deprecated spelling, and environment variables SGLang never reads
    rejected(
        sglang.check([*cmd.argv, "--dp-size", "2", "--enable-dp-attention"]),
        "flag --enable-dp-attention: deprecated",
    )
    rejected(sglang.check(cmd.argv, {"SGLANG_HOSTIP": "x"}), "env SGLANG_HOSTIP: not a variable")
    rejected(
        sglang.check(["python3", "-m", "sglang.launch", *cmd.argv[3:]]), "sglang.launch_server"
    )


# -- vLLM 0.33.0 -----------------------------------------------------------------------------


def test_vllm_version_is_the_pinned_one(vllm: Checker) -> None:
    assert vllm.version == "0.33.0"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_typical_pair_parses_to_the_intended_values(vllm: Checker, role: str) -> None:
    s = typical("vllm", role)
    got = ok(vllm.command(render_vllm(s)))
    p = got["parsed"]
    assert (p["model_tag"], p["served_model_name"]) == (s.model.path, ["beam"])
    assert (p["tensor_parallel_size"], p["data_parallel_size"], p["enable_expert_parallel"]) == (
        4,
        1,
        True,
    )
    assert (p["quantization"], p["block_size"], p["kv_cache_dtype"]) == (
        "modelopt_fp4",
        64,
        "fp8_e4m3",
    )
    assert (p["max_model_len"], p["max_num_batched_tokens"]) == (262144, 16384)
    assert p["enable_chunked_prefill"] is True and p["enable_prefix_caching"] is True
    ktc = p["kv_transfer_config"]
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    if role == "prefill":
        assert ktc["kv_connector"] == "MultiConnector"
        kinds = [c["kv_connector"] for c in ktc["kv_connector_extra_config"]["connectors"]]
        assert kinds == ["NixlConnector", "OffloadingConnector"]
    else:
        assert ktc["kv_connector"] == "NixlConnector"
    assert p["kv_offloading_size"] is None
    ev = p["kv_events_config"]
    assert (ev["enable_kv_cache_events"], ev["publisher"], ev["topic"]) == (
        True,
        "zmq",
        "kv-events",
    )
    assert (ev["endpoint"], ev["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert (p["reasoning_parser"], p["tool_call_parser"], p["enable_auto_tool_choice"]) == (
        "beam",
        "beam",
        True,
    )
    assert p["speculative_config"] == {
        "method": "dflash",
        "model": launch_specs.DRAFT,
        "num_speculative_tokens": 7,
    }
    assert got["env"] == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": POD_IP,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": 5600,
    }


def test_vllm_mooncake_and_dp_attention(vllm: Checker) -> None:
    s = PoolSpec.parse(
        {
            "engine": "vllm",
            "role": "prefill",
            "model": {"path": "/m", "format": "fp8"},
            "parallel": {"tp_size": 8, "dp_attention": 8, "ep_size": 8},
            "transfer": {"backend": "mooncake", "bootstrap_port": 9100},
        }
    )
    got = ok(vllm.command(render_vllm(s)))
    p = got["parsed"]
    assert (p["tensor_parallel_size"], p["data_parallel_size"], p["quantization"]) == (1, 8, "fp8")
    assert p["kv_transfer_config"]["kv_connector"] == "MooncakeConnector"
    assert p["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert got["env"] == {"VLLM_HOST_IP": POD_IP, "VLLM_MOONCAKE_BOOTSTRAP_PORT": 9100}


def test_vllm_kv_both_pool_sends_and_receives_over_nixl(vllm: Checker) -> None:
    """A `both` pool whose parts the router chooses (`kv_both`): vLLM's parser takes a
    NixlConnector with `kv_role: kv_both`, and the side channel is on the pod IP."""
    s = typical("vllm", "both", kv_both=True)
    got = ok(vllm.command(render_vllm(s)))
    ktc = got["parsed"]["kv_transfer_config"]
    assert (ktc["kv_connector"], ktc["kv_role"]) == ("NixlConnector", "kv_both")
    assert ktc["kv_load_failure_policy"] == "recompute"
    assert got["env"] == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": POD_IP,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": 5600,
    }
    # without kv_both a `both` pool has no connector at all
    plain = ok(vllm.command(render_vllm(typical("vllm", "both"))))
    assert plain["parsed"]["kv_transfer_config"] is None and plain["env"] == {}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(doc=launch_specs.spec_docs(engine="vllm"))
def test_vllm_every_generated_spec_parses(vllm: Checker, doc: dict[str, Any]) -> None:
    s = PoolSpec.parse(doc)
    got = ok(vllm.command(render_vllm(s, node="worker" if s.multinode else "leader")))
    p, r = got["parsed"], got["resolved"]
    # vLLM's world size is one DP rank's (TP × PP); the pool's GPUs are that × DP
    assert r["ran"] and r["world_size"] * r["data_parallel_size"] == s.parallel.tp_size
    assert (r["nnodes"], r["node_rank"]) == ((s.parallel.nodes, 1) if s.multinode else (1, 0))
    assert r["block_size"] == s.kv_cache.page_size
    if s.max_running_requests is not None:
        assert r["max_num_seqs"] == s.max_running_requests
    assert p["headless"] is s.multinode
    assert (p["tensor_parallel_size"], p["block_size"], p["port"]) == (
        s.parallel.attention_tp,
        s.kv_cache.page_size,
        s.port,
    )
    assert (p["kv_transfer_config"] is not None) == (
        s.disaggregated or s.kv_cache.host_cache_gb > 0
    )


def test_vllm_rejects_what_it_must(vllm: Checker) -> None:
    cmd = render_vllm(typical("vllm", "decode"))
    rejected(vllm.check([*cmd.argv, "--block-sizee", "64"]), "parser: exit 2")
    # accepted by the parser as an unambiguous prefix; refused by the exact-string check
    rejected(
        vllm.check(with_flag(cmd, "--enable-prefix-cachin", None)), "flag --enable-prefix-cachin"
    )
    bad_json = '{"kv_connector":"NixlConnector",'
    rejected(vllm.check(with_flag(cmd, "--kv-transfer-config", bad_json)), "parser: exit 2")
    bad_role = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_decoder"})
    rejected(vllm.check(with_flag(cmd, "--kv-transfer-config", bad_role)), "parser: exit 2")
    unknown_connector = json.dumps({"kv_connector": "NixlConnectr", "kv_role": "kv_both"})
    rejected(
        vllm.check(with_flag(cmd, "--kv-transfer-config", unknown_connector)),
        "'NixlConnectr' is not registered",
    )
    multi = json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [{"kv_connector": "Nope", "kv_role": "kv_both"}]
            },
        }
    )
    rejected(
        vllm.check(with_flag(cmd, "--kv-transfer-config", multi)), "connectors[0].kv_connector"
    )
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topics": "x"})
    rejected(vllm.check(with_flag(cmd, "--kv-events-config", events)), "parser: exit 2")
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "kafka"})
    rejected(vllm.check(with_flag(cmd, "--kv-events-config", events)), "parser: exit 2")
    spec_cfg = json.dumps({"method": "dflash2", "model": "/d", "num_speculative_tokens": 7})
    rejected(
        vllm.check(with_flag(cmd, "--speculative-config", spec_cfg)),
        "'dflash2' not in SpeculativeMethod",
    )
    spec_cfg = json.dumps({"method": "dflash", "model": "/d", "block_size": 8})
    rejected(
        vllm.check(with_flag(cmd, "--speculative-config", spec_cfg)), "unknown keys ['block_size']"
    )
    rejected(vllm.check(with_flag(cmd, "--quantization", "nvfp4")), "quantization: 'nvfp4'")
    rejected(
        vllm.check(with_flag(cmd, "--kv-cache-dtype", "fp8_e4m4")), "kv_cache_dtype: 'fp8_e4m4'"
    )
    rejected(vllm.check(with_flag(cmd, "--tool-call-parser", "beam2")), "tool_call_parser: 'beam2'")
    rejected(vllm.check(with_flag(cmd, "--reasoning-parser", "beam2")), "reasoning_parser: 'beam2'")
    rejected(vllm.check([*cmd.argv, "--kv-offloading-size", "10"]), "kv_offloading_size: replaces")
    rejected(vllm.check(cmd.argv, {"VLLM_NIXL_HOST": "x"}), "env VLLM_NIXL_HOST: not a variable")
    rejected(vllm.check(["vllm", "server", *cmd.argv[2:]]), "expected `vllm serve MODEL")


# -- what pods need: the production shape, multi-node ranks, backends, the engines' own rules --


def production_spec(**over: Any) -> PoolSpec:
    """The seeds' production pool: SGLang, 4×GB300, NVFP4, TP4, DFlash2 block 8."""
    doc: dict[str, Any] = {
        "engine": "sglang",
        "role": "both",
        "model": {"path": launch_specs.MODEL, "format": "nvfp4"},
        "parallel": {"tp_size": 4},
        "gpu": "gb300",
        "kv_cache": {"page_size": 64, "host_cache_gb": 88},
        "mem_fraction_static": 0.8,
        "unified_memory": True,
        "speculative": {
            "draft_model_path": launch_specs.DRAFT,
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
    doc.update(over)
    return PoolSpec.parse(doc)


def test_sglang_production_command_passes_parser_and_resolution(sglang: Checker) -> None:
    cmd = render_sglang_production(production_spec())
    assert list(cmd.argv[3:]) == PRODUCTION
    got = ok(sglang.command(cmd))
    p = got["parsed"]
    assert (p["tp_size"], p["ep_size"], p["attn_dp_size"]) == (4, 1, 1)
    assert (p["nnodes"], p["node_rank"], p["dist_init_addr"]) == (1, 0, "127.0.0.1:39746")
    assert (p["attention_backend"], p["speculative_draft_attention_backend"]) == (
        "trtllm_mha",
        "trtllm_mha",
    )
    assert (p["mem_fraction_static"], p["enable_unified_memory"]) == (0.8, True)
    assert (p["speculative_algorithm"], p["speculative_num_draft_tokens"]) == ("DFLASH", 8)
    assert (p["enable_hierarchical_cache"], p["hicache_size"]) == (True, 88)
    assert (p["max_running_requests"], p["cuda_graph_max_bs_decode"]) == (32, 32)
    assert (p["context_length"], p["chunked_prefill_size"]) == (1048576, 16384)
    assert (p["prefill_decode_interval"], p["enable_cache_report"]) == (0, True)
    assert (p["enable_metrics"], p["tokenizer_worker_num"]) == (True, 1)
    assert got["env"]["SGLANG_SIMULATE_ACC_LEN"] == 4.0
    assert set(got["resolution"]["ran"]) >= SGLANG_HOOKS
    # the pod's command: the same flags, plus where to listen and the KV dtype
    assert ok(sglang.command(render_sglang(production_spec())))["parsed"]["port"] == 8000


@pytest.mark.parametrize("node", ["leader", "worker"])
def test_multinode_ranks_come_from_the_leaderworkerset_environment(
    sglang: Checker, vllm: Checker, node: str
) -> None:
    over = {"parallel": {"tp_size": 16, "ep_size": 16, "nodes": 2}, "dist_init_port": 29500}
    s = typical("sglang", "decode", **over)
    p = ok(sglang.command(render_sglang(s, node=node)))["parsed"]  # type: ignore[arg-type]
    assert (p["tp_size"], p["nnodes"], p["node_rank"]) == (16, 2, 1)
    assert p["dist_init_addr"] == f"{LEADER}:29500"
    s = typical("vllm", "decode", **over)
    got = ok(vllm.command(render_vllm(s, node=node)))  # type: ignore[arg-type]
    p, r = got["parsed"], got["resolved"]
    assert (p["nnodes"], p["node_rank"], p["master_addr"], p["master_port"]) == (
        2,
        1,
        LEADER,
        29500,
    )
    assert p["headless"] is (node == "worker")
    assert (r["world_size"], r["nnodes"], r["node_rank"], r["master_addr"]) == (16, 2, 1, LEADER)


@pytest.mark.parametrize("gpu", ["gb300", "gb200", "b300", "b200", "h200", "h100"])
def test_attention_backend_table_names_are_the_engines_own(
    sglang: Checker, vllm: Checker, gpu: str
) -> None:
    s = typical("sglang", "prefill", gpu=gpu)
    draft = {"draft_model_path": launch_specs.DRAFT, "draft_attention_backend": None}
    backend = s.resolved_attention_backend
    draft["draft_attention_backend"] = backend
    s = typical("sglang", "prefill", gpu=gpu, speculative=draft)
    p = ok(sglang.command(render_sglang(s)))["parsed"]
    assert p["attention_backend"] == p["speculative_draft_attention_backend"] == backend
    v = typical("vllm", "decode", gpu=gpu)
    got = ok(vllm.command(render_vllm(v)))
    assert got["resolved"]["attention_backend"] == v.resolved_attention_backend


@pytest.mark.parametrize("backend", ["trtllm_mha", "fa3", "fa4", "flashinfer", "triton"])
def test_sglang_named_backends_parse(sglang: Checker, backend: str) -> None:
    draft = {"draft_model_path": launch_specs.DRAFT, "draft_attention_backend": backend}
    s = typical("sglang", "decode", attention_backend=backend, speculative=draft)
    assert ok(sglang.command(render_sglang(s)))["parsed"]["attention_backend"] == backend


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_vllm_named_backends_resolve(vllm: Checker, backend: str) -> None:
    s = typical("vllm", "decode", attention_backend=backend)
    assert ok(vllm.command(render_vllm(s)))["resolved"]["attention_backend"] == backend


def test_vllm_limits_reach_the_resolved_config(vllm: Checker) -> None:
    s = typical(
        "vllm",
        "decode",
        mem_fraction_static=0.85,
        max_running_requests=128,
        cuda_graph_max_bs=64,
        cache_report=True,
        gpu="h200",
    )
    got = ok(vllm.command(render_vllm(s)))
    p, r = got["parsed"], got["resolved"]
    assert p["enable_prompt_tokens_details"] is True
    assert (r["gpu_memory_utilization"], r["max_num_seqs"]) == (0.85, 128)
    assert (r["max_cudagraph_capture_size"], r["max_num_batched_tokens"]) == (64, 16384)
    assert (r["max_model_len"], r["attention_backend"]) == (262144, "FLASH_ATTN")


def problems_of(doc: dict[str, Any]) -> str:
    with pytest.raises(PoolSpecError) as info:
        PoolSpec.parse(doc)
    return "\n".join(info.value.problems)


def typical_doc(engine: str, role: str, **over: Any) -> dict[str, Any]:
    doc = typical(engine, role).model_dump(exclude_none=True)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


# Each engine rule the pure validation mirrors: the spec it refuses (and the fix it names),
# and the nearest valid spec's command with the refused setting forced in, which the engine
# itself must refuse for the same reason.
MIRRORED = [
    pytest.param(
        "sglang",
        typical_doc("sglang", "decode", kv_cache={"host_cache_gb": 8}),
        "kv_cache.host_cache_gb: SGLang's decode pool runs without a radix cache",
        typical_doc("sglang", "decode"),
        ["--enable-hierarchical-cache", "--hicache-size", "8"],
        "handle_cache_compatibility: ValueError: The arguments enable-hierarchical-cache and "
        "disable-radix-cache are mutually exclusive",
        id="sglang-decode-host-cache",
    ),
    pytest.param(
        "sglang",
        typical_doc("sglang", "prefill", kv_cache={"prefix_caching": False}),
        "set kv_cache.prefix_caching to true or host_cache_gb to 0",
        typical_doc("sglang", "prefill"),
        ["--disable-radix-cache"],
        "enable-hierarchical-cache and disable-radix-cache are mutually exclusive",
        id="sglang-host-cache-without-radix",
    ),
    pytest.param(
        "sglang",
        typical_doc("sglang", "decode", unified_memory=True),
        "unified_memory: SGLang moves a unified pool between P/D pools only over mooncake",
        typical_doc("sglang", "decode"),
        ["--enable-unified-memory"],
        "handle_unified_memory_pool: AssertionError: --enable-unified-memory with PD "
        "disaggregation supports only these transfer backends: mooncake; got 'nixl'",
        id="sglang-unified-memory-over-nixl",
    ),
    pytest.param(
        "sglang",
        typical_doc("sglang", "decode", unified_memory=True, transfer={"backend": "mooncake"}),
        "does not support speculative decoding; remove speculative or unified_memory",
        typical_doc("sglang", "decode", transfer={"backend": "mooncake"}),
        ["--enable-unified-memory"],
        "does not support speculative decoding with the Mooncake transfer backend",
        id="sglang-unified-memory-mooncake-speculative",
    ),
    pytest.param(
        "vllm",
        typical_doc("vllm", "decode", parallel={"nodes": 3}),
        "parallel.nodes: 3 nodes cannot split tp_size 4 evenly; choose nodes from [1, 2, 4]",
        typical_doc("vllm", "decode", parallel={"nodes": 2}),
        ["--nnodes", "3"],
        "`--nnodes 3` must evenly divide the total world size (4)",
        id="vllm-nodes-not-dividing-tp",
    ),
    pytest.param(
        "vllm",
        typical_doc("vllm", "decode", max_running_requests=512, chunked_prefill_size=256),
        "chunked_prefill_size: vLLM needs at least max_running_requests (512) tokens",
        typical_doc("vllm", "decode", max_running_requests=512, chunked_prefill_size=512),
        ["--max-num-batched-tokens", "256"],
        "max_num_seqs",
        id="vllm-batch-tokens-below-max-seqs",
    ),
]


@pytest.mark.parametrize(("engine", "bad", "ours", "near", "force", "theirs"), MIRRORED)
def test_mirrored_rules_are_the_engines_own(
    sglang: Checker,
    vllm: Checker,
    engine: str,
    bad: dict[str, Any],
    ours: str,
    near: dict[str, Any],
    force: list[str],
    theirs: str,
) -> None:
    assert ours in problems_of(bad)
    checker = sglang if engine == "sglang" else vllm
    cmd = render(PoolSpec.parse(near))
    ok(checker.command(cmd))  # the nearest valid spec passes the engine's checks …
    argv = forced(list(cmd.argv), force)
    rejected(checker.check(argv, dict(cmd.env)), theirs)  # … and the forced one does not


def forced(argv: list[str], force: list[str]) -> list[str]:
    """`argv` with `force` applied: a `--flag value` replaces the flag's value, else appends."""
    out = list(argv)
    i = 0
    while i < len(force):
        flag = force[i]
        value = force[i + 1] if i + 1 < len(force) and not force[i + 1].startswith("--") else None
        if value is not None and flag in out:
            out[out.index(flag) + 1] = value
        elif flag not in out:
            out += [flag] + ([value] if value is not None else [])
        i += 2 if value is not None else 1
    return out


def test_sglang_resolution_reports_what_it_could_not_run(sglang: Checker) -> None:
    got = ok(sglang.command(render_sglang(typical("sglang", "prefill"))))
    skipped = got["resolution"]["skipped"]
    # needs the checkpoint's config or the draft's: reported, never passed silently
    assert "handle_speculative_decoding" in skipped
    assert "handle_attention_backend_compatibility" in skipped
    assert not set(skipped) & set(got["resolution"]["ran"])


def test_engines_refuse_what_the_resolution_pass_must(sglang: Checker, vllm: Checker) -> None:
    cmd = render_sglang(typical("sglang", "prefill"))
    rejected(sglang.check(with_flag(cmd, "--prefill-decode-interval", "-1")), "non-negative")
    rejected(
        sglang.check(with_flag(cmd, "--speculative-draft-attention-backend", "flashmla")),
        "not in DRAFT_ATTENTION_BACKEND_CHOICES",
    )
    rejected(sglang.check([*cmd.argv, "--node-rank", "$(NOPE)"]), "$(NOPE)")
    v = render_vllm(typical("vllm", "decode"))
    rejected(vllm.check(with_flag(v, "--gpu-memory-utilization", "1.5")), "resolution:")
    rejected(vllm.check(with_flag(v, "--attention-backend", "FLASH_ATTN2")), "FLASH_ATTN2")
    rejected(vllm.check([*v.argv, "--nnodes", "2", "--node-rank", "2"]), "`--node-rank` must")
    rejected(vllm.check(with_flag(v, "--max-model-len", "2000000")), "resolution:")
