"""Segment records' page alignment, which read errors are the record's (segments.py reads them), and
whether the folder's file system takes O_DIRECT.
(``fsync_dir`` and ``punch_hole`` stay in ``segments``: the crash tests record the file operations made
through that module.)"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import sys
from pathlib import Path

__all__ = [
    "ALIGN",
    "IOV_MAX",
    "MEDIA_ERRNOS",
    "TransientReadError",
    "accepts_direct_io",
    "aligned",
    "has_cachestat",
    "media_or_raise",
]

ALIGN = 4096  # file offsets and record footprints are page multiples: punchable, O_DIRECT-able
IOV_MAX = 1024  # Linux's limit on buffers per preadv / pwritev
# Errors that say the medium could not return the record's bytes: the record is purged. Any other error of a
# read (no descriptors left: EMFILE, ENFILE; no memory) says nothing about the record, which stays.
MEDIA_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "ENODATA", "EBADMSG", "EUCLEAN", "EREMOTEIO")
    if hasattr(errno, name)
)


class TransientReadError(OSError):
    """A read failed for a reason that is not the record's (EMFILE, ENOMEM, ...): a miss, nothing purged."""


def media_or_raise(exc: OSError, seg_id: int) -> None:
    if exc.errno not in MEDIA_ERRNOS:
        raise TransientReadError(exc.errno, f"reading segment {seg_id}: {exc.strerror}") from None


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


# What a file system answers when it refuses O_DIRECT: EINVAL from Linux's own file systems (tmpfs before
# 6.6), EOPNOTSUPP from some others (FUSE file systems, network ones) at open or at the first read or write.
DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)


def accepts_direct_io(folder: Path) -> bool | None:
    """Whether files in ``folder`` open with O_DIRECT (tmpfs before Linux 6.6 and some network file systems
    refuse it): probed by opening a segment read-only, or in a folder without one, a scratch file of a name
    no other process picks, removed at once (a power cut in between leaves it, empty, in a folder with
    nothing else). None when it cannot tell (a read-only empty folder, no space)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    existing = next(folder.glob("*.seg"), None)
    probe = existing or folder / f".direct-probe-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_RDONLY if existing else os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(probe, flags | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError as exc:
        refused = exc.errno in DIRECT_REFUSED
        if refused and not existing:  # some file systems create the file, then refuse the flag
            _unlink_quietly(probe)
        return False if refused else None
    os.close(fd)
    if not existing:
        _unlink_quietly(probe)
    return True


# cachestat(2), Linux 6.5: the same number on every architecture (the unified syscall table)
CACHESTAT_NR = 451


@functools.cache
def has_cachestat() -> bool:
    """Whether this kernel answers cachestat(2) (not before Linux 6.5, nor where a seccomp profile refuses
    it): the native reader's residency check. Without it that check maps each range and asks ``mincore``,
    taking the process's memory-map lock for writing and flushing TLBs on every CPU the process runs on,
    group by group. Asked of no file (descriptor -1): a kernel that has the call answers EBADF, one without
    it ENOSYS, a seccomp profile EPERM or ENOSYS. Never of a store's files: closing any descriptor of a
    file drops every fcntl lock this process holds on it (LMDB's reader table's, on its lock file)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        long = ctypes.c_long  # syscall(2) takes its arguments as longs
        ctypes.set_errno(0)
        libc.syscall(long(CACHESTAT_NR), long(-1), None, None, long(0))
        return ctypes.get_errno() == errno.EBADF
    except (AttributeError, OSError):
        return False


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
