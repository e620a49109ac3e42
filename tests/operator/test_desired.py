"""`desired_objects`: the objects a BeamDeployment becomes (pure; no API server).

Every built-in object is validated against the Kubernetes 1.27 OpenAPI schemas
(`kubernetes-validate`'s, strict: unknown fields are errors); the custom resources against
the upstream CRDs' schemas (tests/operator/crds/, `jsonschema`; tests/operator/_validate.py).
Hypothesis draws specs the admission rules accept; the examples in manifests/examples are
rendered too.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from beamserve.operator.admission import validate
from beamserve.operator.desired import (
    LABEL_REVISION,
    LABEL_ROLE,
    ClusterFacts,
    RenderError,
    desired_objects,
    merge_pod_template,
    parse_deployment,
    revision,
)
from beamserve.router import discovery
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

_path = Path(__file__).resolve().parent / "_specs.py"
_spec = importlib.util.spec_from_file_location("operator_specs", _path)
assert _spec is not None and _spec.loader is not None
_specs = sys.modules.setdefault("operator_specs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_specs)

_vpath = Path(__file__).resolve().parent / "_validate.py"
_vspec = importlib.util.spec_from_file_location("operator_validate", _vpath)
assert _vspec is not None and _vspec.loader is not None
_validate = sys.modules.setdefault("operator_validate", importlib.util.module_from_spec(_vspec))
_vspec.loader.exec_module(_validate)
check_object = _validate.check_object


def render(doc: dict[str, Any], facts: ClusterFacts | None = None) -> list[dict[str, Any]]:
    bd = parse_deployment(doc)
    return desired_objects(bd, facts or ClusterFacts.everything())


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


# -- the examples -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", _specs.EXAMPLES, ids=lambda p: p.name)
def test_examples_render_valid_objects(path: Path) -> None:
    doc = _specs.load_example(path)
    objs = render(doc)
    assert objs
    for obj in objs:
        check_object(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), names


def test_multinode_is_a_leader_worker_set_whose_service_selects_leaders() -> None:
    doc = _specs.load_example(_specs.REPO / "manifests/examples/beam-multinode.yaml")
    objs = render(doc)
    (lws,) = by_kind(objs, "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    argv = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert "$(LWS_LEADER_ADDRESS):39746" in argv["command"]
    svc = next(
        o for o in by_kind(objs, "Service") if o["metadata"]["name"] == lws["metadata"]["name"]
    )
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    with pytest.raises(RenderError, match="LeaderWorkerSet"):
        render(doc, ClusterFacts())


def test_pool_service_carries_what_router_discovery_watches() -> None:
    objs = render(_specs.obj(_specs.disagg()))
    services = by_kind(objs, "Service")
    workers = [s for s in services if discovery.LABEL_DEPLOYMENT in s["metadata"]["labels"]]
    assert {s["metadata"]["labels"][discovery.LABEL_ROLE] for s in workers} == {"prefill", "decode"}
    for svc in workers:
        labels = svc["metadata"]["labels"]
        assert labels[discovery.LABEL_DEPLOYMENT] == "beam"
        assert labels[discovery.LABEL_ENGINE] == "sglang"
        assert labels[discovery.LABEL_REVISION]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {discovery.PORT_HTTP, discovery.PORT_KV_EVENTS, discovery.PORT_KV_REPLAY} <= ports
        assert svc["spec"]["clusterIP"] == "None"
    # the router and Redis Services are not workers: discovery must not see them
    others = [s for s in services if s not in workers]
    assert {s["metadata"]["name"] for s in others} == {"beam-router"}


def test_kv_incompatible_change_makes_new_pool_names_and_compatible_change_does_not() -> None:
    base = _specs.disagg()
    rev = revision(parse_deployment(_specs.obj(base)).spec)
    for change in (
        {"kv": {"pageSize": 32}},
        {"kv": {"dtype": "fp8_e4m3"}},
        {"engine": {"image": "lmsysorg/sglang:v0.5.24"}},
        {"model": {"format": "fp8"}},
    ):
        spec = _specs.merge(base, change)
        assume_valid = validate(_specs.obj(spec))
        assert assume_valid == [], (change, assume_valid)
        assert revision(parse_deployment(_specs.obj(spec)).spec) != rev, change
    for change in ({"decode": {"replicas": 3}}, {"router": {"replicas": 2}}):
        spec = _specs.merge(base, change)
        assert revision(parse_deployment(_specs.obj(spec)).spec) == rev, change
    objs = render(_specs.obj(base))
    pools = [o for o in objs if LABEL_REVISION in o["metadata"]["labels"]]
    assert pools and all(o["metadata"]["name"].endswith(rev) for o in pools)


def test_owner_references_only_with_a_uid() -> None:
    doc = _specs.obj(_specs.disagg())
    assert all("ownerReferences" not in o["metadata"] for o in render(doc))
    doc["metadata"]["uid"] = "0b7c8a1e-0000-4000-8000-000000000001"
    for o in render(doc):
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "beamserve.io/v1alpha1",
            "kind": "BeamDeployment",
            "name": "beam",
            "uid": doc["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_managed_redis_and_optional_apis() -> None:
    doc = _specs.obj(_specs.disagg(router={"grpcPort": 9002, "sessionStore": {"type": "redis"}}))
    objs = render(doc)
    assert [o["metadata"]["name"] for o in by_kind(objs, "Deployment")].count("beam-redis") == 1
    router = next(o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == "beam-router")
    argv = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--redis") + 1] == "redis://beam-redis.default.svc:6379/0"
    (pool,) = by_kind(objs, "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}
    assert len(by_kind(objs, "ServiceMonitor")) == 3  # prefill, decode, router
    bare = desired_objects(parse_deployment(doc), ClusterFacts(pdb_api_version="policy/v1beta1"))
    assert not by_kind(bare, "InferencePool") and not by_kind(bare, "ServiceMonitor")
    assert {o["apiVersion"] for o in by_kind(bare, "PodDisruptionBudget")} == {"policy/v1beta1"}


def test_scaler_replicas_override_the_spec() -> None:
    doc = _specs.obj(_specs.disagg(decode={"replicas": 2}))
    objs = desired_objects(parse_deployment(doc), ClusterFacts(), replicas={"decode": 7})
    decode = next(
        o
        for o in by_kind(objs, "Deployment")
        if o["metadata"]["labels"].get("beamserve.io/role") == "decode"
    )
    assert decode["spec"]["replicas"] == 7


def test_pod_template_override_merges_by_name_and_keeps_selector_labels() -> None:
    base = {
        "metadata": {"labels": {"a": "1"}},
        "spec": {"containers": [{"name": "engine", "image": "x", "env": [{"name": "A"}]}]},
    }
    over = {
        "metadata": {"labels": {"b": "2"}},
        "spec": {
            "containers": [
                {"name": "engine", "env": [{"name": "B", "value": "1"}]},
                {"name": "side", "image": "y"},
            ]
        },
    }
    out = merge_pod_template(base, over)
    assert out["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert [c["name"] for c in out["spec"]["containers"]] == ["engine", "side"]
    assert out["spec"]["containers"][0]["env"] == [{"name": "A"}, {"name": "B", "value": "1"}]
    assert base["spec"]["containers"][0]["env"] == [{"name": "A"}]  # not mutated


# -- generated specs ----------------------------------------------------------------------------


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    engine = draw(st.sampled_from(["sim", "ref", "sglang", "vllm"]))
    gpu = engine in ("sglang", "vllm")
    spec: dict[str, Any] = {
        "model": {"source": draw(st.sampled_from(_SOURCES))},
        "engine": {"name": engine},
    }
    if gpu:
        spec["engine"]["image"] = f"example.com/{engine}:v1"
    else:
        spec["engine"]["api"] = draw(st.sampled_from(["vllm", "sglang"]))
    tps = [1, 2, 4, 8] if gpu else [1]
    if draw(st.booleans()):
        spec["both"] = {"replicas": draw(st.integers(0, 4)), "tp": draw(st.sampled_from(tps))}
    else:
        for role in ("prefill", "decode"):
            spec[role] = {"replicas": draw(st.integers(0, 4)), "tp": draw(st.sampled_from(tps))}
    spec["kv"] = {"pageSize": draw(st.sampled_from([16, 32, 64]))}
    store = draw(st.sampled_from(["memory", "redis", "external"]))
    spec["router"] = {"replicas": draw(st.integers(0, 3)), "sessionStore": {"type": store}}
    if store == "external":
        spec["router"]["sessionStore"]["url"] = "redis://redis.example:6379/0"
    if draw(st.booleans()):
        spec["router"]["grpcPort"] = 9002
    spec["monitoring"] = {
        "enabled": draw(st.booleans()),
        "kind": draw(st.sampled_from(["ServiceMonitor", "PodMonitor"])),
    }
    if draw(st.booleans()):
        spec["rollout"] = {"maxUnavailable": 1, "maxSurge": 0}
    return spec


_SOURCES = [
    {"hostPath": {"path": "/mnt/beam"}},
    {"pvc": {"claimName": "beam", "subPath": "v1"}},
    {"download": {"uri": "hf://reflection/beam@main", "credentialsSecret": "hf"}},
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), name=st.sampled_from(["beam", "b", "beam-prod-01"]), everything=st.booleans())
def test_generated_specs_render_valid_objects(
    spec: dict[str, Any], name: str, everything: bool
) -> None:
    doc = _specs.obj(spec, name=name)
    assume(validate(doc) == [])
    facts = ClusterFacts.everything() if everything else ClusterFacts()
    first = desired_objects(parse_deployment(copy.deepcopy(doc)), facts)
    assert first == desired_objects(parse_deployment(copy.deepcopy(doc)), facts)  # deterministic
    for obj in first:
        check_object(obj)
        assert len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == name
    names = [(o["kind"], o["metadata"]["name"]) for o in first]
    assert len(names) == len(set(names))
    roles = {"both"} if "both" in spec else {"prefill", "decode"}
    workloads = [o for o in first if o["metadata"]["labels"].get("beamserve.io/role") in roles]
    assert {o["metadata"]["labels"]["beamserve.io/role"] for o in workloads} == roles
    for role in roles:
        kinds = sorted(
            o["kind"] for o in workloads if o["metadata"]["labels"]["beamserve.io/role"] == role
        )
        assert kinds == ["Deployment", "PodDisruptionBudget", "Service"]
    json.dumps(first)  # plain JSON: what server-side apply sends


def test_check_object_catches_a_wrong_field() -> None:
    """The validators refuse what the server would (so the tests above can fail)."""
    objs = render(_specs.obj(_specs.disagg(router={"grpcPort": 9002})))
    deploy = copy.deepcopy(by_kind(objs, "Deployment")[0])
    deploy["spec"]["replicaz"] = 1
    with pytest.raises(jsonschema.ValidationError):
        check_object(deploy)
    pool = copy.deepcopy(by_kind(objs, "InferencePool")[0])
    pool["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        check_object(pool)


def test_render_cli(beamserve: Any, tmp_path: Path) -> None:
    example = _specs.REPO / "manifests/examples/beam-multinode.yaml"
    done = beamserve("render", str(example), "--all-apis", "--namespace", "serving")
    assert done.returncode == 0, done.stderr
    objs = list(yaml.safe_load_all(done.stdout))
    assert objs == desired_objects(
        parse_deployment(_specs.load_example(example)),
        ClusterFacts.everything(namespace="serving"),
    )
    refused = beamserve("render", str(example))  # no LeaderWorkerSet assumed
    assert refused.returncode == 1 and "spec.prefill.nodesPerReplica" in refused.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_specs.obj(_specs.disagg(decode={"tp": 3}))))
    invalid = beamserve("render", str(bad))
    assert invalid.returncode == 1 and "spec.decode" in invalid.stderr


@pytest.mark.parametrize("path", _specs.EXAMPLES, ids=lambda p: p.name)
def test_router_command_parses_and_reads_its_config_map(path: Path, tmp_path: Path) -> None:
    """The router's own parser takes the rendered command; the ConfigMap's file, mounted where
    the command says, gives the spec's router settings."""
    import argparse

    from beamserve.router.cli import add_router

    objs = render(_specs.load_example(path))
    (cm,) = by_kind(objs, "ConfigMap")
    router = next(
        o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-router")
    )
    argv = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[:2] == ["beamserve", "router"]
    config = tmp_path / "router.yaml"
    config.write_text(cm["data"]["router.yaml"])
    args = [a.replace("/etc/beamserve/router/router.yaml", str(config)) for a in argv[2:]]
    args = [a if not a.startswith("$(") else "{}" for a in args]  # env references
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_router(sub)
    ns = parser.parse_args(["router", *args])
    from beamserve.operator.router_config import apply_router_config

    applied = apply_router_config(ns)
    spec = parse_deployment(_specs.load_example(path)).spec
    assert applied.port == spec.router.port
    assert applied.kubernetes == _specs.load_example(path)["metadata"]["name"]
    assert applied.policy == spec.router.policy


