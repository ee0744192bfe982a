"""A long prompt through HTTP: cold, again, and after a restart with the page cache dropped.

One server (``tierkv serve --model ...``) answers a chat whose system prompt is about ``tokens`` long
(greedy, streamed): the first call computes it, the second restores it from the host tier. The server is
stopped (SIGTERM flushes the store), the store's segment files are dropped from the page cache, and a new
server answers the same chat: restored from disk. Then once more, that server stopped and the page cache
dropped again, with ``TIERKV_DIRECT_READS=0``: read buffered, where the default reads what the page cache
lacks with O_DIRECT or buffered, whichever this disk served faster (the two restarts in turn first, cycle
by cycle). For each call: TTFT at the client (first streamed
chunk), the server's restore and prefill times (``usage.tierkv``), the cached tokens per tier, and the
text, which must be the same every time.

What TTFT holds: the server sends the first chunk (the assistant's role) only once the prefill is done,
so it is the chat template and tokenization, the prefill (restore and the tokens computed after it; for
the cold call also handing its new blocks to the store) and HTTP; no decode step. On a shared machine one
cycle's ratio swings (11x to 23x for the same code on two busy cores): ``runs`` repeats the whole cycle on
a fresh cache directory and reports medians.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from tierkv.bench.machine import drop_page_cache
from tierkv.bench.serving import ServeProcess
from tierkv.bench.table import md_table
from tierkv.bench.workloads import WORDS
from tierkv.units import env_flag


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
    runs: int = 1,
) -> dict[str, Any]:
    """``server_args``: more options for ``tierkv serve`` (e.g. ``--block-tokens 16``). ``runs`` cycles
    (cold, second call, restart), each on a fresh cache directory: ``calls`` is the cycle with the median
    speed-up after the restart, ``speedup_*`` are medians, ``runs_detail`` has every cycle."""
    cycles = [
        _cycle(
            base / ("restart-cache" if i == 0 else f"restart-cache-{i}"),
            model,
            tokens,
            max_tokens,
            server_args,
            direct_first=i % 2 == 1,
        )
        for i in range(max(1, runs))
    ]
    ratios = [c["calls"][0]["ttft_s"] / c["calls"][2]["ttft_s"] for c in cycles]
    buffered = [c["calls"][0]["ttft_s"] / c["calls"][3]["ttft_s"] for c in cycles if len(c["calls"]) > 3]
    median_run = sorted(range(len(cycles)), key=lambda i: ratios[i])[len(cycles) // 2]
    return {
        "config": {
            "model": model,
            "max_tokens": max_tokens,
            "cold_method": cycles[0]["cold_method"],
            "server_args": list(server_args),
            "runs": len(cycles),
        },
        "calls": cycles[median_run]["calls"],
        "same_text": len({c["text"] for cycle in cycles for c in cycle["calls"]}) == 1,
        "speedup_after_restart": statistics.median(ratios),
        "speedup_second": statistics.median(
            c["calls"][0]["ttft_s"] / c["calls"][1]["ttft_s"] for c in cycles
        ),
        "speedups_after_restart": ratios,
        # the same restart with buffered reads (none where the environment asks for them already)
        "speedup_after_restart_buffered": statistics.median(buffered) if buffered else None,
        "speedups_after_restart_buffered": buffered,
        "ttft_median_s": {
            phase: statistics.median(c["calls"][k]["ttft_s"] for c in cycles)
            for k, phase in enumerate(PHASES)
            if all(len(c["calls"]) > k for c in cycles)
        },
        "runs_detail": [c["calls"] for c in cycles],
    }


PHASES = (
    "cold",
    "second call",
    "after a restart, page cache dropped",
    "after a restart, page cache dropped, buffered reads",
)
# The restarts' environments: the reads as this process's environment has them (the default: what the page
# cache lacks with O_DIRECT), then everything buffered.
RESTART_ENV = {PHASES[2]: {}, PHASES[3]: {"TIERKV_DIRECT_READS": "0"}}


def _cycle(
    cache: Path,
    model: str,
    tokens: int,
    max_tokens: int,
    server_args: tuple[str, ...],
    *,
    direct_first: bool = False,
) -> dict[str, Any]:
    system = _system_prompt(int(tokens * 0.62))  # about 1.6 tokens per word with SmolLM2's tokenizer
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "In one sentence: what must I do first?"},
    ]
    restarts = list(PHASES[2:])
    if not env_flag("TIERKV_DIRECT_READS", True):
        restarts = restarts[:1]  # the first restart reads buffered already
    elif direct_first:
        restarts.reverse()
    calls: dict[str, dict[str, Any]] = {}
    method = ""
    srv = None
    try:
        for phase in (*PHASES[:2], *restarts):
            start_s = None
            if srv is None:
                t0 = time.perf_counter()
                srv = ServeProcess(
                    "--model",
                    model,
                    "--cache-dir",
                    str(cache),
                    "--host-cache",
                    "1GiB",
                    *server_args,
                    env=RESTART_ENV.get(phase),
                )
                start_s = time.perf_counter() - t0  # (the server warms its model up before it serves)
            r = srv.chat(messages, max_tokens)
            u = r["usage"]
            calls[phase] = {
                "phase": phase,
                "ttft_s": r["ttft_s"],
                "prompt_tokens": u["prompt_tokens"],
                "cached_tokens_by_tier": u["tierkv"]["cached_tokens_by_tier"],
                "restore_ms": u["tierkv"]["restore_ms"],
                "prefill_ms": u["tierkv"].get("prefill_ms"),
                "text": r["text"],
                "server_start_s": start_s,
            }
            if phase != "cold":  # restart: SIGTERM flushes the store; then nothing of it in RAM
                srv.stop()
                srv = None
                method = drop_page_cache(
                    [*(cache / "segments").glob("*.seg"), *(cache / "index").glob("*.mdb")]
                )
    finally:
        if srv is not None:  # also when a call failed: no server is left running
            srv.stop()
    return {"calls": [calls[p] for p in PHASES if p in calls], "cold_method": method}


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
                "server prefill, restore included (ms)",
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
    runs = res["config"].get("runs", 1)
    spread = ""
    if runs > 1:
        med = res["ttft_median_s"]
        spread = (
            f" {runs} cycles, the median one below; median TTFT cold {med['cold'] * 1e3:.0f} ms, second call "
            f"{med['second call'] * 1e3:.0f} ms, after the restart {med[PHASES[2]] * 1e3:.0f} ms; speed-up after "
            f"the restart per cycle: {', '.join(f'{r:.1f}x' for r in res['speedups_after_restart'])} "
            f"(median {res['speedup_after_restart']:.1f}x)."
        )
        if res.get("speedups_after_restart_buffered"):
            spread += (
                " The same restart with every read buffered (`TIERKV_DIRECT_READS=0`; the default reads what"
                " the page cache lacks with O_DIRECT or buffered, whichever this disk served faster; the two"
                " restarts take turns going first): median TTFT "
                f"{med[PHASES[3]] * 1e3:.0f} ms; per cycle "
                f"{', '.join(f'{r:.1f}x' for r in res['speedups_after_restart_buffered'])} "
                f"(median {res['speedup_after_restart_buffered']:.1f}x)."
            )
    return (
        f"Model `{res['config']['model']}`{' (' + extra + ')' if extra else ''} through HTTP, greedy, {res['config']['max_tokens']} tokens: {same} "
        f'("{res["calls"][0]["text"].strip()[:80]}"); page cache dropped via {res["config"]["cold_method"]}.'
        + spread
        + "\n\n"
        + table
    )


__all__ = ["markdown", "run"]
