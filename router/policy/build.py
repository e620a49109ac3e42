"""Build a routing policy from a preset name or a configuration mapping (strictly parsed).

Configuration (YAML shown; any mapping works)::

    name: my-policy                  # optional, for logs and explain strings
    strategy: weighted               # "weighted" (default) or "sticky-until-saturated"
    filters:                         # both strategies; applied in order
      - {type: healthy}
      - {type: role, params: {role: decode}}
    scorers:                         # weighted only: total = Σ wᵢ·scoreᵢ / Σ wᵢ
      - {type: prefix-affinity, weight: 3}
      - {type: load, weight: 2, params: {stale_after_s: 1.0}}
    picker: {type: max-score}        # weighted only; default max-score
    params: {margin_s: 1.0}          # sticky-until-saturated only (see `sticky`)

Unknown keys, plugin types and parameters raise `PolicyConfigError` naming the bad one and the
valid ones. When `filters` is omitted both strategies use ``[healthy, role: decode]``.

Presets (`PRESETS`), all built through this same parser:

| name | what |
|---|---|
| `sticky-until-saturated` | the default (`DEFAULT_POLICY`); see `sticky` |
| `weighted` | llm-d-like: prefix-affinity ×3 + load ×2, max-score |
| `round-robin` | baseline: cycle over healthy decode workers |
| `least-load` | baseline: load scorer only |
| `prefix-only` | baseline: most cached tokens; ties (and near-ties below 1e-6) by load |
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import (
    Filter,
    Policy,
    PolicyConfigError,
    RoutingPolicy,
    WeightedScorer,
    parse_params,
)
from beamserve.router.policy.registry import REGISTRY, PluginRegistry
from beamserve.router.policy.sticky import KIND as STICKY
from beamserve.router.policy.sticky import StickyParams, StickyUntilSaturated

WEIGHTED = "weighted"
DEFAULT_POLICY = STICKY
_DEFAULT_FILTERS: list[dict[str, Any]] = [
    {"type": "healthy"},
    {"type": "role", "params": {"role": "decode"}},
]

PRESETS: dict[str, dict[str, Any]] = {
    STICKY: {"name": STICKY, "strategy": STICKY},
    WEIGHTED: {
        "name": WEIGHTED,
        "scorers": [
            {"type": "prefix-affinity", "weight": 3},
            {"type": "load", "weight": 2},
        ],
        "picker": {"type": "max-score"},
    },
    "round-robin": {"name": "round-robin", "picker": {"type": "round-robin"}},
    "least-load": {
        "name": "least-load",
        "scorers": [{"type": "load", "weight": 1}],
        "picker": {"type": "max-score"},
    },
    "prefix-only": {
        "name": "prefix-only",
        # The load weight is far below the smallest prefix difference (one 64-token block of a
        # 1M-token prompt ≈ 6e-5), so load only breaks ties.
        "scorers": [
            {"type": "prefix-affinity", "weight": 1},
            {"type": "load", "weight": 1e-6},
        ],
        "picker": {"type": "max-score"},
    },
}

_KEYS = {
    WEIGHTED: ("name", "strategy", "filters", "scorers", "picker"),
    STICKY: ("name", "strategy", "filters", "params"),
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def build_policy(
    name_or_config: str | Mapping[str, Any], *, registry: PluginRegistry = REGISTRY
) -> RoutingPolicy:
    """A fresh policy from a preset name (`PRESETS`) or a configuration mapping."""
    if isinstance(name_or_config, str):
        if name_or_config not in PRESETS:
            raise PolicyConfigError(
                f"unknown policy {name_or_config!r}; valid policies: {', '.join(PRESETS)}"
            )
        config: Mapping[str, Any] = copy.deepcopy(PRESETS[name_or_config])
    elif isinstance(name_or_config, Mapping):
        config = name_or_config
    else:
        raise PolicyConfigError(
            f"policy must be a preset name or a mapping, not {type(name_or_config).__name__}"
        )
    strategy = config.get("strategy", WEIGHTED)
    if strategy not in _KEYS:
        raise PolicyConfigError(
            f"policy: unknown strategy {strategy!r}; valid strategies: {', '.join(_KEYS)}"
        )
    _check_keys(config, _KEYS[strategy], f"policy (strategy {strategy!r})")
    name = config.get("name", strategy)
    if not isinstance(name, str):
        raise PolicyConfigError(f"policy: 'name' must be a string, not {name!r}")
    filters = _build_filters(config.get("filters", _DEFAULT_FILTERS), registry)
    if strategy == STICKY:
        params = parse_params(
            StickyParams, _mapping(config.get("params"), "params"), f"policy {name!r} params"
        )
        return StickyUntilSaturated(name, filters, params)
    scorers = [
        _build_scorer(entry, i, registry)
        for i, entry in enumerate(_list(config.get("scorers", []), "scorers"))
    ]
    picker_cfg = _mapping(config.get("picker", {"type": "max-score"}), "picker")
    _check_keys(picker_cfg, ("type", "params"), "picker")
    picker = registry.make_picker(
        _type(picker_cfg, "picker"), _mapping(picker_cfg.get("params"), "picker.params")
    )
    return Policy(name, filters, scorers, picker)


def _build_filters(value: Any, registry: PluginRegistry) -> list[Filter]:
    out = []
    for i, entry in enumerate(_list(value, "filters")):
        where = f"filters[{i}]"
        entry = _mapping(entry, where)
        _check_keys(entry, ("type", "params"), where)
        out.append(registry.make_filter(_type(entry, where), _mapping(entry.get("params"), where)))
    return out


def _build_scorer(entry: Any, i: int, registry: PluginRegistry) -> WeightedScorer:
    where = f"scorers[{i}]"
    entry = _mapping(entry, where)
    _check_keys(entry, ("type", "weight", "params"), where)
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise PolicyConfigError(f"{where}: 'weight' must be a number ≥ 0, not {weight!r}")
    scorer = registry.make_scorer(_type(entry, where), _mapping(entry.get("params"), where))
    return WeightedScorer(scorer, float(weight))


def _check_keys(mapping: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise PolicyConfigError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(allowed)}"
        )


def _type(entry: Mapping[str, Any], where: str) -> str:
    type_ = entry.get("type")
    if not isinstance(type_, str):
        raise PolicyConfigError(f"{where}: 'type' is required and must be a string")
    return type_


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PolicyConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PolicyConfigError(f"{where}: expected a list, got {type(value).__name__}")
    return list(value)
