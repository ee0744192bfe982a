"""Results: JSON, a markdown report and PNG plots in ``bench/results/<machine-tag>/``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench import overhead, plan, restart, scaleout, tiers, ttft, vllm, workloads

QUICK_WARNING = (
    "**Quick run: a smoke test of the benchmarks (tiny sizes, few runs), not measurements to compare.**"
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
        results = {**{k: v for k, v in old.items() if k not in ("machine", "when")}, **results}
    (out_dir / "results.json").write_text(
        json.dumps({"machine": machine, "when": stamp, **results}, indent=2)
    )
    md = [
        f"# tierkv benchmark — {stamp}",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, disk {machine['disk']}, "
        f"GPU {machine['gpu'] or 'none'}; torch {machine['torch']}, Python {machine['python']}.",
        "",
    ]
    if results.get("quick"):
        md += [QUICK_WARNING, ""]
    for res in results.get("ttft", []):
        md += [f"## TTFT: `{res['config']['model']}`", "", ttft.markdown(res), ""]
        if results.get("model"):
            md += [
                "Beside the seeds' headline (a hit from the host tier; from disk after a restart with the page "
                "cache dropped in brackets):",
                "",
                ttft.beside_seeds(res),
                "",
            ]
    sections: list[tuple[str, str, Callable[[Any], str]]] = [
        ("tiers", "Tier bandwidth", tiers.markdown),
        ("workloads", "Workloads through the HTTP server", workloads.markdown),
        ("overhead", "The cache's cost when nothing is reused (interleaved)", overhead.markdown),
        ("restart", "A long prompt through HTTP: cold, again, after a restart", restart.markdown),
        ("scaleout", "Two workers: shared remote tier and prefix-aware routing", scaleout.markdown),
        ("plan", "Break-even", lambda p: plan.markdown(p.get("measured"), p["computed"])),
        ("vllm", "TTFT through vLLM: cold, tierkv, ExampleConnector", vllm.markdown),
    ]
    for part, title, markdown in sections:
        if part in results:
            md += [f"## {title}", "", markdown(results[part]), ""]
    files = [out_dir / "results.json", out_dir / "README.md"]
    files += _plots(out_dir, results)
    md += [f"![{p.stem}]({p.name})" for p in files[2:]]
    (out_dir / "README.md").write_text("\n".join(md) + "\n")
    return files


def _plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: pip install 'tierkv[bench]'
        return []
    files = []
    if results.get("ttft"):
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
    if "tiers" in results:
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
    return files


__all__ = ["write"]
