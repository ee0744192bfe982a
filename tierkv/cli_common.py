"""What the ``tierkv`` command's modules share: how a command reports an error and exits."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

__all__ = ["fail"]


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"tierkv: error: {message}", err=True)
    sys.exit(code)
