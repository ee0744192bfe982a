"""Opening a store's directory, and what may be repaired there, by whom.

The store's directories are private (0700). Every process holds ``owners.lock`` shared while it has the
store open, so one that finds the index damaged can prove it is alone (exclusive) before it repairs
anything: a lock-file problem is repaired by recreating ``lock.mdb`` (it holds no data); a damaged
``data.mdb`` is moved aside, only by a writer, and only when no other process has the store open.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

from tierkv.errors import StoreOpenError
from tierkv.tiers.disk.segments import fsync_dir

__all__ = [
    "CORRUPT",
    "RELOCK_TIMEOUT_S",
    "OwnersLock",
    "make_private_dir",
    "open_store",
    "read_index_ahead",
    "read_only_media",
]

log = logging.getLogger("tierkv.disk")

# Errors that mean the environment itself is damaged or foreign: only these may lead to a repair.
CORRUPT = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.VersionMismatchError)
# How long the repairer waits for the fresh store's owners lock: another process that opened the empty
# store in the meantime holds it for as long as it runs.
RELOCK_TIMEOUT_S = 30.0
# How long a reader on read-only media waits for another process to let go of the store (another
# ``tierkv stats`` on the same mount, say) before it says the store is in use.
READ_ONLY_WAIT_S = 3.0


class OwnersLock:
    """``<store>/owners.lock``, flock'ed by every process that has the store open: shared, or exclusive
    by one that repairs it, or that reads it on read-only media (``_lock_owner``)."""

    def __init__(self, path: Path, read_only: bool = False) -> None:
        self.path = path
        self.fd = _lock_alone(path) if read_only else _lock_owner(path, exclusive=False)

    def try_exclusive(self) -> bool:
        """Upgrade our shared lock to exclusive if no other process holds it."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def relock_exclusive(self, timeout_s: float) -> None:
        """Lock the ``owners.lock`` now at ``path`` (a store just moved aside took the old one along),
        waiting at most ``timeout_s``; StoreOpenError if another process holds it that long."""
        os.close(self.fd)
        self.fd = os.open(self.path / "owners.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreOpenError(
                        f"moved the damaged store at {self.path} aside, but another process opened the "
                        f"new empty store there and held it for {timeout_s:.0f} s: start again"
                    ) from None
                time.sleep(0.05)

    def share(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def close(self) -> None:
        os.close(self.fd)


def open_store(path: Path, writer: bool, open_env: Callable[[], None], read_only: bool = False) -> OwnersLock:
    """Create the store's directories, take the owners lock shared and run ``open_env`` (which opens the
    LMDB environment), repairing what may be repaired. Anything else (permissions, read-only media,
    memory) is a ``StoreOpenError``: the data stays. Returns the owners lock, held until closed.
    ``read_only``: a reader of a store on read-only media (``read_only_media``), which takes the lock
    exclusive and creates nothing."""
    if path.exists() and not path.is_dir():
        raise StoreOpenError(f"cannot open the store at {path}: it is a file, not a directory")
    try:
        if not read_only:  # (a reader of a read-only copy creates and re-permissions nothing)
            make_private_dir(path)
        owners = OwnersLock(path, read_only)
    except OSError as exc:
        raise StoreOpenError(f"cannot open the store at {path}: {exc}") from exc
    try:
        try:
            open_env()
        except CORRUPT as exc:
            if read_only:
                raise StoreOpenError(
                    f"the store at {path} is damaged ({exc}) and on read-only media"
                ) from exc
            _repair(path, owners, writer, open_env, exc)
    except lmdb.Error as exc:
        owners.close()  # this process does not own the store after all: no shared lock left behind
        hint = ""
        if "Resource temporarily unavailable" in str(exc):  # LMDB's reader table is keyed by pid
            hint = (
                "; another process with the same pid holds it: processes sharing a cache directory "
                "must share a PID namespace (containers: --pid=host or one pod)"
            )
        raise StoreOpenError(f"cannot open the store at {path}: {exc}{hint}") from exc
    except BaseException:
        owners.close()
        raise
    return owners


def _repair(
    path: Path, owners: OwnersLock, writer: bool, open_env: Callable[[], None], exc: lmdb.Error
) -> None:
    if not owners.try_exclusive():
        raise StoreOpenError(
            f"the store at {path} cannot be opened ({exc}) and other processes have it "
            "open: stop them, then start again"
        ) from exc
    # On an error open_store closes the lock: no share() then, which could wait on another process again.
    _repair_alone(path, owners, writer, open_env, exc)
    owners.share()  # back to shared: others may open it now


def _repair_alone(
    path: Path, owners: OwnersLock, writer: bool, open_env: Callable[[], None], exc: lmdb.Error
) -> None:
    lock = path / "index" / "lock.mdb"
    if lock.exists():  # a lock file of another LMDB build, or damaged: recreate it and retry
        lock.unlink()
        try:
            open_env()
            log.warning("the store's lock file at %s was unusable (%s): recreated it", lock, exc)
            return
        except CORRUPT as again:
            exc = again
    if not writer:  # a reader (``tierkv stats``) never moves a store: the server owns that
        raise StoreOpenError(
            f"the store at {path} is damaged ({exc}); the next server started "
            f"on it moves it aside and starts empty"
        ) from exc
    # Damaged meta pages, a truncated or foreign file: keep it for a post-mortem, start empty.
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    log.error(
        "cannot open the store at %s (%s): moved aside to %s, starting an empty store",
        path,
        exc,
        aside,
    )
    path.rename(aside)
    make_private_dir(path)
    owners.relock_exclusive(RELOCK_TIMEOUT_S)
    open_env()


def make_private_dir(path: Path) -> None:
    """The store's directories are the owner's alone (0700): KV blocks reveal what tenants sent."""
    existed = path.exists()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed:
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    created = not existed
    for sub in ("index", "segments"):
        created |= not (path / sub).exists()
        (path / sub).mkdir(mode=0o700, exist_ok=True)
        if (path / sub).stat().st_mode & 0o077:
            os.chmod(path / sub, 0o700)
    if created:  # the new directories themselves must survive a power cut
        fsync_dir(path)
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)


