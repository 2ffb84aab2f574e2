"""PrefixCache (runtime/prefix_cache.py) over OffloadRuntime's shared blocks: matching of
full and partial blocks, exact KV read-back of reused prefixes, copy-on-write of a cached partial
block, LRU leaf-first eviction that never touches a block a live sequence holds, the exhaustion
error, stats, pool accounting; the random workload and the CUDA ordering test also over a pool in
device memory (``placement="device"``).

The KV of a token here is a function of the whole token prefix up to it (a chained hash), as in a
real model: a reused block is right only if its prefix is the same, so any wrong reuse shows.
"""
import random

import pytest
import torch

from xoffload.runtime import OffloadRuntime, PoolExhaustedError, PrefixCache

L, H, D = 2, 2, 4
DT = torch.float32


def eng_(bs=4, nb=16, max_tokens=64, device="cpu", dtype=DT, layers=L, placement="host"):
    return OffloadRuntime(layers, H, D, dtype=dtype, device=device, max_tokens=max_tokens, block_size=bs,
                         num_blocks=nb, num_buffers=2, placement=placement)


def kv_of(tokens, layers=L, device="cpu", dtype=DT):
    """Per layer ``(K, V)`` ``[len(tokens), H, D]``: row i depends on tokens[:i+1] only."""
    h, rows = 0, []
    for t in tokens:
        h = hash((h, int(t))) & 0xFFFFFF
        rows.append(h)
    vals = torch.tensor(rows, dtype=torch.int64).view(-1, 1)
    idx = torch.arange(layers * 2 * H * D, dtype=torch.int64).view(1, -1) * 40503 + 7
    x = ((vals * idx) % 10007).to(torch.float32) / 10007 - 0.5
    x = x.view(len(rows), layers, 2, H, D).to(dtype).to(device)
    return [(x[:, l, 0], x[:, l, 1]) for l in range(layers)]


def prefill(e, seq, tokens, start, kv=None):
    """Write tokens[start:] (KV of the full prefix; ``kv``: precomputed ``kv_of(tokens)``) into seq."""
    if start >= len(tokens):
        return
    kv = kv_of(tokens, e.num_layers, e.device, e.dtype) if kv is None else kv
    for l in range(e.num_layers):
        e.offload_layer(seq, l, kv[l][0][start:].contiguous(), kv[l][1][start:].contiguous())


def decode(e, seq, tokens, new):
    """Decode steps feeding the ids ``new`` after ``tokens`` (whose KV seq holds); checks what the
    ring returns. Returns the extended token list."""
    tokens = list(tokens)
    for t in new:
        tokens.append(t)
        kv = kv_of(tokens, e.num_layers, e.device, e.dtype)
        e.begin_step(seq)
        for l in range(e.num_layers):
            k, v = e.layer_kv(seq, l, kv[l][0][-1:], kv[l][1][-1:])
            assert torch.equal(k, kv[l][0]) and torch.equal(v, kv[l][1]), f"step at {len(tokens)}, layer {l}"
            e.end_layer(seq, l)
        e.end_step(seq)
    return tokens


def check(e, seq, tokens):
    assert e.seq_len(seq) == len(tokens)
    kv = kv_of(tokens, e.num_layers)
    for l in range(e.num_layers):
        k, v = e.host_kv(seq, l)
        assert torch.equal(k, kv[l][0].to(e.dtype)) and torch.equal(v, kv[l][1].to(e.dtype)), f"layer {l}"


def request(e, cache, prompt, new=(), expect=None):
    """Start on the cache, check the reused KV, prefill the rest, decode ``new``; returns (seq, tokens)."""
    seq, n = cache.add_sequence(prompt[:-1])
    if expect is not None:
        assert n == expect, (n, expect)
    check(e, seq, prompt[:n])
    prefill(e, seq, prompt, n)
    toks = decode(e, seq, prompt, new)
    check(e, seq, toks)
    e.allocator.check()
    return seq, toks


def pool_block(e, b):
    return [(e.pool.k[l][b].clone(), e.pool.v[l][b].clone()) for l in range(e.num_layers)]


def same(x, y):
    """Bit-identical (bytes: unused rows of a block are uninitialised and may hold NaN)."""
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for p, q in zip(x, y) for a, b in zip(p, q))


