import torch

from tierkv.keys import BlockKey
from tierkv.tiers.host import HostTier


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 32)


def _block(v: float) -> torch.Tensor:
    return torch.full((2, 2, 4, 1, 2), v, dtype=torch.float32)  # 128 bytes


def test_put_read_roundtrip_and_slots_preallocated() -> None:
    host = HostTier(1024, pin=False)
    assert host.put(_key(1), _block(1.5)) is not None
    assert host.num_slots == 8 and host.slot_nbytes == 128
    with host.read([_key(1), _key(2)]) as views:
        assert views[1] is None
        assert torch.equal(views[0].view(torch.float32).view(2, 2, 4, 1, 2), _block(1.5))


def test_lru_eviction_order() -> None:
    host = HostTier(3 * 128, pin=False)
    for i in range(3):
        host.put(_key(i), _block(i))
    with host.read([_key(0)]):  # touch 0: now 1 is the least recently used
        pass
    host.put(_key(3), _block(3))
    host.put(_key(4), _block(4))
    assert host.contains([_key(i) for i in range(5)]) == [True, False, False, True, True]
    assert host.counters.snapshot()["host"]["evictions"] == 2


def test_referenced_slots_are_never_evicted() -> None:
    host = HostTier(2 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    host.put(_key(1), _block(1))
    host.put(_key(2), _block(2))  # evicts 1, not the held 0
    assert host.contains([_key(0), _key(1), _key(2)]) == [True, False, True]
    with host.read([_key(2)]):
        assert host.put(_key(3), _block(3)) is None  # every slot is referenced
    host.release(held)
    assert host.put(_key(3), _block(3)) is not None


def test_block_of_another_size_is_refused() -> None:
    host = HostTier(1024, pin=False)
    host.put(_key(0), _block(0))
    assert host.put(_key(1), torch.zeros(3, dtype=torch.float32)) is None


def test_zero_capacity_keeps_nothing() -> None:
    host = HostTier(64, pin=False)
    assert host.put(_key(0), _block(0)) is None
    assert len(host) == 0


def test_put_many_writes_new_blocks_in_one_indexed_copy_and_touches_known_ones() -> None:
    host = HostTier(4 * 128, pin=False)
    host.put(_key(1), _block(-1))  # already there: kept as is, only touched
    host.put(_key(9), _block(9))
    stack = torch.stack([_block(v) for v in (0, 1, 2)])
    assert host.put_many([_key(0), _key(1), _key(2)], stack) == 2
    host.put(_key(3), _block(3))  # the pool is full: evicts 9, the least recently used
    assert host.contains([_key(i) for i in (0, 1, 2, 3, 9)]) == [True, True, True, True, False]
    with host.read([_key(0), _key(1), _key(2)]) as views:
        got = [v.view(torch.float32).view(2, 2, 4, 1, 2) for v in views]
    assert torch.equal(got[0], _block(0)) and torch.equal(got[1], _block(-1)) and torch.equal(got[2], _block(2))


def test_put_many_stops_when_every_slot_is_referenced() -> None:
    host = HostTier(2 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    assert host.put_many([_key(1), _key(2), _key(3)], torch.stack([_block(v) for v in (1, 2, 3)])) == 1
    assert host.contains([_key(1), _key(2), _key(3)]) == [True, False, False]
    with host.read([_key(1)]) as (view,):  # a later block of the batch did not take its slot
        assert torch.equal(view.view(torch.float32).view(2, 2, 4, 1, 2), _block(1))
    host.release(held)
