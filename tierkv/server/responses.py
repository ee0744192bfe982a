"""The HTTP layer's response shapes: JSON bodies, OpenAI-style errors, server-sent events, JSON request bodies."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tierkv.server.schemas import error_body


class JSON(Response):
    """JSON with non-ASCII escaped: generated text may hold escaped bytes (lone surrogates)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSON:
    """An OpenAI-style error body (``{"error": {...}}``) with ``status``."""
    return JSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def unauthorized(message: str) -> JSON:
    """401 as OpenAI answers a missing or wrong key."""
    return error(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode() + b"\n\n"


async def json_object(request: Request) -> dict[str, Any] | JSON:
    """The request's body as a JSON object (an empty body is ``{}``), or the 400 to answer instead."""
    raw = await request.body()
    try:
        obj = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return error(400, "the request body is not valid JSON", code="invalid_json")
    if not isinstance(obj, dict):
        return error(400, "the request body must be a JSON object")
    return obj


__all__ = ["JSON", "error", "json_object", "sse", "unauthorized"]
