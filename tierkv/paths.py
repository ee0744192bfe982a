"""Where tierkv keeps its files by default."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "TIERKV_CACHE_DIR"
DEFAULT_CACHE_DIR_HELP = "$TIERKV_CACHE_DIR or ~/.cache/tierkv"  # what default_cache_dir() resolves, in words


# What a store's directory holds that a process writing it opens for writing (tiers/disk: index.py, the
# owners lock, the segments)
STORE_WRITTEN = ("owners.lock", "index", "index/data.mdb", "index/lock.mdb", "segments")


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a store could not be created or written at ``path`` (None: it could), from the directory and
    the store's files in it or, where it does not exist yet, the nearest directory above it that does;
    without creating anything. (access(2) says EROFS for a read-only mount, even to root.)"""
    given = Path(path).expanduser().absolute()
    for link in [given, *given.parents]:
        if link.is_symlink() and not link.exists():
            return f"{link} is a symbolic link to {os.readlink(link)}, which does not exist"
    where = _nearest_existing(given)
    if not where.is_dir():
        return f"{where} is a file"
    if not os.access(where, os.W_OK | os.X_OK):
        return _refused(where)
    if where == given:  # an existing store: what a writer opens in it, made by another user perhaps
        for name in STORE_WRITTEN:
            inside = where / name
            mode = os.W_OK | (os.X_OK if inside.is_dir() else os.R_OK)
            if inside.exists() and not os.access(inside, mode):
                return _refused(inside)
    return None


def _refused(where: Path) -> str:
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"{where} is on a read-only file system"
    except OSError:
        pass
    return f"{where} is not writable by this user"


def store_room_nbytes(path: str | os.PathLike[str]) -> int | None:
    """What the file system under ``path`` (or the nearest directory above it that exists) has for a store
    there: its free bytes (those an unprivileged user may take: root's reserve is not the store's to
    plan on) and what the store's records already hold (allocated; the budget counts records, not the
    index). None if it cannot be told."""
    given = Path(path).expanduser().absolute()
    where = _nearest_existing(given)
    try:
        st = os.statvfs(where)
        # (only a store's own: a directory above the one asked for may be another store)
        held = sum(p.stat().st_blocks * 512 for p in where.glob("segments/*.seg")) if where == given else 0
    except OSError:
        return None
    return st.f_bavail * st.f_frsize + held


def room_short_of(path: str | os.PathLike[str], budget_nbytes: int | None) -> int | None:
    """``store_room_nbytes(path)`` where a disk budget is more than it (the budget would never evict, and
    once the disk is full saves are dropped), else None."""
    room = store_room_nbytes(path) if budget_nbytes else None
    return room if room is not None and budget_nbytes is not None and budget_nbytes > room else None


def _nearest_existing(path: str | os.PathLike[str]) -> Path:
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def default_cache_dir() -> str:
    """The store's directory when none is given: ``$TIERKV_CACHE_DIR`` (a ``~`` in it expanded), else
    ``~/.cache/tierkv``."""
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "tierkv"))


__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_CACHE_DIR_HELP",
    "default_cache_dir",
    "room_short_of",
    "store_room_nbytes",
    "unwritable_reason",
]
