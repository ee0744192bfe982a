"""Block records: the self-describing, checksummed bytes a block is stored as.

Layout (little-endian)::

    header   magic "TKVB", format version, codec, dtype, ndim, shape[6], token count, namespace digest,
             parent key, own key, created_s, raw and stored payload lengths, payload xxh3-64,
             then an xxh3-64 over the header fields and the token ids
    tokens   token_count x uint32
    (pad)    version 2 only: zeros up to the next multiple of 64 bytes from the record's start
    payload  the KV in the canonical layout, raw or zstd (optionally byte-shuffled first)

Version 2 puts the payload at a multiple of 64 bytes from the record's start (records start on a page):
the kernel copies a page-cache read into place a third faster when source and destination agree modulo
64 (a KV slab is 64-aligned; after a 176-byte header and 64 token ids, version 1's payload sits at 48).
Both versions are read; which one is written is the disk tier's choice (its store's format version).

``decode`` checks every field against what the caller asked for; any mismatch or damage raises
``RecordError`` (and nothing else), so a bad record is a miss, never wrong KV.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import numpy as np
import xxhash
import zstandard

from tierkv.errors import RecordError
from tierkv.keys import DTYPES, BlockKey, NamespaceDigest, chain_key

__all__ = [
    "Codec",
    "DTYPE_CODES",
    "DTYPE_ITEMSIZE",
    "Expected",
    "FORMAT_VERSION",
    "PAYLOAD_ALIGN",
    "RECORD_VERSIONS",
    "HEADER_NBYTES",
    "Header",
    "MAGIC",
    "MAX_NDIM",
    "MAX_PAYLOAD_NBYTES",
    "check_expected",
    "check_raw_pieces",
    "check_stored",
    "decode",
    "decode_record",
    "decode_header",
    "decode_payload",
    "encode",
    "encode_parts",
    "encode_unsealed",
    "parent_key_of",
    "parse_header",
    "payload_at",
    "seal",
    "unseal",
    "Unsealed",
]

MAGIC = b"TKVB"
FORMAT_VERSION = 2  # the newest record version (``encode_unsealed``'s default stays 1: readable by all)
RECORD_VERSIONS = (1, 2)
PAYLOAD_ALIGN = 64  # version 2: the payload's offset in the record is a multiple of this
MAX_NDIM = 6
_FIELDS = struct.Struct(f"<4sHBBB3x{MAX_NDIM}II32s32s32sdQQQ")
_CHECK = struct.Struct("<Q")
HEADER_NBYTES = _FIELDS.size + _CHECK.size
_PARENT_AT = struct.calcsize(f"<4sHBBB3x{MAX_NDIM}II32s")  # where the parent key sits in the header
# Stored and raw payloads above this are refused before any allocation (a corrupted length field
# must not make us allocate terabytes).
MAX_PAYLOAD_NBYTES = 1 << 34

DTYPE_CODES = {name: code for name, (code, _) in DTYPES.items()}
DTYPE_ITEMSIZE = {name: itemsize for name, (_, itemsize) in DTYPES.items()}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    ZSTD_SHUFFLE = 2  # bytes of each element grouped by significance first: exponents compress better


@dataclasses.dataclass(frozen=True, slots=True)
class Expected:
    """What a record must be to be served: anything else is a miss."""

    ns_digest: NamespaceDigest
    key: BlockKey
    token_bytes: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    version: int
    codec: Codec
    dtype: str
    shape: tuple[int, ...]
    token_count: int
    ns_digest: NamespaceDigest
    parent_key: BlockKey
    key: BlockKey
    created_s: float
    raw_nbytes: int
    payload_nbytes: int
    payload_checksum: int


def _shuffle(data: bytes | memoryview, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(-1, itemsize).T.tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(itemsize, -1).T.tobytes()


@dataclasses.dataclass(frozen=True, slots=True)
class Unsealed:
    """A record whose two checksums are still to be computed (``seal``, or the native writer, which
    hashes the payload on its own thread without the GIL): ``head`` is the header with zeros in both.
    Its version (in ``head``) says whether zeros pad the token ids to the payload (``pad_nbytes``)."""

    head: bytes
    token_bytes: bytes
    payload: bytes | memoryview

    @property
    def pad_nbytes(self) -> int:
        version = struct.unpack_from("<H", self.head, 4)[0]
        return payload_at(version, len(self.token_bytes)) - HEADER_NBYTES - len(self.token_bytes)

    @property
    def nbytes(self) -> int:
        return len(self.head) + len(self.token_bytes) + self.pad_nbytes + memoryview(self.payload).nbytes


def payload_at(version: int, token_nbytes: int) -> int:
    """Where a record's payload starts, from the record's start."""
    end = HEADER_NBYTES + token_nbytes
    return -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN if version >= 2 else end


def encode_unsealed(
    *,
    ns_digest: NamespaceDigest,
    parent_key: BlockKey,
    key: BlockKey,
    token_bytes: bytes,
    dtype: str,
    shape: tuple[int, ...],
    payload: bytes | memoryview,
    created_s: float,
    codec: Codec = Codec.RAW,
    zstd_level: int = 1,
    version: int = 1,
) -> Unsealed:
    """One record, all but its checksums. ``payload`` is the raw canonical-layout KV (a contiguous
    buffer); with the raw codec it is kept as is, so it must stay unchanged until written. ``version``:
    1 is read by every build, 2 only by builds since the store format 3 (``RECORD_VERSIONS``)."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dims, got {shape}")
    if version not in RECORD_VERSIONS:
        raise ValueError(f"record version {version}: this build writes {RECORD_VERSIONS}")
    raw_nbytes = memoryview(payload).nbytes
    if codec == Codec.RAW:
        stored: bytes | memoryview = payload
    else:
        src = _shuffle(payload, DTYPE_ITEMSIZE[dtype]) if codec == Codec.ZSTD_SHUFFLE else payload
        stored = zstandard.ZstdCompressor(level=zstd_level).compress(src)
    fields = _FIELDS.pack(
        MAGIC,
        version,
        int(codec),
        DTYPE_CODES[dtype],
        len(shape),
        *(tuple(shape) + (0,) * (MAX_NDIM - len(shape))),
        len(token_bytes) // 4,
        ns_digest,
        parent_key,
        key,
        created_s,
        raw_nbytes,
        memoryview(stored).nbytes,
        0,  # the payload's checksum: ``seal``'s
    )
    return Unsealed(fields + _CHECK.pack(0), token_bytes, stored)


