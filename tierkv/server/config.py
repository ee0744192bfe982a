"""ServeConfig: every option of ``tierkv serve``, from defaults < TOML file < TIERKV_* env < command line."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import tomllib

from tierkv.errors import ConfigError
from tierkv.units import parse_duration, parse_size


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # a local Hugging Face directory; None: the embedded default model
    revision: str | None = None  # vouch for the weights instead of fingerprinting them
    host: str = "127.0.0.1"  # loopback unless asked: the admin API and the cache are not for the internet
    port: int = 8000
    cache_dir: str = ""  # "" -> $TIERKV_CACHE_DIR or ~/.cache/tierkv
    device: str = "auto"
    dtype: str = "auto"
    block_tokens: int = 64
    gpu_cache: str = "auto"  # a size, a fraction of free GPU memory, auto (0.1 on CUDA, none on CPU) or 0
    host_cache: int = 2 << 30  # bytes of host RAM for KV blocks
    disk_budget: int = 20 << 30  # bytes on disk
    ttl: float = 86400.0  # seconds, sliding from the last hit
    no_cache: bool = False
    remote: str | None = None  # redis://host:port or redis+cluster://host:port: a tier shared by workers
    remote_admit_after: int = 1  # share a block once this many requests contained it
    admin_token: str | None = None  # admin API disabled without one
    max_queue: int = 16  # requests waiting or running; past it: 503 with Retry-After
    max_context: int = 0  # tokens; 0 -> the model's max_position_embeddings
    debug_prompts: bool = False  # keep recent prompts' tokens to show where misses diverged (text!)
    max_body: int = 8 << 20  # bytes of a request body; past it: 413
    body_timeout: float = 30.0  # seconds to receive a whole request body; past it: 408

    @classmethod
    def load(cls, cli: dict[str, Any], config_file: str | None = None,
             env: dict[str, str] | None = None) -> ServeConfig:
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        if config_file:
            try:
                values.update(tomllib.loads(Path(config_file).read_text()))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"--config {config_file}: {exc}") from None
        for f in dataclasses.fields(cls):
            key = "TIERKV_" + f.name.upper()
            if key in env:
                values[f.name] = env[key]
        values.update({k: v for k, v in cli.items() if v is not None})
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return cls(**{name: _coerce(name, value) for name, value in values.items()})

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get("TIERKV_CACHE_DIR") or str(Path.home() / ".cache" / "tierkv")


def _coerce(name: str, value: Any) -> Any:
    """TOML and env give strings or numbers; turn each into the field's type, with one clear error."""
    try:
        if name == "gpu_cache":
            text = str(value).strip().lower()
            if text not in ("auto", "0", "off") and not 0 < _float_or(text, 0.0) < 1:
                parse_size(text)  # else it must be a size: raises one clear error
            return text
        if name in ("host_cache", "disk_budget", "max_body"):
            return parse_size(value if isinstance(value, (str, int)) else int(value))
        if name in ("ttl", "body_timeout"):
            return parse_duration(value)
        if name in ("port", "block_tokens", "max_queue", "max_context", "remote_admit_after"):
            return int(value)
        if name in ("no_cache", "debug_prompts"):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        if name == "dtype" and value not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {value!r}")
        if name == "device" and not (value in ("auto", "cpu") or str(value).startswith("cuda")):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {value!r}")
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _float_or(text: str, default: float) -> float:
    try:
        return float(text)
    except ValueError:
        return default
