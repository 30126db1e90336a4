"""Logging for meshd processes: structlog, readable on a terminal, JSON lines otherwise.

Rule: logs go to stderr (stdout belongs to program output such as generated text), and
libp2p's chatty loggers are held at WARNING-or-above unless asked for.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

NOISY_LOGGERS = ("libp2p", "multiaddr", "async_service", "transformers", "urllib3", "filelock")


def setup_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog and stdlib logging once per process."""
    level = (level or os.environ.get("MESHD_LOG_LEVEL", "INFO")).upper()
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    quiet = os.environ.get("MESHD_LIBP2P_LOG_LEVEL", "ERROR").upper()
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def get_logger(name: str):
    return structlog.get_logger(name)