def seal(rec: Unsealed) -> list[bytes | memoryview]:
    """The record as buffers to write back to back (header and token ids, payload): no joining copy.
    The native writer does the same (``native/write.c``); this is the reference."""
    fields = bytearray(rec.head[: _FIELDS.size])
    struct.pack_into("<Q", fields, _FIELDS.size - 8, xxhash.xxh3_64_intdigest(rec.payload))
    check = xxhash.xxh3_64(bytes(fields))
    check.update(rec.token_bytes)  # the pad is not hashed: it is zeros, and no reader uses it
    prefix = bytes(fields) + _CHECK.pack(check.intdigest()) + rec.token_bytes + bytes(rec.pad_nbytes)
    return [prefix, rec.payload]


def unseal(buf: bytes | memoryview, header: Header, version: int | None = None) -> Unsealed:
    """A whole record (already parsed into ``header``) back into what ``seal`` takes: its checksums
    zeroed, its token ids and payload as views into ``buf``. Sealing it again gives the same bytes (or,
    with another ``version``, the same record in that version's layout), so an imported record can take
    the native writer's path (which seals as it writes) like a fresh save."""
    view = memoryview(buf).cast("B")
    tokens_end = HEADER_NBYTES + 4 * header.token_count
    version = header.version if version is None else version
    if version not in RECORD_VERSIONS:
        raise ValueError(f"record version {version}: this build writes {RECORD_VERSIONS}")
    fields = bytearray(view[: _FIELDS.size - 8])
    struct.pack_into("<H", fields, 4, version)
    head = bytes(fields) + bytes(8) + _CHECK.pack(0)
    payload = view[payload_at(header.version, 4 * header.token_count) :]
    return Unsealed(head, bytes(view[HEADER_NBYTES:tokens_end]), payload)


