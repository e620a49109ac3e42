"""Conditional disaggregation: when to prefill remotely, and on which prefill worker."""

from __future__ import annotations

import pytest
from beamserve.router.policy import (
    ConditionalDisaggregation,
    PolicyConfigError,
    build_policy,
    choose_prefill_worker,
    decide_disaggregation,
)
from beamserve.router.types import PrefixHit
from hypothesis import given
from hypothesis import strategies as st

from tests.router._policy_views import request, view


@pytest.mark.parametrize(
    ("prompt", "blocks", "window_ok", "both", "either"),
    [
        (100, 0, True, False, True),  # tiny cold prompt: 100 new < 2048 → local under "both"
        (80_000, 0, True, True, True),  # large and cold → remote
        (80_000, 1187, True, False, True),  # 75968 cached (95 %), 4032 new: warm → local
        (80_000, 900, True, False, True),  # 57600 cached (72 % ≥ 70 %) → local
        (10_000, 100, True, True, True),  # 6400 cached (64 %), 3600 new → remote
        (4_000, 30, True, True, True),  # 1920 cached (48 %), 2080 new → remote
        (4_000, 40, True, False, True),  # 2560 cached, 1440 new < 2048 → local
        (4_000, 60, True, False, False),  # 3840 cached (96 %), 160 new → local either way
        (10_000, 110, True, False, True),  # 7040 cached (70.4 %) → local
        (10_000, 110, False, True, True),  # partial: 7040 − 512 = 6528 (65.3 %) → remote
    ],
)
def test_decide_hand_cases(
    prompt: int, blocks: int, window_ok: bool, both: bool, either: bool
) -> None:
    hit = PrefixHit(full_blocks=blocks, window_ok=window_ok)
    assert decide_disaggregation(request(prompt), hit) is both
    assert decide_disaggregation(request(prompt), hit, require="either") is either


def test_decide_thresholds_are_configurable() -> None:
    hit = PrefixHit(full_blocks=0)
    assert decide_disaggregation(request(3000), hit)
    assert not decide_disaggregation(request(3000), hit, min_uncached_tokens=4096)
    warm = PrefixHit(full_blocks=100, window_ok=True)  # 6400 of 10000 cached
    assert decide_disaggregation(request(10_000), warm)
    assert not decide_disaggregation(request(10_000), warm, max_cached_ratio=0.6)
    assert not decide_disaggregation(request(0), hit)


@given(
    st.integers(1, 200_000),
    st.integers(0, 4000),
    st.booleans(),
    st.integers(0, 10_000),
    st.floats(0, 1),
)
def test_more_cache_never_turns_local_into_remote(
    prompt: int, blocks: int, ok: bool, min_uncached: int, ratio: float
) -> None:
    less = PrefixHit(full_blocks=blocks, window_ok=ok)
    more = PrefixHit(full_blocks=blocks + 1, window_ok=ok)
    kw = {"min_uncached_tokens": min_uncached, "max_cached_ratio": ratio}
    for require in ("both", "either"):
        if decide_disaggregation(request(prompt), more, require=require, **kw):  # type: ignore[arg-type]
            assert decide_disaggregation(request(prompt), less, require=require, **kw)  # type: ignore[arg-type]


def test_prefill_worker_pairs_and_prefers_hit_plus_low_load() -> None:
    decode = view("d", role="decode", revision="r2").endpoint
    views = [
        view("p-old", role="prefill", revision="r1", blocks=100),  # wrong revision
        view("p-layout", role="prefill", revision="r2", kv_layout="M", blocks=100),
        view("p-sick", role="prefill", revision="r2", blocks=100, healthy=False),
        view("p-cold", role="prefill", revision="r2"),
        view("p-warm", role="prefill", revision="r2", blocks=100, prefill=1000),
        view("d", role="decode", revision="r2", blocks=120),  # the decode worker itself
    ]
    chosen = choose_prefill_worker(request(20_000), decode, views)
    assert chosen is not None and chosen.endpoint.id == "p-warm"
    busy = [*views[:4], view("p-warm", role="prefill", revision="r2", blocks=100, prefill=90_000)]
    chosen = choose_prefill_worker(request(20_000), decode, busy)
    assert chosen is not None and chosen.endpoint.id == "p-cold"
    assert choose_prefill_worker(request(20_000), decode, views[:3]) is None


def test_apply_sets_prefill_and_expected_hit() -> None:
    views = [
        view("d1", role="decode"),
        view("p1", role="prefill", blocks=50),
    ]
    pol = build_policy("sticky-until-saturated")
    disagg = ConditionalDisaggregation()
    big = request(30_000)
    d = disagg.apply(big, pol.route(big, views), views)
    assert d.decode.id == "d1" and d.prefill is not None and d.prefill.id == "p1"
    assert d.expected_hit.full_blocks == 50
    assert "disagg=yes prefill=p1" in d.explain
    small = request(500)
    d = disagg.apply(small, pol.route(small, views), views)
    assert d.prefill is None and "disagg=no" in d.explain
    # nothing pairs → local, with the reason in the explain string
    lone = [view("d1", role="decode"), view("p9", role="prefill", revision="r9")]
    d = disagg.apply(big, pol.route(big, lone), lone)
    assert d.prefill is None and "no prefill worker pairs with d1" in d.explain
    off = ConditionalDisaggregation.from_params({"enabled": False})
    assert off.apply(big, pol.route(big, views), views).prefill is None


@pytest.mark.parametrize("keep", [False, True])
def test_keep_warm_local_prefills_a_sessions_turn_on_its_own_worker(keep: bool) -> None:
    """A continuing turn with a large new part, routed to the decode worker that holds its
    session: split by the size rule, kept local with `keep_warm_local` (the prefill worker
    would recompute the whole context). A new session's prompt is split either way."""
    disagg = ConditionalDisaggregation.from_params({"keep_warm_local": keep})
    pol = build_policy("sticky-until-saturated")
    turn = request(25_000)
    warm = [view("d1", role="decode", warm=True, blocks=60), view("p1", role="prefill")]
    d = disagg.apply(turn, pol.route(turn, warm[:1]), warm)
    assert d.decode.id == "d1"
    assert (d.prefill is None) is keep
    if keep:
        assert "disagg=no (the session's own worker)" in d.explain
    cold = [view("d1", role="decode"), view("p1", role="prefill")]
    d = disagg.apply(turn, pol.route(turn, cold[:1]), cold)
    assert d.prefill is not None and d.prefill.id == "p1"


def test_disaggregation_params_are_strict() -> None:
    with pytest.raises(PolicyConfigError, match="unknown parameter 'min_uncached'"):
        ConditionalDisaggregation.from_params({"min_uncached": 10})
    with pytest.raises(PolicyConfigError, match="parameter 'require'"):
        ConditionalDisaggregation.from_params({"require": "all"})
