"""What a store is made of: ``StoreConfig``, one part per tier, and the tiers it builds (fastest first).

``TieredStore.open(path, host_bytes=..., ...)`` (the quickstart call) goes through ``StoreConfig.of``;
``tierkv serve``'s ``ServeConfig`` builds a ``StoreConfig`` too.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.codec import Codec
from tierkv.errors import ConfigError
from tierkv.units import format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from tierkv.metrics import Counters
    from tierkv.tiers.base import Tier

__all__ = ["DiskConfig", "GpuConfig", "RemoteConfig", "StoreConfig"]


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    nbytes: int = 0  # 0: no GPU tier (see ``tiers.gpu.gpu_budget_nbytes`` for --gpu-cache)
    device: str = "cuda"


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    path: Path
    budget_nbytes: int | None = None  # None: unbounded
    sync: bool = True  # fdatasync each batch before indexing it (off only for tests and benchmarks)
    sweep_interval_s: float = 0.0  # > 0: expiry and budget swept in the background that often
    pin_budget_nbytes: int | None = None  # None: a quarter of the budget (no pins without a budget)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # DiskTier's sizes (queue, segments...)


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    url: str  # redis://host:port or redis+cluster://host:port
    admit_after: int = 1  # share a block only once that many requests contained it
    # sign records with the first, accept any (remote.py); () unsigned; never in a repr (logs, tracebacks)
    secrets: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)


# TieredStore.open's own keywords, and those it hands the disk tier (DiskTier's sizes and modes)
OPEN_OPTIONS = frozenset(
    {"host_bytes", "disk_bytes", "pin_bytes", "ttl_s", "max_age_s", "codec_", "clock", "sync", "remote"}
    | {"remote_admit_after", "remote_secrets", "gpu_bytes", "device", "staging", "sweep_interval_s"}
)
DISK_OPTIONS = frozenset(
    {"queue_nbytes", "batch_nbytes", "segment_nbytes", "map_nbytes", "read_threads", "direct_reads"}
    | {"direct_writes"}
)


def _size(name: str, value: Any) -> int | None:
    """A size in bytes: an integer (a whole float such as 20e9 too), or a string such as ``"4GiB"``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{name} must be a number of bytes (an int, or a size such as '4GiB'), got {value!r}")


