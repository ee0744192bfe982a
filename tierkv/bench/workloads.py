"""Real workloads through the real HTTP server, with the cache on and off.

(a) multi-turn chat: conversations of several turns under one shared system prompt
(b) RAG: a fixed block of rules and varying retrieved text, in both orders (rules first, retrieved first)
(c) a template with the current date on its first line, against the same template with the date at the end
(d) no reuse at all: every prompt new (shows the cache's overhead)
For each: hit rate, prompt tokens computed, TTFT p50 and p95 (client side: time to the first streamed
chunk, which the server sends right after the prefill).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierkv.bench.serving import ServeProcess, serve_all
from tierkv.bench.table import md_table

WORDS = (
    "cache prefix token block restore disk memory tier model request user system rule answer "
    "document context latency budget expire verify namespace tenant batch segment index"
).split()


def _text(rng: random.Random, nchars: int) -> str:
    out: list[str] = []
    n = 0
    while n < nchars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:nchars]


def _workloads(quick: bool) -> dict[str, list[list[list[dict[str, str]]]]]:
    """name -> list of sessions -> list of turns' messages (multi-turn turns are built live)."""
    rng = random.Random(7)
    conv, turns = (2, 3) if quick else (10, 8)
    rules_chars, retrieved_chars, n_rag = (600, 300, 3) if quick else (2500, 1500, 6)
    system = "You are the support assistant of tierkv. " + _text(rng, 400 if quick else 1500)
    out: dict[str, Any] = {
        "multi-turn chat": {
            "system": system,
            "conversations": conv,
            "turns": turns,
            "user": [[_text(rng, 80) for _ in range(turns)] for _ in range(conv)],
        }
    }
    rules = "Rules: " + _text(rng, rules_chars)
    docs = ["Retrieved: " + _text(rng, retrieved_chars) for _ in range(n_rag)]
    q = "Question: which tier answers fastest?"
    out["RAG, rules first"] = [
        [{"role": "system", "content": rules}, {"role": "user", "content": d + "\n" + q}] for d in docs
    ]
    out["RAG, retrieved first"] = [
        [{"role": "system", "content": d}, {"role": "user", "content": rules + "\n" + q}] for d in docs
    ]
    body = _text(rng, rules_chars)
    stamps = [
        f"Current time: 2026-11-{d:02d}T{h:02d}:00Z" for d, h in zip(range(1, n_rag + 1), range(9, 9 + n_rag))
    ]
    out["date on the first line"] = [
        [{"role": "system", "content": s + "\n" + body}, {"role": "user", "content": q}] for s in stamps
    ]
    out["date at the end"] = [
        [{"role": "system", "content": body + "\n" + s}, {"role": "user", "content": q}] for s in stamps
    ]
    out["no reuse"] = [
        [
            {"role": "system", "content": _text(random.Random(100 + i), rules_chars)},
            {"role": "user", "content": q},
        ]
        for i in range(n_rag)
    ]
    return out


def _run_one(srv: ServeProcess, name: str, spec: Any, max_tokens: int) -> list[dict[str, Any]]:
    results = []
    if name == "multi-turn chat":
        for c in range(spec["conversations"]):
            history = [{"role": "system", "content": spec["system"]}]
            for t in range(spec["turns"]):
                history.append({"role": "user", "content": spec["user"][c][t]})
                r = srv.chat(history, max_tokens)
                history.append({"role": "assistant", "content": r["text"]})
                results.append(r)
        return results
    return [srv.chat(messages, max_tokens) for messages in spec]


def _stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "computed_tokens": prompt - cached,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": p95,
    }


def run(base: Path, *, quick: bool = False, max_tokens: int = 8, model: str | None = None) -> dict[str, Any]:
    """``model``: what ``tierkv serve --model`` takes (smollm2, tiny, a directory); None: tiny."""
    specs = _workloads(quick)
    out: dict[str, Any] = {
        "config": {
            "quick": quick,
            "max_tokens": max_tokens,
            "model": f"{model or 'tiny'} (CPU)",
        },
        "rows": [],
    }
    model_args = ["--model", model or "tiny"]
    # Both servers start together (the start-ups overlap) and are measured one after the other.
    servers = serve_all([*model_args, "--cache-dir", str(base / "cache")], [*model_args, "--no-cache"])
    try:
        for mode, srv in zip(("cache on", "cache off"), servers):
            srv.chat([{"role": "user", "content": "warm-up"}], 1)
            for name, spec in specs.items():
                out["rows"].append(
                    {"workload": name, "mode": mode, **_stats(_run_one(srv, name, spec, max_tokens))}
                )
            srv.stop()  # before the next one is measured
    finally:
        for srv in servers:
            srv.stop()
    return out


def markdown(res: dict[str, Any]) -> str:
    return "\n".join(
        md_table(
            [
                "workload",
                "cache",
                "requests",
                "hit rate",
                "prompt tokens computed",
                "TTFT p50 (ms)",
                "TTFT p95 (ms)",
            ],
            "llrrrrr",
            (
                [
                    r["workload"],
                    r["mode"],
                    r["requests"],
                    f"{100 * r['hit_rate']:.1f}%",
                    f"{r['computed_tokens']} of {r['prompt_tokens']}",
                    f"{r['ttft_p50_s'] * 1e3:.0f}",
                    f"{r['ttft_p95_s'] * 1e3:.0f}",
                ]
                for r in res["rows"]
            ),
        )
    )


__all__ = ["WORDS", "markdown", "run"]


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
        print(markdown(run(Path(d), quick="--quick" in sys.argv)))
