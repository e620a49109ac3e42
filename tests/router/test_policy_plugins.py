"""Each routing plugin alone: formulas on hand-computed cases, and properties."""

from __future__ import annotations

from dataclasses import replace

import pytest
from beamserve.router.policy import (
    HealthyFilter,
    KVCompatFilter,
    KVUsageScorer,
    LoadScorer,
    MaxScorePicker,
    PolicyConfigError,
    PrefixAffinityScorer,
    RandomWeightedPicker,
    RoleFilter,
    RoundRobinPicker,
    SessionAffinityScorer,
    effective_cached_tokens,
    estimate_ttft_s,
    pairs_with,
)
from beamserve.router.types import PrefixHit
from hypothesis import given
from hypothesis import strategies as st

from tests.router._policy_views import request, view

# --- filters ----------------------------------------------------------------------------------


def test_healthy_filter_drops_unhealthy_keeps_order() -> None:
    views = [view("a"), view("b", healthy=False), view("c")]
    kept = HealthyFilter().filter(request(), views)
    assert [v.endpoint.id for v in kept] == ["a", "c"]


def test_role_filter_decode_and_prefill_and_pool() -> None:
    views = [view("p", role="prefill"), view("d", role="decode"), view("b", role="both")]
    assert [v.endpoint.id for v in RoleFilter("decode").filter(request(), views)] == ["d", "b"]
    assert [v.endpoint.id for v in RoleFilter("prefill").filter(request(), views)] == ["p", "b"]
    assert RoleFilter("decode", pool="other").filter(request(), views) == ()


def test_kv_compat_filter_matches_revision_and_layout() -> None:
    d = view("d", role="decode", revision="r2", kv_layout="L")
    views = [
        view("p1", role="prefill", revision="r2", kv_layout="L"),
        view("p2", role="prefill", revision="r1", kv_layout="L"),
        view("p3", role="prefill", revision="r2", kv_layout="M"),
    ]
    kept = KVCompatFilter.matching(d.endpoint).filter(request(), views)
    assert [v.endpoint.id for v in kept] == ["p1"]
    assert pairs_with(views[0].endpoint, d.endpoint)
    assert not pairs_with(views[1].endpoint, d.endpoint)
    pinned = KVCompatFilter.from_params({"revision": "r1"}).filter(request(), views)
    assert [v.endpoint.id for v in pinned] == ["p2"]


def test_pairs_with_needs_a_sender_a_receiver_and_one_handoff_style() -> None:
    p, d = view("p", role="prefill").endpoint, view("d", role="decode").endpoint
    both = view("b").endpoint
    assert pairs_with(p, d)
    assert not pairs_with(d, p)  # a decode worker sends nothing
    assert not pairs_with(both, d) and not pairs_with(p, both)  # `both` = aggregated serving
    kv_both = replace(both, labels=(("kv_role", "kv_both"),))
    assert pairs_with(kv_both, d) and pairs_with(p, kv_both)
    sg_p = replace(p, api="sglang")
    assert not pairs_with(sg_p, d)  # SGLang sender, vLLM-style receiver
    sg_d = replace(d, api="sglang")
    assert not pairs_with(sg_p, sg_d)  # no bootstrap port known
    assert pairs_with(replace(sg_p, bootstrap_port=8998), sg_d)
    assert pairs_with(replace(sg_p, labels=(("bootstrap_port", "8998"),)), sg_d)
    # What the worker reported wins over its role.
    assert not pairs_with(replace(p, kv_send=False), d)
    assert pairs_with(replace(both, kv_send=True), d)


# --- prefix-affinity --------------------------------------------------------------------------


def test_prefix_affinity_full_hit_counts_all_blocks() -> None:
    # 64 blocks × 64 tokens = 4096 of an 8192-token prompt.
    s = PrefixAffinityScorer().score(request(8192), [view("a", blocks=64, window_ok=True)])
    assert s["a"] == pytest.approx(4096 / 8192)


def test_prefix_affinity_partial_hit_recomputes_window_tail() -> None:
    # partial: 4096 − 512 (window) = 3584 effective cached tokens.
    s = PrefixAffinityScorer().score(request(8192), [view("a", blocks=64, window_ok=False)])
    assert s["a"] == pytest.approx(3584 / 8192)
    # a partial hit shorter than the window saves nothing.
    s = PrefixAffinityScorer().score(request(8192), [view("b", blocks=4, window_ok=False)])
    assert s["b"] == 0.0


