"""A long prompt through HTTP: cold, again, and after a restart with the page cache dropped.

One server (``tierkv serve --model ...``) answers a chat whose system prompt is about ``tokens`` long
(greedy, streamed): the first call computes it, the second restores it from the host tier. The server is
stopped (SIGTERM flushes the store), the store's segment files are dropped from the page cache, and a new
server answers the same chat: restored from disk. For each call: TTFT at the client (first streamed
chunk), the server's restore and prefill times (``usage.tierkv``), the cached tokens per tier, and the
text, which must be the same every time.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from tierkv.bench.machine import drop_page_cache
from tierkv.bench.serving import ServeProcess
from tierkv.bench.table import md_table
from tierkv.bench.workloads import WORDS


def _system_prompt(nwords: int) -> str:
    rng = random.Random(3)
    rules = [
        f"Rule {i}: " + " ".join(rng.choice(WORDS) for _ in range(11)) + "." for i in range(nwords // 12)
    ]
    return "You are the support assistant of a storage product. Follow these rules.\n" + "\n".join(rules)


def run(
    base: Path,
    *,
    model: str = "smollm2",
    tokens: int = 3000,
    max_tokens: int = 16,
    server_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``server_args``: more options for ``tierkv serve`` (e.g. ``--block-tokens 16``)."""
    system = _system_prompt(int(tokens * 0.62))  # about 1.6 tokens per word with SmolLM2's tokenizer
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "In one sentence: what must I do first?"},
    ]
    cache = base / "restart-cache"
    calls: list[dict[str, Any]] = []
    method = ""
    srv = None
    for phase in ("cold", "second call", "after a restart, page cache dropped"):
        start_s = None
        if srv is None:
            t0 = time.perf_counter()
            srv = ServeProcess(
                "--model", model, "--cache-dir", str(cache), "--host-cache", "1GiB", *server_args
            )
            start_s = time.perf_counter() - t0
            srv.chat([{"role": "user", "content": "warm-up"}], 1)  # the code path, not this prompt's blocks
        r = srv.chat(messages, max_tokens)
        u = r["usage"]
        calls.append(
            {
                "phase": phase,
                "ttft_s": r["ttft_s"],
                "prompt_tokens": u["prompt_tokens"],
                "cached_tokens_by_tier": u["tierkv"]["cached_tokens_by_tier"],
                "restore_ms": u["tierkv"]["restore_ms"],
                "prefill_ms": u["tierkv"].get("prefill_ms"),
                "text": r["text"],
                "server_start_s": start_s,
            }
        )
        if phase == "second call":  # restart: SIGTERM flushes the store; then nothing of it in RAM
            srv.stop()
            srv = None
            method = drop_page_cache(list((cache / "segments").glob("*.seg")))
    assert srv is not None
    srv.stop()
    cold = calls[0]["ttft_s"]
    return {
        "config": {
            "model": model,
            "max_tokens": max_tokens,
            "cold_method": method,
            "server_args": list(server_args),
        },
        "calls": calls,
        "same_text": len({c["text"] for c in calls}) == 1,
        "speedup_after_restart": cold / calls[-1]["ttft_s"],
        "speedup_second": cold / calls[1]["ttft_s"],
    }


def markdown(res: dict[str, Any]) -> str:
    cold = res["calls"][0]["ttft_s"]
    table = "\n".join(
        md_table(
            [
                "call",
                "prompt tokens",
                "cached (host / disk)",
                "computed",
                "TTFT (ms)",
                "x cold",
                "server restore (ms)",
                "server prefill (ms)",
            ],
            "lrrrrrrr",
            (
                [
                    c["phase"],
                    c["prompt_tokens"],
                    f"{c['cached_tokens_by_tier']['host']} / {c['cached_tokens_by_tier']['disk']}",
                    c["prompt_tokens"] - sum(c["cached_tokens_by_tier"].values()),
                    f"{c['ttft_s'] * 1e3:.0f}",
                    f"{cold / c['ttft_s']:.1f}",
                    f"{c['restore_ms']:.0f}",
                    "" if c["prefill_ms"] is None else f"{c['prefill_ms']:.0f}",
                ]
                for c in res["calls"]
            ),
        )
    )
    same = "the same text every time" if res["same_text"] else "DIFFERENT TEXTS"
    extra = " ".join(res["config"].get("server_args", []))
    return (
        f"Model `{res['config']['model']}`{' (' + extra + ')' if extra else ''} through HTTP, greedy, {res['config']['max_tokens']} tokens: {same} "
        f'("{res["calls"][0]["text"].strip()[:80]}"); page cache dropped via {res["config"]["cold_method"]}.\n\n'
        + table
    )


__all__ = ["markdown", "run"]
