"""A process that used NIXL exits cleanly (the UCX environment of `backends/nixl.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from beamserve.kv_transfer.backends.nixl import ucx_environment

AGENT_THEN_EXIT = (
    "from beamserve.kv_transfer.backends.nixl import NixlAgent\n"
    "agent = NixlAgent('exit-test')\n"
    "print('made')\n"
)


@pytest.mark.skipif(
    bool(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else False,
    reason="the host has RDMA devices: UCX keeps its InfiniBand modules there",
)
def test_a_process_with_a_nixl_agent_exits_with_status_0() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run(
        [sys.executable, "-c", AGENT_THEN_EXIT],
        capture_output=True, text=True, timeout=60, env=env, cwd="/",
    )  # fmt: skip
    assert "made" in done.stdout, done.stderr[-2000:]
    # Before the fix: -11 / 139 (SIGSEGV in libnl-route's destructor at exit).
    assert done.returncode == 0, done.stderr[-2000:]


def test_ib_modules_stay_out_only_without_rdma_devices(tmp_path: Path) -> None:
    none = tmp_path / "none"  # no such folder: no RDMA stack at all
    empty = tmp_path / "empty"
    empty.mkdir()
    with_dev = tmp_path / "dev"
    (with_dev / "mlx5_0").mkdir(parents=True)

    env: dict[str, str] = {}
    ucx_environment(env, str(none))
    assert env == {"UCX_MODULES": "^ib"}
    env = {}
    ucx_environment(env, str(empty))
    assert env == {"UCX_MODULES": "^ib"}
    env = {}
    ucx_environment(env, str(with_dev))
    assert env == {}
    env = {"UCX_MODULES": "ib,cma"}  # the operator's choice wins
    ucx_environment(env, str(none))
    assert env == {"UCX_MODULES": "ib,cma"}
