"""Logging for meshd processes: structlog, readable on a terminal, JSON lines otherwise.

Rule: logs go to stderr (stdout belongs to program output such as generated text), and
libp2p's chatty loggers are held at ERROR unless asked for (MESHD_LIBP2P_LOG_LEVEL); lines py-libp2p
logs for ordinary events (a peer half-closing a Kademlia stream) are dropped at any level.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

NOISY_LOGGERS = ("libp2p", "multiaddr", "async_service", "transformers", "urllib3", "filelock")
# py-libp2p 0.8.1 logs these for ordinary events: a requester's clean half-close ends in an exception
# whose text is empty, and a peer still on an older meshd sends record keys in FIND_NODE.
BENIGN_LIBP2P = ("Failed to read DHT message from stream: ", "FIND_NODE key is not a valid PeerId")


class QuietLibraries(logging.Filter):
    """Drops library records below `level` (py-libp2p sets some of its loggers' levels itself, e.g.
    its auto-connector's to INFO, so logger levels alone do not hold) and py-libp2p's benign lines."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(NOISY_LOGGERS):
            return True
        if record.levelno < self.level:
            return False
        msg = record.getMessage()
        return not (msg == BENIGN_LIBP2P[0] or msg.startswith(BENIGN_LIBP2P[1]))


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
    for handler in logging.getLogger().handlers:
        handler.addFilter(QuietLibraries(logging.getLevelName(quiet)))
    # importing libp2p resets its logger (level WARNING, no propagation: lines reach stderr bare
    # through logging's last-resort handler), so it is imported before the levels are set
    import libp2p  # noqa: F401

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
        logging.getLogger(name).propagate = True


def get_logger(name: str):
    return structlog.get_logger(name)
