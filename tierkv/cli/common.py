"""What the ``tierkv`` command's modules share: how a command reports an error and exits, the store's
``--cache-dir`` option, option values parsed with one clear error."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from tierkv.errors import ConfigError
from tierkv.paths import DEFAULT_CACHE_DIR_HELP, default_cache_dir

__all__ = ["cache_dir_option", "fail", "parsed"]


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"tierkv: error: {message}", err=True)
    sys.exit(code)


def parsed(fn: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    """A click callback: ``fn(value)``, a ConfigError as one error line and exit 2."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return fn(value)
        except ConfigError as exc:
            fail(f"{param.opts[0]}: {exc}", 2)

    return callback


cache_dir_option = click.option(
    "--cache-dir",
    default=default_cache_dir,
    show_default=DEFAULT_CACHE_DIR_HELP,
    help="The store's directory.",
)
