"""The archive format: a stream of checked frames, readable past damage.

Layout (little-endian)::

    file head   "TKVARCH\\0", format version (u16), flags (u16, 0), reserved (u32)
    frame       "TKVF", kind (u8), 3 zero bytes, body length (u64), key (32 bytes),
                xxh3-64 of the frame head's fields, then the body

Kinds: ``H`` (JSON: the plan, with every namespace's spec), then one ``R`` per block (the key, and the
block's record exactly as the disk tier stores it: self-verifying, see ``codec``), then ``E`` (JSON: what
was written, with a digest over the records). Nothing in it names a path or a host: it moves between
machines as is.

Why not tar: a damaged tar header loses the rest of the archive; here a frame whose head fails its
checksum is skipped by scanning for the next frame magic, so one bad region costs only the records in it.
A frame head that checks but whose body is damaged costs one record (its own checksums catch it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import stat
import struct
from collections.abc import Iterator
from typing import Any, BinaryIO

import xxhash

from tierkv.errors import TierKVError

__all__ = [
    "ARCHIVE_VERSION",
    "ArchiveError",
    "FILE_HEAD_NBYTES",
    "FRAME_HEAD_NBYTES",
    "Frame",
    "FrameReader",
    "Kind",
    "MAX_JSON_NBYTES",
    "MAX_RECORD_NBYTES",
    "file_head",
    "frame_head",
    "json_frame",
]

FILE_MAGIC = b"TKVARCH\0"
ARCHIVE_VERSION = 1
_FILE_HEAD = struct.Struct("<8sHHI")
FILE_HEAD_NBYTES = _FILE_HEAD.size
FRAME_MAGIC = b"TKVF"
_FRAME = struct.Struct("<4sB3xQ32s")
_CHECK = struct.Struct("<Q")
FRAME_HEAD_NBYTES = _FRAME.size + _CHECK.size
# Bodies above these are refused unread (skipped): a hostile length must not make us allocate it.
MAX_JSON_NBYTES = 64 << 20
MAX_RECORD_NBYTES = 1 << 30
_READ_NBYTES = 1 << 20
NO_KEY = bytes(32)


class ArchiveError(TierKVError):
    """Not a tierkv archive, or a version this build does not read."""


class Kind(enum.IntEnum):
    HEAD = ord("H")
    RECORD = ord("R")
    END = ord("E")


def file_head() -> bytes:
    return _FILE_HEAD.pack(FILE_MAGIC, ARCHIVE_VERSION, 0, 0)


def frame_head(kind: Kind, key: bytes, body_nbytes: int) -> bytes:
    fields = _FRAME.pack(FRAME_MAGIC, int(kind), body_nbytes, key)
    return fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields))


def json_frame(kind: Kind, obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, sort_keys=True).encode()
    return frame_head(kind, NO_KEY, len(body)) + body


@dataclasses.dataclass(slots=True)
class Frame:
    kind: int  # a Kind, or another byte from a newer writer (skipped)
    key: bytes
    body: bytes | bytearray | None  # None: too large to read (skipped unread)
    body_nbytes: int


class FrameReader:
    """Frames from a stream (a file, a pipe, an HTTP response), one buffered pass, no seeking.

    ``damaged_regions`` counts the stretches skipped to find the next good frame head, and
    ``truncated`` whether the stream ended inside a frame."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        # read1: what the stream has now (up to n), not a wait for all n; a pipe or a socket that pauses
        # mid-archive must not hold back the records already received.
        self._read = getattr(stream, "read1", stream.read)
        with contextlib.suppress(AttributeError, OSError, ValueError):  # a file: a larger readahead window
            fd = stream.fileno()
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self.damaged_regions = 0
        self.truncated = False
        self.nbytes_read = 0

    def _fill(self, n: int) -> int:
        """Make ``n`` bytes available past the position if the stream has them; how many are."""
        while len(self._buf) - self._pos < n and not self._eof:
            if self._pos > _READ_NBYTES:
                del self._buf[: self._pos]
                self._pos = 0
            chunk = self._read(max(_READ_NBYTES, n - (len(self._buf) - self._pos)))
            if not chunk:
                self._eof = True
                break
            self._buf += chunk
        return min(n, len(self._buf) - self._pos)

    def _take(self, n: int) -> bytes | bytearray | None:
        """The next ``n`` bytes (None if the stream ends first). Large bodies are read straight into
        their own buffer, not through the read buffer."""
        have = len(self._buf) - self._pos
        if n <= have:
            out = bytes(self._buf[self._pos : self._pos + n])
            self._pos += n
            self.nbytes_read += n
            return out
        body = bytearray(n)
        body[:have] = self._buf[self._pos :]
        del self._buf[:]
        self._pos = 0
        view = memoryview(body)
        got = have
        while got < n:
            k = self._stream.readinto(view[got:])  # type: ignore[attr-defined]
            if not k:
                self._eof = True
                self.nbytes_read += got
                return None
            got += k
        self.nbytes_read += n
        return body

    def _skip(self, n: int) -> bool:
        while n > 0:
            got = self._fill(min(n, _READ_NBYTES))
            if not got:
                return False
            self._pos += got
            self.nbytes_read += got
            n -= got
        return True

    def read_file_head(self) -> int:
        """Check the file head; the archive's version. ArchiveError if this is not one this build reads."""
        if self._fill(FILE_HEAD_NBYTES) < FILE_HEAD_NBYTES:
            raise ArchiveError("not a tierkv archive (empty or shorter than its head)")
        magic, version, _flags, _ = _FILE_HEAD.unpack_from(self._buf, self._pos)
        if magic != FILE_MAGIC:
            raise ArchiveError("not a tierkv archive (bad magic)")
        if version != ARCHIVE_VERSION:
            raise ArchiveError(f"archive format version {version}; this build reads {ARCHIVE_VERSION}")
        self._pos += FILE_HEAD_NBYTES
        self.nbytes_read += FILE_HEAD_NBYTES
        return int(version)

    def _head_at_pos(self) -> tuple[int, int, bytes] | None:
        if self._fill(FRAME_HEAD_NBYTES) < FRAME_HEAD_NBYTES:
            return None
        fields = bytes(self._buf[self._pos : self._pos + _FRAME.size])
        magic, kind, body_nbytes, key = _FRAME.unpack(fields)
        (check,) = _CHECK.unpack_from(self._buf, self._pos + _FRAME.size)
        if magic != FRAME_MAGIC or check != xxhash.xxh3_64_intdigest(fields):
            return None
        return kind, body_nbytes, key

    def _resync(self) -> bool:
        """Move to the next frame head that checks; False at the end of the stream."""
        self.damaged_regions += 1
        self._pos += 1
        self.nbytes_read += 1
        while True:
            at = self._buf.find(FRAME_MAGIC, self._pos)
            if at < 0:
                keep = max(self._pos, len(self._buf) - (len(FRAME_MAGIC) - 1))
                self.nbytes_read += keep - self._pos
                self._pos = keep
                if (
                    not self._fill(FRAME_HEAD_NBYTES + _READ_NBYTES)
                    or self._eof
                    and (len(self._buf) - self._pos < FRAME_HEAD_NBYTES)
                ):
                    return False
                continue
            self.nbytes_read += at - self._pos
            self._pos = at
            if self._head_at_pos() is not None:
                return True
            if len(self._buf) - self._pos < FRAME_HEAD_NBYTES and self._eof:
                return False
            self._pos += 1
            self.nbytes_read += 1

    def frames(self) -> Iterator[Frame]:
        """Every frame whose head checks, in order. Bodies are as read: their content is the caller's to
        verify."""
        while True:
            if self._fill(FRAME_HEAD_NBYTES) == 0:
                return
            head = self._head_at_pos()
            if head is None:
                if len(self._buf) - self._pos < FRAME_HEAD_NBYTES and self._eof:
                    self.truncated = True
                    return
                if not self._resync():
                    self.truncated = True
                    return
                continue
            kind, body_nbytes, key = head
            self._pos += FRAME_HEAD_NBYTES
            self.nbytes_read += FRAME_HEAD_NBYTES
            limit = MAX_JSON_NBYTES if kind in (Kind.HEAD, Kind.END) else MAX_RECORD_NBYTES
            if body_nbytes > limit:
                if not self._skip(body_nbytes):
                    self.truncated = True
                    return
                yield Frame(kind, key, None, body_nbytes)
                continue
            body = self._take(body_nbytes)
            if body is None:
                self.truncated = True
                return
            yield Frame(kind, key, body, body_nbytes)