def encode_parts(**kwargs: Any) -> list[bytes | memoryview]:
    """One record as buffers to write back to back (see ``encode_unsealed`` and ``seal``)."""
    return seal(encode_unsealed(**kwargs))


def encode(**kwargs: Any) -> bytes:
    """One record's bytes (see ``encode_parts``)."""
    return b"".join(encode_parts(**kwargs))


def parse_header(prefix: bytes | memoryview, record_nbytes: int) -> tuple[Header, memoryview]:
    """Parse and check a record's header and token ids from its first bytes.

    ``prefix`` holds at least the header and token ids; ``record_nbytes`` is the whole record's length
    (the payload may live elsewhere, e.g. already scattered into its destination).
    """
    view = memoryview(prefix).cast("B")
    if view.nbytes < HEADER_NBYTES or record_nbytes < HEADER_NBYTES:
        raise RecordError(
            f"record truncated: {min(view.nbytes, record_nbytes)} bytes, header needs {HEADER_NBYTES}"
        )
    f = _FIELDS.unpack_from(view, 0)
    magic, version, codec, dtype_code, ndim = f[0:5]
    shape_all = f[5 : 5 + MAX_NDIM]
    token_count, ns_digest, parent, key, created_s, raw_nbytes, stored_nbytes, payload_check = f[
        5 + MAX_NDIM :
    ]
    if magic != MAGIC:
        raise RecordError("not a tierkv block record (bad magic)")
    if version not in RECORD_VERSIONS:
        raise RecordError(
            f"record format version {version}, this build reads {', '.join(map(str, RECORD_VERSIONS))}"
        )
    tokens_end = HEADER_NBYTES + 4 * token_count
    if tokens_end > view.nbytes or tokens_end > record_nbytes:
        raise RecordError("record truncated inside its token ids")
    check = xxhash.xxh3_64(view[: _FIELDS.size])
    check.update(view[HEADER_NBYTES:tokens_end])
    if check.intdigest() != _CHECK.unpack_from(view, _FIELDS.size)[0]:
        raise RecordError("header checksum mismatch")
    # Past the checksum every field is as written; still validate ranges written by a buggy encoder.
    if codec not in Codec._value2member_map_ or dtype_code not in _CODE_DTYPES or not 0 < ndim <= MAX_NDIM:
        raise RecordError("record header has an unknown codec, dtype or rank")
    if stored_nbytes > MAX_PAYLOAD_NBYTES or raw_nbytes > MAX_PAYLOAD_NBYTES:
        raise RecordError("record payload length out of range")
    start = payload_at(version, 4 * token_count)
    if start + stored_nbytes != record_nbytes:
        raise RecordError(f"record length {record_nbytes} != header's {start + stored_nbytes}")
    header = Header(
        version,
        Codec(codec),
        _CODE_DTYPES[dtype_code],
        tuple(shape_all[:ndim]),
        token_count,
        NamespaceDigest(ns_digest),
        BlockKey(parent),
        BlockKey(key),
        created_s,
        raw_nbytes,
        stored_nbytes,
        payload_check,
    )
    return header, view[HEADER_NBYTES:tokens_end]


def parent_key_of(prefix: bytes | memoryview) -> BlockKey | None:
    """A record's parent key, from its first bytes, unverified (for ordering only: whatever is served or
    stored is verified whole); None if the bytes are not a record's."""
    view = memoryview(prefix).cast("B")
    if view.nbytes < _PARENT_AT + 32 or bytes(view[:4]) != MAGIC:
        return None
    return BlockKey(bytes(view[_PARENT_AT : _PARENT_AT + 32]))


