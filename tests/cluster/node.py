"""A single-node Kubernetes 1.20.2 cluster from real parts, inside a network namespace of its own.

`NodeCluster().start()` creates a network namespace (`ip netns add bsc-<pid>`) and runs in it:

- etcd: Debian's `etcd-server`, 127.0.0.1:2379 of the namespace, a fresh data dir;
- kube-apiserver: token auth, RBAC, a self-signed cert, on the node address 10.244.0.1:6443
  (the lease endpoint reconciler points the `kubernetes` Service there);
  `--enable-aggregator-routing` (the webhook is reached at its pod's address);
- kube-controller-manager: every default controller (ServiceAccount tokens, EndpointSlices,
  GC, …); kube-scheduler;
- containerd: Debian's 1.6 with `restrict_oom_score_adj = true`, the local pause image as
  `sandbox_image`, overlayfs, CNI plugins from `/usr/lib/cni` (k8s-node.md);
- the pod network: Debian's CNI plugins, bridge `bscni0` (10.244.0.1/24, the node's address
  too) + host-local + loopback; kube-proxy (iptables) for Services' ClusterIPs (10.96.0.0/16);
- kubelet: cgroupfs under a cgroup root of its own, CRI over containerd's socket.

Nothing listens outside the namespace and nothing in it is routed out (the namespace has no
interface but `lo` and the bridge). Clients run inside it: `run(argv)` (nsenter), `kubectl(…)`.
The binaries are the ones `scripts/k8s-testenv.sh` caches; images come from
`scripts/build-image.sh` (imported once into a containerd root kept in the cache, so a warm run
imports nothing). `stop()` kills what it started by PID (and the containers' shims, found by
this cluster's containerd socket); containerd's and the kubelet's mounts live in a private mount
namespace that goes with them (anything left under its folders is unmounted); it removes its
cgroups and deletes the network namespace. `collect_logs(dir)` copies every
component's and every pod's log.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

K8S_VERSION = "1.20.2"
REPO = Path(__file__).resolve().parents[2]
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/16"
BRIDGE = "bscni0"
NODE_NAME = "bsnode"
API_PORT = 6443
# what kubelet 1.20's container manager wants (setupKernelTunables), shown to it in its own
# mount namespace only (see NodeCluster._mount_namespace)
KUBELET_SYSCTLS = {"vm.overcommit_memory": 1, "kernel.panic": 10, "kernel.panic_on_oops": 1}
FIX = "run `make cluster-env` (scripts/k8s-testenv.sh, scripts/build-image.sh)"


class NodeClusterError(RuntimeError):
    """The cluster could not start; the message carries the log tail and the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("BEAMSERVE_CACHE") or Path.home() / ".cache" / "beamserve")


def bin_dir() -> Path:
    return cache_root() / f"k8s-{K8S_VERSION}" / "bin"


def missing_parts() -> list[str]:
    """What `NodeCluster` needs that is not there (empty when all are)."""
    out = []
    for b in (
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubelet",
        "kube-proxy",
    ):
        if not os.access(bin_dir() / b, os.X_OK):
            out.append(str(bin_dir() / b))
    for tool in (
        "etcd",
        "containerd",
        "containerd-shim-runc-v2",
        "runc",
        "ctr",
        "ip",
        "nsenter",
        "iptables",
        "openssl",
        "kubectl",
    ):
        if shutil.which(tool) is None:
            out.append(tool)
    if not Path("/usr/lib/cni/bridge").exists():
        out.append("/usr/lib/cni/bridge (containernetworking-plugins)")
    if os.geteuid() != 0:
        out.append("root (network namespaces, mounts, cgroups)")
    return out


