#!/usr/bin/env bash
# Create .venv (if missing) and install tierkv with the given extras. Idempotent and quiet on re-runs.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test   or   scripts/setup.sh serve
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# Pin torch before anything asks for it: a bare `torch` requirement would pull a multi-GB CUDA build.
# On this project's machines torch==2.13.0 is a local CPU wheel.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${TIERKV_TORCH_VERSION:-2.13.0}"
fi
stamp=".venv/.tierkv-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
