"""What each pool of a `BeamDeployment` runs: its launcher spec and its command (pure).

* `launch_spec(spec, role)` — the `beamserve.workers.launch.PoolSpec` of an SGLang or vLLM pool
  (the launchers' strict boundary model; raises `PoolSpecError` naming the launcher's field);
* `pool_command(spec, role)` — the container's `LaunchCommand` (argv, env, probes) for every
  engine: SGLang and vLLM through `beamserve.workers.launch.render`, `sim` and `ref` as
  `beamserve worker …`. Environment values use Kubernetes' `$(VAR)` references: `POD_IP`
  (downward API `status.podIP`) and, in multi-node pools, the LeaderWorkerSet variables
  `LWS_LEADER_ADDRESS` and `LWS_WORKER_INDEX`, which the pod template must define.

Engine knobs (`tuning`) and multi-node ranks go to the launcher's own fields where its
`PoolSpec` has them; a knob it does not render yet is appended as the engine's flag
(`SGLANG_FLAGS` / `VLLM_FLAGS`) unless the rendered command already carries that flag, so a
launcher that learns a knob takes it over without a change here.
"""

from __future__ import annotations

from typing import Any

from beamserve.operator.api import BeamDeploymentSpec, EngineTuning, PoolRole, PoolSpec
from beamserve.workers.launch import LaunchCommand, render
from beamserve.workers.launch import PoolSpec as LaunchPoolSpec

POD_IP_ENV = "POD_IP"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"

# tuning field → (launcher PoolSpec field it maps to when present, SGLang flag, vLLM flag).
# A flag of None: the engine has no such knob (admission refuses the field for it).
# A bool knob renders as a bare switch when true. The flags are checked against the option
# strings of SGLang 0.5.23's and vLLM 0.33.0's parsers (the launchers' contract venvs).
TUNING: dict[str, tuple[str, str | None, str | None]] = {
    "attention_backend": ("attention_backend", "--attention-backend", "--attention-backend"),
    "memory_fraction": ("mem_fraction_static", "--mem-fraction-static", "--gpu-memory-utilization"),
    "unified_memory": ("unified_memory", "--enable-unified-memory", None),
    "max_running_requests": ("max_running_requests", "--max-running-requests", "--max-num-seqs"),
    "cuda_graph_max_batch_size": (
        "cuda_graph_max_bs",
        "--cuda-graph-max-bs-decode",
        "--max-cudagraph-capture-size",
    ),
    "prefill_decode_interval": ("prefill_decode_interval", "--prefill-decode-interval", None),
    "cache_report": ("cache_report", "--enable-cache-report", None),
    "tokenizer_workers": ("tokenizer_worker_num", "--tokenizer-worker-num", None),
}
SGLANG_FLAGS = {k: v[1] for k, v in TUNING.items()}
VLLM_FLAGS = {k: v[2] for k, v in TUNING.items()}


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
    if kv.ib_device is not None and spec.engine.name == "sglang":
        out["transfer"]["ib_device"] = kv.ib_device
    if spec.model.draft is not None:
        out["speculative"] = {
            "method": spec.model.draft.method,
            "draft_model_path": spec.model.draft.mount_path,
            "block_size": spec.model.draft.block_size,
        }
    if spec.model.context_length is not None:
        out["context_length"] = spec.model.context_length
    if pool.tuning.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = pool.tuning.chunked_prefill_size
    fields = LaunchPoolSpec.model_fields
    for name, (launcher_field, _, _) in TUNING.items():
        value = getattr(pool.tuning, name)
        if value is not None and launcher_field in fields:
            out[launcher_field] = value
    return out


def pool_command(spec: BeamDeploymentSpec, role: PoolRole) -> LaunchCommand:
    """The command `role`'s pods run (engine flags, then `engine.extraArgs`, then the pool's)."""
    pool = _pool(spec, role)
    if spec.engine.name in ("sglang", "vllm"):
        cmd = render(launch_spec(spec, role))
        argv = list(cmd.argv)
        argv += _tuning_flags(spec.engine.name, pool.tuning, argv)
        argv += _multinode_flags(spec, pool, argv)
        env = dict(cmd.env)
    else:
        argv = _worker_argv(spec, role, pool)
        env = {}
        cmd = LaunchCommand(argv=(), port=pool.ports.http, ready_path="/health")
    argv += spec.engine.extra_args + pool.extra_args
    env.update({e.name: e.value for e in spec.engine.extra_env})
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


def _tuning_flags(engine: str, tuning: EngineTuning, argv: list[str]) -> list[str]:
    flags = SGLANG_FLAGS if engine == "sglang" else VLLM_FLAGS
    present = {flag_name(a) for a in argv}
    out: list[str] = []
    for name, flag in flags.items():
        value = getattr(tuning, name)
        if value is None or flag is None or flag in present:
            continue
        if isinstance(value, bool):
            if value:
                out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def _multinode_flags(spec: BeamDeploymentSpec, pool: PoolSpec, argv: list[str]) -> list[str]:
    """Rank flags of one engine instance over `nodesPerReplica` pods (a LeaderWorkerSet)."""
    if pool.nodes_per_replica == 1 or "--nnodes" in argv:
        return []
    port = pool.ports.dist_init
    if spec.engine.name == "sglang":
        return [
            "--nnodes",
            str(pool.nodes_per_replica),
            "--node-rank",
            f"$({WORKER_INDEX_ENV})",
            "--dist-init-addr",
            f"$({LEADER_ADDRESS_ENV}):{port}",
        ]
    return [
        "--nnodes",
        str(pool.nodes_per_replica),
        "--node-rank",
        f"$({WORKER_INDEX_ENV})",
        "--master-addr",
        f"$({LEADER_ADDRESS_ENV})",
        "--master-port",
        str(port),
    ]


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
    else:
        argv += ["--tp", str(pool.tp // pool.attention_dp)]
    argv += ["--kv-events-endpoint", f"tcp://*:{pool.ports.kv_events}"]
    argv += ["--kv-replay-endpoint", f"tcp://*:{pool.ports.kv_replay}"]
    if role != "both":
        argv += ["--transfer-backend", spec.kv.transfer_backend]
    if role == "prefill":
        argv += ["--handshake-port", str(pool.ports.bootstrap)]
    if spec.model.context_length is not None:
        argv += ["--max-model-len", str(spec.model.context_length)]
    return argv
