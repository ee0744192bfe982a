"""The model executor: one thread runs the model, a bounded number of requests may wait for it.

The HTTP layer never runs model or store work on the event loop: ``Engine.stream`` runs a request on the
executor thread and hands its events to the loop through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierkv.worker import CachedModel, StreamEvent

log = logging.getLogger("tierkv.server")

PLAIN_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # per message; then "<|assistant|>\n" opens the reply
PLAIN_CHAT_GENERATION_PROMPT = "<|assistant|>\n"


class Busy(Exception):
    """The request queue is full: the client should retry later (HTTP 503)."""


class ClientError(Exception):
    """A request the model cannot serve as asked (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def encode_text(tokenizer: Any, text: str, special: bool = True, param: str = "prompt") -> list[int]:
    from tierkv.default_model import ByteTokenizer

    try:
        if isinstance(tokenizer, ByteTokenizer):
            return tokenizer.encode(text, add_bos=special)
        text.encode("utf-8")  # JSON may carry lone surrogates (\ud800): no tokenizer takes them
        return list(tokenizer.encode(text, add_special_tokens=special))
    except UnicodeEncodeError as exc:
        raise ClientError(f"{param}: the text is not valid Unicode ({exc.reason} at character {exc.start})",
                          param) from None


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat: the tokenizer's own chat template when it has one, else the plain template.

    The plain template renders each message as ``<|role|>\\ncontent\\n`` and ends with ``<|assistant|>\\n``;
    appending a message never changes how the earlier ones render, so a conversation's history is a
    token-exact prefix of its next turn (and hits the cache).
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return encode_text(tokenizer, text, special=False, param="messages")
    text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages) + PLAIN_CHAT_GENERATION_PROMPT
    return encode_text(tokenizer, text, param="messages")


_END = object()


class Engine:
    def __init__(self, cm: CachedModel, *, max_queue: int, max_context: int, use_cache: bool) -> None:
        self.cm = cm
        self.max_queue = max_queue
        self.max_context = max_context
        self.use_cache = use_cache
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-model")
        self._lock = threading.Lock()
        self.queued = 0  # waiting or running

    def _admit(self) -> None:
        with self._lock:
            if self.queued >= self.max_queue:
                raise Busy(f"{self.queued} requests in flight, the limit is {self.max_queue}")
            self.queued += 1

    def _leave(self) -> None:
        with self._lock:
            self.queued -= 1

    def check_length(self, prompt_tokens: int, max_tokens: int, param: str = "messages") -> None:
        if prompt_tokens + max_tokens > self.max_context:
            raise ClientError(
                f"this model's maximum context length is {self.max_context} tokens; the request asks for "
                f"{prompt_tokens} prompt tokens and {max_tokens} completion tokens", param,
                "context_length_exceeded")

    async def stream(self, make: Callable[[], Iterator[StreamEvent]]) -> AsyncIterator[StreamEvent]:
        """Run ``make()`` (tokenize, then ``cm.stream``) on the model thread; yield its events here.

        Raises ``Busy`` at once when the queue is full, and whatever ``make`` raised (``ClientError``).
        Closing the iterator early (a client that went away) stops generation after the current token.
        """
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancelled = threading.Event()

        def work() -> None:
            try:
                if cancelled.is_set():
                    return
                for event in make():
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if cancelled.is_set():
                        break
            except BaseException as exc:  # handed to the request; the model thread lives on
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                self._leave()
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        try:
            self._executor.submit(work)
        except RuntimeError:  # shutting down
            self._leave()
            raise Busy("the server is shutting down") from None
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()

    def close(self) -> None:
        """Finish the running request, then stop (queued ones still run: they were accepted)."""
        t0 = time.perf_counter()
        self._executor.shutdown(wait=True)
        log.info("model executor stopped in %.1f s", time.perf_counter() - t0)