def test_quantities_are_strings_for_server_side_apply() -> None:
    doc = _specs.obj(_specs.disagg(decode={"resources": {"limits": {"cpu": 8, "memory": "64Gi"}}}))
    objs = render(doc)
    for deploy in by_kind(objs, "Deployment"):
        for c in deploy["spec"]["template"]["spec"]["containers"]:
            for section in c.get("resources", {}).values():
                assert all(isinstance(v, str) for v in section.values()), section
    decode = next(
        o
        for o in by_kind(objs, "Deployment")
        if o["metadata"]["labels"].get(LABEL_ROLE) == "decode"
    )
    limits = decode["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "4"}


@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_pool_roles_render_a_kv_both_pool_the_router_can_split(engine: str) -> None:
    """`router.disaggregation.poolRoles`: the `both` pool's engines send and receive KV (vLLM:
    a NixlConnector with `kv_role: kv_both`; sim: its handshake server on the bootstrap port),
    its Service says so to discovery, and the router's config carries the thresholds."""
    from beamserve.operator.desired import LABEL_KV_ROLE
    from beamserve.operator.router_config import router_flags

    over: dict[str, Any] = {
        "both": {"replicas": 4, "tp": 1 if engine == "sim" else 4},
        "router": {"disaggregation": {"poolRoles": {"prefillWorkers": 2, "settleSeconds": 5}}},
    }
    if engine == "sim":
        over["engine"] = {"name": "sim", "image": _specs.DELETE, "api": "vllm"}
    doc = _specs.obj(_specs.aggregated(**over))
    assert validate(doc) == []
    objs = render(doc)
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] != "beam-router"]
    assert svc["metadata"]["labels"][LABEL_KV_ROLE] == "kv_both"
    pool = next(d for d in by_kind(objs, "Deployment") if "-both-" in d["metadata"]["name"])
    argv = pool["spec"]["template"]["spec"]["containers"][0]["command"]
    if engine == "vllm":
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert (ktc["kv_connector"], ktc["kv_role"]) == ("NixlConnector", "kv_both")
    else:
        assert argv[argv.index("--handshake-port") + 1] == "8998"
    bd = parse_deployment(doc)
    flags = router_flags(bd.spec.router)
    assert flags["disaggregation"]["pool_roles"] == {
        "prefill_workers": 2,
        "split_at_sessions_per_worker": 10.0,
        "colocate_below_sessions_per_worker": None,
        "settle_s": 5.0,
        "spill_at_sessions_per_worker": None,
        "spill_stop_below_sessions_per_worker": None,
        "drain_quiet_s": 2.0,
        "drain_below_peak": 0.9,
        "drain_move_margin": 2,
        "drain_max_prefill_tokens": 8192,
    }
    # the router takes that config as it is
    from beamserve.router.policy import ConditionalDisaggregation

    params = ConditionalDisaggregation.from_params(flags["disaggregation"]).params
    assert params.pool_roles is not None and params.pool_roles.prefill_workers == 2
    # without poolRoles: no connector, no label
    plain = render(_specs.obj(_specs.aggregated(both={"replicas": 4})))
    (svc,) = [s for s in by_kind(plain, "Service") if s["metadata"]["name"] != "beam-router"]
    assert LABEL_KV_ROLE not in svc["metadata"]["labels"]
    pool = next(d for d in by_kind(plain, "Deployment") if "-both-" in d["metadata"]["name"])
    argv = pool["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--kv-transfer-config" not in argv