def _seconds(name: str, value: Any) -> float | None:
    """A duration in seconds: a number, or a string such as ``"24h"``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{name} must be seconds (a number, or a duration such as '24h'), got {value!r}")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    host_bytes: int = 1 << 30
    disk: DiskConfig | None = None
    remote: RemoteConfig | None = None
    gpu: GpuConfig = GpuConfig()
    ttl_s: float | None = None  # sliding, every tier
    max_age_s: float | None = None  # from a block's creation, every tier
    codec: Codec = Codec.RAW
    staging: bool | None = None  # the write-behind's staging ring: None = when blocks are on a GPU
    clock: Callable[[], float] = time.time

    @classmethod
    def of(
        cls,
        path: str | os.PathLike[str] | None,
        *,
        host_bytes: int = 1 << 30,
        disk_bytes: int | None = None,
        pin_bytes: int | None = None,
        ttl_s: float | None = None,
        max_age_s: float | None = None,
        codec_: Codec | str = Codec.RAW,
        clock: Callable[[], float] = time.time,
        sync: bool = True,
        remote: str | None = None,
        remote_admit_after: int = 1,
        remote_secrets: tuple[bytes, ...] = (),
        gpu_bytes: int = 0,
        device: str = "cuda",
        staging: bool | None = None,
        sweep_interval_s: float = 0.0,
        **disk_options: int,
    ) -> StoreConfig:
        """The flat keywords of ``TieredStore.open``. ``path=None`` gives a memory-only store;
        ``host_bytes=0`` one without a host tier. ``pin_bytes``: the disk tier's pin budget (None: a
        quarter of ``disk_bytes``). Sizes may be given as ``"4GiB"`` and durations as ``"24h"``, as on the
        command line; a keyword nothing takes is a ConfigError (a misspelt ``ttl`` would never expire)."""
        unknown = sorted(set(disk_options) - DISK_OPTIONS)
        if unknown:
            raise ConfigError(
                f"TieredStore.open: unknown option(s) {', '.join(unknown)}; it takes "
                f"{', '.join(sorted(OPEN_OPTIONS | DISK_OPTIONS))}"
            )
        if path is None and (disk_bytes is not None or pin_bytes is not None or disk_options):
            given = [k for k, v in (("disk_bytes", disk_bytes), ("pin_bytes", pin_bytes)) if v is not None]
            raise ConfigError(
                f"TieredStore.open: {', '.join(given + sorted(disk_options))} given for a store without a "
                "disk tier (path None)"
            )
        host_bytes = _size("host_bytes", host_bytes) or 0
        disk_bytes, pin_bytes = _size("disk_bytes", disk_bytes), _size("pin_bytes", pin_bytes)
        ttl_s, max_age_s = _seconds("ttl_s", ttl_s), _seconds("max_age_s", max_age_s)
        if isinstance(codec_, str):
            codec_ = Codec[codec_.upper().replace("-", "_")]
        disk = (
            None
            if path is None
            else DiskConfig(Path(path), disk_bytes, sync, sweep_interval_s, pin_bytes, disk_options)
        )
        return cls(
            host_bytes=host_bytes,
            disk=disk,
            remote=RemoteConfig(remote, remote_admit_after, tuple(remote_secrets))
            if remote is not None
            else None,
            gpu=GpuConfig(gpu_bytes, str(device)),
            ttl_s=ttl_s,
            max_age_s=max_age_s,
            codec=codec_,
            staging=staging,
            clock=clock,
        )

    def check(self) -> None:
        if self.host_bytes < 0 or (
            self.disk is not None and self.disk.budget_nbytes is not None and self.disk.budget_nbytes <= 0
        ):
            raise ConfigError("host_bytes must be >= 0 and disk_bytes > 0")
        if self.disk is not None and self.disk.pin_budget_nbytes is not None:
            budget = self.disk.budget_nbytes
            if self.disk.pin_budget_nbytes < 0 or (
                budget is not None and self.disk.pin_budget_nbytes > budget
            ):
                raise ConfigError(
                    f"the pin budget (--pin-budget, {format_size(self.disk.pin_budget_nbytes)}) must be >= 0 "
                    f"and at most the disk budget (--disk-budget, {format_size(budget or 0)})"
                )

    def build(self, counters: Counters) -> list[Tier]:
        """The tiers, fastest first."""
        self.check()
        ages: dict[str, Any] = {"ttl_s": self.ttl_s, "max_age_s": self.max_age_s, "clock": self.clock}
        tiers: list[Tier] = []
        try:
            self._build(tiers, counters, ages)
        except BaseException:
            for tier in tiers:  # a disk tier opened before the remote one failed: closed, not leaked
                tier.close()
            raise
        return tiers

    def _build(self, tiers: list[Tier], counters: Counters, ages: dict[str, Any]) -> None:
        from tierkv.tiers.disk import DiskTier, Policy
        from tierkv.tiers.host import HostTier

        if self.gpu.nbytes:
            from tierkv.tiers.gpu import GpuTier

            tiers.append(GpuTier(self.gpu.nbytes, device=self.gpu.device, counters=counters, **ages))
        if self.host_bytes:
            tiers.append(HostTier(self.host_bytes, counters=counters, **ages))
        if self.disk is not None:
            d = self.disk
            tiers.append(
                DiskTier(
                    d.path,
                    policy=Policy(d.budget_nbytes, self.ttl_s, self.max_age_s, d.pin_budget_nbytes),
                    clock=self.clock,
                    sync=d.sync,
                    counters=counters,
                    sweep_interval_s=d.sweep_interval_s,
                    **d.options,
                )
            )
        if self.remote is not None:
            from tierkv.tiers.admission import Admission
            from tierkv.tiers.remote import RemoteTier

            remote: Tier = RemoteTier(
                self.remote.url, ttl_s=self.ttl_s, counters=counters, secrets=self.remote.secrets
            )
            tiers.append(
                Admission(remote, self.remote.admit_after) if self.remote.admit_after > 1 else remote
            )
