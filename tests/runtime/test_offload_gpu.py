"""GPU tests of the offload runtime: stream/event ordering against synchronous
references, 100 iterations each, plus pinned-memory residency and the UVA gather path.

(a) slow writer then offload, (b) 2-buffer ring with slowed attention, (c) D2H source deleted and
its memory poisoned, (d) ring size not dividing the layer count over many decode steps, (e) compute
on a non-default stream. (a), (c), the gather test and copy-on-write also run with the pool in
device memory (``placement="device"``: the same ordering, device-to-device copies). Tests may
synchronize; the library never does.
"""
import pytest
import torch

from xoffload.runtime import CpuKVPool, OffloadRuntime

pytestmark = pytest.mark.cuda

ITERS = 100
BF = torch.bfloat16


def _rand(t, h, d, g):
    return torch.randn(t, h, d, device="cuda", generator=g).to(BF)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_a_slow_writer_then_offload(placement):
    T, h, d = 300, 8, 128
    e = OffloadRuntime(2, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=128, num_blocks=8,
                       placement=placement)
    assert e.pool.k[0].is_cuda == (placement == "device")
    g = _gen(0)
    naive_bad = 0
    side = torch.cuda.Stream()
    naive = torch.empty(T, h, d, dtype=BF, pin_memory=True)  # allocated up front (cudaHostAlloc syncs)
    for it in range(ITERS):
        s = e.add_sequence()
        fk, fv = _rand(T, h, d, g), _rand(T, h, d, g)
        k = torch.zeros(T, h, d, device="cuda", dtype=BF)
        v = torch.zeros_like(k)
        # a slow kernel (~2.5 ms, longer than the host's enqueue work below) ...
        torch.cuda._sleep(5_000_000)
        k.copy_(fk)  # ... after which K/V get their final values
        v.copy_(fv)
        e.offload_layer(s, 0, k, v)  # enqueued at once
        e.offload_layer(s, 1, fk, fv)
        if it == 0:  # the caller never waits: the copy is still queued when offload_layer returns
            assert not e._offload_stream.query()
        if it < 5:  # control: the same copy on a side stream without the event is wrong
            with torch.cuda.stream(side):
                naive.copy_(k, non_blocking=True)
        torch.cuda.synchronize()
        if it < 5:
            naive_bad += int(not torch.equal(naive, fk.cpu()))
        hk, hv = e.host_kv(s, 0)
        assert torch.equal(hk, fk.cpu()) and torch.equal(hv, fv.cpu()), f"iteration {it}"
        e.free(s)
    assert naive_bad > 0, "the race this test guards against did not show up in the control"
    e.close()


def test_b_two_buffer_ring_slow_attention():
    L, h, d, T = 6, 8, 128, 300
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=64, num_buffers=2)
    g = _gen(1)
    s = e.add_sequence()
    ref_k, ref_v = [], []
    for l in range(L):
        k, v = _rand(T, h, d, g), _rand(T, h, d, g)
        e.offload_layer(s, l, k, v)
        ref_k.append(k)
        ref_v.append(v)
    for it in range(ITERS):
        e.begin_step(s)
        seen = []
        for l in range(L):
            kn, vn = _rand(1, h, d, g), _rand(1, h, d, g)
            ref_k[l] = torch.cat([ref_k[l], kn])
            ref_v[l] = torch.cat([ref_v[l], vn])
            k, v = e.layer_kv(s, l, kn, vn)
            torch.cuda._sleep(500_000)  # slow attention (~0.25 ms): the next prefetch is enqueued meanwhile
            seen.append((k.clone(), v.clone()))
            e.end_layer(s, l)
        e.end_step(s)
        for l in range(L):
            assert torch.equal(seen[l][0], ref_k[l]) and torch.equal(seen[l][1], ref_v[l]), f"it {it} layer {l}"
    e.close()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_c_source_deleted_and_poisoned(placement):
    T, h, d = 256, 8, 128
    e = OffloadRuntime(1, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=128, num_blocks=4,
                       placement=placement)
    g = _gen(2)
    for it in range(ITERS):
        s = e.add_sequence()
        rk, rv = _rand(T, h, d, g), _rand(T, h, d, g)
        k, v = rk.clone(), rv.clone()
        with torch.cuda.stream(e._offload_stream):
            torch.cuda._sleep(4_000_000)  # the D2H copy will start late (~2 ms)
        e.offload_layer(s, 0, k, v)
        del k, v
        poison = [torch.full((T, h, d), float("nan"), device="cuda", dtype=BF) for _ in range(4)]
        torch.cuda.synchronize()
        hk, hv = e.host_kv(s, 0)
        assert torch.equal(hk, rk.cpu()) and torch.equal(hv, rv.cpu()), f"iteration {it}"
        del poison
        e.free(s)
    e.close()


