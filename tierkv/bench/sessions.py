"""``tierkv bench --only sessions``: many chat sessions at once, round after round, through each engine.

The workload (seeded, the same text for every system): ``users`` sessions share one system prompt; each
has a private document and a history that grows every round (a question, then a fixed answer of the
assistant, so that every system sees the same prompts). In each round every user asks once, at most
``concurrency`` requests in flight; a round starts when the previous one has ended. After the last round
the server is restarted (the page cache dropped) and one more round is asked: what a restart costs.

Systems (each one server, in turn, on the same machine):

    vllm          vLLM's OpenAI server, its own prefix cache only, a KV pool of ``pool_tokens``
    vllm+tierkv   the same with tierkv as its KV connector (host tier ``host_bytes``, then disk)
    vllm+example  the same with vLLM's ExampleConnector (safetensors files, every prompt saved whole)
    tierkv        ``tierkv serve`` (its transformers engine, one request at a time), same tiers

and on a GPU node also vLLM's own offloading (``OffloadingConnector``; it runs on CUDA, ROCm and XPU
only), the anchor a vLLM user tries first (``GPU_SYSTEMS``):

    vllm+offload     its CPU tier, ``host_bytes`` of pinned memory (lost on a restart)
    vllm+offload-fs  the same with its file-system tier behind (``TieringOffloadingSpec``, type ``fs``)

Reported per system and round: TTFT p50/p90/p99 at the client (request to first streamed token,
queueing included), inter-token latency, prompt tokens and requests per second (the round's wall time),
and where the prompt tokens' KV came from: the counters each server exports on ``/metrics`` (vLLM's
prefix cache, tierkv's host and disk tiers, recomputed), and the blocks tierkv lost for the disk.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierkv.bench.chat_client import chat, scrape
from tierkv.bench.machine import drop_page_cache
from tierkv.bench.table import md_table
from tierkv.bench.workloads import _text

__all__ = ["GPU_SYSTEMS", "SYSTEMS", "Workload", "later", "markdown", "offload_config", "run"]

SYSTEMS = ("vllm", "vllm+tierkv", "vllm+example", "tierkv")
GPU_SYSTEMS = ("vllm+offload", "vllm+offload-fs")
ANSWER = "Noted. The cached prefix is restored from the fastest tier that holds it; the rest is computed."


class Workload:
    """The sessions' text: one system prompt, a document per user, a question per user and round."""

    def __init__(
        self,
        users: int,
        rounds: int,
        *,
        system_chars: int,
        doc_chars: int,
        question_chars: int,
        seed: int = 0,
    ) -> None:
        rng = random.Random(seed)
        self.users, self.rounds = users, rounds
        self.system = "You are the assistant of a team that reads documents. " + _text(rng, system_chars)
        self.docs = [f"Document {u}: " + _text(rng, doc_chars) for u in range(users)]
        self.questions = [
            [f"Question {r + 1}: " + _text(rng, question_chars) for r in range(rounds + 1)]
            for _ in range(users)
        ]

    def messages(self, user: int, round_: int) -> list[dict[str, str]]:
        """User ``user``'s request in round ``round_`` (0-based): its whole history, then a new question."""
        out = [{"role": "system", "content": self.system}]
        for r in range(round_ + 1):
            content = self.questions[user][r]
            if r == 0:
                content = self.docs[user] + "\n\n" + content
            out.append({"role": "user", "content": content})
            if r < round_:
                out.append({"role": "assistant", "content": ANSWER})
        return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _round_stats(
    calls: list[dict[str, Any]], wall_s: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    ttfts = [c["ttft_s"] for c in calls]
    itls = [c["itl_s"] for c in calls if c["itl_s"] is not None]
    prompt = sum(c["prompt_tokens"] for c in calls)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    sources = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("tokens:")}
    if not sources:  # a server without tierkv's counters: vLLM's own split, and what the usage says
        local = delta.get("vllm:prefix_cache_hits", 0.0)
        cached = sum(c["cached_tokens"] for c in calls)
        sources = {"vllm": local, "connector": max(0.0, cached - local), "computed": prompt - cached}
    return {
        "requests": len(calls),
        "wall_s": wall_s,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "itl_s": statistics.median(itls) if itls else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(c["cached_tokens"] for c in calls),
        "prompt_tokens_per_s": prompt / wall_s,
        "requests_per_s": len(calls) / wall_s,
        "sources": sources,
        "lost_blocks": delta.get("lost_blocks", 0.0),
        # The engine's seconds loading and saving KV (tierkv's counters; None without them): what of the
        # round's wall time the cache itself cost, beside computing what it did not hold.
        "kv_load_s": delta.get("kv_load_s") if "kv_load_s" in after else None,
        "kv_save_s": delta.get("kv_save_s") if "kv_save_s" in after else None,
        "ttft_s": ttfts,
    }


