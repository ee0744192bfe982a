"""The ``tierkv`` command: a click group whose commands live in one module per group, each imported only
when one of its commands runs (``tierkv --help`` imports them all, but none of them imports torch, the
server or a tokenizer at module level):

    tierkv.cli.store    stats, gc        the store on disk (safe while a server writes to it)
    tierkv.cli.archive  export, import   a store's records to an archive and back (the same)
    tierkv.cli.serve    serve, route     the OpenAI-compatible server and the prefix-aware router
    tierkv.cli.prompts  explain, lint    the prompt tools
    tierkv.cli.cache    prefetch, forget a running server's cache, prompt by prompt
    tierkv.cli.keys     keys ...         API keys and quotas of tenants, for serve --api-keys
    tierkv.cli.bench    bench            the benchmarks of ``tierkv.bench``

``python -m tierkv.cli`` and the ``tierkv`` console script (``tierkv.cli:main``) are the same command.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

__all__ = ["COMMANDS", "main"]

# command name -> (module, attribute)
COMMANDS: dict[str, tuple[str, str]] = {
    "stats": ("tierkv.cli.store", "stats"),
    "gc": ("tierkv.cli.store", "gc"),
    "export": ("tierkv.cli.archive", "export"),
    "import": ("tierkv.cli.archive", "import_cmd"),
    "serve": ("tierkv.cli.serve", "serve"),
    "route": ("tierkv.cli.serve", "route"),
    "explain": ("tierkv.cli.prompts", "explain"),
    "lint": ("tierkv.cli.prompts", "lint_cmd"),
    "prefetch": ("tierkv.cli.cache", "prefetch"),
    "forget": ("tierkv.cli.cache", "forget"),
    "keys": ("tierkv.cli.keys", "keys"),
    "bench": ("tierkv.cli.bench", "bench"),
}


class _LazyGroup(click.Group):
    """A group that imports a command's module only when the command is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierkv")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM inference."""
    # Progress bars (a model's conversion, its loading) written to a log rather than a terminal are
    # carriage-return updates that fill it: off there unless asked for. tqdm reads TQDM_* when first
    # imported, after this (no command imports it at module level); servers the bench starts inherit it.
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
