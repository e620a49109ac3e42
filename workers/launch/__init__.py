"""Production engines (SGLang, vLLM): render a pool's command line, check a P/D pair, supervise.

    spec = PoolSpec.parse(yaml.safe_load(...))       # strict boundary model
    check_pair_compat(prefill_spec, decode_spec)     # before launch
    cmd = render(spec)                               # pure: argv + env + probes
    cmd = render(spec, node="worker")                # multi-node: a LeaderWorkerSet worker
    seed = render_sglang_production(spec)            # the seeds' production command shape
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
from beamserve.workers.launch.hardware import ATTENTION_BACKENDS, attention_backend_for
from beamserve.workers.launch.sglang import (
    PRODUCTION_FLAGS,
    NodeRole,
    render_sglang,
    render_sglang_production,
)
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


def render(spec: PoolSpec, *, node: NodeRole = "leader") -> LaunchCommand:
    """The command for `spec`'s engine; `node="worker"` for the non-leader pods of a
    multi-node instance (a LeaderWorkerSet's worker template)."""
    if spec.engine == "sglang":
        return render_sglang(spec, node=node)
    return render_vllm(spec, node=node)


__all__ = [
    "ATTENTION_BACKENDS",
    "PRODUCTION_FLAGS",
    "EngineEnvError",
    "EngineExitedError",
    "EngineNotReadyError",
    "EngineSupervisor",
    "KVCacheSpec",
    "KVEventsSpec",
    "LaunchCommand",
    "LaunchError",
    "ModelSource",
    "NodeRole",
    "PairCompatError",
    "Parallelism",
    "ParserSpec",
    "PoolSpec",
    "PoolSpecError",
    "SpeculativeSpec",
    "SupervisorOptions",
    "TransferSpec",
    "attention_backend_for",
    "check_pair_compat",
    "render",
    "render_sglang",
    "render_sglang_production",
    "render_vllm",
]
