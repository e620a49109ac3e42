"""A real Kubernetes API server for tests: `KubeCluster` and the `kube_cluster` fixture.

`KubeCluster()` runs, on free loopback ports, a single-member etcd with a fresh data dir, a
kube-apiserver 1.20.2 (token auth, RBAC, self-signed serving cert, `--insecure-port=0`) and,
with `controller_manager=True`, a kube-controller-manager (garbage collector, deployments,
replica sets, namespaces, HPA, disruption). There is no scheduler or kubelet: pods never run.
The binaries are the ones `scripts/k8s-testenv.sh` (`make k8s-testenv`) builds and caches under
``${BEAMSERVE_CACHE:-~/.cache/beamserve}/k8s-1.20.2/bin``; etcd comes from Debian's
`etcd-server`. Startup takes ≈ 15–30 s (until `/readyz` answers); RSS ≈ 500 MB.

`start()` / `stop()` (or `with KubeCluster() as cluster:`). `stop()` kills every process it
started, by PID, and removes its temp dir; it also runs at interpreter exit. `kubeconfig` is a
file with the server, the admin token (group `system:masters`) and
`insecure-skip-tls-verify: true`; `write_kubeconfig(user)` writes one for another user named in
`users=` (authenticated, no permissions until a test grants them with RBAC), and
`write_kubeconfig(ca=cluster.ca_file)` one that verifies the server's certificate.
`stop_apiserver()` / `start_apiserver()` restart the API server on the same port and etcd (its
watch cache starts afresh: watches from older resource versions get 410 Gone);
`etcd_delete(key)` and `etcd_compact()` change the store behind the API server's back.

Use from a test module (tests are imported with ``--import-mode=importlib``)::

    _path = Path(__file__).resolve().parents[1] / "k8s_cluster.py"
    _spec = importlib.util.spec_from_file_location("k8s_cluster", _path)
    ...
    kube_cluster = _mod.kube_cluster      # the fixture, re-exported in the module

and mark those tests `@pytest.mark.k8s` (`make test-k8s` runs them).
"""

from __future__ import annotations

import atexit
import base64
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

K8S_VERSION = "1.20.2"
APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
ADMIN = "admin"
FIX = "run `make k8s-testenv` (scripts/k8s-testenv.sh builds and caches kube-apiserver)"


class KubeClusterError(RuntimeError):
    """The test cluster could not start; the message carries the log tail and the fix."""


def bin_dir() -> Path:
    """Where `scripts/k8s-testenv.sh` caches the binaries."""
    cache = os.environ.get("BEAMSERVE_CACHE") or str(Path.home() / ".cache" / "beamserve")
    return Path(cache) / f"k8s-{K8S_VERSION}" / "bin"


def etcd_binary() -> Path:
    return Path(shutil.which("etcd") or "/usr/bin/etcd")


