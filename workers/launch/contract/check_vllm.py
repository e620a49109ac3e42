"""Check rendered vLLM command lines against vLLM's real `serve` parser (run in .venv-vllm).

A line-oriented server: builds vLLM 0.33.0's `vllm serve` parser once (≈6–10 s), then reads
one JSON request per stdin line, `{"argv": [...], "env": {...}}`, and answers one JSON line
on stdout:

    {"ok": bool, "problems": [str, ...], "parsed": {dest: value, ...}, "env": {...}}

`ok` is true only if the real parser accepts the argv (as `vllm serve …`), the subcommand's
own `validate(args)` passes, and the checks the parser does not make hold:

* every flag is an exact option string (argparse accepts unambiguous prefixes) and not
  deprecated;
* `--kv-transfer-config` connectors (MultiConnector children too) are registered in
  `KVConnectorFactory._registry` and support the hybrid KV-cache manager (Beam has sliding
  layers), and children are valid `KVTransferConfig`s;
* `--speculative-config` names a method of `SpeculativeMethod` and only `SpeculativeConfig`
  fields; `--quantization` is in `QUANTIZATION_METHODS`; `--kv-cache-dtype` in `CacheDType`;
  the reasoning and tool-call parsers are registered;
* every environment variable is one vLLM reads (`vllm.envs`), and reads back as rendered
  (with `$(NAME)` expanded from the request's `environ`);
* the resolution pass: `EngineArgs.from_cli_args(args).create_engine_config(headless=…)`, the
  config resolution `vllm serve` runs before it starts an engine — every `*Config`
  validator (`ParallelConfig`, `CacheConfig`, `SchedulerConfig`, `KVTransferConfig`,
  `CompilationConfig`, `VllmConfig.__post_init__`…), the multi-node rank checks, and the
  model-dependent ones (heads vs TP, `max_model_len` vs the model) — against a Beam 1.0-shaped
  config without weights (`BEAM_CONFIG_DIR`: Beam's `config.json` and a tokenizer) on vLLM's CPU
  platform. It leaves out what needs the real checkpoint or a GPU: `--quantization` (the
  checkpoint's `quantization_config` and GPU kernels), `--speculative-config` (the draft
  checkpoint) and the `beam` parsers (the tokenizer's `response_template`); those are checked
  by the registries above.

`$(NAME)` references in argv (multi-node ranks) are expanded from `environ` first, as kubelet
does in a pod.

Run with VLLM_TARGET_DEVICE=cpu (without it the parser fails "Failed to infer device type").
Diagnostics go to stderr; stdout carries only answers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import sys
import typing
from typing import Any

_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # whatever vLLM prints goes to stderr

from vllm import envs  # noqa: E402
from vllm.config.cache import CacheDType  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS  # noqa: E402
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
PARSED = (
    "model_tag",
    "served_model_name",
    "host",
    "port",
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "quantization",
    "block_size",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "max_model_len",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "kv_transfer_config",
    "kv_events_config",
    "reasoning_parser",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "speculative_config",
    "kv_offloading_size",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "headless",
    "attention_backend",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_cudagraph_capture_size",
    "enable_prompt_tokens_details",
)
# Left to the engine's defaults in the resolution pass (see the module docstring).
NEUTRALIZED = {
    "quantization": None,
    "speculative_config": None,
    "reasoning_parser": None,
    "tool_call_parser": None,
    "enable_auto_tool_choice": False,
}


def _flat_literal(t: Any) -> set[str]:
    out: set[str] = set()
    for a in typing.get_args(t):
        if typing.get_origin(a) is typing.Literal:
            out |= _flat_literal(a)
        else:
            out.add(a)
    return out


class Checker:
    def __init__(self) -> None:
        self.parser = FlexibleArgumentParser(prog="vllm")
        sub = self.parser.add_subparsers(required=False, dest="subparser")
        self.cmd = ServeSubcommand()
        self.serve = self.cmd.subparser_init(sub)
        self.serve.set_defaults(dispatch_function=self.cmd.cmd)
        self.options = self.serve._option_string_actions
        self.spec_methods = _flat_literal(SpeculativeMethod)
        self.spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        self.cache_dtypes = _flat_literal(CacheDType)
        self.reasoning = set(ReasoningParserManager.list_registered())
        self.tools = set(ToolParserManager.list_registered())
        self.attention_backends = {m.name for m in AttentionBackendEnum}
        self.model_dir = os.environ.get("BEAM_CONFIG_DIR")
        if self.model_dir is not None:  # warm up: the first resolution imports ≈ 30 s of vLLM
            self._resolve(self.parser.parse_args(["serve", self.model_dir]), {})

    def check(self, req: dict[str, Any]) -> dict[str, Any]:
        environ: dict[str, str] = req.get("environ", {})
        problems: list[str] = []
        try:
            argv = [_REF.sub(lambda m: environ[m.group(1)], a) for a in req["argv"]]
        except KeyError as exc:
            problems.append(f"argv: refers to $({exc.args[0]}), which environ lacks")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        if argv[1:2] != ["serve"]:
            problems.append(f"argv: expected `vllm serve MODEL …`, got {argv[:3]}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        problems += self._check_option_strings(argv[2:])
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = self.parser.parse_args(argv[1:])
                self.cmd.validate(args)
        except SystemExit as exc:
            problems.append(f"parser: exit {exc.code}: {err.getvalue().strip()[-800:]}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        except Exception as exc:
            problems.append(f"validate: {type(exc).__name__}: {exc}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        problems += self._check_values(args)
        env, env_problems = self._check_env(req.get("env", {}), environ)
        problems += env_problems
        parsed = {k: _plain(getattr(args, k, None)) for k in PARSED}
        resolved: dict[str, Any] = {}
        if not problems:
            resolved, resolve_problems = self._resolve(args, req.get("env", {}), environ)
            problems += resolve_problems
        return {
            "ok": not problems,
            "problems": problems,
            "parsed": parsed,
            "env": env,
            "resolved": resolved,
        }

    def _resolve(
        self,
        args: argparse.Namespace,
        env: dict[str, str],
        environ: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], list[str]]:
        """The resolution pass (module docstring); `resolved` holds what it settled on."""
        if self.model_dir is None:
            return {"ran": False}, ["resolution: BEAM_CONFIG_DIR is not set; cannot run it"]
        ns = copy.copy(args)
        ns.model_tag = None
        ns.model = self.model_dir
        for key, value in NEUTRALIZED.items():
            setattr(ns, key, value)
        saved = dict(os.environ)
        try:
            for key, value in env.items():
                os.environ[key] = _REF.sub(lambda m: (environ or {})[m.group(1)], value)
            with contextlib.redirect_stdout(sys.stderr):
                cfg = EngineArgs.from_cli_args(ns).create_engine_config(
                    headless=bool(getattr(ns, "headless", False))
                )
        except Exception as exc:
            text = " ".join(str(exc).split())
            return {"ran": True}, [f"resolution: {type(exc).__name__}: {text[:900]}"]
        finally:
            os.environ.clear()
            os.environ.update(saved)
        par, cache, sched = cfg.parallel_config, cfg.cache_config, cfg.scheduler_config
        backend = cfg.attention_config.backend
        return {
            "ran": True,
            "neutralized": sorted(NEUTRALIZED),
            "world_size": par.world_size,
            "tensor_parallel_size": par.tensor_parallel_size,
            "data_parallel_size": par.data_parallel_size,
            "data_parallel_size_local": par.data_parallel_size_local,
            "nnodes": par.nnodes,
            "node_rank": par.node_rank,
            "master_addr": par.master_addr,
            "master_port": par.master_port,
            "block_size": cache.block_size,
            "cache_dtype": str(cache.cache_dtype),
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "max_model_len": cfg.model_config.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_cudagraph_capture_size": cfg.compilation_config.max_cudagraph_capture_size,
            "attention_backend": None if backend is None else backend.name,
            "kv_connector": None
            if cfg.kv_transfer_config is None
            else cfg.kv_transfer_config.kv_connector,
        }, []

    def _check_option_strings(self, tokens: list[str]) -> list[str]:
        out = []
        for tok in tokens:
            if not tok.startswith("-") or _is_number(tok):
                continue
            name = tok.split("=", 1)[0]
            action = self.options.get(name)
            if action is None:
                out.append(f"flag {name}: not an exact vLLM option string")
            elif "deprecated" in (action.help or "").lower():
                out.append(f"flag {name}: deprecated in vLLM {_version()}")
        return out

    def _check_values(self, args: argparse.Namespace) -> list[str]:
        out: list[str] = []
        backend = getattr(args, "attention_backend", None)
        if backend is not None and str(backend).upper() not in self.attention_backends:
            out.append(f"attention_backend: {backend!r} not in AttentionBackendEnum")
        ktc = args.kv_transfer_config
        if ktc is not None:
            if ktc.kv_connector == "MultiConnector":
                children = ktc.kv_connector_extra_config.get("connectors", [])
                if not children:
                    out.append("kv_transfer_config: MultiConnector without connectors")
                for i, child in enumerate(children):
                    try:
                        cfg = KVTransferConfig(**child)
                    except Exception as exc:
                        out.append(f"kv_transfer_config.connectors[{i}]: {exc}")
                        continue
                    out += self._check_connector(cfg, f"kv_transfer_config.connectors[{i}]")
            if not out:  # MultiConnector's own check needs valid children
                out += self._check_connector(ktc, "kv_transfer_config")
        sc = args.speculative_config
        if sc is not None:
            method = sc.get("method")
            if method not in self.spec_methods:
                out.append(f"speculative_config.method: {method!r} not in SpeculativeMethod")
            unknown = sorted(set(sc) - self.spec_fields)
            if unknown:
                out.append(f"speculative_config: unknown keys {unknown}")
            draft_backend = sc.get("attention_backend")
            if draft_backend is not None and draft_backend not in self.attention_backends:
                out.append(
                    f"speculative_config.attention_backend: {draft_backend!r} not in "
                    "AttentionBackendEnum"
                )
            n = sc.get("num_speculative_tokens")
            if not isinstance(n, int) or n < 1:
                out.append(f"speculative_config.num_speculative_tokens: {n!r} is not ≥ 1")
        if args.quantization is not None and args.quantization not in QUANTIZATION_METHODS:
            out.append(f"quantization: {args.quantization!r} not in QUANTIZATION_METHODS")
        if args.kv_cache_dtype not in self.cache_dtypes:
            out.append(f"kv_cache_dtype: {args.kv_cache_dtype!r} not in CacheDType")
        if args.reasoning_parser and args.reasoning_parser not in self.reasoning:
            out.append(f"reasoning_parser: {args.reasoning_parser!r} not registered")
        if args.tool_call_parser and args.tool_call_parser not in self.tools:
            out.append(f"tool_call_parser: {args.tool_call_parser!r} not registered")
        if args.kv_offloading_size is not None and ktc is not None:
            out.append(
                "kv_offloading_size: replaces the --kv-transfer-config connector "
                "(VllmConfig._post_init_kv_transfer_config); use an OffloadingConnector"
            )
        return out

    def _check_connector(self, cfg: KVTransferConfig, where: str) -> list[str]:
        name = cfg.kv_connector
        if name not in KVConnectorFactory._registry:
            return [f"{where}.kv_connector: {name!r} is not registered"]
        try:
            with contextlib.redirect_stdout(sys.stderr):
                hma = KVConnectorFactory.supports_hma_config(cfg)
        except Exception as exc:
            return [f"{where}.kv_connector: {name!r}: {type(exc).__name__}: {exc}"]
        if not hma:
            return [f"{where}.kv_connector: {name!r} does not support hybrid KV caches"]
        return []

    def _check_env(
        self, env: dict[str, str], environ: dict[str, str]
    ) -> tuple[dict[str, Any], list[str]]:
        out: list[str] = []
        read: dict[str, Any] = {}
        saved = dict(os.environ)
        try:
            for key, value in env.items():
                if key not in envs.environment_variables:
                    out.append(f"env {key}: not a variable vLLM {_version()} reads")
                    continue
                os.environ[key] = _REF.sub(lambda m: environ[m.group(1)], value)
            for key in env:
                if key in envs.environment_variables:
                    read[key] = getattr(envs, key)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return read, out


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def main() -> None:
    checker = Checker()
    _OUT.write(json.dumps({"ready": True, "version": _version()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = checker.check(json.loads(line))
        except Exception as exc:  # a checker bug must not look like a pass
            answer = {"ok": False, "problems": [f"checker: {type(exc).__name__}: {exc}"]}
        _OUT.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
