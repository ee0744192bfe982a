"""Tables in the README and ``docs/`` generated from the committed benchmark results.

A document marks a generated block ``<!-- bench: NAME -->`` ... ``<!-- /bench -->``; ``NAME`` is one of
``BLOCKS``, each rendered from ``bench/results/<machine>/results.json`` by the same functions that write
the results' own report. ``python -m tierkv.bench.docs`` rewrites every block, and a test fails when a
committed block differs from what the results give: a table and its results cannot disagree.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench import (
    overhead,
    peers,
    restart,
    scaleout,
    sessions,
    stall,
    tiers,
    transfer,
    ttft,
    vllm,
    workloads,
)
from tierkv.bench.table import md_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = ("README.md", "docs/measured.md", "docs/vllm.md")
BLOCK = re.compile(r"(<!-- bench: ([\w./-]+) -->\n)(.*?)(<!-- /bench -->)", re.S)


def _load(folder: str) -> dict[str, Any]:
    return json.loads((RESULTS / folder / "results.json").read_text())


def _when(results: dict[str, Any], part: str) -> str:
    """When a part ran: its own stamp, else the file's (when the part is among the last run's), else unknown
    (a part kept from an earlier run that did not record its time)."""
    entry = results.get("parts", {}).get(part, {})
    if entry.get("when"):
        return entry["when"]
    if part in results.get("parts", {}) or "parts" not in results:
        return results["when"]
    return "an earlier run (time not recorded)"


def _source(folder: str, part: str, results: dict[str, Any], extra: str = "") -> str:
    return (
        f"_Generated from [`bench/results/{folder}/`](../bench/results/{folder}/README.md) "
        f"(`{part}`, {_when(results, part)}{extra}); `python -m tierkv.bench.docs` rewrites it._"
    )


def _part(folder: str, part: str, render: Callable[[Any], str]) -> Callable[[], str]:
    def block() -> str:
        results = _load(folder)
        return render(results[part]) + "\n\n" + _source(folder, part, results)

    return block


def _ttft(folder: str) -> Callable[[], str]:
    def block() -> str:
        results = _load(folder)
        out = []
        for res in results["ttft"]:
            out += [f"**`{res['config']['model']}`**", "", ttft.markdown(res), ""]
        return "\n".join(out) + _source(folder, "ttft", results)

    return block


def vllm_rows() -> tuple[dict[str, Any], list[str]]:
    """The vLLM TTFT results with each prompt length at its latest measurement: the last full run's rows,
    replaced by any later rerun of a length (``rerun-*.json`` beside it); and one line saying which row
    comes from which run."""
    folder = RESULTS / "cpu-2c-vllm"
    base = json.loads((folder / "results.json").read_text())
    res = dict(base["vllm"])
    rows = {r["tokens"]: (r, base["when"]) for r in res["rows"]}
    for path in sorted(folder.glob("rerun-*.json")):
        rerun = json.loads(path.read_text())
        other = rerun.get("machine", {}).get("cpu") != base.get("machine", {}).get("cpu")
        for r in rerun["vllm"]["rows"]:
            if "limits" in rerun["vllm"]:  # its load table divides by its own run's memcpy and disk
                r = {**r, "limits": rerun["vllm"]["limits"]}
            if r["tokens"] not in rows or rerun["when"] > rows[r["tokens"]][1]:
                where = f", another machine ({rerun['machine']['cpu']})" if other else ""
                rows[r["tokens"]] = (r, f"{rerun['when']}, `{path.name}`{where}")
    res["rows"] = [rows[t][0] for t in sorted(rows)]
    runs: dict[str, list[int]] = {}
    for t in sorted(rows):
        runs.setdefault(rows[t][1], []).append(t)
    lines = [f"tokens {', '.join(map(str, ts))}: {when}" for when, ts in runs.items()]
    return res, lines


def _vllm() -> str:
    res, runs = vllm_rows()
    return (
        vllm.markdown(res)
        + "\n\nEach length at its latest measurement; "
        + "; ".join(runs)
        + ".\n\n_Generated from [`bench/results/cpu-2c-vllm/`](../bench/results/cpu-2c-vllm/README.md); "
        "`python -m tierkv.bench.docs` rewrites it._"
    )


def _ratio(rows: dict[str, float], *names: str) -> str:
    """The first of ``names`` the run measured (a ratio renamed keeps its older runs readable)."""
    return next((f"{rows[n]:.2f}" for n in names if n in rows), "-")


def _ratio_of(rows: dict[str, float], prefix: str, fallback: str) -> str:
    """The ratio whose name starts with ``prefix`` (its name says the pattern measured), else ``fallback``'s."""
    return next((f"{v:.2f}" for k, v in rows.items() if k.startswith(prefix)), _ratio(rows, fallback))


WARM = "restore warm / memcpy (median of each run's ratio) [native]"
HOST = "host tier / memcpy (median of each run's ratio)"