# ------------------------------------------------------------------------------- matching
def test_match_full_partial_none_and_mismatch():
    e = eng_(bs=4)
    c = PrefixCache(e)
    A = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = e.add_sequence()
    prefill(e, a, A, 0)
    assert c.insert(a, A) == 3 and len(c) == 3
    t = e.block_table(a)
    assert c.match([]) == ((), 0)
    assert c.match([1, 2, 3, 4, 5]) == ((), 0)
    assert c.match(A[:8]) == (t[:2], 8)
    assert c.match(A) == (t, 10)
    assert c.match(A[:9]) == (t, 9)
    assert c.match(A + [7, 7, 7]) == (t, 10)  # the partial block's tokens are a prefix of the rest
    assert c.match(A[:8] + [108, 5]) == (t, 9)
    bad = A[:5] + [0] + A[6:]  # a mismatching token in the middle of block 1
    assert c.match(bad) == (t[:2], 5)  # block 0, then the first token of block 1
    assert c.match([0] + A[1:]) == ((), 0)
    assert c.match(torch.tensor(A[:4])) == (t[:1], 4)
    st = c.stats()
    assert (st.queries, st.entries, st.blocks, st.evictions) == (10, 3, 3, 0)
    assert st.hits == 8 + 10 + 9 + 10 + 9 + 5 + 4
    assert st.hits + st.misses == 0 + 5 + 8 + 10 + 9 + 13 + 10 + 10 + 10 + 4
    e.free(a)
    assert e.num_free_blocks == 16 - 3  # the cache keeps them
    assert c.clear() == 3 and e.num_free_blocks == 16 and len(c) == 0
    e.allocator.check()


