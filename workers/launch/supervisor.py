"""`EngineSupervisor`: run one rendered engine command as a child process and look after it.

* launch: `asyncio` subprocess in its own session (so a terminal's Ctrl-C reaches the engine
  once, through us), environment = ours + the command's, `$(NAME)` references expanded;
* readiness: polls `http://127.0.0.1:{port}{ready_path}` until it answers 200, then keeps
  polling; `is_ready` turns false after `fail_threshold` failed probes in a row, and at once
  when draining starts (so the pod's readiness, which relays it, drops traffic first);
* drain: `stop()` sends SIGTERM (or the signal we received), waits up to `grace_s` for the
  engine to finish, then SIGKILLs the engine's whole process group (engines fork workers);
* signals: `run()` forwards SIGTERM and SIGINT to the engine as a drain, and returns the
  engine's exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

import httpx
from beamserve.workers.launch.command import LaunchCommand
from beamserve.workers.launch.errors import EngineExitedError, EngineNotReadyError


@dataclass(frozen=True)
class SupervisorOptions:
    """Timings of a supervisor, in seconds."""

    grace_s: float = 30.0
    """How long a draining engine may take after SIGTERM before it is SIGKILLed."""
    poll_interval_s: float = 0.5
    probe_timeout_s: float = 5.0
    fail_threshold: int = 3
    """Failed readiness probes in a row that make a ready engine unready."""
    health_host: str = "127.0.0.1"


class EngineSupervisor:
    """Owns one engine process. Use `async with` or `start()` … `stop()`; or `run()`."""

    def __init__(
        self,
        command: LaunchCommand,
        options: SupervisorOptions | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        stdout: IO[bytes] | int | None = None,
        stderr: IO[bytes] | int | None = None,
    ) -> None:
        self.command = command
        self.options = options or SupervisorOptions()
        environ = os.environ if environ is None else environ
        self._env = command.resolve_env(environ)
        # `$(NAME)` in argv (multi-node ranks), as kubelet would expand it in a pod
        self._argv = command.resolve_argv(environ)
        self._stdout, self._stderr = stdout, stderr
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = False
        self._ever_ready = asyncio.Event()
        self._draining = False
        self._probe_task: asyncio.Task[None] | None = None
        self._stop_lock = asyncio.Lock()

    # -- state ---------------------------------------------------------------------------

    @property
    def ready_url(self) -> str:
        return f"http://{self.options.health_host}:{self.command.port}{self.command.ready_path}"

    @property
    def is_ready(self) -> bool:
        """True while the engine answers its readiness probe and is not draining."""
        return self._ready and not self._draining and self.returncode is None

    @property
    def returncode(self) -> int | None:
        """The engine's exit status once it has exited (negative: killed by that signal)."""
        return None if self._proc is None else self._proc.returncode

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the engine and start probing it. Returns once the process exists."""
        if self._proc is not None:
            raise RuntimeError("start: this supervisor already started its engine")
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv,
            env=self._env,
            stdout=self._stdout,
            stderr=self._stderr,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        if self.command.serves_http:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="engine-readiness")
        else:
            # a worker node of a multi-node instance: nothing to probe; running is all
            self._ready = True
            self._ever_ready.set()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the engine first answers its readiness probe.

        Raises `EngineExitedError` if it exits first, `EngineNotReadyError` after `timeout_s`.
        """
        proc = self._require_proc()
        ready = asyncio.create_task(self._ever_ready.wait())
        exited = asyncio.create_task(proc.wait())
        try:
            done, _ = await asyncio.wait(
                {ready, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for t in (ready, exited):
                if not t.done():
                    t.cancel()
        if ready in done and self._ever_ready.is_set():
            return
        if exited in done:
            raise EngineExitedError(proc.returncode or 0, self.command.argv[0])
        raise EngineNotReadyError(
            f"engine: no 200 from {self.ready_url} within {timeout_s} s; raise the timeout "
            "(large checkpoints load for minutes) or read the engine log"
        )

    async def wait(self) -> int:
        """Wait for the engine to exit; its exit status."""
        code = await self._require_proc().wait()
        await self._stop_probing()
        return code

    async def stop(self, sig: signal.Signals = signal.SIGTERM, grace_s: float | None = None) -> int:
        """Drain: send `sig`, wait up to `grace_s`, then SIGKILL the process group.

        Idempotent; returns the engine's exit status.
        """
        proc = self._require_proc()
        grace = self.options.grace_s if grace_s is None else grace_s
        async with self._stop_lock:
            self._draining = True
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=grace)
                except TimeoutError:
                    self._kill_group(proc.pid)
                    await proc.wait()
            # workers the engine forked and left behind go with it
            self._kill_group(proc.pid)
        await self._stop_probing()
        assert proc.returncode is not None
        return proc.returncode

    async def run(self, ready_timeout_s: float | None = None) -> int:
        """Start, forward SIGTERM/SIGINT as a drain, wait for exit; the engine's status.

        Call from the main thread's event loop (signal handlers live there).
        """
        loop = asyncio.get_running_loop()
        await self.start()
        stopping: list[asyncio.Task[int]] = []

        def on_signal(sig: signal.Signals) -> None:
            if not stopping:
                stopping.append(asyncio.create_task(self.stop(sig)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            if ready_timeout_s is not None:
                try:
                    await self.wait_ready(ready_timeout_s)
                except EngineNotReadyError:
                    return await self.stop()
                except EngineExitedError:
                    pass
            code = await self.wait()
            if stopping:
                code = await stopping[0]
            return code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def __aenter__(self) -> EngineSupervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._proc is not None:
            await self.stop()

    # -- internals -----------------------------------------------------------------------

    def _require_proc(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise RuntimeError("engine not started; call start() first")
        return self._proc

    @staticmethod
    def _kill_group(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    async def _probe_loop(self) -> None:
        opts = self.options
        failures = 0
        async with httpx.AsyncClient(timeout=opts.probe_timeout_s, trust_env=False) as client:
            while self._proc is not None and self._proc.returncode is None:
                started = time.monotonic()
                try:
                    ok = (await client.get(self.ready_url)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    failures = 0
                    self._ready = True
                    self._ever_ready.set()
                else:
                    failures += 1
                    if failures >= opts.fail_threshold:
                        self._ready = False
                elapsed = time.monotonic() - started
                await asyncio.sleep(max(0.0, opts.poll_interval_s - elapsed))
        self._ready = False

    async def _stop_probing(self) -> None:
        task, self._probe_task = self._probe_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ready = False
