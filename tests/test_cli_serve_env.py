"""Every documented ``tierkv`` command, run as a new user runs it: in the environment ``scripts/serve.sh``
builds, with the ``serve`` extra alone (not ``test``, whose extra packages hid that the router needs httpx).

That environment is ``.venv-serve``: ``TIERKV_VENV=.venv-serve scripts/setup.sh serve`` (.ci/run sets it
up before the tests; about two minutes the first time, the torch wheel reused from the local wheel
folder). Without it, or when pyproject.toml is newer than its install, these tests are skipped with that
command as the reason. The commands run through the environment's own ``tierkv`` console script.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tierkv import TieredStore
from tierkv.cli import COMMANDS

from helpers import REPO, free_port, make_kv

SERVE_VENV = REPO / ".venv-serve"
SETUP = "TIERKV_VENV=.venv-serve scripts/setup.sh serve"

pytestmark = pytest.mark.serve_env


@pytest.fixture(scope="module")
def tierkv() -> Path:
    exe = SERVE_VENV / "bin" / "tierkv"
    stamp = SERVE_VENV / ".tierkv-installed-serve"
    if not exe.exists() or not stamp.exists():
        pytest.skip(f"no serve environment at {SERVE_VENV} (set it up: {SETUP}; .ci/run does)")
    if (REPO / "pyproject.toml").stat().st_mtime > stamp.stat().st_mtime:
        pytest.skip(f"{SERVE_VENV} predates pyproject.toml: rerun {SETUP}")
    # Faithful only without the test extra: its packages (httpx among them) are what hid the bug.
    r = _run(SERVE_VENV / "bin" / "python", "-c", "import pytest")
    assert r.returncode != 0, f"{SERVE_VENV} has pytest: it is not the serve extra alone"
    return exe


def _run(exe: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_every_command_answers_help(tierkv: Path) -> None:
    r = _run(tierkv, "--help")
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(COMMANDS)
    assert _run(tierkv, "--version").returncode == 0
    for command in COMMANDS:
        r = _run(tierkv, command, "--help")
        assert r.returncode == 0 and "Usage:" in r.stdout, (command, r.stderr)
    assert "Exit status" in _run(tierkv, "bench", "--help").stdout


def test_stats_and_gc_on_a_store(tierkv: Path, tmp_path: Path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=2**20, ttl_s=3600) as store:
        for p in range(2):
            store.save(ns, [p * 100 + t for t in range(32)], make_kv(ns, 32, seed=p))
    r = _run(tierkv, "stats", "--cache-dir", str(tmp_path))
    assert r.returncode == 0 and "blocks     4" in r.stdout, r.stdout + r.stderr
    assert json.loads(_run(tierkv, "stats", "--cache-dir", str(tmp_path), "--json").stdout)["blocks"] == 4
    r = _run(tierkv, "gc", "--cache-dir", str(tmp_path), "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("would remove"), r.stdout + r.stderr
    # a dry run: the live bytes are those now, and it empties no segment (none counted)
    assert "; live now " in r.stdout and "segments" not in r.stdout, r.stdout
    r = _run(tierkv, "gc", "--cache-dir", str(tmp_path), "--all", "--dry-run", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["purged"] == 4, r.stderr


RULES = "Rules:\n" + "\n".join(f"{i}. Always cite the section you rely on." for i in range(20))


def _request(system: str) -> str:
    return json.dumps(
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What changed?"}]}
    )


def test_explain_and_lint_with_the_served_model(tierkv: Path, tmp_path: Path) -> None:
    """The README's `tierkv explain req1.json req2.json` and `tierkv lint template.txt`, beside the model
    scripts/serve.sh serves: smollm2 and its 16-token blocks, said on the first line."""
    a, b = tmp_path / "req1.json", tmp_path / "req2.json"
    a.write_text(_request("Today is 2026-09-07.\n" + RULES))
    b.write_text(_request("Today is 2026-09-08.\n" + RULES))
    r = _run(tierkv, "explain", str(a), str(b))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "model smollm2; blocks of 16 tokens (as tierkv serve picks it for the model on a CPU)"
    assert lines[1].startswith("first divergent token:") and "of 16 tokens" in lines[1], r.stdout
    assert lines[2].startswith("reused: 0 tokens"), r.stdout
    template = tmp_path / "template.txt"
    template.write_text("Generated at 2026-09-07 10:15 UTC\n" + RULES)
    r = _run(tierkv, "lint", str(template))
    assert r.returncode == 1 and r.stdout.startswith("model smollm2; blocks of 16 tokens"), (
        r.stdout + r.stderr
    )
    assert "date '2026-09-07" in r.stdout and "Move the dynamic parts" in r.stdout


class _Child:
    """A `tierkv` command left running (serve, route), its output in a log file."""

    def __init__(self, exe: Path, log: Path, *args: str) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(exe), *args], stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{url}/health did not answer in {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


CLIENT = """
import sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
tutor = {"role": "system", "content": "You are a geography tutor. Answer in one short, correct sentence. " * 20}
for question in ("What is the capital of France?", "What is the capital of Italy?"):
    r = client.chat.completions.create(model="smollm2", max_tokens=4, temperature=0,
                                       messages=[tutor, {"role": "user", "content": question}])
    print(r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)
"""


def test_serve_and_route_start_and_the_readme_client_answers(tierkv: Path, tmp_path: Path) -> None:
    """`tierkv serve` with its default model, `tierkv route` in front of it (it needs httpx), and the
    README's OpenAI client snippet (the serve extra's openai) through the router."""
    serve_port, route_port = free_port(), free_port()
    serve_url, route_url = f"http://127.0.0.1:{serve_port}", f"http://127.0.0.1:{route_port}"
    server = _Child(
        tierkv,
        tmp_path / "serve.log",
        "serve",
        "--port",
        str(serve_port),
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    router = None
    try:
        router = _Child(
            tierkv, tmp_path / "route.log", "route", "--workers", serve_url, "--port", str(route_port)
        )
        router.wait_healthy(route_url, 60)
        server.wait_healthy(serve_url, 240)  # the first start converts smollm2 (about a minute)
        assert "model SmolLM2-135M-Instruct" in server.log.read_text()  # the default model
        _until(lambda: _get(route_url + "/health")["workers"][serve_url]["healthy"], 30)  # its next check
        r = _run(SERVE_VENV / "bin" / "python", "-c", CLIENT, route_url, timeout=120)
        assert r.returncode == 0, r.stderr
        (first, none), (second, cached) = (map(int, line.split()) for line in r.stdout.splitlines())
        assert first == second and none == 0 and 0 < cached < second and cached % 16 == 0, r.stdout
    finally:
        if router is not None:
            router.stop()
        server.stop()


@pytest.mark.slow  # two minutes or more of both cores
def test_bench_quick_in_the_serve_env_exits_0_within_3_minutes(tierkv: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = subprocess.run(
        [str(tierkv), "bench", "--quick", "--out", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (folder,) = (tmp_path / "results").iterdir()
    res = json.loads((folder / "results.json").read_text())
    assert {p: v["status"] for p, v in res["parts"].items()} == dict.fromkeys(
        ("plan", "ttft", "tiers", "workloads", "scaleout"), "ok"
    )
    assert took < 180, f"bench --quick took {took:.0f} s"
