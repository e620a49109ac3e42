"""Shared fixtures: run the installed `beamserve` console script as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Beam checkpoint (`beamserve model make-tiny`) shared by the session."""
    from beamserve.workers.ref.checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


class WorkerProc:
    """A running `beamserve worker` (or `router`) process and what its ready line said."""

    def __init__(
        self, args: list[str], ready_timeout_s: float = 120.0, command: str = "worker"
    ) -> None:
        import json
        import selectors
        import time

        self.args = args
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "beamserve"), command, "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "BEAMSERVE_LOG_JSON": "1"},
        )
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + ready_timeout_s
        line = ""
        while time.monotonic() < end and self.proc.poll() is None:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    break
        sel.close()
        if not line.startswith("{"):
            self.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"{command} {args} did not become ready:\n{err[-3000:]}")
        self.info: dict[str, object] = json.loads(line)
        self.url = str(self.info["url"])

    @property
    def handshake_port(self) -> int:
        return int(str(self.info["handshake_url"]).rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)


SpawnWorker = Callable[..., WorkerProc]


@pytest.fixture
def spawn_worker() -> Iterator[SpawnWorker]:
    """`spawn_worker("--engine", "sim", ...)` starts a worker; all are stopped afterwards."""
    procs: list[WorkerProc] = []

    def spawn(*args: str, ready_timeout_s: float = 120.0, command: str = "worker") -> WorkerProc:
        w = WorkerProc(list(args), ready_timeout_s, command)
        procs.append(w)
        return w

    yield spawn
    for w in procs:
        w.stop()


# How long the interpreter may take to exit once the session has ended (atexit hooks, thread
# joins) before the watchdog below gives up on it.
EXIT_GRACE_S = 120.0


# A second process that ends this one if it outlives the grace (below): the faulthandler timer
# stops with Python's own finalisation, and a native destructor that hangs after it (one did:
# libnl-route's, loaded by NIXL's UCX, spinning in `_dl_fini`) would otherwise go unnoticed.
_EXIT_WATCHDOG = """
import os, sys, time
pid, grace = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + grace
while time.monotonic() < end:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(0.5)
sys.stderr.write(
    f"conftest: pytest (pid {pid}) still alive {grace:.0f} s after its session ended "
    "(a hang in native code at exit); killing it\\n"
)
os.kill(pid, 9)
"""


def pytest_unconfigure(config: pytest.Config) -> None:
    """A suite that hangs on its way out (a thread, a child process or a native destructor that
    never ends) fails fast instead of running into CI's own limit with nothing in the log.

    Python's shutdown joins every non-daemon thread (executors included) and multiprocessing's
    children: the lingering ones are named now, and faulthandler is armed to write every
    thread's stack and exit with status 1 if Python is still finalising `EXIT_GRACE_S` later.
    Past Python's finalisation, a watchdog process kills the interpreter at the same grace.
    """
    import faulthandler
    import threading

    lingering = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    if lingering:
        sys.stderr.write(f"conftest: non-daemon threads alive at exit: {', '.join(lingering)}\n")
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)
    subprocess.Popen(
        [sys.executable, "-c", _EXIT_WATCHDOG, str(os.getpid()), str(EXIT_GRACE_S + 30)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
