"""Two workers on a shared-prefix workload: with and without the shared remote tier, with and without
prefix-aware routing. Without routing, requests alternate between the workers (round robin)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tierkv.bench.serving import ServeProcess, free_port, serve_all, start_router, stop_router
from tierkv.bench.table import md_table


def _redis() -> tuple[subprocess.Popen[bytes], str] | None:
    if shutil.which("redis-server") is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}"


def _chat(url: str, system: str, user: str) -> tuple[float, dict[str, Any]]:
    body = json.dumps(
        {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4,
            "temperature": 0,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out["usage"]


def _one(
    workers: list[ServeProcess], systems: list[str], rounds: int, remote: bool, routed: bool
) -> dict[str, Any]:
    router = None
    url = None
    try:
        if routed:
            router, url = start_router([w.url for w in workers])
        ttfts, cached, total, n = [], 0, 0, 0
        for r in range(rounds):
            for system in systems:
                t, usage = _chat(url or workers[n % 2].url, system, f"question {r}")
                n += 1
                ttfts.append(t)
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                total += usage["prompt_tokens"]
    finally:
        if router is not None:
            stop_router(router)
    return {
        "remote": remote,
        "routed": routed,
        "requests": n,
        "hit_rate": cached / total,
        "computed_tokens": total - cached,
        "ttft_p50_s": statistics.median(ttfts),
        "total_s": sum(ttfts),
    }


def run(base: Path, *, quick: bool = False, model: str = "tiny") -> dict[str, Any]:
    """``model``: what ``tierkv serve --model`` takes (smollm2, tiny, a directory)."""
    # An odd number of prompts: with an even one, round robin would send each prompt to one worker anyway.
    prompts, rounds, chars = (3, 3, 600) if quick else (5, 4, 2000)
    redis = _redis()
    rows = []
    try:
        for remote in (False, True):
            if remote and redis is None:
                continue
            extra = ["--remote", redis[1]] if remote and redis else []
            # One pair of workers per remote setting; each routing mode gets prompts of its own, so the
            # two modes never share cached blocks.
            kind = "remote" if remote else "local"
            workers = serve_all(
                *(["--model", model, "--cache-dir", str(base / f"{kind}-{i}"), *extra] for i in range(2))
            )
            try:
                for routed in (False, True):
                    systems = [
                        f"Team {i} handbook ({'routed' if routed else 'rr'}). "
                        + ("Answer from the handbook, cite the page. " * (chars // 42))
                        for i in range(prompts)
                    ]
                    rows.append(_one(workers, systems, rounds, remote, routed))
            finally:
                for w in workers:
                    w.stop()
    finally:
        if redis is not None:
            redis[0].kill()
            redis[0].wait()
    return {
        "config": {
            "workers": 2,
            "model": model,
            "prompts": prompts,
            "rounds": rounds,
            "quick": quick,
            "redis": redis is not None,
        },
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"{c['workers']} workers ({c.get('model', 'tiny')}), {c['prompts']} shared prefixes x "
        f"{c['rounds']} rounds; without routing requests alternate between the workers."
        + ("" if c["redis"] else " (No redis-server: remote rows skipped.)"),
        "",
        *md_table(
            ["remote tier", "routing", "hit rate", "prompt tokens computed", "latency p50 (ms)", "total (s)"],
            "llrrrr",
            (
                [
                    "Redis" if r["remote"] else "none",
                    "prefix-aware" if r["routed"] else "round robin",
                    f"{100 * r['hit_rate']:.1f}%",
                    r["computed_tokens"],
                    f"{r['ttft_p50_s'] * 1e3:.0f}",
                    f"{r['total_s']:.1f}",
                ]
                for r in res["rows"]
            ),
        ),
    ]
    return "\n".join(lines)


__all__ = ["markdown", "run"]
