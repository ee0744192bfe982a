"""``tierkv bench --engine vllm`` runs for real: nine vLLM servers (cold, tierkv saving, tierkv loading
after a restart, once more through a buffer and once with buffered reads, ExampleConnector saving and
loading, tierkv saving and cold again), one short prompt length, one prompt each; and the load itself,
timed in each connector."""

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
    # cold and saving: a server at the start and another at the end of the run, one prompt each
    assert len(row["cold"]["all_s"]) == len(row["tierkv_saving"]["all_s"]) == 2
    assert (folder / "vllm-cold-again.log").exists() and (folder / "vllm-tierkv-save-again.log").exists()
    assert "tierkv on, saving / cold prefill" in (folder / "README.md").read_text()
    # 300 tokens: two whole blocks of 128, the last token always computed
    assert row["tierkv_disk_cold"]["cached"] == row["tierkv_host"]["cached"] == 256
    assert row["example_disk_cold"]["cached"] == row["example_warm"]["cached"] == 256
    assert "Example disk / tierkv disk" in (folder / "README.md").read_text()
    assert "tierkv connector (worker): loaded" in (folder / "vllm-tierkv-load.log").read_text()
    assert "copy natively into and out of the pages" in (folder / "vllm-tierkv-load.log").read_text()
    assert "through a buffer" in (folder / "vllm-tierkv-load-buffer.log").read_text()
    # the load itself: 256 tokens of 4 layers x K, V x 2 KV heads x 64 dims in float32 into the pages
    kv_nbytes = 256 * 4 * 2 * 2 * 64 * 4
    assert "reads O_DIRECT where uncached" in (folder / "vllm-tierkv-load.log").read_text()
    assert "reads buffered with readahead" in (folder / "vllm-tierkv-load-buffered-reads.log").read_text()
    for column in (
        "tierkv_disk_cold",
        "tierkv_host",
        "tierkv_disk_cold_buffer",
        "tierkv_host_buffer",
        "tierkv_disk_cold_buffered_reads",
    ):
        assert row[column]["cached"] == 256 and row[column]["load_s"] > 0, column
        assert abs(row[column]["load_gbps"] * 1e9 * row[column]["load_s"] - kv_nbytes) < 1e-3 * kv_nbytes
    for column in ("example_disk_cold", "example_warm"):  # timed around ExampleConnector's start_load_kv
        assert row[column]["load_s"] > 0, column
    assert res["limits"]["memcpy_gbps"] > 0 and res["limits"]["disk_read_gbps"] > 0
    assert "tierkv host / memcpy" in (folder / "README.md").read_text()


def test_the_sessions_benchmarks_offloading_config_is_what_vllm_reads() -> None:
    """On a GPU node the sessions benchmark also runs vLLM's own OffloadingConnector (CUDA only, so not
    here): its two configurations must name the spec, the tier type and the keys the installed vLLM reads,
    checked against vLLM's own registries and constructor (a renamed key would fail only on the GPU)."""
    import inspect

    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tierkv.bench.sessions import offload_config

    cpu = offload_config(1 << 30, None)
    assert cpu["kv_connector"] == "OffloadingConnector"
    assert OffloadingSpecFactory.get_spec_cls(cpu["kv_connector_extra_config"]) is CPUOffloadingSpec
    assert '"cpu_bytes_to_use"' in inspect.getsource(CPUOffloadingSpec)
    tiered = offload_config(1 << 30, Path("/nonexistent/fs-tier"))["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(tiered) is TieringOffloadingSpec
    (fs,) = tiered["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(fs)
    params = inspect.signature(tier_cls.__init__).parameters
    assert all(k in params for k in fs if k != "type"), (tier_cls, list(params))
