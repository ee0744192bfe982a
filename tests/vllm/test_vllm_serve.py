"""vLLM's OpenAI server with the connector (``tierkv.integrations.vllm.serve``): the engine's scheduler and
its worker are separate processes there, sharing the store's directory."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_engine import ROOT, tierkv_cli

from tierkv.errors import ConfigError
from tierkv.integrations.vllm.serve import connector_config, vllm_command

PROMPT = " ".join(f"t{t}" for t in random.Random(1).choices(range(3, 500), k=700))  # one token a word


def test_the_command_carries_the_connector_and_serve_options(tmp_path: Path, model_dir: Path) -> None:
    config = {
        "model": str(model_dir),
        "port": 9001,
        "cache_dir": str(tmp_path),
        "host_cache": 1 << 30,
        "disk_budget": 5 << 30,
        "ttl": 3600.0,
        "dtype": "float32",
        "max_context": 4096,
        "block_tokens": 64,
    }
    cmd = vllm_command(config, ["--enforce-eager"], python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and cmd[-1] == "--enforce-eager"
    assert (
        "--enable-prompt-tokens-details" in cmd and "--block-size" not in cmd
    )  # tierkv follows vLLM's blocks
    assert cmd[cmd.index("--max-model-len") + 1] == "4096" and cmd[cmd.index("--port") + 1] == "9001"
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == connector_config(config)
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"] == {
        "cache_dir": str(tmp_path),
        "host_bytes": 1 << 30,
        "disk_bytes": 5 << 30,
        "ttl_s": 3600.0,
    }
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "30"  # vLLM's workers exit cleanly on SIGTERM
    given = vllm_command(config, ["--shutdown-timeout=5"])
    assert given[-1] == "--shutdown-timeout=5" and "--shutdown-timeout" not in given
    assert "--kv-transfer-config" not in vllm_command({**config, "no_cache": True})
    # the connector loads only under synchronous scheduling; a choice given to vLLM is left alone
    assert "--no-async-scheduling" in cmd
    assert "--no-async-scheduling" not in vllm_command({**config, "no_cache": True})
    assert vllm_command(config, ["--async-scheduling"]).count("--async-scheduling") == 1
    assert "--no-async-scheduling" not in vllm_command(config, ["--async-scheduling"])
    with pytest.raises(ConfigError, match="tiny"):
        vllm_command({"model": "tiny"})
    with pytest.raises(ConfigError, match="config.json"):
        vllm_command({"model": str(tmp_path)})


def test_without_vllm_it_says_how_to_install_and_exits_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.integrations.vllm.serve", "--model", "/nowhere"],
        capture_output=True,
        text=True,
        env=dict(os.environ, TIERKV_VLLM_PYTHON="/bin/false"),
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "scripts/setup.sh vllm" in r.stderr


def _post(port: int, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _complete(port: int) -> tuple[str, int]:
    out = _post(
        port, "/v1/completions", {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    )
    assert out["usage"]["prompt_tokens"] == 700
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


# what only tierkv serve's own engine exports (vLLM has its own request, queue and TTFT series)
SERVER_ONLY = {
    "tierkv_ttft_seconds_bucket",
    "tierkv_restore_seconds_bucket",
    "tierkv_requests_total",
    "tierkv_queue_depth",
}


def _check_metrics(port: int) -> None:
    """The connector's series on vLLM's /metrics after a cold request and a restore of 640 tokens: the
    prompt tokens by source, the tiers' bytes and the loads; and every store series the dashboard reads."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def total(name: str, **labels: str) -> float:
        return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    restored = total("tierkv_prompt_tokens_total", source="host") + total(
        "tierkv_prompt_tokens_total", source="disk"
    )
    assert restored == 640, text
    assert total("tierkv_prompt_tokens_total") == 2 * 700
    assert total("tierkv_tier_hit_tokens_total") == 640
    assert total("tierkv_connector_loaded_blocks_total") == 5
    # 5 blocks of 128 tokens, each token 4 layers x K, V x 2 KV heads x 64 dims in float32
    assert total("tierkv_connector_loaded_bytes_total") == 5 * 128 * 4 * 2 * 2 * 64 * 4
    assert total("tierkv_connector_saved_blocks_total") >= 5
    assert total("tierkv_tier_written_bytes_total", tier="disk") > 0
    assert total("tierkv_tier_used_bytes", tier="host") > 0
    assert 0 < total("tierkv_hit_ratio") <= 1
    dashboard = json.loads((ROOT / "dashboards" / "tierkv.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for t in panel["targets"]
        for name in re.findall(r"\btierkv_\w+", t["expr"])
    }
    assert not queried - SERVER_ONLY - set(samples), sorted(queried - SERVER_ONLY - set(samples))


def _wait(what: str, check, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(
    tmp_path: Path, model_dir: Path, port: int, cache: Path, *options: str
) -> Iterator[subprocess.Popen]:
    """``python -m tierkv.integrations.vllm.serve`` on the test model, up (its ``/health`` answers), then
    stopped with SIGTERM; its output in ``tmp_path / "server.log"``."""
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", TOKENIZERS_PARALLELISM="false"
    )
    env["PYTHONFAULTHANDLER"] = "1"  # a process that hangs on SIGTERM dumps its threads on SIGABRT
    cmd = [
        sys.executable,
        "-m",
        "tierkv.integrations.vllm.serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
    ]
    cmd += ["--cache-dir", str(cache), "--host-cache", "64MiB", "--dtype", "float32", *options]
    cmd += ["--", "--enforce-eager", "--max-model-len", "2048"]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    # A session of its own: the engine's processes are stopped with it, whatever the server left.
    server = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        preexec_fn=_no_core_dumps,  # SIGABRT below must not write GiBs of cores
    )
    server.hung = False  # type: ignore[attr-defined]

    def up() -> bool:
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        _wait("the server", up, 600)
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:  # say where each process is before they go
            server.hung = True  # type: ignore[attr-defined]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGABRT)
            time.sleep(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # what the server left, if anything
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def _no_core_dumps() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _shutdown_lines(log: Path) -> str:
    """What a failed shutdown test needs to see: the shutdown steps, tierkv's lines, errors, tracebacks."""
    keep = re.compile(r"shutdown|tierkv|Error|Traceback|File \"|Thread 0x|Current thread|leaked|Killed")
    return "\n".join(line[:300] for line in log.read_text().splitlines() if keep.search(line))[-12000:]


def test_the_server_restores_from_tierkv_and_a_reset_starts_afresh(tmp_path: Path, model_dir: Path) -> None:
    port, cache = _free_port(), tmp_path / "cache"
    with _serving(tmp_path, model_dir, port, cache, "--disk-budget", "1GiB") as server:
        cold, cached = _complete(port)
        assert cached == 0
        # The store is usable beside the running engine: stats sees the saved blocks once written behind.
        _wait("the blocks on disk", lambda: tierkv_cli("stats", "--cache-dir", str(cache))["blocks"] == 5, 60)
        assert tierkv_cli("gc", "--check", "--cache-dir", str(cache))["corrupt"] == 0
        assert _post(port, "/reset_prefix_cache")["success"]  # vLLM forgets; tierkv does not
        text, cached = _complete(port)
        assert (text, cached) == (cold, 640)
        _check_metrics(port)
        assert _post(port, "/reset_prefix_cache?reset_external=true")["success"]  # both forget
        text, cached = _complete(port)
        assert (text, cached) == (cold, 0)
    # SIGTERM let the worker close its connector (flushing the write-behind), not a kill
    log = tmp_path / "server.log"
    assert not server.hung, "the server did not stop within 90 s of SIGTERM:\n" + _shutdown_lines(log)
    assert "tierkv connector (worker): loaded" in log.read_text(), _shutdown_lines(log)
    assert tierkv_cli("gc", "--check", "--cache-dir", str(cache))["corrupt"] == 0


def _keys(path: Path, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "keys", *args, "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _complete_as(port: int, key: str | None, **extra: object) -> tuple[int, dict]:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.load(e)


def test_api_keys_put_tenants_in_front_of_vllm(tmp_path: Path, model_dir: Path) -> None:
    """``--api-keys`` through vLLM: a front checks keys and sets each request's cache_salt from its tenant,
    so tenants share nothing in vLLM's prefix cache or in tierkv's tiers; the tenants' quotas reach the
    connector's store; SIGTERM stops vLLM cleanly behind the front."""
    keys, port, cache = tmp_path / "keys.toml", _free_port(), tmp_path / "cache"
    acme, beta = _keys(keys, "add", "acme"), _keys(keys, "add", "beta")
    _keys(keys, "quota", "beta", "--disk", "64MiB", "--pin", "8MiB")
    with _serving(tmp_path, model_dir, port, cache, "--api-keys", str(keys)) as server:
        status, out = _complete_as(port, None)
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
        status, out = _complete_as(port, acme)
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = out["choices"][0]["text"]
        status, out = _complete_as(port, beta)  # the same prompt, another tenant: nothing of acme's
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["text"] == text  # (the same model: the same answer)
        status, out = _complete_as(port, beta, cache_salt="team-1")  # a subdivision of beta's own space
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, out = _complete_as(port, acme)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640
        _wait(
            "the blocks on disk", lambda: tierkv_cli("stats", "--cache-dir", str(cache))["blocks"] >= 15, 60
        )
        tenants = {t["tenant"]: t for t in tierkv_cli("stats", "--cache-dir", str(cache))["tenants"]}
        assert tenants["acme"]["blocks"] == 5 and tenants["beta"]["blocks"] == 10
        assert tenants["beta"]["disk_quota_nbytes"] == 64 * 2**20
        salts = [line.split('"')[1] for line in keys.read_text().splitlines() if line.startswith("salt")]
        assert not any(s in (tmp_path / "server.log").read_text() for s in salts)
    assert server.returncode == 0, (tmp_path / "server.log").read_text()[-4000:]
    assert "tierkv connector (worker): loaded" in (tmp_path / "server.log").read_text()
