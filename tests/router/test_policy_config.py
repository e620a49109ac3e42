"""Policies built from configuration: presets, the weighted combination, strict parsing."""

from __future__ import annotations

from typing import Any

import pytest
from beamserve.router.policy import (
    DEFAULT_POLICY,
    Policy,
    PolicyConfigError,
    build_policy,
    preset_names,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.router._policy_views import request, view


def test_presets_all_build() -> None:
    assert DEFAULT_POLICY == "sticky-until-saturated"
    assert set(preset_names()) >= {
        "sticky-until-saturated",
        "round-robin",
        "least-load",
        "prefix-only",
        "weighted",
    }
    for name in preset_names():
        d = build_policy(name).route(request(), [view("a"), view("b")])
        assert d.decode.id in {"a", "b"}


def test_round_robin_baseline_cycles_healthy_decode_workers() -> None:
    pol = build_policy("round-robin")
    views = [view("b"), view("a"), view("x", healthy=False), view("p", role="prefill")]
    picks = [pol.route(request(), views).decode.id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    assert pol.route(request(), views).reason == "round-robin"
    assert pol.route(request(), views[:1]).reason == "only-candidate"


def test_least_load_baseline_ignores_prefix() -> None:
    views = [view("a", blocks=128, prefill=50_000), view("b", prefill=10)]
    d = build_policy("least-load").route(request(8192), views)
    assert (d.decode.id, d.reason) == ("b", "load")


def test_prefix_only_baseline_max_hit_ties_by_load() -> None:
    views = [view("a", blocks=10, prefill=50_000), view("b", blocks=20, prefill=90_000)]
    assert build_policy("prefix-only").route(request(8192), views).decode.id == "b"
    tied = [view("a", blocks=20, prefill=50_000), view("b", blocks=20, prefill=10)]
    d = build_policy("prefix-only").route(request(8192), tied)
    assert d.decode.id == "b"


def test_weighted_policy_formula_explain_and_reason() -> None:
    pol = build_policy(
        {
            "name": "mine",
            "scorers": [
                {"type": "prefix-affinity", "weight": 3},
                {"type": "load", "weight": 1},
            ],
        }
    )
    assert isinstance(pol, Policy)
    a = view("a", blocks=64, window_ok=True, prefill=32768)  # prefix 0.5, load 0.5
    b = view("b")  # prefix 0, load 1
    d = pol.route(request(8192), [a, b])
    # totals: a = (3·0.5 + 1·0.5)/4 = 0.5, b = (0 + 1)/4 = 0.25
    assert dict(d.scores) == {"a": pytest.approx(0.5), "b": pytest.approx(0.25)}
    assert (d.decode.id, d.reason) == ("a", "prefix")
    assert d.explain.startswith("policy=mine pick=a")
    assert "a total=0.500 [prefix-affinity=0.500×3 load=0.500×1]" in d.explain
    assert "b total=0.250" in d.explain


def test_weighted_policy_with_filters_and_picker() -> None:
    cfg: dict[str, Any] = {
        "filters": [{"type": "healthy"}, {"type": "kv-compat", "params": {"revision": "r2"}}],
        "scorers": [{"type": "kv-usage"}],
        "picker": {"type": "random-weighted", "params": {"temperature": 0.5}},
    }
    views = [view("a", revision="r1"), view("b", revision="r2"), view("c", revision="r2")]
    d = build_policy(cfg).route(request(), views)
    assert d.decode.id in {"b", "c"}


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"scorer": []}, "unknown key 'scorer'; valid keys: name, strategy, filters, scorers"),
        (
            {"scorers": [{"type": "prefix"}]},
            "unknown scorer type 'prefix'; valid scorer types: "
            "kv-usage, load, prefix-affinity, session-affinity",
        ),
        ({"filters": [{"type": "nope"}]}, "valid filter types: healthy, kv-compat, role"),
        ({"picker": {"type": "best"}}, "valid picker types: max-score, random-weighted"),
        (
            {"scorers": [{"type": "load", "params": {"stale_s": 1}}]},
            "scorer 'load': unknown parameter 'stale_s'; valid parameters: decode_token_scale,",
        ),
        ({"scorers": [{"type": "load", "wieght": 2}]}, "scorers[0]: unknown key 'wieght'"),
        ({"scorers": [{"type": "load", "weight": -1}]}, "'weight' must be a number ≥ 0"),
        ({"scorers": [{"weight": 1}]}, "scorers[0]: 'type' is required"),
        ({"strategy": "fancy"}, "unknown strategy 'fancy'; valid strategies: weighted, sticky"),
        (
            {"strategy": "sticky-until-saturated", "scorers": []},
            "unknown key 'scorers'; valid keys: name, strategy, filters, params",
        ),
        (
            {"strategy": "sticky-until-saturated", "params": {"margin": 2}},
            "unknown parameter 'margin'; valid parameters: burst_gap_s, burst_window_s, "
            "decode_interference, hold_when_saturated, margin_ratio,",
        ),
        (
            {"strategy": "sticky-until-saturated", "params": {"margin_ratio": 0.5}},
            "parameter 'margin_ratio'",
        ),
        ({"filters": [{"type": "role", "params": {"role": "both"}}]}, "parameter 'role'"),
        ({"picker": {"type": "max-score", "extra": 1}}, "picker: unknown key 'extra'"),
        ({"scorers": {"type": "load"}}, "scorers: expected a list"),
        ("fastest", "unknown policy 'fastest'; valid policies: sticky-until-saturated"),
    ],
)
def test_config_errors_name_the_bad_key(config: Any, needle: str) -> None:
    with pytest.raises(PolicyConfigError) as err:
        build_policy(config)
    assert needle in str(err.value)


worker = st.fixed_dictionaries(
    {
        "blocks": st.integers(0, 300),
        "window_ok": st.booleans(),
        "prefill": st.integers(0, 10**6),
        "decode": st.integers(0, 10**7),
        "queue_len": st.integers(0, 50),
        "kv_usage": st.floats(0, 1),
        "scraped_age_s": st.one_of(st.none(), st.floats(0, 10)),
        "warm": st.booleans(),
    }
)


@given(st.lists(worker, min_size=1, max_size=6), st.integers(0, 50_000), st.text(max_size=6))
def test_every_preset_scores_in_unit_interval_and_is_deterministic(
    workers: list[dict[str, Any]], prompt: int, rid: str
) -> None:
    views = [view(f"w{i}", **w) for i, w in enumerate(workers)]
    for name in ("sticky-until-saturated", "weighted", "least-load", "prefix-only"):
        d1 = build_policy(name).route(request(prompt, rid=rid), views)
        d2 = build_policy(name).route(request(prompt, rid=rid), list(reversed(views)))
        assert d1.decode.id == d2.decode.id
        assert all(0.0 <= s <= 1.0 for _, s in d1.scores)
        assert d1.reason in {"sticky", "rebalance", "prefix", "load", "tie", "only-candidate"}