def _decode_check(e, s, L, ref_k, ref_v, g, h, d, sleep=0):
    e.begin_step(s)
    for l in range(L):
        kn, vn = _rand(1, h, d, g), _rand(1, h, d, g)
        ref_k[l] = torch.cat([ref_k[l], kn])
        ref_v[l] = torch.cat([ref_v[l], vn])
        k, v = e.layer_kv(s, l, kn, vn)
        if sleep:
            torch.cuda._sleep(sleep)
        ok = torch.equal(k, ref_k[l]) and torch.equal(v, ref_v[l])
        e.end_layer(s, l)
        assert ok, f"layer {l} at length {ref_k[l].shape[0]}"
    e.end_step(s)


def test_d_ring_not_dividing_layers_wraparound():
    L, h, d, bs = 7, 3, 64, 16
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=bs, num_buffers=3)
    g = _gen(3)
    s = e.add_sequence()
    ref_k, ref_v = [], []
    for l in range(L):
        k, v = _rand(37, h, d, g), _rand(37, h, d, g)
        e.offload_layer(s, l, k, v)
        ref_k.append(k)
        ref_v.append(v)
    for it in range(ITERS):  # crosses 6 block boundaries: flushes + reloads of flushed blocks
        _decode_check(e, s, L, ref_k, ref_v, g, h, d)
        if it % 25 == 24:
            nb = e.num_seq_blocks(s)
            ids = list(range(nb))[::-1]
            for l in (0, L - 1):
                fk, fv = e.fetch_blocks(s, l, ids)
                n = ref_k[l].shape[0]
                pad = nb * bs - n
                rk = torch.cat([ref_k[l], ref_k[l].new_zeros(pad, h, d)]).view(nb, bs, h, d)[ids]
                assert torch.equal(fk.view(nb, bs, h, d), rk)
    assert e.seq_len(s) == 37 + ITERS
    e.close()


def test_e_compute_on_non_default_stream():
    L, h, d = 5, 8, 128
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=1024, block_size=64, num_buffers=2)
    g = _gen(4)
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        s = e.add_sequence()
        ref_k, ref_v = [], []
        for l in range(L):
            k = torch.zeros(200, h, d, device="cuda", dtype=BF)
            v = torch.zeros_like(k)
            fk, fv = _rand(200, h, d, g), _rand(200, h, d, g)
            torch.cuda._sleep(2_000_000)
            k.copy_(fk)
            v.copy_(fv)
            e.offload_layer(s, l, k, v)  # offload waits on an event of stream st
            ref_k.append(fk)
            ref_v.append(fv)
        for _ in range(ITERS):
            _decode_check(e, s, L, ref_k, ref_v, g, h, d, sleep=300_000)
    torch.cuda.synchronize()
    for l in range(L):
        hk, _ = e.host_kv(s, l)
        assert torch.equal(hk, ref_k[l].cpu())
    e.close()


