"""CpuKVPool (runtime/pool.py): layout, sizes, and the allocation-failure message."""
import pytest
import torch

from xoffload.runtime import CpuKVPool, OffloadEngine, PoolAllocationError


def test_pool_layout_and_size():
    p = CpuKVPool(3, 5, 16, 2, 8, torch.float16, pin=False, slab_bytes=10_000)
    assert p.nbytes == 3 * 2 * 5 * 16 * 2 * 8 * 2
    assert p.allocated_bytes <= 1.05 * p.nbytes + 2 * 4096 * 3
    assert len(p.k) == 3 and p.k[0].shape == (5, 16, 2, 8) and p.k[0].is_contiguous()
    for l in range(3):  # K and V of all layers are distinct memory
        p.k[l].fill_(l)
        p.v[l].fill_(10 + l)
    for l in range(3):
        assert bool((p.k[l] == l).all()) and bool((p.v[l] == 10 + l).all())
    assert p.k_rows(1).shape == (80, 2, 8)
    big = CpuKVPool(2, 64, 1024, 2, 64, torch.float16, pin=False)  # 64 MiB, one slab
    assert big.nbytes <= big.allocated_bytes <= 1.05 * big.nbytes
    big.close()
    p.close()


def test_pool_failed_allocation_names_size_and_hint():
    with pytest.raises(PoolAllocationError) as ei:
        CpuKVPool(1, 2 ** 36, 1024, 8, 128, torch.bfloat16, pin=False)
    msg = str(ei.value)
    assert "GiB" in msg and str(2 ** 36 * 1024 * 8 * 128 * 2 * 2) in msg and "fewer blocks" in msg
    assert "smaller block_size" in msg
    assert isinstance(ei.value, MemoryError)
    with pytest.raises(PoolAllocationError, match="fewer blocks"):
        OffloadEngine(1, 8, 128, device="cpu", max_tokens=1024, num_blocks=2 ** 36)
