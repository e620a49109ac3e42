"""Schema checks shared by the operator and chart tests (loaded by path: tests are no package).

`check_object(obj)`: a built-in kind against the Kubernetes OpenAPI schemas of
`kubernetes-validate` (strict: unknown fields are errors), a custom resource against its
upstream CRD's schema (tests/operator/crds/, unknown fields refused where the CRD prunes them).
Validators are built once per kind (kubernetes-validate's own `validate` re-reads the schemas on
every call, minutes over a hypothesis run); errors are `jsonschema.ValidationError`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

CRDS = Path(__file__).resolve().parent / "crds"
K8S_VERSION = "1.27.0"  # the minimum production version (docs/kubernetes.md)
CUSTOM = {
    "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet": "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "monitoring.coreos.com/v1/ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "monitoring.coreos.com/v1/PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "inference.networking.k8s.io/v1/InferencePool": (
        "inference.networking.k8s.io_inferencepools.yaml"
    ),
}


@functools.cache
def _definitions() -> Any:
    return kv_utils.schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json", K8S_VERSION
    )


@functools.cache
def builtin_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv_utils.schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/{kind.lower()}-{group}.json",
        K8S_VERSION,
    )
    registry: Registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(_definitions()) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@functools.cache
def custom_validator(key: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((CRDS / CUSTOM[key]).read_text())
    version = key.split("/")[1]
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _closed(v["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.validators.Draft7Validator(schema)


def _closed(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def check_object(obj: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` if the server (≥ 1.27) would refuse or prune `obj`."""
    key = f"{obj['apiVersion']}/{obj['kind']}"
    if key in CUSTOM:
        custom_validator(key).validate(obj)
    else:
        builtin_validator(obj["apiVersion"], obj["kind"]).validate(obj)
