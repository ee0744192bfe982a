"""Upgrading a store written by an older build (format 1 or 2) to format 3: an operator's step (``tierkv gc
--upgrade``), never a request's, since older builds refuse the store afterwards, and one still running
beside it would fail on the first entry with a retention (format 1) or record in the new layout."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tierkv.errors import StoreFormatError, StoreOpenError
from tierkv.tiers.disk.index import Index, Txn
from tierkv.tiers.disk.schema import STORE_FORMAT_VERSION, Entry

__all__ = ["upgrade"]

log = logging.getLogger("tierkv.disk")


def upgrade(index: Index, parents: Callable[[list[Entry]], Sequence[bytes | None]]) -> int:
    """Mark a store of format 1 or 2 format 3, after filling the ``parents`` and ``children`` rows of its
    entries (those a format-1 build left unfilled) from ``parents(entries)`` (the records' own parent
    keys). An operator's step (``tierkv gc --upgrade``): older builds refuse the store afterwards, and
    one still running beside it would fail on the first entry with a retention or the first record in
    the new layout, so they are stopped first. Returns how many rows were filled."""
    with index.sole_owner() as alone:
        if not alone:  # an older build among them would misread or refuse what follows the mark
            raise StoreOpenError(
                f"{index.path}: other processes have this store open (a server, or an older tierkv): stop "
                "them, then upgrade"
            )
        filled = 0
        batch: list[tuple[bytes, Entry]] = []

        def fill(items: list[tuple[bytes, Entry]]) -> int:
            with index.read() as txn:  # only those a format-1 build left without the row: a read each
                items = [(k, e) for k, e in items if txn.get(k, db=index.db["parents"]) is None]
            if not items:
                return 0
            keys = [k for k, _ in items]
            found = parents([e for _, e in items])

            def put(txn: Txn) -> int:
                n = 0
                for key, parent in zip(keys, found):
                    if parent is not None and txn.get(key, db=index.db["index"]) is not None:
                        if txn.get(key, db=index.db["parents"]) is None:
                            txn.put(key, bytes(parent), db=index.db["parents"])
                            txn.put(bytes(parent) + key, b"", db=index.db["children"])
                            n += 1
                return n

            return index.write(put)

        for key, e in index.iter_entries():
            batch.append((bytes(key), e))
            if len(batch) >= 1024:
                filled += fill(batch)
                batch = []
        if batch:
            filled += fill(batch)

        def mark(txn: Txn) -> None:
            version = index.format_version(txn)
            if version > STORE_FORMAT_VERSION:
                raise StoreFormatError(f"{index.path}: format version {version} is newer than this build's")
            txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(), db=index.db["meta"])

        index.write(mark)
        log.info("disk tier %s: marked format version %d", index.path, STORE_FORMAT_VERSION)
        return filled
