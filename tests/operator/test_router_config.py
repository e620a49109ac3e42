"""`beamserve router --config FILE`: the BeamDeployment's `spec.router` as the router's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from beamserve.operator.api import BeamDeploymentSpec, RouterConfig
from beamserve.operator.router_config import (
    RouterConfigError,
    apply_router_config,
    dump_router_config,
    load_router_config,
    router_flags,
)
from beamserve.router.flow.controller import FlowConfig, PrefillSpill
from beamserve.router.flow.saturation import SaturationConfig
from beamserve.router.policy import build_policy
from beamserve.router.policy.disagg import ConditionalDisaggregation

from beamserve.cli import build_parser

CONFIG = {
    "port": 9000,
    "grpcPort": 9002,
    "policy": "weighted",
    "flowControl": {"maxQueued": 100, "ttlSeconds": 5},
    "disaggregation": {"minUncachedTokens": 4096},
    "sessionStore": {"type": "external", "url": "redis://redis:6379/0"},
    "replicas": 2,
}


def _args(tmp_path: Path, *flags: str) -> object:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    argv = ["router", "--endpoints", "[]", "--config", str(path), *flags]
    return apply_router_config(build_parser().parse_args(argv))


def test_the_file_fills_the_flags(tmp_path: Path) -> None:
    args = _args(tmp_path)
    assert args.port == 9000 and args.grpc_port == 9002  # type: ignore[attr-defined]
    assert args.policy == "weighted"  # type: ignore[attr-defined]
    assert args.redis == "redis://redis:6379/0"  # type: ignore[attr-defined]
    assert args.flow["max_queued"] == 100  # type: ignore[attr-defined]


def test_replica_sync_settings_reach_the_router(tmp_path: Path) -> None:
    args = _args(tmp_path)
    assert args.replica_sync is True and args.sync_channel is None  # type: ignore[attr-defined]
    path = tmp_path / "sync.yaml"
    path.write_text(
        yaml.safe_dump({**CONFIG, "replicaSync": {"enabled": False, "channel": "team-a:sync"}})
    )
    argv = ["router", "--endpoints", "[]", "--config", str(path)]
    off = apply_router_config(build_parser().parse_args(argv))
    assert off.replica_sync is False  # type: ignore[attr-defined]
    assert off.sync_channel == "team-a:sync"  # type: ignore[attr-defined]
    # and the runtime is built from them (no sync, the named channel kept for when it is on)
    from beamserve.router.cli import runtime_config

    cfg = runtime_config(off)
    assert cfg.replica_sync is False and cfg.sync_channel == "team-a:sync"


def test_flags_override_the_file(tmp_path: Path) -> None:
    args = _args(tmp_path, "--port", "9100", "--policy", "round-robin", "--redis", "redis://x")
    assert args.port == 9100  # type: ignore[attr-defined]
    assert args.policy == "round-robin"  # type: ignore[attr-defined]
    assert args.redis == "redis://x"  # type: ignore[attr-defined]
    assert args.flow["ttl_s"] == 5  # type: ignore[attr-defined]


def test_the_router_accepts_what_the_file_becomes() -> None:
    flags = router_flags(RouterConfig.model_validate(CONFIG))
    FlowConfig.from_mapping(flags["flow"])
    SaturationConfig.from_mapping(flags["saturation"])
    ConditionalDisaggregation.from_params(flags["disaggregation"])
    assert FlowConfig.from_mapping(flags["flow"]).hold_continuing is False  # the default
    held = {**CONFIG, "flowControl": {"holdContinuing": True}}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(held))["flow"])
    assert flow.hold_continuing is True
    default_live = FlowConfig().live_session_s
    assert FlowConfig.from_mapping(flags["flow"]).live_session_s == default_live
    live = {**CONFIG, "flowControl": {"liveSessionSeconds": 45}}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(live))["flow"])
    assert flow.live_session_s == 45
    assert FlowConfig.from_mapping(flags["flow"]).prefill_gate_lead is False  # the default
    lead = {**CONFIG, "flowControl": {"prefillGateLead": True}}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(lead))["flow"])
    assert flow.prefill_gate_lead is True
    default_lull = FlowConfig().prefill_lull_longest_first_s
    assert FlowConfig.from_mapping(flags["flow"]).prefill_lull_longest_first_s == default_lull
    for lull in (3.5, None):
        spec = {**CONFIG, "flowControl": {"prefillLullLongestFirstSeconds": lull}}
        flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(spec))["flow"])
        assert flow.prefill_lull_longest_first_s == lull
    assert FlowConfig.from_mapping(flags["flow"]).prefill_lull_rescue_s == 45.0  # the default
    for rescue in (50.0, None):
        spec = {**CONFIG, "flowControl": {"prefillLullRescueSeconds": rescue}}
        flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(spec))["flow"])
        assert flow.prefill_lull_rescue_s == rescue
    default = FlowConfig()
    flow = FlowConfig.from_mapping(flags["flow"])
    assert (flow.prefill_spill_lull_below_peak, flow.prefill_spill_lull_peak_s) == (
        default.prefill_spill_lull_below_peak,
        default.prefill_spill_lull_peak_s,
    )
    drain = {"prefillSpillLullBelowPeak": None, "prefillSpillLullPeakSeconds": 30}
    spec = {**CONFIG, "flowControl": drain}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(spec))["flow"])
    assert (flow.prefill_spill_lull_below_peak, flow.prefill_spill_lull_peak_s) == (None, 30)
    off = {**CONFIG, "flowControl": {"liveSessionSeconds": None}}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(off))["flow"])
    assert flow.live_session_s is None
    lifo = {**CONFIG, "flowControl": {"lifoAfterSeconds": None, "lifoMaxWaitSeconds": 20}}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(lifo))["flow"])
    assert (flow.lifo_after_s, flow.lifo_max_wait_s) == (None, 20)
    assert FlowConfig.from_mapping(flags["flow"]).lifo_after_s == 2.0  # the default
    assert FlowConfig.from_mapping(flags["flow"]).prefill_piece_yield_tokens is None  # off
    yields = {"prefillPieceYieldTokens": 2048, "prefillPieceYieldMaxSeconds": 0.25}
    spec = {**CONFIG, "flowControl": yields}
    flow = FlowConfig.from_mapping(router_flags(RouterConfig.model_validate(spec))["flow"])
    assert (flow.prefill_piece_yield_tokens, flow.prefill_piece_yield_max_s) == (2048, 0.25)
    assert SaturationConfig.from_mapping(flags["saturation"]).cap_workers_at_threshold
    raw = {**CONFIG, "saturation": {"capWorkersAtThreshold": False}}
    flags_raw = router_flags(RouterConfig.model_validate(raw))
    assert SaturationConfig.from_mapping(flags_raw["saturation"]).cap_workers_at_threshold is False

    def spill_rule(flow_control: dict[str, Any]) -> PrefillSpill:
        spec = RouterConfig.model_validate({**CONFIG, "flowControl": flow_control})
        rule = FlowConfig.from_mapping(router_flags(spec)["flow"]).prefill_spill()
        assert rule is not None
        return rule

    rule = spill_rule(
        {
            "prefillSpillAfterSeconds": 0.3,
            "prefillSpillTokensPerSecond": 90000,
            "prefillSpillUserTokensPerSecond": 14,
        }
    )
    assert (rule.after_s, rule.prefill_tok_s, rule.user_tok_s) == (0.3, 90000, 14)
    assert rule.lull_s is None  # the lull: off by default
    rule = spill_rule(
        {
            "prefillSpillAfterSeconds": 0.3,
            "prefillSpillMaxTokens": 98304,
            "prefillSpillLullSeconds": 2,
            "prefillSpillLullUserTokensPerSecond": 6,
        }
    )
    # the spill's own bound: prefillSpillLullMaxTokens left null
    assert (rule.lull_s, rule.lull_user_tok_s, rule.lull_max_tokens) == (2, 6, 98304)
    lined = {
        **CONFIG,
        "disaggregation": {
            "poolRoles": {"spillAtSessionsPerWorker": 24, "spillStopBelowSessionsPerWorker": 0}
        },
    }
    disagg = router_flags(RouterConfig.model_validate(lined))["disaggregation"]
    roles = ConditionalDisaggregation.from_params(disagg).params.pool_roles
    assert roles is not None and roles.spill_at_sessions_per_worker == 24
    assert roles.spill_stop_below == 0
    drained = {
        **CONFIG,
        "disaggregation": {
            "poolRoles": {"drainQuietSeconds": 3, "drainBelowPeak": None, "drainMoveMargin": 1}
        },
    }
    disagg = router_flags(RouterConfig.model_validate(drained))["disaggregation"]
    roles = ConditionalDisaggregation.from_params(disagg).params.pool_roles
    assert roles is not None
    assert (roles.drain_quiet_s, roles.drain_below_peak, roles.drain_move_margin) == (3, None, 1)
    assert roles.drain_max_prefill_tokens == 8192
    build_policy(flags["policy"])


def test_the_crd_section_is_the_file(tmp_path: Path) -> None:
    spec = BeamDeploymentSpec.model_validate(
        {"model": {"source": {"hostPath": {"path": "/m"}}}, "engine": {"name": "sim"},
         "both": {}, "router": CONFIG}
    )  # fmt: skip
    path = tmp_path / "configmap.json"
    path.write_text(dump_router_config(spec.router))
    loaded = load_router_config(path)
    assert RouterConfig.model_validate(loaded.to_json_dict()) == spec.router


def test_bad_files_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("flowControl: {maxQueue: 3}\n")
    with pytest.raises(RouterConfigError, match=r"flowControl\.maxQueue"):
        load_router_config(path)
    path.write_text("port: '80'\n")
    with pytest.raises(RouterConfigError, match="port"):
        load_router_config(path)
    from beamserve.cli import main

    assert main(["router", "--endpoints", "[]", "--config", str(path)]) == 2


def test_the_operators_configmap_loads(tmp_path: Path) -> None:
    """What desired_objects writes into the router's ConfigMap is what --config reads."""
    from beamserve.operator.api import BeamDeployment
    from beamserve.operator.desired import router_config_dict

    bd = BeamDeployment.model_validate(
        {"metadata": {"name": "beam", "namespace": "ns"},
         "spec": {"model": {"source": {"hostPath": {"path": "/m"}}, "servedName": "b1"},
                  "engine": {"name": "sim"}, "both": {}, "router": CONFIG}}
    )  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(router_config_dict(bd, "ns")))
    argv = ["router", "--kubernetes", "beam", "--config", str(path)]
    args = apply_router_config(build_parser().parse_args(argv))
    assert args.served_model_name == ["b1"]  # type: ignore[attr-defined]
    assert args.namespace == "ns"  # type: ignore[attr-defined]
    assert args.port == 9000  # type: ignore[attr-defined]
    other = ["router", "--kubernetes", "other", "--config", str(path)]
    with pytest.raises(RouterConfigError, match="--kubernetes"):
        apply_router_config(build_parser().parse_args(other))
