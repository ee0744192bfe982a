"""Export: the verified records of a disk tier as an archive stream (``frames``).

Reads only (safe beside a server writing to the same directory, and what the server's
``GET /admin/export`` streams). The selection is one snapshot of the index; a record removed since (a
sweep, an eviction) is left out and counted as vanished, not as corrupt. Records go out most recently used
first (parents before their children at equal times), so an import into a smaller budget keeps the hottest
prefixes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from tierkv.archive.frames import Kind, file_head, frame_fields, frame_head, frame_mac, json_frame, mac_key
from tierkv.codec import check_stored, parent_key_of, seal, unseal
from tierkv.errors import ConfigError, RecordError
from tierkv.keys import BlockKey, Namespace, NamespaceDigest, root_key
from tierkv.tiers.disk import DiskTier, Entry
from tierkv.tiers.disk.segments import aligned

__all__ = ["ExportReport", "Selection", "archive_chunks", "prefixes_first", "read_parents", "select"]

BATCH_NBYTES = 32 << 20  # read and verified together (in parallel), then written out
BATCH_RECORDS = 256


@dataclasses.dataclass
class Selection:
    """What an export writes: entries in the order they go out, and their namespaces' specs."""

    entries: list[tuple[BlockKey, Entry]]
    specs: dict[NamespaceDigest, Namespace]
    no_spec: int = 0  # entries left out: their namespace has no spec row in the store

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for _, e in self.entries)


@dataclasses.dataclass
class ExportReport:
    blocks: int = 0
    record_nbytes: int = 0
    archive_nbytes: int = 0
    corrupt: int = 0  # failed verification while still indexed: left out (``tierkv gc --check`` purges)
    vanished: int = 0  # removed from the store after the selection (a sweep, an eviction)
    no_spec: int = 0  # left out: their namespace's spec is not in the store (an importer refuses them)
    planned: int = 0
    namespaces: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def select(
    disk: DiskTier, namespaces: Sequence[str] = (), models: Sequence[str] = (), now: float | None = None
) -> Selection:
    """The unexpired entries of the namespaces given (digests or unique prefixes of them) and of the models
    given (as ``tierkv serve --model`` or ``tierkv stats`` name them); everything when neither is given.
    ConfigError on a prefix that names no namespace, or several. Entries of a namespace whose spec the
    store lacks are left out (an importer could not check their shape) and counted. Cheap: the order
    (``archive_chunks`` takes it, reading every record's first page) is not taken here."""
    from tierkv.maintenance import resolve_namespace

    known = disk.namespaces()
    entries = disk.index.snapshot_entries()
    present = {NamespaceDigest(e.ns_digest) for _, e in entries}
    wanted: set[bytes] | None = None
    if namespaces or models:
        wanted = {resolve_namespace(disk, p, also=present) for p in namespaces}
        wanted |= {d for d, ns in known.items() if any(_is_model(ns, m) for m in models)}
        if missing := [m for m in models if not any(_is_model(ns, m) for ns in known.values())]:
            have = sorted({ns.model_id for ns in known.values()})
            raise ConfigError(
                f"no namespace in this store is of model {', '.join(missing)} (its models: "
                f"{', '.join(have) or 'none'})"
            )
    t = disk.clock() if now is None else now
    chosen = [
        (k, e)
        for k, e in entries
        if (wanted is None or e.ns_digest in wanted) and not disk.policy.expired(e, t)
    ]
    no_spec = sum(1 for _, e in chosen if NamespaceDigest(e.ns_digest) not in known)
    chosen = [(k, e) for k, e in chosen if NamespaceDigest(e.ns_digest) in known]
    specs = {NamespaceDigest(e.ns_digest): known[NamespaceDigest(e.ns_digest)] for _, e in chosen}
    return Selection(chosen, specs, no_spec)


def read_parents(disk: DiskTier, entries: Sequence[Entry]) -> list[BlockKey | None]:
    """Each record's parent key, read from the first page of its header, unverified (None where it is not
    a record's): how an export orders prefixes before their continuations."""
    out: list[BlockKey | None] = []
    for at in range(0, len(entries), 4096):  # 16 MiB of first pages at a time
        heads = [dataclasses.replace(e, nbytes=min(e.nbytes, 4096)) for e in entries[at : at + 4096]]
        with disk.read(heads) as views:
            out += [parent_key_of(v) for v in views]
    return out


_ORPHAN = -(1 << 62)


