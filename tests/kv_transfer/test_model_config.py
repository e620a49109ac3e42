"""BeamModelConfig: reading Beam checkpoint configs, every error path, and the fingerprint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from beamserve.kv_transfer.errors import KVTransferError, ModelConfigError
from beamserve.kv_transfer.model import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    BeamModelConfig,
    beam_1_0,
    beam_layer_types,
)

_DROP = object()  # marks a field to leave out of the mapping


def beam_dict(**over: Any) -> dict[str, Any]:
    """A Beam 1.0-shaped `config.json` mapping (only a few of the many real fields)."""
    raw: dict[str, Any] = {
        "model_type": "beam",
        "architectures": ["BeamForCausalLM"],
        "num_hidden_layers": 52,
        "layer_types": list(beam_layer_types(52)),
        "sliding_window": 512,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 6144,
        "max_position_embeddings": 1_048_576,
        "torch_dtype": "bfloat16",
    }
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not _DROP}


# --- the layer pattern ---------------------------------------------------------------------


def test_beam_layer_pattern_52() -> None:
    types = beam_layer_types(52)
    full = [i for i, t in enumerate(types) if t == FULL_ATTENTION]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    assert len(full) == 9
    assert types.count(SLIDING_ATTENTION) == 43
    assert types[-1] == FULL_ATTENTION


@pytest.mark.parametrize("n", [1, 2, 5, 6, 7, 12, 13])
def test_beam_layer_pattern_last_is_full(n: int) -> None:
    types = beam_layer_types(n)
    assert len(types) == n
    assert types[-1] == FULL_ATTENTION
    for i, t in enumerate(types[:-1]):
        assert (t == FULL_ATTENTION) == ((i + 1) % 6 == 0)


def test_beam_layer_pattern_full_every() -> None:
    assert beam_layer_types(7, full_every=3) == (
        SLIDING_ATTENTION,
        SLIDING_ATTENTION,
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        SLIDING_ATTENTION,
        FULL_ATTENTION,
        FULL_ATTENTION,
    )


def test_beam_1_0_facts() -> None:
    m = beam_1_0()
    assert m.num_hidden_layers == 52
    assert len(m.full_layers) == 9 and len(m.sliding_layers) == 43
    assert set(m.full_layers) | set(m.sliding_layers) == set(range(52))
    assert m.sliding_window == 512
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (48, 8, 128)
    assert m.dtype == "bfloat16" and m.dtype_bytes == 2
    assert m.model_type == "beam"


# --- from_dict -----------------------------------------------------------------------------


def test_from_dict_beam_1_0() -> None:
    m = BeamModelConfig.from_dict(beam_dict())
    assert m == beam_1_0()
    assert m.full_layers == beam_1_0().full_layers
    assert len(m.full_layers) == 9 and len(m.sliding_layers) == 43


def test_from_dict_model_type_defaults_to_beam() -> None:
    assert BeamModelConfig.from_dict(beam_dict(model_type=_DROP)) == beam_1_0()


def test_from_dict_head_dim_falls_back_to_hidden_size() -> None:
    m = BeamModelConfig.from_dict(beam_dict(head_dim=_DROP, hidden_size=48 * 128))
    assert m.head_dim == 128
    m = BeamModelConfig.from_dict(beam_dict(head_dim=_DROP, hidden_size=48 * 64))
    assert m.head_dim == 64


def test_from_dict_explicit_head_dim_wins_over_hidden_size() -> None:
    # Beam's head_dim is not hidden_size / heads in general: the explicit field wins.
    m = BeamModelConfig.from_dict(beam_dict(head_dim=128, hidden_size=4096))
    assert m.head_dim == 128


@pytest.mark.parametrize(
    ("over", "want"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": _DROP, "dtype": "float32"}, "float32"),
        ({"torch_dtype": "float16", "dtype": "bfloat16"}, "bfloat16"),  # new name wins
        ({"torch_dtype": _DROP}, "bfloat16"),  # default
        ({"torch_dtype": None, "dtype": None}, "bfloat16"),
    ],
)
def test_from_dict_dtype_and_torch_dtype(over: dict[str, Any], want: str) -> None:
    m = BeamModelConfig.from_dict(beam_dict(**over))
    assert m.dtype == want
    assert m.dtype_bytes == {"bfloat16": 2, "float16": 2, "float32": 4}[want]


def test_from_dict_ignores_unrelated_fields() -> None:
    m = BeamModelConfig.from_dict(beam_dict(rope_theta=1e6, mlp_layer_types=["dense"] * 52))
    assert m == beam_1_0()


def _raises(raw: Any, field: str) -> ModelConfigError:
    with pytest.raises(ModelConfigError) as info:
        BeamModelConfig.from_dict(raw)
    assert field in str(info.value), f"{field!r} not named in: {info.value}"
    assert isinstance(info.value, KVTransferError) and isinstance(info.value, ValueError)
    return info.value


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_hidden_layers": _DROP}, "num_hidden_layers"),
        ({"num_attention_heads": _DROP}, "num_attention_heads"),
        ({"num_key_value_heads": _DROP}, "num_key_value_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": -52}, "num_hidden_layers"),
        ({"num_hidden_layers": 52.0}, "num_hidden_layers"),
        ({"num_hidden_layers": "52"}, "num_hidden_layers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": 51}, "layer_types"),  # 52 types for 51 layers
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_attention_heads": 12}, "num_key_value_heads"),  # 8 does not divide 12
        ({"num_attention_heads": 4}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": -8}, "num_key_value_heads"),
        ({"num_key_value_heads": 8.5}, "num_key_value_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"head_dim": "128"}, "head_dim"),
        ({"head_dim": _DROP, "hidden_size": _DROP}, "head_dim"),
        ({"head_dim": _DROP, "hidden_size": 0}, "hidden_size"),
        ({"head_dim": _DROP, "hidden_size": 47}, "head_dim"),  # 47 // 48 == 0
        ({"sliding_window": _DROP}, "sliding_window"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": None}, "sliding_window"),
        ({"sliding_window": False}, "sliding_window"),
        ({"layer_types": _DROP}, "layer_types"),
        ({"layer_types": None}, "layer_types"),
        ({"layer_types": "full_attention"}, "layer_types"),
        ({"layer_types": list(beam_layer_types(51))}, "layer_types"),
        ({"layer_types": [*beam_layer_types(51), "linear_attention"]}, "layer_types"),
        ({"layer_types": [*beam_layer_types(50), 7, "chunked"]}, "layer_types"),
        ({"layer_types": [*beam_layer_types(51), ["full_attention"]]}, "layer_types"),
        ({"torch_dtype": "float8_e4m3fn"}, "dtype"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_from_dict_errors_name_the_field(over: dict[str, Any], field: str) -> None:
    _raises(beam_dict(**over), field)


def test_from_dict_unknown_layer_type_lists_the_valid_ones() -> None:
    exc = _raises(beam_dict(layer_types=[*beam_layer_types(51), "linear_attention"]), "layer_types")
    assert "linear_attention" in str(exc)
    assert FULL_ATTENTION in str(exc) and SLIDING_ATTENTION in str(exc)


@pytest.mark.parametrize("raw", [[], "beam", None, 52])
def test_from_dict_rejects_non_objects(raw: Any) -> None:
    _raises(raw, "config.json")


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"num_hidden_layers": 0, "layer_types": ()}, "num_hidden_layers"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"head_dim": -1}, "head_dim"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_attention_heads": 10}, "num_key_value_heads"),
        ({"layer_types": beam_layer_types(51)}, "layer_types"),
        ({"dtype": "fp8"}, "dtype"),
    ],
)
def test_direct_construction_validates(over: dict[str, Any], field: str) -> None:
    kw: dict[str, Any] = {
        "num_hidden_layers": 52,
        "layer_types": beam_layer_types(52),
        "sliding_window": 512,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
    }
    kw.update(over)
    with pytest.raises(ModelConfigError, match=field):
        BeamModelConfig(**kw)


# --- from_checkpoint -----------------------------------------------------------------------


def test_from_checkpoint_directory_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(beam_dict()))
    assert BeamModelConfig.from_checkpoint(tmp_path) == beam_1_0()
    assert BeamModelConfig.from_checkpoint(str(tmp_path)) == beam_1_0()
    assert BeamModelConfig.from_checkpoint(tmp_path / "config.json") == beam_1_0()


def test_from_checkpoint_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json") as info:
        BeamModelConfig.from_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        BeamModelConfig.from_checkpoint(tmp_path / "nope" / "config.json")


@pytest.mark.parametrize("text", ["", "{", '{"model_type": "beam",}', "not json"])
def test_from_checkpoint_bad_json(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelConfigError, match=r"config\.json") as info:
        BeamModelConfig.from_checkpoint(tmp_path)
    assert "JSON" in str(info.value)


def test_from_checkpoint_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        BeamModelConfig.from_checkpoint(tmp_path)


def test_from_checkpoint_invalid_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(beam_dict(sliding_window=-1)))
    with pytest.raises(ModelConfigError, match="sliding_window"):
        BeamModelConfig.from_checkpoint(tmp_path)


# --- fingerprint ---------------------------------------------------------------------------


def test_fingerprint_equal_for_equal_configs() -> None:
    a = BeamModelConfig.from_dict(beam_dict())
    b = beam_1_0()
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 64 and int(a.fingerprint(), 16) >= 0
    # stable across calls, and independent of the on-disk dtype and unrelated fields
    assert a.fingerprint() == a.fingerprint()
    c = BeamModelConfig.from_dict(beam_dict(torch_dtype="float16", rope_theta=1.0))
    assert c.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "over",
    [
        {"sliding_window": 1024},
        {"sliding_window": 511},
        {"layer_types": list(beam_layer_types(52, full_every=4))},
        {"layer_types": [SLIDING_ATTENTION] * 51 + [FULL_ATTENTION]},
        {"num_attention_heads": 64},
        {"num_key_value_heads": 16},
        {"num_key_value_heads": 4},
        {"head_dim": 64},
        {"num_hidden_layers": 53, "layer_types": list(beam_layer_types(53))},
    ],
)
def test_fingerprint_differs(over: dict[str, Any]) -> None:
    base = beam_1_0().fingerprint()
    assert BeamModelConfig.from_dict(beam_dict(**over)).fingerprint() != base
