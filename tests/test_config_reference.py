"""Generated docs: docs/config-reference.md from the pydantic models
(scripts/gen-config-reference.py) is current, lists every field of a BeamDeployment's spec and of
RouterConfig, and its check fails on a stale copy; docs/policies.md from the plugin modules'
docstrings (scripts/gen-policies.py) is current and has a section for every plugin module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

from beamserve.operator.api import BeamDeploymentSpec, RouterConfig
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen-config-reference.py"
DOC = REPO / "docs" / "config-reference.md"


def gen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def field_paths(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}.{f.alias or name}" if prefix else (f.alias or name)
        out.append(path)
        for sub in _models_in(f.annotation):
            if sub is not model:
                out += field_paths(sub, path + ("[]" if "list[" in str(f.annotation) else ""))
    return out


def test_committed_file_is_current() -> None:
    run = gen("--check")
    assert run.returncode == 0, run.stdout


def test_every_field_is_listed() -> None:
    text = DOC.read_text()
    spec = [
        p
        for p in field_paths(BeamDeploymentSpec, "spec")
        if not p.startswith(("spec.decode.", "spec.both.", "spec.router."))
    ]
    missing = [p for p in spec + field_paths(RouterConfig, "") if f"| `{p}` |" not in text]
    assert not missing, missing
    assert "| `spec.router.disaggregation` |" not in text  # listed once, under the router file
    assert "| `disaggregation.minUncachedTokens` | integer (≥ 0) | `2048` |" in text


def test_stale_copy_fails_the_check(tmp_path: Path) -> None:
    stale = tmp_path / "config-reference.md"
    stale.write_text(DOC.read_text().replace("`2048`", "`1024`"))
    run = gen("--check", "--out", str(stale))
    assert run.returncode == 1 and "stale" in run.stdout, run.stdout
    assert gen("--out", str(stale)).returncode == 0
    assert stale.read_text() == DOC.read_text()


POLICIES = REPO / "scripts" / "gen-policies.py"


def test_policies_page_is_current_and_covers_every_plugin() -> None:
    run = subprocess.run(
        [sys.executable, str(POLICIES), "--check"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout
    text = (REPO / "docs" / "policies.md").read_text()
    modules = sorted(
        p.relative_to(REPO).as_posix()
        for folder in ("router/policy", "router/flow")
        for p in (REPO / folder).glob("*.py")
        if p.name not in ("__init__.py", "registry.py")
    )
    missing = [m for m in modules if f"*`{m}`*" not in text]
    assert not missing, f"plugins without a section in docs/policies.md: {missing}"
    # formulas come through as code blocks, parameter tables as tables
    assert "score = 1 / (1 + p + d)" in text and "| `margin_s` | `1.0` |" in text
