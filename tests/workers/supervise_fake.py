"""Run `EngineSupervisor.run()` over a command, as a worker pod's main process would.

    supervise_fake.py PORT GRACE_S LOG -- ARGV...

Appends `{"event": "supervisor-ready"}` to LOG once the engine is ready, and
`{"event": "supervisor-exit", "code": N}` at the end; exits with the engine's status
(128 + signal number when it was killed by a signal, as a shell reports it).
"""

from __future__ import annotations

import asyncio
import json
import sys

from beamserve.workers.launch import EngineSupervisor, LaunchCommand, SupervisorOptions


async def main(port: int, grace_s: float, log: str, argv: list[str]) -> int:
    cmd = LaunchCommand(argv=tuple(argv), env={"ENGINE_POD": "$(POD_IP)"}, port=port)
    sup = EngineSupervisor(cmd, SupervisorOptions(grace_s=grace_s, poll_interval_s=0.05))

    async def report_ready() -> None:
        while not sup.is_ready:
            await asyncio.sleep(0.02)
        with open(log, "a") as f:
            f.write(json.dumps({"event": "supervisor-ready"}) + "\n")

    watcher = asyncio.ensure_future(report_ready())
    code = await sup.run()
    watcher.cancel()
    with open(log, "a") as f:
        f.write(json.dumps({"event": "supervisor-exit", "code": code}) + "\n")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    port, grace, log, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: supervise_fake.py PORT GRACE_S LOG -- ARGV..."
    sys.exit(asyncio.run(main(int(port), float(grace), log, argv)))
