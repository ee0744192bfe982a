"""``tierkv prefetch`` and ``tierkv forget``: a running server's cache, prompt by prompt, from the shell.

Both send each prompt (a file: an OpenAI request body, chat or completion, or plain text; a directory: its
files) to the server's cache routes (``POST /v1/cache/prefetch``, ``DELETE /v1/cache``): the server holds
the host tier and the tokenizer, and a deletion must reach its memory too, not only the directory.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from tierkv.cli.common import fail

__all__ = ["forget", "prefetch"]

DEFAULT_SERVER = "http://127.0.0.1:8000"
TIMEOUT_S = 600.0  # a prefetch of a long prompt from a cold disk takes a while


def _files(paths: tuple[str, ...]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            out.append(p)
        else:
            fail(f"{p}: no such file or directory", 2)
    if not out:
        fail("no prompt files given", 2)
    return out


def _body(path: Path, salt: str | None) -> dict[str, Any]:
    """The cache route's body for one prompt file."""
    text = path.read_text(encoding="utf-8")
    try:
        req = json.loads(text)
    except ValueError:
        req = None
    if isinstance(req, dict) and ("messages" in req or "prompt" in req):
        body = {k: req[k] for k in ("messages", "prompt", "cache_salt") if k in req}
    else:
        body = {"prompt": text}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _send(server: str, method: str, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        server.rstrip("/") + route,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {"error": {"message": e.reason}}
    except (urllib.error.URLError, OSError) as e:
        fail(f"cannot reach {server}: {getattr(e, 'reason', e)}", 1)


def _tiers(by_tier: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {tier}" for tier, n in by_tier.items() if n) or "none"


_server = click.option(
    "--server",
    envvar="TIERKV_SERVER",
    default=DEFAULT_SERVER,
    show_default=True,
    help="The tierkv serve to ask.",
)
_salt = click.option("--cache-salt", help="The tenant's cache_salt (else each file's own, else none).")


def _each(
    paths: tuple[str, ...],
    send: Callable[[Path], tuple[int, dict[str, Any]]],
    line: Callable[[dict[str, Any]], str],
) -> NoReturn:
    """Send each prompt file; print ``line(answer)`` for each, or its error. Exit 1 if any failed."""
    failed = 0
    for path in _files(paths):
        code, out = send(path)
        if code != 200:
            failed += 1
            click.echo(f"{path}: {code} {out.get('error', {}).get('message', out)}", err=True)
        else:
            click.echo(f"{path}: {line(out)}")
    sys.exit(1 if failed else 0)


@click.command()
@_server
@_salt
@click.argument("paths", nargs=-1, required=True)
def prefetch(server: str, cache_salt: str | None, paths: tuple[str, ...]) -> None:
    """Bring each prompt's cached prefix from disk into the server's memory, computing nothing.

    PATHS: request bodies (chat or completion JSON) or text files, or directories of them."""
    _each(
        paths,
        lambda path: _send(server, "POST", "/v1/cache/prefetch", _body(path, cache_salt)),
        lambda out: (
            f"{out['cached_tokens']:,} of {out['prompt_tokens']:,} tokens cached, now in "
            f"{_tiers(out['cached_tokens_by_tier'])} (were in {_tiers(out['before_by_tier'])})"
        ),
    )


@click.command()
@_server
@_salt
@click.option(
    "--shared", is_flag=True, help="Also the blocks other cached prompts extend (a shared system prompt)."
)
@click.argument("paths", nargs=-1, required=True)
def forget(server: str, cache_salt: str | None, shared: bool, paths: tuple[str, ...]) -> None:
    """Remove each prompt's blocks from every tier of the server's cache (memory and disk).

    Only the blocks no other cached prompt extends, unless --shared. PATHS: request bodies (chat or
    completion JSON) or text files, or directories of them."""
    _each(
        paths,
        lambda path: _send(server, "DELETE", "/v1/cache", {**_body(path, cache_salt), "shared": shared}),
        lambda out: (
            f"removed {out['removed_blocks']} of {out['blocks']} blocks"
            + (
                f", kept {out['kept_shared_blocks']} shared with other prompts"
                if out["kept_shared_blocks"]
                else ""
            )
        ),
    )
