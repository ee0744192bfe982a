"""Segment records' page alignment, and which read errors are the record's (segments.py reads them).
(``fsync_dir`` and ``punch_hole`` stay in ``segments``: the crash tests record the file operations made
through that module.)"""

from __future__ import annotations

import errno

__all__ = [
    "ALIGN",
    "MEDIA_ERRNOS",
    "TransientReadError",
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
