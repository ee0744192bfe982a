"""``tierkv export`` and ``tierkv import``: a store's verified records to one archive and back, from a file,
a pipe or a running server's ``GET /admin/export``.

Exit status, for scripts: 0 everything asked for was done; 1 done, but something was left out (a corrupt
record in the store, a damaged or incomplete archive, a record the disk did not take); 2 nothing was done
(no store, not an archive, a bad option).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import click

from tierkv.cli.common import cache_dir_option, fail, open_disk
from tierkv.errors import ConfigError
from tierkv.units import format_size

__all__ = ["export", "import_cmd"]

IMPORT_QUEUE_NBYTES = 256 << 20  # records verified and waiting for the writer: bounds the importer's memory

secret_file_option = click.option(
    "--secret-file",
    type=click.Path(dir_okay=False),
    envvar="TIERKV_ARCHIVE_SECRET_FILE",
    help="A file whose bytes (one line, its line end stripped) sign every record (export) or must have "
    "signed every record (import); or TIERKV_ARCHIVE_SECRET_FILE. A server's export is signed with its "
    "admin token: --token verifies it.",
)


def _secret(secret_file: str | None, token: str | None = None) -> bytes | None:
    """What signs the archive: the secret file's bytes, else the source server's admin token (its
    /admin/export signs with it, whether read from the URL or saved to a file first)."""
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            fail(f"--secret-file: {exc}", 2)
        if not secret:
            fail(f"--secret-file: {secret_file} is empty", 2)
        return secret
    return token.encode() if token else None


@click.command()
@cache_dir_option
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    help="Only this namespace (a digest, or a unique prefix of it; `tierkv stats` lists them). Repeatable.",
)
@click.option("--model", "models", multiple=True, help="Only namespaces of this model id. Repeatable.")
@secret_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (on stderr with `-`).")
@click.argument("archive")
def export(
    cache_dir: str,
    namespaces: tuple[str, ...],
    models: tuple[str, ...],
    secret_file: str | None,
    as_json: bool,
    archive: str,
) -> None:
    """Write the store's verified records to ARCHIVE (`-`: standard output), most recently used first.

    Safe while a server uses the store. A file appears under its name only once complete and synced."""
    from tierkv.archive.export import archive_chunks, select
    from tierkv.archive.streams import archive_file

    to_stdout = archive == "-"
    if to_stdout and sys.stdout.isatty():
        fail("the archive is binary: redirect standard output to a file or a pipe", 2)
    with open_disk(cache_dir, missing_code=2) as disk:
        try:
            sel = select(disk, namespaces, models)
        except ConfigError as exc:
            fail(str(exc), 2)
        show = sys.stderr.isatty()

        def progress(blocks: int, nbytes: int) -> None:
            if show:
                click.echo(
                    f"\rexport: {blocks} of {len(sel.entries)} blocks ({format_size(nbytes)})",
                    nl=False,
                    err=True,
                )

        chunks = archive_chunks(disk, sel, progress, _secret(secret_file))
        try:
            with archive_file(archive) as out:
                while True:
                    try:
                        out.write(next(chunks))
                    except StopIteration as stop:
                        report = stop.value
                        break
        except BrokenPipeError:
            # The reader went away: the archive it got is incomplete, and its importer will say so.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            fail(f"{archive}: the reader closed the pipe before the archive was whole", 1)
        except OSError as exc:
            fail(f"cannot write {archive}: {exc.strerror or exc}", 2)
        if show:
            click.echo("", err=True)
    out_json = report.as_dict()
    if as_json:
        click.echo(json.dumps(out_json), err=to_stdout)
    else:
        click.echo(
            f"exported {report.blocks} blocks ({format_size(report.record_nbytes)}) of "
            f"{len(report.namespaces)} namespace(s) into {archive if archive != '-' else 'standard output'} "
            f"({format_size(report.archive_nbytes)}{', signed' if secret_file else ''})"
            + (f"; {report.vanished} removed from the store meanwhile" if report.vanished else "")
            + (f"; {report.no_spec} left out, their namespace's spec missing" if report.no_spec else ""),
            err=to_stdout,
        )
    if report.corrupt:
        fail(
            f"{report.corrupt} corrupt record(s) left out: run `tierkv gc --check` and check the disk",
            1,
            "warning",
        )


@click.command("import")
@cache_dir_option
@click.option(
    "--token",
    envvar="TIERKV_EXPORT_TOKEN",
    help="The source server's admin token, when ARCHIVE is its /admin/export URL (or TIERKV_EXPORT_TOKEN: "
    "not TIERKV_ADMIN_TOKEN, which is your own server's). It also verifies the records' signatures.",
)
@secret_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.argument("archive")
def import_cmd(
    cache_dir: str, token: str | None, secret_file: str | None, as_json: bool, archive: str
) -> None:
    """Verify and import the records of ARCHIVE (a file, `-` for standard input, or a server's
    http://HOST:PORT/admin/export) that the store lacks and has room for.

    Safe while a server uses the store; run it again after an interruption and it resumes (what was
    imported is skipped). A damaged record is refused by itself and counted; nothing is evicted."""
    from tierkv.archive.frames import ArchiveError, FrameReader
    from tierkv.archive.load import ImportReport, import_archive, open_archive

    show = sys.stderr.isatty() and not as_json

    def progress(r: ImportReport) -> None:
        if show:
            of = f" of {r.planned}" if r.planned else ""
            click.echo(
                f"\rimport: {r.seen}{of} records, {r.imported} imported ({format_size(r.imported_nbytes)})",
                nl=False,
                err=True,
            )

    if token and secret_file:
        fail("give --token (a server's export) or --secret-file (an archive signed with it), not both", 2)
    secret = _secret(secret_file, token)
    created = not (Path(cache_dir) / "index" / "data.mdb").exists()
    stop = threading.Event()
    with _archive_in(archive, token) as src, _ctrl_c_sets(stop):
        reader = FrameReader(src)
        try:
            # Before the store is opened: what is not an archive, or not signed as the secret says, creates
            # nothing.
            opened = open_archive(reader, secret)
        except ArchiveError as exc:
            reader.close()
            fail(f"{archive}: {exc}", 2)
        try:
            with open_disk(cache_dir, writer=True, queue_nbytes=IMPORT_QUEUE_NBYTES) as disk:
                if created:
                    click.echo(
                        f"tierkv: a new store at {cache_dir}: no budget and no TTL until a server opens it "
                        "with --disk-budget / --ttl",
                        err=True,
                    )
                try:
                    report = import_archive(disk, opened, progress, secret=secret, stop=stop)
                except ArchiveError as exc:
                    fail(f"{archive}: {exc}", 2)
                except OSError as exc:
                    fail(f"import stopped: {exc}; run it again to resume", 1)
        finally:
            opened.reader.close()  # its read-ahead thread, on every way out
        if show:
            click.echo("", err=True)
        code, message = _import_outcome(report, as_json)
        if opened.reader.abandoned:
            # The source stalled and its read-ahead thread is blocked in it: closing the stream would wait
            # for that thread (for ever, if the source never ends). The store is closed and synced: leave.
            if message:
                click.echo(f"tierkv: {message}", err=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if message:
        fail(message, code, "warning" if code == 1 else "error")


def _import_outcome(report: Any, as_json: bool) -> tuple[int, str]:
    """Print the import's report; its exit status and the line that explains it (empty when all went)."""
    out: dict[str, Any] = report.as_dict()
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(
            f"imported {report.imported} blocks ({format_size(report.imported_nbytes)}); already there "
            f"{report.present}, expired {report.expired}, no room {report.no_room}, refused {report.refused}"
            + (f", unreachable {report.unreachable}" if report.unreachable else "")
            + (f", not written {report.not_written}" if report.not_written else "")
            + (f"; {report.damaged_regions} damaged region(s) skipped" if report.damaged_regions else "")
            + ("; every record's signature checked" if report.signed else "; unsigned")
        )
    if report.interrupted:
        return 130, "interrupted: what was read before is imported; run it again to resume"
    problems = []
    if report.no_room:
        problems.append(
            f"{report.no_room} record(s) did not fit the store's budget (the most recently used came first; "
            "nothing was evicted for them)"
        )
    if report.refused or report.damaged_regions:
        problems.append("the archive is damaged: its bad records were refused, the rest imported")
    if report.stream_error:
        problems.append(f"reading the archive failed: {report.stream_error}")
    if not report.complete:
        problems.append("the archive is incomplete (it ends before its end frame, or lacks records)")
    if report.digest_ok is False:
        problems.append("the archive's records differ from what its end frame lists")
    if report.not_written:
        problems.append("the disk tier did not take every record (full, or failing): see the server's log")
    if not problems:
        return 0, ""
    resume = not report.complete or report.refused or report.damaged_regions or report.not_written
    return 1, "; ".join(problems) + ("; run it again with a whole archive to resume" if resume else "")


@contextlib.contextmanager
def _ctrl_c_sets(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C sets ``stop`` instead of raising wherever the import happens to be (between a queue's two
    steps, say): the import stops reading at a frame's edge and writes what it queued."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _archive_in(archive: str, token: str | None) -> Iterator[BinaryIO]:
    if archive == "-":
        yield sys.stdin.buffer
        return
    if archive.startswith(("http://", "https://")):
        req = urllib.request.Request(archive, headers={"Authorization": f"Bearer {token}"} if token else {})
        # No redirects: urllib would send the token on to wherever one points.
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            resp = opener.open(req, timeout=600)  # per read: the source orders its records first
        except urllib.error.HTTPError as exc:
            hint = (
                " (give the source server's admin token: --token or TIERKV_EXPORT_TOKEN)"
                if exc.code == 401
                else ""
            )
            fail(f"{archive}: HTTP {exc.code}: {_error_message(exc)}{hint}", 2)
        except urllib.error.URLError as exc:
            fail(f"cannot reach {archive}: {exc.reason}", 2)
        except OSError as exc:
            fail(f"cannot reach {archive}: {exc}", 2)
        with resp:
            yield resp
        return
    try:
        f = open(archive, "rb")
    except OSError as exc:
        fail(f"cannot read {archive}: {exc}", 2)
    with f:
        yield f


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(newurl, code, f"redirected to {newurl} (not followed)", headers, fp)


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The message of a tierkv server's JSON error body, else the body's start."""
    raw = exc.read(2000) if exc.fp is not None else b""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:500].decode(errors="replace") or str(exc.reason)
