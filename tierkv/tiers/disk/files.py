"""Segment records' page alignment, which read errors are the record's (segments.py reads them), and
whether the folder's file system takes O_DIRECT.
(``fsync_dir`` and ``punch_hole`` stay in ``segments``: the crash tests record the file operations made
through that module.)"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = [
    "ALIGN",
    "MEDIA_ERRNOS",
    "TransientReadError",
    "accepts_direct_io",
    "aligned",
    "media_or_raise",
]

ALIGN = 4096  # file offsets and record footprints are page multiples: punchable, O_DIRECT-able
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


def accepts_direct_io(folder: Path) -> bool | None:
    """Whether files in ``folder`` open with O_DIRECT (tmpfs and some network file systems refuse it):
    probed with a scratch file of a name no other process picks, removed at once; None when it cannot
    tell (a read-only folder, no space)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / f".direct-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            try:  # some file systems create the file, then refuse the flag
                probe.unlink()
            except OSError:
                pass
            return False
        return None
    os.close(fd)
    try:
        probe.unlink()
    except OSError:
        pass
    return True
