"""`LaunchCommand`: what a renderer produces — argv, environment and the engine's probes.

Environment values may refer to other variables as `$(NAME)`, Kubernetes' own syntax for
dependent environment variables: in a pod, kubelet expands `$(POD_IP)` from an earlier
`env` entry (the operator defines `POD_IP` from the downward API, `fieldRef: status.podIP`);
outside Kubernetes, `resolve_env` expands it from the launching process's environment.

The same references appear in `argv` for the ranks of a multi-node instance:
`--node-rank $(LWS_WORKER_INDEX)`, `--dist-init-addr $(LWS_LEADER_ADDRESS):PORT`. Kubelet
expands `$(NAME)` in a container's `command` and `args` from the container's `env`, which
LeaderWorkerSet fills with `LWS_LEADER_ADDRESS`, `LWS_WORKER_INDEX` and `LWS_GROUP_SIZE` on
every pod of a group, so the pod needs no shell and no launcher shim; outside Kubernetes,
`resolve_argv` expands them (and `EngineSupervisor` runs the expanded argv). A reference to an
unset variable is an error here; kubelet would pass it on literally.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from beamserve.workers.launch.errors import EngineEnvError

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class LaunchCommand:
    """One engine process: `argv` to exec, `env` to add to the pod's environment.

    `ready_path` answers 200 only once the engine can serve (polled by the supervisor and
    used as the pod's readiness probe); `live_path` is the cheap liveness probe.
    `serves_http` is false for the worker nodes of a multi-node instance (SGLang rank ≥ 1,
    vLLM `--headless`): they serve no HTTP, so only the process itself can be watched.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    port: int = 8000
    ready_path: str = "/health"
    live_path: str = "/health"
    serves_http: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    def flag(self, name: str) -> str | None:
        """The value following flag `name` in argv (None when absent or a bare switch)."""
        for i, arg in enumerate(self.argv):
            if arg == name:
                nxt = self.argv[i + 1] if i + 1 < len(self.argv) else None
                return None if nxt is None or nxt.startswith("-") else nxt
        return None

    def resolve_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """`environ` plus `env`, with every `$(NAME)` reference expanded from `environ`.

        Raises `EngineEnvError` naming the variable when a reference cannot be expanded.
        """
        out = dict(environ)
        for key, value in self.env.items():
            out[key] = _expand(key, value, environ)
        return out

    def resolve_argv(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """`argv` with every `$(NAME)` expanded from `environ` (what kubelet does in a pod).

        Raises `EngineEnvError` naming the flag when a reference cannot be expanded.
        """
        out: list[str] = []
        for i, arg in enumerate(self.argv):
            where = self.argv[i - 1] if i and self.argv[i - 1].startswith("-") else f"argv[{i}]"
            out.append(_expand(where, arg, environ))
        return tuple(out)

    @property
    def references(self) -> frozenset[str]:
        """Every variable `argv` and `env` refer to as `$(NAME)`."""
        found = {m.group(1) for a in (*self.argv, *self.env.values()) for m in _REF.finditer(a)}
        return frozenset(found)


_HINT = {
    "LWS_LEADER_ADDRESS": "LeaderWorkerSet sets it; else export the leader's address",
    "LWS_WORKER_INDEX": "LeaderWorkerSet sets it; else export this node's rank (0: leader)",
}


def _expand(where: str, value: str, environ: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in environ:
            hint = _HINT.get(name, "in a pod: an env entry with fieldRef status.podIP")
            raise EngineEnvError(
                f"{where}: refers to $({name}), which is not set; export {name} ({hint})"
            )
        return environ[name]

    return _REF.sub(one, value)
