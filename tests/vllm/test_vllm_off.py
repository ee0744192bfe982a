"""A connector that turns itself off leaves vLLM running exactly as without it (a real engine).

A sliding-window model (a tiny random Mistral) is refused by ``namespace.unsupported``; both of the
connector's roles must then answer every call vLLM makes as a connector with nothing to do (it raised
``AttributeError: ... 'epoch'`` on the first request) and the answers must be those of an engine without
the connector.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engine import HERE, Engine


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-mistral-sliding"
    r = subprocess.run(
        [sys.executable, str(HERE / "vllm_run.py"), "--make-model", str(path), "256"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return path


def test_a_sliding_window_model_runs_as_without_the_connector(tmp_path: Path, sliding_model: Path) -> None:
    engine = Engine(tmp_path, sliding_model)
    prompt = random.Random(4).choices(range(3, 500), k=3 * 128 + 20)
    connector = {"cache_dir": str(tmp_path / "cache")}
    base = engine.start("base", [{"tokens": prompt}], None)
    with_connector = engine.run("with", [{"tokens": prompt}, {"tokens": prompt}], connector)
    base = engine.wait(base)
    assert "tierkv connector is off for this engine: KV cache spec SlidingWindowSpec" in with_connector["log"]
    assert [r["tokens"] for r in with_connector["results"]] == [base["results"][0]["tokens"]] * 2
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
