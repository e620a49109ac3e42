"""The CRD's CEL rules, evaluated with cel-python: each fails on an invalid spec and passes on
a valid one, and admission (the webhook, `beamserve validate`) refuses the same spec."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import pytest
from beamserve.operator.admission import validate, validate_update
from beamserve.operator.api import BeamDeployment
from beamserve.operator.crd import CEL_RULES, CelRule

_spec = importlib.util.spec_from_file_location("_specs", Path(__file__).parent / "_specs.py")
assert _spec is not None and _spec.loader is not None
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)
D = S.DELETE

Spec = dict[str, Any]
SIM = S.disagg(engine={"name": "sim", "image": D}, prefill={"tp": 1}, decode={"tp": 1})


def _pool_case(role: str, pool: Spec, base: Spec | None = None) -> Spec:
    if base is None:
        base = S.aggregated() if role == "both" else S.disagg()
    return S.merge(base, {role: pool})


# rule id → (passing whole-object or spec, failing one); per-pool rules by a builder of role
CASES: dict[str, tuple[Spec, Spec]] = {
    "name-length": (S.obj(S.disagg(), "b" * 29), S.obj(S.disagg(), "b" * 30)),
    "pools-exclusive": (S.disagg(), S.disagg(both={"tp": 4})),
    "pools-present": (S.aggregated(), S.disagg(prefill=D)),
    "pool-roles-aggregated": (
        S.aggregated(both={"replicas": 4}, router={"disaggregation": {"poolRoles": {}}}),
        S.disagg(
            engine={"name": "vllm", "image": "v"}, router={"disaggregation": {"poolRoles": {}}}
        ),
    ),
    "model-source-one": (S.disagg(), S.disagg(model={"source": {"pvc": {"claimName": "m"}}})),
    "draft-source-one": (
        S.disagg(model={"draft": {"source": {"pvc": {"claimName": "d"}}}}),
        S.disagg(model={"draft": {"source": {}}}),
    ),
    "image-required": (S.merge(SIM, {}), S.disagg(engine={"image": D})),
    "draft-engine": (
        S.disagg(model={"draft": {"source": {"pvc": {"claimName": "d"}}}}),
        S.merge(SIM, {"model": {"draft": {"source": {"pvc": {"claimName": "d"}}}}}),
    ),
    "pair-attention-tp": (
        S.disagg(prefill={"tp": 4}, decode={"tp": 8}),
        S.disagg(model={"kvHeads": 24}, prefill={"tp": 8}, decode={"tp": 3}),
    ),
    "pair-page-size": (
        S.disagg(prefill={"kv": {"pageSize": 32}}, decode={"kv": {"pageSize": 32}}),
        S.disagg(decode={"kv": {"pageSize": 32}}),
    ),
    "pair-kv-dtype": (
        S.disagg(kv={"dtype": "fp8_e4m3"}),
        S.disagg(decode={"kv": {"dtype": "fp8_e4m3"}}),
    ),
    "sglang-decode-host-cache": (
        S.disagg(kv={"hostCacheGb": 64}, decode={"kv": {"hostCacheGb": 0}}),
        S.disagg(kv={"hostCacheGb": 64}),
    ),
    "router-sessions": (
        S.disagg(router={"replicas": 2, "sessionStore": {"type": "redis"}}),
        S.disagg(router={"replicas": 2}),
    ),
    "external-session-store": (
        S.disagg(router={"sessionStore": {"type": "external", "url": "redis://r:6379/0"}}),
        S.disagg(router={"sessionStore": {"type": "external"}}),
    ),
    "rollout-progress": (
        S.disagg(rollout={"maxSurge": 0, "maxUnavailable": 1}),
        S.disagg(rollout={"maxSurge": "0%", "maxUnavailable": 0}),
    ),
}
POOL_CASES: dict[str, Callable[[str], tuple[Spec, Spec]]] = {
    "pool-attention-dp": lambda r: (
        _pool_case(r, {"tp": 8, "attentionDp": 2}), _pool_case(r, {"attentionDp": 3})
    ),
    "pool-ports": lambda r: (
        _pool_case(r, {"ports": {"http": 9000}}), _pool_case(r, {"ports": {"kvEvents": 8000}})
    ),
    "kv-heads": lambda r: (_pool_case(r, {"tp": 16}), _pool_case(r, {"tp": 6})),
    "gpus-per-node": lambda r: (
        _pool_case(r, {"tp": 16, "nodesPerReplica": 2, "gpusPerNode": 8}),
        _pool_case(r, {"tp": 8, "gpusPerNode": 4}),
    ),
    "nodes-split": lambda r: (
        _pool_case(r, {"tp": 8, "nodesPerReplica": 2}),
        _pool_case(r, {"tp": 8, "nodesPerReplica": 3}),
    ),
    "cpu-single-node": lambda r: (
        _pool_case(r, {"tp": 1}, base=_sim_base(r)),
        _pool_case(r, {"tp": 1, "nodesPerReplica": 2}, base=_sim_base(r)),
    ),
    "chunk-pages": lambda r: (
        _pool_case(r, {"tuning": {"chunkedPrefillSize": 16384}}),
        _pool_case(r, {"tuning": {"chunkedPrefillSize": 1000}}),
    ),
}  # fmt: skip


def _sim_base(role: str) -> Spec:
    if role == "both":
        return S.aggregated(engine={"name": "sim", "image": D}, both={"tp": 1})
    return SIM


def _cases() -> list[tuple[CelRule, Spec, Spec]]:
    out = []
    for rule in CEL_RULES:
        if rule.transition:
            continue
        if rule.id in CASES:
            good, bad = CASES[rule.id]
        else:
            base, _, role = rule.id.rpartition("-")
            good, bad = POOL_CASES[base](role)
        out.append((rule, good, bad))
    return out


def _defaulted(doc: Spec) -> Spec:
    """What the API server stores (and CEL sees): the object with every default filled."""
    whole = doc if "spec" in doc else S.obj(doc)
    return BeamDeployment.model_validate(whole).to_json_dict()


def _eval(rule: CelRule, doc: Spec, old: Spec | None = None) -> bool | None:
    """The rule's verdict on `doc` (None: the rule's node is absent, so it is not checked)."""
    node: Any = _defaulted(doc)
    old_node: Any = _defaulted(old) if old is not None else None
    for part in rule.path:
        if part not in node:
            return None
        node = node[part]
        old_node = old_node[part] if old_node is not None else None
    env = celpy.Environment()
    program = env.program(env.compile(rule.rule))
    activation = {"self": celpy.json_to_cel(node)}
    if old_node is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_node)
    result = program.evaluate(activation)
    assert isinstance(result, celpy.celtypes.BoolType), f"{rule.id}: {result!r}"
    return bool(result)


def _field(rule: CelRule) -> str:
    return rule.message.split(":", 1)[0]


@pytest.mark.parametrize(("rule", "good", "bad"), _cases(), ids=[c[0].id for c in _cases()])
def test_rule_passes_and_fails(rule: CelRule, good: Spec, bad: Spec) -> None:
    assert validate(good) == [], [str(v) for v in validate(good)]
    assert _eval(rule, good) in (True, None)
    assert _eval(rule, bad) is False
    # admission (a superset) refuses the same object, naming the rule's field
    field = _field(rule)
    found = validate(bad)
    assert any(
        v.path.startswith(field) or v.path.rsplit(".", 1)[-1] == field.rsplit(".", 1)[-1]
        for v in found
    ), (field, [str(v) for v in found])


def test_transition_rule() -> None:
    (rule,) = [r for r in CEL_RULES if r.transition]
    old, same, switched = S.disagg(), S.disagg(decode={"replicas": 3}), S.aggregated()
    assert _eval(rule, same, old) is True
    assert _eval(rule, switched, old) is False
    assert any(v.path == _field(rule) for v in validate_update(old, switched))


def test_every_rule_has_cases_and_names_a_field() -> None:
    ids = {r.id for r in CEL_RULES}
    assert len(ids) == len(CEL_RULES)
    for rule in CEL_RULES:
        assert _field(rule).startswith(("spec", "metadata")), rule.message


def test_rules_hold_on_the_examples() -> None:
    for path in S.EXAMPLES:
        doc = S.load_example(path)
        for rule in CEL_RULES:
            if not rule.transition:
                assert _eval(rule, doc) in (True, None), (path.name, rule.id)