def image_ids(archive: Path) -> tuple[str, str]:
    """(manifest digest, config digest = image ID) of an OCI archive from build-image.sh."""

    def member(name: str) -> Any:
        done = subprocess.run(["tar", "-xOf", str(archive), name], check=True, capture_output=True)
        return json.loads(done.stdout)

    manifest = member("index.json")["manifests"][0]["digest"]
    config = member(f"blobs/sha256/{manifest[7:]}")["config"]["digest"]
    return str(manifest), str(config)


def _mounts_under(prefixes: Sequence[Path]) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if any(mnt == str(p) or mnt.startswith(str(p) + "/") for p in prefixes):
                out.append(mnt)
    return out


class NodeCluster:
    """See the module docstring. `images`: OCI archives to import (path → reference)."""

    def __init__(self, images: Sequence[Path] = (), *, ready_timeout_s: float = 240.0) -> None:
        self.id = f"{os.getpid()}"
        self.netns = f"bsc-{self.id}"
        self.dir = Path(tempfile.mkdtemp(prefix="beamserve-cluster-"))
        self.logs = self.dir / "logs"
        self.logs.mkdir()
        # the containerd root (content store, unpacked snapshots) outlives a run: warm runs
        # import nothing
        self.ctr_root = cache_root() / "cluster" / "containerd"
        self.ctr_state = self.dir / "containerd-state"
        self.ctr_sock = self.dir / "containerd.sock"
        self.kubelet_root = self.dir / "kubelet"
        self.cgroup_root = f"beamserve-{self.netns}"
        self.images = list(images)
        self.ready_timeout_s = ready_timeout_s
        self.token = secrets.token_hex(16)
        self.server = f"https://{NODE_IP}:{API_PORT}"
        self.kubeconfig = self.dir / "kubeconfig"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.netns_made = False
        atexit.register(self.stop)

    # -- running things inside -------------------------------------------------------------

    def ns(self, argv: Sequence[str], *, node: bool = False) -> list[str]:
        """`argv` run in the cluster's network namespace; `node=True`: also in the node's mount
        namespace (containerd and the kubelet: what one mounts the other must see)."""
        mnt = [f"--mount=/proc/{self.procs['mount-ns'].pid}/ns/mnt"] if node else []
        return ["nsenter", f"--net=/run/netns/{self.netns}", *mnt, "--", *argv]

    def run(
        self, argv: Sequence[str], *, timeout: float = 120, check: bool = True, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **kw.pop("env", {})}
        done = subprocess.run(
            self.ns(argv), capture_output=True, text=True, timeout=timeout, env=env, **kw
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True, **kw: Any) -> str:
        return self.run(["kubectl", *args], timeout=timeout, check=check, **kw).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> NodeCluster:
        missing = missing_parts()
        if missing:
            raise NodeClusterError(f"missing {', '.join(missing)}: {FIX}")
        try:
            self._network()
            self._mount_namespace()
            self._credentials()
            self._etcd()
            self._apiserver()
            self._containerd()
            self._controllers()
            self._kubelet()
            self.wait("node Ready", self._node_ready, timeout=self.ready_timeout_s, proc="kubelet")
        except BaseException:
            self.collect_logs(self.dir / "failed-start")
            tail = self._tails()
            self.stop()
            raise NodeClusterError(f"cluster did not start; logs:\n{tail}") from None
        return self

    def __enter__(self) -> NodeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _network(self) -> None:
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        self.netns_made = True
        for cmd in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE],
            ["ip", "link", "set", BRIDGE, "up"],
            # the namespace has no default route: Service IPs need one for kube-proxy's DNAT
            # (OUTPUT chain) to see the test's own connections
            ["ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE, "src", NODE_IP],
            ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
            # Service traffic between two pods of the bridge goes through iptables both ways
            ["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"],
        ):
            subprocess.run(self.ns(cmd), check=True, capture_output=True)
        cni = self.dir / "cni"
        cni.mkdir()
        (cni / "10-beamserve.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "beamserve",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.dir / "cni-ipam"),
                            },
                        },
                        {"type": "loopback"},
                    ],
                },
                indent=1,
            )
        )

    def _mount_namespace(self) -> None:
        """A private mount namespace for containerd and the kubelet, held open by a `sleep`:
        their mounts (pod volumes, container rootfs overlays, sandbox netns files) never reach
        the host's, and all go when its last process exits. In it, the kernel settings the
        kubelet insists on (vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1;
        it sets them unless they already hold, and refuses to start with
        protectKernelDefaults) read as the kubelet wants from files bound over /proc/sys: the
        host's own values, which this machine shares with others, stay untouched."""
        self.procs["mount-ns"] = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sleep", "infinity"],
            start_new_session=True,
        )
        mnt = f"/proc/{self.procs['mount-ns'].pid}/ns/mnt"
        self.wait(
            "the node's mount namespace",
            lambda: os.readlink(mnt) != os.readlink("/proc/self/ns/mnt"),
            timeout=10,
        )
        fake = self.dir / "sysctl"
        fake.mkdir()
        for key, value in KUBELET_SYSCTLS.items():
            f = fake / key
            f.write_text(f"{value}\n")
            target = "/proc/sys/" + key.replace(".", "/")
            subprocess.run(
                ["nsenter", f"--mount={mnt}", "--", "mount", "--bind", str(f), target],
                check=True,
                capture_output=True,
            )

    def _credentials(self) -> None:
        d = self.dir
        subprocess.run(
            ["openssl", "genrsa", "-out", d / "sa.key", "2048"], check=True, capture_output=True
        )
        subprocess.run(
            ["openssl", "rsa", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub"],
            check=True,
            capture_output=True,
        )
        (d / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {"server": self.server, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": "admin", "user": {"token": self.token}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "admin"}}],
                    "current-context": "c",
                }
            )
        )

    def _etcd(self) -> None:
        self.spawn(
            "etcd",
            [
                "etcd",
                f"--data-dir={self.dir / 'etcd'}",
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=default=http://127.0.0.1:2380",
            ],
        )

    def _apiserver(self) -> None:
        d = self.dir
        self.spawn(
            "kube-apiserver",
            [
                str(bin_dir() / "kube-apiserver"),
                "--etcd-servers=http://127.0.0.1:2379",
                f"--bind-address={NODE_IP}",
                f"--secure-port={API_PORT}",
                f"--advertise-address={NODE_IP}",
                f"--cert-dir={d / 'certs'}",
                "--insecure-port=0",
                f"--token-auth-file={d / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={d / 'sa.pub'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--enable-aggregator-routing=true",
                "--kubelet-preferred-address-types=InternalIP",
            ],
        )
        self.wait("kube-apiserver /readyz", self._api_ready, timeout=180, proc="kube-apiserver")

    def _containerd(self) -> None:
        self.ctr_root.mkdir(parents=True, exist_ok=True)
        sandbox = self._image_ref("pause")
        default = subprocess.run(
            ["containerd", "config", "default"], check=True, capture_output=True, text=True
        ).stdout
        edits = {
            'root = "/var/lib/containerd"': f'root = "{self.ctr_root}"',
            'state = "/run/containerd"': f'state = "{self.ctr_state}"',
            'address = "/run/containerd/containerd.sock"': f'address = "{self.ctr_sock}"',
            "restrict_oom_score_adj = false": "restrict_oom_score_adj = true",
            'sandbox_image = "registry.k8s.io/pause:3.6"': f'sandbox_image = "{sandbox}"',
            'bin_dir = "/opt/cni/bin"': 'bin_dir = "/usr/lib/cni"',
            'conf_dir = "/etc/cni/net.d"': f'conf_dir = "{self.dir / "cni"}"',
            'path = "/opt/containerd"': f'path = "{self.dir / "containerd-opt"}"',
            # pods' network namespaces under the state dir, not the host's /run/netns
            "netns_mounts_under_state_dir = false": "netns_mounts_under_state_dir = true",
        }
        for old, new in edits.items():
            if old not in default:
                raise NodeClusterError(
                    f"`containerd config default` has no {old!r}; update node.py"
                )
            default = default.replace(old, new, 1)
        # the snapshotter: overlayfs (the default), stated so a changed default shows up here
        if 'snapshotter = "overlayfs"' not in default:
            raise NodeClusterError("containerd's default snapshotter is not overlayfs")
        cfg = self.dir / "containerd.toml"
        cfg.write_text(default)
        self.spawn("containerd", ["containerd", "--config", str(cfg)], node=True)
        self.wait(
            "containerd socket",
            lambda: self._ctr("version", check=False).returncode == 0,
            timeout=60,
            proc="containerd",
        )
        self._clean_leftovers()
        present = self._ctr("-n", "k8s.io", "images", "ls").stdout
        for archive in self.images:
            digest_file = archive.with_name(archive.name.replace(".oci.tar", ".digest"))
            digest = digest_file.read_text().strip() if digest_file.exists() else "?"
            if digest in present:
                continue
            self._ctr("-n", "k8s.io", "images", "import", str(archive), timeout=900)
        # the kept root holds only these images: older builds' content is garbage-collected
        keep = {image_ids(a)[0] for a in self.images}
        for line in self._ctr("-n", "k8s.io", "images", "ls").stdout.splitlines()[1:]:
            ref, _kind, digest = line.split()[:3]
            if digest not in keep:
                self._ctr("-n", "k8s.io", "images", "rm", ref, check=False)

    def _image_ref(self, name: str) -> str:
        for archive in self.images:
            if archive.name.startswith(f"{name}."):
                index = subprocess.run(
                    ["tar", "-xOf", str(archive), "index.json"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                return str(
                    json.loads(index)["manifests"][0]["annotations"]["io.containerd.image.name"]
                )
        raise NodeClusterError(f"no {name} image among {self.images}: {FIX}")

    def _clean_leftovers(self) -> None:
        """Containers a killed earlier run left in the kept containerd root."""
        for cid in self._ctr("-n", "k8s.io", "containers", "ls", "-q").stdout.split():
            self._ctr("-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", cid, check=False)
            self._ctr("-n", "k8s.io", "tasks", "delete", "-f", cid, check=False)
            self._ctr("-n", "k8s.io", "containers", "delete", cid, check=False)

    def _ctr(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["ctr", "--address", str(self.ctr_sock), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise NodeClusterError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
        return done

    def _controllers(self) -> None:
        d = self.dir
        self.spawn(
            "kube-controller-manager",
            [
                str(bin_dir() / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--port=0",
                f"--service-account-private-key-file={d / 'sa.key'}",
                f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
            ],
        )
        self.spawn(
            "kube-scheduler",
            [
                str(bin_dir() / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--port=0",
            ],
        )
        self.spawn(
            "kube-proxy",
            [
                str(bin_dir() / "kube-proxy"),
                f"--kubeconfig={self.kubeconfig}",
                "--proxy-mode=iptables",
                f"--hostname-override={NODE_NAME}",
                f"--cluster-cidr={POD_CIDR}",
                "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
                # conntrack limits are host-wide sysctls: leave them alone
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
            ],
        )

    def _cgroup_dirs(self) -> list[Path]:
        base = Path("/sys/fs/cgroup")
        out = []
        for ctl in sorted(os.listdir(base)):
            p = base / ctl
            if not p.is_dir() or p.is_symlink():  # "unified" too: the kubelet writes there
                continue
            out.append(p / self.cgroup_root)
        return out

    def _kubelet(self) -> None:
        for cg in self._cgroup_dirs():
            cg.mkdir(exist_ok=True)
            if cg.parent.name == "cpuset":  # a new cpuset cgroup starts with no CPUs
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (cg / f).write_text((cg.parent / f).read_text())
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failSwapOn": False,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": "cluster.local",
            "resolvConf": str(self._resolv_conf()),
            "podCIDR": POD_CIDR,
            "maxPods": 30,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "fileCheckFrequency": "5s",
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
        }
        path = self.dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.kubelet_root.mkdir()
        self.spawn(
            "kubelet",
            [
                str(bin_dir() / "kubelet"),
                f"--config={path}",
                f"--kubeconfig={self.kubeconfig}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.ctr_sock}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={self.dir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}",
                "--v=1",
            ],
            node=True,
        )

    def _resolv_conf(self) -> Path:
        # No DNS server is reachable from the namespace; pods get an empty resolver config.
        p = self.dir / "resolv.conf"
        p.write_text("# no DNS in the beamserve test cluster\n")
        return p

    def stop(self) -> None:
        """Everything `start` made goes: processes (by PID), mounts, cgroups, the namespace."""
        if not self.procs and not self.netns_made:
            shutil.rmtree(self.dir, ignore_errors=True)
            atexit.unregister(self.stop)
            return
        self._kill("kubelet")
        if "containerd" in self.procs and self.procs["containerd"].poll() is None:
            try:
                self._clean_leftovers()
            except (NodeClusterError, subprocess.TimeoutExpired):
                pass
        for name in reversed(list(self.procs)):
            self._kill(name)
        self._kill_shims()
        for mnt in sorted(_mounts_under([self.dir, self.ctr_root]), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        for cg in self._cgroup_dirs():
            if cg.exists():
                for sub in sorted(
                    (p for p in cg.rglob("*") if p.is_dir()),
                    key=lambda p: len(p.parts),
                    reverse=True,
                ):
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                try:
                    cg.rmdir()
                except OSError:
                    pass
        if self.netns_made:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
            self.netns_made = False
        if os.environ.get("BEAMSERVE_KEEP_CLUSTER_DIR") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def _kill_shims(self) -> None:
        """containerd-shim-runc-v2 processes serving this cluster's containerd (by its socket)."""
        needle = str(self.ctr_sock).encode()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmd and needle in cmd:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- processes ------------------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], *, node: bool = False) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.procs[name] = subprocess.Popen(
            self.ns(argv, node=node),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def _kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def wait(
        self, what: str, cond: Callable[[], object], *, timeout: float = 120, proc: str = ""
    ) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc and self.procs[proc].poll() is not None:
                raise NodeClusterError(f"{proc} exited {self.procs[proc].returncode} ({what})")
            try:
                got = cond()
            except (subprocess.SubprocessError, AssertionError, ValueError, KeyError):
                got = None
            if got:
                return got
            time.sleep(1)
        raise NodeClusterError(f"timed out after {timeout:.0f} s waiting for {what}")

    def _api_ready(self) -> bool:
        done = self.run(["kubectl", "get", "--raw", "/readyz"], check=False, timeout=20)
        return done.stdout.strip() == "ok"

    def _node_ready(self) -> bool:
        node = self.get("node", NODE_NAME)
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"]
        )

    def _tails(self, n: int = 25) -> str:
        out = []
        for f in sorted(self.logs.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def collect_logs(self, dest: Path) -> Path:
        """Copies every component's log and every container's log (the kubelet's
        /var/log/pods-style files under its root) to `dest`."""
        dest.mkdir(parents=True, exist_ok=True)
        for f in self.logs.glob("*.log"):
            shutil.copy(f, dest / f.name)
        pods = Path("/var/log/pods")
        for d in pods.glob("*_*_*") if pods.exists() else []:
            shutil.copytree(d, dest / "pods" / d.name, dirs_exist_ok=True)
        try:
            (dest / "pods.txt").write_text(
                self.kubectl("get", "pods", "-A", "-o", "wide", check=False, timeout=30)
                + self.kubectl("get", "events", "-A", check=False, timeout=30)
            )
        except subprocess.SubprocessError:
            pass
        return dest
