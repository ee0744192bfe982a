"""The disk tier in words: its part of a server's start-up line and of ``tierkv stats`` (its budget, TTL,
pins and sweep; whether the file system can hold the budget; which reader and writer serve it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv import native
from tierkv.paths import room_short_of
from tierkv.units import format_size

if TYPE_CHECKING:
    from tierkv.tiers.disk import DiskTier

__all__ = ["read_path", "setup"]


def setup(disk: DiskTier) -> str:
    """How the tier is set up, in one phrase (the server's start-up line)."""
    p = disk.policy
    budget = format_size(p.budget_nbytes) if p.budget_nbytes else "no budget"
    ttl = f"ttl {p.ttl_s:.0f}s" if p.ttl_s else "no ttl"
    if p.pin_limit_nbytes:
        ttl += f", pins up to {format_size(p.pin_limit_nbytes)}"
    sweeper = disk._sweeper
    sweep = f"swept every {sweeper.interval_s:g}s" if sweeper is not None else "no background sweep"
    return f"disk {budget} at {disk.path} ({ttl}, {sweep}){_room(disk)}; data path {read_path(disk)}"


def _room(disk: DiskTier) -> str:
    """A clause where the budget is more than this file system can give the store (what it holds and what
    is free): the disk fills before the budget evicts, and saves are dropped."""
    room = room_short_of(disk.path, disk.policy.budget_nbytes)
    if room is None:
        return ""
    return (
        f" (WARNING: more than the {format_size(room)} this file system has for the store: the budget never "
        "evicts, and once the disk is full saves are dropped until expiries make room; set it lower)"
    )


def read_path(disk: DiskTier) -> str:
    """Which reader serves the tier: native (O_DIRECT or buffered) or Python, and why."""
    if not native.enabled():
        return native.describe() + ", reads buffered"
    seg = disk.segments
    refused = "buffered: this file system refuses O_DIRECT"
    note = f" ({disk._reads_note})" if disk._reads_note else ""
    if seg.direct_reads:
        how = disk.read_modes.describe() + note if seg.direct_ok else refused
    else:
        how = "buffered with readahead" + note
    writes = ("O_DIRECT" if seg.direct_ok else refused) if seg.direct_writes else "buffered"
    return (
        f"native (reads {how}, {native.READ_THREADS} in flight; writes {writes}, sealed and synced natively)"
    )
