"""Shared fixtures: run the installed `beamserve` console script as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RunBeamserve = Callable[..., subprocess.CompletedProcess[str]]


def _run_beamserve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The venv's `beamserve` script (never `python -m` from the repository root)."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "beamserve"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "BEAMSERVE_LOG_JSON": "1"},
        check=False,
    )


@pytest.fixture(scope="session")
def beamserve() -> RunBeamserve:
    return _run_beamserve