def run_rounds(
    url: str,
    model: str | None,
    wl: Workload,
    rounds: range,
    *,
    concurrency: int,
    answer_tokens: int,
    progress: Callable[[str], None] = lambda _: None,
    label: str = "",
) -> list[dict[str, Any]]:
    """Each round of ``rounds``: every user's request, ``concurrency`` at a time; its statistics."""
    out = []
    with ThreadPoolExecutor(concurrency) as pool:
        for r in rounds:
            before = scrape(url)
            t0 = time.perf_counter()
            calls = list(
                pool.map(lambda u, r=r: chat(url, model, wl.messages(u, r), answer_tokens), range(wl.users))
            )
            wall = time.perf_counter() - t0
            stats = _round_stats(calls, wall, before, scrape(url))
            stats["round"] = r + 1
            out.append(stats)
            progress(
                f"{label} round {r + 1}: TTFT p50 {stats['ttft_p50_s']:.2f} s p90 {stats['ttft_p90_s']:.2f} s, "
                f"{stats['prompt_tokens_per_s']:.0f} prompt tokens/s"
            )
    return out


def _system_servers(
    base: Path,
    *,
    python: str | None,
    model: str,
    pool_tokens: int,
    host_bytes: int,
    max_context: int,
    log_dir: Path,
) -> dict[str, tuple[Callable[[], Any], Path | None]]:
    """Per system: how to start its server (an object with ``url``, ``stop()``), and its cache folder."""
    from tierkv.bench.serving import ServeProcess

    out: dict[str, tuple[Callable[[], Any], Path | None]] = {}
    tierkv_dir = base / "tierkv-cache"
    out["tierkv"] = (
        lambda: ServeProcess(
            "--model", model, "--cache-dir", str(tierkv_dir), "--host-cache", str(host_bytes), timeout_s=600
        ),
        tierkv_dir,
    )
    if python is None:
        return out
    import torch

    from tierkv.bench.vllm import SAME_CPUS_ENV, VllmServer
    from tierkv.integrations.vllm.serve import vllm_command

    env = dict(
        os.environ,
        **SAME_CPUS_ENV,
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    dtype = "auto" if torch.cuda.is_available() else "float32"  # CPUs without AVX-512 BF16 emulate bf16
    common = {"model": model, "max_context": max_context, "dtype": dtype}
    # vLLM's pool held to pool_tokens so that the sessions outgrow it: its CPU blocks are 128 tokens, and a
    # GPU's (16 by default) are made so too, for the same pool and the same blocks as tierkv's
    args = [
        "--num-gpu-blocks-override",
        str(max(2, pool_tokens // 128)),
        "--max-num-batched-tokens",
        str(max_context),
        *(["--block-size", "128"] if torch.cuda.is_available() else []),
    ]
    vdir, edir = base / "vllm-tierkv-cache", base / "vllm-example-store"
    plain = vllm_command({**common, "no_cache": True}, args, python)
    with_tierkv = vllm_command(
        {**common, "cache_dir": str(vdir), "host_cache": host_bytes, "disk_budget": 64 << 30}, args, python
    )
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(edir)},
    }
    with_example = [*plain, "--kv-transfer-config", json.dumps(example)]
    systems: list[tuple[str, list[str], Path | None]] = [
        ("vllm", plain, None),
        ("vllm+tierkv", with_tierkv, vdir),
        ("vllm+example", with_example, edir),
    ]
    if torch.cuda.is_available():  # vLLM's own offloading runs on GPUs only
        fdir = base / "vllm-offload-fs"
        for name, fs_dir in (("vllm+offload", None), ("vllm+offload-fs", fdir)):
            cfg = offload_config(host_bytes, fs_dir)
            systems.append((name, [*plain, "--kv-transfer-config", json.dumps(cfg)], fs_dir))
    for name, cmd, folder in systems:
        out[name] = (
            functools.partial(VllmServer, cmd, env, log_dir / f"sessions-{name.replace('+', '-')}.log"),
            folder,
        )
    return out


def offload_config(cpu_bytes: int, fs_dir: Path | None) -> dict[str, Any]:
    """vLLM 0.32's ``OffloadingConnector``: its CPU tier of ``cpu_bytes``, and with ``fs_dir`` its
    file-system tier behind it (``vllm/v1/kv_offload/tiering/fs``)."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
    if fs_dir is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(fs_dir)}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def run(
    base: Path,
    *,
    python: str | None,
    model: str = "smollm2",
    users: int = 12,
    rounds: int = 3,
    concurrency: int = 4,
    answer_tokens: int = 8,
    system_chars: int = 3000,
    doc_chars: int = 5000,
    question_chars: int = 300,
    pool_tokens: int = 8192,
    max_context: int = 4096,
    host_bytes: int = 256 << 20,
    systems: tuple[str, ...] = SYSTEMS,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every system of ``systems`` (those needing vLLM only with ``python``, vLLM's interpreter): the
    workload's ``rounds``, then a restart and one more round. Config and per-round statistics.
    ``max_context``: vLLM's longest request (its pool must hold one: below ``pool_tokens``)."""
    import shutil

    wl = Workload(
        users, rounds, system_chars=system_chars, doc_chars=doc_chars, question_chars=question_chars
    )
    from tierkv.bench.serving import current_log_dir

    log_dir = log_dir or current_log_dir() or base  # tierkv bench: <results>/logs/sessions/
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = _system_servers(
        base,
        python=python,
        model=model,
        pool_tokens=pool_tokens,
        host_bytes=host_bytes,
        max_context=max_context,
        log_dir=log_dir,
    )
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in systems:
        if name not in servers:
            errors[name] = "needs vLLM (scripts/setup.sh vllm)"
            continue
        start, folder = servers[name]
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        served = None if name == "tierkv" else model
        try:
            t0 = time.perf_counter()
            srv = start()
            startup_s = time.perf_counter() - t0
            try:
                chat(srv.url, served, [{"role": "user", "content": "warm-up"}], 1)  # one-time costs
                per_round = run_rounds(
                    srv.url,
                    served,
                    wl,
                    range(rounds),
                    concurrency=concurrency,
                    answer_tokens=answer_tokens,
                    progress=progress,
                    label=name,
                )
            finally:
                srv.stop()
            if folder is not None and folder.exists():
                drop_page_cache([p for p in folder.rglob("*") if p.is_file()])
            srv = start()
            try:
                after = run_rounds(
                    srv.url,
                    served,
                    wl,
                    range(rounds, rounds + 1),
                    concurrency=concurrency,
                    answer_tokens=answer_tokens,
                    progress=progress,
                    label=f"{name} after a restart",
                )
            finally:
                srv.stop()
            results[name] = {"startup_s": startup_s, "rounds": per_round, "after_restart": after[0]}
        except Exception as exc:  # one engine's failure is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            progress(f"{name} failed: {errors[name]}")
    tokens = [[len(json.dumps(wl.messages(u, r))) for u in range(users)] for r in range(rounds + 1)]
    return {
        "config": {
            "model": model,
            "users": users,
            "rounds": rounds,
            "concurrency": concurrency,
            "answer_tokens": answer_tokens,
            "system_chars": system_chars,
            "doc_chars": doc_chars,
            "question_chars": question_chars,
            "vllm_pool_tokens": pool_tokens,
            "max_context": max_context,
            "host_bytes": host_bytes,
            "request_chars_by_round": [statistics.mean(t) for t in tokens],
        },
        "systems": results,
        "errors": errors,
    }


def later(res: dict[str, Any], name: str, key: str) -> float | None:
    """A statistic over the rounds after the first: TTFT percentiles over all their requests, rates
    over their summed time."""
    rounds = res["systems"].get(name, {}).get("rounds", [])[1:]
    if not rounds:
        return None
    if key.startswith("ttft_p"):
        q = {"ttft_p50_s": 0.5, "ttft_p90_s": 0.9, "ttft_p99_s": 0.99}[key]
        return _pct([t for r in rounds for t in r["ttft_s"]], q)
    if key == "prompt_tokens_per_s":
        return sum(r["prompt_tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds)
    raise KeyError(key)


def _seconds(s: float | None, wall_s: float) -> str:
    """Seconds and their share of the round's wall time; blank where the server does not count them."""
    return "" if s is None else f"{s:.2f} ({100 * s / wall_s:.0f}%)"


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"{c['users']} users x {c['rounds']} rounds, {c['concurrency']} requests at a time, {c['answer_tokens']} "
        f"tokens per answer, model {c['model']}; vLLM's KV pool {c['vllm_pool_tokens']:,} tokens; tierkv's host "
        f"tier {c['host_bytes'] / 2**20:.0f} MiB, then disk. Prompts grow from ~{c['request_chars_by_round'][0]:,.0f} "
        f"to ~{c['request_chars_by_round'][-1]:,.0f} characters. TTFT at the client, queueing included. "
        "KV load s, KV save s: the server's seconds loading and saving KV over the round (tierkv's counters: "
        "the connector's on vLLM's model thread, `tierkv serve`'s restores) and their share of the round's "
        "wall time.",
        "",
    ]
    rows = []
    for name, s in res["systems"].items():
        for r in [
            *s["rounds"],
            {**s["after_restart"], "round": f"{s['after_restart']['round']} (restarted)"},
        ]:
            total = sum(r["sources"].values()) or 1.0
            where = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(r["sources"].items()) if v)
            rows.append(
                [
                    name,
                    str(r["round"]),
                    f"{r['ttft_p50_s'] * 1e3:,.0f}",
                    f"{r['ttft_p90_s'] * 1e3:,.0f}",
                    f"{r['ttft_p99_s'] * 1e3:,.0f}",
                    "" if r["itl_s"] is None else f"{r['itl_s'] * 1e3:.0f}",
                    f"{r['prompt_tokens_per_s']:,.0f}",
                    f"{r['requests_per_s']:.2f}",
                    where,
                    _seconds(r.get("kv_load_s"), r["wall_s"]),
                    _seconds(r.get("kv_save_s"), r["wall_s"]),
                    f"{r['lost_blocks']:.0f}",
                ]
            )
    head = [
        "system",
        "round",
        "TTFT p50 ms",
        "p90",
        "p99",
        "ITL ms",
        "prompt tok/s",
        "req/s",
        "prompt tokens from",
        "KV load s",
        "KV save s",
        "lost blocks",
    ]
    lines += md_table(head, "llrrrrrrlrrr", rows)
    if "vllm" in res["systems"]:
        lines += ["", "Against vLLM alone, over the rounds after the first:", ""]
        ratio_rows = []
        for name in res["systems"]:
            if name == "vllm":
                continue
            cells = [name]
            for key in ("ttft_p50_s", "ttft_p90_s", "prompt_tokens_per_s"):
                a, b = later(res, name, key), later(res, "vllm", key)
                cells.append("" if a is None or not b else f"{a / b:.2f}")
            a = res["systems"][name]["after_restart"]["ttft_p90_s"]
            b = res["systems"]["vllm"]["after_restart"]["ttft_p90_s"]
            cells.append(f"{a / b:.2f}")
            ratio_rows.append(cells)
        lines += md_table(
            ["system", "TTFT p50", "TTFT p90", "prompt tokens/s", "TTFT p90 after a restart"],
            "lrrrr",
            ratio_rows,
        )
    for name, err in res["errors"].items():
        lines.append(f"\n{name}: not measured ({err})")
    return "\n".join(lines)
