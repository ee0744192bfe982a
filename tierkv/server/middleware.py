"""The app's outermost middleware: counts every request by route, and answers unexpected errors with a 500."""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierkv.server.metrics import Metrics
from tierkv.server.responses import error

log = logging.getLogger("tierkv.server")


class CountAndCatch:
    """Counts each request by its route's template (``unmatched`` when none matched, so probes of random
    paths add no series), and answers an unexpected error with a 500 after which the connection lives on.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the kept-alive
    connection: the client's next request on it fails too. An error after the response has started
    (a broken stream) still propagates: that response cannot be completed, so its connection must end.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = False

        async def send_(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except asyncio.CancelledError:  # the end of a drain, or a client gone: not a server error
            if not started:
                status = 499  # as nginx counts a request its client closed
            raise
        except Exception:
            if started:
                raise
            log.exception("internal error on %s", scope.get("path"))
            await error(500, "internal server error", "server_error")(scope, receive, send_)
        finally:
            route = getattr(scope.get("route"), "path", None)  # set by the router once a route matched
            self.metrics.requests.labels(route or "unmatched", str(status)).inc()


__all__ = ["CountAndCatch"]
