"""The generated CRD on a real kube-apiserver 1.20.2 (`make test-k8s`): it installs (structural,
without CEL) under server-side apply, the examples are stored, the server's defaults equal the
models' defaults, and what its schema refuses or prunes is what the models say."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from beamserve.operator import crd
from beamserve.operator.admission import validate
from beamserve.operator.api import BeamDeployment

_path = Path(__file__).resolve().parents[1] / "k8s_cluster.py"
_kspec = importlib.util.spec_from_file_location("k8s_cluster", _path)
assert _kspec is not None and _kspec.loader is not None
_kc = sys.modules.setdefault("k8s_cluster", importlib.util.module_from_spec(_kspec))
_kspec.loader.exec_module(_kc)
kube_cluster = _kc.kube_cluster  # the fixture

_spec = importlib.util.spec_from_file_location("_specs", Path(__file__).parent / "_specs.py")
assert _spec is not None and _spec.loader is not None
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]
NS = "crd-test"
BD = f"/apis/beamserve.io/v1alpha1/namespaces/{NS}/beamdeployments"


def _norm(node: Any) -> Any:
    """Empty lists and maps left out (the API server stores no default for them), and whole
    floats as ints (JSON does not tell 60.0 from 60)."""
    if isinstance(node, dict):
        return {k: _norm(v) for k, v in node.items() if v not in ({}, [])}
    if isinstance(node, list):
        return [_norm(v) for v in node]
    if isinstance(node, float) and node.is_integer():
        return int(node)
    return node


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[httpx.Client]:
    client = httpx.Client(
        base_url=kube_cluster.server,
        headers={"Authorization": f"Bearer {kube_cluster.token}"},
        verify=False,
        timeout=30,
    )
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}"
    r = client.patch(
        path,
        params={"fieldManager": "beamserve-test", "force": "true"},
        content=yaml.safe_dump(crd.crd_without_cel()),
        headers={"Content-Type": "application/apply-patch+yaml"},
    )
    assert r.status_code in (200, 201), r.text
    deadline = time.monotonic() + 60
    while True:
        conds = client.get(path).json().get("status", {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
            break
        assert time.monotonic() < deadline, conds
        time.sleep(0.2)
    client.post("/api/v1/namespaces", json={"metadata": {"name": NS}})
    while client.get(BD).status_code != 200:  # the new API group is served
        assert time.monotonic() < deadline
        time.sleep(0.2)
    yield client
    client.close()


def test_crd_is_structural(api: httpx.Client) -> None:
    got = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}")
    conds = {c["type"]: c["status"] for c in got.json()["status"]["conditions"]}
    assert conds.get("NonStructuralSchema", "False") == "False", conds


@pytest.mark.parametrize("path", S.EXAMPLES, ids=[p.name for p in S.EXAMPLES])
def test_examples_are_stored_with_the_models_defaults(api: httpx.Client, path: Path) -> None:
    doc = S.load_example(path)
    r = api.post(BD, json=doc)
    assert r.status_code == 201, r.text
    stored = r.json()
    try:
        # the server's defaulting fills exactly what the models' defaults fill
        ours = BeamDeployment.model_validate(doc).spec.to_json_dict()
        assert _norm(stored["spec"]) == _norm(ours)
        assert validate(stored) == []
    finally:
        api.delete(f"{BD}/{doc['metadata']['name']}")


@pytest.mark.parametrize(
    "spec",
    [
        S.disagg(decode={"tp": "4"}),
        S.disagg(decode={"tp": 0}),
        S.disagg(kv={"pageSize": 48}),
        S.disagg(engine={"name": "tgi"}),
        S.disagg(model=S.DELETE),
        S.disagg(rollout={"maxSurge": "lots"}),
        S.disagg(decode={"tuning": {"memoryFraction": 0}}),
    ],
)
def test_the_schema_refuses_what_the_models_refuse(api: httpx.Client, spec: Any) -> None:
    assert validate(spec)
    r = api.post(BD, json=S.obj(spec, name="bad"))
    assert r.status_code == 422, r.text


def test_unknown_fields_are_pruned_so_the_webhook_refuses_them(api: httpx.Client) -> None:
    r = api.post(BD, json=S.obj(S.disagg(decode={"gpus": 4}), name="pruned"))
    assert r.status_code == 201, r.text
    try:
        assert "gpus" not in r.json()["spec"]["decode"]
        assert any(v.path == "spec.decode.gpus" for v in validate(S.disagg(decode={"gpus": 4})))
    finally:
        api.delete(f"{BD}/pruned")


def test_status_subresource_and_printer_columns(api: httpx.Client) -> None:
    r = api.post(BD, json=S.obj(S.disagg(), name="cols"))
    assert r.status_code == 201, r.text
    try:
        status = {
            "observedGeneration": 1,
            "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady",
                            "lastTransitionTime": "2026-12-01T12:00:00Z"}],
            "prefill": {"replicas": 1, "readyReplicas": 1},
            "decode": {"replicas": 2, "readyReplicas": 2},
        }  # fmt: skip
        r = api.patch(
            f"{BD}/cols/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.status_code == 200, r.text
        table = api.get(
            f"{BD}/cols", headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
        ).json()
        names = [c["name"] for c in table["columnDefinitions"]]
        assert names[:4] == ["Name", "Ready", "Prefill", "Decode"] and "Age" in names
        cells = table["rows"][0]["cells"]
        assert cells[1:4] == ["True", 1, 2]
        # a spec write through /status is ignored; a status write through the object too
        r = api.patch(
            f"{BD}/cols",
            json={"status": {"prefill": {"readyReplicas": 0}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.json()["status"]["prefill"]["readyReplicas"] == 1
    finally:
        api.delete(f"{BD}/cols")
