"""The vLLM connector's tests: run with the vLLM venv (``scripts/setup.sh vllm``), skipped without vLLM.

.venv-vllm/bin/python -m pytest tests/vllm -m vllm
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin is not None  # not this directory, seen as a namespace package


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs vLLM (scripts/setup.sh vllm; run with .venv-vllm/bin/python)")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    r = subprocess.run(
        [sys.executable, str(HERE / "vllm_run.py"), "--make-model", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return path
