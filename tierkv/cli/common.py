"""What the ``tierkv`` command's modules share: how a command reports an error and exits, the store's
``--cache-dir`` option, option values parsed with one clear error."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click
import lmdb

from tierkv.errors import ConfigError, TierKVError
from tierkv.paths import DEFAULT_CACHE_DIR_HELP, default_cache_dir

__all__ = ["cache_dir_option", "fail", "open_disk", "parsed"]


def fail(message: str, code: int, label: str = "error") -> NoReturn:
    click.echo(f"tierkv: {label}: {message}", err=True)
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
    # (a shell leaves ~ as it is in --cache-dir=~/kv: the server's checks and its store expand it)
    callback=lambda ctx, param, value: os.path.expanduser(value) if isinstance(value, str) else value,
)


@contextmanager
def open_disk(cache_dir: str, writer: bool = False, missing_code: int = 1, **options: Any) -> Iterator[Any]:
    """The store's disk tier, safe beside a server writing to it: without a writer thread (``stats``,
    ``export``, and ``gc``, whose sweeps take their own write transactions) or with one (``import``, which
    appends records as a save does, and may create the store)."""
    from tierkv.tiers.disk import DiskTier

    try:
        if Path(cache_dir).exists() and not Path(cache_dir).is_dir():  # a usage error, not a missing store
            fail(f"--cache-dir {cache_dir} is a file, not a store's directory", 2)
        if not writer and not (Path(cache_dir) / "index" / "data.mdb").exists():
            fail(
                f"no tierkv store at {cache_dir} yet (a server makes it as it starts: with --engine vllm, "
                "once vLLM's workers are up; elsewhere: set --cache-dir or TIERKV_CACHE_DIR)",
                missing_code,
            )
        disk = DiskTier(cache_dir, writer=writer, **options)
    except TierKVError as exc:  # another format version; permissions, read-only media, a lock file
        fail(str(exc), 2)
    except (OSError, lmdb.Error, ValueError) as exc:  # (ValueError: a damaged row read at open, say)
        fail(f"cannot open the store at {cache_dir}: {exc}", 2)
    try:
        yield disk
    except lmdb.Error as exc:  # the index failed under a command (damaged meanwhile, say): one line
        fail(f"reading the store at {cache_dir}: {exc}", 1)
    finally:
        disk.close()
