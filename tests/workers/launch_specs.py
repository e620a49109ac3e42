"""Launcher test specs: a typical P/D pair and a hypothesis strategy of valid specs."""

from __future__ import annotations

from typing import Any

from beamserve.workers.launch import PoolSpec
from hypothesis import strategies as st

MODEL = "/models/beam-1.0-nvfp4"
DRAFT = "/models/beam-1.0-dflash2"


def typical(engine: str, role: str, **over: Any) -> PoolSpec:
    """The pair docs/engines.md shows: NVFP4 Beam, TP 4, fp8 KV, NIXL, events, DFlash2."""
    doc: dict[str, Any] = {
        "engine": engine,
        "role": role,
        "model": {"path": MODEL, "format": "nvfp4"},
        "parallel": {"tp_size": 4, "ep_size": 4},
        "kv_cache": {"page_size": 64, "dtype": "fp8_e4m3"},
        "transfer": {"backend": "nixl"},
        "kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        "speculative": {"draft_model_path": DRAFT, "block_size": 8},
        "context_length": 262144,
        "chunked_prefill_size": 16384,
        "port": 8000,
    }
    if role == "prefill":
        doc["kv_cache"] = {**doc["kv_cache"], "host_cache_gb": 200}
    doc.update(over)
    return PoolSpec.parse(doc)


@st.composite
def spec_docs(draw: st.DrawFn, engine: str | None = None) -> dict[str, Any]:
    """Mappings that `PoolSpec.parse` accepts, over every option that changes the render.

    Combinations the engines themselves refuse are never drawn (the pure validation refuses
    them too: see test_launch_spec.py and the contract tests' negative cases).
    """
    eng = engine or draw(st.sampled_from(["sglang", "vllm"]))
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    dpa = draw(st.sampled_from([d for d in (1, 2, 4, 8) if tp % d == 0]))
    eps = [1, tp] if eng == "vllm" else [d for d in (1, 2, 4, 8, 16) if tp % d == 0]
    page = draw(st.sampled_from([16, 32, 64]))
    role = draw(st.sampled_from(["prefill", "decode", "both"]))
    prefix_caching = draw(st.booleans())
    hosts = [0, 1, 64] if eng == "vllm" or (role != "decode" and prefix_caching) else [0]
    backend = draw(st.sampled_from(["nixl", "mooncake"]))
    doc: dict[str, Any] = {
        "engine": eng,
        "role": role,
        "model": {
            "path": draw(st.sampled_from([MODEL, "/m/beam", "/mnt/ckpt/beam 1.0"])),
            "format": draw(st.sampled_from(["bf16", "fp8", "nvfp4"])),
        },
        "parallel": {
            "tp_size": tp,
            "dp_attention": dpa,
            "ep_size": draw(st.sampled_from(eps)),
            "nodes": draw(st.sampled_from([n for n in (1, 1, 2, 4) if tp % n == 0])),
        },
        "kv_cache": {
            "page_size": page,
            "dtype": draw(st.sampled_from(["bf16", "fp8_e4m3"])),
            "host_cache_gb": draw(st.sampled_from(hosts)),
            "prefix_caching": prefix_caching,
        },
        "transfer": {
            "backend": backend,
            "bootstrap_port": draw(st.sampled_from([8998, 9100])),
            "side_channel_port": draw(st.sampled_from([5600, 5700])),
            "on_load_failure": draw(st.sampled_from(["recompute", "fail"])),
        },
        "metrics": draw(st.booleans()),
        "parsers": {
            "reasoning": draw(st.sampled_from(["beam", None])),
            "tool_call": draw(st.sampled_from(["beam", None])),
        },
        "pod_ip_env": draw(st.sampled_from(["POD_IP", "MY_POD_IP"])),
        "port": draw(st.sampled_from([8000, 30000])),
        "dist_init_port": draw(st.sampled_from([39746, 29500])),
        "cache_report": draw(st.booleans()),
    }
    if eng == "sglang" and draw(st.booleans()):
        doc["transfer"]["ib_device"] = "mlx5_0,mlx5_1"
    if draw(st.booleans()):
        doc["kv_events"] = {
            "endpoint": "tcp://*:5557",
            "topic": draw(st.sampled_from(["kv-events", ""])),
            "replay_endpoint": draw(st.sampled_from([None, "tcp://*:5558"])),
        }
    draft_backends = ["trtllm_mha", "fa3"] if eng == "sglang" else ["FLASHINFER", "FLASH_ATTN"]
    speculative = draw(st.booleans())
    if speculative:
        doc["speculative"] = {
            "draft_model_path": DRAFT,
            "block_size": draw(st.sampled_from([2, 8, 16])),
            "draft_attention_backend": draw(st.sampled_from([None, *draft_backends])),
        }
        if eng == "sglang" and draw(st.booleans()):
            doc["speculative"]["simulate_acceptance_length"] = draw(st.sampled_from([4, 2.5]))
    hardware = draw(st.sampled_from(["gpu", "backend", "none"]))
    if hardware == "gpu":
        doc["gpu"] = draw(st.sampled_from(["gb300", "b200", "h200", "h100"]))
    elif hardware == "backend":
        doc["attention_backend"] = draw(st.sampled_from(draft_backends))
    if draw(st.booleans()):
        doc["mem_fraction_static"] = draw(st.sampled_from([0.8, 0.85, 0.9]))
    unified_ok = eng == "sglang" and (role == "both" or (backend == "mooncake" and not speculative))
    if unified_ok and draw(st.booleans()):
        doc["unified_memory"] = True
    if draw(st.booleans()):
        doc["max_running_requests"] = draw(st.sampled_from([16, 64, 256]))
    if draw(st.booleans()):
        doc["cuda_graph_max_bs"] = draw(st.sampled_from([16, 64]))
    if eng == "sglang" and draw(st.booleans()):
        doc["prefill_decode_interval"] = draw(st.sampled_from([0, 4]))
    if draw(st.booleans()):
        doc["tokenizer_worker_num"] = 1 if eng == "vllm" else draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        doc["context_length"] = draw(st.sampled_from([8192, 131072, 1048576]))
    if draw(st.booleans()):
        chunk = page * draw(st.sampled_from([32, 128, 256]))
        if eng == "vllm":
            chunk = max(chunk, doc.get("max_running_requests", 0))
        doc["chunked_prefill_size"] = chunk
    if draw(st.booleans()):
        doc["env"] = {"VLLM_LOGGING_LEVEL": "WARNING"} if eng == "vllm" else {"SGLANG_LOG_MS": "1"}
    return doc


