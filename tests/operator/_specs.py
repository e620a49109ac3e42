"""Spec builders shared by the operator tests (loaded by path: tests are not a package)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


def disagg(**over: Any) -> dict[str, Any]:
    """A valid disaggregated SGLang spec (prefill TP8 → decode TP4), updated by `over`."""
    spec: dict[str, Any] = {
        "model": {"source": {"hostPath": {"path": "/mnt/beam"}}},
        "engine": {"name": "sglang", "image": "lmsysorg/sglang:v0.5.23"},
        "prefill": {"tp": 8},
        "decode": {"tp": 4},
    }
    return merge(spec, over)


def aggregated(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": {"hostPath": {"path": "/mnt/beam"}}},
        "engine": {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0"},
        "both": {"tp": 4},
    }
    return merge(spec, over)


def obj(spec: dict[str, Any], name: str = "beam") -> dict[str, Any]:
    return {
        "apiVersion": "beamserve.io/v1alpha1",
        "kind": "BeamDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `over` into a copy of `base`; a value of `DELETE` removes the key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


DELETE = object()


def load_example(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc
