"""Beam's model facts that serving depends on, read from a checkpoint's `config.json`.

Only the fields that shape the KV cache are kept; they are never hard-coded elsewhere
(DESIGN.md §1). `fingerprint()` is what both sides of a P/D pair compare in the handshake.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beamserve.kv_transfer.errors import ModelConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class BeamModelConfig:
    """The KV-relevant part of a Beam checkpoint config.

    Invariants: `len(layer_types) == num_hidden_layers`; every entry is `full_attention` or
    `sliding_attention`; `num_attention_heads % num_key_value_heads == 0`.
    """

    num_hidden_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    model_type: str = "beam"

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def fingerprint(self) -> str:
        """SHA-256 over the fields that must agree for KV to be interchangeable (computed once
        per config: every plan checks it)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = self._fingerprint_now()
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def _fingerprint_now(self) -> str:
        doc = {
            "model_type": self.model_type,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
        }
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BeamModelConfig:
        """Build from a `config.json` mapping (transformers/sglang Beam field names)."""
        if not isinstance(raw, dict):
            raise ModelConfigError("config.json must hold a JSON object")
        model_type = raw.get("model_type", "beam")
        if model_type != "beam":
            raise ModelConfigError(
                f"model_type: expected 'beam', got {model_type!r}; point at a Beam checkpoint"
            )
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if name not in raw:
                raise ModelConfigError(f"{name}: missing from config.json; add it")
        layers = _positive_int(raw, "num_hidden_layers")
        n_heads = _positive_int(raw, "num_attention_heads")
        if "head_dim" in raw:
            head_dim = _positive_int(raw, "head_dim")
        elif "hidden_size" in raw:
            head_dim = _positive_int(raw, "hidden_size") // n_heads
        else:
            raise ModelConfigError("head_dim: missing from config.json (and no hidden_size)")
        layer_types = raw.get("layer_types")
        if layer_types is None:
            raise ModelConfigError(
                "layer_types: missing; Beam lists 'full_attention'/'sliding_attention' per layer"
            )
        if not isinstance(layer_types, list):
            raise ModelConfigError("layer_types: must be a list of strings")
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        return cls(
            num_hidden_layers=layers,
            layer_types=tuple(layer_types),
            sliding_window=_positive_int(raw, "sliding_window"),
            num_attention_heads=n_heads,
            num_key_value_heads=_positive_int(raw, "num_key_value_heads"),
            head_dim=head_dim,
            dtype=str(dtype),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> BeamModelConfig:
        """Read `<path>/config.json` (or `path` itself when it is the file)."""
        p = Path(path)
        cfg = p / "config.json" if p.is_dir() else p
        try:
            raw = json.loads(cfg.read_text())
        except FileNotFoundError as exc:
            raise ModelConfigError(f"config.json: not found at {cfg}") from exc
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"config.json: not valid JSON at {cfg}: {exc}") from exc
        return cls.from_dict(raw)


def beam_layer_types(num_layers: int, full_every: int = 6) -> tuple[str, ...]:
    """Beam's pattern: every `full_every`-th layer full attention, and the last layer full."""
    return tuple(
        FULL_ATTENTION if (i + 1) % full_every == 0 or i == num_layers - 1 else SLIDING_ATTENTION
        for i in range(num_layers)
    )


def beam_1_0() -> BeamModelConfig:
    """Beam 1.0's KV shape (DESIGN.md §1): 52 layers (9 full, 43 sliding), 8 KV heads."""
    return BeamModelConfig(
        num_hidden_layers=52,
        layer_types=beam_layer_types(52),
        sliding_window=512,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
    )


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{name}: must be a positive integer, got {value!r}")
    return value


def _validate(cfg: BeamModelConfig) -> None:
    for name in (
        "num_hidden_layers",
        "sliding_window",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        if getattr(cfg, name) <= 0:
            raise ModelConfigError(f"{name}: must be positive")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ModelConfigError(
            f"layer_types: has {len(cfg.layer_types)} entries but num_hidden_layers is "
            f"{cfg.num_hidden_layers}; give one type per layer"
        )
    bad = sorted({repr(t) for t in cfg.layer_types if t not in _LAYER_TYPES})
    if bad:
        raise ModelConfigError(
            f"layer_types: unknown [{', '.join(bad)}]; valid types are {list(_LAYER_TYPES)}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelConfigError(
            f"num_key_value_heads: {cfg.num_key_value_heads} does not divide "
            f"num_attention_heads {cfg.num_attention_heads}"
        )
    if cfg.dtype not in _DTYPE_BYTES:
        raise ModelConfigError(f"dtype: {cfg.dtype!r} unsupported; use one of {list(_DTYPE_BYTES)}")
