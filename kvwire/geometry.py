"""`KVGeometry`: how one worker cuts, hashes and reports its KV cache, as one immutable value.

Every consumer of a worker's KV blocks needs the same four facts, and they must agree: the
router's prompt hasher (which tokens make a block, which hash chain), its prefix index (how many
blocks cover the window tail of a hit), its policies and its disaggregation decider (how many
tokens a hit of ``k`` blocks saves), and the KV-event subscriber (which wire format to decode)::

    KVGeometry(block_size=64, sliding_window=512, hash_scheme="vllm", event_format="vllm")

- `block_size`: tokens per KV block (vLLM's block size, SGLang's page size). Reported as
  SGLang's ``/server_info`` `page_size`, or `block_size` in a beamserve worker's ``/v1/models``
  entry.
- `sliding_window`: tokens a sliding-window layer keeps (0: no sliding layers; config.json
  `sliding_window`). Reported as `sliding_window` (either answer) or as the
  `kv_cache_spec_sliding_window` of the worker's `BlockStored` events.
- `hash_scheme`: the block-hash chain, ``vllm`` (chained sha256) or ``sglang`` (page sha256);
  `kv_hash_scheme` in the answers, else ``sglang`` on SGLang's surface.
- `event_format`: the KV-event wire format, ``vllm`` or ``sglang``; `kv_event_format`, else as
  `hash_scheme`.

A worker's own report wins over the router's flags (`--block-size`, `--sliding-window`,
`--hash-scheme`), which are only the default for workers that report nothing. Values are
interned (`KVGeometry.of`): equal geometries are one object, so the router's hot path can compare
them by identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeAlias

__all__ = [
    "DEFAULT_GEOMETRY",
    "HASH_SCHEMES",
    "HashScheme",
    "KVGeometry",
    "KVGeometryError",
    "window_of_config",
]

HashScheme: TypeAlias = Literal["vllm", "sglang"]
HASH_SCHEMES: tuple[HashScheme, ...] = ("vllm", "sglang")
DEFAULT_BLOCK_SIZE = 64
DEFAULT_SLIDING_WINDOW = 512  # Beam 1.0's config.json


class KVGeometryError(ValueError):
    """A geometry field out of range; the message names the field and the fix."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """One worker's KV-cache geometry (table in the module docstring). Validated on creation:
    `block_size` > 0, `sliding_window` ≥ 0, `hash_scheme` and `event_format` in
    `HASH_SCHEMES`; anything else raises `KVGeometryError`."""

    block_size: int = DEFAULT_BLOCK_SIZE
    sliding_window: int = DEFAULT_SLIDING_WINDOW
    hash_scheme: HashScheme = "vllm"
    event_format: HashScheme = "vllm"

    def __post_init__(self) -> None:
        bs, w = self.block_size, self.sliding_window
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise KVGeometryError(
                f"block_size must be a positive number of tokens, got {bs!r}; use the engine's "
                "block size (vLLM --block-size, SGLang --page-size; Beam: 64)"
            )
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise KVGeometryError(
                f"sliding_window must be ≥ 0 tokens, got {w!r}; use config.json's "
                "sliding_window (Beam 1.0: 512), 0 for a model without sliding layers"
            )
        for name in ("hash_scheme", "event_format"):
            value = getattr(self, name)
            if value not in HASH_SCHEMES:
                raise KVGeometryError(
                    f"{name} must be one of {', '.join(HASH_SCHEMES)}, got {value!r}; "
                    "'sglang' for SGLang workers, 'vllm' for vLLM, sim and ref workers"
                )

    @classmethod
    def of(
        cls,
        block_size: int = DEFAULT_BLOCK_SIZE,
        sliding_window: int = DEFAULT_SLIDING_WINDOW,
        hash_scheme: str = "vllm",
        event_format: str | None = None,
    ) -> KVGeometry:
        """The interned geometry (`event_format` defaults to `hash_scheme`): equal values give
        the same object."""
        g = cls(block_size, sliding_window, hash_scheme, event_format or hash_scheme)  # type: ignore[arg-type]
        return _INTERNED.setdefault(g, g)

    def interned(self) -> KVGeometry:
        return _INTERNED.setdefault(self, self)

    def with_(self, **changes: Any) -> KVGeometry:
        """This geometry with some fields changed (validated, interned)."""
        return replace(self, **changes).interned() if changes else self

    def differs(self, other: KVGeometry) -> dict[str, tuple[Any, Any]]:
        """The fields that differ: name → (this value, other's value)."""
        return {
            f: (getattr(self, f), getattr(other, f))
            for f in ("block_size", "sliding_window", "hash_scheme", "event_format")
            if getattr(self, f) != getattr(other, f)
        }

    def __str__(self) -> str:
        return (
            f"block {self.block_size}, window {self.sliding_window}, hash {self.hash_scheme}, "
            f"events {self.event_format}"
        )


_INTERNED: dict[KVGeometry, KVGeometry] = {}
DEFAULT_GEOMETRY = KVGeometry().interned()


def window_of_config(model_dir: str | Path | None) -> int | None:
    """`sliding_window` of a checkpoint's config.json (None: no directory, no config.json, or
    no positive window in it). A config whose `layer_types` has no sliding layer gives 0."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    layers = cfg.get("layer_types")
    if isinstance(layers, list) and layers and "sliding_attention" not in layers:
        return 0
    window = cfg.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return window
    return None