def _depths(parents: list[BlockKey | None], parent_at: list[int | None], roots: set[bytes]) -> list[int]:
    """Each block's position in its prompt (0: its parent is its namespace's root), following parent
    links; _ORPHAN where the chain breaks (a parent not here, unreadable, or a cycle in damaged data)."""
    depth: list[int | None] = [None] * len(parents)
    for i in range(len(parents)):
        path: list[int] = []
        on_path: set[int] = set()
        j = i
        while True:
            known = depth[j]
            if known is not None:
                top = known
                break
            if j in on_path:
                top = _ORPHAN
                break
            path.append(j)
            on_path.add(j)
            p = parents[j]
            if p is not None and bytes(p) in roots:
                top = -1  # the root: path's last block is at 0
                break
            nxt = parent_at[j]
            if nxt is None:
                top = _ORPHAN
                break
            j = nxt
        for n, k in enumerate(reversed(path), start=1):
            depth[k] = _ORPHAN if top == _ORPHAN else top + n
    return [d if d is not None else _ORPHAN for d in depth]


def _is_model(ns: Namespace, name: str) -> bool:
    """Whether ``name`` names the namespace's model: its model id, or as ``tierkv serve --model`` (smollm2,
    a directory) or ``tierkv stats`` (id@revision) name it."""
    from tierkv.models import BUILTIN

    if name in BUILTIN:
        return ns.model_id == BUILTIN[name].dirname
    base = name.split("@", 1)[0]
    return ns.model_id in (base, base.rstrip("/").rsplit("/", 1)[-1])


def prefixes_first(disk: DiskTier, entries: list[tuple[BlockKey, Entry]]) -> list[tuple[BlockKey, Entry]]:
    """Most recently used first, and every block after the blocks before it in its prompt: a block counts
    as recent as the most recent block after it (a hit touches its whole prefix, but a continuation saved
    later is newer than the prefix it extends), and among equals the shorter prefix goes first. So an
    import that runs out of room keeps whole prefixes, never a continuation without its start. Blocks whose
    prefix is not in the selection (it was evicted) can never be hit from position 0: they go last."""
    parents = read_parents(disk, [e for _, e in entries])
    at = {bytes(k): i for i, (k, _) in enumerate(entries)}
    parent_at = [at.get(bytes(p)) if p is not None else None for p in parents]
    roots = {bytes(root_key(NamespaceDigest(e.ns_digest))) for _, e in entries}
    depth = _depths(parents, parent_at, roots)
    recent = [e.last_access_s for _, e in entries]
    for i in sorted(range(len(entries)), key=lambda i: -depth[i]):  # deepest first: up the chains
        j = parent_at[i]
        if j is not None and depth[i] != _ORPHAN:
            recent[j] = max(recent[j], recent[i])
    reachable = [i for i in range(len(entries)) if depth[i] != _ORPHAN]
    orphans = [i for i in range(len(entries)) if depth[i] == _ORPHAN]
    reachable.sort(key=lambda i: (-recent[i], depth[i], entries[i][1].created_s))
    orphans.sort(key=lambda i: -recent[i])
    return [entries[i] for i in reachable + orphans]


def _head(sel: Selection, salt: bytes | None) -> dict[str, Any]:
    per_ns: dict[str, dict[str, Any]] = {}
    for digest, ns in sel.specs.items():
        per_ns[digest.hex()] = {"spec": ns.to_json(), "blocks": 0, "nbytes": 0}
    for _, e in sel.entries:
        row = per_ns[e.ns_digest.hex()]
        row["blocks"] += 1
        row["nbytes"] += e.nbytes
    from tierkv import __version__

    return {
        "format": "tierkv-archive",
        "tierkv": __version__,
        "created_s": time.time(),
        "blocks": len(sel.entries),
        "nbytes": sel.nbytes,
        "namespaces": per_ns,
        "mac": None if salt is None else {"algorithm": "blake2b-256", "kdf": "scrypt", "salt": salt.hex()},
    }


def _batches(entries: list[tuple[BlockKey, Entry]]) -> Generator[list[tuple[BlockKey, Entry]], None, None]:
    batch: list[tuple[BlockKey, Entry]] = []
    nbytes = 0
    for ke in entries:
        if batch and (nbytes + aligned(ke[1].nbytes) > BATCH_NBYTES or len(batch) >= BATCH_RECORDS):
            yield batch
            batch, nbytes = [], 0
        batch.append(ke)
        nbytes += aligned(ke[1].nbytes)
    if batch:
        yield batch


