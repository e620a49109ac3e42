"""`check_pair_compat`: a prefill and a decode pool must agree before either is launched."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.workers.launch import PairCompatError, PoolSpec, check_pair_compat
from hypothesis import given, settings
from hypothesis import strategies as st

BEAM = beam_1_0()
FP = BEAM.fingerprint()


def pool(role: str, engine: str = "sglang", **over: Any) -> PoolSpec:
    doc: dict[str, Any] = {
        "engine": engine,
        "role": role,
        "model": {"path": "/models/beam", "format": "nvfp4"},
        "parallel": {"tp_size": 4},
        "kv_cache": {"page_size": 64, "dtype": "fp8_e4m3"},
        "transfer": {"backend": "nixl"},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**copy.deepcopy(doc[key]), **value}
        else:
            doc[key] = value
    return PoolSpec.parse(doc)


def refused(p: PoolSpec, d: PoolSpec, model: BeamModelConfig | None = None) -> str:
    with pytest.raises(PairCompatError) as info:
        check_pair_compat(p, d, model)
    return str(info.value)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 4), (8, 2), (2, 8), (1, 4), (16, 8), (8, 16)])
def test_dividing_tp_pairs_pass_in_both_directions(engine: str, p_tp: int, d_tp: int) -> None:
    p = pool("prefill", engine, parallel={"tp_size": p_tp})
    d = pool("decode", engine, parallel={"tp_size": d_tp})
    check_pair_compat(p, d)
    check_pair_compat(p, d, BEAM)


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        (
            {"kv_cache": {"page_size": 32}},
            "kv_cache.page_size: prefill uses 64, decode uses 32; set both",
        ),
        (
            {"kv_cache": {"dtype": "bf16"}},
            "kv_cache.dtype: prefill uses fp8_e4m3, decode uses bf16",
        ),
        (
            {"transfer": {"backend": "mooncake"}},
            "transfer.backend: prefill uses nixl, decode uses mooncake",
        ),
        ({"engine": "vllm"}, "engine: prefill runs sglang, decode runs vllm"),
        ({"model": {"path": "/models/other"}}, "model.path: prefill serves '/models/beam', decode"),
        ({"model": {"format": "fp8"}}, "model.format: prefill loads nvfp4, decode loads fp8"),
        ({"parallel": {"tp_size": 3}}, "prefill attention TP 4 and decode attention TP 3 do not"),
    ],
)
def test_each_disagreement_is_named_with_its_fix(over: dict[str, Any], needle: str) -> None:
    msg = refused(pool("prefill"), pool("decode", **over))
    assert needle in msg, msg


def test_tp_refusal_lists_valid_choices() -> None:
    msg = refused(pool("prefill", parallel={"tp_size": 8}), pool("decode", parallel={"tp_size": 3}))
    assert "choose decode attention TP from [1, 2, 4, 8, 16, 32, 64]" in msg
    assert "(or prefill from [1, 3, 6, 12, 24, 48])" in msg


def test_attention_tp_is_what_must_divide_not_the_gpu_count() -> None:
    # 8 GPUs as 2 attention groups of TP 4 hand KV to TP 4 like a plain TP-4 pool does
    p = pool("prefill", parallel={"tp_size": 8, "dp_attention": 2})
    check_pair_compat(p, pool("decode"), BEAM)
    # 6 GPUs as 2 groups of TP 3 do not divide TP 4
    p = pool("prefill", parallel={"tp_size": 6, "dp_attention": 2})
    assert "prefill attention TP 3 and decode attention TP 4" in refused(p, pool("decode"))


def test_roles_must_be_prefill_then_decode() -> None:
    msg = refused(pool("decode"), pool("prefill"))
    assert "prefill.role: is 'decode'; pass the prefill pool first" in msg
    assert "decode.role: is 'prefill'; pass the decode pool second" in msg
    assert "prefill.role: is 'both'" in refused(pool("both"), pool("decode"))


def test_all_problems_are_reported_together() -> None:
    d = pool(
        "decode", kv_cache={"page_size": 16, "dtype": "bf16"}, transfer={"backend": "mooncake"}
    )
    msg = refused(pool("prefill"), d)
    for field in ("kv_cache.page_size", "kv_cache.dtype", "transfer.backend"):
        assert field in msg


def test_fingerprints_decide_over_paths() -> None:
    p = pool("prefill", model={"path": "/mnt/a/beam", "fingerprint": FP})
    d = pool("decode", model={"path": "/mnt/b/beam", "fingerprint": FP[:16]})
    check_pair_compat(p, d, BEAM)  # different mounts, same checkpoint
    other = "0" * 64
    msg = refused(p, pool("decode", model={"path": "/mnt/a/beam", "fingerprint": other}))
    assert f"model.fingerprint: prefill serves {FP[:12]}, decode serves 000000000000" in msg


def test_fingerprint_is_checked_against_the_model_config() -> None:
    wrong = "ab" * 32
    p = pool("prefill", model={"fingerprint": wrong})
    d = pool("decode", model={"fingerprint": wrong})
    check_pair_compat(p, d)  # without the config, equal fingerprints are all we can compare
    msg = refused(p, d, BEAM)
    assert (
        f"the prefill pool names {wrong[:12]}, but the checkpoint config hashes to {FP[:12]}" in msg
    )


def test_with_the_model_config_tp_must_shard_its_kv_heads() -> None:
    # 12 KV heads: TP 8 divides the decode TP 4 (both ways fine) but cannot shard 12 heads
    cfg = BeamModelConfig(
        num_hidden_layers=12,
        layer_types=beam_layer_types(12),
        sliding_window=512,
        num_attention_heads=48,
        num_key_value_heads=12,
        head_dim=128,
    )
    p, d = pool("prefill", parallel={"tp_size": 8}), pool("decode")
    check_pair_compat(p, d)
    msg = refused(p, d, cfg)
    assert "prefill.parallel: attention tp_size: 8 cannot shard 12 KV heads" in msg


@settings(max_examples=200, deadline=None)
@given(
    engine=st.sampled_from(["sglang", "vllm"]),
    backend=st.sampled_from(["nixl", "mooncake"]),
    a=st.integers(1, 32),
    b=st.integers(1, 32),
    with_model=st.booleans(),
)
def test_tp_pair_validity_is_exactly_the_rule(
    engine: str, backend: str, a: int, b: int, with_model: bool
) -> None:
    p = pool("prefill", engine, parallel={"tp_size": a}, transfer={"backend": backend})
    d = pool("decode", engine, parallel={"tp_size": b}, transfer={"backend": backend})
    k = BEAM.num_key_value_heads
    divides = max(a, b) % min(a, b) == 0
    shards = all(t % k == 0 or k % t == 0 for t in (a, b))
    expect = divides and (shards or not with_model)
    try:
        check_pair_compat(p, d, BEAM if with_model else None)
        ok = True
    except PairCompatError as exc:
        ok = False
        assert "parallel" in str(exc) and ("choose" in str(exc))
    assert ok == expect
