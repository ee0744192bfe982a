"""``tierkv stats`` and ``tierkv gc``: the store on disk, opened read-only for stats and as a second writer
for gc (both safe while a server writes to it)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from tierkv.cli.common import cache_dir_option, fail, open_disk, parsed
from tierkv.errors import ConfigError, StoreOpenError
from tierkv.paths import CACHE_DIR_ENV
from tierkv.units import format_duration, format_size, parse_duration, parse_size

__all__ = ["gc", "stats"]


def _store_dir(cache_dir: str, folder: str | None) -> str:
    """The store's directory: FOLDER, or --cache-dir (its default, or TIERKV_CACHE_DIR), not both."""
    if folder is None:
        return cache_dir
    if (
        click.get_current_context().get_parameter_source("cache_dir")
        == click.core.ParameterSource.COMMANDLINE
    ):
        fail("give the store's directory once: as FOLDER or as --cache-dir", 2)
    return folder


@click.command()
@cache_dir_option
@click.argument("folder", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def stats(cache_dir: str, folder: str | None, as_json: bool) -> None:
    """Totals per namespace, ages, expired blocks not yet swept, budget and space. FOLDER: the store's
    directory, as --cache-dir."""
    from tierkv.store_report import store_stats

    source = click.get_current_context().get_parameter_source("cache_dir")
    cache_dir = _store_dir(cache_dir, folder)
    # the default store (no --cache-dir, no TIERKV_CACHE_DIR): a server started with --cache-dir keeps its
    # own elsewhere, which a new user then looks for here
    default = (
        folder is None and source == click.core.ParameterSource.DEFAULT and not os.environ.get(CACHE_DIR_ENV)
    )

    with open_disk(cache_dir) as disk:
        report = store_stats(disk)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    p = report["policy"]
    from tierkv.tiers.disk.schema import STORE_FORMAT_VERSION

    newest = report["format_version"] >= STORE_FORMAT_VERSION
    click.echo(
        f"store      {report['cache_dir']}   format {report['format_version']}"
        + ("" if newest else f" (`tierkv gc --upgrade` makes it {STORE_FORMAT_VERSION}, see docs/shell.md)")
        + ("   (the default: give --cache-dir for a server started with one)" if default else "")
    )
    # this process's, from its environment: a server's own is on its start-up line
    click.echo(f"data path  {report['data_path']}   (in this environment; a server logs its own)")
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
        f"max age {format_duration(p['max_age_s']) if p['max_age_s'] else 'none'}   "
        f"pin budget {format_size(p['pin_budget_nbytes']) if p['pin_budget_nbytes'] else 'none'}"
    )
    if p["budget_nbytes"]:  # what a user watching the files with du asks next
        click.echo(
            "           (the files may pass it by up to two write batches while a save is written, until "
            "it is indexed; evictions: a server's /metrics, tierkv_tier_evictions_total)"
        )
    r = report["retention"]
    kept = "".join(
        f", {ttl} {row['blocks']}" for ttl, row in r["retained"]["by_ttl"].items()
    )  # per retention asked
    click.echo(
        f"retention  store's ttl {r['default']['blocks']} blocks {format_size(r['default']['nbytes'])}   "
        f"asked to keep {r['retained']['blocks']} blocks {format_size(r['retained']['nbytes'])}"
        + (f" ({kept[2:]})" if kept else "")
        + f"   pinned {r['pinned']['blocks']} blocks {format_size(r['pinned']['nbytes'])}"
    )
    for t in report["tenants"]:
        quotas = "".join(
            f"   {what} quota {format_size(t[field])}"
            for what, field in (
                ("disk", "disk_quota_nbytes"),
                ("host", "host_quota_nbytes"),
                ("pin", "pin_quota_nbytes"),
            )
            if t[field] is not None
        )
        click.echo(
            f"tenant     {t['tenant']}   {t['blocks']} blocks {format_size(t['nbytes'])}   pinned "
            f"{t['pinned_blocks']} blocks {format_size(t['pinned_nbytes'])}{quotas}"
        )
    if report["tenants"]:  # what no tenant holds (a server without keys on the same directory)
        rest = report["blocks"] - sum(t["blocks"] for t in report["tenants"])
        rest_nbytes = report["live_nbytes"] - sum(t["nbytes"] for t in report["tenants"])
        if rest > 0:
            click.echo(f"no tenant  {rest} blocks {format_size(max(0, rest_nbytes))}")
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
            # a salt may be a tenant's secret: never printed, only a digest of it to tell them apart
            + (f" salted #{_digest(spec['tenant_salt'])}" if spec.get("tenant_salt") else "")
            + (f" tenant {ns['tenant']}" if ns.get("tenant") else "")
        )

        def age(t: float | None) -> str:
            return format_duration(now - t) + " ago" if t else "-"

        click.echo(
            f"  blocks {ns['blocks']}  {format_size(ns['nbytes'])}  oldest {age(ns['oldest_created_s'])}  "
            f"newest {age(ns['newest_created_s'])}  expired, not swept {ns['expired_unswept']}"
        )
        click.echo("  last access  " + "  ".join(f"{k} {v}" for k, v in ns["last_access_histogram"].items()))


