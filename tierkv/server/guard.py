"""An ASGI guard that reads request bodies before the app sees them: bounded in size and in time, each
and all together.

A body over ``max_nbytes`` is a 413 (at once, when Content-Length says so); a body not received within
``timeout_s`` (a client that stalls or never finishes) is a 408; a JSON body that is not UTF-8 is a 400.
Bodies being received at once hold at most ``max_total_nbytes`` between them: past it a 503 with
Retry-After (a body's declared length is held from its first byte, a chunked one's as it arrives).
Without it a slow client would hold a connection and its memory for as long as it liked, and many
clients uploading the largest body at once would exhaust the memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_nbytes: int,
        timeout_s: float,
        max_total_nbytes: int,
        on_refusal: Callable[[Scope, int], None] | None = None,
    ) -> None:
        """``on_refusal(scope, status)`` is told of each request answered here (the app, which counts the
        others, never sees these)."""
        self.app = app
        self.max_nbytes = max_nbytes
        self.timeout_s = timeout_s
        self.max_total_nbytes = max_total_nbytes
        self.on_refusal = on_refusal
        self.receiving = 0  # bytes held by bodies being received now (one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return

        async def refuse(message: Message) -> None:
            if message["type"] == "http.response.start" and self.on_refusal is not None:
                self.on_refusal(scope, message["status"])
            await send(message)

        data = await self._receive(scope, receive, refuse)
        if data is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _receive(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None when it answered an error instead (or the client went away)."""
        headers = dict(scope.get("headers") or [])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            await _reply(send, 400, "bad Content-Length header")
            return None
        if declared > self.max_nbytes:
            await _reply(
                send, 413, f"request body of {declared} bytes is over the limit of {self.max_nbytes}"
            )
            return None
        held = 0  # of self.receiving, this body's share: given back once it is received

        def hold(nbytes: int) -> bool:
            nonlocal held
            if self.receiving + nbytes > self.max_total_nbytes:
                return False
            self.receiving += nbytes
            held += nbytes
            return True

        try:
            if not hold(declared):
                await self._busy(send)
                return None
            chunks: list[bytes] = []
            total = 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            while True:
                try:
                    message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    await _reply(send, 408, f"request body not received within {self.timeout_s:.0f} s")
                    return None
                if message["type"] == "http.disconnect":
                    return None
                body = message.get("body", b"")
                total += len(body)
                if total > self.max_nbytes:
                    await _reply(send, 413, f"request body is over the limit of {self.max_nbytes} bytes")
                    return None
                if total > held and not hold(total - held):  # chunked, or more than declared
                    await self._busy(send)
                    return None
                chunks.append(body)
                if not message.get("more_body"):
                    break
        finally:
            self.receiving -= held
        data = b"".join(chunks)
        if b"json" in headers.get(b"content-type", b"application/json"):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                await _reply(send, 400, f"the request body is not valid UTF-8 (byte {exc.start})")
                return None
        return data

    async def _busy(self, send: Send) -> None:
        await _reply(
            send,
            503,
            f"the server is receiving {self.receiving} bytes of request bodies, its limit is "
            f"{self.max_total_nbytes} (--max-body-total): retry later",
            "server_busy",
            [(b"retry-after", b"1")],
        )


async def _reply(
    send: Send,
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    error = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    body = json.dumps(error, separators=(",", ":")).encode()  # as the app's own JSON errors
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["BodyGuard"]
