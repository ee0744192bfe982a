"""``tierkv bench --engine vllm``'s load measurements: each request's load (tierkv's connector counters on
vLLM's /metrics, the timed ExampleConnector's log), memcpy and the disk's read limit in the same run,
and the load table."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench.machine import memcpy_bps
from tierkv.bench.table import md_table

__all__ = ["LOAD_COLUMNS", "limits", "on_cuda", "load_counters", "load_table", "logged_loads", "token_nbytes"]


def on_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def token_nbytes(model_config: dict[str, Any], itemsize: int) -> int:
    """One token's KV in bytes (every layer's K and V)."""
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads", heads))
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // heads)
    return int(model_config["num_hidden_layers"]) * 2 * kv_heads * head_dim * itemsize


def load_counters(url: str) -> dict[str, float]:
    """tierkv's connector load counters on vLLM's /metrics (empty without tierkv)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    names = {"tierkv_connector_load_seconds": "load_s", "tierkv_connector_loaded_bytes": "load_nbytes"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = names.get(name.split("{")[0].removesuffix("_total"))
        if key and not line.startswith("#"):
            out[key] = out.get(key, 0.0) + float(value.split()[-1] if " " in value else value)
    return out


def logged_loads(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def limits(base: Path, nbytes: int, progress: Callable[[str], None]) -> dict[str, float]:
    """In the same run as the loads: memcpy (torch ``copy_`` of the largest prompt's KV into a preallocated
    tensor, median of 5) and the disk's best raw sequential read over a file of at least 256 MiB."""
    from tierkv.bench.disk_limits import sequential_read_limit

    n = max(nbytes, 64 << 20)
    memcpy = memcpy_bps(n) / 1e9
    path = base / "disk-limit.bin"
    size = max(n, 256 << 20)
    with open(path, "wb") as f:
        chunk = os.urandom(8 << 20)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    try:
        disk = sequential_read_limit(path, size, 3) / 1e9
    finally:
        path.unlink(missing_ok=True)
    progress(f"limits: memcpy {memcpy:.2f} GB/s, disk sequential read {disk:.2f} GB/s")
    return {"memcpy_gbps": memcpy, "disk_read_gbps": disk}


LOAD_COLUMNS = (
    "tierkv_disk_cold",
    "tierkv_host",
    "tierkv_disk_cold_buffer",
    "tierkv_host_buffer",
    "tierkv_disk_cold_buffered_reads",
    "example_disk_cold",
    "example_warm",
)


def load_table(res: dict[str, Any]) -> list[str]:
    """The load itself: its median seconds and KV bytes per second into vLLM's pages, against memcpy and
    the disk's read limit measured in the same run, and tierkv's load time against ExampleConnector's."""
    rows = [r for r in res["rows"] if any("load_s" in r.get(c, {}) for c in LOAD_COLUMNS)]
    # a row from another run (docs.vllm_rows) carries that run's limits
    rows = [r for r in rows if r.get("limits") or res.get("limits")]
    if not rows:
        return []

    def cell(c: dict[str, Any] | None) -> str:
        if c is None or "load_s" not in c:
            return "-"
        return f"{c['load_s'] * 1e3:.0f} ms, {c['load_gbps']:.2f} GB/s"

    def ratio(a: float | None, b: float | None, fmt: str = "{:.2f}") -> str:
        return fmt.format(a / b) if a and b else "-"

    table = []
    limits_seen = []
    for r in rows:
        limits = r.get("limits") or res["limits"]
        memcpy, disk = limits["memcpy_gbps"], limits["disk_read_gbps"]
        if (memcpy, disk) not in limits_seen:
            limits_seen.append((memcpy, disk))
        get = {c: r.get(c, {}) for c in LOAD_COLUMNS}
        table.append(
            [
                r["tokens"],
                *(cell(r.get(c)) for c in LOAD_COLUMNS),
                ratio(get["tierkv_host"].get("load_gbps"), memcpy),
                ratio(get["tierkv_disk_cold"].get("load_gbps"), disk),
                ratio(get["tierkv_disk_cold"].get("load_s"), get["example_disk_cold"].get("load_s")),
                ratio(get["tierkv_host"].get("load_s"), get["example_warm"].get("load_s")),
            ]
        )
    header = [
        "tokens",
        "tierkv disk load",
        "tierkv host load",
        "tierkv disk, via buffer",
        "tierkv host, via buffer",
        "tierkv disk, buffered reads",
        "Example cold load",
        "Example warm load",
        "tierkv host / memcpy",
        "tierkv disk / disk limit",
        "load time tierkv / Example, cold",
        "warm",
    ]
    return [
        "",
        "",
        "The load itself, medians (tierkv: its connector's load time and bytes on /metrics, lookup and "
        "verification included; ExampleConnector: timed around its `start_load_kv`). In the same run as "
        "each row: memcpy (torch `copy_`) and the disk's best raw sequential read, "
        + "; ".join(f"{m:.2f} and {d:.2f} GB/s" for m, d in limits_seen)
        + ".",
        "",
        *md_table(header, "r" * len(header), table),
    ]
