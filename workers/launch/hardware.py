"""Attention backends per GPU generation, and the backend names each engine accepts.

| generation | GPUs | SGLang 0.5.23 | vLLM 0.33.0 |
|---|---|---|---|
| Blackwell | GB300, GB200, B300, B200 | `trtllm_mha` | `FLASHINFER` |
| Hopper | H200, H100 | `fa3` | `FLASH_ATTN` |

The names are the engines' own: SGLang's `--attention-backend` choices
(`sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES`) and vLLM's `AttentionBackendEnum`
members; `tests/workers/test_launch_contract.py` checks every name below against them.
"""

from __future__ import annotations

from typing import Literal

Generation = Literal["blackwell", "hopper"]

GENERATION: dict[str, Generation] = {
    "gb300": "blackwell",
    "gb200": "blackwell",
    "b300": "blackwell",
    "b200": "blackwell",
    "h200": "hopper",
    "h100": "hopper",
}

ATTENTION_BACKENDS: dict[tuple[str, Generation], str] = {
    ("sglang", "blackwell"): "trtllm_mha",
    ("sglang", "hopper"): "fa3",
    ("vllm", "blackwell"): "FLASHINFER",
    ("vllm", "hopper"): "FLASH_ATTN",
}

# Backends a pool spec may name: the engines' MHA backends that serve Beam's GQA attention on
# NVIDIA GPUs (MLA-only, AMD, NPU and CPU backends are left out on purpose).
SGLANG_ATTENTION_BACKENDS = ("trtllm_mha", "fa3", "fa4", "flashinfer", "triton", "flex_attention")
VLLM_ATTENTION_BACKENDS = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
# SGLang's DFLASH draft runs only on these (`DRAFT_ATTENTION_BACKEND_CHOICES`); any other name
# is silently replaced with a fallback (speculative_hook._resolve_dflash_draft_attention_backend).
SGLANG_DRAFT_ATTENTION_BACKENDS = ("trtllm_mha", "fa3", "fa4", "flashinfer", "triton")


def attention_backend_for(engine: str, gpu: str) -> str:
    """The table's attention backend for `engine` on `gpu` (a key of `GENERATION`)."""
    return ATTENTION_BACKENDS[(engine, GENERATION[gpu])]


def allowed_attention_backends(engine: str) -> tuple[str, ...]:
    return SGLANG_ATTENTION_BACKENDS if engine == "sglang" else VLLM_ATTENTION_BACKENDS