def read_only_media(path: Path) -> bool:
    """Whether the store at ``path`` is on a file system mounted read-only here (a snapshot, a read-only
    bind mount, a copy on read-only media): a reader then opens its index read-only, without LMDB's lock
    file (LMDB skips it there), and creates nothing; alone (``_lock_owner``), since the same files may be
    written through another mount."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _lock_owner(path: Path, exclusive: bool) -> int:
    """Open and flock ``<store>/owners.lock`` (shared by every process that has the store open; a reader
    on read-only media takes it exclusive instead, ``_lock_alone``)."""
    fd = os.open(path / "owners.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:  # held exclusive: said, then waited for (not a silent hang)
            log.warning(
                "the store at %s is held by another process (a repair, or a reader on a read-only mount of "
                "it): waiting for it",
                path,
            )
            fcntl.flock(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_alone(path: Path) -> int:
    """``owners.lock`` of a store on read-only media, opened for reading (flock needs no write access) and
    locked exclusive, waiting ``READ_ONLY_WAIT_S`` for another reader; else ``StoreOpenError``.

    A read-only mount says nothing of other mounts of the same files: a server may be writing the store
    through a writable one, and LMDB, which takes no locks on read-only media, would then read pages that
    writer is reusing (torn reads, or an assertion that aborts the process). The exclusive lock proves no
    process on this host has it open and keeps any from opening it until this one is done (a writer then
    waits, and says so). The lock must exist: a store without one (an older build's, a copy without it)
    cannot prove that no process writes it elsewhere."""
    try:
        fd = os.open(path / "owners.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreOpenError(
            f"the store at {path} is on read-only media and has no owners.lock, so no process can be shown "
            "not to write it through another mount: open it once from a writable path (any tierkv command "
            "creates the lock), or read a copy"
        ) from None
    deadline = time.monotonic() + READ_ONLY_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreOpenError(
                        f"the store at {path} is on a read-only mount and another process has it open (a "
                        "server writing it through another mount, or another command reading it): read it "
                        "once that process is done, or where it runs"
                    ) from None
                time.sleep(0.05)
            except OSError as exc:  # an NFS mount takes no exclusive lock on a file opened for reading
                raise StoreOpenError(
                    f"the store at {path} is on a read-only file system that cannot lock owners.lock "
                    f"({exc.strerror}; a network file system?): read it from a writable path, or a copy"
                ) from None
    except BaseException:
        os.close(fd)
        raise


def read_index_ahead(path: Path, max_nbytes: int) -> int:
    """The store's index file at ``path`` read into the page cache by the kernel's readahead, up to
    ``max_nbytes``; returns the bytes asked for (``DiskTier.read_ahead``).

    data.mdb only, never lock.mdb: closing any descriptor of a file drops every POSIX lock the process
    holds on it, and LMDB marks its live readers with such locks on lock.mdb (another process's reader
    check then frees this one's reader slots: MDB_BAD_RSLOT on its next read)."""
    with contextlib.suppress(OSError):  # a hint: an error here costs only the first lookups
        fd = os.open(path / "index" / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
        try:
            n = min(os.fstat(fd).st_size, max_nbytes)
            if n > 0:  # (a length of 0 would mean "to the end")
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)
            return max(n, 0)
        finally:
            os.close(fd)
    return 0
