"""Render a pool spec as a vLLM 0.33.0 server command (`vllm serve MODEL`).

Pure: spec in, `LaunchCommand` out. Every flag, JSON key and registry name below is checked
against the real vLLM 0.33.0 `serve` parser and `validate()` by
`tests/workers/test_launch_contract.py`; the mapping is explained in docs/engines.md.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from beamserve.workers.launch.command import LaunchCommand
from beamserve.workers.launch.spec import PoolSpec

VLLM_VERSION = "0.33.0"

QUANTIZATION = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4"}
KV_CACHE_DTYPE = {"bf16": "bfloat16", "fp8_e4m3": "fp8_e4m3"}
# DFlash2 runs on vLLM's `dflash` method; the draft's architecture (`DFlash2BeamDraftModel`)
# selects the DFlash2 speculator (vllm/v1/worker/gpu/spec_decode/__init__.py).
SPECULATIVE_METHOD = {"dflash2": "dflash"}
CONNECTOR = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
HOST_CACHE_CONNECTOR = "OffloadingConnector"


def render_vllm(
    spec: PoolSpec, *, vllm: str = "vllm", node: Literal["leader", "worker"] = "leader"
) -> LaunchCommand:
    """The vLLM command line and environment for `spec` (which must name engine vllm).

    Several nodes (`parallel.nodes` > 1) run as vLLM's multi-node TP/DP: every node gets
    `--nnodes N --node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)
    --master-port PORT`, and the worker nodes (`node="worker"`) also `--headless`: they run
    engine cores only and serve no HTTP (vllm/entrypoints/cli/serve.py: run_headless).
    """
    if spec.engine != "vllm":
        raise ValueError(f"engine: render_vllm got a {spec.engine} pool; use render_sglang")
    par, kv = spec.parallel, spec.kv_cache
    argv: list[str] = [vllm, "serve", spec.model.path]
    argv += ["--served-model-name", spec.model.served_name]
    argv += ["--host", spec.host, "--port", str(spec.port)]
    argv += ["--tensor-parallel-size", str(par.attention_tp)]
    if par.dp_attention > 1:
        argv += ["--data-parallel-size", str(par.dp_attention)]
    if par.ep_size > 1:
        argv += ["--enable-expert-parallel"]
    if spec.multinode:
        argv += ["--nnodes", str(par.nodes), "--node-rank", f"$({spec.node_rank_env})"]
        argv += ["--master-addr", f"$({spec.leader_address_env})"]
        argv += ["--master-port", str(spec.dist_init_port)]
        if node == "worker":
            argv += ["--headless"]
    backend = spec.resolved_attention_backend
    if backend is not None:
        argv += ["--attention-backend", backend.upper()]
    if spec.mem_fraction_static is not None:
        argv += ["--gpu-memory-utilization", str(spec.mem_fraction_static)]
    quant = QUANTIZATION[spec.model.format]
    if quant is not None:
        argv += ["--quantization", quant]
    argv += ["--block-size", str(kv.page_size), "--kv-cache-dtype", KV_CACHE_DTYPE[kv.dtype]]
    argv += ["--enable-prefix-caching" if kv.prefix_caching else "--disable-prefix-caching"]
    if spec.context_length is not None:
        argv += ["--max-model-len", str(spec.context_length)]
    if spec.chunked_prefill_size is not None:
        argv += ["--enable-chunked-prefill"]
        argv += ["--max-num-batched-tokens", str(spec.chunked_prefill_size)]
    if spec.max_running_requests is not None:
        argv += ["--max-num-seqs", str(spec.max_running_requests)]
    if spec.cuda_graph_max_bs is not None:
        argv += ["--max-cudagraph-capture-size", str(spec.cuda_graph_max_bs)]
    if spec.cache_report:
        argv += ["--enable-prompt-tokens-details"]

    env: dict[str, str] = {}
    transfer = kv_transfer_config(spec)
    if transfer is not None:
        argv += ["--kv-transfer-config", _json(transfer)]
    if spec.hands_off_kv:
        t = spec.transfer
        if t.backend == "nixl":
            # vLLM defaults the NIXL side channel to localhost; peers in other pods must
            # reach it on the pod IP. vLLM adds the DP rank to the port itself.
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = f"$({spec.pod_ip_env})"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(t.side_channel_port)
        else:
            env["VLLM_HOST_IP"] = f"$({spec.pod_ip_env})"
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(t.bootstrap_port)

    if spec.kv_events is not None:
        ev = spec.kv_events
        events: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": ev.endpoint,
            "topic": ev.topic,
        }
        if ev.replay_endpoint is not None:
            events["replay_endpoint"] = ev.replay_endpoint
        argv += ["--kv-events-config", _json(events)]
    if spec.parsers.reasoning is not None:
        argv += ["--reasoning-parser", spec.parsers.reasoning]
    if spec.parsers.tool_call is not None:
        # agent harnesses send tool_choice "auto", which vLLM serves only with this switch
        argv += ["--tool-call-parser", spec.parsers.tool_call, "--enable-auto-tool-choice"]
    if spec.speculative is not None:
        sp = spec.speculative
        spec_cfg: dict[str, Any] = {
            "method": SPECULATIVE_METHOD[sp.method],
            "model": sp.draft_model_path,
            # a DFlash block is 1 bonus token + N drafted ones
            # (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py: num_query_per_req)
            "num_speculative_tokens": sp.block_size - 1,
        }
        if sp.draft_attention_backend is not None:
            spec_cfg["attention_backend"] = sp.draft_attention_backend.upper()
        argv += ["--speculative-config", _json(spec_cfg)]
    env.update(spec.env)
    return LaunchCommand(
        argv=tuple(argv),
        env=env,
        port=spec.port,
        ready_path="/health",
        live_path="/health",
        serves_http=not (spec.multinode and node == "worker"),
    )


def kv_transfer_config(spec: PoolSpec) -> dict[str, Any] | None:
    """`--kv-transfer-config` for `spec`: the P/D connector, the host-memory cache, or both.

    The host cache goes in as an `OffloadingConnector` (inside a `MultiConnector` next to the
    P/D connector), never as `--kv-offloading-size`: vLLM 0.33 turns that flag into a
    connector that *replaces* whatever `--kv-transfer-config` named
    (`VllmConfig._post_init_kv_transfer_config`), which would silently drop P/D transfer.
    """
    parts: list[dict[str, Any]] = []
    if spec.hands_off_kv:
        t = spec.transfer
        if t.backend == "nixl":
            role = "kv_both"
        else:
            role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
        parts.append({"kv_connector": CONNECTOR[t.backend], "kv_role": role})
    if spec.kv_cache.host_cache_gb > 0:
        # cpu_bytes_to_use counts all ranks of one engine (vllm/v1/kv_offload/cpu/spec.py)
        total = spec.kv_cache.host_cache_gb * 10**9 * spec.parallel.attention_tp
        parts.append(
            {
                "kv_connector": HOST_CACHE_CONNECTOR,
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": total},
            }
        )
    if not parts:
        return None
    if len(parts) == 1:
        top = parts[0]
    else:
        top = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": parts},
        }
    if spec.hands_off_kv:
        # read from the top-level config only (vllm/v1/core/sched/scheduler.py)
        top["kv_load_failure_policy"] = spec.transfer.on_load_failure
    return top


def _json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))
