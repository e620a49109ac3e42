"""beamserve.router.policy: routing policies (filter → score → pick), the default
`sticky-until-saturated` policy, baselines, the TTFT estimator and conditional disaggregation.

Entry points: `build_policy(name_or_config)` → a `RoutingPolicy` whose
``route(request, views) -> RouteDecision`` raises `NoCandidates` when nothing fits;
`ConditionalDisaggregation(...).apply(request, decision, views)` adds the prefill worker.
"""

from beamserve.router.policy.base import (
    Filter,
    NoCandidates,
    Picker,
    PluginParams,
    Policy,
    PolicyConfigError,
    RoutingPolicy,
    Scorer,
    ScoreTable,
    WeightedScorer,
    break_tie,
    parse_params,
    stable_hash,
)
from beamserve.router.policy.build import DEFAULT_POLICY, PRESETS, build_policy, preset_names
from beamserve.router.policy.disagg import (
    ConditionalDisaggregation,
    DisaggregationParams,
    choose_prefill_worker,
    decide_disaggregation,
    prefill_candidates,
)
from beamserve.router.policy.healthy import HealthyFilter
from beamserve.router.policy.kv_compat import KVCompatFilter, pairs_with
from beamserve.router.policy.kv_usage import KVUsageScorer
from beamserve.router.policy.load import LoadParams, LoadScorer
from beamserve.router.policy.max_score import MaxScorePicker
from beamserve.router.policy.prefix_affinity import PrefixAffinityScorer, effective_cached_tokens
from beamserve.router.policy.random_weighted import RandomWeightedPicker
from beamserve.router.policy.registry import REGISTRY, PluginRegistry, default_registry
from beamserve.router.policy.role import RoleFilter
from beamserve.router.policy.round_robin import RoundRobinPicker
from beamserve.router.policy.session_affinity import SessionAffinityScorer
from beamserve.router.policy.sticky import StickyParams, StickyUntilSaturated, should_leave_warm
from beamserve.router.policy.ttft import TTFTEstimate, TTFTParams, estimate_ttft, estimate_ttft_s

__all__ = [
    "DEFAULT_POLICY",
    "PRESETS",
    "REGISTRY",
    "ConditionalDisaggregation",
    "DisaggregationParams",
    "Filter",
    "HealthyFilter",
    "KVCompatFilter",
    "KVUsageScorer",
    "LoadParams",
    "LoadScorer",
    "MaxScorePicker",
    "NoCandidates",
    "Picker",
    "PluginParams",
    "PluginRegistry",
    "Policy",
    "PolicyConfigError",
    "PrefixAffinityScorer",
    "RandomWeightedPicker",
    "RoleFilter",
    "RoundRobinPicker",
    "RoutingPolicy",
    "ScoreTable",
    "Scorer",
    "SessionAffinityScorer",
    "StickyParams",
    "StickyUntilSaturated",
    "TTFTEstimate",
    "TTFTParams",
    "WeightedScorer",
    "break_tie",
    "build_policy",
    "choose_prefill_worker",
    "decide_disaggregation",
    "default_registry",
    "effective_cached_tokens",
    "estimate_ttft",
    "estimate_ttft_s",
    "pairs_with",
    "parse_params",
    "prefill_candidates",
    "preset_names",
    "should_leave_warm",
    "stable_hash",
]
