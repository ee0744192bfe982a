"""The benchmarks run (quick mode), write their report, and measure what they claim to."""

import json

import pytest
from click.testing import CliRunner

from tierkv.bench import plan
from tierkv.cli import main


def _quick(tmp_path, monkeypatch, only: str) -> tuple[dict, object]:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["bench", "--quick", "--only", only, "--out", str(tmp_path / "results")])
    assert r.exit_code == 0, r.output
    (folder,) = (tmp_path / "results").iterdir()
    res = json.loads((folder / "results.json").read_text())
    assert res["machine"]["cores"] >= 1 and res["quick"] is True
    return res, folder


def test_bench_quick_writes_json_markdown_and_plots(tmp_path, monkeypatch) -> None:
    res, folder = _quick(tmp_path, monkeypatch, "ttft,tiers,plan")
    (ttft,) = res["ttft"]
    for row in ttft["rows"]:
        assert row["host_s"]["median"] < row["cold_s"]["median"]  # restoring beats recomputing
    tiers = res["tiers"]
    depths = [
        tiers["rows_Bps"][f"raw O_DIRECT sequential read, {s} MiB, QD {d}"]["median"]
        for s in (1, 8)
        for d in (1, 4, 32)
    ]
    depths.append(tiers["rows_Bps"]["raw buffered cold sequential read, 8 MiB, 4 threads"]["median"])
    own = tiers["rows_Bps"][
        "raw buffered cold sequential read of the store's segment files, 8 MiB, 4 threads"
    ]
    assert own["n"] == tiers["rows_Bps"]["restore one-prefix, cold"]["n"]  # one before each cold restore
    depths.append(own["median"])
    runs = tiers["config"]["runs"]
    assert tiers["rows_Bps"]["raw O_DIRECT sequential read, 1 MiB, QD 1"]["n"] == 2 * runs  # two passes
    depths += [
        v["median"] for k, v in tiers["rows_Bps"].items() if k.startswith("fio O_DIRECT sequential read")
    ]
    assert tiers["disk_read_limit_Bps"] == max(depths) > 0  # the limit is the best of them
    assert tiers["ratios"]["restore cold one-prefix / disk limit"] == pytest.approx(
        tiers["rows_Bps"]["restore one-prefix, cold"]["median"] / tiers["disk_read_limit_Bps"]
    )
    first = tiers["rows_Bps"]["first restore in a fresh process, cold, host tier on"]
    assert first["n"] == 2 and first["median"] > 0  # measured in fresh processes, beside the disk limit
    assert tiers["ratios"]["first restore, host tier on / disk limit"] > 0
    for row in ttft["rows"]:  # TTFT apart: the restore and the forward, each beside its own baseline
        assert 0 < row["host_restore_s"]["median"] < row["host_s"]["median"]
        assert row["forward_1_contiguous_s"]["median"] > 0
        assert row["restore_floor_s"]["disk_cold"] == pytest.approx(
            row["kv_nbytes"] / ttft["bandwidth_Bps"]["disk_read_limit"]
        )
        # the total's floor: the bytes, then the forward a perfect restore would be followed by
        assert row["floor_host_s"] == pytest.approx(
            row["kv_nbytes"] / ttft["bandwidth_Bps"]["memcpy"] + row["forward_1_contiguous_s"]["median"]
        )
    readme = (folder / "README.md").read_text()
    assert "Quick run: a smoke test" in readme  # nobody quotes a quick run's numbers unwarned
    assert f"read limit in this run: {tiers['disk_read_limit_Bps'] / 1e9:.2f} GB/s" in readme
    assert "Restore and forward apart" in (folder / "README.md").read_text()
    assert res["plan"]["measured"]["break_even_Bps"] > 0
    readme = (folder / "README.md").read_text()
    assert "## TTFT" in readme and "ttft.png" in readme
    assert (folder / "ttft.png").stat().st_size > 1000 and (folder / "bandwidth.png").stat().st_size > 1000


@pytest.mark.slow  # servers through HTTP, several minutes of CPU: behind --runslow (test_server and test_router
def test_bench_quick_workloads_and_scaleout(tmp_path, monkeypatch) -> None:  # cover the same paths in CI)
    res, folder = _quick(tmp_path, monkeypatch, "workloads,scaleout,overhead")
    over = res["overhead"]
    assert len(over["ttft_s"]["cache on"]) == len(over["ttft_s"]["cache off"]) == 4
    assert over["overhead"] == pytest.approx(over["median_on_s"] / over["median_off_s"] - 1)
    low, high = over["overhead_95_interval"]
    assert low <= high
    rates = {(w["workload"], w["mode"]): w["hit_rate"] for w in res["workloads"]["rows"]}
    assert rates[("date at the end", "cache on")] > rates[("date on the first line", "cache on")] == 0
    assert rates[("RAG, rules first", "cache on")] > rates[("RAG, retrieved first", "cache on")]
    assert all(rate == 0 for (_, mode), rate in rates.items() if mode == "cache off")
    so = {(r["remote"], r["routed"]): r["hit_rate"] for r in res["scaleout"]["rows"]}
    assert so[(False, True)] > so[(False, False)]  # routing keeps a prefix where its KV is
    if res["scaleout"]["config"]["redis"]:
        assert so[(True, False)] > so[(False, False)]  # the shared tier serves the other worker's prefixes
    assert "## Workloads" in (folder / "README.md").read_text()


def test_computed_break_even_is_kv_bytes_times_throughput() -> None:
    (row,) = [r for r in plan.computed("H200", 0.4, 8192) if r["shape"].startswith("Llama-3.1-8B")]
    assert row["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert row["break_even_Bps"] == pytest.approx(row["kv_bytes_per_token"] * row["prefill_tokens_per_s"])
    assert 1e9 < row["break_even_Bps"] < 1e11  # GB/s territory for an 8B model on an H200


def test_bench_rejects_unknown_parts(tmp_path) -> None:
    r = CliRunner().invoke(main, ["bench", "--only", "ttft,magic", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "magic" in r.output


def test_overhead_interval_is_exact_without_noise_and_widens_with_it() -> None:
    import random

    from tierkv.bench.overhead import _interval

    off = [1.0 + 0.1 * r for r in range(8) for _ in range(5)]  # drift between rounds, none within
    low, high = _interval({"cache on": [t * 1.05 for t in off], "cache off": off}, per_block=5)
    assert low == pytest.approx(0.05) and high == pytest.approx(0.05)
    rng = random.Random(1)
    noisy = [t * 1.05 * rng.uniform(0.8, 1.2) for t in off]
    low, high = _interval({"cache on": noisy, "cache off": off}, per_block=5)
    assert low < 0.05 < high and high - low > 0.05  # what 20% noise over 8 rounds allows one to claim
