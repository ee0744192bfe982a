"""The cache routes: ``POST /v1/cache/prefetch`` and ``DELETE /v1/cache``, for a prompt or a chat.

A prefetch brings the prompt's cached prefix from disk (or the remote tier) into the host tier, computing
nothing, so that the request that follows restores it from memory; a deletion removes the prompt's
blocks from every tier (only those no other stored prompt extends, unless ``shared`` is true). Both run
off the event loop and off the model thread: store work only. A client reaches only its own tenant's
blocks (its API key's tenant, then its ``cache_salt``), and only prompts it can name.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from jinja2 import TemplateError, TemplateSyntaxError
from pydantic import BaseModel, ConfigDict, Field

from tierkv.errors import ConfigError
from tierkv.prompts import PromptError, encode_text, render_chat
from tierkv.server.engine import ClientError
from tierkv.server.responses import JSON, error
from tierkv.server.schemas import ChatMessage
from tierkv.server.state import Server

__all__ = ["CacheRequest", "add_cache_routes"]


class CacheRequest(BaseModel):
    """A prompt (text or token ids) or a chat's messages, rendered as the completion routes render them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    cache_salt: str | None = Field(default=None, max_length=256)
    shared: bool = False  # DELETE only: also the blocks other stored prompts extend


def add_cache_routes(app: FastAPI, server: Server) -> None:
    def token_ids(req: CacheRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise ClientError("give one of prompt or messages", "prompt")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                return render_chat(server.cm.tokenizer, messages)
            except TemplateSyntaxError:  # the model's template is broken: the server's fault (500)
                raise
            except TemplateError as exc:  # the template refuses these messages: the request's fault
                raise ClientError(
                    f"messages: the model's chat template does not accept them: {exc}", "messages"
                ) from None
        if isinstance(req.prompt, list):
            vocab = server.vocab_size
            if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
                raise ClientError(
                    f"prompt: token ids must be a non-empty list of ids from 0 to {vocab - 1}", "prompt"
                )
            return list(req.prompt)
        if not req.prompt:
            raise ClientError("prompt must not be empty", "prompt")
        return encode_text(server.cm.tokenizer, req.prompt)

    async def run(req: CacheRequest, request: Request, work: Any) -> Response:
        salt = server.request_salt(request.headers.get("authorization"), req.cache_salt)
        if not isinstance(salt, str):  # 401 or 400
            return salt
        store = server.store
        if store is None or not server.engine.use_cache:
            return error(409, "this server runs without a cache", code="no_cache")
        try:
            return JSON(await asyncio.to_thread(lambda: work(store, token_ids(req), salt)))
        except (ClientError, PromptError, ConfigError) as exc:
            return error(400, str(exc), param=getattr(exc, "param", None))

    @app.post("/v1/cache/prefetch")
    async def prefetch(req: CacheRequest, request: Request) -> Response:
        def work(store: Any, ids: list[int], salt: str) -> dict[str, Any]:
            ns = server.cm.namespace(salt)
            restorable = (len(ids) - 1) // ns.block_tokens  # a request computes its last token itself
            before, after = store.prefetch(ns, ids[: restorable * ns.block_tokens])
            return {
                "object": "cache.prefetch",
                "prompt_tokens": len(ids),
                "cached_tokens": after.num_tokens,  # what the next request with this prompt restores
                "cached_tokens_by_tier": after.by_tier,  # where they are now
                "before_by_tier": before.by_tier,  # where they were
            }

        return await run(req, request, work)

    @app.delete("/v1/cache")
    async def forget(req: CacheRequest, request: Request) -> Response:
        def work(store: Any, ids: list[int], salt: str) -> dict[str, Any]:
            ns = server.cm.namespace(salt)
            gone = store.forget(ns, ids, shared=req.shared)
            return {
                "object": "cache.deletion",
                "prompt_tokens": len(ids),
                "blocks": gone.blocks,
                "removed_blocks": gone.removed,
                "removed_tokens": gone.removed * ns.block_tokens,
                "kept_shared_blocks": gone.kept_shared,
                # tierkv serve's own engine keeps no KV of its own between requests: nothing else to reset
                "engine_prefix_cache": "none",
            }

        return await run(req, request, work)
