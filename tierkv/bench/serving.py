"""Benchmark parts' servers: ``tierkv serve`` and ``tierkv route`` as subprocesses on free loopback ports.

Each child writes its stdout and stderr to a log file (``serve-PORT.log``, ``route-PORT.log``) in the
folder ``log_dir`` sets (``tierkv bench``: ``<results>/logs/<part>/``; else the temporary directory, as
``tierkv-serve-PORT.log``). A
child that exits or does not answer ``/health`` in time is killed and raises ``ChildFailed``, whose
message names its log and quotes the log's last lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "SERVE_DEFAULTS",
    "ChildFailed",
    "ServeProcess",
    "current_log_dir",
    "free_port",
    "log_dir",
    "log_tail",
    "serve_all",
    "start_router",
    "stop_router",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_DEFAULTS = (
    "--host-cache",
    "1GiB",
    "--max-queue",
    "64",
)  # the benchmarks' servers, before their own args

_log_dir: Path | None = None


@contextlib.contextmanager
def log_dir(path: Path) -> Iterator[Path]:
    """Children started inside this block log into ``path`` (created by the first one)."""
    global _log_dir
    previous, _log_dir = _log_dir, path
    try:
        yield path
    finally:
        _log_dir = previous


def current_log_dir() -> Path | None:
    """The folder ``log_dir`` set for children's logs (None outside such a block)."""
    return _log_dir


def _open_log(kind: str, port: int) -> tuple[Path, IO[str]]:
    if _log_dir is None:
        path = Path(tempfile.gettempdir()) / f"tierkv-{kind}-{port}.log"
    else:
        _log_dir.mkdir(parents=True, exist_ok=True)
        path = _log_dir / f"{kind}-{port}.log"
    return path, open(path, "w")  # noqa: SIM115 - closed by the owner of the child


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log (empty when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class ChildFailed(RuntimeError):
    """A child (``tierkv serve`` or ``tierkv route``) that did not come up; ``log`` is its log file."""

    def __init__(self, message: str, log: Path) -> None:
        tail = log_tail(log)
        super().__init__(
            f"{message}; its log, {log}, ends:\n{tail}" if tail else f"{message}; {log} is empty"
        )
        self.log = log


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _wait_healthy(proc: subprocess.Popen[Any], url: str, what: str, log: Path, timeout_s: float) -> None:
    """Return once ``url``/health answers 200; raise ChildFailed (the child killed) if it exits or not in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildFailed(f"{what} exited with status {proc.returncode} before /health answered", log)
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    _kill(proc)
    raise ChildFailed(f"{what} did not answer {url}/health within {timeout_s:.0f} s", log)


class ServeProcess:
    """``tierkv serve ARGS`` in a subprocess on a free loopback port, once it answers /health; ``chat`` streams.

    Give ``--model``: without it ``tierkv serve`` runs its default model (smollm2)."""

    def __init__(
        self, *args: str, timeout_s: float = 180, wait: bool = True, env: dict[str, str] | None = None
    ) -> None:
        """``env``: variables set for the server on top of this process's environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.log = _open_log("serve", self.port)
        cmd = [sys.executable, "-m", "tierkv.cli", "serve", "--port", str(self.port), *SERVE_DEFAULTS, *args]
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self.log.write("$ " + (shown + " " if shown else "") + " ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None
        )
        self.timeout_s = timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once /health answers; ChildFailed (the server killed) if it exits or does not in time."""
        try:
            _wait_healthy(self.proc, self.url, "tierkv serve", self.log_path, self.timeout_s)
        except BaseException:
            _kill(self.proc)
            self.log.close()
            raise

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body = json.dumps(
            {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        ttft = None
        text, usage = [], None
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    text.append(c.get("delta", {}).get("content") or "")
        assert usage is not None and ttft is not None
        return {"ttft_s": ttft, "usage": usage, "text": "".join(text)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
        self.log.close()


def serve_all(*arg_lists: list[str], timeout_s: float = 180) -> list[ServeProcess]:
    """Several ``tierkv serve`` started together (their start-ups overlap: on two cores about half the
    time of one after the other), once every one answers /health; on a failure the others are stopped."""
    servers: list[ServeProcess] = []
    try:
        for args in arg_lists:
            servers.append(ServeProcess(*args, timeout_s=timeout_s, wait=False))
        for srv in servers:
            srv.wait_ready()
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return servers


def start_router(worker_urls: list[str], timeout_s: float = 60) -> tuple[subprocess.Popen[bytes], str]:
    """``tierkv route`` in front of ``worker_urls`` on a free loopback port, once it answers /health;
    ChildFailed (the router killed, its log quoted) if it does not."""
    port = free_port()
    log_path, log = _open_log("route", port)
    cmd = [
        sys.executable,
        "-m",
        "tierkv.cli",
        "route",
        "--workers",
        ",".join(worker_urls),
        "--port",
        str(port),
    ]
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    with log:  # the child has its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, "tierkv route", log_path, timeout_s)
    except BaseException:
        _kill(proc)
        raise
    return proc, url


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        _kill(proc)
