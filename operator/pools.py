"""What each pool of a `BeamDeployment` runs: its launcher spec and its command (pure).

* `launch_spec(spec, role)` — the `beamserve.workers.launch.PoolSpec` of an SGLang or vLLM pool
  (the launchers' strict boundary model; raises `PoolSpecError` naming the launcher's field;
  `LAUNCH_PATHS` maps those fields back to the BeamDeployment's);
* `pool_command(spec, role, node=...)` — the container's `LaunchCommand` (argv, env, probes)
  for every engine: SGLang and vLLM through `beamserve.workers.launch.render`, `sim` and `ref`
  as `beamserve worker …`. Multi-node pools (`nodesPerReplica` > 1) render a `leader` and a
  `worker` command (vLLM's workers run headless). Environment values use Kubernetes' `$(VAR)`
  references: `POD_IP` (downward API `status.podIP`) and, in multi-node pools, the
  LeaderWorkerSet variables `LWS_LEADER_ADDRESS` and `LWS_WORKER_INDEX`, which the pod
  template must define.
"""

from __future__ import annotations

from typing import Any, Literal

from beamserve.operator.api import BeamDeploymentSpec, PoolRole, PoolSpec
from beamserve.workers.launch import LaunchCommand, render
from beamserve.workers.launch import PoolSpec as LaunchPoolSpec

POD_IP_ENV = "POD_IP"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
NodeRole = Literal["leader", "worker"]

# `tuning` field → the launcher's PoolSpec field.
TUNING: dict[str, str] = {
    "gpu": "gpu",
    "attention_backend": "attention_backend",
    "memory_fraction": "mem_fraction_static",
    "unified_memory": "unified_memory",
    "max_running_requests": "max_running_requests",
    "cuda_graph_max_batch_size": "cuda_graph_max_bs",
    "chunked_prefill_size": "chunked_prefill_size",
    "prefill_decode_interval": "prefill_decode_interval",
    "cache_report": "cache_report",
    "tokenizer_workers": "tokenizer_worker_num",
}
# The launcher's field paths (first dotted part of its messages) → the BeamDeployment's, with
# `{role}` for the pool (used to name the field in admission's messages).
LAUNCH_PATHS: dict[str, str] = {
    "parallel.tp_size": "spec.{role}.tp",
    "parallel.ep_size": "spec.{role}.ep",
    "parallel.dp_attention": "spec.{role}.attentionDp",
    "parallel.nodes": "spec.{role}.nodesPerReplica",
    "parallel": "spec.{role}.tp",
    "kv_cache.page_size": "spec.{role}.kv.pageSize",
    "kv_cache.dtype": "spec.{role}.kv.dtype",
    "kv_cache.host_cache_gb": "spec.{role}.kv.hostCacheGb",
    "kv_cache.prefix_caching": "spec.kv.prefixCaching",
    "transfer.backend": "spec.kv.transferBackend",
    "transfer.ib_device": "spec.kv.ibDevice",
    "transfer.bootstrap_port": "spec.{role}.ports.bootstrap",
    "transfer.side_channel_port": "spec.{role}.ports.sideChannel",
    "transfer.on_load_failure": "spec.kv.onLoadFailure",
    "kv_events.endpoint": "spec.{role}.ports.kvEvents",
    "kv_events.replay_endpoint": "spec.{role}.ports.kvReplay",
    "port": "spec.{role}.ports.http",
    "dist_init_port": "spec.{role}.ports.distInit",
    "model.path": "spec.model.mountPath",
    "model.format": "spec.model.format",
    "model.fingerprint": "spec.model.fingerprint",
    "model.served_name": "spec.model.servedName",
    "context_length": "spec.model.contextLength",
    "speculative.draft_model_path": "spec.model.draft.mountPath",
    "speculative.block_size": "spec.model.draft.blockSize",
    "speculative.draft_attention_backend": "spec.model.draft.attentionBackend",
    "speculative.simulate_acceptance_length": "spec.model.draft.simulateAcceptanceLength",
    "speculative": "spec.model.draft",
    "env": "spec.engine.extraEnv",
    "gpu": "spec.{role}.tuning.gpu",
    "attention_backend": "spec.{role}.tuning.attentionBackend",
    "mem_fraction_static": "spec.{role}.tuning.memoryFraction",
    "unified_memory": "spec.{role}.tuning.unifiedMemory",
    "max_running_requests": "spec.{role}.tuning.maxRunningRequests",
    "cuda_graph_max_bs": "spec.{role}.tuning.cudaGraphMaxBatchSize",
    "chunked_prefill_size": "spec.{role}.tuning.chunkedPrefillSize",
    "prefill_decode_interval": "spec.{role}.tuning.prefillDecodeInterval",
    "cache_report": "spec.{role}.tuning.cacheReport",
    "tokenizer_worker_num": "spec.{role}.tuning.tokenizerWorkers",
}


