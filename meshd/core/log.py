"""Logging for meshd processes: structlog, readable on a terminal, JSON lines otherwise.

Rule: logs go to stderr (stdout belongs to program output such as generated text), and
libp2p's chatty loggers are held at ERROR unless asked for (MESHD_LIBP2P_LOG_LEVEL); lines py-libp2p
logs for ordinary events (a peer half-closing a Kademlia stream) are dropped at any level, and the
ERROR lines of a benign race (identify on a connection that is closing) are lowered to DEBUG, so an
ERROR in an operator's log means trouble.
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
# py-libp2p 0.8.1 identifies every new connection from a background task (BasicHost._identify_peer,
# scheduled on connect and on the notifee's "connected"). When the connection closes between that
# task's is_closed check and its stream's multistream handshake, `new_stream` logs two ERROR lines
# and raises; the identify task catches it and logs its own DEBUG "Identify[...]: failed to open
# stream". Nothing meshd asked for failed. Seen in a healthy 3-daemon mesh (loopback, 8 concurrent
# sessions, nothing killed): every such ERROR line was an `/ipfs/id/1.0.0` stream, each one matched
# by an identify DEBUG line for the same peer, the peers were the throwaway probe hosts of
# reachability's dial-back (`dial_fresh` connects and hangs up at once) or the daemons those probes
# dialled, and a mesh with no generation at all logged as many (4 a daemon). So they go to DEBUG:
# - "Failed to open stream to peer ...": only when the protocols tried are identify's (a meshd
#   stream that fails to open stays an ERROR here, and meshd reports it in its own words too);
# - the multistream client's "handshake: write failed" / "read failed": always, since it never
#   stands alone: its caller gets the failure as an exception and reports it (`new_stream` with the
#   line above, naming the protocol; a dial's upgrade with the dial's failure).
# The same hang-up makes Yamux's read loop log "Error in handle_incoming for peer ...:
# ClosedResourceError" (the probe's own side, closed under it) or "...: ConnectionClosedError: TCP
# connection reset by remote peer" (the side the probe hung up on); seen 1 and 4 times in such runs,
# always for a probe's connection. py-libp2p ends the loop for these as it does for the closes it
# logs at INFO ("Yamux connection closed cleanly"): a connection ended, nothing more. They go to INFO;
# what a connection's end costs meshd (a session rerouted) meshd logs itself.
IDENTIFY_PROTOCOLS = ("'/ipfs/id/1.0.0'", "'/ipfs/id/push/1.0.0'")
HANDSHAKE_FAILED = ("MultiselectClient handshake: write failed", "MultiselectClient handshake: read failed")
CONNECTION_ENDED = (": ClosedResourceError", ": ConnectionClosedError")


def lowered_level(record: logging.LogRecord) -> int | None:
    """A lower level for a library ERROR line that only reports the hang-up race above, else None."""
    if record.levelno < logging.ERROR:
        return None
    msg = record.getMessage()
    if record.name == "libp2p.protocol_muxer.multiselect_client" and msg.startswith(HANDSHAKE_FAILED):
        return logging.DEBUG
    if record.name == "libp2p.host.basic_host" and msg.startswith("Failed to open stream to peer"):
        tried = msg.partition("Protocols: [")[2].partition("]")[0]
        if tried and all(p.strip() in IDENTIFY_PROTOCOLS for p in tried.split(",")):
            return logging.DEBUG
    if (record.name == "libp2p.stream_muxer.yamux.yamux" and msg.startswith("Error in handle_incoming for peer")
            and any(e in msg for e in CONNECTION_ENDED)):
        return logging.INFO
    return None


class QuietLibraries(logging.Filter):
    """Drops library records below `level` (py-libp2p sets some of its loggers' levels itself, e.g.
    its auto-connector's to INFO, so logger levels alone do not hold) and py-libp2p's benign lines."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(NOISY_LOGGERS):
            return True
        lowered = lowered_level(record)
        if lowered is not None:
            record.levelno, record.levelname = lowered, logging.getLevelName(lowered)
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
