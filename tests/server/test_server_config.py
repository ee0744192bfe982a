"""`tierkv serve` options that need no model: the background sweep's interval, the admin token's sources,
the disk budget; and opening the server's store when it is damaged."""

import os
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from tierkv.cli import main
from tierkv.errors import ConfigError, StoreOpenError
from tierkv.server import startup, state
from tierkv.server.config import ServeConfig
from tierkv.tiers.disk import opening


@pytest.fixture
def served(monkeypatch):
    """`tierkv serve ...` up to the point where it would load the model: the ServeConfig it built."""
    configs: list[ServeConfig] = []
    monkeypatch.setattr(startup, "serve", configs.append)
    for name in (
        "TIERKV_ADMIN_TOKEN",
        "TIERKV_ADMIN_TOKEN_FILE",
        "TIERKV_SWEEP_INTERVAL",
        "TIERKV_SWEEP_INTERVAL_S",
        "TIERKV_DISK_BUDGET",
    ):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, env: dict | None = None) -> tuple[int, str, ServeConfig | None]:
        r = CliRunner().invoke(main, ["serve", *args], env=env)
        return r.exit_code, r.output, configs.pop() if configs else None

    return run


def test_sweep_interval_default_units_and_sources(served, tmp_path) -> None:
    assert ServeConfig().sweep_interval_s == 300.0
    assert served()[2].sweep_interval_s == 300.0
    assert served("--sweep-interval", "5m")[2].sweep_interval_s == 300.0
    assert served("--sweep-interval", "0")[2].sweep_interval_s == 0.0  # no background sweep
    assert served(env={"TIERKV_SWEEP_INTERVAL": "90s"})[2].sweep_interval_s == 90.0
    toml = tmp_path / "serve.toml"
    toml.write_text('sweep_interval = "2m"\n')
    assert served("--config", str(toml))[2].sweep_interval_s == 120.0
    assert served("--config", str(toml), "--sweep-interval", "1h")[2].sweep_interval_s == 3600.0
    for bad in ("soon", "-5s"):
        code, out, _ = served("--sweep-interval", bad)
        assert code == 2 and out.count("\n") == 1 and "sweep_interval" in out, out
    with pytest.raises(ConfigError):
        ServeConfig.load({"sweep_interval_s": -1.0}, env={})


def test_sweep_interval_reaches_the_store(tmp_path) -> None:
    config = ServeConfig.load(
        {"cache_dir": str(tmp_path), "sweep_interval_s": "30s", "host_cache": "1MiB"}, env={}
    )
    assert config.store_config().disk.sweep_interval_s == 30.0
    store = state.open_store(config)
    try:
        assert any("swept every 30s" in phrase for phrase in store.describe())
    finally:
        store.close()


