"""The model executor: one thread runs the model, a bounded number of requests may wait for it.

The HTTP layer never runs model or store work on the event loop: ``Engine.stream`` runs a request on the
executor thread and hands its events to the loop through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# render_chat lives in tierkv.prompts; re-exported while tests/test_real_model.py imports it from here.
from tierkv.prompts import render_chat as render_chat
from tierkv.worker import CachedModel, StreamEvent

log = logging.getLogger("tierkv.server")


class Busy(Exception):
    """The request queue is full: the client should retry later (HTTP 503)."""


class ClientError(Exception):
    """A request the model cannot serve as asked (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


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
        self._closing = threading.Event()  # set by close: no request runs on, nor starts

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
                f"{prompt_tokens} prompt token{'s' if prompt_tokens != 1 else ''} and {max_tokens} completion "
                f"token{'s' if max_tokens != 1 else ''}",
                param,
                "context_length_exceeded",
            )

    async def stream(self, make: Callable[[], Iterator[StreamEvent]]) -> AsyncGenerator[StreamEvent, None]:
        """Run ``make()`` (tokenize, then ``cm.stream``) on the model thread; yield its events here.

        Raises ``Busy`` at once when the queue is full, and whatever ``make`` raised (``ClientError``, ``PromptError``).
        Closing the iterator early (a client that went away) stops generation after the current token.
        """
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancelled = threading.Event()

        def work() -> None:
            try:
                if cancelled.is_set() or self._closing.is_set():
                    return
                for event in make():
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if cancelled.is_set() or self._closing.is_set():
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

    def warm_up(self) -> float:
        """``CachedModel.warm_up`` on the model's own thread, before the first request: a thread's first
        forward sets up its own thread pool (a warm-up on another thread left the first request after a
        restart at 390 ms of forward for 9 tokens, against 131 ms). Then a chat rendered and tokenized as a
        request's is there: the model's chat template is compiled on first use. Returns its seconds."""

        def work() -> None:
            self.cm.warm_up()
            try:  # one user message: a template that accepts no other chat accepts this one
                render_chat(self.cm.tokenizer, [{"role": "user", "content": "Hi"}])
            except Exception as exc:  # the first request will say what is wrong with the template
                log.warning("chat template not warmed up: %s", exc)

        t0 = time.perf_counter()
        self._executor.submit(work).result()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop: the running request ends after its current token, and no queued one starts. By now the
        server has drained its requests or cancelled them (--drain-timeout): a request left here is one
        whose client will not read it (a cancelled stream's generator is closed only when collected)."""
        self._closing.set()
        t0 = time.perf_counter()
        self._executor.shutdown(wait=True)
        log.info("model executor stopped in %.1f s", time.perf_counter() - t0)


__all__ = ["Busy", "ClientError", "Engine", "render_chat"]
