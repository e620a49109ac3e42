"""`LaunchCommand`: what a renderer produces — argv, environment and the engine's probes.

Environment values may refer to other variables as `$(NAME)`, Kubernetes' own syntax for
dependent environment variables: in a pod, kubelet expands `$(POD_IP)` from an earlier
`env` entry (the operator defines `POD_IP` from the downward API, `fieldRef: status.podIP`);
outside Kubernetes, `resolve_env` expands it from the launching process's environment.
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
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    port: int = 8000
    ready_path: str = "/health"
    live_path: str = "/health"

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

            def expand(m: re.Match[str], key: str = key) -> str:
                name = m.group(1)
                if name not in environ:
                    raise EngineEnvError(
                        f"{key}: refers to $({name}), which is not set; export {name} "
                        "(in a pod: an env entry with fieldRef status.podIP)"
                    )
                return environ[name]

            out[key] = _REF.sub(expand, value)
        return out
