"""Where tierkv keeps its files by default."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "TIERKV_CACHE_DIR"
DEFAULT_CACHE_DIR_HELP = "$TIERKV_CACHE_DIR or ~/.cache/tierkv"  # what default_cache_dir() resolves, in words


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a store could not be created or written at ``path`` (None: it could), from the directory or,
    where it does not exist yet, the nearest one above it that does; without creating anything. (access(2)
    says EROFS for a read-only mount, even to root.)"""
    where = _nearest_existing(path)
    if not where.is_dir():
        return f"{where} is a file"
    if os.access(where, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"{where} is on a read-only file system"
    except OSError:
        pass
    return f"{where} is not writable by this user"


def store_room_nbytes(path: str | os.PathLike[str]) -> int | None:
    """What the file system under ``path`` (or the nearest directory above it that exists) has for a store
    there: its free bytes and what the store's files already hold (allocated). None if it cannot be told."""
    where = _nearest_existing(path)
    try:
        st = os.statvfs(where)
        held = sum(
            p.stat().st_blocks * 512
            for pattern in ("segments/*.seg", "index/*.mdb")
            for p in where.glob(pattern)
        )
    except OSError:
        return None
    return st.f_bavail * st.f_frsize + held


def room_short_of(path: str | os.PathLike[str], budget_nbytes: int | None) -> int | None:
    """``store_room_nbytes(path)`` where a disk budget is more than it (the budget would never evict, and
    once the disk is full saves are dropped), else None."""
    room = store_room_nbytes(path) if budget_nbytes else None
    return room if room is not None and budget_nbytes is not None and budget_nbytes > room else None


def _nearest_existing(path: str | os.PathLike[str]) -> Path:
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def default_cache_dir() -> str:
    """The store's directory when none is given: ``$TIERKV_CACHE_DIR``, else ``~/.cache/tierkv``."""
    return os.environ.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "tierkv")


__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_CACHE_DIR_HELP",
    "default_cache_dir",
    "room_short_of",
    "store_room_nbytes",
    "unwritable_reason",
]
