"""``tierkv keys add`` and ``tierkv keys quota``: API keys for ``tierkv serve --api-keys FILE``, one tenant's cache space each."""

from __future__ import annotations

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
