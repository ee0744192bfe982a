"""The model thread's stalls beside tierkv's background work, on one busy core.

Each mode runs in a fresh process pinned to one CPU, beside a spinning process on the same CPU (another
worker on a busy node). The main thread plays the model: steps of half a millisecond of Python and torch
work and a millisecond's wait with the GIL released (as for a GPU's kernels), saving a prompt's blocks every few steps so that the disk writer always has work (fdatasync'ed
batches). A step that takes longer than usual waited: for the CPU, or for the GIL held by a background
thread the scheduler does not run. The steps with a save are reported apart (they copy the KV). Modes:

  alone                        no store: the spinner's share of the core only
  writer, Python at SCHED_IDLE the disk writer as it was before (b550b1f): its thread, Python included,
                               at SCHED_IDLE; the Python writer
  writer, nice 19, Python      the writer thread at nice 19 (never idle), the Python writer
  writer, nice 19, native      the same, records sealed and written by the native writer, which alone goes
                               to SCHED_IDLE (for the checksums, without the GIL): tierkv's default
  writer, nice 0, native       the same with TIERKV_BACKGROUND_NICE=0: the writer keeps up better, at the
                               cost of CPU the model could use

Reported per mode: step time percentiles and the worst, and how many blocks the writer wrote meanwhile.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MODES", "markdown", "run"]

MODES = {
    "alone": {},
    "writer, Python at SCHED_IDLE (before)": {"TIERKV_NATIVE": "0", "_IDLE_PYTHON": "1"},
    "writer, nice 19, Python writer": {"TIERKV_NATIVE": "0"},
    "writer, nice 19, native writer (now)": {"TIERKV_NATIVE": "1"},
    "writer, nice 0, native writer": {"TIERKV_NATIVE": "1", "TIERKV_BACKGROUND_NICE": "0"},
}

_SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def child(store_dir: str, seconds: float, with_store: bool) -> dict[str, Any]:
    """One mode, in this process (pinned, beside a spinner): step times in ms."""
    import torch

    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    if os.environ.get("_IDLE_PYTHON") == "1":  # the old policy: the writer thread's Python at SCHED_IDLE
        import tierkv.priority as priority

        def idle() -> None:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        priority.background_priority = idle
        import tierkv.tiers.disk.writer as writer_mod

        writer_mod.background_priority = idle
    from tierkv import TieredStore
    from tierkv.bench.kv_workload import NS as ns  # the embedded default model's KV layout

    kv = torch.randn(6, 2, 16 * 64, 4, 64)  # 12 MiB per prompt
    w = torch.randn(160, 160)
    x = torch.randn(160, 160)
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu)])
    steps: list[float] = []
    saves: list[float] = []
    written = 0
    store = None
    try:
        store = TieredStore.open(store_dir, host_bytes=0, queue_nbytes=256 << 20) if with_store else None
        time.sleep(0.5)
        t_end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for _ in range(4):  # the model's Python and torch, then a wait for the device (GIL released)
                x = torch.tanh(x @ w) * 0.5
            time.sleep(0.001)
            saving = store is not None and n % 10 == 0
            if store is not None and saving:
                store.save(ns, [n * 10_000 + t for t in range(16 * 64)], kv)
            (saves if saving else steps).append((time.perf_counter() - t0) * 1e3)
            n += 1
        if store is not None:
            written = store.stats()["disk"]["blocks_written"]
    finally:
        spinner.kill()  # first: an idle-priority writer may never run beside it, and close waits for it
        spinner.wait()
    if store is not None:
        store.close()
    steps.sort()
    q = statistics.quantiles(steps, n=1000, method="inclusive")  # never past the worst step
    return {
        "steps": len(steps),
        "p50_ms": statistics.median(steps),
        "p99_ms": q[989],
        "p999_ms": q[998],
        "max_ms": steps[-1],
        "save_p50_ms": statistics.median(saves) if saves else 0.0,
        "save_max_ms": max(saves) if saves else 0.0,
        "blocks_written": written,
    }


def run(base: Path, *, seconds: float = 20.0, modes: tuple[str, ...] = tuple(MODES)) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": seconds, "modes": {}}
    for name, env in ((m, MODES[m]) for m in modes):
        store_dir = base / f"stall-{len(out['modes'])}"
        code = (
            "import json, sys; from tierkv.bench.stall import child; "
            "print(json.dumps(child(sys.argv[1], float(sys.argv[2]), sys.argv[3] == '1')))"
        )
        r = subprocess.run(
            [sys.executable, "-c", code, str(store_dir), str(seconds), "0" if name == "alone" else "1"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=seconds * 10 + 120,
        )
        if r.returncode != 0:
            raise RuntimeError(f"stall mode {name!r} failed: {r.stderr[-2000:]}")
        out["modes"][name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"The model thread's step times beside the disk writer, on one core shared with a spinning process; "
        f"{res['seconds']:.0f} s per mode, each in a fresh process (steps of 0.5 ms of Python and torch and a "
        "1 ms wait without the GIL, a 16-block prompt saved every 10 steps, fdatasync'ed batches).",
        "",
        "| mode | steps | p50 ms | p99 ms | p99.9 ms | worst ms | save step p50 / worst ms | blocks written |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in res["modes"].items():
        lines.append(
            f"| {name} | {m['steps']} | {m['p50_ms']:.2f} | {m['p99_ms']:.1f} | {m['p999_ms']:.1f} | "
            f"{m['max_ms']:.1f} | {m['save_p50_ms']:.1f} / {m['save_max_ms']:.1f} | {m['blocks_written']} |"
        )
    lines += [
        "",
        "Steps: the model's own (no save in them): a long one waited for the CPU or for the GIL. Save steps "
        "(every tenth) also copy the prompt's 12 MiB of KV for the writer. Blocks written: what the writer "
        "indexed meanwhile (in a short run it may not have finished a batch).",
    ]
    return "\n".join(lines)
