"""`beamserve router --config FILE`: a `RouterConfig` file (YAML or JSON) as the router's flags.

The file is what a BeamDeployment's `spec.router` holds and what the operator writes into the
router's ConfigMap (`api.RouterConfig`, camelCase keys, unknown keys refused). Flags given on
the command line override it: a flag whose value still equals its parser default is filled from
the file (so spelling a flag out with its default value does not override the file).

The file may also name the served model (`servedModelName`) and the namespace the workers
are discovered in (`discovery.kubernetes`: `deployment` must agree with `--kubernetes`, which
stays a flag, as do `--endpoints` and `--local-runtime`). What a file cannot carry stays a
flag: the Redis URL of a managed or secret-held store (`--redis`, which the
operator passes from the Secret or its Redis Service), and the API keys (`--api-keys FILE`,
mounted from `apiKeysSecretRef`). Deployment-shape fields (`replicas`, `image`, `resources`,
`nodeSelector`) are the operator's and ignored here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from beamserve.operator.api import RouterConfig, _Model
from pydantic import ValidationError

DEFAULTS_DEST = "router_flag_defaults"
"""The `argparse` dest where `beamserve router` records its flags' defaults."""


class KubernetesDiscoverySpec(_Model):
    deployment: str
    namespace: str | None = None


class DiscoverySpec(_Model):
    kubernetes: KubernetesDiscoverySpec | None = None


class RouterConfigFile(RouterConfig):
    """The file: a `RouterConfig` plus what the operator knows beyond `spec.router` (where the
    workers are, the served model name). The Deployment-shape fields may be left out."""

    discovery: DiscoverySpec | None = None
    served_model_name: str | list[str] | None = None


class RouterConfigError(ValueError):
    """A router config file that cannot be used; the message names the field and the fix."""


def load_router_config(path: Path) -> RouterConfigFile:
    """Parse `path` (YAML or JSON); raise `RouterConfigError` listing every problem."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RouterConfigError(f"{path}: cannot read it: {exc}") from None
    try:
        return RouterConfigFile.model_validate(raw or {}, by_alias=True, by_name=False)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        ]
        detail = "\n  ".join(lines)
        raise RouterConfigError(f"{path}: invalid router config:\n  {detail}") from None


def _pool_roles(config: RouterConfig) -> dict[str, Any]:
    """`disaggregation.pool_roles` of the router's `--disaggregation` (absent: fixed roles)."""
    r = config.disaggregation.pool_roles
    if r is None:
        return {}
    return {
        "pool_roles": {
            "prefill_workers": r.prefill_workers,
            "split_at_sessions_per_worker": r.split_at_sessions_per_worker,
            "colocate_below_sessions_per_worker": r.colocate_below_sessions_per_worker,
            "settle_s": r.settle_seconds,
            "spill_at_sessions_per_worker": r.spill_at_sessions_per_worker,
            "spill_stop_below_sessions_per_worker": r.spill_stop_below_sessions_per_worker,
            "drain_quiet_s": r.drain_quiet_seconds,
            "drain_below_peak": r.drain_below_peak,
            "drain_move_margin": r.drain_move_margin,
            "drain_max_prefill_tokens": r.drain_max_prefill_tokens,
        }
    }


