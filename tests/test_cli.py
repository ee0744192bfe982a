import json
import os
import shutil
import subprocess
import sys

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
    r = CliRunner().invoke(
        main, ["gc", "--cache-dir", str(store_dir), "--namespace", ns.digest.hex()[:8], "--json"]
    )
    assert r.exit_code == 0 and json.loads(r.output)["purged"] == 8
    assert json.loads(r.output)["live_nbytes"] == 0


def test_gc_ttl_and_budget(store_dir) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--budget", "8KiB", "--json"])
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["evicted"] == 6 and out["live_nbytes"] == 8192
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--ttl", "0s", "--json"])
    assert json.loads(r.output)["expired"] == 2


@pytest.mark.parametrize(
    "args",
    [["--ttl", "soon"], ["--budget", "lots"], ["--namespace", "ab", "--all"], ["--namespace", "zzzzzz"]],
)
def test_bad_arguments_one_line_exit_2(store_dir, args) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), *args])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and r.output.startswith("tierkv: error:")


def test_missing_store_is_exit_1(tmp_path) -> None:
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(tmp_path / "none")])
    assert r.exit_code == 1 and "no tierkv store" in r.output


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("tierkv: error:"), r.output
    assert "Traceback" not in r.output
    return r.output


@pytest.mark.parametrize("command", ["stats", "gc"])
def test_store_of_another_format_is_one_line_exit_2_and_kept(store_dir, command) -> None:
    import lmdb

    env = lmdb.open(str(store_dir / "index"), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    before = sorted(p.name for p in store_dir.iterdir())
    out = _one_error_line(CliRunner().invoke(main, [command, "--cache-dir", str(store_dir)]))
    assert "format version 99" in out
    assert sorted(p.name for p in store_dir.iterdir()) == before  # nothing moved aside
    assert not list(store_dir.parent.glob(store_dir.name + ".corrupt-*"))


def _without_root_powers() -> list[str]:
    """A command prefix under which chmod 000 denies: none for a user, for root one without DAC overrides."""
    if os.geteuid() != 0:
        return []
    drop = [
        "setpriv",
        "--bounding-set=-dac_override,-dac_read_search",
        "--inh-caps=-dac_override,-dac_read_search",
    ]
    if shutil.which("setpriv") is None or subprocess.run([*drop, "true"], check=False).returncode != 0:
        pytest.skip("root reads through chmod 000, and setpriv cannot drop that power here")
    return [*drop, "--"]


@pytest.mark.parametrize("command", ["stats", "gc"])
def test_unreadable_store_is_one_line_exit_2_and_kept(store_dir, command) -> None:
    prefix = _without_root_powers()
    index = store_dir / "index"
    index.chmod(0)
    try:
        r = subprocess.run(
            [*prefix, sys.executable, "-m", "tierkv.cli", command, "--cache-dir", str(store_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        index.chmod(0o700)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tierkv: error:"), r.stderr
    assert "Permission denied" in r.stderr
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["blocks"] == 8  # the data stayed where it was


def test_serve_engine_vllm_without_vllm_is_one_line_and_exit_2(monkeypatch) -> None:
    from click.testing import CliRunner

    from tierkv.cli import main
    from tierkv.integrations import vllm_serve

    monkeypatch.setattr(vllm_serve, "vllm_python", lambda: None)  # as in the main venv: no vLLM
    r = CliRunner().invoke(main, ["serve", "--engine", "vllm", "--model", "smollm2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "scripts/setup.sh vllm" in r.output, r.output


def test_serve_rejects_unknown_options_unless_for_vllm() -> None:
    from click.testing import CliRunner

    from tierkv.cli import main

    r = CliRunner().invoke(main, ["serve", "--bogus"])
    assert r.exit_code == 2 and "--bogus" in r.output
