"""``tierkv keys add``: API keys for ``tierkv serve --api-keys FILE``, one tenant's cache space each."""

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
