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
