"""The admin API (``/admin/*``): the store's report, recent misses, gc and purge, behind a bearer token.

Disabled (404) unless the server was started with an admin token; 409 when the store has no disk tier.
Everything goes through the store's public maintenance calls (``report``, ``gc``, ``purge``).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import FastAPI, Request

from tierkv.errors import ConfigError
from tierkv.server.responses import JSON, error, json_object
from tierkv.server.state import Server
from tierkv.store import TieredStore
from tierkv.units import parse_duration, parse_size

GC_OPTIONS = frozenset({"ttl", "max_age", "budget", "namespace", "all", "check", "compact", "dry_run"})


def gc_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``store.gc``'s keyword options from a ``POST /admin/gc`` body (durations and sizes as text or numbers).

    ConfigError on an unknown option or a value that does not parse.
    """
    if unknown := set(opts) - GC_OPTIONS:
        raise ConfigError(f"unknown gc option(s): {', '.join(sorted(unknown))}")
    return dict(
        ttl_s=parse_duration(opts["ttl"]) if opts.get("ttl") is not None else None,
        max_age_s=parse_duration(opts["max_age"]) if opts.get("max_age") is not None else None,
        budget_nbytes=parse_size(opts["budget"]) if opts.get("budget") is not None else None,
        namespace=opts.get("namespace"),
        purge_all=bool(opts.get("all")),
        check=bool(opts.get("check")),
        compact=bool(opts.get("compact")),
        dry_run=bool(opts.get("dry_run")),
    )


def add_admin_routes(app: FastAPI, server: Server) -> None:
    def admitted(request: Request) -> TieredStore | JSON:
        """The store, if the request may administer it; else the error to answer."""
        token = server.config.admin_token
        if not token:
            return error(
                404, "the admin API is disabled (start the server with --admin-token)", "not_found_error"
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

    @app.post("/admin/gc")
    async def admin_gc(request: Request) -> JSON:
        if isinstance(got := await admitted_with_body(request), JSON):
            return got
        store, opts = got
        try:
            return JSON(await asyncio.to_thread(store.gc, **gc_options(opts)))
        except ConfigError as exc:
            return error(400, str(exc))

    @app.post("/admin/purge")
    async def admin_purge(request: Request) -> JSON:
        if isinstance(got := await admitted_with_body(request), JSON):
            return got
        store, opts = got
        if bool(opts.get("namespace")) == bool(opts.get("all")):
            return error(400, "give exactly one of namespace (a digest prefix) or all: true")
        try:
            out = await asyncio.to_thread(store.purge, opts.get("namespace"), purge_all=bool(opts.get("all")))
        except ConfigError as exc:
            return error(400, str(exc))
        return JSON(out)


__all__ = ["GC_OPTIONS", "add_admin_routes", "gc_options"]
