"""Import: an archive stream (``frames``) into a disk tier, every record verified before it is queued.

The records go through the disk tier's own writer (append, ``fdatasync``, then the index commit), so an
import is as durable and as safe beside a running server as a save, and an interrupted one resumes by
running it again: what was committed is skipped as already there.

Nothing is evicted to make room: the writer indexes an imported record only if it fits the store's budget
in the transaction that would index it (another process's writes meanwhile count), and an archive larger
than the room left fills it, most recently used records first (the export's order), a block only after
the blocks before it in its prompt; the rest is counted as ``no_room``. Records keep their last access time from the source (never later than now), so the store's
LRU order and sliding TTL go on as they were.

What is refused, record by record: a frame whose body is damaged (its checksums), a record whose token
ids do not hash to its key, a record of a namespace the archive's head does not declare with a spec that
hashes to its digest, a record whose dtype, shape or token count is not its namespace's (checked before a
compressed payload is inflated: its size is bounded by the spec), a creation or access time that is not a
finite time at most CLOCK_SKEW_S ahead of ours (then clamped to now), and, with a secret, a record whose
MAC does not verify.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import xxhash

from tierkv.archive.frames import ArchiveError, Frame, FrameReader, Kind, frame_mac, mac_key
from tierkv.codec import Header, check_stored, decode_header, unseal
from tierkv.errors import ConfigError, RecordError
from tierkv.keys import BlockKey, Namespace, root_key
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk.segments import aligned
from tierkv.tiers.disk.writer import Put

__all__ = ["ImportReport", "import_archive"]

_ROOM_WAIT_S = 0.002
CLOCK_SKEW_S = 300.0  # a record "created" this far past our clock is refused (another node's clock)


@dataclasses.dataclass
class ImportReport:
    imported: int = 0  # indexed in the store
    imported_nbytes: int = 0
    present: int = 0  # the store already held it
    expired: int = 0  # past the store's TTL or max age
    no_room: int = 0  # past the store's byte budget
    refused: int = 0  # damaged, forged, or not what its frame or namespace says: never stored
    unreachable: int = 0  # its prompt's earlier blocks are neither in the store nor imported: never a hit
    not_written: int = 0  # verified and queued, but the disk tier dropped it (a full disk, a write error)
    damaged_regions: int = 0  # stretches of the archive skipped to find the next good frame
    planned: int = 0  # records the archive's head announced
    complete: bool = False  # the end frame was read, and every record it counts was seen
    digest_ok: bool | None = None  # the end frame's records digest matched (None: not comparable)
    signed: bool = False  # every record's MAC was verified with the importer's key
    stream_error: str | None = None  # why the stream ended early, when reading it failed
    interrupted: bool = False  # stopped by Ctrl-C: what was queued before it is written
    archive_nbytes: int = 0

    @property
    def seen(self) -> int:
        return (
            self.imported
            + self.present
            + self.expired
            + self.no_room
            + self.refused
            + self.unreachable
            + self.not_written
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seen": self.seen}


def _json(body: bytes | bytearray | None) -> dict[str, Any] | None:
    try:
        out = json.loads(body) if body is not None else None
    except (ValueError, RecursionError):  # damaged, or nested to exhaust the parser
        return None
    return out if isinstance(out, dict) else None


def _specs(head: dict[str, Any]) -> dict[bytes, Namespace]:
    """Namespace digest -> its spec, for the specs in the head that parse and hash to their digest. A
    record of any other namespace is refused: without its spec, its shape cannot be bounded."""
    out: dict[bytes, Namespace] = {}
    rows = head.get("namespaces")
    if not isinstance(rows, dict):
        return out
    for hex_digest, row in rows.items():
        try:
            ns = Namespace.from_json(row["spec"])
            if ns.digest == bytes.fromhex(hex_digest):
                out[ns.digest] = ns
        except (ValueError, TypeError, KeyError, ConfigError, RecursionError):
            continue
    return out


def _refusal(frame: Frame, specs: dict[bytes, Namespace], mac: bytes | None, now: float) -> Header | None:
    """The record's header if it may be stored, else None. The MAC first (cheap to refuse a forgery),
    then the header against its namespace before the payload is decoded (a compressed payload's size is
    bounded by its shape), then the whole record."""
    body = frame.body
    if body is None:
        return None
    if mac is not None and not hmac.compare_digest(frame.mac, frame_mac(mac, frame.fields, body)):
        return None
    try:
        header, _, _ = decode_header(memoryview(body))
        ns = specs.get(header.ns_digest)
        if ns is None or header.dtype != ns.dtype or header.token_count != ns.block_tokens:
            return None
        if header.shape != (ns.num_layers, 2, ns.block_tokens, ns.num_kv_heads, ns.head_dim):  # KVSpec's
            return None
        if not (math.isfinite(header.created_s) and 0 <= header.created_s <= now + CLOCK_SKEW_S):
            return None
        if not (math.isfinite(frame.time_s) and 0 <= frame.time_s <= now + CLOCK_SKEW_S):
            return None
        return check_stored(memoryview(body), frame.key)
    except RecordError:
        return None


@dataclasses.dataclass
class Opened:
    """An archive whose file head and head frame were read, and its signing checked against the secret:
    what ``open_archive`` gives, before any store is opened."""

    reader: FrameReader
    head: dict[str, Any]
    head_frame: Frame | None  # None: the first frame was not a head (damaged): nothing to check
    mac: bytes | None


def open_archive(src: BinaryIO | FrameReader, secret: bytes | None) -> Opened:
    """Read the archive's file head and its head frame; ArchiveError if it is not an archive this build
    reads, or its signing and ``secret`` disagree (a wrong secret, none for a signed archive)."""
    if isinstance(src, FrameReader):
        reader = src
    else:
        reader = FrameReader(src)
    reader.read_file_head()
    first = next(reader.frames(), None)
    if first is None or first.kind != Kind.HEAD:
        reader.pushback(first)
        return Opened(reader, {}, None, None)
    head = _json(first.body) or {}
    return Opened(reader, head, first, _head_key(head, first, secret))


def import_archive(
    disk: DiskTier,
    src: BinaryIO | Opened,
    progress: Callable[[ImportReport], None] | None = None,
    timeout_s: float = 600.0,
    secret: bytes | None = None,
    stop: threading.Event | None = None,
) -> ImportReport:
    """Import every verified record of the archive on ``src`` that the store lacks and has room for.

    ``secret``: every frame must carry a MAC made with the key derived from it and the archive's salt
    (``frames.mac_key``); an archive signed with another secret, or not signed, is an ArchiveError before
    anything is stored. Without one, a signed archive is an ArchiveError too (its signer meant it to be
    checked). ArchiveError also if ``src`` is not an archive this build reads; anything damaged inside it
    is counted, not raised. ``progress(report)`` every few records; ``stop``: set it (a Ctrl-C handler) to
    stop reading, what was queued is still written and counted."""
    if disk.writer is None:
        raise ConfigError("import needs a disk tier opened with a writer")
    opened = src if isinstance(src, Opened) else open_archive(src, secret)
    reader, mac = opened.reader, opened.mac
    report = ImportReport()
    state = _State(disk)
    state.specs = _specs(opened.head)
    planned = opened.head.get("blocks")
    report.planned = planned if isinstance(planned, int) else 0
    end: dict[str, Any] | None = None
    try:
        for frame in reader.frames(stop):
            if frame.kind == Kind.END:
                signed = mac is None or _mac_ok(frame, mac)
                end = _json(frame.body) if signed else None
            elif frame.kind == Kind.RECORD:
                if secret is not None and mac is None:  # the head was lost: nothing can be checked
                    report.refused += 1
                else:
                    state.take(frame, mac, report, timeout_s)
                if progress is not None and (report.seen + len(state.queued)) % 64 == 0:
                    progress(report)
            # Another kind (a newer writer's), or a second head: nothing to store.
    finally:
        reader.close()
    report.interrupted = stop is not None and stop.is_set()
    if not disk.flush(timeout_s):
        raise OSError("the disk tier did not finish writing the imported records in time")
    dropped_queued = max(0, _dropped(disk) - state.dropped_before - state.writer_refused)
    report.not_written += state.writer_refused + state.timed_out
    _settle(disk, state.queued, dropped_queued, report)
    report.damaged_regions = reader.damaged_regions
    report.archive_nbytes = reader.nbytes_read
    report.stream_error = reader.error
    report.signed = mac is not None
    if end is not None:
        blocks = end.get("blocks")
        report.complete = not reader.truncated and reader.error is None and blocks == report.seen
        if report.refused == 0 and report.complete:
            report.digest_ok = end.get("records_xxh3") == state.digest.hexdigest()
    if progress is not None:
        progress(report)
    return report


class _State:
    """What an import tracks between records."""

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self.specs: dict[bytes, Namespace] = {}
        self.digest = xxhash.xxh3_64()
        self.dropped_before = _dropped(disk)
        self.queued: list[tuple[bytes, int]] = []  # key, record nbytes
        self.writer_refused = 0  # put returned False: the writer counted each as a dropped save
        self.timed_out = 0  # the writer's queue never had room in time (not counted by the writer)
        self.landed: set[bytes] = set()  # keys present or queued: the blocks after them may follow
        self.no_room: set[bytes] = set()  # keys left out for room: the blocks after them are too
        with disk.index.read() as txn:  # the room left, as an estimate: the writer decides, in its txn
            self.used_nbytes = disk.index.total_nbytes(txn)

    def take(self, frame: Frame, mac: bytes | None, report: ImportReport, timeout_s: float) -> None:
        disk, policy = self.disk, self.disk.policy
        now = disk.clock()
        header = _refusal(frame, self.specs, mac, now)
        if header is None or frame.body is None:
            report.refused += 1
            return
        self.digest.update(frame.key + header.payload_checksum.to_bytes(8, "little"))
        access_s = min(frame.time_s, now)
        created_s = min(header.created_s, now)  # a source clock a little ahead (CLOCK_SKEW_S)
        parent = bytes(header.parent_key)
        footprint = aligned(frame.body_nbytes)
        if disk.holds([BlockKey(frame.key)])[0]:
            report.present += 1
            self.landed.add(frame.key)
        elif parent in self.no_room:
            report.no_room += 1
            self.no_room.add(frame.key)
        elif not self._reachable(header):
            report.unreachable += 1
        elif policy.expired_at(created_s, access_s, now):
            report.expired += 1
        elif policy.budget_nbytes is not None and self.used_nbytes + footprint > policy.budget_nbytes:
            report.no_room += 1  # not even written: the writer would skip it
            self.no_room.add(frame.key)
        else:
            after = None if parent == root_key(header.ns_digest) else parent
            ns = self.specs[header.ns_digest]
            got = _queue(disk, frame.key, frame.body, header, ns, created_s, access_s, after, timeout_s)
            if got:
                self.queued.append((frame.key, frame.body_nbytes))
                self.landed.add(frame.key)
                self.used_nbytes += footprint
            elif got is None:
                self.timed_out += 1
            else:
                self.writer_refused += 1

    def _reachable(self, header: Header) -> bool:
        """Whether a prompt could reach this block from position 0 here: its parent is its namespace's
        root, or a block the store holds or this import queued (the export sends prefixes first)."""
        parent = bytes(header.parent_key)
        if parent == root_key(header.ns_digest) or parent in self.landed:
            return True
        return self.disk.holds([BlockKey(parent)])[0]


def _mac_ok(frame: Frame, mac: bytes) -> bool:
    return frame.body is not None and hmac.compare_digest(frame.mac, frame_mac(mac, frame.fields, frame.body))


def _head_key(head: dict[str, Any], frame: Frame, secret: bytes | None) -> bytes | None:
    """The archive's MAC key, from the secret and the salt in its head, once the head's own MAC verifies
    with it; None without a secret. ArchiveError when signing and secret disagree."""
    signed = head.get("mac")
    if secret is None:
        if signed:
            raise ArchiveError(
                "this archive is signed: give its secret (--secret-file, or --token for a server's export)"
            )
        return None
    salt = signed.get("salt") if isinstance(signed, dict) else None
    if not isinstance(salt, str):
        raise ArchiveError("this archive is not signed, and a secret was given: nothing in it can be trusted")
    try:
        key = mac_key(secret, bytes.fromhex(salt))
    except ValueError:
        raise ArchiveError("this archive's signature is malformed") from None
    if not _mac_ok(frame, key):
        raise ArchiveError("this archive was signed with another secret (or its head was altered)")
    return key


def _settle(disk: DiskTier, queued: list[tuple[bytes, int]], dropped: int, report: ImportReport) -> None:
    """Count what the writer did with the queued records, from the index: indexed is imported; of the
    rest, what it dropped (``dropped``: degraded, gone) was not written, and what it skipped had no room
    left in the budget."""
    if not queued:
        return
    held = disk.holds([BlockKey(k) for k, _ in queued])
    for (_, nbytes), ok in zip(queued, held):
        if ok:
            report.imported += 1
            report.imported_nbytes += nbytes
    missing = len(queued) - report.imported
    report.not_written += min(dropped, missing)
    report.no_room += missing - min(dropped, missing)


def _dropped(disk: DiskTier) -> int:
    return disk.counters.snapshot().get("disk", {}).get("dropped_saves", 0)


def _queue(
    disk: DiskTier,
    key: bytes,
    body: bytes | bytearray,
    header: Header,
    ns: Namespace,
    created_s: float,
    access_s: float,
    after: bytes | None,
    timeout_s: float,
) -> bool | None:
    """Hand a record to the disk tier's writer, waiting while its queue is full (an import is a bulk
    writer: it waits for room rather than drop). False if the tier stopped accepting writes (the writer
    counted the drop); None if its queue had no room for ``timeout_s``."""
    writer = disk.writer
    assert writer is not None
    # Unsealed: the writer seals it again (the same record: it verified, laid out in the record version
    # this store takes) on its native path, O_DIRECT where the file system allows, instead of a buffered
    # write of the sealed bytes.
    record = unseal(memoryview(body), header, disk.record_version)
    item = Put(
        header.ns_digest,
        key,
        lambda: record,
        record.nbytes,
        created_s,
        None,
        ns.spec_bytes,
        access_s=access_s,
        evict=False,
        after=after,
        parent=bytes(header.parent_key),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        got = writer.put(item, full_ok=True)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            return None
        time.sleep(_ROOM_WAIT_S)
