"""Exceptions raised by tierkv.

TierKVError
├── RecordError          a block record failed to decode or verify (caller treats it as a miss)
├── StoreFormatError     the store on disk was written by another format version
├── StoreOpenError       the store cannot be opened (permissions, read-only media, memory, lock file)
├── NamespaceConflictError  one digest registered with two different specs
├── StoreClosedError     the store was used after (or while) it was closed
├── ConfigError          a caller's mistake in an argument (size, duration, shape)
└── PinBudgetError       a pin would take the pinned bytes past the store's pin budget (refused)
"""

__all__ = [
    "ConfigError",
    "NamespaceConflictError",
    "PinBudgetError",
    "RecordError",
    "StoreClosedError",
    "StoreFormatError",
    "StoreOpenError",
    "TierKVError",
]


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class RecordError(TierKVError):
    """A stored block record is truncated, corrupted, foreign or of another version.

    Never fatal to a request: the block is a miss (and is purged).
    """


class StoreFormatError(TierKVError):
    """The store directory holds data of a format version this build cannot read."""


class StoreOpenError(TierKVError):
    """The store exists but cannot be opened for a reason other than corruption; its data is left as is."""


class StoreClosedError(TierKVError):
    """The store is closed: nothing more is saved or served by it (open it again)."""


class NamespaceConflictError(TierKVError):
    """A namespace digest is already registered with a different spec."""


class ConfigError(TierKVError, ValueError):
    """An argument is out of range or malformed."""


class PinBudgetError(TierKVError):
    """A pin was refused: it would take the pinned bytes past the pin budget (nothing was pinned)."""
