"""``tierkv bench``: runs the benchmarks of ``tierkv.bench`` and writes their report (the benchmarks
themselves are imported only when the command runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from tierkv.cli_common import fail

__all__ = ["bench"]

ONLY_DEFAULT = "ttft,tiers,workloads,plan,scaleout"


def _bench_vllm(quick: bool, model: str, out_dir: str, runs: int | None, lengths: str | None) -> None:
    import tempfile

    from tierkv.bench import machine, report
    from tierkv.bench import vllm as vllm_bench
    from tierkv.errors import ConfigError
    from tierkv.integrations.vllm.serve import INSTALL_HINT, vllm_python

    python = vllm_python()
    if python is None:
        fail(INSTALL_HINT, 2)
    sizes: tuple[int, ...] = (256, 512) if quick else vllm_bench.LENGTHS
    if lengths:
        try:
            sizes = tuple(int(x) for x in lengths.split(","))
        except ValueError:
            fail(f"--lengths: expected comma-separated token counts, got {lengths!r}", 2)
    desc = machine.describe(".")
    target = Path(out_dir) / (machine.tag(desc) + "-vllm" + ("-quick" if quick else ""))
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=".") as tmp:
        try:
            res = vllm_bench.run(
                Path(tmp),
                log_dir=target,
                python=python,
                model=model,
                runs=runs or (1 if quick else 3),
                lengths=sizes,
                progress=lambda line: click.echo(line, err=True),
            )
        except ConfigError as exc:
            fail(str(exc), 2)
    files = report.write(target, desc, {"vllm": res})  # the JSON first: the table is made from it
    click.echo(vllm_bench.markdown(res) + "\n")
    click.echo("wrote " + ", ".join(str(f) for f in files))


@click.command()
@click.option("--quick", is_flag=True, help="Small sizes and few runs: proves the benchmarks run (CI).")
@click.option(
    "--only",
    default=ONLY_DEFAULT,
    show_default=True,
    help="Comma-separated parts: ttft, tiers, workloads, plan, scaleout, restart, overhead.",
)
@click.option("--plan", "plan_only", is_flag=True, help="Only the break-even plan (fast).")
@click.option(
    "--model",
    "model_path",
    help="smollm2, tiny or a local Hugging Face directory: the model of the plan, the TTFT table (1K, 2K, "
    "4K, 8K tokens), the HTTP workloads and the restart measurement.  [default: the embedded configs]",
)
@click.option(
    "--config", "config_name", help="A built-in model config for --plan and ttft: default or llama-wide."
)
@click.option(
    "--out",
    "out_dir",
    default="bench/results",
    show_default=True,
    help="Results folder (a machine tag is appended).",
)
@click.option(
    "--runs", type=int, help="Repetitions per measurement (default 5, quick 2); overhead: rounds (default 6)."
)
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="vllm: TTFT through vLLM's OpenAI server, five servers in turn: cold, tierkv saving, tierkv "
    "loading after a restart (disk, then host), ExampleConnector saving and loading; --model "
    "smollm2 or a Hugging Face directory (default smollm2), --runs prompts per length (default 3, "
    "quick 1). About 45 minutes on 2 CPU cores. Needs vLLM (scripts/setup.sh vllm, then "
    ".venv-vllm/bin/tierkv, or TIERKV_VLLM_PYTHON).",
)
@click.option(
    "--lengths",
    "vllm_lengths",
    help="vllm: comma-separated prompt lengths, each below the model's context [default: "
    "1024,2048,4096,8064; quick 256,512].",
)
def bench(
    quick: bool,
    only: str,
    plan_only: bool,
    model_path: str | None,
    config_name: str | None,
    out_dir: str,
    runs: int | None,
    engine: str,
    vllm_lengths: str | None,
) -> None:
    """Cold prefill against restore from each tier, tier bandwidth, HTTP workloads, break-even."""
    import tempfile

    if engine == "vllm":
        if plan_only or config_name or only != ONLY_DEFAULT:
            fail("--engine vllm runs its own benchmark: --plan, --only and --config do not apply", 2)
        _bench_vllm(quick, model_path or "smollm2", out_dir, runs, vllm_lengths)
        return

    from tierkv.bench import machine, overhead, plan, report, restart, scaleout, tiers, ttft, workloads

    parts = {"plan"} if plan_only else {p.strip() for p in only.split(",") if p.strip()}
    if unknown := parts - {"ttft", "tiers", "workloads", "plan", "scaleout", "restart", "overhead"}:
        fail(f"--only: unknown part(s) {', '.join(sorted(unknown))}", 2)
    if config_name is not None and config_name not in ttft.MODELS:
        fail(f"--config: expected one of {', '.join(ttft.MODELS)}", 2)
    if model_path is not None and config_name is not None:
        fail("give --model or --config, not both", 2)
    rounds = runs  # overhead: rounds of new prompts per server (its own default when not given)
    runs = runs or (2 if quick else 5)
    desc = machine.describe(".")
    results: dict[str, Any] = {"quick": quick}
    if quick:
        click.echo(report.QUICK_WARNING + "\n")
    if model_path:
        results["model"] = model_path
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=".") as tmp:
        base = Path(tmp)
        if "plan" in parts:
            cm = ttft._model(model_path or config_name or "default", None)
            results["plan"] = {
                "measured": plan.measured(cm, base, context=256 if quick else 1024),
                "computed": plan.computed(),
            }
            click.echo(plan.markdown(results["plan"]["measured"], results["plan"]["computed"]) + "\n")
        if "ttft" in parts:
            results["ttft"] = []
            chosen = model_path or config_name
            models = [chosen] if chosen else (["default"] if quick else list(ttft.MODELS))
            for name in models:
                lengths: tuple[int, ...] | None
                if quick:
                    lengths = (128, 256)
                elif model_path:
                    lengths = None  # the model's: 1K, 2K, 4K and 8K within its context
                else:
                    lengths = (512, 1024, 2048, 4096) if name == "default" else (512, 1024, 2048)
                res = ttft.run(base, model=name, lengths=lengths, runs=runs)
                results["ttft"].append(res)
                click.echo(ttft.markdown(res) + "\n")
                if model_path:
                    click.echo(ttft.beside_seeds(res) + "\n")
        if "tiers" in parts:
            results["tiers"] = tiers.run(base, total_nbytes=(24 << 20) if quick else (512 << 20), runs=runs)
            click.echo(tiers.markdown(results["tiers"]) + "\n")
        if "workloads" in parts:
            results["workloads"] = workloads.run(base, quick=quick, model=model_path)
            click.echo(workloads.markdown(results["workloads"]) + "\n")
        if "restart" in parts:
            results["restart"] = restart.run(
                base, model=model_path or "tiny", tokens=300 if quick else 3000, runs=1 if quick else 3
            )
            click.echo(restart.markdown(results["restart"]) + "\n")
        if "overhead" in parts:
            results["overhead"] = overhead.run(base, quick=quick, model=model_path, rounds=rounds)
            click.echo(overhead.markdown(results["overhead"]) + "\n")
        if "scaleout" in parts:
            results["scaleout"] = scaleout.run(base, quick=quick)
            click.echo(scaleout.markdown(results["scaleout"]) + "\n")
    target = Path(out_dir) / (
        machine.tag(desc) + (f"-{Path(model_path).name}" if model_path else "") + ("-quick" if quick else "")
    )
    files = report.write(target, desc, results)
    click.echo("wrote " + ", ".join(str(f) for f in files))
