"""Request bodies of the OpenAI-compatible API (pydantic), and the shape of error bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from tierkv.server.cache_control import PromptCacheOptions, TierkvCacheOptions

# What torch's Generator.manual_seed takes (a negative seed wraps around); past it torch raises.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP = 64  # stop strings per request: each one is searched for after every generated token


class StreamOptions(BaseModel):
    include_usage: StrictBool = False  # true or false: "yes" is an error, not a guess


class _Common(BaseModel):
    # Unknown fields are accepted and ignored, as the hosted APIs do for forward compatibility.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    # Cache control (server/cache_control.py): OpenAI's fields, and tierkv's own for what they lack.
    prompt_cache_retention: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    tierkv: TierkvCacheOptions | None = None
    # Accepted only at the values that ask for what we do (one choice, no log probabilities): anything
    # else is a 400 naming the field, never silently ignored.
    n: int | None = None
    logprobs: Any = None  # chat: a bool; completions: an int

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field asking for something this server does not do."""
        if self.n is not None and self.n != 1:
            return "n", "n: only n=1 is supported (one choice per request)"
        if self.logprobs is not None and self.logprobs is not False:
            return "logprobs", "logprobs: log probabilities are not supported (send null or false)"
        return None


class CompletionRequest(_Common):
    # One prompt: text, token ids, or a batch of exactly one of either (batches of more are a 400).
    prompt: str | list[int] | list[list[int]] | list[str]
    echo: StrictBool | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo: echoing the prompt is not supported"
        if self.best_of is not None and self.best_of != 1:
            return "best_of", "best_of: only best_of=1 is supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # A breakpoint on the whole message (as some clients send it, with text content): the prefix up to
    # its end (server/cache_control.py).
    cache_control: Any = None
    prompt_cache_breakpoint: Any = None

    @field_validator("content")
    @classmethod
    def _text_parts_are_strings(cls, v: Any) -> Any:
        if isinstance(v, list) and any(
            p.get("type") == "text" and not isinstance(p.get("text", ""), str) for p in v
        ):
            raise ValueError("a text part's text must be a string")
        return v

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # Only an assistant's turn may come without content (it made tool calls instead); a user's null
        # content was read as an empty turn, which is a different prompt from the one the client meant.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: a string or a list of parts")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs: log probabilities are not supported (send null or 0)"
        return super().unsupported()


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


__all__ = [
    "MAX_STOP",
    "SEED_MAX",
    "SEED_MIN",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
]
