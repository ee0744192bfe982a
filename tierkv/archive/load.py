"""Import: an archive stream (``frames``) into a disk tier, every record verified before it is queued.

The records go through the disk tier's own writer (append, ``fdatasync``, then the index commit), so an
import is as durable and as safe beside a running server as a save, and an interrupted one resumes by
running it again: what was committed is skipped as already there.

Nothing is evicted to make room: an archive larger than what is left of the store's budget fills it, most
recently used records first (the export's order), and the rest is counted as ``no_room``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import xxhash

from tierkv.archive.frames import FrameReader, Kind
from tierkv.codec import Header, check_stored, unseal
from tierkv.errors import ConfigError, RecordError
from tierkv.keys import BlockKey, Namespace
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk.segments import aligned
from tierkv.tiers.disk.writer import Put

__all__ = ["ImportReport", "import_archive"]

_ROOM_WAIT_S = 0.002


@dataclasses.dataclass
class ImportReport:
    imported: int = 0  # queued and then written (``not_written`` already subtracted)
    imported_nbytes: int = 0
    present: int = 0  # the store already held it
    expired: int = 0  # older than the store's max age
    no_room: int = 0  # past the store's byte budget
    refused: int = 0  # damaged, or not what its frame or namespace says: never stored
    not_written: int = 0  # verified and queued, but the disk tier dropped it (a full disk, a write error)
    damaged_regions: int = 0  # stretches of the archive skipped to find the next good frame
    planned: int = 0  # records the archive's head announced
    complete: bool = False  # the end frame was read, and every record it counts was seen
    digest_ok: bool | None = None  # the end frame's records digest matched (None: not comparable)
    archive_nbytes: int = 0

    @property
    def seen(self) -> int:
        return self.imported + self.present + self.expired + self.no_room + self.refused + self.not_written

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seen": self.seen}


def _specs(body: bytes | bytearray) -> dict[bytes, bytes | None]:
    """Namespace digest -> spec JSON from the head frame, each spec checked against its digest; a spec
    that does not hash to its digest maps to ``b""`` (its records are refused)."""
    out: dict[bytes, bytes | None] = {}
    try:
        head = json.loads(body)
        rows = head["namespaces"]
        assert isinstance(rows, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        return out
    for hex_digest, row in rows.items():
        try:
            digest = bytes.fromhex(hex_digest)
            spec = row.get("spec") if isinstance(row, dict) else None
            if spec is None:
                out[digest] = None
                continue
            ns = Namespace.from_json(spec)
            out[digest] = ns.spec_bytes if ns.digest == digest else b""
        except (ValueError, TypeError, ConfigError):
            continue
    return out


def _fits_namespace(header: Header, spec: bytes | None) -> bool:
    if spec is None:  # no spec to compare with: the record's own checks stand alone
        return True
    if not spec:
        return False
    ns = Namespace.from_json(spec.decode())
    return header.dtype == ns.dtype and header.token_count == ns.block_tokens


def import_archive(
    disk: DiskTier,
    src: BinaryIO,
    progress: Callable[[ImportReport], None] | None = None,
    timeout_s: float = 600.0,
) -> ImportReport:
    """Import every verified record of the archive on ``src`` that the store lacks and has room for.
    ArchiveError if ``src`` is not an archive this build reads; anything damaged inside it is counted, not
    raised. ``progress(report)`` every few records."""
    if disk.writer is None:
        raise ConfigError("import needs a disk tier opened with a writer")
    reader = FrameReader(src)
    reader.read_file_head()
    report = ImportReport()
    specs: dict[bytes, bytes | None] = {}
    seen_head = False
    end: dict[str, Any] | None = None
    digest = xxhash.xxh3_64()
    policy = disk.policy
    with disk.index.read() as txn:
        used_nbytes = disk.index.total_nbytes(txn)
    dropped_before = _dropped(disk)
    for frame in reader.frames():
        if frame.kind == Kind.HEAD and not seen_head and frame.body is not None:
            seen_head = True
            specs = _specs(frame.body)
            try:
                report.planned = int(json.loads(frame.body).get("blocks", 0))
            except (ValueError, AttributeError, TypeError):
                pass
            continue
        if frame.kind == Kind.END and frame.body is not None:
            try:
                end = json.loads(frame.body)
            except ValueError:
                end = None
            continue
        if frame.kind != Kind.RECORD:
            continue  # a kind from a newer writer, or a second head: nothing to store
        if frame.body is None:
            report.refused += 1
            continue
        try:
            header = check_stored(memoryview(frame.body), frame.key)
        except RecordError:
            report.refused += 1
            continue
        spec = specs.get(header.ns_digest)
        if not _fits_namespace(header, spec):
            report.refused += 1
            continue
        digest.update(frame.key + header.payload_checksum.to_bytes(8, "little"))
        if disk.holds([BlockKey(frame.key)])[0]:
            report.present += 1
            continue
        if policy.max_age_s is not None and disk.clock() - header.created_s > policy.max_age_s:
            report.expired += 1
            continue
        footprint = aligned(frame.body_nbytes)
        if policy.budget_nbytes is not None and used_nbytes + footprint > policy.budget_nbytes:
            report.no_room += 1
            continue
        if not _queue(disk, frame.key, frame.body, header, spec, timeout_s):
            report.not_written += 1
            continue
        used_nbytes += footprint
        report.imported += 1
        report.imported_nbytes += frame.body_nbytes
        if progress is not None and report.seen % 64 == 0:
            progress(report)
    if not disk.flush(timeout_s):
        raise OSError("the disk tier did not finish writing the imported records in time")
    dropped = _dropped(disk) - dropped_before
    report.not_written += dropped
    report.imported -= dropped
    report.damaged_regions = reader.damaged_regions
    report.archive_nbytes = reader.nbytes_read
    if end is not None:
        try:
            report.complete = not reader.truncated and int(end["blocks"]) == report.seen
            if report.refused == 0 and report.complete:
                report.digest_ok = end.get("records_xxh3") == digest.hexdigest()
        except (KeyError, TypeError, ValueError):
            report.complete = False
    if progress is not None:
        progress(report)
    return report


def _dropped(disk: DiskTier) -> int:
    return disk.counters.snapshot().get("disk", {}).get("dropped_saves", 0)


def _queue(
    disk: DiskTier,
    key: bytes,
    body: bytes | bytearray,
    header: Header,
    spec: bytes | None,
    timeout_s: float,
) -> bool:
    """Hand a record to the disk tier's writer, waiting while its queue is full (an import is a bulk
    writer: it waits for room rather than drop). False if the tier stopped accepting writes."""
    writer = disk.writer
    assert writer is not None
    # Unsealed: the writer seals it again (the same bytes: it verified) on its native path, O_DIRECT where
    # the file system allows, instead of a buffered write of the sealed bytes.
    record = unseal(memoryview(body), header)
    item = Put(
        header.ns_digest,
        key,
        lambda: record,
        record.nbytes,
        header.created_s,
        None,
        spec or None,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        got = writer.put(item, full_ok=True)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            return False
        time.sleep(_ROOM_WAIT_S)