def test_admin_token_from_a_file_or_the_environment(served, tmp_path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    assert served("--admin-token-file", str(path))[2].admin_token == "s3cret"
    assert served(env={"TIERKV_ADMIN_TOKEN": "from-env"})[2].admin_token == "from-env"
    # The command line over the environment, however each gives the token.
    assert (
        served("--admin-token-file", str(path), env={"TIERKV_ADMIN_TOKEN": "from-env"})[2].admin_token
        == "s3cret"
    )
    assert served("--admin-token", "cli", env={"TIERKV_ADMIN_TOKEN_FILE": str(path)})[2].admin_token == "cli"
    path.write_text("no-newline")
    assert served("--admin-token-file", str(path))[2].admin_token == "no-newline"


@pytest.mark.parametrize(
    ("content", "args", "words"),
    [
        (None, ["--admin-token-file", "{missing}"], "cannot read it (No such file or directory)"),
        (None, ["--admin-token-file", "{dir}"], "cannot read it"),
        ("\n", ["--admin-token-file", "{file}"], "is empty"),
        ("", ["--admin-token-file", "{file}"], "is empty"),
        ("one\ntwo\n", ["--admin-token-file", "{file}"], "more than one line"),
        ("tok\n", ["--admin-token-file", "{file}", "--admin-token", "x"], "not both"),
    ],
)
def test_a_bad_admin_token_file_is_one_line_exit_2(served, tmp_path, content, args, words) -> None:
    file = tmp_path / "token"
    if content is not None:
        file.write_text(content)
    paths = {"missing": tmp_path / "nope", "dir": tmp_path, "file": file}
    code, out, config = served(*[a.format(**paths) for a in args])
    assert code == 2 and config is None
    assert out.count("\n") == 1 and out.startswith("tierkv: error:") and words in out, out


def test_disk_budget_none_is_unbounded_and_0_an_error(served, tmp_path) -> None:
    assert served()[2].disk_budget == 20 << 30
    assert served("--disk-budget", "none")[2].disk_budget is None
    assert served("--disk-budget", "5GiB")[2].disk_budget == 5 << 30
    config = ServeConfig.load(
        {"cache_dir": str(tmp_path), "disk_budget": "none", "host_cache": "1MiB"}, env={}
    )
    store = state.open_store(config)
    try:
        assert any(phrase.startswith("disk no budget") for phrase in store.describe())
    finally:
        store.close()
    toml = tmp_path / "serve.toml"
    toml.write_text("disk_budget = 0\n")
    for args, env in (
        (["--disk-budget", "0"], None),
        ([], {"TIERKV_DISK_BUDGET": "0B"}),
        (["--config", str(toml)], None),
    ):
        code, out, config = served(*args, env=env)
        assert code == 2 and config is None and out.count("\n") == 1, out
        assert "disk_budget: must be a size above 0" in out and "give none" in out, out


def test_a_damaged_store_moved_aside_waits_for_its_new_lock_a_bounded_time(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    config = ServeConfig.load({"cache_dir": str(cache), "host_cache": "1MiB", "sweep_interval_s": 0}, env={})
    state.open_store(config).close()
    with open(cache / "index" / "data.mdb", "r+b") as f:
        f.write(os.urandom(8192))  # both meta pages: LMDB refuses the file, the server moves it aside
    # Another process opens the new, empty store in the moment after the damaged one was moved aside.
    holder: list[subprocess.Popen[str]] = []
    real = opening.make_private_dir

    def make_private_dir(path):  # noqa: ANN001, ANN202
        real(path)
        if not holder and list(tmp_path.glob("cache.corrupt-*")):
            code = (
                "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()"
            )
            lock = str(path / "owners.lock")
            holder.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, lock],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            assert holder[0].stdout.readline() == "held\n"

    monkeypatch.setattr(opening, "make_private_dir", make_private_dir)
    monkeypatch.setattr(opening, "RELOCK_TIMEOUT_S", 1.0, raising=False)
    result: dict = {}

    def open_it() -> None:
        try:
            result["store"] = state.open_store(config)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(15)
    hung = thread.is_alive()
    for proc in holder:  # the other process ends: a waiting open goes on
        proc.communicate("", timeout=30)
    thread.join(30)
    if "store" in result:
        result["store"].close()
    assert holder and not hung, "the exclusive re-lock waited without a bound"
    error = result.get("error")
    assert isinstance(error, StoreOpenError) and "another process opened the new empty store" in str(error)
    assert list(tmp_path.glob("cache.corrupt-*"))  # the damaged store is kept for a post-mortem


def test_the_remote_secret_file_signs_the_remote_tier(tmp_path) -> None:
    secrets = tmp_path / "remote.secret"
    secrets.write_text("new-secret-0123456789-0123456789ab\n\nold-secret-0123456789-0123456789ab\n")
    config = ServeConfig.load(
        {"remote": "redis://127.0.0.1:6379"}, env={"TIERKV_REMOTE_SECRET_FILE": str(secrets)}
    )
    remote = config.store_config().remote
    assert remote is not None
    assert remote.secrets == (b"new-secret-0123456789-0123456789ab", b"old-secret-0123456789-0123456789ab")
    assert "secret" not in repr(config.store_config())  # never in a log line or a traceback
    secrets.write_text("short\n")
    with pytest.raises(ConfigError, match="32 bytes"):
        ServeConfig.load({"remote": "redis://x", "remote_secret_file": str(secrets)}).store_config()


def test_the_ready_line_comes_once_listening_and_a_port_in_use_says_what_to_do(tmp_path) -> None:
    """``tierkv serve: listening on ...`` is logged once the port is bound (a client may connect from that
    line on, which scripts/serve.sh tells a user to wait for); on a port another process holds, the server
    never logs it, exits with an error, and says ``--port`` picks another."""
    import socket

    from helpers import ServerProcess

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "tierkv.cli", "serve", "--model", "tiny", "--port", str(port),
               "--host-cache", "16MiB", "--cache-dir", str(tmp_path / "busy")]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"cannot listen on http://127.0.0.1:{port}" in out and "--port picks another" in out, out
    assert "listening on" not in out, out
    assert "warmed up" not in out, out  # said before the model loads, not seconds after
    srv = ServerProcess(cache_dir=tmp_path / "free")
    try:
        (line,) = [x for x in srv.output().splitlines() if "tierkv serve: listening on" in x]
        assert f"http://127.0.0.1:{srv.port}: model" in line
        assert "model threads; --threads to change" in srv.output() or "1 model thread;" in srv.output()
    finally:
        srv.stop()


def test_threads_sets_the_models_cpu_threads_and_the_start_up_line_says_so(tmp_path) -> None:
    """On cores shared with other work, fewer threads than cores keep a forward from waiting on a core
    the scheduler gave away: ``--threads 1`` is torch's count in the serving process, and it serves."""
    from helpers import ServerProcess

    srv = ServerProcess("--threads", "1", cache_dir=tmp_path / "c")
    try:
        assert "(1 model thread (--threads))" in srv.output(), srv.output()
        reply = srv.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert reply.usage.completion_tokens == 2
    finally:
        srv.stop()


def test_a_disk_budget_below_one_block_is_said_at_start_up_and_the_pin_budget_names_its_options(
    tmp_path,
) -> None:
    """A budget that can keep no block of the model (the embedded model's are 768 KiB) starts, and says
    so in its log at once; a pin budget above the disk budget names both options and sizes."""
    from helpers import ServerProcess

    srv = ServerProcess("--disk-budget", "1KiB", cache_dir=tmp_path / "c")
    try:
        out = srv.output()
        assert "its budget (1.0 KiB) is smaller than one block of this model's KV (768.0 KiB)" in out, out
        assert "nothing will be kept on disk (--disk-budget)" in out, out
    finally:
        srv.stop()
    config = ServeConfig.load(
        {"cache_dir": str(tmp_path / "p"), "disk_budget": "1MiB", "pin_budget": "2MiB", "host_cache": "1MiB"},
        env={},
    )
    with pytest.raises(
        ConfigError, match=r"pin budget \(--pin-budget, 2\.0 MiB\).*disk budget \(--disk-budget, 1\.0 MiB\)"
    ):
        state.open_store(config).close()