def decode_header(buf: bytes | memoryview) -> tuple[Header, memoryview, memoryview]:
    """Parse and check a whole record; returns (header, token bytes, stored payload)."""
    view = memoryview(buf).cast("B")
    header, token_bytes = parse_header(view, view.nbytes)
    return header, token_bytes, view[view.nbytes - header.payload_nbytes :]


def check_expected(header: Header, token_bytes: memoryview, expected: Expected) -> None:
    """Raise ``RecordError`` unless the record is the block the caller asked for."""
    if header.ns_digest != expected.ns_digest:
        raise RecordError("record belongs to another namespace")
    if header.key != expected.key:
        raise RecordError("record key differs from the key asked for")
    if token_bytes != expected.token_bytes:
        raise RecordError("record token ids differ from the request's")
    if header.dtype != expected.dtype or header.shape != tuple(expected.shape):
        raise RecordError(
            f"record is {header.dtype}{list(header.shape)}, expected {expected.dtype}{list(expected.shape)}"
        )


def check_raw_pieces(header: Header, pieces: list[memoryview]) -> None:
    """Verify a raw payload that was read straight into its destination, in ``pieces`` (in order)."""
    if header.codec != Codec.RAW:
        raise RecordError("not a raw record")
    if header.payload_nbytes != header.raw_nbytes:
        raise RecordError("raw record whose stored length is not its raw length")
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    if h.intdigest() != header.payload_checksum:
        raise RecordError("payload checksum mismatch")


def check_stored(buf: bytes | memoryview, key: bytes) -> Header:
    """Verify a whole record on its own, with no request to compare it with (``gc --check``, export,
    import): its header, that it names ``key``, that its token ids hash to ``key`` from its parent, and its
    payload. Raises ``RecordError``; returns the header."""
    header, token_bytes, stored = decode_header(buf)
    if header.key != key:
        raise RecordError("record names another key")
    if chain_key(header.parent_key, bytes(token_bytes)) != key:
        raise RecordError("token ids do not hash to the key")
    decode_payload(header, stored)
    return header


def decode(buf: bytes | memoryview, expected: Expected) -> memoryview | bytes:
    """Verify a record against ``expected`` and return its raw payload bytes.

    The returned buffer may be a view into ``buf`` (raw codec): copy it before ``buf`` dies.
    """
    return decode_record(buf, expected)[1]


def decode_record(buf: bytes | memoryview, expected: Expected) -> tuple[Header, memoryview | bytes]:
    """``decode``, with the record's header (its creation time, say)."""
    header, token_bytes, stored = decode_header(buf)
    check_expected(header, token_bytes, expected)
    return header, decode_payload(header, stored)


def decode_payload(header: Header, stored: memoryview) -> memoryview | bytes:
    if xxhash.xxh3_64_intdigest(stored) != header.payload_checksum:
        raise RecordError("payload checksum mismatch")
    expected_raw = int(np.prod(header.shape)) * DTYPE_ITEMSIZE[header.dtype]
    if header.raw_nbytes != expected_raw:
        raise RecordError(f"payload holds {header.raw_nbytes} bytes, shape needs {expected_raw}")
    if header.codec == Codec.RAW:
        if stored.nbytes != expected_raw:
            raise RecordError("raw payload length differs from its shape")
        return stored
    try:
        # A frame that states its size is decompressed into that many bytes whatever max_output_size says:
        # a size other than the shape's is refused before anything is allocated.
        declared = zstandard.frame_content_size(stored)
        if declared not in (-1, expected_raw):
            raise RecordError(f"compressed payload declares {declared} bytes, its shape needs {expected_raw}")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=expected_raw)
    except zstandard.ZstdError as exc:
        raise RecordError(f"payload does not decompress: {exc}") from None
    except MemoryError:
        raise RecordError(f"payload of {expected_raw} bytes does not fit in memory") from None
    if len(raw) != expected_raw:
        raise RecordError("decompressed payload length differs from its shape")
    if header.codec == Codec.ZSTD_SHUFFLE:
        raw = _unshuffle(raw, DTYPE_ITEMSIZE[header.dtype])
    return raw
