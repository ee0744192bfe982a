"""ServeConfig: every option of ``tierkv serve``, from defaults < TOML file < TIERKV_* env < command line."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import tomllib

from tierkv import models
from tierkv.config import DiskConfig, RemoteConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.paths import default_cache_dir, unwritable_reason
from tierkv.redact import redact_url
from tierkv.units import parse_duration, parse_size


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str | None = models.DEFAULT  # smollm2, tiny (the embedded test model) or a local HF directory
    revision: str | None = None  # vouch for the weights instead of fingerprinting them
    host: str = "127.0.0.1"  # loopback unless asked: the admin API and the cache are not for the internet
    port: int = 8000
    cache_dir: str = ""  # "" -> $TIERKV_CACHE_DIR or ~/.cache/tierkv
    device: str = "auto"
    dtype: str = "auto"
    block_tokens: int | None = None  # None: by the model's KV bytes (tierkv.models.default_block_tokens)
    gpu_cache: str = "auto"  # a size, a fraction of free GPU memory, auto (0.1 on CUDA, none on CPU) or 0
    host_cache: int = 2 << 30  # bytes of host RAM for KV blocks
    disk_budget: int | None = 20 << 30  # bytes on disk; None: no budget (given as "none"; 0 is an error)
    pin_budget: int | None = None  # bytes of the disk budget pins may hold; None: a quarter of it
    ttl: float = 86400.0  # seconds, sliding from the last hit
    sweep_interval_s: float = 300.0  # seconds between background sweeps (expiry, budget); 0: none
    no_cache: bool = False
    remote: str | None = None  # redis://host:port or redis+cluster://host:port: a tier shared by workers
    remote_admit_after: int = 1  # share a block once this many requests contained it
    remote_secret_file: str | None = None  # secrets signing remote records, one a line (first signs)
    api_keys: str | None = None  # a keys file (server/tenants.py): requests need a key, tenants share nothing
    admin_token: str | None = None  # admin API disabled without one
    admin_token_file: str | None = (
        None  # read into admin_token at load (not on the command line: ps shows it)
    )
    max_queue: int = 16  # requests waiting or running; past it: 503 with Retry-After
    max_context: int = 0  # tokens; 0 -> the model's max_position_embeddings
    debug_prompts: bool = False  # keep recent prompts' tokens to show where misses diverged (text!)
    max_body: int = 8 << 20  # bytes of a request body; past it: 413
    body_timeout: float = 30.0  # seconds to receive a whole request body; past it: 408
    # seconds the requests running at a SIGTERM get to finish before they are cancelled and the store is
    # flushed: under the 30 s a container manager waits before its SIGKILL, which would lose the flush
    drain_timeout: float = 20.0
    max_body_total: int = 64 << 20  # bytes of bodies being received at once, all connections; past it: 503
    max_connections: int = 256  # open HTTP connections; past it uvicorn answers 503
    threads: int = 0  # torch's CPU threads for the model; 0: torch's own choice (a thread per core)
    self_check_rate: float = 0.001  # prefills with a hit also computed cold and compared (worker.py)

    def __post_init__(self) -> None:
        if self.max_body_total < self.max_body:  # else a body of the allowed size could never be received
            raise ConfigError(
                f"max_body_total ({self.max_body_total} bytes) must be at least max_body ({self.max_body})"
            )

    @classmethod
    def load(
        cls, cli: dict[str, Any], config_file: str | None = None, env: dict[str, str] | None = None
    ) -> ServeConfig:
        env = dict(os.environ) if env is None else env
        layers: list[dict[str, Any]] = []  # file < environment < command line
        if config_file:
            try:
                layers.append(tomllib.loads(Path(config_file).read_text()))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"--config {config_file}: {exc}") from None
        names = [f.name for f in dataclasses.fields(cls)] + list(_ALIASES)
        layers.append(
            {name: env["TIERKV_" + name.upper()] for name in names if "TIERKV_" + name.upper() in env}
        )
        layers.append({k: v for k, v in cli.items() if v is not None})
        values: dict[str, Any] = {}
        for layer in layers:
            layer = {_ALIASES.get(k, k): v for k, v in layer.items()}
            token_keys = {"admin_token", "admin_token_file"} & set(layer)
            if len(token_keys) == 2:
                raise ConfigError("give the admin token one way: admin_token or admin_token_file, not both")
            if token_keys:  # a token from a later layer replaces the earlier one, however it was given
                values.pop("admin_token", None)
                values.pop("admin_token_file", None)
            values.update(layer)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        if values.get("admin_token_file"):
            values["admin_token"] = read_token_file(str(values["admin_token_file"]))
        config = cls(**{name: _coerce(name, value) for name, value in values.items()})
        where = Path(config.resolved_cache_dir())
        if where.exists() and not where.is_dir():  # a usage error, told before the model loads
            raise ConfigError(f"cache_dir: {where} is a file, not a directory")
        if not config.no_cache and (why := unwritable_reason(where)):  # (a server writes its store)
            raise ConfigError(f"cache_dir: {where} cannot hold a store: {why}")
        return config

    def resolved_cache_dir(self) -> str:
        """(``~`` expanded: a shell leaves it in ``--cache-dir=~/kv``, as TOML and the environment do)"""
        return os.path.expanduser(self.cache_dir or default_cache_dir())

    def store_config(self) -> StoreConfig:
        """The store this server runs on (its GPU tier is added once the model is loaded)."""
        disk = DiskConfig(
            Path(self.resolved_cache_dir()),
            self.disk_budget,
            sweep_interval_s=self.sweep_interval_s,
            pin_budget_nbytes=self.pin_budget,
        )
        secrets = read_secrets(self.remote_secret_file) if self.remote_secret_file else ()
        remote = RemoteConfig(self.remote, self.remote_admit_after, secrets) if self.remote else None
        return StoreConfig(host_bytes=self.host_cache, disk=disk, remote=remote, ttl_s=self.ttl)


# Option names as given (--sweep-interval, TIERKV_SWEEP_INTERVAL, sweep_interval in TOML) -> field names.
_ALIASES = {"sweep_interval": "sweep_interval_s"}


def read_secrets(path: str) -> tuple[bytes, ...]:
    """The remote tier's secrets: one a line (blank lines skipped), the first signs, each 32 bytes or more;
    ConfigError naming the file otherwise."""
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"remote secret file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})"
        ) from None
    secrets = [line for line in lines if line]
    if not secrets or any(len(x.encode()) < 32 for x in secrets):
        raise ConfigError(
            f"remote secret file {path}: one secret a line, each 32 bytes or more (openssl rand -hex 32)"
        )
    return tuple(x.encode() for x in secrets)


def read_token_file(path: str) -> str:
    """The admin token in ``path``: the file's one line, without its line end."""
    try:
        token = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"admin token file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})"
        ) from None
    if not token.strip():
        raise ConfigError(f"admin token file {path}: it is empty")
    if "\n" in token:
        raise ConfigError(f"admin token file {path}: it holds more than one line")
    return token