def launch_path(launcher_field: str, role: PoolRole) -> str:
    """The BeamDeployment field behind the launcher's `launcher_field` (longest known prefix)."""
    parts = launcher_field.split(".")
    for n in range(len(parts), 0, -1):
        known = LAUNCH_PATHS.get(".".join(parts[:n]))
        if known is not None:
            return known.format(role=role)
    return f"spec.{role}"


def launch_spec(spec: BeamDeploymentSpec, role: PoolRole) -> LaunchPoolSpec:
    """The launcher's spec for `role`'s pool (engines `sglang` and `vllm` only)."""
    return LaunchPoolSpec.parse(launch_spec_dict(spec, role))


def launch_spec_dict(spec: BeamDeploymentSpec, role: PoolRole) -> dict[str, Any]:
    """`launch_spec` before validation (the mapping `PoolSpec.parse` takes)."""
    pool = _pool(spec, role)
    if spec.engine.name not in ("sglang", "vllm"):
        raise ValueError(f"engine: {spec.engine.name} pools run `beamserve worker`, no launcher")
    model: dict[str, Any] = {
        "path": spec.model.mount_path,
        "format": spec.model.format,
        "served_name": spec.model.served_name,
    }
    if spec.model.fingerprint is not None:
        model["fingerprint"] = spec.model.fingerprint
    kv = spec.kv
    out: dict[str, Any] = {
        "engine": spec.engine.name,
        "role": role,
        "model": model,
        "parallel": {"tp_size": pool.tp, "ep_size": pool.ep, "dp_attention": pool.attention_dp},
        "kv_cache": {
            "page_size": spec.page_size(role),
            "dtype": spec.kv_dtype(role),
            "host_cache_gb": spec.host_cache_gb(role),
            "prefix_caching": kv.prefix_caching,
        },
        "transfer": {
            "backend": kv.transfer_backend,
            "bootstrap_port": pool.ports.bootstrap,
            "side_channel_port": pool.ports.side_channel,
            "on_load_failure": kv.on_load_failure,
        },
        "kv_events": {
            "endpoint": f"tcp://*:{pool.ports.kv_events}",
            "replay_endpoint": f"tcp://*:{pool.ports.kv_replay}",
        },
        "metrics": True,
        "host": "0.0.0.0",
        "port": pool.ports.http,
        "pod_ip_env": POD_IP_ENV,
    }
    if spec.swings(role):
        out["kv_both"] = True  # the router chooses its parts by load (`pool_roles`)
    if kv.ib_device is not None and spec.engine.name == "sglang":
        out["transfer"]["ib_device"] = kv.ib_device
    if spec.model.draft is not None:
        draft = spec.model.draft
        out["speculative"] = {
            "method": draft.method,
            "draft_model_path": draft.mount_path,
            "block_size": draft.block_size,
        }
        if draft.attention_backend is not None:
            out["speculative"]["draft_attention_backend"] = draft.attention_backend
        if draft.simulate_acceptance_length is not None:
            out["speculative"]["simulate_acceptance_length"] = draft.simulate_acceptance_length
    if spec.model.context_length is not None:
        out["context_length"] = spec.model.context_length
    for name, launcher_field in TUNING.items():
        value = getattr(pool.tuning, name)
        if value is not None:
            out[launcher_field] = value
    if pool.nodes_per_replica > 1:
        out["parallel"]["nodes"] = pool.nodes_per_replica
        out["dist_init_port"] = pool.ports.dist_init
        out["leader_address_env"] = LEADER_ADDRESS_ENV
        out["node_rank_env"] = WORKER_INDEX_ENV
    if spec.engine.extra_env:
        out["env"] = {e.name: e.value for e in spec.engine.extra_env}
    return out


