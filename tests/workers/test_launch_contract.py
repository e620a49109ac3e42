"""Contract: the rendered command lines parse with the engines' REAL parsers.

SGLang 0.5.23's `ServerArgs` parser runs in `.venv-sglang`, vLLM 0.33.0's `vllm serve` parser
(+ its `validate()`) in `.venv-vllm` (`make install` builds both; their pins conflict with
ours). Each parser is built once per session by a checker process
(workers/launch/contract/check_*.py) that answers one JSON line per command; besides parsing,
it checks exact option strings, registries (KV connectors, speculative methods, parsers,
quantization methods, KV-event publishers) and the environment variables. The negative cases
prove each check can fail.
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
from beamserve.workers.launch import LaunchCommand, PoolSpec, render_sglang, render_vllm
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


class Checker:
    """One long-lived checker process inside an engine's parser venv."""

    def __init__(self, venv: str, script: str, tmp: Path) -> None:
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
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONHASHSEED": "0"},
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
        req = {
            "argv": list(argv),
            "env": env or {},
            "environ": {"POD_IP": POD_IP, "MY_POD_IP": POD_IP},
        }
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


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checker]:
    checker = Checker(".venv-vllm", "check_vllm.py", tmp_path_factory.mktemp("vllm"))
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


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(doc=launch_specs.spec_docs(engine="vllm"))
def test_vllm_every_generated_spec_parses(vllm: Checker, doc: dict[str, Any]) -> None:
    s = PoolSpec.parse(doc)
    p = ok(vllm.command(render_vllm(s)))["parsed"]
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
