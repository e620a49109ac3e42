"""The CRD is generated from the models: no drift, structural, and the examples fit its schema."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from beamserve.operator import crd
from beamserve.operator.api import PASSTHROUGH_FIELDS, BeamDeploymentSpec

_spec = importlib.util.spec_from_file_location("_specs", Path(__file__).parent / "_specs.py")
assert _spec is not None and _spec.loader is not None
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)


@pytest.mark.parametrize("rel", crd.MANIFEST_PATHS)
def test_generated_files_match_the_models(rel: str) -> None:
    path = S.REPO / rel
    assert path.read_text() == crd.crd_yaml(), f"{rel} drifted from operator/api.py: run make crd"


def test_identity() -> None:
    doc = crd.crd()
    assert doc["metadata"]["name"] == "beamdeployments.beamserve.io"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "BeamDeployment", "beamdeployments", ["bd"]
    )  # fmt: skip
    (version,) = doc["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}  # no /scale: two pools, one count
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Prefill"] == ".status.prefill.readyReplicas"
    assert cols["Decode"] == ".status.decode.readyReplicas"
    assert cols["Age"] == ".metadata.creationTimestamp"


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _root(cel: bool = True) -> dict[str, Any]:
    return crd.crd(cel=cel)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural() -> None:
    for path, node in _walk(_root()):
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "const"} & set(node), path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            continue
        assert "type" in node, f"{path}: no type"
        if node["type"] == "object" and "properties" in node:
            assert "additionalProperties" not in node, path
        if "default" in node and node["type"] == "object":
            assert node["default"] == {}, path


def test_installs_on_1_20_as_generated() -> None:
    """What 1.20's CRD validation refuses is never generated, so `crd_without_cel()` installs
    there unmodified (tests/operator/test_operator_k8s.py does): an empty-string default (read
    as null), and a list-map key that is neither required nor defaulted."""
    for cel in (True, False):
        for path, node in _walk(_root(cel)):
            assert node.get("default") != "", f'{path}: default: ""'
            keys = node.get("x-kubernetes-list-map-keys") or []
            items = node.get("items") or {}
            for key in keys:
                sub = items["properties"][key]
                assert key in items.get("required", []) or sub.get("default"), f"{path}.{key}"
    # the models do carry empty-string defaults (Condition.message): the generator drops them
    status = _root()["properties"]["status"]["properties"]
    assert "default" not in status["conditions"]["items"]["properties"]["message"]
    assert crd.crd_without_cel() == crd.crd(cel=False)


def test_preserve_unknown_fields_only_on_passthroughs() -> None:
    free = [p for p, n in _walk(_root()) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert free
    for path in free:
        field = path.rstrip("[]").rsplit(".", 1)[-1]
        assert field in PASSTHROUGH_FIELDS | {"policyConfig", "metadata"}, path


def test_defaults_bounds_and_enums_come_from_the_models() -> None:
    spec = _root()["properties"]["spec"]
    pool = spec["properties"]["decode"]["properties"]
    assert pool["tp"] == {"type": "integer", "minimum": 1, "maximum": 64, "default": 1,
                          "description": pool["tp"]["description"]}  # fmt: skip
    assert pool["replicas"]["minimum"] == 0
    kv = spec["properties"]["kv"]
    assert kv["default"] == {}
    assert kv["properties"]["pageSize"]["enum"] == [16, 32, 64]
    assert kv["properties"]["pageSize"]["default"] == 64
    assert set(spec["required"]) == {"model", "engine"}
    assert spec["properties"]["engine"]["properties"]["name"]["enum"] == [
        "sglang", "vllm", "sim", "ref"
    ]  # fmt: skip
    tuning = pool["tuning"]["properties"]["memoryFraction"]
    assert tuning["minimum"] == 0 and tuning["exclusiveMinimum"] is True
    surge = spec["properties"]["rollout"]["properties"]["maxSurge"]
    assert surge["x-kubernetes-int-or-string"] is True


def test_without_cel_has_no_rules() -> None:
    assert any("x-kubernetes-validations" in n for _, n in _walk(_root(cel=True)))
    assert not any("x-kubernetes-validations" in n for _, n in _walk(_root(cel=False)))
    assert crd.crd_without_cel()["spec"]["names"] == crd.crd()["spec"]["names"]


def _validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_root())


@pytest.mark.parametrize("path", S.EXAMPLES, ids=[p.name for p in S.EXAMPLES])
def test_examples_fit_the_schema(path: Path) -> None:
    doc = S.load_example(path)
    _validator().validate(doc)
    # and so does what the API server stores after defaulting
    filled = BeamDeploymentSpec.model_validate(doc["spec"]).to_json_dict()
    _validator().validate({**doc, "spec": filled})


@pytest.mark.parametrize(
    "spec",
    [
        S.disagg(decode={"tp": "4"}),
        S.disagg(decode={"tp": 0}),
        S.disagg(kv={"pageSize": 48}),
        S.disagg(engine={"name": "tgi"}),
        S.disagg(model=S.DELETE),
        S.disagg(rollout={"maxSurge": "lots"}),
        S.disagg(monitoring={"interval": "soon"}),
    ],
)
def test_schema_refuses_what_the_models_refuse(spec: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        _validator().validate(S.obj(spec))


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    from beamserve.cli import main

    assert main(["crd"]) == 0
    out = capsys.readouterr().out
    assert out == crd.crd_yaml()
    assert yaml.safe_load(out)["kind"] == "CustomResourceDefinition"
    assert main(["crd", "--no-cel"]) == 0
    assert "x-kubernetes-validations" not in capsys.readouterr().out


def test_docs_reference_matches_the_models() -> None:
    path = S.REPO / "docs" / "kubernetes.md"
    text = path.read_text()
    assert crd.with_generated_docs(text) == text, "docs/kubernetes.md drifted: run make crd"
