"""Typed errors of the engine launcher. Each message names the field and the fix."""

from __future__ import annotations


class LaunchError(Exception):
    """Base of every error raised by `beamserve.workers.launch`."""


class PoolSpecError(LaunchError, ValueError):
    """A pool spec holds an unknown key, a value of the wrong type, or an invalid combination.

    `problems` lists one `"field.path: what is wrong; the fix"` line per problem.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid pool spec:\n  " + "\n  ".join(problems))


class PairCompatError(LaunchError, ValueError):
    """A prefill pool and a decode pool cannot exchange KV; refused before launch."""


class EngineEnvError(LaunchError, ValueError):
    """A rendered environment refers to a variable (`$(NAME)`) the launching process lacks."""


class EngineExitedError(LaunchError):
    """The engine process exited before it became ready."""

    def __init__(self, returncode: int, argv0: str) -> None:
        self.returncode = returncode
        super().__init__(
            f"engine {argv0!r} exited with status {returncode} before it became ready; "
            "read its log above for the cause"
        )


class EngineNotReadyError(LaunchError, TimeoutError):
    """The engine did not answer its readiness probe within the deadline."""
