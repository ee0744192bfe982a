"""``tierkv bench``: runs the benchmarks of ``tierkv.bench`` and writes their report (the benchmarks
themselves are imported only when the command runs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tierkv.cli.common import fail

__all__ = ["bench"]

ONLY_DEFAULT = "ttft,tiers,peers,stall,workloads,plan,scaleout"


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
    _update_docs(target)


PARTS = (
    "plan",
    "ttft",
    "tiers",
    "peers",
    "stall",
    "workloads",
    "restart",
    "overhead",
    "scaleout",
    "sessions",
    "transfer",
)  # run order

EXIT_STATUS = (
    "Every part writes its results (results.json, README.md, plots) as it finishes; a part that fails is "
    "listed with its error in the table of parts (a child process's log is kept under logs/ in the "
    "results folder and quoted) and the other parts still run. Exit status: 0 when every part ran; 1 "
    "when any part failed (the others' results are written); 2 for bad options."
)


@click.command(epilog=EXIT_STATUS)
@click.option("--quick", is_flag=True, help="Small sizes and few runs: proves the benchmarks run (CI).")
@click.option(
    "--only",
    default=ONLY_DEFAULT,
    show_default=True,
    help="Comma-separated parts: ttft, tiers, peers, stall, workloads, plan, scaleout, restart, overhead, "
    "sessions (many chat sessions at once through vLLM alone, vLLM with tierkv, with ExampleConnector, "
    "and tierkv serve: about 20 minutes with smollm2), transfer (tierkv export and import against the "
    "store's own read and write speeds).",
)
@click.option("--plan", "plan_only", is_flag=True, help="Only the break-even plan (fast).")
@click.option(
    "--model",
    "model_path",
    help="smollm2, tiny or a local Hugging Face directory: the model of the plan, the TTFT table (1K, 2K, "
    "4K, 8K tokens), the HTTP parts (workloads, restart, overhead, scaleout). tiny: the embedded model "
    "(TTFT also for its wider config, llama-wide), results in the folder without a model suffix.  "
    "[default: smollm2]",
)
@click.option(
    "--config",
    "config_name",
    help="A built-in config of the embedded model for --plan and ttft: default or llama-wide (the HTTP "
    "parts then run tiny).",
)
@click.option(
    "--out",
    "out_dir",
    default="bench/runs",
    show_default=True,
    help="Results folder (a machine tag, the model's name unless tiny, and -quick are appended). The "
    "project's committed results are in bench/results: --out bench/results records a run there and "
    "rewrites the README's and docs' tables from it.",
)
@click.option(
    "--runs", type=int, help="Repetitions per measurement (default 5, quick 2); overhead: rounds (default 6)."
)
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="vllm: TTFT through vLLM's OpenAI server, servers in turn: cold, tierkv saving, tierkv "
    "loading after a restart (disk, then host; again through a buffer, and with buffered reads), "
    "ExampleConnector saving and "
    "loading, tierkv saving and cold again (saving's cost from two servers each); --model "
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

    from tierkv import models
    from tierkv.errors import ConfigError

    if engine == "vllm":
        if plan_only or config_name or only != ONLY_DEFAULT:
            fail("--engine vllm runs its own benchmark: --plan, --only and --config do not apply", 2)
        _bench_vllm(quick, model_path or models.DEFAULT, out_dir, runs, vllm_lengths)
        return

    from tierkv.bench import machine, report, ttft

    parts = {"plan"} if plan_only else {p.strip() for p in only.split(",") if p.strip()}
    if unknown := parts - set(PARTS):
        fail(f"--only: unknown part(s) {', '.join(sorted(unknown))}", 2)
    if not parts:
        fail("--only: give at least one part", 2)
    if config_name is not None and config_name not in ttft.MODELS:
        fail(f"--config: expected one of {', '.join(ttft.MODELS)}", 2)
    if model_path is not None and config_name is not None:
        fail("give --model or --config, not both", 2)
    model = model_path or (models.TINY if config_name else models.DEFAULT)
    if model in models.BUILTIN:  # its weights' package missing: one line now, not every part failing
        try:
            models.gguf_path(models.BUILTIN[model])
        except ConfigError as exc:
            fail(str(exc), 2)
    desc = machine.describe(".")
    target = Path(out_dir) / (
        machine.tag(desc)
        + ("" if model == models.TINY else f"-{Path(model).name}")
        + ("-quick" if quick else "")
    )
    results: dict[str, Any] = {"quick": quick, "model": model, "parts": {}}
    if quick:
        click.echo(report.QUICK_WARNING + "\n")
    click.echo(f"model {model}; results in {target}/ (written after each part)\n")
    run_part = _part_runners(quick, model, config_name, runs)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=".") as tmp:
        for name in (p for p in PARTS if p in parts):
            results[name], results["parts"][name] = _run_part(name, run_part[name], Path(tmp), target)
            files = report.write(target, desc, results)
    click.echo(report.parts_markdown(results["parts"]) + "\n")
    click.echo("wrote " + ", ".join(str(f) for f in files))
    _update_docs(target)
    if failed := [name for name, p in results["parts"].items() if p["status"] != "ok"]:
        fail(
            f"{len(failed)} part(s) failed: {', '.join(failed)} (see the table above; the others' "
            "results are written)",
            1,
        )


def _update_docs(target: Path) -> None:
    """Results written into this checkout's bench/results/ (asked for with ``--out bench/results``): its
    README's and docs' tables follow them. Elsewhere (the default, bench/runs/) nothing tracked changes."""
    from tierkv.bench import docs

    if not (docs.ROOT / "docs").is_dir():  # an installed package, not a checkout: no tables to follow
        return
    if not target.resolve().is_relative_to(docs.RESULTS):
        click.echo(
            "(the project's README and docs quote its committed runs in bench/results/, left as they are; "
            "--out bench/results records a run there)"
        )
        return
    try:
        docs.main([])
    except (OSError, KeyError, ValueError) as exc:  # the results are written; the tables can wait
        click.echo(f"the docs' tables were not rewritten ({exc}); run python -m tierkv.bench.docs", err=True)


def _run_part(name: str, run: Callable[[Path], Any], base: Path, target: Path) -> tuple[Any, dict[str, Any]]:
    """One part: (its results, or report.failure(...) when it raised; its row of the table of parts).
    Its child processes log into ``<target>/logs/<name>/``, emptied first."""
    import shutil
    import time
    import traceback

    from tierkv.bench import report, serving

    logs = target / "logs" / name
    shutil.rmtree(logs, ignore_errors=True)
    t0 = time.monotonic()
    with serving.log_dir(logs):
        try:
            res = run(base)
        except Exception as exc:  # the part failed: say why, keep going with the next one
            seconds = time.monotonic() - t0
            logs.mkdir(parents=True, exist_ok=True)
            (logs / "traceback.txt").write_text(traceback.format_exc())
            error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, serving.ChildFailed):  # its message quotes the child's log already
                error += _failed_children(logs)
            res = report.failure(error, seconds, sorted(str(p) for p in logs.iterdir()))
            click.echo(f"## {name}\n\n{report.failure_markdown(res)}\n", err=True)
            return res, {"status": "failed", "seconds": res["seconds"], "error": error, "when": _now()}
    # each part's own time: a later run of other parts (--only) keeps it, and the docs' tables say it
    return res, {"status": "ok", "seconds": round(time.monotonic() - t0, 1), "when": _now()}


def _now() -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _failed_children(logs: Path, most: int = 2) -> str:
    """The tails of the child logs in ``logs`` that show an error (a server that crashed mid-part)."""
    from tierkv.bench import serving

    quoted = []
    for path in sorted(logs.glob("*.log")):
        tail = serving.log_tail(path)
        if "Traceback" in tail or "error" in tail.lower():
            quoted.append(f"\n{path} ends:\n{tail}")
    return "".join(quoted[:most])


def _gpu_sessions() -> tuple[str, ...]:
    """vLLM's own offloading joins the sessions benchmark where it runs: on a GPU."""
    import torch

    from tierkv.bench import sessions

    return sessions.GPU_SYSTEMS if torch.cuda.is_available() else ()


