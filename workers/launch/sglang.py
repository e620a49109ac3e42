"""Render a pool spec as an SGLang 0.5.23 server command (`python -m sglang.launch_server`).

Pure: spec in, `LaunchCommand` out. Every flag and value below is checked against the real
`ServerArgs` parser of sglang 0.5.23 by `tests/workers/test_launch_contract.py`; the mapping
and what could not be checked are in docs/engines.md.
"""

from __future__ import annotations

import json
from typing import Literal

from beamserve.workers.launch.command import LaunchCommand
from beamserve.workers.launch.spec import PoolSpec

SGLANG_VERSION = "0.5.23"

# Weight formats → `--quantization` values (choices of the 0.5.23 parser). nvfp4 is a
# ModelOpt NVFP4 export, the format NVIDIA's Blackwell checkpoints ship in.
QUANTIZATION = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4"}
KV_CACHE_DTYPE = {"bf16": "bf16", "fp8_e4m3": "fp8_e4m3"}
# DFlash2 is SGLang's DFLASH algorithm with a `DFlash2BeamDraftModel` draft checkpoint
# (sglang/srt/models/dflash.py); the block size is the verify window, anchor included.
SPECULATIVE_ALGORITHM = {"dflash2": "DFLASH"}


NodeRole = Literal["leader", "worker"]
LOCAL_INIT_HOST = "127.0.0.1"
# The seeds' production command (4×GB300, NVFP4, TP4), flag for flag: the order
# `render_sglang_production` keeps; `render_sglang` keeps it too and appends the pod's own flags.
PRODUCTION_FLAGS = (
    "--model-path",
    "--served-model-name",
    "--quantization",
    "--tp-size",
    "--ep-size",
    "--attn-dp-size",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--attention-backend",
    "--page-size",
    "--mem-fraction-static",
    "--enable-unified-memory",
    "--reasoning-parser",
    "--tool-call-parser",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-draft-attention-backend",
    "--speculative-num-draft-tokens",
    "--enable-hierarchical-cache",
    "--hicache-size",
    "--max-running-requests",
    "--cuda-graph-max-bs-decode",
    "--context-length",
    "--chunked-prefill-size",
    "--prefill-decode-interval",
    "--enable-cache-report",
    "--enable-metrics",
    "--tokenizer-worker-num",
)


def render_sglang(
    spec: PoolSpec, *, python: str = "python3", node: NodeRole = "leader"
) -> LaunchCommand:
    """The SGLang command line and environment for `spec` (which must name engine sglang).

    The flags come in the production command's order (`PRODUCTION_FLAGS`; defaults the
    engine already has are left out), then what a pod adds: where to listen, the KV dtype,
    the P/D role and the KV-event socket. Every node of a multi-node instance runs the same
    command (`node` only marks a worker node, which serves no HTTP: rank ≥ 1 runs schedulers
    only); its rank and the leader's address are `$(NAME)` references (`command.py`).
    """
    argv = [python, "-m", "sglang.launch_server"]
    argv += _engine_flags(spec, explicit=False)
    argv += ["--host", spec.host, "--port", str(spec.port)]
    argv += ["--kv-cache-dtype", KV_CACHE_DTYPE[spec.kv_cache.dtype]]
    argv += _pod_flags(spec)
    return _command(spec, argv, node)


def render_sglang_production(spec: PoolSpec, *, python: str = "python3") -> LaunchCommand:
    """The seeds' production command for `spec`, flag for flag (`PRODUCTION_FLAGS`).

    Unlike `render_sglang` it spells out the parallel and rank flags even at their defaults
    (`--ep-size 1 --attn-dp-size 1 --nnodes 1 --node-rank 0 --dist-init-addr
    127.0.0.1:PORT`), writes the DFlash block as `--speculative-num-draft-tokens`, and leaves
    where to listen to SGLang (127.0.0.1:30000), as the seeds' single-machine runs did; the KV
    dtype appears only when it is not bf16 (SGLang's `auto` for Beam). What the production
    shape has no flag for (P/D role, KV events) follows it, as in `render_sglang`.
    """
    argv = [python, "-m", "sglang.launch_server"]
    argv += _engine_flags(spec, explicit=True)
    if spec.kv_cache.dtype != "bf16":
        argv += ["--kv-cache-dtype", KV_CACHE_DTYPE[spec.kv_cache.dtype]]
    argv += _pod_flags(spec)
    return _command(spec, argv, "leader")


