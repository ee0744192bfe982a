"""Benchmark parts' servers: ``tierkv serve`` and ``tierkv route`` as subprocesses on free loopback ports."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any


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


class ServeProcess:
    """``tierkv serve ARGS`` in a subprocess on a free loopback port, once it answers /health; ``chat`` streams."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve", "--port", str(self.port), *SERVE_DEFAULTS, *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

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
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()


def start_router(worker_urls: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``tierkv route`` in front of ``worker_urls`` on a free loopback port, once it answers /health."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierkv.cli",
            "route",
            "--workers",
            ",".join(worker_urls),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, url


__all__ = ["SERVE_DEFAULTS", "ServeProcess", "free_port", "start_router"]
