"""What a request asks the cache to do with its prefix: keep it longer, pin it, or keep it in memory only.

A ``Retention`` applies to the blocks of a prefix (``TieredStore.retain``; a chat request's breakpoints
give several prefixes, each its own). It only ever extends what a block has: the longest retention and the
latest pin asked for by any request win, and the store's own TTL is the least a block gets. The store's
max age caps all of them. Retention and pins are the disk tier's (the memory tiers are least recently
used, and the remote tier has its own TTL); ``memory_only`` keeps a request's new blocks out of every
record tier (disk and remote).
"""

from __future__ import annotations

import dataclasses

from tierkv import units
from tierkv.errors import ConfigError

__all__ = ["CacheControl", "MAX_RETENTION_S", "NO_CONTROL", "Retention", "parse_duration"]

MAX_RETENTION_S = 30 * 86400.0  # the longest retention or pin one request may ask for


@dataclasses.dataclass(frozen=True)
class Retention:
    ttl_s: float = 0.0  # kept at least this long after each use (0: the store's TTL)
    pin_s: float = 0.0  # pinned this long from now: never evicted, never idle-expired (0: no pin)
    memory_only: bool = False  # new blocks stay in the memory tiers, never written to disk or remote

    def __post_init__(self) -> None:
        for name in ("ttl_s", "pin_s"):
            value = getattr(self, name)
            if not 0.0 <= value <= MAX_RETENTION_S:  # also refuses NaN
                raise ConfigError(f"{name} must be between 0 and {MAX_RETENTION_S:.0f} seconds, got {value}")

    @property
    def is_default(self) -> bool:
        return self == Retention()

    def merge(self, other: Retention) -> Retention:
        """The stronger of two asks for the same blocks."""
        return Retention(
            max(self.ttl_s, other.ttl_s), max(self.pin_s, other.pin_s), self.memory_only or other.memory_only
        )


def parse_duration(value: str | float | int, what: str = "duration") -> float:
    """Seconds from ``"300"``, ``"5m"``, ``"1h"``, ``"24h"``, ``"7d"`` or a number, above 0 and at most
    ``MAX_RETENTION_S``; ConfigError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{what}: expected a duration such as 5m, 1h or 24h, got {value!r}")
    try:
        seconds = units.parse_duration(value)
    except ConfigError:
        raise ConfigError(f"{what}: expected a duration such as 5m, 1h or 24h, got {value!r}") from None
    if not 0.0 < seconds <= MAX_RETENTION_S:  # also NaN and infinities
        raise ConfigError(f"{what}: must be more than 0 and at most 30d, got {value!r}")
    return seconds


@dataclasses.dataclass(frozen=True)
class CacheControl:
    """What a request asks: a retention per prefix (its prompt tokens), and for the whole request
    whether its new blocks may go to disk (``memory_only``) or anywhere at all (``no_store``)."""

    prefixes: tuple[tuple[int, Retention], ...] = ()
    memory_only: bool = False
    no_store: bool = False
    save_tokens: int | None = None  # save only the prompt's first this many tokens (None: all it computed)

    @property
    def pin(self) -> tuple[int, float]:
        """(prompt tokens, seconds) of the longest pinned prefix; (0, 0) without a pin."""
        pins = [(n, r.pin_s) for n, r in self.prefixes if r.pin_s]
        return max(pins) if pins else (0, 0.0)


NO_CONTROL = CacheControl()  # a request that asks nothing