def test_prefix_affinity_prices_with_each_workers_geometry_and_credit() -> None:
    scorer = PrefixAffinityScorer(predicted_credit=0.5)
    # 10 blocks, 4 predicted at half credit → 8 blocks × 16 = 128, partial → 28.
    v = view("a", blocks=10, window_ok=False, predicted=4, block_size=16, sliding_window=100)
    # the same hit on a worker of block 64, window 512: 8 × 64 = 512, partial → 0.
    w = view("b", blocks=10, window_ok=False, predicted=4)
    s = scorer.score(request(1000), [v, w])
    assert s == {"a": pytest.approx(28 / 1000), "b": 0.0}


def test_geometry_is_no_scorer_parameter() -> None:
    with pytest.raises(PolicyConfigError, match="valid parameters: predicted_credit"):
        PrefixAffinityScorer.from_params({"sliding_window": 128})


def test_prefix_affinity_caps_at_prompt_and_zero_prompt() -> None:
    v = view("a", blocks=100, window_ok=True)
    assert PrefixAffinityScorer().score(request(1000), [v])["a"] == 1.0
    assert PrefixAffinityScorer().score(request(0), [v])["a"] == 0.0


hits = st.builds(
    PrefixHit,
    full_blocks=st.integers(0, 3000),
    window_ok=st.booleans(),
    predicted_blocks=st.integers(0, 3000),
)


@given(hits, st.integers(0, 200_000), st.integers(1, 256), st.integers(0, 4096))
def test_effective_cached_within_prompt(hit: PrefixHit, p: int, b: int, w: int) -> None:
    c = effective_cached_tokens(hit, p, block_size=b, sliding_window=w)
    assert 0.0 <= c <= p


@given(
    st.integers(0, 2000),
    st.integers(0, 2000),
    st.booleans(),
    st.booleans(),
    st.integers(1, 200_000),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
)
def test_prefix_affinity_monotone_in_hit(
    k1: int, k2: int, ok1: bool, ok2: bool, p: int, prefill: int, decode: int
) -> None:
    # worker a's hit dominates b's (more or equal blocks, window at least as resident); equal load.
    hi, lo = max(k1, k2), min(k1, k2)
    a = view("a", blocks=hi, window_ok=ok1 or ok2, prefill=prefill, decode=decode)
    b = view("b", blocks=lo, window_ok=ok1 and ok2, prefill=prefill, decode=decode)
    s = PrefixAffinityScorer().score(request(p), [a, b])
    assert s["a"] >= s["b"]
    assert 0.0 <= s["b"] <= 1.0 and 0.0 <= s["a"] <= 1.0


# --- load / kv-usage / session ----------------------------------------------------------------


def test_load_scorer_router_counts_only_when_scrape_stale() -> None:
    scorer = LoadScorer()
    # p = 32768/32768 = 1, d = 4194304/4194304 = 1 → 1/3; scraped queue ignored (stale).
    v = view("a", prefill=32768, decode=4194304, queue_len=400, kv_usage=0.99, scraped_age_s=9.0)
    assert scorer.score(request(), [v])["a"] == pytest.approx(1 / 3)
    never = view("b", prefill=32768, queue_len=400, scraped_age_s=None)
    assert scorer.score(request(), [never])["b"] == pytest.approx(1 / 2)


def test_load_scorer_fresh_scrape_takes_the_larger_of_each_pair() -> None:
    scorer = LoadScorer()
    # p = max(0, 8/4) = 2, d = max(0, 0.4/0.8) = 0.5 → 1/3.5
    v = view("a", queue_len=8, kv_usage=0.4, scraped_age_s=0.5)
    assert scorer.score(request(), [v])["a"] == pytest.approx(1 / 3.5)
    # router count larger than the scrape: p = max(65536/32768, 4/4) = 2 → 1/3
    w = view("b", prefill=65536, queue_len=4, scraped_age_s=0.5)
    assert scorer.score(request(), [w])["b"] == pytest.approx(1 / 3)


@given(
    st.integers(0, 10**7),
    st.integers(0, 10**8),
    st.integers(0, 10**4),
    st.floats(0, 1),
    st.one_of(st.none(), st.floats(0, 100)),
)
def test_load_and_kv_scores_in_unit_interval(
    pf: int, dc: int, q: int, kv: float, age: float | None
) -> None:
    v = view("a", prefill=pf, decode=dc, queue_len=q, kv_usage=kv, scraped_age_s=age)
    for scorer in (LoadScorer(), KVUsageScorer(), SessionAffinityScorer()):
        assert 0.0 <= scorer.score(request(), [v])["a"] <= 1.0


