"""Every `beamserve.*` module imports from the repository, and the root `operator/` folder never
shadows the standard library's `operator` (DESIGN.md §2, layout note)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = (
    "beamserve",
    "beamserve.kv_transfer",
    "beamserve.kv_transfer.backends",
    "beamserve.kvwire",
    "beamserve.workers",
    "beamserve.workers.sim",
    "beamserve.workers.launch",
    "beamserve.workers.ref",
    "beamserve.workers.server",
    "beamserve.router",
    "beamserve.router.index",
    "beamserve.router.api",
    "beamserve.router.policy",
    "beamserve.router.flow",
    "beamserve.router.grpc_api",
    "beamserve.router.bench",
    "beamserve.operator",
    "beamserve.operator.local",
)


def _declared_packages() -> list[str]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["tool"]["setuptools"]["packages"])


def _all_modules() -> list[str]:
    """Every package and module under `beamserve`, found by walking each package's path.

    The components live in top-level folders mapped onto subpackages (package-dir), so walking
    `beamserve.__path__` alone would not reach them: walk from every declared package.
    """
    names: set[str] = set(SUBPACKAGES) | set(_declared_packages())
    for pkg_name in sorted(names):
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg_name + "."):
            names.add(info.name)
    return sorted(names)


def _inside_repo(path: str | None) -> bool:
    if path is None:
        return False
    p = Path(path).resolve()
    return p.is_relative_to(REPO) and not p.is_relative_to(REPO / ".venv")


def test_declared_packages_match_the_component_folders() -> None:
    assert sorted(_declared_packages()) == sorted(SUBPACKAGES)


def test_walk_finds_every_subpackage() -> None:
    found = set(_all_modules())
    assert set(SUBPACKAGES) <= found
    # the pure kv_transfer modules are part of the walk too
    for mod in ("model", "topology", "plan", "errors"):
        assert f"beamserve.kv_transfer.{mod}" in found


# Modules that need an optional dependency at import time (module → the dependency): where it is
# not installed (CI: Triton is a GPU-only install), importing them must fail for that reason
# alone; every other module of the walk imports everywhere.
NEEDS = {"beamserve.kv_transfer.triton_loop": "triton"}


@pytest.mark.parametrize("name", _all_modules())
def test_module_imports_from_the_repository(name: str) -> None:
    need = NEEDS.get(name)
    if need is not None and importlib.util.find_spec(need) is None:
        with pytest.raises(ModuleNotFoundError) as missing:
            importlib.import_module(name)
        assert missing.value.name == need, missing.value
        return
    mod = importlib.import_module(name)
    assert _inside_repo(mod.__file__), f"{name} imported from {mod.__file__}, not from {REPO}"
    top = name.split(".")[1] if name.count(".") else ""
    if top in {p.split(".")[1] for p in SUBPACKAGES if p.count(".") == 1}:
        # a component subpackage lives in its top-level folder (or below it)
        assert Path(mod.__file__).resolve().is_relative_to(REPO / top)
    else:
        # the root package (CLI, logging) lives in src/beamserve
        assert Path(mod.__file__).resolve().is_relative_to(REPO / "src" / "beamserve")


def test_beamserve_operator_is_the_component_not_the_stdlib() -> None:
    mod = importlib.import_module("beamserve.operator")
    assert Path(mod.__file__).resolve().parent == REPO / "operator"


def test_stdlib_operator_is_not_shadowed() -> None:
    import operator

    assert hasattr(operator, "itemgetter")
    assert not _inside_repo(operator.__file__)
    assert operator.itemgetter(1)([3, 4]) == 4


def test_stdlib_operator_not_shadowed_in_a_fresh_interpreter_at_repo_root() -> None:
    # `python -c` puts the current directory first on sys.path: the stdlib module must still win.
    code = (
        "import operator, beamserve.operator as comp; "
        "print(operator.__file__); print(comp.__file__); "
        "assert hasattr(operator, 'itemgetter')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert not _inside_repo(out[0])
    assert Path(out[1]).resolve().parent == REPO / "operator"