def router_flags(config: RouterConfig) -> dict[str, Any]:
    """The `beamserve router` argument values (argparse dests) `config` stands for."""
    out: dict[str, Any] = {
        "port": config.port,
        "policy": config.policy_config if config.policy_config is not None else config.policy,
        "disaggregation": {
            "enabled": config.disaggregation.enabled,
            "min_uncached_tokens": config.disaggregation.min_uncached_tokens,
            "max_cached_ratio": config.disaggregation.max_cached_ratio,
            "keep_warm_local": config.disaggregation.keep_warm_local,
            **_pool_roles(config),
        },
        "flow": {
            "max_queued": config.flow_control.max_queued,
            "ttl_s": config.flow_control.ttl_seconds,
            "las_half_life_s": config.flow_control.las_half_life_seconds,
            "retry_after_max_s": config.flow_control.retry_after_max_seconds,
            "drain_window_s": config.flow_control.drain_window_seconds,
            "hold_continuing": config.flow_control.hold_continuing,
            "live_session_s": config.flow_control.live_session_seconds,
            "lifo_after_s": config.flow_control.lifo_after_seconds,
            "lifo_max_wait_s": config.flow_control.lifo_max_wait_seconds,
            "prefill_gate_tokens": config.flow_control.prefill_gate_tokens,
            "prefill_gate_lead": config.flow_control.prefill_gate_lead,
            "prefill_sjf_window_s": config.flow_control.prefill_sjf_window_seconds,
            "prefill_lull_longest_first_s": (
                config.flow_control.prefill_lull_longest_first_seconds
            ),
            "prefill_lull_rescue_s": config.flow_control.prefill_lull_rescue_seconds,
            "prefill_spill_after_s": config.flow_control.prefill_spill_after_seconds,
            "prefill_spill_max_tokens": config.flow_control.prefill_spill_max_tokens,
            "prefill_spill_margin_s": config.flow_control.prefill_spill_margin_seconds,
            "prefill_spill_tok_s": config.flow_control.prefill_spill_tokens_per_second,
            "prefill_spill_user_tok_s": config.flow_control.prefill_spill_user_tokens_per_second,
            "prefill_spill_lull_s": config.flow_control.prefill_spill_lull_seconds,
            "prefill_spill_lull_user_tok_s": (
                config.flow_control.prefill_spill_lull_user_tokens_per_second
            ),
            "prefill_spill_lull_max_tokens": config.flow_control.prefill_spill_lull_max_tokens,
            "prefill_spill_lull_below_peak": config.flow_control.prefill_spill_lull_below_peak,
            "prefill_spill_lull_peak_s": config.flow_control.prefill_spill_lull_peak_seconds,
            "prefill_piece_min_tokens": config.flow_control.prefill_piece_min_tokens,
            "prefill_piece_tokens": config.flow_control.prefill_piece_tokens,
            "prefill_first_pieces": config.flow_control.prefill_first_pieces,
            "prefill_first_piece_tokens": config.flow_control.prefill_first_piece_tokens,
            "prefill_piece_yield_tokens": config.flow_control.prefill_piece_yield_tokens,
            "prefill_piece_yield_max_s": config.flow_control.prefill_piece_yield_max_seconds,
            "pace_hold_tokens": config.flow_control.pace_hold_tokens,
            "pace_hold_max_s": config.flow_control.pace_hold_max_seconds,
            "pace_hold_user_tok_s": config.flow_control.pace_hold_user_tokens_per_second,
            "pace_hold_prefill_tok_s": config.flow_control.pace_hold_prefill_tokens_per_second,
        },
        "saturation": {
            "max_prefill_tokens": config.saturation.max_prefill_tokens,
            "max_queue_len": config.saturation.max_queue_len,
            "max_kv_usage": config.saturation.max_kv_usage,
            "stale_after_s": config.saturation.stale_after_seconds,
            "max_decode_itl_s": config.saturation.max_decode_itl_seconds,
            "cap_workers_at_threshold": config.saturation.cap_workers_at_threshold,
        },
        "max_body_bytes": config.max_body_bytes,
        "scrape_interval_s": config.scrape_interval_seconds,
        "prefill_timeout_s": config.prefill_timeout_seconds,
        "replica_sync": config.replica_sync.enabled,
    }
    if config.replica_sync.channel is not None:
        out["sync_channel"] = config.replica_sync.channel
    if config.grpc_port is not None:
        out["grpc_port"] = config.grpc_port
    if config.session_store.type == "external" and config.session_store.url is not None:
        out["redis"] = config.session_store.url
    if isinstance(config, RouterConfigFile):
        if config.served_model_name is not None:
            names = config.served_model_name
            out["served_model_name"] = [names] if isinstance(names, str) else list(names)
        kube = config.discovery.kubernetes if config.discovery is not None else None
        if kube is not None and kube.namespace is not None:
            out["namespace"] = kube.namespace
    return out


def apply_router_config(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every flag left at its default taken from `args.config` (when set)."""
    path = getattr(args, "config", None)
    if path is None:
        return args
    defaults: dict[str, Any] = getattr(args, DEFAULTS_DEST, None) or {}
    merged = argparse.Namespace(**vars(args))
    config = load_router_config(Path(path))
    kube = config.discovery.kubernetes if config.discovery is not None else None
    if kube is not None and kube.deployment != getattr(args, "kubernetes", None):
        raise RouterConfigError(
            f"{path}: discovery.kubernetes.deployment is {kube.deployment!r} but the router "
            f"was started with --kubernetes {getattr(args, 'kubernetes', None)!r}; make them agree"
        )
    for dest, value in router_flags(config).items():
        if dest not in defaults or getattr(args, dest, None) == defaults[dest]:
            setattr(merged, dest, value)
    return merged


def dump_router_config(config: RouterConfig) -> str:
    """The ConfigMap's file: `config` as JSON (YAML's subset), camelCase, defaults included."""
    return json.dumps(config.to_json_dict(), indent=2, sort_keys=True) + "\n"