def _read_verified(
    disk: DiskTier, batch: list[tuple[BlockKey, Entry]], mac: bytes | None
) -> tuple[list[memoryview], list[int | None], list[bytes]]:
    """Read a batch into one new buffer and verify each record on the reading threads (and MAC it, with a
    key); per record its view, its payload checksum (None: unreadable, or it failed verification) and its
    MAC (zeros without a key)."""
    buf = bytearray(sum(e.nbytes for _, e in batch))
    views: list[memoryview] = []
    pos = 0
    for _, e in batch:
        views.append(memoryview(buf)[pos : pos + e.nbytes])
        pos += e.nbytes
    checks: list[int | None] = [None] * len(batch)
    macs = [bytes(32)] * len(batch)
    # Read in file order (adjacent records coalesce into one read); written out in the batch's order.
    order = sorted(range(len(batch)), key=lambda i: batch[i][1].location[:2])

    def verify(j: int) -> bool:
        key, e = batch[order[j]]
        try:
            header = check_stored(views[order[j]], key)
        except RecordError:
            return False
        if header.ns_digest != e.ns_digest:
            return False
        if header.version != 1:  # archives carry version 1, which every build reads (imports re-lay it)
            views[order[j]] = memoryview(b"".join(seal(unseal(views[order[j]], header, 1))))
        checks[order[j]] = header.payload_checksum
        if mac is not None:
            fields = frame_fields(Kind.RECORD, bytes(key), views[order[j]].nbytes, e.last_access_s)
            macs[order[j]] = frame_mac(mac, fields, views[order[j]])
        return True

    disk.read_scatter([(batch[i][1], [views[i]]) for i in order], verify)
    return views, checks, macs


def _frames(
    disk: DiskTier,
    batch: list[tuple[BlockKey, Entry]],
    views: list[memoryview],
    checks: list[int | None],
    macs: list[bytes],
    report: ExportReport,
    digest: Any,
) -> Generator[bytes | memoryview, None, None]:
    """A read batch's frames; what did not verify is counted (corrupt if still indexed, else vanished)."""
    for i, (key, e) in enumerate(batch):
        check = checks[i]
        if check is None:
            if disk.index.still_indexed(key, e.location):
                report.corrupt += 1
            else:
                report.vanished += 1
            continue
        digest.update(bytes(key) + check.to_bytes(8, "little"))
        nbytes = views[i].nbytes  # the record in version 1 (an entry's may be longer)
        head = frame_head(Kind.RECORD, bytes(key), nbytes, e.last_access_s, macs[i])
        report.blocks += 1
        report.record_nbytes += nbytes
        report.archive_nbytes += len(head) + nbytes
        row = report.namespaces.setdefault(e.ns_digest.hex(), {"blocks": 0, "nbytes": 0})
        row["blocks"] += 1
        row["nbytes"] += nbytes
        yield head
        yield views[i]


def archive_chunks(
    disk: DiskTier,
    sel: Selection,
    progress: Callable[[int, int], None] | None = None,
    secret: bytes | None = None,
) -> Generator[bytes | memoryview, None, ExportReport]:
    """The archive of ``sel``, as chunks to write or send in order; returns the report when exhausted.
    ``progress(blocks, nbytes)`` after each batch; ``secret``: every frame is signed with a key derived
    from it and a salt of this archive's own (``frames.mac_key``)."""
    report = ExportReport(planned=len(sel.entries), no_spec=sel.no_spec)
    digest = xxhash.xxh3_64()
    salt = os.urandom(16) if secret is not None else None
    mac = mac_key(secret, salt) if secret is not None and salt is not None else None
    sel.entries = prefixes_first(disk, sel.entries)
    for chunk in (file_head(), json_frame(Kind.HEAD, _head(sel, salt), mac)):
        report.archive_nbytes += len(chunk)
        yield chunk
    # One batch read ahead on a thread (the reads release the GIL) while the previous one is written out.
    batches = list(_batches(sel.entries))
    with ThreadPoolExecutor(1, thread_name_prefix="tierkv-export") as pool:
        ahead = pool.submit(_read_verified, disk, batches[0], mac) if batches else None
        for k, batch in enumerate(batches):
            assert ahead is not None
            views, checks, macs = ahead.result()
            ahead = pool.submit(_read_verified, disk, batches[k + 1], mac) if k + 1 < len(batches) else None
            yield from _frames(disk, batch, views, checks, macs, report, digest)
            if progress is not None:
                progress(report.blocks, report.record_nbytes)
    end = json_frame(
        Kind.END,
        {
            "blocks": report.blocks,
            "nbytes": report.record_nbytes,
            "namespaces": report.namespaces,
            "corrupt": report.corrupt,
            "vanished": report.vanished,
            "records_xxh3": digest.hexdigest(),
        },
        mac,
    )
    report.archive_nbytes += len(end)
    yield end
    return report