def _engine_flags(spec: PoolSpec, *, explicit: bool) -> list[str]:
    if spec.engine != "sglang":
        raise ValueError(f"engine: render_sglang got a {spec.engine} pool; use render_vllm")
    par, kv = spec.parallel, spec.kv_cache
    argv: list[str] = []
    argv += ["--model-path", spec.model.path, "--served-model-name", spec.model.served_name]
    quant = QUANTIZATION[spec.model.format]
    if quant is not None:
        argv += ["--quantization", quant]
    argv += ["--tp-size", str(par.tp_size)]
    if explicit or par.ep_size > 1:
        argv += ["--ep-size", str(par.ep_size)]
    if explicit or par.dp_attention > 1:
        # 0.5.23 deprecates `--dp-size N --enable-dp-attention` in favour of this flag.
        argv += ["--attn-dp-size", str(par.dp_attention)]
    if explicit or spec.multinode:
        argv += _rank_flags(spec)
    backend = spec.resolved_attention_backend
    if backend is not None:
        argv += ["--attention-backend", backend]
    argv += ["--page-size", str(kv.page_size)]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", _fraction(spec.mem_fraction_static)]
    if spec.unified_memory:
        argv += ["--enable-unified-memory"]
    if spec.parsers.reasoning is not None:
        argv += ["--reasoning-parser", spec.parsers.reasoning]
    if spec.parsers.tool_call is not None:
        argv += ["--tool-call-parser", spec.parsers.tool_call]
    if spec.speculative is not None:
        sp = spec.speculative
        argv += ["--speculative-algorithm", SPECULATIVE_ALGORITHM[sp.method]]
        argv += ["--speculative-draft-model-path", sp.draft_model_path]
        if sp.draft_attention_backend is not None:
            argv += ["--speculative-draft-attention-backend", sp.draft_attention_backend]
        # one value, two spellings: `--speculative-dflash-block-size` is DFLASH's alias of
        # `--speculative-num-draft-tokens` (speculative_hook._handle_dflash)
        name = "--speculative-num-draft-tokens" if explicit else "--speculative-dflash-block-size"
        argv += [name, str(sp.block_size)]
    if kv.host_cache_gb > 0:
        argv += ["--enable-hierarchical-cache", "--hicache-size", str(kv.host_cache_gb)]
    if spec.max_running_requests is not None:
        argv += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.cuda_graph_max_bs is not None:
        argv += ["--cuda-graph-max-bs-decode", str(spec.cuda_graph_max_bs)]
    if spec.context_length is not None:
        argv += ["--context-length", str(spec.context_length)]
    if spec.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(spec.chunked_prefill_size)]
    if spec.prefill_decode_interval is not None:
        argv += ["--prefill-decode-interval", str(spec.prefill_decode_interval)]
    if spec.cache_report:
        argv += ["--enable-cache-report"]
    if spec.metrics:
        argv += ["--enable-metrics"]
    if spec.tokenizer_worker_num is not None:
        argv += ["--tokenizer-worker-num", str(spec.tokenizer_worker_num)]
    return argv


def _rank_flags(spec: PoolSpec) -> list[str]:
    """`--nnodes --node-rank --dist-init-addr`: from the LeaderWorkerSet environment on
    several nodes, literal on one (the leader is this node)."""
    if spec.multinode:
        rank = f"$({spec.node_rank_env})"
        leader = f"$({spec.leader_address_env})"
    else:
        rank, leader = "0", LOCAL_INIT_HOST
    return [
        "--nnodes",
        str(spec.parallel.nodes),
        "--node-rank",
        rank,
        "--dist-init-addr",
        f"{leader}:{spec.dist_init_port}",
    ]


def _pod_flags(spec: PoolSpec) -> list[str]:
    """What the production shape has no flag for: the P/D role, radix-cache off, events."""
    argv: list[str] = []
    kv = spec.kv_cache
    if not kv.prefix_caching and spec.role != "decode":
        # decode's radix cache is already off in PD mode
        argv += ["--disable-radix-cache"]
    if spec.speculative is not None and spec.parallel.dp_attention > 1:
        # speculative_hook._handle_dflash: "DFLASH with dp attention requires
        # --enable-dp-lm-head" (the drafter borrows the target's LM head)
        argv += ["--enable-dp-lm-head"]
    if spec.disaggregated:
        t = spec.transfer
        argv += ["--disaggregation-mode", spec.role]
        argv += ["--disaggregation-transfer-backend", t.backend]
        if spec.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(t.bootstrap_port)]
        if t.ib_device is not None:
            argv += ["--disaggregation-ib-device", t.ib_device]
    if spec.kv_events is not None:
        ev = spec.kv_events
        cfg: dict[str, str] = {"publisher": "zmq", "endpoint": ev.endpoint, "topic": ev.topic}
        if ev.replay_endpoint is not None:
            cfg["replay_endpoint"] = ev.replay_endpoint
        argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
    return argv


def _command(spec: PoolSpec, argv: list[str], node: NodeRole) -> LaunchCommand:
    env: dict[str, str] = {
        # `/health` answers without running a generation, so it can serve as liveness;
        # readiness polls `/health_generate`, which does.
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    }
    if spec.disaggregated:
        # the address prefill ranks register with the bootstrap server, and decode
        # ranks advertise (sglang/srt/utils/network.py: get_local_ip_auto)
        env["SGLANG_HOST_IP"] = f"$({spec.pod_ip_env})"
    if spec.speculative is not None and spec.speculative.simulate_acceptance_length is not None:
        env["SGLANG_SIMULATE_ACC_LEN"] = _fraction(spec.speculative.simulate_acceptance_length)
    env.update(spec.env)
    return LaunchCommand(
        argv=tuple(argv),
        env=env,
        port=spec.port,
        ready_path="/health_generate",
        live_path="/health",
        serves_http=node == "leader",
    )


def _fraction(value: float) -> str:
    """0.8 → "0.80", 4.0 → "4" (the seeds' spelling; any float SGLang parses is fine)."""
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.2f}"
    return text if float(text) == value else repr(value)
