"""Pin admission: whether a pin fits in the disk tier's pin budget, decided before the work it pins.

The pinned bytes are exact in the index (``meta`` ``pinned``), less pins that have ended but were not swept
yet; pins asked for and not written yet (their blocks still on their way) count too, at the size their
records will have. The transaction that writes a pin checks again (another process may have pinned
meanwhile) and counts what it refused (``pins_refused``): this check is what lets a client hear "no".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.errors import PinBudgetError
from tierkv.keys import BlockChain
from tierkv.tenancy import tenant_id
from tierkv.tiers.disk.schema import Entry
from tierkv.tiers.disk.segments import aligned
from tierkv.units import format_size

if TYPE_CHECKING:
    from tierkv.tiers.disk import DiskTier

__all__ = ["check_pin"]


def check_pin(disk: DiskTier, chain: BlockChain, count: int, record_nbytes: int) -> None:
    """Raise ``PinBudgetError`` unless pinning blocks ``0..count-1`` of ``chain`` (records of about
    ``record_nbytes`` where not stored yet) fits in the pin budget, with the pins already taken and
    those asked for and not yet written. A pin that adds no bytes (all pinned already) always fits."""
    limit = disk.policy.pin_limit_nbytes
    if disk.read_only or limit <= 0:
        raise PinBudgetError(
            "this store takes no pins: its disk tier has no pin budget (give it --pin-budget, or a "
            "--disk-budget, whose quarter pins may use)"
        )
    disk.check_retention()
    keys = [bytes(k) for k in chain.keys[:count]]
    asked = set(keys)
    pending = [k for k in disk.times.pending_pins() if k not in asked]  # (of every tenant)
    now = disk.clock()
    with disk.index.read() as txn:
        pinned = disk.index.live_pinned_nbytes(txn, now)
        mine = theirs = 0
        for i, key in enumerate(keys + pending):
            raw = txn.get(key, db=disk.index.db["index"])
            e = Entry.unpack(raw) if raw is not None else None
            if e is None or disk.policy.expired(e, now):
                add = aligned(record_nbytes)
            elif e.pin_until_s <= now:
                add = e.footprint
            else:
                add = 0
            if i < len(keys):
                mine += add
            else:
                theirs += add
    tid = tenant_id(chain.ns.tenant_salt)
    if tid is not None:  # a tenant hears of its own pins only, never of the store's (a side channel)
        _check_tenant(disk, chain, tid, mine, limit - pinned - theirs)
        return
    if mine and pinned + theirs + mine > limit:
        raise PinBudgetError(
            f"pin refused: it needs {format_size(mine)} more, and {format_size(pinned + theirs)} of the "
            f"{format_size(limit)} pin budget is pinned already (or on its way): pin a shorter prefix, "
            "wait for pins to end, or give the server a larger --pin-budget"
        )


def _check_tenant(disk: DiskTier, chain: BlockChain, tid: bytes, mine: int, store_room: int) -> None:
    """A tenant's pin: within its pin quota (if it has one), and within the store's budget. Its own
    pinned bytes count as in the index (pins that ended and were not swept yet too: conservative)."""
    if not mine:
        return
    with disk.index.read() as txn:
        quotas = disk.index.tenants.quotas(txn)
        own = disk.index.tenants.pinned_nbytes(txn, tid)
    q = quotas.get(tid)
    if q is not None and q.pin_nbytes is not None and own + mine > q.pin_nbytes:
        raise PinBudgetError(
            f"pin refused: it needs {format_size(mine)} more, and {format_size(own)} of your "
            f"{format_size(q.pin_nbytes)} pin quota is pinned already: pin a shorter prefix or wait for "
            "pins to end"
        )
    reserved = [x.pin_nbytes for x in quotas.values()]
    if q is not None and q.pin_nbytes is not None and None not in reserved:
        if sum(r for r in reserved if r is not None) <= disk.policy.pin_limit_nbytes:
            # Every tenant's pins fit in the budget: decided on the tenant's own quota alone, so that the
            # answer says nothing of the others' pins (the writing transaction still checks the budget).
            return
    if mine > store_room:  # one bit of the others' pins: what a shared budget cannot help telling
        raise PinBudgetError(
            "pin refused: the store's pin budget is taken: pin a shorter prefix, or try again later"
        )
