#!/usr/bin/env bash
# Time the micro-benchmarks (hashing, codec, disk put/get, host tier) for real.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test 2> >(grep -v "is ignored: it is neither" >&2)
.venv/bin/python -m pytest -q tests/test_micro_bench.py --benchmark-enable --benchmark-only "$@"