def _headline() -> str:
    """The README's few numbers, each from the latest committed run that measured it."""
    real = _load("cpu-2c-smollm2")
    store = _load("cpu-2c")
    rs = real["restart"]
    med = rs["ttft_median_s"]
    ratios = store["tiers"]["ratios"]
    res, _ = vllm_rows()
    rows = [
        [
            "SmolLM2, a 2,873-token chat through HTTP: cold, then after a restart with the page cache dropped "
            f"({len(rs['speedups_after_restart'])} cycles: the TTFTs are the medians over the cycles, the "
            "speed-up the median of the cycles' own)",
            f"{med['cold'] * 1e3:,.0f} ms → {med['after a restart, page cache dropped'] * 1e3:,.0f} ms; "
            f"**{rs['speedup_after_restart']:.1f}x** (cycles "
            + ", ".join(f"{x:.1f}x" for x in rs["speedups_after_restart"])
            + ")"
            + (
                f"; with every read buffered, the median of its cycles' {rs['speedup_after_restart_buffered']:.1f}x"
                if rs.get("speedup_after_restart_buffered")
                else ""
            ),
            _when(real, "restart"),
        ],
        [
            "restore from a warm page cache / memcpy; from the host tier / memcpy",
            f"{_ratio(ratios, WARM, 'restore warm / memcpy [native]')}; "
            f"{_ratio(ratios, HOST, 'host tier / memcpy')}",
            _when(store, "tiers"),
        ],
        [
            "restore one prefix from a cold disk / the disk's read limit (the default, O_DIRECT or buffered "
            "as measured faster; O_DIRECT; buffered)",
            f"{_ratio(ratios, 'restore cold one-prefix / disk limit [native]')}; "
            f"{_ratio(ratios, 'restore cold one-prefix / disk limit [native O_DIRECT reads]')}; "
            f"{_ratio(ratios, 'restore cold one-prefix / disk limit [native buffered reads]')}",
            _when(store, "tiers"),
        ],
        [
            "the first restore in a fresh process, host tier on / the best raw read pattern measured beside "
            "each; / the disk's read limit (the best median of the run's raw reads)",
            f"{_ratio_of(ratios, 'first restore, host tier on / the best raw read beside it', '-')}; "
            f"{_ratio(ratios, 'first restore, host tier on / disk limit [native]')}",
            _when(store, "tiers"),
        ],
        [
            "durable save (save, then flush) / the best raw write pattern measured beside each; / the disk's "
            "write limit (the best median of the run's raw writes, a reused buffer's); / a raw write from "
            "memory of its own, as a store's",
            f"{_ratio_of(ratios, 'persistence / the best raw write beside it', '-')}; "
            f"{_ratio(ratios, 'persistence / disk write limit [native]')}; "
            f"{_ratio(ratios, 'persistence / a raw write from memory of its own [native]')}",
            _when(store, "tiers"),
        ],
    ]
    many = real.get("sessions", {})
    p90 = [sessions.later(many, name, "ttft_p90_s") for name in ("vllm+tierkv", "vllm")] if many else []
    tps = (
        [sessions.later(many, name, "prompt_tokens_per_s") for name in ("vllm+tierkv", "vllm")]
        if many
        else []
    )
    if many and None not in p90 + tps:
        c = many["config"]
        assert p90[0] and p90[1] and tps[0] and tps[1]  # for the type checker: measured, not None
        rows.append(
            [
                f"inside vLLM (CPU), {c['users']} chat sessions x {c['rounds']} rounds, {c['concurrency']} at a time "
                "(SmolLM2), rounds after the first, vLLM + tierkv against vLLM alone: TTFT p90; prompt tokens/s",
                f"{p90[0]:,.1f} s against {p90[1]:,.1f} s; **{tps[0] / tps[1]:.1f}x**",
                "see [docs/measured.md](docs/measured.md#many-users-at-once)",
            ]
        )
    four_k = next((r for r in res["rows"] if r["tokens"] == 4096), None)
    if four_k and "tierkv_disk_cold" in four_k:
        cold = min(four_k[c]["ttft_s"] for c in vllm.COLD_COLUMNS if c in four_k)
        rows.append(
            [
                "inside vLLM (CPU), 4,096 tokens: the fastest of its three cold prefills; tierkv from a cold "
                "disk; ExampleConnector from a cold page cache",
                f"{cold * 1e3:,.0f}; {four_k['tierkv_disk_cold']['ttft_s'] * 1e3:,.0f}; "
                f"{four_k['example_disk_cold']['ttft_s'] * 1e3:,.0f} ms",
                "see [docs/vllm.md](docs/vllm.md)",
            ]
        )
    return "\n".join(md_table(["measure (2 cores, no GPU)", "result", "measured"], "lrl", rows))


BLOCKS: dict[str, Callable[[], str]] = {
    "headline": _headline,
    "restart": _part("cpu-2c-smollm2", "restart", restart.markdown),
    "ttft-smollm2": _ttft("cpu-2c-smollm2"),
    "ttft-tiny": _ttft("cpu-2c"),
    "tiers": _part("cpu-2c", "tiers", tiers.markdown),
    "peers": _part("cpu-2c", "peers", peers.markdown),
    "stall": _part("cpu-2c", "stall", stall.markdown),
    "workloads": _part("cpu-2c", "workloads", workloads.markdown),
    "scaleout": _part("cpu-2c", "scaleout", scaleout.markdown),
    "overhead": _part("cpu-2c", "overhead", overhead.markdown),
    "vllm": _vllm,
    "sessions": _part("cpu-2c-smollm2", "sessions", sessions.markdown),
    "transfer": _part("cpu-2c", "transfer", transfer.markdown),
}


def render(text: str) -> str:
    """``text`` with every generated block rewritten; an unknown block name is an error."""

    def one(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        return f"{m.group(1)}{BLOCKS[name]().rstrip()}\n{m.group(4)}"

    return BLOCK.sub(one, text)


def main(argv: list[str]) -> int:
    """Rewrite the documents' generated blocks; with ``--check``, only say which are out of date (exit 1)."""
    stale = []
    for rel in DOCUMENTS:
        path = ROOT / rel
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(rel)
            if "--check" not in argv:
                path.write_text(new)
    verb = "out of date" if "--check" in argv else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every generated table is up to date")
    return 1 if stale and "--check" in argv else 0


__all__ = ["BLOCKS", "DOCUMENTS", "main", "render", "vllm_rows"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
