"""What the cache costs when nothing is ever reused: every prompt new, cache on against cache off.

Two servers run side by side (``tierkv serve`` with its cache, and with ``--no-cache``); requests go to
one at a time, in blocks of ``per_block`` new prompts, the servers' order alternating from round to round
(on-off, off-on, ...) so that drift (frequency, the page cache, other tenants of the machine) favours
neither. Each block is followed by the same pause, in which the cache-on server's writer finishes what
the block saved; within a block, that writer competes with the block's next prefills as it would in
service. TTFT at the client (the first streamed chunk, sent right after the prefill), medians.

A first round is run and not counted (reported apart): each server's first prefills at this length pay for
what later ones reuse (memory faulted, a host tier still being populated behind them), and that round's
overhead swung from -22.5% to +27.2% between runs of the same code (12 and 16 rounds, 2026-12-06), the
rounds after it from -12.4% to +11.3%.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from tierkv.bench.serving import ServeProcess
from tierkv.bench.workloads import _text

__all__ = ["markdown", "run"]

QUESTION = "Question: which tier answers fastest?"


def run(
    base: Path,
    *,
    quick: bool = False,
    model: str | None = None,
    rounds: int | None = None,
    per_block: int | None = None,
    prompt_chars: int | None = None,
    pause_s: float = 1.0,
) -> dict[str, Any]:
    rounds = rounds or (2 if quick else 6)
    per_block = per_block or (2 if quick else 5)
    prompt_chars = prompt_chars or (600 if quick else 2500)
    model_args = ["--model", model or "tiny"]
    servers: dict[str, ServeProcess] = {}
    ttfts: dict[str, list[float]] = {mode: [] for mode in ("cache on", "cache off")}
    per_round: list[float] = []
    prompt_tokens = 0
    n = 0
    try:
        servers["cache on"] = ServeProcess(*model_args, "--cache-dir", str(base / "overhead-cache"))
        servers["cache off"] = ServeProcess(*model_args, "--no-cache")
        for srv in servers.values():
            srv.chat([{"role": "user", "content": "warm-up"}], 1)
        warm_up_round: dict[str, float] = {}
        for r in range(-1, rounds):  # round -1: the uncounted first round
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            medians = {}
            for mode in order:
                block = []
                for _ in range(per_block):
                    n += 1
                    system = _text(random.Random(10_000 + n), prompt_chars)  # never seen before
                    res = servers[mode].chat(
                        [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}], 1
                    )
                    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                    prompt_tokens = res["usage"]["prompt_tokens"]
                    block.append(res["ttft_s"])
                medians[mode] = statistics.median(block)
                if r >= 0:
                    ttfts[mode] += block
                time.sleep(pause_s)
            if r < 0:
                warm_up_round = medians
            else:
                per_round.append(medians["cache on"] / medians["cache off"] - 1)
    finally:
        for srv in servers.values():
            srv.stop()
    on, off = (statistics.median(ttfts[m]) for m in ("cache on", "cache off"))
    low, high = _interval(ttfts, per_block)
    return {
        "config": {
            "model": model or "tiny",
            "rounds": rounds,
            "per_block": per_block,
            "prompt_tokens": prompt_tokens,
            "pause_s": pause_s,
        },
        "ttft_s": ttfts,
        "median_on_s": on,
        "median_off_s": off,
        "overhead": on / off - 1,
        "overhead_95_interval": [low, high],
        "overhead_per_round": per_round,
        "warm_up_round_s": warm_up_round,  # the uncounted first round's medians
    }


def _interval(ttfts: dict[str, list[float]], per_block: int, draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the overhead (ratio of medians - 1), resampling whole rounds so that
    a round's drift stays paired: what the noise of this run allows one to claim, not a guess."""
    on, off = ttfts["cache on"], ttfts["cache off"]
    rounds = len(on) // per_block
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        a = [t for r in picks for t in on[r * per_block : (r + 1) * per_block]]
        b = [t for r in picks for t in off[r * per_block : (r + 1) * per_block]]
        ratios.append(statistics.median(a) / statistics.median(b) - 1)
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    rounds = ", ".join(f"{100 * x:+.1f}%" for x in res["overhead_per_round"])
    low, high = res["overhead_95_interval"]
    return "\n".join(
        [
            f"Model {c['model']}, {c['rounds']} rounds of {c['per_block']} new prompts (~{c['prompt_tokens']} "
            "tokens) per server, order alternating; TTFT medians.",
            "",
            "| cache on | cache off | overhead | 95% interval (bootstrap over rounds) | per round |",
            "|---:|---:|---:|---|---|",
            f"| {res['median_on_s'] * 1e3:.0f} ms | {res['median_off_s'] * 1e3:.0f} ms | "
            f"{100 * res['overhead']:+.1f}% | {100 * low:+.1f}% to {100 * high:+.1f}% | {rounds} |",
            *_warm_up_line(res),
        ]
    )


def _warm_up_line(res: dict[str, Any]) -> list[str]:
    warm = res.get("warm_up_round_s")  # absent from results written before it was run
    if not warm:
        return []
    on, off = warm["cache on"], warm["cache off"]
    return [
        "",
        f"Not counted: a first round, {on * 1e3:.0f} ms with the cache on against {off * 1e3:.0f} ms off "
        f"({100 * (on / off - 1):+.1f}%): each server's first prefills of this length.",
    ]
