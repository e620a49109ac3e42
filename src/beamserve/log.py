"""Structured logging: JSON lines on stderr (or key=value for a terminal), one setup call."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


def setup(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once. `BEAMSERVE_LOG_LEVEL` / `BEAMSERVE_LOG_JSON` override."""
    level = (level or os.environ.get("BEAMSERVE_LOG_LEVEL", "info")).upper()
    if json is None:
        env = os.environ.get("BEAMSERVE_LOG_JSON")
        json = (env == "1") if env is not None else not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger


def progress_bar(console: Any) -> Any:
    """The progress display of long commands (rich): description, bar, n of N, elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
