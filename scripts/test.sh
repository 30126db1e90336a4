#!/usr/bin/env bash
# Set up what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the kernel's build is optional for users (meshd falls back to torch), not here: with a compiler
# present a build error must fail the run, not skip the native lane's tests
if command -v gcc >/dev/null; then
    .venv/bin/python -c "import sys; from meshd.shard import blocks; sys.exit(0 if blocks.KERNEL is not None else
        'meshd/shard/_blocks.c did not build: see pip install -v -e .')"
fi
exec .venv/bin/python -m pytest -q "$@"
