"""The admin API (``/admin/*``): the store's report, recent misses, gc and purge, and the export stream
another node imports from, behind a bearer token.

Disabled (404) unless the server was started with an admin token; 409 when the store has no disk tier.
Everything goes through the store's public maintenance calls (``report``, ``gc``, ``purge``,
``export_chunks``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from tierkv.errors import ConfigError
from tierkv.server.responses import JSON, error, json_object
from tierkv.server.state import Server
from tierkv.store import TieredStore
from tierkv.units import parse_duration, parse_size

log = logging.getLogger("tierkv.server")

GC_OPTIONS = frozenset({"ttl", "max_age", "budget", "namespace", "all", "check", "compact", "dry_run"})


class FieldError(ConfigError):
    """A field of an admin request's body of the wrong type or out of range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def gc_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``store.gc``'s keyword options from a ``POST /admin/gc`` body (durations and sizes as text or numbers).

    ConfigError on an unknown option; FieldError on a value of the wrong type, out of range or that does
    not parse.
    """
    if unknown := set(opts) - GC_OPTIONS:
        raise ConfigError(f"unknown gc option(s): {', '.join(sorted(unknown))}")
    return dict(
        ttl_s=_duration(opts, "ttl"),
        max_age_s=_duration(opts, "max_age"),
        budget_nbytes=_size(opts, "budget"),
        namespace=_namespace(opts),
        purge_all=_flag(opts, "all"),
        check=_flag(opts, "check"),
        compact=_flag(opts, "compact"),
        dry_run=_flag(opts, "dry_run"),
    )


def _flag(opts: dict[str, Any], name: str) -> bool:
    value = opts.get(name, False)
    if not isinstance(value, bool):  # "false" is a truthy string: it would purge everything
        raise FieldError(name, f"must be a JSON boolean (true or false), got {json.dumps(value)}")
    return value


def _duration(opts: dict[str, Any], name: str) -> float | None:
    value = opts.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FieldError(name, f"must be seconds or a duration like 24h, got {json.dumps(value)}")
    try:
        seconds = parse_duration(value)
    except ConfigError as exc:
        raise FieldError(name, str(exc)) from None
    except OverflowError:  # an integer past float's range: JSON integers have no bound
        seconds = math.inf
    if not 0 <= seconds < math.inf:  # also NaN, which json.loads accepts
        raise FieldError(name, f"must be a finite duration of 0 or more, got {value!r}")
    return seconds


def _size(opts: dict[str, Any], name: str) -> int | None:
    value = opts.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FieldError(name, f"must be bytes (an integer) or a size like 20GiB, got {json.dumps(value)}")
    try:
        nbytes = parse_size(value)
    except ConfigError as exc:
        raise FieldError(name, str(exc)) from None
    if nbytes < 0:
        raise FieldError(name, f"must be 0 or more bytes, got {value!r}")
    return nbytes


def _namespace(opts: dict[str, Any]) -> str | None:
    value = opts.get("namespace")
    if value is not None and not (isinstance(value, str) and value):
        raise FieldError(
            "namespace", f"must be a namespace digest or a prefix of it (text), got {json.dumps(value)}"
        )
    return value


EXPORT_STALL_S = 60.0  # an export whose client read nothing for this long no longer holds the slot


@dataclasses.dataclass
class _Exports:
    """The exports streaming now: one at a time, each reads the whole store beside the model; a client
    that stopped reading frees the slot after EXPORT_STALL_S (its stream ends when it disconnects)."""

    running: int = 0
    drawn_at: float = 0.0  # when the newest one last had a chunk taken by its client

    def busy(self) -> bool:
        return self.running > 0 and time.monotonic() - self.drawn_at < EXPORT_STALL_S


class _Export:
    """One export's stream: its chunks drawn on a thread of its own (the reads, native, release the GIL),
    so the event loop keeps answering meanwhile. When the client goes away the generator is closed on that
    same thread, after the draw in flight (a generator cannot be closed while it runs), and only then is
    the export counted as done (it was counted by the caller). A response that never started is counted
    done by ``finish``, its background task."""

    def __init__(self, chunks: Iterator[bytes | memoryview], exports: _Exports, who: str) -> None:
        self.chunks = chunks
        self.exports = exports
        self.who = who
        self.started = False
        self.nbytes = 0

    async def stream(self) -> AsyncIterator[bytes | memoryview]:
        self.started = True
        pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-export")
        done = False
        try:
            while (chunk := await asyncio.wrap_future(pool.submit(next, self.chunks, None))) is not None:
                self.exports.drawn_at = time.monotonic()
                self.nbytes += len(chunk)
                yield chunk  # a view into its batch's own buffer, never reused
            done = True
        finally:
            log.info(
                "export to %s %s after %.1f MiB",
                self.who,
                "done" if done else "cut off (the client went away)",
                self.nbytes / 2**20,
            )
            if done:  # the generator has returned: nothing to close, and the slot is free before the
                self.exports.running -= 1  # response's last byte (a client's next export must not get 409)
            else:
                pool.submit(self._close)
            pool.shutdown(wait=False)

    def _close(self) -> None:
        try:
            getattr(self.chunks, "close", lambda: None)()
        finally:
            self.exports.running -= 1

    async def finish(self) -> None:
        if not self.started:
            self.started = True
            self._close()


def add_admin_routes(app: FastAPI, server: Server) -> None:
    def admitted(request: Request) -> TieredStore | JSON:
        """The store, if the request may administer it; else the error to answer."""
        token = server.config.admin_token
        if not token:
            return error(
                404,
                "the admin API is disabled (start the server with --admin-token-file or TIERKV_ADMIN_TOKEN)",
                "not_found_error",
            )
        given = request.headers.get("authorization", "").encode("latin-1")  # as the bytes were sent
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):  # constant time: no timing oracle
            return error(401, "missing or wrong admin token", "authentication_error")
        if server.store is None or not server.store.durable:
            return error(409, "this server runs without a disk tier (--no-cache)")
        return server.store

    async def admitted_with_body(request: Request) -> tuple[TieredStore, dict[str, Any]] | JSON:
        """The store and the request's JSON object, if the request may administer it; else the error."""
        store = admitted(request)
        if isinstance(store, JSON):
            return store
        opts = await json_object(request)
        return opts if isinstance(opts, JSON) else (store, opts)

    @app.get("/admin/stats")
    async def admin_stats(request: Request) -> JSON:
        """``tierkv stats``' report, plus what only this process knows (memory tiers, staging, hit counters)."""
        store = admitted(request)
        if isinstance(store, JSON):
            return store
        return JSON(await asyncio.to_thread(store.report))

    @app.get("/admin/misses")
    async def admin_misses(request: Request) -> JSON:
        """Recent requests whose hit ended early, with where they diverged; hit rate per template."""
        store = admitted(request)
        if isinstance(store, JSON):
            return store
        return JSON(server.misses.report())

    exports = _Exports()

    @app.get("/admin/export", response_model=None)
    async def admin_export(request: Request) -> JSON | StreamingResponse:
        """The store's verified records as an archive (``tierkv import URL --token`` reads it), every
        record signed with a key derived from the admin token; query parameters ``namespace`` and
        ``model`` (repeatable) select, as ``tierkv export``'s options do. 409 while another runs."""
        store = admitted(request)
        if isinstance(store, JSON):
            return store
        if unknown := set(request.query_params) - {"namespace", "model"}:
            return error(400, f"unknown export parameter(s): {', '.join(sorted(unknown))}")
        if exports.busy():
            return error(409, "an export is already running on this server; try again when it is done")
        exports.running += 1  # at once: the selection below takes a while, and a second request must see it
        exports.drawn_at = time.monotonic()
        try:
            chunks = await asyncio.to_thread(
                store.export_chunks,
                request.query_params.getlist("namespace"),
                request.query_params.getlist("model"),
                str(server.config.admin_token).encode(),
            )
        except BaseException as exc:
            exports.running -= 1
            if isinstance(exc, ConfigError):
                return error(400, str(exc), param="namespace")
            raise
        who = request.client.host if request.client else "?"
        log.info("export to %s started", who)
        export = _Export(chunks, exports, who)
        return StreamingResponse(
            export.stream(), media_type="application/octet-stream", background=BackgroundTask(export.finish)
        )

    @app.post("/admin/gc")
    async def admin_gc(request: Request) -> JSON:
        if isinstance(got := await admitted_with_body(request), JSON):
            return got
        store, opts = got
        try:
            return JSON(await asyncio.to_thread(store.gc, **gc_options(opts)))
        except ConfigError as exc:
            return error(400, str(exc), param=getattr(exc, "param", None))

    @app.post("/admin/purge")
    async def admin_purge(request: Request) -> JSON:
        if isinstance(got := await admitted_with_body(request), JSON):
            return got
        store, opts = got
        try:
            if unknown := set(opts) - {"namespace", "all"}:
                raise ConfigError(f"unknown purge option(s): {', '.join(sorted(unknown))}")
            namespace, purge_all = _namespace(opts), _flag(opts, "all")
            if (namespace is None) == (not purge_all):
                raise ConfigError("give exactly one of namespace (a digest prefix) or all: true")
            out = await asyncio.to_thread(store.purge, namespace, purge_all=purge_all)
        except ConfigError as exc:
            return error(400, str(exc), param=getattr(exc, "param", None))
        return JSON(out)


__all__ = ["GC_OPTIONS", "FieldError", "add_admin_routes", "gc_options"]
