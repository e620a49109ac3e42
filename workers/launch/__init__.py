"""Production engines (SGLang, vLLM): render a pool's command line, check a P/D pair, supervise.

    spec = PoolSpec.parse(yaml.safe_load(...))       # strict boundary model
    check_pair_compat(prefill_spec, decode_spec)     # before launch
    cmd = render(spec)                               # pure: argv + env + probes
    code = await EngineSupervisor(cmd).run()         # child process, signals, readiness

See docs/engines.md for the rendered commands and what is verified against which parser.
"""

from __future__ import annotations

from beamserve.workers.launch.command import LaunchCommand
from beamserve.workers.launch.compat import check_pair_compat
from beamserve.workers.launch.errors import (
    EngineEnvError,
    EngineExitedError,
    EngineNotReadyError,
    LaunchError,
    PairCompatError,
    PoolSpecError,
)
from beamserve.workers.launch.sglang import render_sglang
from beamserve.workers.launch.spec import (
    KVCacheSpec,
    KVEventsSpec,
    ModelSource,
    Parallelism,
    ParserSpec,
    PoolSpec,
    SpeculativeSpec,
    TransferSpec,
)
from beamserve.workers.launch.supervisor import EngineSupervisor, SupervisorOptions
from beamserve.workers.launch.vllm import render_vllm


def render(spec: PoolSpec) -> LaunchCommand:
    """The command for `spec`'s engine."""
    return render_sglang(spec) if spec.engine == "sglang" else render_vllm(spec)


__all__ = [
    "EngineEnvError",
    "EngineExitedError",
    "EngineNotReadyError",
    "EngineSupervisor",
    "KVCacheSpec",
    "KVEventsSpec",
    "LaunchCommand",
    "LaunchError",
    "ModelSource",
    "PairCompatError",
    "Parallelism",
    "ParserSpec",
    "PoolSpec",
    "PoolSpecError",
    "SpeculativeSpec",
    "SupervisorOptions",
    "TransferSpec",
    "check_pair_compat",
    "render",
    "render_sglang",
    "render_vllm",
]