def pool_command(
    spec: BeamDeploymentSpec, role: PoolRole, node: NodeRole = "leader"
) -> LaunchCommand:
    """The command `role`'s pods run (engine flags, then `engine.extraArgs`, then the pool's);
    `node="worker"`: the non-leader pods of a multi-node replica."""
    pool = _pool(spec, role)
    if spec.engine.name in ("sglang", "vllm"):
        cmd = render(launch_spec(spec, role), node=node)
        argv = list(cmd.argv)
        env = dict(cmd.env)
    else:
        argv = _worker_argv(spec, role, pool)
        env = {e.name: e.value for e in spec.engine.extra_env}
        cmd = LaunchCommand(argv=(), port=pool.ports.http, ready_path="/health")
    argv += spec.engine.extra_args + pool.extra_args
    return LaunchCommand(
        argv=tuple(argv),
        env=env,
        port=cmd.port,
        ready_path=cmd.ready_path,
        live_path=cmd.live_path,
    )


def rendered_flags(spec: BeamDeploymentSpec, role: PoolRole) -> set[str]:
    """The `--flags` beamserve itself renders for `role` (extra args must not repeat them)."""
    bare = spec.model_copy(
        update={
            "engine": spec.engine.model_copy(update={"extra_args": []}),
            role: _pool(spec, role).model_copy(update={"extra_args": []}),
        }
    )
    return {flag_name(a) for a in pool_command(bare, role).argv if a.startswith("-")}


def flag_name(arg: str) -> str:
    """`--flag=value` → `--flag`."""
    return arg.split("=", 1)[0]


def _pool(spec: BeamDeploymentSpec, role: PoolRole) -> PoolSpec:
    pool = getattr(spec, role)
    if pool is None:
        raise ValueError(f"spec.{role}: not set; this BeamDeployment has {list(spec.pools())}")
    assert isinstance(pool, PoolSpec)
    return pool


def _worker_argv(spec: BeamDeploymentSpec, role: PoolRole, pool: PoolSpec) -> list[str]:
    """`beamserve worker` for the `sim` and `ref` engines (one process per pod)."""
    argv = ["beamserve", "worker", "--engine", spec.engine.name, "--role", role]
    argv += ["--api", spec.engine.api, "--model", spec.model.mount_path]
    argv += ["--served-model-name", spec.model.served_name]
    argv += ["--host", "0.0.0.0", "--port", str(pool.ports.http)]
    argv += ["--advertise-host", f"$({POD_IP_ENV})"]
    argv += ["--page-size", str(spec.page_size(role))]
    if spec.engine.name == "sim":
        argv += ["--profile", spec.engine.sim_profile]
        if pool.tuning.chunked_prefill_size is not None:
            argv += ["--max-num-batched-tokens", str(pool.tuning.chunked_prefill_size)]
    else:
        argv += ["--tp", str(pool.tp // pool.attention_dp)]
    argv += ["--kv-events-endpoint", f"tcp://*:{pool.ports.kv_events}"]
    argv += ["--kv-replay-endpoint", f"tcp://*:{pool.ports.kv_replay}"]
    swings = spec.swings(role)
    if role != "both" or swings:
        argv += ["--transfer-backend", spec.kv.transfer_backend]
    if role == "prefill" or swings:  # a swinging pool's workers may serve prefill legs
        argv += ["--handshake-port", str(pool.ports.bootstrap)]
    if spec.model.context_length is not None:
        argv += ["--max-model-len", str(spec.model.context_length)]
    return argv
