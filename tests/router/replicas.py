"""Several `beamserve router` processes behind a real HAProxy, in front of real sim workers:
`HAProxy`, `ReplicaCluster` and the `replica_cluster` fixture.

`HAProxy(tmp_path, backends)` writes a configuration into `tmp_path` — plain L4 (``mode tcp``),
``balance roundrobin`` over `backends`, listening on a free loopback port — starts ``haproxy -f
… -db`` (foreground) and waits until the port accepts. Without the Debian `haproxy` binary it
fails the test, naming the fix (``make debs``): a test that needs it must not pass by skipping.

`replica_cluster(routers=2, workers=3, router_args=…)` starts `workers` sim workers (KV events
on), `routers` routers sharing one real `redis-server` (`--redis`), and HAProxy in front of the
routers; everything is stopped at teardown (`spawn_worker`, `redis_server`, the fixture).

Use from a test module (tests are imported with ``--import-mode=importlib``)::

    from tests.router.redis_server import redis_server  # noqa: F401 (fixture)
    from tests.router.replicas import ReplicaCluster, replica_cluster  # noqa: F401 (fixture)
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import SpawnWorker, WorkerProc
from tests.router.redis_server import RedisServer, free_port

KV_KEYS = ("kv_events", "kv_replay")
HAPROXY_FALLBACK = "/usr/sbin/haproxy"  # not on a non-root PATH
HAPROXY_FIX = "haproxy is not installed: run `make debs` (installs the Debian package haproxy)"


def haproxy_binary() -> str:
    """The `haproxy` executable; fails the calling test (with the fix) when it is missing."""
    found = shutil.which("haproxy") or (
        HAPROXY_FALLBACK if Path(HAPROXY_FALLBACK).exists() else None
    )
    if found is None:
        pytest.fail(HAPROXY_FIX)
    return found


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class HAProxy:
    """One `haproxy` process balancing TCP connections round-robin over `backends`
    (``host:port``); `url` is its listening address."""

    def __init__(self, tmp_path: Path, backends: Sequence[str], start_timeout_s: float = 10.0):
        binary = haproxy_binary()
        self.port = free_port()
        servers = "\n".join(f"    server r{i} {b}" for i, b in enumerate(backends))
        self.config = tmp_path / "haproxy.cfg"
        self.config.write_text(
            "global\n"
            "    maxconn 256\n"
            "defaults\n"
            "    mode tcp\n"
            "    timeout connect 5s\n"
            "    timeout client 120s\n"
            "    timeout server 120s\n"
            "frontend routers_in\n"
            f"    bind 127.0.0.1:{self.port}\n"
            "    default_backend routers\n"
            "backend routers\n"
            "    balance roundrobin\n"
            f"{servers}\n"
        )
        check = subprocess.run(
            [binary, "-c", "-f", str(self.config)], capture_output=True, text=True, check=False
        )
        assert check.returncode == 0, f"haproxy rejected {self.config}:\n{check.stderr}"
        self.proc = subprocess.Popen(
            [binary, "-f", str(self.config), "-db"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        end = time.monotonic() + start_timeout_s
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"haproxy did not start on port {self.port}:\n{err[-2000:]}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class ReplicaCluster:
    workers: list[WorkerProc]
    routers: list[WorkerProc]
    lb: HAProxy
    redis: RedisServer


def _address(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


@pytest.fixture
def replica_cluster(
    spawn_worker: SpawnWorker, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Callable[..., ReplicaCluster]]:
    """`replica_cluster(routers=2, workers=3, router_args=())`: see the module docstring."""
    proxies: list[HAProxy] = []

    def start(
        routers: int = 2, workers: int = 3, router_args: Sequence[str] = ()
    ) -> ReplicaCluster:
        haproxy_binary()  # fail first, before any process starts, when it is missing
        events = ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
        events += ["--kv-replay-endpoint", "tcp://127.0.0.1:0"]
        sims = [spawn_worker("--engine", "sim", *events) for _ in range(workers)]
        specs = json.dumps(
            [
                {"url": w.url, "engine": "sim", **{k: w.info[k] for k in KV_KEYS if w.info.get(k)}}
                for w in sims
            ]
        )
        common = ["--endpoints", specs, "--redis", redis_server.url, "--scrape-interval-s", "0.5"]
        replicas = [spawn_worker(*common, *router_args, command="router") for _ in range(routers)]
        lb = HAProxy(tmp_path, [_address(r.url) for r in replicas])
        proxies.append(lb)
        return ReplicaCluster(sims, replicas, lb, redis_server)

    yield start
    for lb in proxies:
        lb.stop()
