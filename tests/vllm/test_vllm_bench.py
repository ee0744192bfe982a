"""``tierkv bench --engine vllm`` runs for real: five vLLM servers (cold, tierkv saving and loading after a
restart, ExampleConnector saving and loading), one short prompt length, one prompt each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_engine import ROOT


def test_the_vllm_benchmark_measures_every_column(tmp_path: Path, model_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "bench", "--engine", "vllm", "--model", str(model_dir),
         "--lengths", "300", "--runs", "1", "--out", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = (tmp_path / "results").iterdir()
    res = json.loads((folder / "results.json").read_text())["vllm"]
    (row,) = res["rows"]
    assert row["tokens"] == 300 and row["same_first_token"]
    assert row["cold"]["cached"] == row["tierkv_saving"]["cached"] == row["example_saving"]["cached"] == 0
    # 300 tokens: two whole blocks of 128, the last token always computed
    assert row["tierkv_disk_cold"]["cached"] == row["tierkv_host"]["cached"] == 256
    assert row["example_disk_cold"]["cached"] == row["example_warm"]["cached"] == 256
    assert "Example disk / tierkv disk" in (folder / "README.md").read_text()
    assert "tierkv connector (worker): loaded" in (folder / "vllm-tierkv-load.log").read_text()
