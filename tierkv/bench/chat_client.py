"""The sessions benchmark's client side: one streamed chat completion against an OpenAI-compatible server
(``tierkv serve`` or vLLM's), and the counters of its ``/metrics`` that say where prompt tokens came from."""

from __future__ import annotations

import json
import re
import statistics
import time
import urllib.request
from typing import Any

__all__ = ["chat", "scrape"]


def chat(url: str, model: str | None, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: TTFT (to the first chunk with text), inter-token gaps, usage."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                stamps.append(time.perf_counter() - t0)
    if usage is None or not stamps:
        raise RuntimeError("the stream had no token or no usage")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft_s": stamps[0],
        "itl_s": statistics.mean(gaps) if gaps else None,
        "e2e_s": stamps[-1],
        "prompt_tokens": int(usage["prompt_tokens"]),
        "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|\+Inf|-Inf)\s*$")


def scrape(url: str) -> dict[str, float]:
    """The counters of ``url``/metrics we report, summed over their labels (``tierkv_prompt_tokens`` kept
    by ``source``): where prompt tokens came from, vLLM's prefix cache hits, blocks lost for the disk, and
    the seconds spent loading and saving KV."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        name = name.removesuffix("_total")
        if name == "tierkv_prompt_tokens":
            src = re.search(r'source="([^"]+)"', labels)
            key = f"tokens:{src.group(1) if src else '?'}"
        elif name in ("vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:prefix_cache_queries"):
            key = name
        elif name in ("tierkv_tier_dropped_saves", "tierkv_tier_writeback_lost_blocks"):
            key = "lost_blocks"  # saves no tier took, blocks evicted from the host tier before the disk had them
        elif name in ("tierkv_connector_load_seconds", "tierkv_restore_seconds_sum"):
            key = "kv_load_s"  # the engine's time restoring cached KV (vLLM: on the model's thread)
        elif name == "tierkv_connector_save_seconds":
            key = "kv_save_s"
        else:
            continue
        out[key] = out.get(key, 0.0) + value
    return out
