#!/usr/bin/env bash
# The test command: set up .venv, lint, run the test suite (under 10 minutes on 2 cores).
# Extra arguments go to pytest (e.g. --runslow for the soak, crash and benchmark variants;
# --switch-interval 1e-5 for threads that take turns mid-call, as on a loaded machine).
set -euo pipefail
cd "$(dirname "$0")/.."
# The native reader (native/*.c) must build and load here: its tests fail instead of skipping.
export TIERKV_REQUIRE_NATIVE="${TIERKV_REQUIRE_NATIVE:-1}"
scripts/setup.sh test 2> >(grep -v "is ignored: it is neither" >&2)
.venv/bin/ruff check tierkv tests bench
.venv/bin/ruff format --check tierkv tests bench
.venv/bin/python -m mypy  # configured in pyproject.toml: the tierkv package
.venv/bin/python -m pytest -q "$@"
