"""Properties over generated specs: a spec that validates always renders every pool's command
(and its pair passes the launchers' check); the CEL rules are a subset of admission."""

from __future__ import annotations

import functools
from typing import Any

import celpy
from beamserve.operator.admission import _model_config, validate
from beamserve.operator.api import BeamDeployment, BeamDeploymentSpec
from beamserve.operator.crd import CEL_RULES
from beamserve.operator.pools import launch_spec, pool_command
from beamserve.workers.launch import check_pair_compat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENGINES = ("sglang", "vllm", "sim", "ref")
IMAGES = {"sglang": "lmsysorg/sglang:v0.5.23", "vllm": "vllm/vllm-openai:v0.33.0"}


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def pools(draw: st.DrawFn, *, gpu: bool, wild: bool) -> dict[str, Any]:
    tp = draw(st.sampled_from((1, 2, 3, 4, 6, 8, 16, 32) if wild else (1, 2, 4, 8, 16)))
    pool: dict[str, Any] = {"tp": tp, "replicas": draw(st.integers(0, 4))}
    if wild or gpu:
        pool["attentionDp"] = draw(st.sampled_from((1, 2, 4)) if wild else st.just(1))
        pool["ep"] = draw(st.sampled_from((1, 2, 4, 8)) if wild else st.sampled_from((1, tp)))
    if gpu or wild:
        nodes = draw(st.sampled_from((1, 2)))
        if wild or tp % nodes == 0:
            pool["nodesPerReplica"] = nodes
        if wild and draw(st.booleans()):
            pool["gpusPerNode"] = draw(st.integers(0, 16))
    if draw(st.booleans()):
        pool["kv"] = {"pageSize": draw(st.sampled_from((16, 32, 64)))}
    if gpu and draw(st.booleans()):
        tuning: dict[str, Any] = {"maxRunningRequests": draw(st.integers(1, 256))}
        if draw(st.booleans()):
            tuning["chunkedPrefillSize"] = draw(st.sampled_from((4096, 8192, 1000)))
        if draw(st.booleans()):
            tuning["memoryFraction"] = draw(st.floats(0.5, 0.95))
        pool["tuning"] = tuning
    if draw(st.booleans()):
        pool["ports"] = {
            "http": draw(st.sampled_from((8000, 8080, 5557))),
            "bootstrap": draw(st.sampled_from((8998, 8000))),
        }
    if draw(st.booleans()):
        pool["extraArgs"] = draw(st.sampled_from((["--log-level", "debug"], ["--port", "1"])))
    return pool


@st.composite
def specs(draw: st.DrawFn, *, wild: bool) -> dict[str, Any]:
    engine = draw(st.sampled_from(ENGINES))
    gpu = engine in IMAGES
    spec: dict[str, Any] = {
        "model": {
            "source": {"hostPath": {"path": "/mnt/beam"}},
            "kvHeads": draw(st.sampled_from((1, 2, 4, 8, 16) if wild else (8,))),
            "format": draw(st.sampled_from(("bf16", "fp8", "nvfp4"))),
        },
        "engine": {"name": engine},
        "kv": {
            "transferBackend": draw(st.sampled_from(("nixl", "mooncake"))),
            "pageSize": draw(st.sampled_from((16, 32, 64))),
            "dtype": draw(st.sampled_from(("bf16", "fp8_e4m3"))),
            "hostCacheGb": draw(st.sampled_from((0, 0, 16))),
        },
    }
    if gpu or (wild and draw(st.booleans())):
        spec["engine"]["image"] = IMAGES.get(engine, "img")
    if gpu and draw(st.booleans()):
        spec["model"]["draft"] = {
            "source": {"pvc": {"claimName": "draft"}},
            "blockSize": draw(st.integers(2, 16)),
        }
    if draw(st.booleans()):
        spec["model"]["contextLength"] = draw(st.sampled_from((8, 4096, 1048576)))
    if draw(st.booleans()):
        spec["both"] = draw(pools(gpu=gpu, wild=wild))
    else:
        spec["prefill"] = draw(pools(gpu=gpu, wild=wild))
        spec["decode"] = draw(pools(gpu=gpu, wild=wild))
    if draw(st.booleans()):
        spec["router"] = {
            "replicas": draw(st.integers(0, 3)),
            "sessionStore": {"type": draw(st.sampled_from(("memory", "redis")))},
        }
    return spec


@functools.cache
def _programs() -> list[tuple[Any, Any]]:
    env = celpy.Environment()
    rules = [rule for rule in CEL_RULES if not rule.transition]
    return [(rule, env.program(env.compile(rule.rule))) for rule in rules]


def _cel_failures(spec: dict[str, Any]) -> list[str]:
    doc = BeamDeployment.model_validate(
        {"apiVersion": "beamserve.io/v1alpha1", "kind": "BeamDeployment",
         "metadata": {"name": "beam"}, "spec": spec}
    ).to_json_dict()  # fmt: skip
    failed = []
    for rule, program in _programs():
        node: Any = doc
        for part in rule.path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        result = program.evaluate({"self": celpy.json_to_cel(node)})
        if not isinstance(result, celpy.celtypes.BoolType) or not result:
            failed.append(rule.id)
    return failed


def _renders(spec_dict: dict[str, Any]) -> None:
    spec = BeamDeploymentSpec.model_validate(spec_dict)
    for role in spec.pools():
        cmd = pool_command(spec, role)
        assert cmd.argv and cmd.port == spec.pools()[role].ports.http
        assert str(spec.page_size(role)) in cmd.argv
    if spec.prefill is not None and spec.engine.name in IMAGES:
        check_pair_compat(
            launch_spec(spec, "prefill"), launch_spec(spec, "decode"), _model_config(spec)
        )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(wild=True))
def test_a_spec_that_validates_renders_and_cel_is_a_subset(spec: dict[str, Any]) -> None:
    found = validate(spec)
    cel = _cel_failures(spec)
    if not found:
        _renders(spec)
        assert cel == [], cel  # what admission admits, CEL admits
        # the webhook sees what the API server stores: every default filled in
        filled = BeamDeploymentSpec.model_validate(spec).to_json_dict()
        assert validate(filled) == [], [str(v) for v in validate(filled)]
    if cel:
        assert found, f"CEL refuses ({cel}) what admission admits"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(wild=False))
def test_well_formed_specs_mostly_validate_and_always_render(spec: dict[str, Any]) -> None:
    found = validate(spec)
    if not found:
        _renders(spec)
