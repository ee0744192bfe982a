"""``tierkv keys add``, ``quota``, ``list`` and ``revoke``: API keys for ``tierkv serve --api-keys FILE``, one tenant's cache space each."""

from __future__ import annotations

import sys

import click

from tierkv.cli.common import fail
from tierkv.errors import ConfigError

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """API keys of tenants (tierkv serve --api-keys FILE)."""


@keys.command("add")
@click.argument("tenant")
@click.option("--file", "path", required=True, help="The keys file (created, mode 0600, if missing).")
def add(tenant: str, path: str) -> None:
    """Make a new API key for TENANT (and the tenant, with a secret salt, if it is new); print it once.

    The file keeps only the key's SHA-256; a running server reads the change by itself."""
    from tierkv.server.tenants import add_key

    try:
        key = add_key(path, tenant)
    except (ConfigError, OSError, ValueError) as exc:  # (ValueError: a keys file that is not TOML)
        fail(str(exc), 2)
    click.echo(key)
    click.echo(f"tierkv: a new key for tenant {tenant!r} in {path} (shown once: it is not stored)", err=True)


def _size_or_none(value: str | None) -> str | None:
    return None if value is None or value.lower() == "none" else value


@keys.command("quota")
@click.argument("tenant")
@click.option("--file", "path", required=True, help="The keys file.")
@click.option(
    "--disk", help="What eviction leaves TENANT on disk when the disk is full (20GiB; none: no quota)."
)
@click.option("--host", help="The same in the host tier (memory).")
@click.option("--pin", help="The most TENANT may pin (within the store's pin budget).")
def quota(tenant: str, path: str, disk: str | None, host: str | None, pin: str | None) -> None:
    """Set TENANT's quotas. A quota is what the tenant keeps when a tier must evict: eviction takes first
    from tenants above theirs (a tenant without one counts as above it), oldest first. A running server
    reads the change by itself."""
    from tierkv.server.tenants import set_quotas

    given = {"disk_quota": disk, "host_quota": host, "pin_quota": pin}
    changes = {k: _size_or_none(v) for k, v in given.items() if v is not None}
    if not changes:
        fail("give --disk, --host or --pin (a size, or none)", 2)
    try:
        set_quotas(path, tenant, changes)
    except (ConfigError, OSError, ValueError) as exc:
        fail(str(exc), 2)
    shown = ", ".join(f"{k.split('_')[0]} {v or 'none'}" for k, v in changes.items())
    click.echo(f"tierkv: tenant {tenant!r} in {path}: {shown}", err=True)


@keys.command("list")
@click.option("--file", "path", required=True, help="The keys file.")
@click.option("--json", "as_json", is_flag=True, help="As JSON.")
def list_(path: str, as_json: bool) -> None:
    """Each tenant, how many keys it has and its quotas (never a salt or a key's hash)."""
    import json

    from tierkv.server.tenants import describe

    try:
        rows = describe(path)
    except (ConfigError, OSError, ValueError) as exc:
        fail(str(exc), 2)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        quotas = "  ".join(
            f"{k.split('_')[0]} {r[k]}" for k in ("disk_quota", "host_quota", "pin_quota") if r[k]
        )
        click.echo(
            f"{r['tenant']}  {r['keys']} key{'s' if r['keys'] != 1 else ''}"
            + (f"  {quotas}" if quotas else "")
        )


@keys.command("revoke")
@click.option("--file", "path", required=True, help="The keys file.")
def revoke(path: str) -> None:
    """Revoke the API key read from standard input (not an argument: every user sees those in ps), e.g.
    `printf %s "$KEY" | tierkv keys revoke --file keys.toml`. A running server refuses it within seconds."""
    from tierkv.server.tenants import revoke_key

    key = sys.stdin.read().strip()
    if not key:
        fail("give the key on standard input", 2)
    try:
        tenant = revoke_key(path, key)
    except (ConfigError, OSError, ValueError) as exc:
        fail(str(exc), 2)
    click.echo(f"tierkv: revoked a key of tenant {tenant!r} in {path}", err=True)
