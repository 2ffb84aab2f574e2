"""BlockAllocator and block_runs (runtime/allocator.py): exhaustion errors, reuse, contiguous runs."""
import pytest

from xoffload.runtime import BlockAllocator, PoolExhaustedError, block_runs


def test_allocator_exhaustion_names_needed_and_free():
    a = BlockAllocator(5, block_size=16)
    a.add(0)
    a.allocate(0, 4)
    a.add(1)
    before = a.snapshot()
    with pytest.raises(PoolExhaustedError) as ei:
        a.allocate(1, 3)
    msg = str(ei.value)
    assert "needs 3" in msg and "only 1 of 5" in msg and "48 tokens" in msg, msg
    assert isinstance(ei.value, ValueError)
    assert a.snapshot() == before  # nothing changed


def test_allocator_free_returns_all_and_reuse():
    a = BlockAllocator(8)
    start = a.snapshot()
    for s in range(3):
        a.add(s)
    a.allocate(0, 3)
    a.allocate(1, 2)
    a.allocate(0, 1)
    a.allocate(2, 2)
    assert a.num_free == 0
    assert a.free(0) == 4 and a.num_free == 4
    assert not a.has(0)
    with pytest.raises(ValueError):
        a.table(0)
    a.add(3)
    got = a.allocate(3, 4)  # reuses the freed blocks
    assert sorted(got) == sorted([0, 1, 2, 5])
    for s in (1, 2, 3):
        a.free(s)
    assert a.snapshot() == start and a.num_free == 8


def test_block_tables_prefer_contiguous_runs():
    a = BlockAllocator(16)
    a.add(0)
    a.add(1)
    assert a.allocate(0, 2) == [0, 1]
    assert a.allocate(1, 3) == [2, 3, 4]
    assert a.allocate(0, 2) == [5, 6]  # cannot extend 0..1: takes the next run
    assert a.allocate(0, 1) == [7]     # extends contiguously
    assert a.table(0) == (0, 1, 5, 6, 7) and a.table(1) == (2, 3, 4)
    assert a.owns(0, 6) and not a.owns(0, 2)
    a.free(1)
    a.add(2)
    assert a.allocate(2, 4) == [8, 9, 10, 11]  # first run long enough (2..4 is too short)
    assert block_runs(a.table(0), 0, 80, 16) == [(0, 0, 32), (80, 32, 48)]
    assert block_runs(a.table(0), 20, 40, 16) == [(20, 20, 12), (80, 32, 8)]
    assert block_runs(a.table(0), 3, 3, 16) == []


# ------------------------------------------------------------ reference counts
def test_shared_blocks_refcounts_and_free():
    a = BlockAllocator(6, block_size=4)
    start = a.snapshot()
    a.add(0)
    a.allocate(0, 3)  # [0, 1, 2]
    a.add(1, shared=[0, 1])
    assert a.table(1) == (0, 1) and [a.refcount(b) for b in range(4)] == [2, 2, 1, 0]
    assert a.is_shared(0) and not a.is_shared(2) and a.num_free == 3
    assert a.allocate(1, 1) == [3]  # extends after its last block
    a.check()
    assert a.usage() == {"free": 2, "seq_held": 4, "external_only": 0, "shared": 2, "total": 6}
    assert a.free(0) == 1  # only block 2 comes back; 0 and 1 are still sequence 1's
    assert a.refcount(0) == 1 and a.refcount(2) == 0 and a.num_free == 3
    a.check()
    assert a.free(1) == 3
    assert a.snapshot() == start
    a.check()


def test_shared_add_bad_blocks_change_nothing():
    a = BlockAllocator(4)
    a.add(0)
    a.allocate(0, 2)
    snap = a.snapshot()
    with pytest.raises(ValueError, match="block 3 is free"):
        a.add(1, shared=[0, 3])
    with pytest.raises(ValueError, match="repeat"):
        a.add(1, shared=[1, 1])
    with pytest.raises(ValueError, match=r"block id must be in \[0, 3\], got 9"):
        a.add(1, shared=[9])
    assert a.snapshot() == snap and not a.has(1)


def test_external_refs_retain_release():
    a = BlockAllocator(4)
    a.add(0)
    a.allocate(0, 2)
    a.retain([0, 1])
    assert a.external_refs(0) == 1 and a.refcount(0) == 2
    assert a.free(0) == 0  # the external holder keeps both
    assert a.usage()["external_only"] == 2 and a.num_free == 2
    with pytest.raises(ValueError, match="is free"):
        a.retain([2])
    with pytest.raises(ValueError, match="1 external"):
        a.release([1, 1])  # one reference only; nothing released
    assert a.external_refs(1) == 1
    a.check()
    assert a.release([0, 1]) == 2 and a.num_free == 4
    a.check()


def test_replace_block_copy_on_write_bookkeeping():
    a = BlockAllocator(8)
    a.add(0)
    a.allocate(0, 2)  # [0, 1]
    a.add(1, shared=[0, 1])
    a.allocate(0, 1)  # [2]  (fills so that 3 is the next free block)
    old, new = a.replace_block(1, 1)
    assert (old, new) == (1, 3) and a.table(1) == (0, 3) and a.refcount(1) == 1 and a.refcount(3) == 1
    a.check()
    with pytest.raises(ValueError, match="table index"):
        a.replace_block(1, 2)


class _Evictor:
    """Stand-in evictor holding external references on some blocks."""

    def __init__(self, alloc, blocks):
        self.a, self.held = alloc, list(blocks)
        alloc.retain(self.held)
        alloc.set_evictor(self)

    def evictable_blocks(self):
        return len(self.held)

    def evict_blocks(self, n):
        if n > len(self.held):
            return 0
        got = self.a.release(self.held[:n])
        self.held = self.held[n:]
        return got


def test_allocate_evicts_then_names_who_holds_what():
    a = BlockAllocator(6, block_size=16)
    a.add(0)
    a.allocate(0, 4)
    ev = _Evictor(a, [2, 3])
    a.free(0)  # 0, 1 free; 2, 3 held only by the evictor
    a.add(1)
    assert a.num_free == 4
    got = a.allocate(1, 5)  # needs one block from the evictor
    assert len(got) == 5 and ev.held == [3] and a.num_free == 0
    a.check()
    a.add(2)
    snap = a.snapshot()
    with pytest.raises(PoolExhaustedError) as ei:
        a.allocate(2, 2)  # one evictable, two needed: nothing is evicted
    msg = str(ei.value)
    assert "needs 2" in msg and "only 0 of 6" in msg and "5 held by live sequences" in msg, msg
    assert "1 held only by the prefix cache, 1 of them evictable" in msg, msg
    assert a.snapshot() == snap and ev.held == [3]
    with pytest.raises(ValueError, match="already has an evictor"):
        a.set_evictor(_Evictor.__new__(_Evictor))