@click.command()
@cache_dir_option
@click.option(
    "--ttl",
    callback=parsed(parse_duration),
    help="Delete blocks idle longer than this (e.g. 24h); default: the store's TTL.",
)
@click.option(
    "--max-age", callback=parsed(parse_duration), help="Delete blocks created longer ago than this."
)
@click.option(
    "--budget",
    callback=parsed(parse_size),
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
@click.option(
    "--upgrade",
    is_flag=True,
    help="Mark a store of an older tierkv (format 1 or 2) format 3: retention and pins (which format 1 "
    "lacks) and records laid out for faster restores; stop older builds on it first: they cannot read it "
    "afterwards.",
)
@click.option("--dry-run", is_flag=True, help="Count what would go; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.argument("folder", required=False)
def gc(
    cache_dir: str,
    folder: str | None,
    ttl: float | None,
    max_age: float | None,
    budget: int | None,
    namespace: str | None,
    purge_all: bool,
    check: bool,
    compact: bool,
    upgrade: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Sweep expired blocks, hold the byte budget, purge, verify, compact. FOLDER: the store's directory,
    as --cache-dir."""
    from tierkv.maintenance import run_gc
    from tierkv.maintenance import upgrade as upgrade_store
    from tierkv.tiers.disk.schema import STORE_FORMAT_VERSION

    with open_disk(_store_dir(cache_dir, folder)) as disk:
        if disk.index.on_read_only_media and not dry_run:
            fail(f"the store at {disk.path} is on a read-only file system: --dry-run counts what would go", 2)
        version = disk.format_version()
        if upgrade and version >= STORE_FORMAT_VERSION:
            click.echo(f"format {version}: already the newest, nothing to upgrade", err=True)
        elif upgrade and dry_run:
            click.echo(f"format {version}: would be upgraded to {STORE_FORMAT_VERSION}", err=True)
        elif upgrade:
            try:
                filled = upgrade_store(disk)
            except StoreOpenError as exc:
                fail(str(exc), 2)
            click.echo(
                f"upgraded from format {version} to {STORE_FORMAT_VERSION}: retention and pins on, new "
                f"records in the aligned layout (faster restores from the page cache); which stored "
                f"prompts extend which, indexed for {filled} blocks",
                err=True,
            )
        show = sys.stderr.isatty() and not as_json
        # what the segment files take on the file system, before and after what punches or deletes them
        measure = (compact or check) and not dry_run
        allocated_before = disk.segments.disk_nbytes()[0] if measure else 0
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
        if measure:
            out["allocated_before_nbytes"] = allocated_before
            out["allocated_after_nbytes"] = disk.segments.disk_nbytes()[0]
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(
            ("would remove" if dry_run else "removed")
            + f": expired {out['expired']}, evicted {out['evicted']}, purged {out['purged']}, "
            f"corrupt {out['corrupt']} (of {out['checked']} checked)"
            # a dry run empties no segment; its live bytes are those before
            + ("" if dry_run else f", segments {out['segments_removed']}")
            + f"; freed {format_size(out['freed_nbytes'])}; "
            + ("live now " if dry_run else "live ")
            + format_size(out["live_nbytes"])
            + (
                f" ({format_size(out['pinned_nbytes'])} of it pinned: never evicted)"
                if out["pinned_nbytes"]
                else ""
            )
            + (
                f"; segment files allocated {format_size(out['allocated_before_nbytes'])} before, "
                f"{format_size(out['allocated_after_nbytes'])} after"
                if "allocated_before_nbytes" in out
                else ""
            )
        )
    if out["corrupt"]:  # a cron job or a script must hear of it: the disk or something writing to it is bad
        verb = "would purge" if dry_run else "purged"
        fail(f"{out['corrupt']} corrupt record(s) found and {verb}: check the disk (dmesg, SMART)", 1)


def _digest(secret: str) -> str:
    import hashlib

    return hashlib.sha256(secret.encode()).hexdigest()[:12]


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
