"""What cache control costs a request in ``tierkv serve``: the time to the first token of a chat sent
plain, with OpenAI's prompt_cache_options, and with four Anthropic-style breakpoints (each costs a render
of the chat up to it), interleaved, on one server, in one run; and the plain request through ``tierkv
route`` in front of the same server: what one more HTTP hop (a thin front that would translate cache
fields for vLLM's server) costs. Prints the configuration, the medians and the ratios against the plain
request.

    .venv/bin/python scripts/cache_control_cost.py [--model smollm2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> tuple[float, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def _wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    port = _free_port()
    cache = tempfile.mkdtemp(prefix="tierkv-cc-")
    log = open(os.path.join(cache, "serve.log"), "w")  # noqa: SIM115
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierkv.cli",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--cache-dir",
            cache,
            "--ttl",
            "10m",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    route_port = _free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "route", "--workers", url, "--port", str(route_port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    front = f"http://127.0.0.1:{route_port}"
    try:
        _wait_healthy(url)
        parts = [
            f"Section {i}: " + " ".join(f"rule {i}.{j} applies to every answer." for j in range(40))
            for i in range(4)
        ]
        user = {"role": "user", "content": "Which rule applies first?"}

        def chat(marks: bool) -> list[dict]:
            content = [
                {
                    "type": "text",
                    "text": p,
                    **({"cache_control": {"type": "ephemeral", "ttl": "1h"}} if marks else {}),
                }
                for p in parts
            ]
            return [{"role": "system", "content": content}, user]

        variants = {
            "plain": (url, {"messages": chat(False)}),
            "prompt_cache_options (implicit, 30m)": (
                url,
                {"messages": chat(False), "prompt_cache_options": {"ttl": "30m"}},
            ),
            "4 cache_control breakpoints": (url, {"messages": chat(True)}),
            "plain, through tierkv route": (front, {"messages": chat(False)}),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        prompt_tokens = 0
        _wait_healthy(front)
        for base_url, body in variants.values():  # warm: the prompt is cached (a host-tier hit) for every variant
            _, out = _post(base_url + "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0})
            prompt_tokens = out["usage"]["prompt_tokens"]
        for _ in range(args.rounds):
            for name, (base_url, body) in variants.items():
                seconds, out = _post(
                    base_url + "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0}
                )
                times[name].append(seconds)
        base = statistics.median(times["plain"])
        print(
            f"model {args.model}, chat of {prompt_tokens} prompt tokens (cached: a host-tier hit), max_tokens 1, "
            f"{args.rounds} rounds interleaved, client-side latency (TTFT plus one token)"
        )
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"  {name:40s} median {med * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  "
                f"ratio {med / base:.3f}"
            )
    finally:
        for proc in (router, server):
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
