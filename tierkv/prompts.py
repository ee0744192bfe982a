"""Prompts as token ids: plain text, a chat, or an OpenAI request body, encoded as the model's tokenizer does.

The server (``/v1/completions``, ``/v1/chat/completions``) and the CLI (``tierkv explain``, ``tierkv lint``)
both encode through here, so a prompt given to either becomes the same token ids: the same cache keys.
"""

from __future__ import annotations

import json
from typing import Any

PLAIN_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # per message; then "<|assistant|>\n" opens the reply
PLAIN_CHAT_GENERATION_PROMPT = "<|assistant|>\n"


class PromptError(ValueError):
    """Text that no tokenizer can encode (e.g. lone surrogates from a JSON body); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code: str | None = None


def encode_text(tokenizer: Any, text: str, special: bool = True, param: str = "prompt") -> list[int]:
    """Token ids of ``text``; ``special``: with the tokenizer's special tokens (BOS)."""
    from tierkv.default_model import ByteTokenizer

    try:
        if isinstance(tokenizer, ByteTokenizer):
            return tokenizer.encode(text, add_bos=special)
        text.encode("utf-8")  # JSON may carry lone surrogates (\ud800): no tokenizer takes them
        return list(tokenizer.encode(text, add_special_tokens=special))
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"{param}: the text is not valid Unicode ({exc.reason} at character {exc.start})", param
        ) from None


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


def encode_request(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an OpenAI request body (chat or completion JSON), or of ``text`` itself when it is not one.

    Lenient, for files a person saved: a message's content may be a string or a list of parts (their
    ``text`` joined), a missing role is ``user``; a completion's prompt may be text or token ids.
    """
    try:
        body = json.loads(text)
    except ValueError:
        return encode_text(tokenizer, text)
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        msgs = [
            {
                "role": m.get("role", "user"),
                "content": m.get("content")
                if isinstance(m.get("content"), str)
                else "".join(p.get("text", "") for p in m.get("content") or [] if isinstance(p, dict)),
            }
            for m in body["messages"]
            if isinstance(m, dict)
        ]
        return render_chat(tokenizer, msgs)
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        return encode_text(tokenizer, body["prompt"])
    if isinstance(body, dict) and isinstance(body.get("prompt"), list):
        return [int(t) for t in body["prompt"]]
    return encode_text(tokenizer, text)


__all__ = [
    "PLAIN_CHAT_GENERATION_PROMPT",
    "PLAIN_CHAT_TEMPLATE",
    "PromptError",
    "encode_request",
    "encode_text",
    "render_chat",
]
