"""`beamserve validate FILE`: exit 0 when every BeamDeployment is valid, 1 with every violation."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from beamserve.cli import main

_spec = importlib.util.spec_from_file_location("_specs", Path(__file__).parent / "_specs.py")
assert _spec is not None and _spec.loader is not None
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)


def _write(tmp_path: Path, *docs: Any) -> Path:
    path = tmp_path / "bd.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


@pytest.mark.parametrize("path", S.EXAMPLES, ids=[p.name for p in S.EXAMPLES])
def test_examples_are_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(path)]) == 0
    assert "1 BeamDeployment(s) valid" in capsys.readouterr().out


def test_invalid_exits_1_with_every_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = S.obj(S.disagg(engine={"image": S.DELETE}, decode={"tp": 3}), name="bad")
    good = S.obj(S.disagg(), name="good")
    path = _write(tmp_path, good, bad)
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert f"{path}#2 bad: spec.engine.image: required for engine sglang" in out.out
    assert any("spec.decode.tp" in ln for ln in lines)
    assert all(ln.startswith(f"{path}#2 bad: spec.") for ln in lines)
    assert "1 of 2 document(s) invalid" in out.err


def test_other_kinds_are_skipped_and_bare_specs_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    path = _write(tmp_path, cm, S.aggregated())
    assert main(["validate", str(path)]) == 0
    assert "skipped (ConfigMap, v1)" in capsys.readouterr().err
    assert main(["validate", str(_write(tmp_path, cm))]) == 1


def test_old_checks_the_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(S.obj(S.disagg())))
    new = _write(tmp_path, S.obj(S.aggregated()))
    assert main(["validate", str(new)]) == 0
    assert main(["validate", str(new), "--old", str(old)]) == 1
    assert "spec.both: switching from disaggregated to aggregated" in capsys.readouterr().out


def test_unreadable_file(tmp_path: Path) -> None:
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    (tmp_path / "broken.yaml").write_text("a: [")
    assert main(["validate", str(tmp_path / "broken.yaml")]) == 1


def test_console_script_exit_codes(beamserve: Any, tmp_path: Path) -> None:
    ok = beamserve("validate", str(S.EXAMPLES[0]))
    assert ok.returncode == 0, ok.stderr
    bad = beamserve("validate", str(_write(tmp_path, S.obj(S.disagg(decode={"tp": 0})))))
    assert bad.returncode == 1
    assert "spec.decode.tp:" in bad.stdout
