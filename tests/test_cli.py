import json

import pytest
from click.testing import CliRunner

from tierkv import TieredStore
from tierkv.cli import main

from helpers import make_kv


@pytest.fixture
def store_dir(tmp_path, ns):
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=2**20, ttl_s=3600) as store:
        for p in range(4):
            store.save(ns, [p * 100 + t for t in range(32)], make_kv(ns, 32, seed=p))
    return tmp_path


def test_stats_json(store_dir, ns) -> None:
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["blocks"] == 8
    assert report["policy"] == {"budget_nbytes": 2**20, "ttl_s": 3600, "max_age_s": None}
    (row,) = report["namespaces"]
    assert row["digest"] == ns.digest.hex() and row["blocks"] == 8 and row["expired_unswept"] == 0
    assert sum(row["last_access_histogram"].values()) == 8


def test_stats_text_uses_env_cache_dir(store_dir, monkeypatch) -> None:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(store_dir))
    r = CliRunner().invoke(main, ["stats"])
    assert r.exit_code == 0 and "blocks     8" in r.output and "test-model@r1" in r.output


def test_gc_dry_run_changes_nothing(store_dir) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--all", "--dry-run", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["purged"] == 8
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir), "--json"])
    assert json.loads(r.output)["blocks"] == 8


def test_gc_purge_namespace_by_prefix(store_dir, ns) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--namespace", ns.digest.hex()[:8], "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["purged"] == 8
    assert json.loads(r.output)["live_nbytes"] == 0


def test_gc_ttl_and_budget(store_dir) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--budget", "8KiB", "--json"])
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["evicted"] == 6 and out["live_nbytes"] == 8192
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--ttl", "0s", "--json"])
    assert json.loads(r.output)["expired"] == 2


@pytest.mark.parametrize("args", [["--ttl", "soon"], ["--budget", "lots"], ["--namespace", "ab", "--all"],
                                  ["--namespace", "zzzzzz"]])
def test_bad_arguments_one_line_exit_2(store_dir, args) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), *args])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and r.output.startswith("tierkv: error:")


def test_missing_store_is_exit_1(tmp_path) -> None:
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(tmp_path / "none")])
    assert r.exit_code == 1 and "no tierkv store" in r.output
