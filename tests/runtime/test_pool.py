"""CpuKVPool and DeviceKVPool (runtime/pool.py): layout, sizes, and the allocation-failure message."""
import pytest
import torch

from xoffload.runtime import CpuKVPool, DeviceKVPool, OffloadRuntime, PoolAllocationError


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


def test_device_pool_has_the_host_pools_interface(device):
    """DeviceKVPool: the same layout and views as CpuKVPool, zero-filled, on the device asked for
    (the CPU counts as a device), placement 'device'; an OffloadRuntime over it writes and reads
    there; bad shapes and dtypes are refused as for the host pool."""
    p = DeviceKVPool(3, 5, 16, 2, 8, torch.float16, device=device)
    h = CpuKVPool(3, 5, 16, 2, 8, torch.float16, pin=False)
    assert (p.nbytes, p.block_bytes, p.layer_bytes) == (h.nbytes, h.block_bytes, h.layer_bytes)
    assert p.placement == "device" and h.placement == "host" and not p.pinned and h.label == "CPU pool"
    assert p.label == ("GPU pool" if device == "cuda" else "device pool")
    assert len(p.k) == 3 and p.k[0].shape == (5, 16, 2, 8) and p.k[0].is_contiguous()
    assert p.k[0].device.type == device and float(p.k[2].abs().sum() + p.v[2].abs().sum()) == 0.0
    for l in range(3):  # K and V of all layers are distinct memory
        p.k[l].fill_(l)
        p.v[l].fill_(10 + l)
    for l in range(3):
        assert bool((p.k[l] == l).all()) and bool((p.v[l] == 10 + l).all())
        assert p.k_rows(l).shape == (80, 2, 8) and p.k_rows(l).data_ptr() == p.k[l].data_ptr()
    p.close()
    assert p.k == [] and p.v == []
    with pytest.raises(ValueError):
        DeviceKVPool(0, 5, 16, 2, 8, torch.float16, device=device)
    with pytest.raises(TypeError):
        DeviceKVPool(1, 5, 16, 2, 8, torch.int8, device=device)
    e = OffloadRuntime(2, 2, 8, dtype=torch.float32, device=device, max_tokens=64, block_size=16, placement="device")
    assert e.pool.k[0].device.type == device and e.use_gather == (device == "cuda")
    s = e.add_sequence()
    k, v = torch.randn(20, 2, 8, device=device), torch.randn(20, 2, 8, device=device)
    for l in range(2):
        e.offload_layer(s, l, k, v)
    rows = e.pool.k_rows(1)[e.block_table(s)[0] * 16:e.block_table(s)[0] * 16 + 16]
    assert torch.equal(rows, k[:16])  # the pool holds the tokens, in device memory
    fk, _ = e.fetch_blocks(s, 1, [1, 0])
    assert torch.equal(fk[16:], k[:16]) and torch.equal(fk[:4], k[16:]) and not bool(fk[4:16].any())
    hk, hv = e.host_kv(s, 0)
    assert hk.device.type == "cpu" and torch.equal(hk, k.cpu()) and torch.equal(hv, v.cpu())
    e.close()


def test_device_pool_failed_allocation_names_size_and_hint():
    with pytest.raises(PoolAllocationError) as ei:
        DeviceKVPool(1, 2 ** 36, 1024, 8, 128, torch.bfloat16, device="cpu")
    msg = str(ei.value)
    assert "GiB" in msg and str(2 ** 36 * 1024 * 8 * 128 * 2 * 2) in msg and "fewer blocks (kv_cache_tokens)" in msg
    assert isinstance(ei.value, MemoryError)
    with pytest.raises(PoolAllocationError, match="fewer blocks"):
        OffloadRuntime(1, 8, 128, device="cpu", max_tokens=1024, num_blocks=2 ** 36, placement="device")


def test_pool_failed_allocation_names_size_and_hint():
    with pytest.raises(PoolAllocationError) as ei:
        CpuKVPool(1, 2 ** 36, 1024, 8, 128, torch.bfloat16, pin=False)
    msg = str(ei.value)
    assert "GiB" in msg and str(2 ** 36 * 1024 * 8 * 128 * 2 * 2) in msg and "fewer blocks" in msg
    assert "smaller block_size" in msg
    assert isinstance(ei.value, MemoryError)
    with pytest.raises(PoolAllocationError, match="fewer blocks"):
        OffloadRuntime(1, 8, 128, device="cpu", max_tokens=1024, num_blocks=2 ** 36)


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister (the pinned path on a CPU-only machine)."""

    def __init__(self):
        self.registered = {}
        self.register_calls = 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        assert ptr not in self.registered
        self.registered[ptr] = nbytes
        self.register_calls += 1
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


@pytest.fixture
def fake_pinning(monkeypatch):
    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


def test_pinned_pool_registers_and_unregisters_its_slabs(fake_pinning):
    p = CpuKVPool(4, 8, 16, 2, 8, torch.float16, slab_bytes=2 * 2 * 8 * 16 * 2 * 8 * 2)  # 2 layers a slab
    assert p.pinned and fake_pinning.register_calls == 2 and len(fake_pinning.registered) == 2
    p.close()
    assert fake_pinning.registered == {}


def test_reuse_pinned_slabs_hands_a_closed_pools_slabs_to_the_next(fake_pinning):
    from xoffload.runtime import reuse_pinned_slabs

    shape = (4, 8, 16, 2, 8, torch.float16)
    kw = dict(slab_bytes=2 * 2 * 8 * 16 * 2 * 8 * 2)
    with reuse_pinned_slabs() as cache:
        a = CpuKVPool(*shape, **kw)
        ptrs = sorted(t.data_ptr() for t in a.k[::2])
        a.k[0].fill_(1.0)
        a.close()
        assert len(fake_pinning.registered) == 2 and cache.free_bytes > 0  # kept registered
        b = CpuKVPool(*shape, **kw)  # the same slab size: the same memory, nothing registered
        assert sorted(t.data_ptr() for t in b.k[::2]) == ptrs and fake_pinning.register_calls == 2
        assert (cache.hits, cache.misses) == (2, 2) and cache.free_bytes == 0
        b.v[3].fill_(2.0)
        assert bool((b.v[3] == 2.0).all()) and b.k[1].shape == (8, 16, 2, 8)
        c = CpuKVPool(4, 9, 16, 2, 8, torch.float16, **kw)  # another size: 4 fresh slabs (1 layer each)
        assert fake_pinning.register_calls == 6 and len(fake_pinning.registered) == 6
        c.close()
    assert len(fake_pinning.registered) == 2  # the context's end: the cached ones go, b's stay
    b.close()  # its slabs came from a closed cache: unregistered now
    assert fake_pinning.registered == {}
    d = CpuKVPool(*shape, **kw)  # outside the context: plain registration again
    assert fake_pinning.register_calls == 8
    d.close()
    assert fake_pinning.registered == {}


def test_unpinned_pools_ignore_the_slab_cache():
    from xoffload.runtime import reuse_pinned_slabs

    with reuse_pinned_slabs() as cache:
        a = CpuKVPool(2, 4, 16, 2, 8, torch.float16, pin=False)
        a.close()
        CpuKVPool(2, 4, 16, 2, 8, torch.float16, pin=False).close()
    assert (cache.hits, cache.misses) == (0, 0)
