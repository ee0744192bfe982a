"""The ``tierkv`` command: ``stats`` and ``gc`` on a store (safe while a server writes to it)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from tierkv.errors import ConfigError, TierKVError
from tierkv.units import format_duration, format_size, parse_duration, parse_size


def default_cache_dir() -> str:
    return os.environ.get("TIERKV_CACHE_DIR") or str(Path.home() / ".cache" / "tierkv")


def _fail(message: str, code: int) -> None:
    click.echo(f"tierkv: error: {message}", err=True)
    sys.exit(code)


def _parse(fn: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return fn(value)
        except ConfigError as exc:
            _fail(f"{param.opts[0]}: {exc}", 2)
    return callback


@contextmanager
def _open_disk(cache_dir: str) -> Iterator[Any]:
    from tierkv.tiers.disk import DiskTier

    if not (Path(cache_dir) / "index" / "data.mdb").exists():
        _fail(f"no tierkv store at {cache_dir} (set --cache-dir or TIERKV_CACHE_DIR)", 1)
    try:
        disk = DiskTier(cache_dir, writer=False)
    except TierKVError as exc:
        _fail(str(exc), 1)
    try:
        yield disk
    finally:
        disk.close()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierkv")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM inference."""


cache_dir_option = click.option("--cache-dir", default=default_cache_dir, show_default="$TIERKV_CACHE_DIR or ~/.cache/tierkv",
                                help="The store's directory.")


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
    click.echo(f"blocks     {report['blocks']}   live {format_size(report['live_nbytes'])}   "
               f"on disk {format_size(report['segment_allocated_nbytes'] + report['index_file_nbytes'])} "
               f"(segments {format_size(report['segment_allocated_nbytes'])} allocated of "
               f"{format_size(report['segment_apparent_nbytes'])} apparent, index {format_size(report['index_file_nbytes'])})")
    budget = format_size(p["budget_nbytes"]) if p["budget_nbytes"] else "none"
    used = f" ({100 * report['budget_used']:.1f}% used)" if report["budget_used"] is not None else ""
    click.echo(f"policy     budget {budget}{used}   ttl {format_duration(p['ttl_s']) if p['ttl_s'] else 'none'}   "
               f"max age {format_duration(p['max_age_s']) if p['max_age_s'] else 'none'}")
    now = time.time()
    for ns in report["namespaces"]:
        spec = json.loads(ns["spec"]) if ns["spec"] else {}
        click.echo(f"\nnamespace  {ns['digest'][:16]}  {spec.get('model_id', '?')}@{spec.get('revision', '?')} "
                   f"{spec.get('dtype', '?')} block {spec.get('block_tokens', '?')}"
                   + (f" salt {spec['tenant_salt']!r}" if spec.get("tenant_salt") else ""))

        def age(t: float | None) -> str:
            return format_duration(now - t) + " ago" if t else "-"

        click.echo(f"  blocks {ns['blocks']}  {format_size(ns['nbytes'])}  oldest {age(ns['oldest_created_s'])}  "
                   f"newest {age(ns['newest_created_s'])}  expired, not swept {ns['expired_unswept']}")
        click.echo("  last access  " + "  ".join(f"{k} {v}" for k, v in ns["last_access_histogram"].items()))


@main.command()
@cache_dir_option
@click.option("--ttl", callback=_parse(parse_duration), help="Delete blocks idle longer than this (e.g. 24h); default: the store's TTL.")
@click.option("--max-age", callback=_parse(parse_duration), help="Delete blocks created longer ago than this.")
@click.option("--budget", callback=_parse(parse_size), help="Evict least recently used blocks down to this size (e.g. 20GiB).")
@click.option("--namespace", "namespace", help="Purge every block of this namespace (digest, or a unique prefix of it).")
@click.option("--all", "purge_all", is_flag=True, help="Purge every block.")
@click.option("--check", is_flag=True, help="Read and verify every record; purge the bad ones.")
@click.option("--compact", is_flag=True, help="Release space no live record uses (crash leftovers, empty files).")
@click.option("--dry-run", is_flag=True, help="Count what would go; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def gc(cache_dir: str, ttl: float | None, max_age: float | None, budget: int | None, namespace: str | None,
       purge_all: bool, check: bool, compact: bool, dry_run: bool, as_json: bool) -> None:
    """Sweep expired blocks, hold the byte budget, purge, verify, compact."""
    from tierkv.tiers.disk import SweepReport

    if namespace and purge_all:
        _fail("--namespace and --all exclude each other", 2)
    if namespace is not None and len(namespace) < 4:
        _fail("--namespace: give at least 4 hex digits of the digest", 2)
    report = SweepReport()
    with _open_disk(cache_dir) as disk:
        show = sys.stderr.isatty() and not as_json
        if namespace is not None:
            matches = [d for d in disk.totals() if d.hex().startswith(namespace.lower())]
            matches += [d for d in disk.namespaces() if d.hex().startswith(namespace.lower()) and d not in matches]
            if len(matches) != 1:
                _fail(f"--namespace {namespace}: {'no' if not matches else len(matches)} namespaces match", 2)
            with _progress(show, "purge") as tick:
                report += disk.purge_namespace(matches[0], dry_run=dry_run, progress=tick)
        if purge_all:
            with _progress(show, "purge") as tick:
                report += disk.purge_namespace(None, dry_run=dry_run, progress=tick)
        with _progress(show, "expire") as tick:
            report += disk.expire(ttl_s=ttl, max_age_s=max_age, dry_run=dry_run, progress=tick)
        with _progress(show, "budget") as tick:
            report += disk.enforce_budget(budget, dry_run=dry_run, progress=tick)
        if check:
            with _progress(show, "check") as tick:
                report += disk.check(dry_run=dry_run, progress=tick)
        if compact:
            report += disk.compact(dry_run=dry_run)
        usage = disk.usage()
    out = {**dataclasses.asdict(report), "dry_run": dry_run, "live_nbytes": usage["live_nbytes"]}
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(("would remove" if dry_run else "removed") +
                   f": expired {report.expired}, evicted {report.evicted}, purged {report.purged}, "
                   f"corrupt {report.corrupt} (of {report.checked} checked), segments {report.segments_removed}; "
                   f"freed {format_size(report.freed_nbytes)}; live {format_size(usage['live_nbytes'])}")


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


if __name__ == "__main__":
    main()
