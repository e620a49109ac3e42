"""`EngineSupervisor` against a real child process (tests/workers/fake_engine.py): readiness
relayed from the engine's probe, graceful drain, SIGKILL after the grace period, an engine
that dies early, `$(POD_IP)` expansion, and SIGTERM forwarded from a supervising process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from beamserve.workers.launch import (
    EngineEnvError,
    EngineExitedError,
    EngineNotReadyError,
    EngineSupervisor,
    LaunchCommand,
    SupervisorOptions,
)

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_engine.py"
FAST = SupervisorOptions(grace_s=5.0, poll_interval_s=0.05, probe_timeout_s=1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake(port: int, log: Path, *extra: str, env: dict[str, str] | None = None) -> LaunchCommand:
    argv = (sys.executable, str(FAKE), "--port", str(port), "--log", str(log), *extra)
    return LaunchCommand(argv=argv, env=env or {}, port=port, ready_path="/health_generate")


def events(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state in /proc tells
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ready_only_after_the_engine_answers_then_drains_on_sigterm(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()

    async def scenario() -> tuple[bool, float, bool, int]:
        sup = EngineSupervisor(fake(port, log, "--ready-after", "0.8", "--drain-s", "0.3"), FAST)
        t0 = time.monotonic()
        await sup.start()
        await asyncio.sleep(0.3)
        early = sup.is_ready
        await sup.wait_ready(timeout_s=10)
        took = time.monotonic() - t0
        ready = sup.is_ready
        code = await sup.stop()
        return early, took, ready and not sup.is_ready, code

    early, took, flipped, code = asyncio.run(scenario())
    assert not early
    assert 0.8 <= took < 5
    assert flipped
    assert code == 0
    names = [e.get("name") for e in events(log) if e["event"] == "signal"]
    assert names == ["SIGTERM"]
    assert [e["event"] for e in events(log)][-1] == "drained"


def test_sigkill_after_the_grace_period_when_the_engine_ignores_sigterm(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()

    async def scenario() -> tuple[int, float, int]:
        cmd = fake(port, log, "--ignore-term", "--spawn-child")
        async with EngineSupervisor(cmd, FAST) as sup:
            await sup.wait_ready(timeout_s=10)
            t0 = time.monotonic()
            code = await sup.stop(grace_s=0.7)
            return code, time.monotonic() - t0, sup.returncode or 0

    code, took, rc = asyncio.run(scenario())
    assert code == rc == -signal.SIGKILL
    assert 0.7 <= took < 4
    child = next(e for e in events(log) if e["event"] == "child")
    deadline = time.monotonic() + 3
    while alive(int(str(child["pid"]))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(str(child["pid"]))), "the engine's forked worker outlived it"


def test_engine_that_dies_before_ready_is_reported_with_its_status(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()
    cmd = fake(port, log, "--ready-after", "30", "--exit-after", "0.3", "--exit-code", "3")

    async def scenario() -> int | None:
        sup = EngineSupervisor(cmd, FAST)
        await sup.start()
        with pytest.raises(EngineExitedError, match="status 3"):
            await sup.wait_ready(timeout_s=10)
        assert not sup.is_ready
        return sup.returncode

    assert asyncio.run(scenario()) == 3


def test_not_ready_within_the_deadline(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()

    async def scenario() -> int:
        sup = EngineSupervisor(fake(port, log, "--ready-after", "30"), FAST)
        await sup.start()
        with pytest.raises(EngineNotReadyError, match="raise the timeout"):
            await sup.wait_ready(timeout_s=0.5)
        return await sup.stop()

    assert asyncio.run(scenario()) == 0


def test_readiness_follows_the_engine_after_it_was_ready(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()
    cmd = fake(port, log, "--unhealthy-after", "1.0")

    async def scenario() -> tuple[bool, bool]:
        async with EngineSupervisor(cmd, FAST) as sup:
            await sup.wait_ready(timeout_s=10)
            was = sup.is_ready
            deadline = time.monotonic() + 5
            while sup.is_ready and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return was, sup.is_ready

    assert asyncio.run(scenario()) == (True, False)


def test_pod_ip_reference_is_expanded_and_a_missing_one_refused(tmp_path: Path) -> None:
    log, port = tmp_path / "engine.log", free_port()
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "$(POD_IP)", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    cmd = fake(port, log, env=env)
    with pytest.raises(EngineEnvError, match=r"VLLM_NIXL_SIDE_CHANNEL_HOST.*POD_IP"):
        EngineSupervisor(cmd, FAST, environ={"PATH": os.environ.get("PATH", "")})

    async def scenario() -> None:
        environ = {**os.environ, "POD_IP": "192.0.2.7"}
        async with EngineSupervisor(cmd, FAST, environ=environ) as sup:
            await sup.wait_ready(timeout_s=10)

    asyncio.run(scenario())
    start = next(e for e in events(log) if e["event"] == "start")
    assert start["env"] == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "192.0.2.7",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "POD_IP": "192.0.2.7",
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_supervisor_is_forwarded_and_the_engine_drains(
    tmp_path: Path, sig: signal.Signals
) -> None:
    log, port = tmp_path / "engine.log", free_port()
    argv = [sys.executable, str(FAKE), "--port", str(port), "--log", str(log), "--drain-s", "0.2"]
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "supervise_fake.py"), str(port), "5", str(log), "--", *argv],
        env={**os.environ, "POD_IP": "192.0.2.9"},
    )
    try:
        deadline = time.monotonic() + 15
        while not any(e["event"] == "supervisor-ready" for e in events(log)):
            assert proc.poll() is None, "supervisor exited early"
            assert time.monotonic() < deadline, "engine never became ready"
            time.sleep(0.05)
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    got = events(log)
    assert [e.get("name") for e in got if e["event"] == "signal"] == [sig.name]
    assert next(e for e in got if e["event"] == "start")["env"]["ENGINE_POD"] == "192.0.2.9"  # type: ignore[index]
    assert [e["event"] for e in got][-2:] == ["drained", "supervisor-exit"]


def test_argv_references_are_expanded_and_a_worker_node_is_ready_once_running(
    tmp_path: Path,
) -> None:
    """A multi-node worker: ranks in argv come from the environment (as kubelet expands them
    in a pod), and a node that serves no HTTP is ready while its process runs."""
    log, port = tmp_path / "engine.log", free_port()
    argv = (sys.executable, str(FAKE), "--port", str(port), "--log", "$(ENGINE_LOG)")
    cmd = LaunchCommand(
        argv=(*argv, "--ready-after", "$(LWS_WORKER_INDEX)0"),  # never answers in time
        port=port,
        serves_http=False,
    )
    with pytest.raises(EngineEnvError, match=r"--log: refers to \$\(ENGINE_LOG\)"):
        EngineSupervisor(cmd, FAST, environ={"LWS_WORKER_INDEX": "9"})

    async def scenario() -> None:
        environ = {**os.environ, "ENGINE_LOG": str(log), "LWS_WORKER_INDEX": "9"}
        async with EngineSupervisor(cmd, FAST, environ=environ) as sup:
            await sup.wait_ready(timeout_s=2)
            assert sup.is_ready
            for _ in range(200):  # the expanded --log path is where the engine writes
                if events(log):
                    break
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert next(e["event"] for e in events(log)) == "start"
