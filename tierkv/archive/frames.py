"""The archive format: a stream of checked frames, readable past damage.

Layout (little-endian)::

    file head   "TKVARCH\\0", format version (u16), flags (u16, 0), reserved (u32)
    frame       "TKVF", kind (u8), 3 zero bytes, body length (u64), key (32 bytes), time (f64: a record's
                last access), MAC (32 bytes: keyed blake2b-256 of the fields before it and the body, or
                zeros), xxh3-64 of the frame head's fields, then the body

Kinds: ``H`` (JSON: the plan, with every namespace's spec, and whether records carry a MAC), then one ``R``
per block (the key, and the block's record exactly as the disk tier stores it: self-verifying, see
``codec``), then ``E`` (JSON: what was written, with a digest over the records). Nothing in it names a path
or a host: it moves between machines as is.

The records' own checksums catch damage, not a forger: whoever writes an archive can compute records
whose keys are right and whose KV is not. A MAC keyed by a secret both sides hold (``mac_key``), on every
frame, is what lets an importer refuse records, and heads and ends, nobody with the secret wrote.

Why not tar: a damaged tar header loses the rest of the archive; here a frame whose head fails its
checksum is skipped by scanning for the next frame magic, so one bad region costs only the records in it.
A frame head that checks but whose body is damaged costs one record (its own checksums catch it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import http.client
import json
import os
import stat
import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import xxhash

from tierkv.archive.streams import PrefetchReader
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
    "frame_fields",
    "frame_head",
    "frame_mac",
    "json_frame",
    "mac_key",
]

FILE_MAGIC = b"TKVARCH\0"
ARCHIVE_VERSION = 1
_FILE_HEAD = struct.Struct("<8sHHI")
FILE_HEAD_NBYTES = _FILE_HEAD.size
FRAME_MAGIC = b"TKVF"
_FRAME = struct.Struct("<4sB3xQ32sd")
_MAC_NBYTES = 32
_CHECK = struct.Struct("<Q")
FRAME_HEAD_NBYTES = _FRAME.size + _MAC_NBYTES + _CHECK.size
# Bodies above these are refused unread (skipped): a hostile length must not make us allocate it.
MAX_JSON_NBYTES = 64 << 20
MAX_RECORD_NBYTES = 1 << 30
_READ_NBYTES = 1 << 20
NO_KEY = bytes(32)
# What reading a stream can raise besides a clean end: an HTTP response cut short is not an OSError.
_STREAM_ERRORS = (OSError, http.client.HTTPException)


class ArchiveError(TierKVError):
    """Not a tierkv archive, or a version this build does not read."""


class Kind(enum.IntEnum):
    HEAD = ord("H")
    RECORD = ord("R")
    END = ord("E")


def file_head() -> bytes:
    return _FILE_HEAD.pack(FILE_MAGIC, ARCHIVE_VERSION, 0, 0)


def mac_key(secret: bytes, salt: bytes) -> bytes:
    """The MAC key of one archive: scrypt of the shared secret (a server's admin token, a secret file's
    bytes) with the archive's own random salt. Slow on purpose: an archive must not let anyone test guesses
    of the secret (a human-chosen token, say) at hash speed, and a record signed for one archive does not
    verify in another."""
    return hashlib.scrypt(secret, salt=b"tierkv-archive\0" + salt, n=1 << 14, r=8, p=1, dklen=32)


def frame_mac(key: bytes, fields: bytes, body: bytes | bytearray | memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=_MAC_NBYTES)
    h.update(fields)
    h.update(body)  # hashlib releases the GIL over large buffers
    return h.digest()


def frame_fields(kind: Kind, key: bytes, body_nbytes: int, time_s: float = 0.0) -> bytes:
    return _FRAME.pack(FRAME_MAGIC, int(kind), body_nbytes, key, time_s)


def frame_head(
    kind: Kind, key: bytes, body_nbytes: int, time_s: float = 0.0, mac: bytes = bytes(_MAC_NBYTES)
) -> bytes:
    head = frame_fields(kind, key, body_nbytes, time_s) + mac
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def json_frame(kind: Kind, obj: dict[str, Any], key: bytes | None = None) -> bytes:
    """A head or end frame, MACed with ``key`` if given."""
    body = json.dumps(obj, sort_keys=True).encode()
    mac = bytes(_MAC_NBYTES) if key is None else frame_mac(key, frame_fields(kind, NO_KEY, len(body)), body)
    return frame_head(kind, NO_KEY, len(body), mac=mac) + body


@dataclasses.dataclass(slots=True)
class Frame:
    kind: int  # a Kind, or another byte from a newer writer (skipped)
    key: bytes
    body: bytes | bytearray | None  # None: too large to read, or of a kind this build ignores (skipped)
    body_nbytes: int
    time_s: float
    mac: bytes
    fields: bytes  # what the MAC covers besides the body


class FrameReader:
    """Frames from a stream (a file, a pipe, an HTTP response), one buffered pass, no seeking.

    ``damaged_regions`` counts the stretches skipped to find the next good frame head, ``truncated`` says
    whether the stream ended inside a frame, and ``error`` why, when reading it failed."""

    def __init__(self, stream: BinaryIO, prefetch: bool = True) -> None:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # a file: a larger readahead window
            fd = stream.fileno()
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        # Read ahead on a thread while this one verifies; read1: what has arrived (up to n), not a wait for
        # all n: a pipe or a socket that pauses mid-archive must not hold back the records received.
        self._prefetch = PrefetchReader(stream) if prefetch else None
        source: Any = self._prefetch if self._prefetch is not None else stream
        self._stream = source
        self._read = getattr(source, "read1", source.read)
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self.damaged_regions = 0
        self.truncated = False
        self.error: str | None = None  # why the stream ended early, if it failed rather than ended
        self.nbytes_read = 0
        self._pushed: Frame | None = None

    def pushback(self, frame: Frame | None) -> None:
        """Give a frame back: ``frames`` yields it first."""
        self._pushed = frame

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()

    @property
    def abandoned(self) -> bool:
        """Whether its read-ahead thread is still blocked in the stream (a source that stalled): then the
        stream must not be closed (that would wait for the thread), only the process exited."""
        return self._prefetch is not None and self._prefetch.blocked

    def _fill(self, n: int) -> int:
        """Make ``n`` bytes available past the position if the stream has them; how many are."""
        while len(self._buf) - self._pos < n and not self._eof:
            if self._pos > _READ_NBYTES:
                del self._buf[: self._pos]
                self._pos = 0
            try:
                chunk = self._read(max(_READ_NBYTES, n - (len(self._buf) - self._pos)))
            except _STREAM_ERRORS as exc:  # a reset connection, a server gone mid-stream: truncated here
                self.error = f"{type(exc).__name__}: {exc}"
                chunk = b""
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
            try:
                k = self._stream.readinto(view[got:])
            except _STREAM_ERRORS as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                k = 0
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

    def _head_at_pos(self) -> Frame | None:
        """The frame head at the position, if one is there and checks (its body not read yet)."""
        if self._fill(FRAME_HEAD_NBYTES) < FRAME_HEAD_NBYTES:
            return None
        head = bytes(self._buf[self._pos : self._pos + FRAME_HEAD_NBYTES - _CHECK.size])
        (check,) = _CHECK.unpack_from(self._buf, self._pos + len(head))
        if head[:4] != FRAME_MAGIC or check != xxhash.xxh3_64_intdigest(head):
            return None
        fields = head[: _FRAME.size]
        _, kind, body_nbytes, key, time_s = _FRAME.unpack(fields)
        return Frame(kind, key, None, body_nbytes, time_s, head[_FRAME.size :], fields)

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

    def frames(self, stop: threading.Event | None = None) -> Iterator[Frame]:
        """Every frame whose head checks, in order. Bodies are as read: their content is the caller's to
        verify. Once ``stop`` is set, the stream is read no further."""
        if self._prefetch is not None:
            self._prefetch.interrupt = stop
        if self._pushed is not None:
            pushed, self._pushed = self._pushed, None
            yield pushed
        while stop is None or not stop.is_set():
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
            self._pos += FRAME_HEAD_NBYTES
            self.nbytes_read += FRAME_HEAD_NBYTES
            if head.kind in (Kind.HEAD, Kind.END):
                limit = MAX_JSON_NBYTES
            elif head.kind == Kind.RECORD:
                limit = MAX_RECORD_NBYTES
            else:
                limit = -1  # a kind from a newer writer: skipped unread
            if head.body_nbytes > limit:
                if not self._skip(head.body_nbytes):
                    self.truncated = True
                    return
                yield head
                continue
            body = self._take(head.body_nbytes)
            if body is None:
                self.truncated = True
                return
            head.body = body
            yield head