def missing_binaries() -> list[str]:
    """The executables `KubeCluster` needs that are not there (empty when all are)."""
    wanted = [bin_dir() / APISERVER, bin_dir() / CONTROLLER_MANAGER, etcd_binary()]
    missing = [str(p) for p in wanted if not os.access(p, os.X_OK)]
    if shutil.which("openssl") is None:
        missing.append("openssl")
    return missing


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KubeCluster:
    """etcd + kube-apiserver (+ kube-controller-manager) on loopback; see the module docstring.

    | parameter | default | meaning |
    |---|---|---|
    | `controller_manager` | False | also run kube-controller-manager (GC, Deployments, …) |
    | `users` | () | extra token users (no groups, so no permissions until granted) |
    | `ready_timeout_s` | 120 | how long `start()` waits for `/readyz` |
    | `extra_apiserver_args` | () | appended to the kube-apiserver command line |
    """

    def __init__(
        self,
        *,
        controller_manager: bool = False,
        users: tuple[str, ...] = (),
        ready_timeout_s: float = 120.0,
        extra_apiserver_args: tuple[str, ...] = (),
    ) -> None:
        self.with_controller_manager = controller_manager
        self.ready_timeout_s = ready_timeout_s
        self.extra_apiserver_args = extra_apiserver_args
        self.dir = Path(tempfile.mkdtemp(prefix="beamserve-k8s-"))
        self.tokens: dict[str, str] = {u: secrets.token_hex(16) for u in (ADMIN, *users)}
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.port = free_port()
        self.controller_manager_port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.kubeconfig = self.dir / "kubeconfig"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        atexit.register(self.stop)

    @property
    def token(self) -> str:
        """The admin token (group `system:masters`)."""
        return self.tokens[ADMIN]

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> KubeCluster:
        missing = missing_binaries()
        if missing:
            raise KubeClusterError(f"missing {', '.join(missing)}: {FIX}")
        try:
            self._write_credentials()
            self._start_etcd()
            self.start_apiserver()
            self.write_kubeconfig(ADMIN, self.kubeconfig)
            if self.with_controller_manager:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every process this cluster started (by PID) and remove its temp dir."""
        for name in reversed(list(self.procs)):
            self._kill(name)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> KubeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_apiserver(self) -> None:
        """Start kube-apiserver (again) on `self.port` and wait until `/readyz` answers."""
        certs = self.dir / "certs"
        certs.mkdir(exist_ok=True)
        self._spawn(
            APISERVER,
            [
                str(bin_dir() / APISERVER),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={certs}",
                "--insecure-port=0",
                f"--token-auth-file={self.dir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--endpoint-reconciler-type=none",
                f"--service-account-key-file={self.dir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.dir / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--advertise-address=127.0.0.1",
                "--allow-privileged=true",
                *self.extra_apiserver_args,
            ],
        )
        self._wait(APISERVER, self._apiserver_ready)

    def stop_apiserver(self, *, kill: bool = True) -> None:
        """End kube-apiserver: SIGKILL (a crash: open watches drop) or SIGTERM; etcd stays."""
        self._kill(APISERVER, sig=signal.SIGKILL if kill else signal.SIGTERM)

    @property
    def ca_file(self) -> Path:
        """The API server's self-signed serving certificate and its CA (valid for 127.0.0.1)."""
        return self.dir / "certs" / "apiserver.crt"

    def write_kubeconfig(
        self, user: str = ADMIN, path: Path | None = None, *, ca: Path | None = None
    ) -> Path:
        """A kubeconfig for `user` (one of `users=`, or the admin) in the cluster's temp dir:
        `insecure-skip-tls-verify: true`, or with `ca` that file's content as
        `certificate-authority-data` (pass `self.ca_file` to verify the server)."""
        path = path or self.dir / f"kubeconfig-{user}"
        cluster: dict[str, Any] = {"server": self.server}
        if ca is None:
            cluster["insecure-skip-tls-verify"] = True
        else:
            cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    # -- etcd behind the API server's back ------------------------------------------------------

    def etcd_delete(self, key: str) -> int:
        """Delete one etcd key (e.g. ``/registry/endpointslices/<ns>/<name>``); returns the
        number deleted. Bumps etcd's revision like any write."""
        body = self._etcd("/v3/kv/deleterange", {"key": _b64(key)})
        return int(body.get("deleted", 0))

    def etcd_compact(self) -> int:
        """Compact etcd's history up to its current revision (what the API server does every
        5 minutes); returns that revision."""
        revision = int(self._etcd("/v3/kv/range", {"key": _b64("/")})["header"]["revision"])
        self._etcd("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def _etcd(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        resp = httpx.post(self.etcd_url + path, json=body, timeout=10)
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    # -- internals ------------------------------------------------------------------------------

    def _write_credentials(self) -> None:
        key, pub = self.dir / "sa.key", self.dir / "sa.pub"
        for cmd in (
            ["openssl", "genrsa", "-out", str(key), "2048"],
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        lines = [f"{self.token},{ADMIN},{ADMIN},system:masters"]
        lines += [f"{tok},{user},{user}" for user, tok in self.tokens.items() if user != ADMIN]
        (self.dir / "tokens.csv").write_text("\n".join(lines) + "\n")
        (self.dir / "tokens.csv").chmod(0o600)

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._spawn(
            "etcd",
            [
                str(etcd_binary()),
                "--name=test",
                f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
            ],
        )
        self._wait("etcd", self._etcd_ready)

    def _start_controller_manager(self) -> None:
        self._spawn(
            CONTROLLER_MANAGER,
            [
                str(bin_dir() / CONTROLLER_MANAGER),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.controller_manager_port}",
                "--controllers=garbagecollector,deployment,replicaset,namespace,"
                "horizontalpodautoscaling,disruption",
                "--use-service-account-credentials=false",
            ],
        )
        self._wait(CONTROLLER_MANAGER, self._controller_manager_ready)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        if name in self.procs and self.procs[name].poll() is None:
            raise KubeClusterError(f"{name} is already running (pid {self.procs[name].pid})")
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    def _wait(self, name: str, ready: Any) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise KubeClusterError(
                    f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}\n{FIX}"
                )
            if ready():
                return
            time.sleep(0.25)
        raise KubeClusterError(
            f"{name} not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail(name)}"
        )

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last `lines` lines of a component's log (`etcd`, `kube-apiserver`, …)."""
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _etcd_ready(self) -> bool:
        try:
            health = httpx.get(f"{self.etcd_url}/health", timeout=1).json().get("health")
        except (httpx.HTTPError, ValueError):
            return False
        return bool(health == "true")

    def _apiserver_ready(self) -> bool:
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            resp = httpx.get(f"{self.server}/readyz", headers=headers, verify=False, timeout=2)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.text.strip() == "ok"

    def _controller_manager_ready(self) -> bool:
        url = f"https://127.0.0.1:{self.controller_manager_port}/healthz"
        try:
            return httpx.get(url, verify=False, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _kill(self, name: str, sig: signal.Signals = signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _cluster(**kwargs: Any) -> Iterator[KubeCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"the k8s tests need {', '.join(missing)}: {FIX}", pytrace=False)
    cluster = KubeCluster(**kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """etcd + kube-apiserver for the session (users `router`, `viewer` without permissions);
    FAILS with the fix when the binaries are missing (never skips)."""
    yield from _cluster(users=("router", "viewer"))


@pytest.fixture(scope="session")
def kube_cluster_with_controllers() -> Iterator[KubeCluster]:
    """Like `kube_cluster`, plus kube-controller-manager (GC, Deployments, ReplicaSets, …)."""
    yield from _cluster(controller_manager=True, users=("router", "viewer"))
