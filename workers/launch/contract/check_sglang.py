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
* `--speculative-algorithm` resolves with `SpeculativeAlgorithm.from_string`, and
  `--speculative-draft-attention-backend` is in `DRAFT_ATTENTION_BACKEND_CHOICES` (the flag
  has no parser choices; DFLASH replaces any other name with a fallback);
* every environment variable is one SGLang reads, and reads back as rendered.

Then the resolution pass: the cross-field checks `ServerArgs.resolve_once` runs through
`sglang.srt.arg_groups.pipeline.run_resolution_pipeline`, hook by hook, in the pipeline's own
order (read from its source), on a `ServerArgs` prepared as `resolve_once` prepares it. The
full pass cannot run here: the pipeline module, and the hooks that need the checkpoint's config
(`model_config_of`, `transformers`) or GPU kernels, import packages this parser-only venv lacks
(transformers, safetensors, huggingface_hub, tvm_ffi, sentencepiece). Those imports are
stubbed (below the part under test): any *use* of a stub, any call of `model_config_of`, and
the RDMA-device probe `validate_ib_devices` (it reads this machine's /sys) raise
`NeedsCheckpoint`, and that hook is reported as skipped, never as passed. Every other
hook runs for real (`handle_pd_disaggregation`, `handle_hicache`,
`handle_cache_compatibility`, `handle_unified_memory_pool`, `validate_prefill_decode_interval`,
…); an exception from one is a refusal. The answer's `resolution` lists what ran and what was
skipped, with why. `$(NAME)` references in argv (multi-node ranks) are expanded from
`environ` first, as kubelet does in a pod.

Diagnostics go to stderr; stdout carries only answers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import pkgutil
import re
import sys
import types
from typing import Any

_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # whatever SGLang prints goes to stderr

import sglang  # noqa: E402
from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES  # noqa: E402
from sglang.srt.disaggregation.kv_events import (  # noqa: E402
    EventPublisherFactory,
    KVEventsConfig,
)
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.utils.network import get_local_ip_auto  # noqa: E402

# -- stubs for the resolution pass (module docstring) -----------------------------------------


class NeedsCheckpoint(Exception):
    """A hook reached for the checkpoint's config, a package this venv lacks, or the
    machine's hardware (RDMA devices)."""


class _Stub:
    def __init__(self, name: str) -> None:
        self._name = name

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise NeedsCheckpoint(f"uses {self._name}")

    __call__ = __iter__ = __len__ = __bool__ = __getitem__ = __contains__ = _refuse

    def __getattr__(self, name: str) -> _Stub:
        return _Stub(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(stub.Base)` at import time; using X still refuses


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")


STUBBED = (
    "sglang.srt.configs",  # imports transformers' model configs
    "safetensors",
    "huggingface_hub",
    "tvm_ffi",
    "sentencepiece",
)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _needs_checkpoint(*_: Any, **__: Any) -> Any:
    raise NeedsCheckpoint("reads the checkpoint's config (model_config_of)")


def _needs_rdma(*_: Any, **__: Any) -> Any:
    raise NeedsCheckpoint("probes this machine's RDMA devices (/sys/class/infiniband)")


# functions that read the checkpoint or the machine, replaced wherever a hook module holds them
_REPLACED = {"model_config_of": _needs_checkpoint, "validate_ib_devices": _needs_rdma}


class Resolution:
    """The pipeline's hooks, in its order, that this venv can import."""

    def __init__(self) -> None:
        sys.meta_path.insert(0, _StubFinder())
        import sglang.srt.arg_groups as groups
        from sglang.srt.arg_groups.resolution_hooks import run_hook

        self.run_hook = run_hook
        folder = os.path.dirname(groups.__file__)
        with open(os.path.join(folder, "pipeline.py")) as f:
            src = f.read()
        body = src[src.index("def run_resolution_pipeline") :]
        self.order = re.findall(r"run_hook\((\w+), server_args\)", body)
        self.modules: dict[str, Any] = {}
        self.import_errors: dict[str, str] = {}
        for info in pkgutil.iter_modules([folder]):
            try:
                mod = importlib.import_module(f"sglang.srt.arg_groups.{info.name}")
            except Exception as exc:  # needs a package this venv lacks
                self.import_errors[info.name] = f"{type(exc).__name__}: {exc}"
                continue
            for attr, replacement in _REPLACED.items():
                if hasattr(mod, attr):
                    setattr(mod, attr, replacement)
            self.modules[info.name] = mod
        self.hooks = {}
        for name in self.order:
            fn = next((getattr(m, name) for m in self.modules.values() if hasattr(m, name)), None)
            if fn is not None:
                self.hooks[name] = fn

    def run(self, server_args: Any) -> tuple[dict[str, Any], list[str]]:
        from sglang.srt.arg_groups.arg_utils import record_fields

        # what resolve_once and the pipeline's preamble set up before the first hook
        server_args._raw_input = {
            f.name: getattr(server_args, f.name) for f in record_fields(type(server_args))
        }
        server_args._resolved_overrides = []
        server_args._input_frozen = True
        ran: list[str] = []
        skipped: dict[str, str] = {}
        for name in self.order:
            fn = self.hooks.get(name)
            if fn is None:
                skipped[name] = "its module does not import here"
                continue
            try:
                self.run_hook(fn, server_args)
            except NeedsCheckpoint as exc:
                skipped[name] = str(exc)
                continue
            except ImportError as exc:
                skipped[name] = f"imports {exc.name or exc}"
                continue
            except BaseException as exc:
                text = " ".join(str(exc).split())
                return {"ran": ran, "skipped": skipped}, [
                    f"resolution {name}: {type(exc).__name__}: {text[:900]}"
                ]
            ran.append(name)
        return {"ran": ran, "skipped": skipped}, []


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
    "speculative_num_draft_tokens",
    "speculative_draft_attention_backend",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "attention_backend",
    "mem_fraction_static",
    "enable_unified_memory",
    "max_running_requests",
    "cuda_graph_max_bs_decode",
    "prefill_decode_interval",
    "enable_cache_report",
    "tokenizer_worker_num",
    "enable_dp_lm_head",
)
# variables read through os.getenv rather than sglang.srt.environ.envs
_GETENV = {"SGLANG_HOST_IP": lambda: get_local_ip_auto()}


class Checker:
    def __init__(self) -> None:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.options = parser._option_string_actions
        self.resolution = Resolution()

    def check(self, req: dict[str, Any]) -> dict[str, Any]:
        environ: dict[str, str] = req.get("environ", {})
        problems: list[str] = []
        try:
            argv = [_REF.sub(lambda m: environ[m.group(1)], a) for a in req["argv"]]
        except KeyError as exc:
            problems.append(f"argv: refers to $({exc.args[0]}), which environ lacks")
            return {"ok": False, "problems": problems, "parsed": {}, "env": {}}
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
        env, env_problems = self._check_env(req.get("env", {}), environ)
        problems += env_problems
        parsed = {k: _plain(getattr(server_args, k, None)) for k in PARSED}
        resolution: dict[str, Any] = {}
        if not problems:
            resolution, resolve_problems = self._resolve(server_args, req.get("env", {}), environ)
            problems += resolve_problems
        return {
            "ok": not problems,
            "problems": problems,
            "parsed": parsed,
            "env": env,
            "resolution": resolution,
        }

    def _resolve(
        self, server_args: Any, env: dict[str, str], environ: dict[str, str]
    ) -> tuple[dict[str, Any], list[str]]:
        """The resolution pass with the command's environment applied (hooks read it)."""
        saved = dict(os.environ)
        try:
            for key, value in env.items():
                os.environ[key] = _REF.sub(lambda m: environ[m.group(1)], value)
            with contextlib.redirect_stderr(io.StringIO()):
                return self.resolution.run(server_args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

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
        draft_backend = getattr(sa, "speculative_draft_attention_backend", None)
        if draft_backend is not None and draft_backend not in DRAFT_ATTENTION_BACKEND_CHOICES:
            # no parser choices: DFLASH would silently fall back to another backend
            out.append(
                f"speculative_draft_attention_backend: {draft_backend!r} not in "
                "DRAFT_ATTENTION_BACKEND_CHOICES"
            )
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
    logging.disable(logging.WARNING)  # the hooks' advice would flood the test log
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
