"""The reconciler's pure parts: what counts as "already applied", readiness, the webhook's
view of a defaulted object (the API-server behaviour is in test_operator_k8s.py)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from beamserve.operator import crd
from beamserve.operator.admission import validate
from beamserve.operator.main import without_defaults
from beamserve.operator.reconcile import _ready, contains, owner_deployment

_path = Path(__file__).resolve().parent / "_specs.py"
_spec = importlib.util.spec_from_file_location("operator_specs", _path)
assert _spec is not None and _spec.loader is not None
_specs = sys.modules.setdefault("operator_specs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_specs)


def test_contains_ignores_server_additions_and_omitted_zero_values() -> None:
    want = {"spec": {"replicas": 2, "publishNotReadyAddresses": False, "ports": [{"port": 80}]}}
    live = {
        "metadata": {"resourceVersion": "7"},
        "spec": {"replicas": 2, "ports": [{"port": 80, "protocol": "TCP"}], "type": "ClusterIP"},
        "status": {},
    }
    assert contains(live, want)
    assert contains({"limits": {"nvidia.com/gpu": "4"}}, {"limits": {"nvidia.com/gpu": 4}})
    assert not contains(live, {"spec": {"replicas": 3}})
    assert not contains(live, {"spec": {"ports": [{"port": 80}, {"port": 81}]}})
    assert not contains(live, {"spec": {"selector": {"a": "b"}}})
    assert not contains({"x": True}, {"x": 1}) and not contains({"x": 0}, {"x": False})


def _workload(want: int, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": want},
        "status": {"observedGeneration": 2, **status},
    }


def test_ready_needs_every_replica_of_the_current_template() -> None:
    assert _ready(_workload(2, replicas=2, readyReplicas=2, updatedReplicas=2))
    assert not _ready(_workload(2, replicas=3, readyReplicas=2, updatedReplicas=2))  # old pod
    assert not _ready(_workload(2, replicas=2, readyReplicas=2, updatedReplicas=1))
    stale = _workload(2, replicas=2, readyReplicas=2, updatedReplicas=2)
    stale["status"]["observedGeneration"] = 1
    assert not _ready(stale) and not _ready(None)
    assert _ready(_workload(0))


def test_owner_deployment() -> None:
    ref = {"apiVersion": "beamserve.io/v1alpha1", "kind": "BeamDeployment", "name": "beam"}
    assert owner_deployment({"metadata": {"ownerReferences": [ref]}}) == "beam"
    assert owner_deployment({"metadata": {"ownerReferences": [{**ref, "kind": "X"}]}}) is None


def _defaulted(obj: Any, schema: dict[str, Any]) -> Any:
    """What the API server stores: the CRD schema's defaults filled in."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _defaulted(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _defaulted(item, schema["items"])
    return obj


@pytest.mark.parametrize("path", _specs.EXAMPLES, ids=lambda p: p.name)
def test_webhook_admits_the_examples_as_the_server_defaults_them(path: Path) -> None:
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    doc = yaml.safe_load(path.read_text())
    stored = _defaulted(copy.deepcopy(doc), root)
    assert stored != doc  # the server did add fields
    assert validate(without_defaults(stored)) == []
    # and a real problem still shows through the defaults
    bad = copy.deepcopy(stored)
    bad["spec"]["kv"]["pageSize"] = 48
    assert validate(without_defaults(bad)) != []


def _pool(name: str, *refs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "ownerReferences": list(refs)}}


def test_stale_pools_are_the_owned_ones_the_spec_lost() -> None:
    from beamserve.operator.scaler import stale_pools

    mine = {"kind": "BeamDeployment", "name": "beam", "uid": "u1", "controller": True}
    live = [
        _pool("beam-prefill", mine),
        _pool("beam-decode", mine),
        _pool("beam-both", mine),  # the spec went back to prefill + decode
        _pool("beam-both-copy", {**mine, "uid": "u2"}),  # another (recreated) BeamDeployment's
        _pool("beam-hand-made"),  # labelled alike, owned by nobody
        _pool("beam-referenced", {**mine, "controller": False}),  # referenced, not controlled
    ]
    assert stale_pools(live, "u1", ["beam-prefill", "beam-decode"]) == ["beam-both"]
    assert stale_pools(live, "u1", ["beam-both"]) == ["beam-decode", "beam-prefill"]
    assert stale_pools(live, "u1", ["beam-prefill", "beam-decode", "beam-both"]) == []
    assert stale_pools([], "u1", []) == []
