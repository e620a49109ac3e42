"""The small Beam geometry of the transfer tests: 6 layers, every third full attention."""

from __future__ import annotations

from beamserve.kv_transfer.model import BeamModelConfig, beam_layer_types


def beam_small(head_dim: int = 4, window: int = 48, kv_heads: int = 8) -> BeamModelConfig:
    return BeamModelConfig(
        num_hidden_layers=6,
        layer_types=beam_layer_types(6, full_every=3),
        sliding_window=window,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
