"""Render a pool spec as an SGLang 0.5.23 server command (`python -m sglang.launch_server`).

Pure: spec in, `LaunchCommand` out. Every flag and value below is checked against the real
`ServerArgs` parser of sglang 0.5.23 by `tests/workers/test_launch_contract.py`; the mapping
and what could not be checked are in docs/engines.md.
"""

from __future__ import annotations

import json

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


def render_sglang(spec: PoolSpec, *, python: str = "python3") -> LaunchCommand:
    """The SGLang command line and environment for `spec` (which must name engine sglang)."""
    if spec.engine != "sglang":
        raise ValueError(f"engine: render_sglang got a {spec.engine} pool; use render_vllm")
    par, kv = spec.parallel, spec.kv_cache
    argv: list[str] = [python, "-m", "sglang.launch_server"]
    argv += ["--model-path", spec.model.path, "--served-model-name", spec.model.served_name]
    argv += ["--host", spec.host, "--port", str(spec.port)]
    argv += ["--tp-size", str(par.tp_size)]
    if par.dp_attention > 1:
        # 0.5.23 deprecates `--dp-size N --enable-dp-attention` in favour of this flag.
        argv += ["--attn-dp-size", str(par.dp_attention)]
    if par.ep_size > 1:
        argv += ["--ep-size", str(par.ep_size)]
    quant = QUANTIZATION[spec.model.format]
    if quant is not None:
        argv += ["--quantization", quant]
    argv += ["--page-size", str(kv.page_size), "--kv-cache-dtype", KV_CACHE_DTYPE[kv.dtype]]
    if spec.context_length is not None:
        argv += ["--context-length", str(spec.context_length)]
    if spec.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(spec.chunked_prefill_size)]
    if not kv.prefix_caching and spec.role != "decode":
        # decode's radix cache is already off in PD mode
        argv += ["--disable-radix-cache"]
    if kv.host_cache_gb > 0:
        argv += ["--enable-hierarchical-cache", "--hicache-size", str(kv.host_cache_gb)]

    env: dict[str, str] = {
        # `/health` answers without running a generation, so it can serve as liveness;
        # readiness polls `/health_generate`, which does.
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    }
    if spec.disaggregated:
        t = spec.transfer
        argv += ["--disaggregation-mode", spec.role]
        argv += ["--disaggregation-transfer-backend", t.backend]
        if spec.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(t.bootstrap_port)]
        if t.ib_device is not None:
            argv += ["--disaggregation-ib-device", t.ib_device]
        # the address prefill ranks register with the bootstrap server, and decode
        # ranks advertise (sglang/srt/utils/network.py: get_local_ip_auto)
        env["SGLANG_HOST_IP"] = f"$({spec.pod_ip_env})"

    if spec.kv_events is not None:
        ev = spec.kv_events
        cfg: dict[str, str] = {"publisher": "zmq", "endpoint": ev.endpoint, "topic": ev.topic}
        if ev.replay_endpoint is not None:
            cfg["replay_endpoint"] = ev.replay_endpoint
        argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
    if spec.metrics:
        argv += ["--enable-metrics"]
    if spec.parsers.reasoning is not None:
        argv += ["--reasoning-parser", spec.parsers.reasoning]
    if spec.parsers.tool_call is not None:
        argv += ["--tool-call-parser", spec.parsers.tool_call]
    if spec.speculative is not None:
        sp = spec.speculative
        argv += ["--speculative-algorithm", SPECULATIVE_ALGORITHM[sp.method]]
        argv += ["--speculative-draft-model-path", sp.draft_model_path]
        argv += ["--speculative-dflash-block-size", str(sp.block_size)]
    return LaunchCommand(
        argv=tuple(argv),
        env=env,
        port=spec.port,
        ready_path="/health_generate",
        live_path="/health",
    )