def test_f_fresh_ring_buffers_wait_for_queued_writers():
    """The ring's buffers are allocated at the first decode step, right after a prefill the host
    ran ahead of: the memory they get may still be written by queued compute work. The load
    stream must not fill them before that work has run (seen on the H200: garbage first tokens)."""
    T, h, d, L, nb = 256, 8, 128, 4, 2
    g = _gen(5)
    for it in range(20):
        e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=128, num_buffers=nb)
        s = e.add_sequence()
        ref = [(_rand(T, h, d, g), _rand(T, h, d, g)) for _ in range(L)]
        for l, (k, v) in enumerate(ref):
            e.offload_layer(s, l, k, v)
        torch.cuda.synchronize()
        # memory of exactly the ring buffers' size, written by a slow queued kernel, then freed
        scratch = [torch.empty(e.buffer_tokens, h, d, dtype=BF, device="cuda") for _ in range(2 * nb)]
        torch.cuda._sleep(20_000_000)
        for x in scratch:
            x.fill_(7.0)
        del scratch, x
        e.begin_step(s)
        for l in range(L):
            kn, vn = _rand(1, h, d, g), _rand(1, h, d, g)
            k, v = e.layer_kv(s, l, kn, vn)
            assert torch.equal(k[:T], ref[l][0]) and torch.equal(v[:T], ref[l][1]), f"iteration {it} layer {l}"
            assert torch.equal(k[T:T + 1], kn) and torch.equal(v[T:T + 1], vn)
            e.end_layer(s, l)
        e.end_step(s)
        e.close()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_fragmented_tables_use_gather_and_fetch_blocks_match(placement):
    # two sequences prefilled chunk by chunk interleave their blocks: whole-layer loads use the
    # gather kernel (runs of one 96 KiB block), fetch_blocks reads pinned memory through UVA (or
    # device memory)
    L, h, d, bs = 3, 3, 64, 256
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=4096, block_size=bs, num_blocks=40,
                       placement=placement)
    # (Tensor.is_pinned() is False for cudaHostRegister'ed memory on torch 2.11; not checked)
    assert e.use_gather and (e.pool.pinned if placement == "host" else e.pool.k[0].is_cuda)
    g = _gen(5)
    a, b = e.add_sequence(), e.add_sequence()
    refs = {a: [[], []], b: [[], []]}
    for _ in range(6):
        for s in (a, b):
            for l in range(L):
                k, v = _rand(bs, h, d, g), _rand(bs, h, d, g)
                e.offload_layer(s, l, k, v)
                if len(refs[s][0]) <= l:
                    refs[s][0].append(k)
                    refs[s][1].append(v)
                else:
                    refs[s][0][l] = torch.cat([refs[s][0][l], k])
                    refs[s][1][l] = torch.cat([refs[s][1][l], v])
    assert e.block_table(a) == tuple(range(0, 12, 2))
    for _ in range(20):
        _decode_check(e, a, L, refs[a][0], refs[a][1], g, h, d)
    ids = [5, 0, 3, 3, 6]
    for l in range(L):
        fk, fv = e.fetch_blocks(a, l, torch.tensor(ids, device="cuda"))
        n = refs[a][0][l].shape[0]
        nb = e.num_seq_blocks(a)
        rk = torch.cat([refs[a][0][l], refs[a][0][l].new_zeros(nb * bs - n, h, d)]).view(nb, bs, h, d)
        rv = torch.cat([refs[a][1][l], refs[a][1][l].new_zeros(nb * bs - n, h, d)]).view(nb, bs, h, d)
        assert torch.equal(fk.view(len(ids), bs, h, d), rk[ids]) and torch.equal(fv.view(len(ids), bs, h, d), rv[ids])
    e.close()


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_pinned_pool_resident_size():
    torch.cuda.init()
    before = _rss()
    p = CpuKVPool(4, 40, 1024, 8, 128, BF, pin=True, slab_bytes=1 << 28)  # 640 MiB in 4 slabs
    grew = _rss() - before
    assert p.pinned and len(p._registered) == 4
    assert p.allocated_bytes <= 1.05 * p.nbytes
    assert 0.8 * p.nbytes <= grew <= 1.05 * p.nbytes, (grew, p.nbytes)  # registered = resident
    p.close()
    assert _rss() - before < 0.1 * p.nbytes


@pytest.mark.parametrize("placement", ["host", "device"])
def test_copy_on_write_after_slow_pending_writes(placement):
    """A fork shares a partly filled block whose prefill copy is still queued (a slow offload
    stream); the child's first write copies it (on the offload stream, after that copy): both
    sequences keep their own KV, 20 iterations."""
    L, h, d, bs = 2, 4, 64, 64
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=512, block_size=bs, num_blocks=16,
                       placement=placement)
    g = _gen(9)
    for it in range(20):
        p = e.add_sequence()
        ref = [(_rand(100, h, d, g), _rand(100, h, d, g)) for _ in range(L)]
        with torch.cuda.stream(e._offload_stream):
            torch.cuda._sleep(2_000_000)
        for l in range(L):
            e.offload_layer(p, l, *ref[l])
        c = e.fork(p, 90)
        new = [(_rand(7, h, d, g), _rand(7, h, d, g)) for _ in range(L)]
        for l in range(L):
            e.offload_layer(c, l, *new[l])
        assert e.cow_copies == it + 1
        torch.cuda.synchronize()
        for l in range(L):
            hk, hv = e.host_kv(p, l)
            assert torch.equal(hk, ref[l][0].cpu()) and torch.equal(hv, ref[l][1].cpu()), f"it {it} parent {l}"
            ck, cv = e.host_kv(c, l)
            assert torch.equal(ck, torch.cat([ref[l][0][:90], new[l][0]]).cpu()), f"it {it} child {l}"
            assert torch.equal(cv, torch.cat([ref[l][1][:90], new[l][1]]).cpu()), f"it {it} child {l}"
        e.free(c)
        e.free(p)
    assert e.num_free_blocks == 16
    e.close()


def test_device_pool_on_cuda_and_its_allocation_error():
    """DeviceKVPool on CUDA: zeroed, layer-major blocks in device memory; more than the device
    holds raises PoolAllocationError naming the size."""
    from xoffload.runtime import DeviceKVPool, PoolAllocationError

    p = DeviceKVPool(3, 5, 64, 2, 32, BF, device="cuda")
    assert p.label == "GPU pool" and p.k[2].is_cuda and p.k[0].shape == (5, 64, 2, 32)
    assert float(p.v[1].abs().sum()) == 0.0 and p.k_rows(1).shape == (320, 2, 32)
    p.close()
    # more than the whole device: the free figure leaves out what torch's caching allocator holds
    total = torch.cuda.get_device_properties(0).total_memory
    n = total // (2 * 1024 * 8 * 128 * 2) + 8
    with pytest.raises(PoolAllocationError, match=r"GiB .* on cuda.*Hint: use fewer blocks"):
        DeviceKVPool(1, n, 1024, 8, 128, BF, device="cuda")
