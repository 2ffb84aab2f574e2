"""CPU tests of OffloadRuntime (runtime/offload.py): pool exhaustion, decode-buffer flushes at block
boundaries, ring sizes, request isolation, random lifecycles, bad input. The allocator, pool, ring
and gather kernel have their own test files.

Host mode (device="cpu") runs the same bookkeeping as the GPU path with synchronous copies. The
lifecycle, fetch and copy-on-write tests also run with ``placement="device"`` (the pool a
DeviceKVPool on the runtime's device: the same results).
"""
import random

import pytest
import torch

from xoffload.runtime import OffloadRuntime, PoolExhaustedError

H, D = 1, 2
DT = torch.float32


class Ref:
    """Reference KV per (seq, layer), kept as plain CPU tensors."""

    def __init__(self, eng, seed=0):
        self.eng = eng
        self.g = torch.Generator().manual_seed(seed)
        self.k, self.v = {}, {}

    def rand(self, t):
        e = self.eng
        return torch.randn(t, e.num_kv_heads, e.head_dim, generator=self.g).to(e.dtype)

    def prefill(self, seq, T, chunks=1):
        e = self.eng
        bounds = [round(i * T / chunks) for i in range(chunks + 1)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            for l in range(e.num_layers):
                k, v = self.rand(b - a), self.rand(b - a)
                e.offload_layer(seq, l, k, v)
                self._add(seq, l, k, v)

    def _add(self, seq, l, k, v):
        key = (seq, l)
        self.k[key] = torch.cat([self.k.get(key, k[:0]), k])
        self.v[key] = torch.cat([self.v.get(key, v[:0]), v])

    def step(self, seq, check=True):
        e = self.eng
        e.begin_step(seq)
        for l in range(e.num_layers):
            kn, vn = self.rand(1), self.rand(1)
            k, v = e.layer_kv(seq, l, kn, vn)
            self._add(seq, l, kn, vn)
            if check:
                assert torch.equal(k, self.k[(seq, l)]), f"layer {l} K differs at len {k.shape[0]}"
                assert torch.equal(v, self.v[(seq, l)]), f"layer {l} V differs"
            e.end_layer(seq, l)
        e.end_step(seq)

    def check_host(self, seq):
        e = self.eng
        for l in range(e.num_layers):
            k, v = e.host_kv(seq, l)
            assert torch.equal(k, self.k[(seq, l)]) and torch.equal(v, self.v[(seq, l)]), f"host layer {l}"

    def check_fetch(self, seq, ids=None):
        e = self.eng
        bs = e.block_size
        nb = e.num_seq_blocks(seq)
        ids = list(range(nb)) if ids is None else ids
        for l in range(e.num_layers):
            k, v = e.fetch_blocks(seq, l, ids)
            rk, rv = self.k[(seq, l)], self.v[(seq, l)]
            pad = nb * bs - rk.shape[0]
            rk = torch.cat([rk, rk.new_zeros(pad, *rk.shape[1:])]).view(nb, bs, *rk.shape[1:])
            rv = torch.cat([rv, rv.new_zeros(pad, *rv.shape[1:])]).view(nb, bs, *rv.shape[1:])
            assert torch.equal(k.view(len(ids), bs, *k.shape[1:]), rk[ids]), f"fetch layer {l}"
            assert torch.equal(v.view(len(ids), bs, *v.shape[1:]), rv[ids]), f"fetch layer {l}"


def eng_(layers=2, bs=16, max_tokens=256, nb=None, nbuf=4, dtype=DT, h=H, d=D, placement="host"):
    return OffloadRuntime(layers, h, d, dtype=dtype, device="cpu", max_tokens=max_tokens, block_size=bs,
                         num_buffers=nbuf, num_blocks=nb, placement=placement)


PLACEMENTS = pytest.mark.parametrize("placement", ["host", "device"])


# ---------------------------------------------------------------------------- exhaustion


def test_engine_exhaustion_error_and_no_change():
    e = eng_(bs=16, nb=3, max_tokens=1000)
    r = Ref(e)
    s0, s1 = e.add_sequence(), e.add_sequence()
    r.prefill(s0, 20)  # 2 blocks
    with pytest.raises(PoolExhaustedError, match=r"needs 2 more block.*only 1 of 3"):
        e.offload_layer(s1, 0, r.rand(17), r.rand(17))
    assert e.layer_len(s1, 0) == 0 and e.num_seq_blocks(s1) == 0 and e.num_free_blocks == 1
    r.check_host(s0)


# ------------------------------------------------------------------------ decode flushes
@pytest.mark.parametrize("n", [1023, 1024, 1025, 2047, 2048, 2049])
def test_decode_flush_at_block_boundaries_bs1024(n):
    e = eng_(layers=2, bs=1024, max_tokens=4096, nb=8)
    r = Ref(e, seed=n)
    s = e.add_sequence()
    r.prefill(s, n - 2, chunks=2)
    for _ in range(4):  # lengths n-1, n, n+1, n+2
        r.step(s)
        r.check_host(s)
    assert e.seq_len(s) == n + 2
    r.check_fetch(s)
    # prefill ending exactly at the length, then one step
    s2 = e.add_sequence()
    r.prefill(s2, n)
    r.step(s2)
    r.check_host(s2)
    r.check_fetch(s2)


@pytest.mark.parametrize("bs,prefill,steps", [(16, 0, 40), (16, 5, 40), (16, 32, 17), (256, 250, 10),
                                              (256, 0, 3), (256, 512, 2)])
def test_decode_flush_small_blocks(bs, prefill, steps):
    e = eng_(layers=3, bs=bs, max_tokens=1024, nbuf=2)
    r = Ref(e, seed=bs + prefill)
    s = e.add_sequence()
    if prefill:
        r.prefill(s, prefill, chunks=3)
    for i in range(steps):
        r.step(s)
        if i % 7 == 0 or i == steps - 1:
            r.check_host(s)
            r.check_fetch(s)
    assert e.seq_len(s) == prefill + steps


def test_offload_after_decode_second_turn():
    e = eng_(layers=2, bs=16)
    r = Ref(e)
    s = e.add_sequence()
    r.prefill(s, 10)
    for _ in range(3):
        r.step(s)  # 13 tokens: 3 in the decode buffer
    r.prefill(s, 9)  # second turn: decode buffer goes to the pool first
    r.check_host(s)
    for _ in range(12):
        r.step(s)
    r.check_host(s)
    r.check_fetch(s, [2, 0, 1, 1])


# ----------------------------------------------------------------------------------- ring
@pytest.mark.parametrize("nbuf", [1, 2, 3, 4, 5])
def test_ring_sizes_over_30_layers(nbuf):
    e = eng_(layers=30, bs=4, max_tokens=64, nbuf=nbuf)
    r = Ref(e, seed=nbuf)
    s = e.add_sequence()
    r.prefill(s, 7)
    for _ in range(3):
        r.step(s)
    r.check_host(s)
    ring = e._rings[0]
    assert len(e._rings) == 1 and ring.loads == 3 * 30  # every layer loaded once per step


# ----------------------------------------------------------------------- request isolation
def _run_request(e, seed, T, steps, fetch_ids):
    r = Ref(e, seed=seed)
    s = e.add_sequence()
    r.prefill(s, T, chunks=2)
    outs = []
    for _ in range(steps):
        e.begin_step(s)
        for l in range(e.num_layers):
            k, v = e.layer_kv(s, l, r.rand(1), r.rand(1))
            outs.append((k.clone(), v.clone()))
            e.end_layer(s, l)
        e.end_step(s)
    for l in range(e.num_layers):
        outs.append(e.fetch_blocks(s, l, fetch_ids))
        outs.append(e.host_kv(s, l))
    return s, outs


@PLACEMENTS
def test_request_after_another_is_bit_identical(placement):
    def fresh():
        return eng_(layers=3, bs=16, max_tokens=256, nb=24, nbuf=2, placement=placement)

    _, alone = _run_request(fresh(), seed=7, T=37, steps=12, fetch_ids=[2, 0, 3])
    e = fresh()
    s_a, _ = _run_request(e, seed=1, T=90, steps=20, fetch_ids=[5, 1])  # fills most of the pool
    e.free(s_a)
    _, after = _run_request(e, seed=7, T=37, steps=12, fetch_ids=[2, 0, 3])
    assert len(alone) == len(after)
    for (ka, va), (kb, vb) in zip(alone, after):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@PLACEMENTS
def test_twenty_sequences_random_lifecycle_restore_pool(placement):
    e = eng_(layers=2, bs=8, max_tokens=128, nb=120, nbuf=2, placement=placement)
    assert e.pool.placement == placement
    start = e.allocator.snapshot()
    rnd = random.Random(0)
    r = Ref(e, seed=3)
    live = []
    for i in range(20):
        s = e.add_sequence()
        r.prefill(s, rnd.randint(0, 40), chunks=rnd.randint(1, 2))
        for _ in range(rnd.randint(0, 6)):
            r.step(s)
        live.append(s)
        if rnd.random() < 0.4 and live:
            victim = live.pop(rnd.randrange(len(live)))
            e.free(victim)
    rnd.shuffle(live)
    for s in live[: len(live) // 2]:
        r.check_host(s)
    for s in live:
        e.free(s)
    assert e.allocator.snapshot() == start
    assert e.sequences() == [] and e.num_free_blocks == 120
    s = e.add_sequence()
    assert e.seq_len(s) == 0 and e.num_seq_blocks(s) == 0
    e.reset()
    assert e.allocator.snapshot() == start


# ------------------------------------------------------------------------- sparse / misc
@PLACEMENTS
def test_fetch_blocks_without_prefetch_during_step(placement):
    e = eng_(layers=2, bs=8, max_tokens=128, placement=placement)
    r = Ref(e)
    s = e.add_sequence()
    r.prefill(s, 21)
    e.begin_step(s, prefetch=False)
    for l in range(2):
        kn, vn = r.rand(1), r.rand(1)
        kd, vd = e.append_kv(s, l, kn, vn)
        r._add(s, l, kn, vn)
        assert torch.equal(kd, r.k[(s, l)][21:]) and torch.equal(vd, r.v[(s, l)][21:])
        k, _ = e.fetch_blocks(s, l, torch.tensor([2, 0]))
        ref = torch.cat([r.k[(s, l)][16:22], torch.zeros(2, H, D), r.k[(s, l)][:8]])
        assert torch.equal(k, ref)
        e.end_layer(s, l)
    e.end_step(s)
    r.check_host(s)
    r.check_fetch(s, [1, 2, 2])
    with pytest.raises(ValueError, match="prefetch=False"):
        e.begin_step(s, prefetch=False)
        e.layer_kv(s, 0, r.rand(1), r.rand(1))


def test_seq_ids_are_engine_ints():
    e = eng_()
    ids = [e.add_sequence() for _ in range(3)]
    assert ids == [0, 1, 2]
    e.free(1)
    assert e.add_sequence() == 3  # never reused
    with pytest.raises(TypeError):
        e.seq_len("0")


# ------------------------------------------------------------------------------ bad input
def test_bad_input_clear_errors_and_no_other_change():
    e = eng_(layers=2, bs=8, max_tokens=40, nb=20)
    r = Ref(e)
    a, b = e.add_sequence(), e.add_sequence()
    r.prefill(a, 13)
    r.prefill(b, 5)
    snap = e.allocator.snapshot()

    def unchanged():
        r.check_host(a)
        r.check_host(b)
        assert e.allocator.snapshot() == snap

    with pytest.raises(ValueError, match="max_tokens"):
        e.offload_layer(b, 0, r.rand(36), r.rand(36))
    unchanged()
    with pytest.raises(TypeError, match="dtype"):
        e.offload_layer(b, 0, r.rand(3).half(), r.rand(3).half())
    with pytest.raises(ValueError, match=r"\[T, 1, 2\]"):
        e.offload_layer(b, 0, torch.zeros(3, 2, 2), torch.zeros(3, 2, 2))
    with pytest.raises(ValueError, match="tokens"):
        e.offload_layer(b, 0, r.rand(3), r.rand(4))
    with pytest.raises(TypeError):
        e.offload_layer(b, 0, [1.0], r.rand(1))
    with pytest.raises(ValueError, match="layer"):
        e.offload_layer(b, 2, r.rand(1), r.rand(1))
    unchanged()
    with pytest.raises(ValueError, match="not owned"):
        e.fetch_blocks(b, 0, [0, 1])
    with pytest.raises(ValueError, match="not owned"):
        e.fetch_blocks(a, 0, [-1])
    with pytest.raises(TypeError):
        e.fetch_blocks(a, 0, torch.tensor([0.0]))
    unchanged()
    c = e.add_sequence()
    r.prefill(c, 9)
    e.free(c)
    with pytest.raises(ValueError, match="freed"):
        e.offload_layer(c, 0, r.rand(1), r.rand(1))
    with pytest.raises(ValueError, match="freed"):
        e.begin_step(c)
    with pytest.raises(ValueError, match="freed"):
        e.fetch_blocks(c, 0, [0])
    with pytest.raises(ValueError, match="unknown"):
        e.seq_len(99)
    unchanged()
    # decode misuse
    with pytest.raises(ValueError, match="begin_step"):
        e.layer_kv(a, 0, r.rand(1), r.rand(1))
    e.offload_layer(b, 0, r.rand(1), r.rand(1))
    r._add(b, 0, *(e.host_kv(b, 0)[i][-1:] for i in (0, 1)))
    with pytest.raises(ValueError, match="different token counts"):
        e.begin_step(b)
    e.begin_step(a)
    with pytest.raises(ValueError, match="expected layer 0"):
        e.layer_kv(a, 1, r.rand(1), r.rand(1))
    with pytest.raises(ValueError, match="1 token"):
        e.layer_kv(a, 0, r.rand(2), r.rand(2))
    with pytest.raises(ValueError, match="decode step"):
        e.offload_layer(a, 0, r.rand(1), r.rand(1))
    with pytest.raises(ValueError, match="finished 0 of 2"):
        e.end_step(a)
    r.check_host(a)
    e.free(a)  # abandoning a step is allowed


def test_engine_arg_validation():
    with pytest.raises(ValueError):
        OffloadRuntime(0, 1, 2, device="cpu")
    with pytest.raises(ValueError):
        OffloadRuntime(1, 1, 2, device="cpu", num_buffers=0)
    with pytest.raises(ValueError):
        OffloadRuntime(1, 1, 2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            OffloadRuntime(1, 1, 2, device="cuda")
    with pytest.raises(ValueError, match="placement must be 'host' or 'device', got 'gpu'"):
        OffloadRuntime(1, 1, 2, device="cpu", placement="gpu")


# -------------------------------------------------------------------------- gather path


@pytest.mark.parametrize("gather", [False, True])
def test_fragmented_tables_whole_layer_loads(gather):
    # chunks of two sequences alternate, so their block tables interleave (runs of one block);
    # gather=True takes the whole-block gather path of the ring loads (torch fallback on the CPU)
    e = OffloadRuntime(2, 2, 4, dtype=DT, device="cpu", max_tokens=256, block_size=8, num_blocks=40,
                      num_buffers=2, gather=gather)
    r = Ref(e, seed=11)
    a, b = e.add_sequence(), e.add_sequence()
    for _ in range(4):
        r.prefill(a, 8)
        r.prefill(b, 8)
    r.prefill(a, 3)
    assert e.block_table(a) == (0, 2, 4, 6, 8) and e.block_table(b) == (1, 3, 5, 7)
    for _ in range(14):  # crosses two block boundaries; new blocks extend the tables
        r.step(a)
        r.step(b)
    r.check_host(a)
    r.check_host(b)
    r.check_fetch(a, [5, 0, 2, 2])
    r.check_fetch(b)


def test_integer_kv_dtype_refused():
    """KV values are floating point; an int dtype is a caller mistake (found by adversarial testing)."""
    with pytest.raises(TypeError, match="floating-point"):
        OffloadRuntime(2, 1, 8, dtype=torch.int32, device="cpu", max_tokens=64, block_size=16)


def test_release_ring_buffers_between_steps_and_reclaim():
    e = eng_(layers=3, bs=4, max_tokens=32, nbuf=2)
    r = Ref(e, seed=11)
    s = e.add_sequence()
    r.prefill(s, 9)
    e.reclaim()  # no-op in host mode, must not disturb anything
    r.step(s)
    per_ring = 2 * 2 * 32 * H * D * 4  # nbuf x (K, V) x buffer_tokens x Hkv x D x fp32
    assert e.release_ring_buffers() == per_ring
    assert e.release_ring_buffers() == 0 and e._rings == []
    r.step(s)  # a fresh ring is made by the next step; contents still right
    e.begin_step(s)
    assert e.release_ring_buffers() == 0  # the open step's ring is not free: kept
    for l in range(e.num_layers):
        e.layer_kv(s, l, r.rand(1), r.rand(1))
        e.end_layer(s, l)
    e.end_step(s)
    assert e.release_ring_buffers() == per_ring


# ------------------------------------------------------------- sharing / copy-on-write
def _fork_ref(r, parent, child, n):
    for l in range(r.eng.num_layers):
        r.k[(child, l)] = r.k[(parent, l)][:n].clone()
        r.v[(child, l)] = r.v[(parent, l)][:n].clone()


def _pool_block(e, b):
    return [(e.pool.k[l][b].clone(), e.pool.v[l][b].clone()) for l in range(e.num_layers)]


@PLACEMENTS
@pytest.mark.parametrize("n_fork", [0, 16, 21, 37, 40])
def test_fork_shares_then_copies_on_write(n_fork, placement):
    e = eng_(layers=3, bs=16, max_tokens=256, nb=20, placement=placement)
    start = e.num_free_blocks
    r = Ref(e, seed=n_fork)
    p = e.add_sequence()
    r.prefill(p, 37, chunks=2)
    r.step(p)
    r.step(p)
    r.step(p)  # 40 tokens: 3 in the decode buffer -> fork flushes them
    used = e.num_free_blocks
    c = e.fork(p, n_fork)
    _fork_ref(r, p, c, n_fork)
    nb = -(-n_fork // 16)
    assert e.block_table(c) == e.block_table(p)[:nb] and e.seq_len(c) == n_fork
    assert e.num_free_blocks == used  # nothing copied or allocated yet
    assert all(e.allocator.refcount(b) == 2 for b in e.block_table(c))
    r.check_host(c)
    r.check_host(p)
    partial = n_fork % 16 != 0
    before = _pool_block(e, e.block_table(c)[-1]) if partial else None
    shared_last = e.block_table(c)[-1] if partial else None
    # the child writes: a prefill chunk and decode steps
    r.prefill(c, 5)
    for _ in range(20):
        r.step(c)
    assert e.cow_copies == int(partial)
    if partial:
        assert e.block_table(c)[-1] != shared_last and shared_last not in e.block_table(c)
        after = _pool_block(e, shared_last)  # bytes: unused rows are uninitialised (may be NaN)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for x, y in zip(before, after) for a, b in zip(x, y))
    r.check_host(c)
    r.check_fetch(c)
    r.check_host(p)  # the parent's KV is untouched
    for _ in range(18):  # and the parent's own writes (its block is no longer shared) stay in place
        r.step(p)
    assert e.cow_copies == int(partial)
    r.check_host(p)
    r.check_host(c)
    r.check_fetch(p)
    e.allocator.check()
    e.free(p)
    r.check_host(c)  # the shared full blocks stay the child's
    e.free(c)
    assert e.num_free_blocks == start
    e.allocator.check()


@PLACEMENTS
def test_parent_writes_first_copies_and_child_keeps_its_view(placement):
    e = eng_(layers=2, bs=8, max_tokens=128, nb=12, placement=placement)
    r = Ref(e, seed=5)
    p = e.add_sequence()
    r.prefill(p, 13)
    c = e.fork(p)
    _fork_ref(r, p, c, 13)
    shared = e.block_table(p)[1]
    r.prefill(p, 6)  # the parent writes into the shared partial block first: it copies
    assert e.cow_copies == 1 and e.block_table(p)[1] != shared and e.block_table(c)[1] == shared
    assert e.allocator.refcount(shared) == 1
    r.step(c)  # now the child is the only holder: it writes in place
    assert e.cow_copies == 1 and e.block_table(c)[1] == shared
    r.check_host(p)
    r.check_host(c)
    r.check_fetch(c)


def test_add_sequence_prefix_blocks_and_bad_input():
    e = eng_(layers=2, bs=8, max_tokens=64, nb=10)
    r = Ref(e, seed=2)
    a = e.add_sequence()
    r.prefill(a, 20)
    t = e.block_table(a)
    snap = e.allocator.snapshot()
    b = e.add_sequence(prefix_blocks=t[:2])  # 16 tokens by default
    assert e.seq_len(b) == 16 and e.layer_len(b, 1) == 16
    _fork_ref(r, a, b, 16)
    r.check_host(b)
    e.free(b)
    assert e.allocator.snapshot() == snap
    with pytest.raises(ValueError, match=r"prefix_len=17 does not fit 2 prefix block\(s\)"):
        e.add_sequence(prefix_blocks=t[:2], prefix_len=17)
    with pytest.raises(ValueError, match=r"prefix_len=3 does not fit 0"):
        e.add_sequence(prefix_len=3)
    with pytest.raises(ValueError, match="is free"):
        e.add_sequence(prefix_blocks=[t[0], 9])
    with pytest.raises(TypeError):
        e.add_sequence(prefix_blocks=["0"])
    with pytest.raises(ValueError, match="n_tokens"):
        e.fork(a, 21)
    assert e.allocator.snapshot() == snap
    e.begin_step(a)
    with pytest.raises(ValueError, match="decode step"):
        e.fork(a)
    with pytest.raises(ValueError, match="being written by sequence"):
        e.add_sequence(prefix_blocks=t)
    with pytest.raises(ValueError, match="decode step"):
        e.flush(a)
    e.free(a)
    assert e.num_free_blocks == 10


def test_copy_on_write_needs_a_block_clear_error_no_change():
    e = eng_(layers=2, bs=8, max_tokens=64, nb=3)
    r = Ref(e, seed=4)
    a = e.add_sequence()
    r.prefill(a, 20)  # 3 blocks: the pool is full
    c = e.fork(a)
    snap = e.allocator.snapshot()
    with pytest.raises(PoolExhaustedError, match=r"needs 1 more block.*only 0 of 3.*3 held by live sequences"):
        e.begin_step(c)  # the partial block must be copied first
    with pytest.raises(PoolExhaustedError):
        e.offload_layer(a, 0, r.rand(1), r.rand(1))
    assert e.allocator.snapshot() == snap and e.cow_copies == 0
    e.free(c)
    r.step(a)  # no longer shared: writes in place
    r.check_host(a)
