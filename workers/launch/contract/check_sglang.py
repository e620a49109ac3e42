"""Check rendered SGLang command lines against SGLang's real `ServerArgs` parser (in .venv-sglang).

A line-oriented server: builds sglang 0.5.23's parser once, then reads one JSON request per
stdin line, `{"argv": [...], "env": {...}, "environ": {...}}`, and answers one JSON line:

    {"ok": bool, "problems": [str, ...], "parsed": {field: value, ...}, "env": {...}}

`ok` is true only if `argv` is `PYTHON -m sglang.launch_server …`, the module exists, and
`prepare_server_args(argv[3:])` — what `sglang.launch_server` itself calls — parses the flags
into a `ServerArgs`; plus the checks the parser does not make:

* every flag is an exact option string (argparse accepts unambiguous prefixes) and not a
  deprecated one;
* `--kv-events-config` is valid JSON for `KVEventsConfig` with only its keys (the model
  ignores unknown keys) and a registered publisher;
* `--speculative-algorithm` resolves with `SpeculativeAlgorithm.from_string`;
* every environment variable is one SGLang reads, and reads back as rendered.

The resolution pass (`ServerArgs.resolve_once`) is not run: it loads the model config and
probes the GPU. Diagnostics go to stderr; stdout carries only answers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import sys
from typing import Any

_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # whatever SGLang prints goes to stderr

import sglang  # noqa: E402
from sglang.srt.disaggregation.kv_events import (  # noqa: E402
    EventPublisherFactory,
    KVEventsConfig,
)
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.utils.network import get_local_ip_auto  # noqa: E402

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
PARSED = (
    "model_path",
    "served_model_name",
    "host",
    "port",
    "tp_size",
    "attn_dp_size",
    "dp_size",
    "enable_dp_attention",
    "ep_size",
    "quantization",
    "page_size",
    "kv_cache_dtype",
    "context_length",
    "chunked_prefill_size",
    "disable_radix_cache",
    "enable_hierarchical_cache",
    "hicache_size",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port",
    "disaggregation_ib_device",
    "kv_events_config",
    "enable_metrics",
    "reasoning_parser",
    "tool_call_parser",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_dflash_block_size",
)
# variables read through os.getenv rather than sglang.srt.environ.envs
_GETENV = {"SGLANG_HOST_IP": lambda: get_local_ip_auto()}


class Checker:
    def __init__(self) -> None:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.options = parser._option_string_actions

    def check(self, req: dict[str, Any]) -> dict[str, Any]:
        argv: list[str] = req["argv"]
        problems: list[str] = []
        if argv[1:3] != ["-m", "sglang.launch_server"]:
            problems.append(f"argv: expected `python -m sglang.launch_server …`, got {argv[:3]}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        if importlib.util.find_spec("sglang.launch_server") is None:
            problems.append("argv: module sglang.launch_server does not exist")
        flags = argv[3:]
        problems += self._check_option_strings(flags)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                server_args = prepare_server_args(flags)
        except SystemExit as exc:
            problems.append(f"parser: exit {exc.code}: {err.getvalue().strip()[-800:]}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        except Exception as exc:
            problems.append(f"ServerArgs: {type(exc).__name__}: {exc}")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
        problems += self._check_values(server_args)
        env, env_problems = self._check_env(req.get("env", {}), req.get("environ", {}))
        problems += env_problems
        parsed = {k: _plain(getattr(server_args, k, None)) for k in PARSED}
        return {"ok": not problems, "problems": problems, "parsed": parsed, "env": env}

    def _check_option_strings(self, tokens: list[str]) -> list[str]:
        out = []
        for tok in tokens:
            if not tok.startswith("-") or _is_number(tok):
                continue
            name = tok.split("=", 1)[0]
            action = self.options.get(name)
            if action is None:
                out.append(f"flag {name}: not an exact SGLang option string")
            elif (
                type(action).__name__.startswith("Deprecated")
                or "deprecated" in (action.help or "").lower().split(".")[0]
            ):
                out.append(f"flag {name}: deprecated in sglang {sglang.__version__}")
        return out

    def _check_values(self, sa: Any) -> list[str]:
        out: list[str] = []
        if sa.kv_events_config is not None:
            try:
                raw = json.loads(sa.kv_events_config)
                cfg = KVEventsConfig.from_cli(sa.kv_events_config)
            except Exception as exc:
                out.append(f"kv_events_config: {type(exc).__name__}: {exc}")
            else:
                unknown = sorted(set(raw) - set(KVEventsConfig.model_fields))
                if unknown:
                    out.append(f"kv_events_config: keys {unknown} are not KVEventsConfig fields")
                if cfg.publisher not in EventPublisherFactory._registry:
                    out.append(f"kv_events_config.publisher: {cfg.publisher!r} not registered")
        if sa.speculative_algorithm is not None:
            try:
                SpeculativeAlgorithm.from_string(sa.speculative_algorithm)
            except ValueError as exc:
                out.append(f"speculative_algorithm: {exc}")
        return out

    def _check_env(
        self, env: dict[str, str], environ: dict[str, str]
    ) -> tuple[dict[str, Any], list[str]]:
        out: list[str] = []
        read: dict[str, Any] = {}
        saved = dict(os.environ)
        try:
            for key, value in env.items():
                os.environ[key] = _REF.sub(lambda m: environ[m.group(1)], value)
            for key in env:
                if key in _GETENV:
                    read[key] = _GETENV[key]()
                elif hasattr(envs, key):
                    read[key] = getattr(envs, key).get()
                else:
                    out.append(f"env {key}: not a variable sglang {sglang.__version__} reads")
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
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def main() -> None:
    checker = Checker()
    _OUT.write(json.dumps({"ready": True, "version": sglang.__version__}) + "\n")
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
