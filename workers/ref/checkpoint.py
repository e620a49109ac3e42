"""`beamserve model make-tiny`: a real, tiny Beam checkpoint directory made on this machine.

The directory is what a Beam checkpoint on a model hub holds, at toy size:

    config.json              model_type beam, BeamForCausalLM, Beam's layer-type pattern
    model.safetensors        seeded weights (bf16; the MoE router loads in fp32, as Beam's does)
    generation_config.json
    tokenizer.json           a byte-level BPE trained here with `tokenizers` on `corpus.CORPUS`
    tokenizer_config.json    special tokens and a ChatML-like chat template (Jinja)

It loads through the code path a real checkpoint uses: `AutoConfig` / `BeamForCausalLM`
/ `AutoTokenizer.from_pretrained(DIR)` and `BeamModelConfig.from_checkpoint(DIR)`.
Everything is deterministic in `seed`: the same seed writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from beamserve.kv_transfer.model import beam_layer_types
from beamserve.workers.ref.corpus import CORPUS

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"

# ChatML (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then the assistant's
# opening when `add_generation_prompt`); tools are listed in a system turn, an assistant's tool
# calls follow its text as `<tool_call>{function json}</tool_call>`, list content keeps its text.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyBeamSpec:
    """The tiny model's shape. Beam's ratios, toy sizes.

    Beam 1.0: 52 layers (every 6th and the last full attention), 48/8 heads (GQA 6),
    head_dim 128, window 512, 3 dense MLP layers then MoE (256 experts, top 8, 8 groups,
    top 4 groups). Here: 7 layers (layers 5 and 6 full, so both KV lifetimes exist), 24/4 heads
    (GQA 6; 4 KV heads shard over TP 1, 2 and 4), head_dim 16, window 32, 3 dense then MoE with
    8 experts (top 2, 2 groups, top 1 group).
    """

    num_hidden_layers: int = 7
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 24
    num_key_value_heads: int = 4
    head_dim: int = 16
    sliding_window: int = 32
    moe_intermediate_size: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    max_position_embeddings: int = 4096
    vocab_size: int = 512  # the BPE's target size; the config gets the trained size
    initializer_range: float = 0.02


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on the embedded corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _tokenizer_config(tok: Any) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TinyBeamSpec.max_position_embeddings,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def _seeded_weights(model: Any, seed: int, std: float) -> None:
    """Fill every parameter from a generator keyed by (seed, parameter name), so the weights
    do not depend on transformers' init order: norms 1, gate biases 0, the rest N(0, std)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("gate_bias", "e_score_correction_bias")):
                param.zero_()
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float32) * std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()


def make_tiny(directory: str | Path, seed: int = 0, spec: TinyBeamSpec | None = None) -> Path:
    """Write a tiny Beam checkpoint into `directory` (created if missing); return its path."""
    import torch
    from beamserve.workers.ref.engine import quiet_transformers
    from transformers import BeamConfig, BeamForCausalLM, GenerationConfig

    quiet_transformers()
    spec = spec or TinyBeamSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(spec.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2))
    special = {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}

    fields = asdict(spec)
    fields["vocab_size"] = int(tok.get_vocab_size())
    config = BeamConfig(
        **fields,
        layer_types=list(beam_layer_types(spec.num_hidden_layers)),
        mlp_layer_types=["dense"] * min(3, spec.num_hidden_layers)
        + ["sparse"] * max(0, spec.num_hidden_layers - 3),
        eos_token_id=special[EOS_TOKEN],
        pad_token_id=special[PAD_TOKEN],
        bos_token_id=None,
        tie_word_embeddings=False,
        architectures=["BeamForCausalLM"],
    )
    torch.manual_seed(seed)
    model = BeamForCausalLM(config)
    _seeded_weights(model, seed, spec.initializer_range)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[special[EOS_TOKEN], special[PAD_TOKEN]],
        pad_token_id=special[PAD_TOKEN],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


def checkpoint_digest(directory: str | Path) -> str:
    """SHA-256 over the checkpoint's weights and tokenizer (what must match on both pools)."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        h.update((Path(directory) / name).read_bytes())
    return h.hexdigest()
