"""Logging setup in a fresh process: py-libp2p's noise stays out of an operator's log."""

import os
import subprocess
import sys

SCRIPT = """
from meshd.node.log import setup_logging
setup_logging("INFO", json=True)
from libp2p.kad_dht import kad_dht  # imported after the setup, as the daemon does
kad_dht.logger.warning("Failed to read DHT message from stream: ")
kad_dht.logger.warning("FIND_NODE key is not a valid PeerId (59 bytes), ignoring")
kad_dht.logger.warning("a warning")
kad_dht.logger.error("an error")
import logging
logging.getLogger("libp2p.network.auto_connector").info("an info from a logger libp2p set to INFO itself")
"""


def run(env_level=None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MESHD_LIBP2P_LOG_LEVEL", "LIBP2P_DEBUG")}
    if env_level:
        env["MESHD_LIBP2P_LOG_LEVEL"] = env_level
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr.splitlines()


def test_libp2p_logs_errors_only_by_default_and_never_its_benign_lines():
    assert run() == ["ERROR libp2p.kad_dht.kad_dht: an error"]
    assert run("WARNING") == ["WARNING libp2p.kad_dht.kad_dht: a warning", "ERROR libp2p.kad_dht.kad_dht: an error"]
