"""The latency model's formulas, the profiles' constants and the page budgets they imply."""

from __future__ import annotations

import dataclasses

import pytest
from beamserve.kv_transfer.model import beam_1_0
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.topology import KVDtype, PoolLayout, PoolTopology
from beamserve.workers.sim import (
    EngineConfig,
    EngineConfigError,
    LatencyModel,
    ProfileError,
    SpecDecode,
    StepWork,
    get_profile,
    page_budget,
    pd_transfer_seconds,
)
from beamserve.workers.sim.latency import causal_keys, expert_coverage
from beamserve.workers.sim.profiles import GB300_NVFP4_TP4, H200_BF16_TP8, TINY_CPU, beam_1_0_moe
from hypothesis import given
from hypothesis import strategies as st

GB300 = LatencyModel(GB300_NVFP4_TP4)


@given(
    context=st.integers(0, 3000),
    tokens=st.integers(0, 3000),
    window=st.one_of(st.none(), st.integers(1, 700)),
)
def test_causal_keys_is_the_brute_force_sum(context: int, tokens: int, window: int | None) -> None:
    want = sum(
        min(pos + 1, window) if window else pos + 1 for pos in range(context, context + tokens)
    )
    assert causal_keys(context, tokens, window) == want


def test_expert_coverage() -> None:
    assert expert_coverage(0, 8, 256) == 0
    assert expert_coverage(1, 8, 256) == pytest.approx(8 / 256)
    assert expert_coverage(8, 8, 256) < expert_coverage(32, 8, 256) < 1
    assert expert_coverage(2048, 8, 256) == pytest.approx(1.0)


def test_beam_moe_split() -> None:
    moe = beam_1_0_moe()
    # dense + all experts = 501B; dense + 8/256 of the experts = 23B active
    assert moe.dense_params + moe.expert_params == pytest.approx(501e9)
    assert moe.dense_params + moe.expert_params * 8 / 256 == pytest.approx(23e9)


def test_prefill_time_grows_with_uncached_tokens_and_with_context() -> None:
    assert GB300.prefill_seconds(2048) < GB300.prefill_seconds(8192)
    short, long = GB300.prefill_seconds(4096, 0), GB300.prefill_seconds(4096, 100_000)
    assert long > 1.3 * short  # attention over 100K cached tokens costs more than the GEMMs' share
    # the attention part is exactly linear in the cached context beyond the window
    a = GB300.cost(StepWork(4096, causal_keys(50_000, 4096), causal_keys(50_000, 4096, 512)))
    b = GB300.cost(StepWork(4096, causal_keys(0, 4096), causal_keys(0, 4096, 512)))
    assert a.compute > b.compute


def test_decode_step_grows_with_batch_and_context() -> None:
    one = GB300.decode_step_seconds(1, 80_000)
    assert (
        one
        < GB300.decode_step_seconds(16, 16 * 80_000)
        < GB300.decode_step_seconds(32, 32 * 80_000)
    )
    assert GB300.decode_step_seconds(32, 32 * 10_000) < GB300.decode_step_seconds(32, 32 * 200_000)
    assert GB300.decode_step_seconds(0, 0) == 0.0


def test_gb300_decode_steps_match_the_published_per_user_speeds() -> None:
    """Published: 348 tok/s at one session, 185.87 at 32 (acceptance 4 → 4 tokens a step), and
    43.9 at 96 sessions, where speculation is off (1 token a step)."""
    assert 4 / GB300.decode_step_seconds(1, 75_000) == pytest.approx(348, rel=0.1)
    assert 4 / GB300.decode_step_seconds(32, 32 * 80_000) == pytest.approx(185.87, rel=0.1)
    assert 1 / GB300.decode_step_seconds(96, 96 * 80_000) == pytest.approx(43.9, rel=0.1)


def test_speculation_switches_off_above_the_batch_limit() -> None:
    assert GB300.speculates(64) and not GB300.speculates(65)
    assert GB300.tokens_per_step(1) == 4.0 and GB300.tokens_per_step(96) == 1.0
    never = LatencyModel(
        GB300_NVFP4_TP4.with_changes(spec=SpecDecode(8, 3.5, disable_by_batch_size=None))
    )
    assert never.speculates(10_000) and never.tokens_per_step(500) == 3.5
    assert not LatencyModel(H200_BF16_TP8).speculates(1)


def test_more_gpus_make_prefill_faster_and_ep_changes_communication() -> None:
    tp4 = GB300_NVFP4_TP4
    tp8 = tp4.with_changes(gpus=8)
    assert LatencyModel(tp8).prefill_seconds(16_384) < LatencyModel(tp4).prefill_seconds(16_384)
    ep4 = LatencyModel(tp4.with_changes(ep=4)).cost(StepWork(prefill_tokens=8192))
    tp_only = GB300.cost(StepWork(prefill_tokens=8192))
    assert ep4.comm != tp_only.comm
    single = LatencyModel(tp4.with_changes(gpus=1)).cost(StepWork(prefill_tokens=8192))
    assert single.comm == 0.0


