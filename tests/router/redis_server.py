"""A real `redis-server` for tests: `RedisServer` and the `redis_server` fixture.

`RedisServer()` starts ``redis-server --save '' --appendonly no --port N --bind 127.0.0.1`` on a
free loopback port (no persistence, its working dir and log in a temp dir) and waits until it
answers PING. `stop()` (SIGTERM) / `kill()` (SIGKILL) end it, `restart()` starts a fresh empty
server on the SAME port, `pause()` / `resume()` freeze it (SIGSTOP/SIGCONT: connections hang,
so clients see timeouts, not refusals). Never leaves a process behind: the fixture stops it at
teardown, and `close()` (also at interpreter exit) kills any running one.

Use from a test module (tests are imported with ``--import-mode=importlib``)::

    _spec = importlib.util.spec_from_file_location("redis_server", HERE / "redis_server.py")
    ...
    redis_server = _mod.redis_server      # the fixture, re-exported in the module
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis server on 127.0.0.1:`port` answers PING with PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One `redis-server` process on a fixed loopback port (see the module docstring)."""

    def __init__(self, port: int | None = None, *, start_timeout_s: float = 10.0) -> None:
        if not Path(REDIS_SERVER).exists():
            raise FileNotFoundError(f"{REDIS_SERVER} not found; apt-get install redis-server")
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.mkdtemp(prefix="beamserve-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        atexit.register(self.close)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """No persistence, loopback only, logs and working files in this server's temp dir."""
        persistence_off = ["--save", "", "--appendonly", "no"]
        listen = ["--port", str(self.port), "--bind", "127.0.0.1"]
        return [REDIS_SERVER, *persistence_off, *listen, "--dir", self._dir, "--daemonize", "no"]

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        log = open(Path(self._dir) / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        self.paused = False
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if ping(self.port):
                return
            time.sleep(0.01)
        self.kill()
        tail = (Path(self._dir) / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{tail}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Graceful shutdown (SIGTERM), SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL): clients see resets and refused connections."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        self.paused = False

    def restart(self) -> None:
        """Stop (if running) and start an empty server on the same port."""
        self.stop()
        self.start()

    def pause(self) -> None:
        if self.running and not self.paused:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.running and self.paused:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.paused = False

    def close(self) -> None:
        """Kill the server and remove its temp dir (idempotent)."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty `redis-server` for one test; fails when the binary is missing."""
    if not Path(REDIS_SERVER).exists():
        pytest.fail("redis-server is not installed: run `make install` (Debian redis-server)")
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
        server.close()
