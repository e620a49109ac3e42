"""`make_tiny` writes a real checkpoint that loads the way a real Beam checkpoint does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from beamserve.kv_transfer.model import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    BeamModelConfig,
    beam_layer_types,
)
from beamserve.workers.ref.checkpoint import checkpoint_digest, make_tiny
from beamserve.workers.ref.corpus import USER_TURNS
from beamserve.workers.ref.engine import chat_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def test_directory_holds_a_checkpoint(tiny: Path) -> None:
    names = {p.name for p in tiny.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["model_type"] == "beam"
    assert raw["architectures"] == ["BeamForCausalLM"]
    assert raw["dtype"] == "bfloat16"


def test_config_has_beams_shape(tiny: Path) -> None:
    m = BeamModelConfig.from_checkpoint(tiny)
    assert m.num_hidden_layers >= 7
    assert m.layer_types == beam_layer_types(m.num_hidden_layers)
    assert m.layer_types[5] == m.layer_types[-1] == FULL_ATTENTION
    assert m.layer_types[0] == SLIDING_ATTENTION
    assert m.num_attention_heads // m.num_key_value_heads == 6  # Beam's GQA ratio (48/8)
    assert (m.num_key_value_heads, m.head_dim, m.sliding_window) == (4, 16, 32)
    assert m.dtype == "bfloat16"


def test_loads_through_transformers(tiny: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BeamForCausalLM

    cfg = AutoConfig.from_pretrained(tiny)
    assert type(cfg).__name__ == "BeamConfig"
    assert cfg.mlp_layer_types == ["dense"] * 3 + ["sparse"] * (cfg.num_hidden_layers - 3)
    assert cfg.num_experts > 1 and cfg.num_experts_per_tok < cfg.num_experts
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert isinstance(model, BeamForCausalLM)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.shape[0] == cfg.vocab_size


def test_same_seed_same_bytes_other_seed_other_weights(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny(tmp_path / "again", seed=0)
    other = make_tiny(tmp_path / "other", seed=1)
    assert checkpoint_digest(again) == checkpoint_digest(tiny)
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_tokenizer_round_trips(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"]
    for text in (
        "def prefill(self, token_ids: list[int]) -> KVCache:\n    return cache",
        "kubectl get pods -n beam  # ünïcödé and emoji 🚀",
        "<|im_start|>user\nhi<|im_end|>\n",
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    special = tok("<|im_start|><|im_end|>", add_special_tokens=False)["input_ids"]
    assert special == [tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id]


def test_chat_template_renders_chatml(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": USER_TURNS[0]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{USER_TURNS[0]}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = chat_prompt(tok, messages)
    assert tok.decode(ids) == text
    assert 20 < len(ids) < 200