def test_step_cost_parts_and_overheads() -> None:
    empty = GB300.cost(StepWork())
    assert empty.total == 0.0
    draft = GB300.cost(
        StepWork(
            decode_requests=1,
            decode_query_tokens=8,
            decode_context=1000,
            decode_window=512,
            draft=True,
        )
    )
    plain = GB300.cost(
        StepWork(
            decode_requests=1,
            decode_query_tokens=8,
            decode_context=1000,
            decode_window=512,
            draft=False,
        )
    )
    assert draft.overhead - plain.overhead == pytest.approx(GB300_NVFP4_TP4.draft_step_s)
    assert draft.total == pytest.approx(
        draft.overhead + max(draft.compute, draft.memory) + draft.comm
    )


@pytest.mark.parametrize(("src", "dst"), [(8, 4), (4, 8), (2, 2), (8, 16)])
def test_pd_transfer_time_is_kv_transfer_bytes_over_the_links(src: int, dst: int) -> None:
    model = beam_1_0()
    layout = PoolLayout(model, PoolTopology(dst, kv_dtype=KVDtype.BF16), 1, 1)
    want = bytes_minimum(layout, 80_000) / (min(src, dst) * 50e9)
    got = pd_transfer_seconds(
        model, 80_000, dst_tp=dst, src_tp=src, kv_dtype=KVDtype.BF16, link_bandwidth=50e9
    )
    assert got == pytest.approx(want)
    # leading blocks the decode side holds already are not moved: exactly their full-attention KV
    part = pd_transfer_seconds(
        model,
        80_000,
        dst_tp=dst,
        src_tp=src,
        kv_dtype=KVDtype.BF16,
        link_bandwidth=50e9,
        cached_tokens=64_000,
    )
    per_token_full = 9 * 2 * 8 * 128 * 2 * max(1, dst // 8)
    assert (got - part) * min(src, dst) * 50e9 == pytest.approx(64_000 * per_token_full)


def test_host_transfer_and_kv_bytes() -> None:
    # DESIGN.md §1: 36,864 B per token of full-attention KV in bf16; fp8 halves it
    assert LatencyModel(H200_BF16_TP8).kv_full_per_token == 36_864
    assert GB300.kv_full_per_token == 18_432
    assert GB300.kv_bytes(64, 64) == 64 * (18_432 + 43 * 2 * 8 * 128)
    assert GB300.host_transfer_seconds(0) == 0.0
    assert GB300.host_transfer_seconds(10**9) == pytest.approx(1e9 / (4 * 225e9))


def test_profiles_by_name_and_their_errors() -> None:
    assert get_profile("gb300-nvfp4-tp4") is GB300_NVFP4_TP4
    assert get_profile("tiny-cpu") is TINY_CPU
    with pytest.raises(ProfileError, match="h200-bf16-tp8"):
        get_profile("b200")
    with pytest.raises(ProfileError, match="compute_efficiency"):
        GB300_NVFP4_TP4.with_changes(compute_efficiency=1.5)
    with pytest.raises(ProfileError, match="ep"):
        GB300_NVFP4_TP4.with_changes(ep=3)
    with pytest.raises(ProfileError, match="acceptance_length"):
        SpecDecode(8, 9.0)
    assert GB300_NVFP4_TP4.calibrated and not H200_BF16_TP8.calibrated
    assert all(p.sources for p in (GB300_NVFP4_TP4, H200_BF16_TP8, TINY_CPU))


def test_page_budgets_follow_memory() -> None:
    gb = page_budget(GB300_NVFP4_TP4)
    # 4 × (279 GB × 0.9 − 16 GB) − 501e9 × 4.5/8 B of weights
    free = 4 * (279e9 * 0.9 - 16e9) - 501e9 * 4.5 / 8
    assert gb.full_page_bytes == 64 * 18_432
    assert gb.full_pages == int(free * 0.9 / gb.full_page_bytes)
    assert gb.window_pages == int(free * 0.1 / gb.window_page_bytes)
    h = page_budget(H200_BF16_TP8)
    assert 0 < h.full_pages * 64 < gb.full_pages * 64  # bf16 Beam leaves little KV room
    with pytest.raises(ProfileError, match="no KV memory"):
        page_budget(H200_BF16_TP8.with_changes(gpus=4, gpu_memory_utilization=0.9))


def test_engine_config_validation() -> None:
    cfg = EngineConfig.from_profile(TINY_CPU, max_running=4)
    assert cfg.max_running == 4 and cfg.window_span_pages == 3
    with pytest.raises(EngineConfigError, match="unknown engine settings"):
        EngineConfig.from_profile(TINY_CPU, max_runing=4)
    with pytest.raises(EngineConfigError, match="window_pages"):
        EngineConfig.from_profile(TINY_CPU, window_pages=5)
    with pytest.raises(EngineConfigError, match="full decode batch"):
        EngineConfig.from_profile(GB300_NVFP4_TP4, max_batched_tokens=1024)
    with pytest.raises(EngineConfigError, match="page_size"):
        dataclasses.replace(cfg, page_size=48)