def _part_runners(
    quick: bool, model: str, config_name: str | None, runs: int | None
) -> dict[str, Callable[[Path], Any]]:
    """Each part as a function of the run's scratch directory: it prints its table and returns its results."""
    from tierkv import models
    from tierkv.bench import overhead, plan, restart, scaleout, tiers, ttft, workloads

    rounds = runs  # overhead: rounds of new prompts per server (its own default when not given)
    runs = runs or (2 if quick else 5)
    embedded = model == models.TINY  # the embedded model: its configs for the plan and TTFT

    def plan_part(base: Path) -> dict[str, Any]:
        cm = ttft._model(config_name or ("default" if embedded else model), None)
        res: dict[str, Any] = {
            "measured": plan.measured(cm, base, context=256 if quick else 1024),
            "computed": plan.computed(),
        }
        click.echo(plan.markdown(res["measured"], res["computed"]) + "\n")
        return res

    def ttft_part(base: Path) -> list[dict[str, Any]]:
        if config_name:
            names = [config_name]
        elif embedded:
            names = ["default"] if quick else list(ttft.MODELS)
        else:
            names = [model]
        out = []
        for name in names:
            lengths: tuple[int, ...] | None
            if quick:
                lengths = (128, 256)
            elif name not in ttft.MODELS:
                lengths = None  # the model's: 1K, 2K, 4K and 8K within its context
            else:
                lengths = (512, 1024, 2048, 4096) if name == "default" else (512, 1024, 2048)
            res = ttft.run(base, model=name, lengths=lengths, runs=runs)
            out.append(res)
            click.echo(ttft.markdown(res) + "\n")
            if name not in ttft.MODELS:
                click.echo(ttft.beside_seeds(res) + "\n")
        return out

    def tiers_part(base: Path) -> dict[str, Any]:
        res = tiers.run(base, total_nbytes=(24 << 20) if quick else (512 << 20), runs=runs)
        click.echo(tiers.markdown(res) + "\n")
        return res

    def peers_part(base: Path) -> dict[str, Any]:
        from tierkv.bench import peers

        res = peers.run(
            # as many runs as the other parts: a column's median of 3 swung with this disk's minute
            base,
            prompts=2 if quick else 4,
            prompt_tokens=256 if quick else 4096,
            runs=1 if quick else runs,
        )
        click.echo(peers.markdown(res) + "\n")
        return res

    def stall_part(base: Path) -> dict[str, Any]:
        from tierkv.bench import stall

        quick_modes = ("alone", "writer, nice 19, native writer (now)")
        res = stall.run(base, seconds=1.0, modes=quick_modes) if quick else stall.run(base, seconds=20.0)
        click.echo(stall.markdown(res) + "\n")
        return res

    def workloads_part(base: Path) -> dict[str, Any]:
        res = workloads.run(base, quick=quick, model=model, max_tokens=1 if quick else 8)
        click.echo(workloads.markdown(res) + "\n")
        return res

    def restart_part(base: Path) -> dict[str, Any]:
        res = restart.run(base, model=model, tokens=300 if quick else 3000, runs=1 if quick else 3)
        click.echo(restart.markdown(res) + "\n")
        return res

    def overhead_part(base: Path) -> dict[str, Any]:
        res = overhead.run(base, quick=quick, model=model, rounds=rounds)
        click.echo(overhead.markdown(res) + "\n")
        return res

    def scaleout_part(base: Path) -> dict[str, Any]:
        res = scaleout.run(base, quick=quick, model=model)
        click.echo(scaleout.markdown(res) + "\n")
        return res

    def sessions_part(base: Path) -> dict[str, Any]:
        from tierkv.bench import sessions
        from tierkv.integrations.vllm.serve import vllm_python

        # vLLM's systems where vLLM is installed (.venv-vllm or TIERKV_VLLM_PYTHON); tiny runs tierkv alone
        python = None if embedded else vllm_python()
        small = {"users": 3, "rounds": 2, "system_chars": 600, "doc_chars": 900} if quick else {}
        res = sessions.run(
            base,
            python=python,
            model=model,
            systems=("tierkv",) if embedded else sessions.SYSTEMS + _gpu_sessions(),
            progress=lambda line: click.echo(line, err=True),
            **small,  # type: ignore[arg-type]
        )
        click.echo(sessions.markdown(res) + "\n")
        return res

    def transfer_part(base: Path) -> dict[str, Any]:
        from tierkv.bench import transfer

        res = transfer.run(
            base, total_nbytes=(24 << 20) if quick else (512 << 20), runs=runs or (2 if quick else 3)
        )
        click.echo(transfer.markdown(res) + "\n")
        return res

    return {
        "transfer": transfer_part,
        "sessions": sessions_part,
        "plan": plan_part,
        "ttft": ttft_part,
        "tiers": tiers_part,
        "peers": peers_part,
        "stall": stall_part,
        "workloads": workloads_part,
        "restart": restart_part,
        "overhead": overhead_part,
        "scaleout": scaleout_part,
    }