def test_bad_token_ids():
    e = eng_()
    c = PrefixCache(e)
    with pytest.raises(TypeError, match="ints"):
        c.match([1.5, 2])
    with pytest.raises(ValueError, match=">= 0, got -1"):
        c.match([3, -1])
    with pytest.raises(ValueError, match="1-D"):
        c.match(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        c.match(torch.zeros(3))
    with pytest.raises(TypeError):
        c.match("abc")
    with pytest.raises(ValueError, match="unknown sequence"):
        c.insert(5, [1, 2])
    with pytest.raises(ValueError, match="already has an evictor"):
        PrefixCache(e)


# ----------------------------------------------------------------------- reuse + CoW
def test_reuse_reads_back_exact_kv_and_cached_partial_block_is_never_written():
    e = eng_(bs=4, nb=16)
    c = PrefixCache(e)
    a, A = request(e, c, list(range(10)), new=[50, 51, 52], expect=0)  # 13 tokens, 3 via decode
    c.insert(a, A)  # KV up to the 13th token; flushes the decode buffer
    e.free(a)
    tail = c.match(A).blocks[-1]
    cached = pool_block(e, tail)
    B = A + [60, 61, 62, 63, 64]
    b, Bt = request(e, c, B, new=[70, 71, 72, 73, 74, 75], expect=13)
    assert e.cow_copies == 1 and tail not in e.block_table(b)
    assert same(cached, pool_block(e, tail))
    # another request on the same prefix still reuses the untouched cached block
    d, _ = request(e, c, A + [90, 91], new=[92], expect=13)
    assert e.cow_copies == 2 and same(cached, pool_block(e, tail))
    check(e, b, Bt)
    for s in (b, d):
        e.free(s)
    c.clear()
    assert e.num_free_blocks == 16
    e.allocator.check()


def test_insert_live_sequence_then_it_continues():
    e = eng_(bs=4, nb=16)
    c = PrefixCache(e)
    a, A = request(e, c, list(range(7)), new=[20, 21], expect=0)  # 9 tokens, 2 in the decode buffer
    assert c.insert(a, A + [99]) == 3  # the extra id without KV is ignored
    part = e.block_table(a)[2]
    cached = pool_block(e, part)
    A = decode(e, a, A, [30, 31, 32, 33, 34])  # writes into the cached partial block: copies it
    assert e.cow_copies == 1 and e.block_table(a)[2] != part
    assert same(cached, pool_block(e, part))
    check(e, a, A)
    b, _ = request(e, c, A[:9] + [40, 41], new=[42], expect=9)
    assert c.insert(a, A) == 2  # block 2 now full (covers the partial entry, dropped) + block 3
    assert len(c) == 4 and c.stats().blocks == 4
    assert c.insert(a, A) == 0  # nothing new
    check(e, a, A)
    e.free(a)
    e.free(b)
    c.clear()
    assert e.num_free_blocks == 16
    e.allocator.check()


# ----------------------------------------------------------------------------- eviction
def _cached_seq(e, c, toks):
    s = e.add_sequence()
    prefill(e, s, toks, 0)
    c.insert(s, toks)
    e.free(s)
    return c.match(toks).blocks


def test_lru_order_leaf_first():
    e = eng_(bs=4, nb=8)
    c = PrefixCache(e)
    A, B, C = list(range(8)), list(range(10, 18)), list(range(20, 24))
    ba, bb, bc = _cached_seq(e, c, A), _cached_seq(e, c, B), _cached_seq(e, c, C)
    assert len(c) == 5 and e.num_free_blocks == 3
    c.match(A)  # A is now the most recently used
    x = e.add_sequence()
    prefill(e, x, list(range(30, 50)), 0)  # 5 blocks: B's two go (leaf first: its block 1, then 0)
    assert c.stats().evictions == 2 and [b for b, _, _ in c.entries()] == [bc[0], ba[0], ba[1]]
    assert set(e.block_table(x)) >= set(bb)
    prefill(e, x, list(range(30, 54)), 20)  # one more: C
    assert [b for b, _, _ in c.entries()] == [ba[0], ba[1]]
    prefill(e, x, list(range(30, 58)), 24)  # then A's leaf before its parent
    assert [b for b, _, _ in c.entries()] == [ba[0]]
    check(e, x, list(range(30, 58)))
    e.free(x)
    c.clear()
    assert e.num_free_blocks == 8
    e.allocator.check()


def test_eviction_never_touches_blocks_of_live_sequences():
    e = eng_(bs=4, nb=10)
    c = PrefixCache(e)
    A = list(range(12))  # 3 blocks
    ba = _cached_seq(e, c, A)
    _cached_seq(e, c, list(range(50, 58)))  # 2 blocks, cache only
    live, Lt = request(e, c, A + [77], expect=12)  # shares A's 3 blocks, writes a 4th
    assert e.block_table(live)[:3] == ba and e.num_free_blocks == 10 - 3 - 2 - 1
    x = e.add_sequence()
    X = list(range(200, 240))
    with pytest.raises(PoolExhaustedError) as ei:
        prefill(e, x, X, 0)  # 10 blocks: the pool cannot hold them
    msg = str(ei.value)
    assert "needs 10" in msg and "only 4 of 10" in msg and "4 held by live sequences" in msg, msg
    assert "2 held only by the prefix cache, 2 of them evictable" in msg, msg
    assert len(c) == 5 and c.stats().evictions == 0  # nothing evicted by a failed request
    prefill(e, x, X[:24], 0)  # 6 blocks: B's 2 are evicted, A's stay (the live sequence holds them)
    assert c.stats().evictions == 2 and c.match(A).blocks == ba and c.match(list(range(50, 58))).n_tokens == 0
    with pytest.raises(PoolExhaustedError, match="0 of them evictable"):
        prefill(e, x, X[:28], 24)
    check(e, live, Lt)
    check(e, x, X[:24])
    e.free(live)  # its own block comes back; A's blocks are now held by the cache only: evictable
    assert e.num_free_blocks == 1
    prefill(e, x, X, 24)  # 4 more blocks: the free one and A's three
    assert len(c) == 0 and c.stats().evictions == 5 and e.num_free_blocks == 0
    check(e, x, X)
    e.free(x)
    assert e.num_free_blocks == 10
    e.allocator.check()


@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_random_workload_accounting_and_kv(device, placement):
    rnd = random.Random(0)
    e = eng_(bs=4, nb=24, max_tokens=80, device=device, dtype=DT if device == "cpu" else torch.bfloat16,
             placement=placement)
    c = PrefixCache(e)
    start = e.num_free_blocks
    exhausted = [0]
    bases = [[rnd.randrange(1000) for _ in range(30)] for _ in range(3)]
    live = {}
    for it in range(60):
        base = rnd.choice(bases)
        cut = rnd.randint(0, 30)
        prompt = base[:cut] + [rnd.randrange(1000) for _ in range(rnd.randint(1, 8))]
        try:
            s, toks = request(e, c, prompt, new=[rnd.randrange(1000) for _ in range(rnd.randint(0, 6))])
        except PoolExhaustedError:
            # free a live one and go on; the failed sequence's partial state is freed too
            for sid in [sid for sid in e.sequences() if sid not in live]:
                e.free(sid)
            exhausted[0] += 1
            for sid, toks in live.items():  # nothing in use was lost
                check(e, sid, toks)
            if live:
                victim = rnd.choice(list(live))
                del live[victim]
                e.free(victim)
            continue
        live[s] = toks
        if rnd.random() < 0.7:
            c.insert(s, toks)
        if rnd.random() < 0.6 or len(live) > 4:
            victim = rnd.choice(list(live))
            check(e, victim, live.pop(victim))
            e.free(victim)
        e.allocator.check()
        assert c.stats().entries == len(c.entries())
    for s, toks in live.items():
        check(e, s, toks)
        e.free(s)
    st = c.stats()
    assert st.hits > 0 and st.evictions > 0 and exhausted[0] > 0 and e.cow_copies > 0
    c.clear()
    assert e.num_free_blocks == start
    e.allocator.check()


def test_engine_reset_keeps_cache_close_refuses():
    e = eng_(bs=4, nb=8)
    c = PrefixCache(e)
    A = list(range(6))
    s, _ = request(e, c, A)
    c.insert(s, A)
    f = e.fork(s, 5)  # a fork shares the same blocks the cache holds
    assert e.allocator.refcount(e.block_table(s)[0]) == 3
    e.reset()  # frees every sequence; the cache keeps its two blocks
    assert e.sequences() == [] and e.num_free_blocks == 6 and c.stats().blocks == 2
    e.allocator.check()
    s2, n = c.add_sequence(A + [9])
    assert n == 6 and f not in e.sequences()
    check(e, s2, A)
    e.close()
    with pytest.raises(ValueError, match="closed"):
        c.match(A)
    assert c.evictable_blocks() == 0


# -------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["host", "device"])
def test_cuda_pinned_reuse_copy_on_write_ordering(placement):
    """The parent's pool writes are queued behind a slow kernel when the child, started on the
    cached blocks, copies the shared partial block (copy-on-write) and decodes: with ordering by
    events only, every read-back is exact (pinned pool, or the pool in device memory)."""
    e = eng_(bs=64, nb=64, max_tokens=1024, device="cuda", dtype=torch.bfloat16, layers=3, placement=placement)
    c = PrefixCache(e)
    rnd = random.Random(1)
    for it in range(20):
        A = [rnd.randrange(5000) for _ in range(150)]  # 2 full blocks + 22 tokens
        B = A + [1, 2, 3]
        s = e.add_sequence()
        kv = kv_of(A, 3, "cuda", torch.bfloat16)
        kv_b = kv_of(B, 3, "cuda", torch.bfloat16)  # made now: a pageable H2D copy waits for the GPU
        for l in range(3):
            k = torch.zeros_like(kv[l][0])
            torch.cuda._sleep(20_000_000)  # ~10 ms: the D2H copies below wait behind it
            k.copy_(kv[l][0])
            e.offload_layer(s, l, k, kv[l][1])
        c.insert(s, A)
        e.free(s)
        b, n = c.add_sequence(B[:-1])
        assert n == 150
        assert not e._offload_stream.query()  # the parent's writes are still queued
        prefill(e, b, B, n, kv_b)  # copy-on-write of block 2, enqueued behind them
        toks = decode(e, b, B, [4, 5, 6, 7])
        assert e.cow_copies == it + 1
        check(e, b, toks)
        e.free(b)
    c.clear()
    assert e.num_free_blocks == 64
    e.close()


def test_peek_is_match_without_side_effects():
    """peek: the tokens match would find (full blocks and a partial tail), stats and LRU unchanged."""
    e = eng_()
    c = PrefixCache(e)
    a = list(range(1, 11))  # 2 full blocks + 2 tokens
    s = e.add_sequence()
    prefill(e, s, a, 0)
    c.insert(s, a)
    e.free(s)
    before, order = c.stats(), c.entries()
    for ids in (a, a[:9], a[:5] + [99], [99], []):
        n = c.peek(ids)
        assert c.stats() == before and c.entries() == order
        assert n == c.match(ids).n_tokens
        before, order = c.stats(), c.entries()
