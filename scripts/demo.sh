#!/usr/bin/env bash
# Set up what is missing, then start three daemons on loopback, generate through them, stop them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/meshd demo "$@"
