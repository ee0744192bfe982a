"""Results: JSON, a markdown report and PNG plots in ``bench/results/<machine-tag>/``.

``tierkv bench`` writes them after every part, so a part that fails or a run that is stopped keeps what
finished. A part that failed is stored as ``failure(...)`` (its error, the log files of its child
processes) in place of its results, listed in the report's table of parts and quoted in its section.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench import (
    overhead,
    peers,
    plan,
    restart,
    scaleout,
    stall,
    tiers,
    transfer,
    ttft,
    vllm,
    workloads,
)
from tierkv.bench.table import md_table

QUICK_WARNING = (
    "**Quick run: a smoke test of the benchmarks (tiny sizes, few runs), not measurements to compare.**"
)


def failure(error: str, seconds: float, logs: list[str]) -> dict[str, Any]:
    """What a part that raised leaves in the results: its error (quoting a child's log where one failed)
    and the logs of its child processes."""
    return {"failed": True, "error": error, "seconds": round(seconds, 1), "logs": logs}


def is_failure(res: Any) -> bool:
    return isinstance(res, dict) and res.get("failed") is True


def failure_markdown(res: dict[str, Any]) -> str:
    first, _, rest = res["error"].partition("\n")
    lines = [f"**Failed** after {res['seconds']:.0f} s: {first}"]
    if rest:
        lines += ["", "```text", rest, "```"]
    if res.get("logs"):
        lines += ["", "Logs: " + ", ".join(f"`{p}`" for p in res["logs"])]
    return "\n".join(lines)


def parts_markdown(parts: dict[str, dict[str, Any]]) -> str:
    """The table of parts: each one's status, time, and the first line of its error."""
    return "\n".join(
        md_table(
            ["part", "result", "time (s)", "error"],
            "llrl",
            (
                [
                    name,
                    p["status"],
                    f"{p['seconds']:.0f}",
                    p.get("error", "").partition("\n")[0].replace("|", "\\|"),
                ]
                for name, p in parts.items()
            ),
        )
    )


def write(out_dir: Path, machine: dict[str, Any], results: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    previous = out_dir / "results.json"
    if previous.exists():  # a run of some parts (--only) keeps the other parts of the last run
        try:
            old = json.loads(previous.read_text())
        except ValueError:
            old = {}
        parts = {**old.get("parts", {}), **results.get("parts", {})}
        results = {**{k: v for k, v in old.items() if k not in ("machine", "when")}, **results}
        if parts:
            results["parts"] = parts
    (out_dir / "results.json").write_text(
        json.dumps({"machine": machine, "when": stamp, **results}, indent=2)
    )
    md = [
        f"# tierkv benchmark — {stamp}",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, disk {machine['disk']}, "
        f"GPU {machine['gpu'] or 'none'}; torch {machine['torch']}, Python {machine['python']}."
        + (f" Memory: {'; '.join(machine['memory_reclaim'])}." if machine.get("memory_reclaim") else ""),
        "",
    ]
    if results.get("quick"):
        md += [QUICK_WARNING, ""]
    if results.get("parts"):
        md += [parts_markdown(results["parts"]), ""]
    if is_failure(results.get("ttft")):
        md += ["## TTFT", "", failure_markdown(results["ttft"]), ""]
    for res in [] if is_failure(results.get("ttft")) else results.get("ttft", []):
        md += [f"## TTFT: `{res['config']['model']}`", "", ttft.markdown(res), ""]
        if results.get("model") not in (None, "tiny"):
            md += [ttft.beside_seeds(res), ""]  # with its legend, as the console prints it
    sections: list[tuple[str, str, Callable[[Any], str]]] = [
        ("tiers", "Tier bandwidth", tiers.markdown),
        ("peers", "Beside what a user could pick instead", peers.markdown),
        ("stall", "The model thread's stalls beside the disk writer", stall.markdown),
        ("workloads", "Workloads through the HTTP server", workloads.markdown),
        ("overhead", "The cache's cost when nothing is reused (interleaved)", overhead.markdown),
        ("restart", "A long prompt through HTTP: cold, again, after a restart", restart.markdown),
        ("scaleout", "Two workers: shared remote tier and prefix-aware routing", scaleout.markdown),
        ("transfer", "Moving a cache: export and import", transfer.markdown),
        ("plan", "Break-even", lambda p: plan.markdown(p.get("measured"), p["computed"])),
        ("vllm", "TTFT through vLLM: cold, tierkv, ExampleConnector", vllm.markdown),
    ]
    for part, title, markdown in sections:
        if part in results:
            body = failure_markdown(results[part]) if is_failure(results[part]) else markdown(results[part])
            md += [f"## {title}", "", body, ""]
    files = [out_dir / "results.json", out_dir / "README.md"]
    files += _plots(out_dir, results)
    md += [f"![{p.stem}]({p.name})" for p in files[2:]]
    (out_dir / "README.md").write_text("\n".join(md) + "\n")
    return files


_NO_PLOTS_SAID: list[bool] = []


def _plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: said once, in the output
        if not _NO_PLOTS_SAID:
            _NO_PLOTS_SAID.append(True)
            print(
                "no plots: matplotlib is not installed (pip install 'tierkv[bench]'; in a clone, pip install -e '.[bench]')",
                file=sys.stderr,
            )
        return []
    files: list[Path] = []
    if results.get("ttft") and not is_failure(results["ttft"]):
        fig, axes = plt.subplots(
            1, len(results["ttft"]), figsize=(6 * len(results["ttft"]), 4.5), squeeze=False
        )
        for ax, res in zip(axes[0], results["ttft"]):
            x = [r["tokens"] for r in res["rows"]]
            for key, label, style in (
                ("cold_s", "cold prefill", "k-o"),
                ("host_s", "host tier", "g-s"),
                ("disk_warm_s", "disk, warm page cache", "b-^"),
                ("disk_cold_s", "disk, cold page cache", "r-v"),
            ):
                ax.plot(x, [r[key]["median"] * 1e3 for r in res["rows"]], style, label=label)
            ax.plot(x, [r["floor_disk_cold_s"] * 1e3 for r in res["rows"]], "r:", label="floor, cold disk")
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="prompt tokens",
                ylabel="TTFT (ms)",
                title=f"TTFT, {res['config']['model']}",
            )
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out_dir / "ttft.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    if "tiers" in results and not is_failure(results["tiers"]):
        rows = results["tiers"]["rows_Bps"]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = list(rows)
        vals = [rows[n]["median"] / 1e9 for n in names]
        colors = ["#888" if n.startswith(("raw", "memcpy", "naive")) else "#2a7" for n in names]
        ax.barh(names, vals, color=colors)
        ax.set(
            xscale="log",
            xlabel="GB/s (median; grey: baselines measured in the same run)",
            title="Tier bandwidth against the hardware's limit",
        )
        ax.invert_yaxis()
        fig.tight_layout()
        files.append(out_dir / "bandwidth.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    if results.get("sessions") and not is_failure(results["sessions"]) and results["sessions"]["systems"]:
        files.append(_sessions_plot(plt, out_dir, results["sessions"]))
    return files


def _sessions_plot(plt: Any, out_dir: Path, res: dict[str, Any]) -> Path:
    """The sessions benchmark: TTFT by round (p50 solid, p90 dashed), the share of prompt tokens computed
    by round (the rest came from a cache), and the TTFT CDF of the rounds after the first."""
    fig, (by_round, computed, cdf) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, sys_res in res["systems"].items():
        rounds = [*sys_res["rounds"], sys_res["after_restart"]]
        x = list(range(1, len(rounds) + 1))
        (line,) = by_round.plot(x, [r["ttft_p50_s"] for r in rounds], "-o", label=name)
        by_round.plot(x, [r["ttft_p90_s"] for r in rounds], "--", color=line.get_color())
        share = [r["sources"].get("computed", 0.0) / max(1.0, r["prompt_tokens"]) for r in rounds]
        computed.plot(x, [100 * v for v in share], "-o", color=line.get_color(), label=name)
        later = sorted(t for r in sys_res["rounds"][1:] for t in r["ttft_s"])
        if later:
            cdf.step(later, [(i + 1) / len(later) for i in range(len(later))], where="post", label=name)
    last = len(next(iter(res["systems"].values()))["rounds"]) + 1
    for ax in (by_round, computed):
        ax.set_xticks(range(1, last + 1), [*map(str, range(1, last)), f"{last}\n(restarted)"])
        ax.grid(True, alpha=0.3)
    by_round.set(
        xlabel="round", ylabel="TTFT (s), p50 solid, p90 dashed", ylim=(0, None), title="TTFT by round"
    )
    computed.set(
        xlabel="round", ylabel="prompt tokens computed (%)", ylim=(0, 100), title="Computed, not reused"
    )
    cdf.set(
        xlabel="TTFT (s)",
        ylabel="fraction of requests",
        xlim=(0, None),
        title="TTFT CDF, rounds after the first",
    )
    cdf.grid(True, alpha=0.3)
    for ax in (by_round, computed, cdf):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "sessions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["QUICK_WARNING", "failure", "failure_markdown", "is_failure", "parts_markdown", "write"]