def _coerce(name: str, value: Any) -> Any:
    """TOML and env give strings or numbers; turn each into the field's type, with one clear error."""
    try:
        if name == "gpu_cache":
            text = str(value).strip().lower()
            if text not in ("auto", "0", "off") and not 0 < _float_or(text, 0.0) < 1:
                parse_size(text)  # else it must be a size: raises one clear error
            return text
        if name == "disk_budget":
            return parse_disk_budget(value)
        if name == "pin_budget":
            return parse_size(value if isinstance(value, (str, int)) else int(value))
        if name in ("host_cache", "max_body", "max_body_total"):
            return parse_size(value if isinstance(value, (str, int)) else int(value))
        if name in ("ttl", "body_timeout"):
            return parse_duration(value)
        if name in ("sweep_interval_s", "drain_timeout"):
            seconds = parse_duration(value)
            if not seconds >= 0:  # also NaN
                zero = "no background sweep" if name == "sweep_interval_s" else "cancel at once"
                raise ConfigError(f"must be 0 ({zero}) or a positive duration, got {value!r}")
            return seconds
        if name == "port":  # checked here, not by bind() after the model has loaded
            if isinstance(value, (bool, float)) or not 1 <= (port := int(value)) <= 65535:
                raise ConfigError(f"a TCP port, 1 to 65535, got {value!r}")
            return port
        if name in ("block_tokens", "max_queue", "max_context", "remote_admit_after"):
            if isinstance(value, (bool, float)):  # TOML's 2.7 or true: no silent rounding
                raise ConfigError(f"a whole number, got {value!r}")
            count = int(value)
            # max_context 0 is the model's own; the others below 1 would refuse every request or block
            if count < (0 if name == "max_context" else 1):
                least = "0 (the model's own)" if name == "max_context" else "1"
                raise ConfigError(f"must be at least {least}, got {value!r}")
            return count
        if name == "self_check_rate":
            rate = float(value)
            if not 0.0 <= rate <= 1.0:  # NaN included
                raise ConfigError(f"must be in 0..1, got {value!r}")
            return rate
        if name == "threads":
            if isinstance(value, (bool, float)):  # TOML's 2.7 or true: no silent rounding
                raise ConfigError(f"threads: a whole number, got {value!r}")
            if (count := int(value)) < 0:
                raise ConfigError(f"must be 0 (torch's choice) or a number of threads, got {value!r}")
            return count
        if name == "max_connections":
            if (count := int(value)) < 1:
                raise ConfigError(f"must be at least 1, got {value!r}")
            return count
        if name in ("no_cache", "debug_prompts"):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        if name == "dtype" and value not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {value!r}")
        if name == "device":
            return _device(str(value))
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _device(value: str) -> str:
    """``--device``: auto, cpu or cuda[:N] (whether this torch has that GPU: ``check_device``)."""
    if value not in ("auto", "cpu", "cuda") and not (value.startswith("cuda:") and value[5:].isdigit()):
        raise ConfigError(f"device must be auto, cpu or cuda[:N], got {value!r}")
    return value


def check_device(value: str) -> str:
    """``value`` where this process's torch has that device; a one-line ConfigError otherwise. Asked by
    the transformers engine before its model loads (vLLM runs its own torch, maybe another build)."""
    if value in ("auto", "cpu"):
        return value
    import torch

    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ConfigError(
            f"device {value}: this torch ({torch.__version__}) has no CUDA ({why}); use --device cpu"
        )
    index = int(value[5:]) if ":" in value else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {value}: this machine has {torch.cuda.device_count()} GPU(s)")
    return value


def parse_disk_budget(value: str | int | float | None) -> int | None:
    """``--disk-budget``: a size > 0, or ``none`` for no budget. 0 is refused on both engines: it read
    as unbounded to the vLLM connector and as an error to the transformers engine."""
    if value is None or str(value).strip().lower() == "none":
        return None
    nbytes = parse_size(value if isinstance(value, (str, int)) else int(value))
    if nbytes <= 0:
        raise ConfigError(
            f"must be a size above 0 (e.g. 20GiB), got {value!r}; for a disk tier without a budget give none"
        )
    return nbytes


def _float_or(text: str, default: float) -> float:
    try:
        return float(text)
    except ValueError:
        return default


__all__ = ["ServeConfig", "parse_disk_budget", "read_secrets", "read_token_file", "redact_url"]
