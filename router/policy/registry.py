"""The plugin registry: plugin `type` string → factory taking that plugin's parameter mapping.

Factories parse their parameters strictly (`parse_params`). `REGISTRY` holds every plugin of
this package; a deployment may build its own `PluginRegistry` and register more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from beamserve.router.policy import (
    healthy,
    kv_compat,
    kv_usage,
    load,
    max_score,
    prefix_affinity,
    random_weighted,
    role,
    round_robin,
    session_affinity,
)
from beamserve.router.policy.base import Filter, Picker, PolicyConfigError, Scorer

Params = Mapping[str, Any] | None
FilterFactory = Callable[[Params], Filter]
ScorerFactory = Callable[[Params], Scorer]
PickerFactory = Callable[[Params], Picker]


@dataclass
class PluginRegistry:
    """Factories by plugin type, one table per interface."""

    filters: dict[str, FilterFactory] = field(default_factory=dict)
    scorers: dict[str, ScorerFactory] = field(default_factory=dict)
    pickers: dict[str, PickerFactory] = field(default_factory=dict)

    def register_filter(self, type_: str, factory: FilterFactory) -> None:
        _register(self.filters, "filter", type_, factory)

    def register_scorer(self, type_: str, factory: ScorerFactory) -> None:
        _register(self.scorers, "scorer", type_, factory)

    def register_picker(self, type_: str, factory: PickerFactory) -> None:
        _register(self.pickers, "picker", type_, factory)

    def make_filter(self, type_: str, params: Params = None) -> Filter:
        factory: FilterFactory = _lookup(self.filters, "filter", type_)
        return factory(params)

    def make_scorer(self, type_: str, params: Params = None) -> Scorer:
        factory: ScorerFactory = _lookup(self.scorers, "scorer", type_)
        return factory(params)

    def make_picker(self, type_: str, params: Params = None) -> Picker:
        factory: PickerFactory = _lookup(self.pickers, "picker", type_)
        return factory(params)


def _register(table: dict[str, Any], kind: str, type_: str, factory: Any) -> None:
    if type_ in table:
        raise PolicyConfigError(f"{kind} type {type_!r} is already registered")
    table[type_] = factory


def _lookup(table: Mapping[str, Any], kind: str, type_: str) -> Any:
    try:
        return table[type_]
    except KeyError:
        raise PolicyConfigError(
            f"unknown {kind} type {type_!r}; valid {kind} types: {', '.join(sorted(table))}"
        ) from None


def default_registry() -> PluginRegistry:
    """A fresh registry with every plugin of this package."""
    reg = PluginRegistry()
    reg.register_filter(healthy.TYPE, healthy.HealthyFilter.from_params)
    reg.register_filter(role.TYPE, role.RoleFilter.from_params)
    reg.register_filter(kv_compat.TYPE, kv_compat.KVCompatFilter.from_params)
    reg.register_scorer(prefix_affinity.TYPE, prefix_affinity.PrefixAffinityScorer.from_params)
    reg.register_scorer(load.TYPE, load.LoadScorer.from_params)
    reg.register_scorer(kv_usage.TYPE, kv_usage.KVUsageScorer.from_params)
    reg.register_scorer(session_affinity.TYPE, session_affinity.SessionAffinityScorer.from_params)
    reg.register_picker(max_score.TYPE, max_score.MaxScorePicker.from_params)
    reg.register_picker(random_weighted.TYPE, random_weighted.RandomWeightedPicker.from_params)
    reg.register_picker(round_robin.TYPE, round_robin.RoundRobinPicker.from_params)
    return reg


REGISTRY = default_registry()