def test_kv_usage_scorer_fresh_and_stale() -> None:
    scorer = KVUsageScorer.from_params({"stale_score": 0.25})
    fresh = view("a", kv_usage=0.3, scraped_age_s=0.1)
    stale = view("b", kv_usage=0.3, scraped_age_s=5.0)
    s = scorer.score(request(), [fresh, stale])
    assert s == {"a": pytest.approx(0.7), "b": 0.25}


def test_session_affinity_only_with_a_session() -> None:
    views = [view("a", warm=True), view("b")]
    assert SessionAffinityScorer().score(request(), views) == {"a": 1.0, "b": 0.0}
    assert SessionAffinityScorer().score(request(session=None), views) == {"a": 0.0, "b": 0.0}


# --- pickers ----------------------------------------------------------------------------------


def test_max_score_picks_the_best() -> None:
    views = [view("a"), view("b"), view("c")]
    assert (
        MaxScorePicker().pick(request(), views, {"a": 0.2, "b": 0.9, "c": 0.5}).endpoint.id == "b"
    )


def test_max_score_ties_spread_over_workers_but_are_deterministic() -> None:
    views = [view(f"w{i}") for i in range(4)]
    totals = dict.fromkeys((v.endpoint.id for v in views), 0.5)
    picks = {
        MaxScorePicker().pick(request(rid=f"r{i}", session=None), views, totals).endpoint.id
        for i in range(64)
    }
    assert len(picks) > 1  # not always the first worker
    again = MaxScorePicker().pick(request(rid="r7", session=None), list(reversed(views)), totals)
    first = MaxScorePicker().pick(request(rid="r7", session=None), views, totals)
    assert again.endpoint.id == first.endpoint.id  # independent of input order


@given(
    st.lists(st.floats(0, 1), min_size=1, max_size=6),
    st.text(min_size=1, max_size=8),
    st.randoms(use_true_random=False),
)
def test_pickers_deterministic(scores: list[float], rid: str, rnd: object) -> None:
    views = [view(f"w{i}") for i in range(len(scores))]
    totals = {f"w{i}": s for i, s in enumerate(scores)}
    shuffled = list(views)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    for picker in (MaxScorePicker(), RandomWeightedPicker()):
        a = picker.pick(request(rid=rid), views, totals)
        b = picker.pick(request(rid=rid), shuffled, totals)
        assert a.endpoint.id == b.endpoint.id
    picker = MaxScorePicker()
    best = picker.pick(request(rid=rid), views, totals)
    assert totals[best.endpoint.id] >= max(scores) - picker.tie_epsilon  # ties within epsilon


def test_random_weighted_never_picks_a_zero_score_when_others_positive() -> None:
    views = [view("a"), view("b")]
    for i in range(50):
        pick = RandomWeightedPicker().pick(request(rid=f"r{i}"), views, {"a": 0.0, "b": 0.3})
        assert pick.endpoint.id == "b"


def test_round_robin_cycles_in_id_order() -> None:
    views = [view("c"), view("a"), view("b")]
    picker = RoundRobinPicker()
    ids = [picker.pick(request(), views, {}).endpoint.id for _ in range(6)]
    assert ids == ["a", "b", "c", "a", "b", "c"]


# --- TTFT estimator ---------------------------------------------------------------------------


def test_ttft_estimate_hand_computed() -> None:
    # queued 20000 + uncached (10000 − 64·64=4096 → 5904) + 0.002 × 1_000_000 = 2000
    v = view("a", blocks=64, window_ok=True, prefill=20000, decode=1_000_000)
    t = estimate_ttft_s(v, request(10000), prefill_tok_s=40000, decode_interference=0.002)
    assert t == pytest.approx((20000 + 5904 + 2000) / 40000)


def test_ttft_partial_hit_pays_for_the_window_tail() -> None:
    full = view("a", blocks=64, window_ok=True)
    part = view("b", blocks=64, window_ok=False)
    tf = estimate_ttft_s(full, request(10000), prefill_tok_s=1000)
    tp = estimate_ttft_s(part, request(10000), prefill_tok_s=1000)
    assert tp - tf == pytest.approx(0.512)
    # the window is the worker's own (its geometry), not a policy parameter
    part128 = view("c", blocks=64, window_ok=False, sliding_window=128)
    t128 = estimate_ttft_s(part128, request(10000), prefill_tok_s=1000)
    assert t128 - tf == pytest.approx(0.128)
