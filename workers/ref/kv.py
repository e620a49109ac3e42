"""One request's KV cache as plain arrays: what the ref engine lays out in pages and reads back.

Values are the model's bfloat16 bits stored as `uint16` (numpy has no bfloat16), so a round
trip through the pools moves the model's own bytes and nothing is ever rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BF16Bits = npt.NDArray[np.uint16]


@dataclass(frozen=True)
class LayerKV:
    """Keys and values of one layer for tokens `[start, start + tokens)`.

    Shapes `[kv_heads, tokens, head_dim]`. Full-attention layers start at 0; sliding layers
    start at or before `max(0, seq_len − sliding_window)` (they may hold more than the window).
    """

    start: int
    keys: BF16Bits
    values: BF16Bits

    @property
    def stop(self) -> int:
        return self.start + int(self.keys.shape[1])


@dataclass(frozen=True)
class RequestKV:
    """A request's KV after `seq_len` tokens, one `LayerKV` per layer (all ending at seq_len)."""

    seq_len: int
    layers: tuple[LayerKV, ...]

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            if layer.stop != self.seq_len or layer.keys.shape != layer.values.shape:
                raise ValueError(
                    f"layer {i}: holds tokens [{layer.start}, {layer.stop}) with keys "
                    f"{layer.keys.shape} / values {layer.values.shape}; every layer must end at "
                    f"seq_len {self.seq_len} with equal K and V shapes"
                )

    @property
    def nbytes(self) -> int:
        return sum(2 * layer.keys.nbytes for layer in self.layers)

    def equals(self, other: RequestKV, tokens_from: dict[int, int] | None = None) -> bool:
        """Bitwise equality over the tokens both hold (per layer, from `tokens_from[layer]`
        when given), e.g. a decode side's window against the prefill side's wider view."""
        if self.seq_len != other.seq_len or len(self.layers) != len(other.layers):
            return False
        for i, (a, b) in enumerate(zip(self.layers, other.layers, strict=True)):
            lo = max(a.start, b.start, (tokens_from or {}).get(i, 0))
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                if not np.array_equal(x[:, lo - a.start :], y[:, lo - b.start :]):
                    return False
        return True