# The seeds' production command (SGLang, 4×GB300, NVFP4, TP4), `…` and `CC` filled in:
# what `render_sglang_production` must give flag for flag.
PRODUCTION_ARGV = [
    "--model-path",
    "/models/beam-1.0-nvfp4",
    "--served-model-name",
    "beam",
    "--quantization",
    "modelopt_fp4",
    "--tp-size",
    "4",
    "--ep-size",
    "1",
    "--attn-dp-size",
    "1",
    "--nnodes",
    "1",
    "--node-rank",
    "0",
    "--dist-init-addr",
    "127.0.0.1:39746",
    "--attention-backend",
    "trtllm_mha",
    "--page-size",
    "64",
    "--mem-fraction-static",
    "0.80",
    "--enable-unified-memory",
    "--reasoning-parser",
    "beam",
    "--tool-call-parser",
    "beam",
    "--speculative-algorithm",
    "DFLASH",
    "--speculative-draft-model-path",
    "/models/beam-1.0-dflash2",
    "--speculative-draft-attention-backend",
    "trtllm_mha",
    "--speculative-num-draft-tokens",
    "8",
    "--enable-hierarchical-cache",
    "--hicache-size",
    "88",
    "--max-running-requests",
    "32",
    "--cuda-graph-max-bs-decode",
    "32",
    "--context-length",
    "1048576",
    "--chunked-prefill-size",
    "16384",
    "--prefill-decode-interval",
    "0",
    "--enable-cache-report",
    "--enable-metrics",
    "--tokenizer-worker-num",
    "1",
]
