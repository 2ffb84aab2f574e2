"""Tests of the GPU page cache (page_cache_lookup / page_cache_fill) against its PyTorch reference,
and of its invariants over many steps: every selected page's cache rows equal the pool's bit for
bit, the state stays consistent (slot_of and tag are inverse maps), a page selected every step is
never evicted, and a repeated selection is all hits; the batched lookup (one launch for the rows of
a decode batch, each sequence with its own state rows, slots and base, rows reordered between
steps) evolves every sequence's cache exactly as the one-sequence lookup does.

CPU: the Triton code under the interpreter (and the reference under cpu_backend("reference")).
GPU (``-m cuda``): the pool in pinned host memory read over UVA, inside a CUDA graph.
"""
import contextlib

import pytest
import torch

from helpers import HAS_CUDA
from xoffload.kernels import cpu_backend
from xoffload.kernels.page_cache import (PageCacheState, page_cache_fill, page_cache_fill_scales, page_cache_lookup,
                                         page_cache_lookup_batched)

P = 16  # page size


def _pool(n_rows, hkv, d, dtype=torch.float16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_rows, hkv, d, generator=g).to(dtype)
    return k.to(device), v.to(device)


def _selections(steps, hkv, k, n, seed=1, reuse=0.6):
    """Per step, ``[Hkv, K]`` distinct page ids with about ``reuse`` of them kept from the last step."""
    g = torch.Generator().manual_seed(seed)
    prev = [torch.randperm(n, generator=g)[:k] for _ in range(hkv)]
    out = []
    for _ in range(steps):
        rows = []
        for h in range(hkv):
            keep = prev[h][torch.rand(k, generator=g) < reuse]
            rest = torch.tensor([p for p in torch.randperm(n, generator=g).tolist() if p not in set(keep.tolist())])
            rows.append(torch.cat([keep, rest[: k - keep.numel()]]))
        prev = rows
        out.append(torch.stack(rows))
    return out


class _Cache:
    """One layer's cache: [base | C slots] rows, state, and the step outputs."""

    def __init__(self, hkv, d, C, n_ids, dtype, device, base=0):
        self.base = base
        self.k = torch.zeros(base + C * P, hkv, d, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.st = PageCacheState(hkv, C, n_ids, device)
        self.hits = torch.zeros(2, dtype=torch.int64, device=device)

    def step(self, pages, pool_k, pool_v, first_page=0, bt=None, block=0):
        hkv, k = pages.shape
        table = torch.empty(hkv, k, dtype=torch.int32, device=pages.device)
        src = torch.empty_like(table)
        page_cache_lookup(pages, self.st, table, src, first_page=first_page, page_size=P, base=self.base,
                          block_table=bt, block_size=block, hits=self.hits)
        page_cache_fill(pool_k, pool_v, self.k, self.v, src, table, page_size=P)
        return table, src


def _check_invariants(c: _Cache, pages, table, pool_k, pool_v, first_page=0, bt=None, block=0):
    st = c.st
    hkv, C = st.tag.shape
    for h in range(hkv):
        for s in range(C):
            t = int(st.tag[h, s])
            if t >= 0:
                assert int(st.slot_of[h, t]) == s
        held = (st.slot_of[h] >= 0).nonzero().flatten()
        for pg in held.tolist():
            assert int(st.tag[h, st.slot_of[h, pg]]) == pg
        for j, pg in enumerate(pages[h].tolist()):
            tok = (pg + first_page) * P
            row = tok if bt is None else int(bt[tok // block]) * block + tok % block
            r = int(table[h, j])
            assert r == c.base + int(st.slot_of[h, pg]) * P
            assert torch.equal(c.k[r:r + P, h].cpu(), pool_k[row:row + P, h].cpu())
            assert torch.equal(c.v[r:r + P, h].cpu(), pool_v[row:row + P, h].cpu())


@pytest.mark.parametrize("C,k,n", [(8, 8, 40), (13, 8, 40), (16, 8, 40), (2500, 70, 3000)])
def test_many_steps_match_pool_and_reference(C, k, n):
    hkv, d = 3, 24
    pool_k, pool_v = _pool(n * P, hkv, d)
    sels = _selections(12, hkv, k, n)
    tri = _Cache(hkv, d, C, n, torch.float16, "cpu", base=2 * P)
    ref = _Cache(hkv, d, C, n, torch.float16, "cpu", base=2 * P)
    for pages in sels:
        t1, s1 = tri.step(pages.to(torch.int64), pool_k, pool_v)
        with cpu_backend("reference"):
            t2, s2 = ref.step(pages.to(torch.int64), pool_k, pool_v)
        assert torch.equal(t1, t2) and torch.equal(s1, s2)
        for a, b in ((tri.st.tag, ref.st.tag), (tri.st.slot_of, ref.st.slot_of), (tri.st.clock, ref.st.clock)):
            assert torch.equal(a, b)
        _check_invariants(tri, pages, t1, pool_k, pool_v)
    assert torch.equal(tri.hits, ref.hits) and int(tri.hits[0]) > 0
    assert int(tri.hits[1]) == 12 * hkv * k


def test_state_reset_and_slot_limit():
    from xoffload.kernels.page_cache import MAX_SLOTS
    with pytest.raises(ValueError, match="num_slots"):
        PageCacheState(2, MAX_SLOTS + 1, 10, "cpu")
    hkv, d, k, n = 2, 16, 4, 12
    pool_k, pool_v = _pool(n * P, hkv, d, torch.float32)
    c = _Cache(hkv, d, 6, n, torch.float32, "cpu")
    pages = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    c.step(pages, pool_k, pool_v)
    c.st.reset()
    _, src = c.step(pages, pool_k, pool_v)  # after a reset nothing is cached
    assert bool((src >= 0).all())


def test_block_table_rows_and_first_page():
    """Missed pages are read at the pool rows the block table gives (block 32 = 2 pages)."""
    hkv, d, k, block = 2, 16, 4, 32
    n_blocks = 6
    bt = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int32)
    pool_k, pool_v = _pool(n_blocks * block, hkv, d, torch.float32)
    first = 1
    n = n_blocks * block // P - first
    c = _Cache(hkv, d, 8, n, torch.float32, "cpu")
    for pages in _selections(5, hkv, k, n, seed=3):
        table, src = c.step(pages, pool_k, pool_v, first_page=first, bt=bt, block=block)
        _check_invariants(c, pages, table, pool_k, pool_v, first_page=first, bt=bt, block=block)


def test_repeat_is_all_hits_and_hot_page_stays():
    hkv, d, k, n, C = 2, 16, 4, 32, 6
    pool_k, pool_v = _pool(n * P, hkv, d, torch.float32)
    c = _Cache(hkv, d, C, n, torch.float32, "cpu")
    pages = torch.tensor([[0, 5, 9, 3], [1, 2, 7, 30]])
    c.step(pages, pool_k, pool_v)
    assert int(c.hits[0]) == 0
    _, src = c.step(pages, pool_k, pool_v)
    assert int(c.hits[0]) == hkv * k and bool((src == -1).all())
    # page 0 / 1 chosen every step while the rest changes: never evicted
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        others = torch.stack([torch.randperm(n - 2, generator=g)[:k - 1] + 2 for _ in range(hkv)])
        hot = torch.tensor([[0], [1]])
        before = c.hits.clone()
        _, src = c.step(torch.cat([hot, others], 1), pool_k, pool_v)
        assert int(src[0, 0]) == -1 and int(src[1, 0]) == -1
        assert int(c.hits[0] - before[0]) >= hkv


def test_misses_fill_exactly_k_slots_when_cache_equals_k():
    """C == K: every step's selection fits (each miss takes a slot no hit holds)."""
    hkv, d, k, n = 2, 16, 5, 20
    pool_k, pool_v = _pool(n * P, hkv, d, torch.float32)
    c = _Cache(hkv, d, k, n, torch.float32, "cpu")
    for pages in _selections(8, hkv, k, n, seed=5, reuse=0.5):
        table, _ = c.step(pages, pool_k, pool_v)
        _check_invariants(c, pages, table, pool_k, pool_v)
        assert len(set(table[0].tolist())) == k


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_lookup_equals_one_sequence_at_a_time(backend):
    """Three sequences (own slot counts C, candidate counts, pages per step and block tables) and a
    padding row in one batched launch per step, the rows in a different order each step: tables,
    copies, replacement state and hit counters equal the one-sequence lookup of each, and the
    cache rows the fill wrote equal the pool's."""
    import contextlib

    hkv, d, block, steps = 2, 8, 32, 6
    seqs = [dict(C=9, n=30, k=5, first=1), dict(C=6, n=14, k=6, first=0), dict(C=12, n=40, k=3, first=2)]
    S, cmax, kw = len(seqs) + 1, max(x["C"] for x in seqs), max(x["k"] for x in seqs)
    nid = max(x["n"] for x in seqs)
    g = torch.Generator().manual_seed(11)
    n_blocks = 4 * sum(-(-(x["n"] + x["first"]) * P // block) for x in seqs)
    pool_k, pool_v = _pool(n_blocks * block, hkv, d, torch.float32)
    perm = torch.randperm(n_blocks, generator=g)
    used = 0
    for i, x in enumerate(seqs):
        nb = -(-(x["n"] + x["first"]) * P // block)
        x["bt"] = perm[used:used + nb].to(torch.int32)
        used += nb
        tok = (torch.arange(x["n"]) + x["first"]) * P
        x["cand"] = (x["bt"].long()[tok // block] * block + tok % block).to(torch.int32)
        x["base"] = i * cmax * P
        x["alone"] = _Cache(hkv, d, x["C"], x["n"], torch.float32, "cpu", base=x["base"])
        x["sels"] = [sel.sort(-1).values for sel in _selections(steps, hkv, x["k"], x["n"], seed=20 + i)]
    st = PageCacheState(S * hkv, cmax, nid, "cpu")
    ck = torch.zeros(S * cmax * P, hkv, d)
    cv = torch.zeros_like(ck)
    hits = torch.zeros(S, 2, dtype=torch.int64)
    ctx = (lambda: cpu_backend("reference")) if backend == "reference" else contextlib.nullcontext
    for t in range(steps):
        order = [(t + j) % 3 for j in range(3)]  # a new row order every step
        rows = [seqs[i] for i in order] + [None]  # + one padding row
        n = len(rows)
        pages = torch.full((n, hkv, kw), 10 ** 6, dtype=torch.int64)  # junk past each row's count
        cand = torch.zeros(n, nid, dtype=torch.int32)
        meta = torch.zeros(4, n, dtype=torch.int32)  # slot, k, C, base
        for r, (i, x) in enumerate(zip(order + [None], rows)):
            if x is None:
                meta[:, r] = torch.tensor([S - 1, 0, 1, 0])
                continue
            pages[r, :, :x["k"]] = x["sels"][t]
            cand[r, :x["n"]] = x["cand"]
            meta[:, r] = torch.tensor([i, x["k"], x["C"], x["base"]])
        table = torch.full((n, hkv, kw), -7, dtype=torch.int32)
        src = torch.empty(n, hkv, kw, dtype=torch.int32)
        with ctx():
            page_cache_lookup_batched(pages, st, meta[0], meta[1], meta[2], meta[3], cand, table, src,
                                      page_size=P, hits=hits)
            page_cache_fill(pool_k, pool_v, ck, cv, src, table, page_size=P)
        for r, (i, x) in enumerate(zip(order, rows)):
            with cpu_backend("reference"):
                t1, s1 = x["alone"].step(x["sels"][t], pool_k, pool_v, first_page=x["first"], bt=x["bt"], block=block)
            k = x["k"]
            assert torch.equal(table[r, :, :k], t1) and torch.equal(src[r, :, :k], s1), (t, i)
            assert bool((src[r, :, k:] == -1).all()) and bool((table[r, :, k:] == -7).all())
            a = x["alone"].st
            for h in range(hkv):
                sr = i * hkv + h
                assert torch.equal(st.tag[sr, :x["C"]], a.tag[h]) and bool((st.tag[sr, x["C"]:] == -1).all())
                assert torch.equal(st.slot_of[sr, :x["n"]], a.slot_of[h]) and int(st.clock[sr]) == int(a.clock[h])
                for j in range(k):  # the rows the fill wrote are the pool's
                    rr, pg = int(table[r, h, j]), int(x["sels"][t][h, j])
                    prow = int(x["cand"][pg])
                    assert torch.equal(ck[rr:rr + P, h], pool_k[prow:prow + P, h])
                    assert torch.equal(cv[rr:rr + P, h], pool_v[prow:prow + P, h])
        assert bool((src[n - 1] == -1).all())  # the padding row copies nothing
    for i, x in enumerate(seqs):
        assert torch.equal(hits[i], x["alone"].hits), i
    assert int(hits[:3, 0].sum()) > 0 and int(hits[S - 1].sum()) == 0


def test_batched_lookup_bad_inputs():
    st = PageCacheState(4, 6, 10, "cpu")
    one = torch.zeros(2, dtype=torch.int32)
    cand = torch.zeros(2, 10, dtype=torch.int32)
    t = torch.empty(2, 2, 5, dtype=torch.int32)
    ok = dict(page_size=16)
    pages = torch.zeros(2, 2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a multiple of the 3 KV heads"):
        page_cache_lookup_batched(torch.zeros(2, 3, 5, dtype=torch.int64), st, one, one, one, one, cand,
                                  torch.empty(2, 3, 5, dtype=torch.int32), torch.empty(2, 3, 5, dtype=torch.int32), **ok)
    with pytest.raises(ValueError, match="7 pages per KV head do not fit a cache of 6 slots"):
        page_cache_lookup_batched(torch.zeros(2, 2, 7, dtype=torch.int64), st, one, one, one, one, cand, t, t, **ok)
    with pytest.raises(ValueError, match=r"row_k must be \[2\]"):
        page_cache_lookup_batched(pages, st, one, torch.zeros(3, dtype=torch.int32), one, one, cand, t, t.clone(), **ok)
    with pytest.raises(TypeError, match="row_base"):
        page_cache_lookup_batched(pages, st, one, one, one, one.long(), cand, t, t.clone(), **ok)
    with pytest.raises(ValueError, match=r"src must be \[2, 2, 5\]"):
        page_cache_lookup_batched(pages, st, one, one, one, one, cand, t, torch.empty(2, 2, 4, dtype=torch.int32), **ok)
    with pytest.raises(ValueError, match="src is on meta, pages on cpu"):
        page_cache_lookup_batched(pages, st, one, one, one, one, cand, t, torch.empty(2, 2, 5, dtype=torch.int32,
                                                                                     device="meta"), **ok)
    k = torch.zeros(32, 2, 8)
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        page_cache_fill(k, k, k, k, [[1]], t, page_size=16)
    with pytest.raises(ValueError, match="batched src must be contiguous"):
        page_cache_fill(k, k, k, k, torch.zeros(2, 4, 2, dtype=torch.int32)[:, ::2], t[:, :, :2].contiguous(),
                        page_size=16)
    with pytest.raises(ValueError, match="hits must have 2 dims"):
        page_cache_lookup_batched(pages, st, one, one, one, one, cand, t, t.clone(), hits=torch.zeros(2, dtype=torch.int64), **ok)


def test_bad_inputs():
    st = PageCacheState(2, 4, 10, "cpu")
    t = torch.empty(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit a cache of 4 slots"):
        page_cache_lookup(torch.zeros(2, 5, dtype=torch.int64), st, t, t.clone(), first_page=0, page_size=16)
    t = torch.empty(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="pages"):
        page_cache_lookup(torch.zeros(2, 3), st, t, t.clone(), first_page=0, page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        page_cache_lookup(torch.zeros(2, 3, dtype=torch.int64), st, t, t.clone(), first_page=0, page_size=24)
    with pytest.raises(ValueError, match="block_size 24 must be a multiple"):
        page_cache_lookup(torch.zeros(2, 3, dtype=torch.int64), st, t, t.clone(), first_page=0, page_size=16,
                          block_table=torch.zeros(4, dtype=torch.int32), block_size=24)
    with pytest.raises(ValueError, match="KV heads"):
        page_cache_lookup(torch.zeros(3, 3, dtype=torch.int64), st, t, t.clone(), first_page=0, page_size=16)
    with pytest.raises(ValueError, match="num_slots"):
        PageCacheState(2, 0, 10, "cpu")
    k = torch.zeros(32, 2, 8)
    with pytest.raises(TypeError, match="one dtype"):
        page_cache_fill(k, k, k.half(), k.half(), t, t, page_size=16)


@pytest.mark.parametrize("gran", ["page", "token"])
@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_fp8_fill_moves_the_scales_of_the_pages_it_moves(gran, backend, device):
    """e4m3 codes and their fp32 scales (per page of 16 rows or per row) of the missed pages land
    at their cache rows, bit for bit; hits (-1) and the other cache rows keep what they held.
    ``kernel``: the Triton kernels (the GPU or the interpreter); ``reference``: the torch path."""
    if backend == "reference" and device == "cuda":
        pytest.skip("the torch path serves CPU tensors")
    P, hkv, d, rows = 16, 2, 32, 8 * 16
    g = torch.Generator().manual_seed(0)
    src_k = (torch.randn(rows, hkv, d, generator=g) * 8).to(torch.float8_e4m3fn).to(device)
    src_v = (torch.randn(rows, hkv, d, generator=g) * 8).to(torch.float8_e4m3fn).to(device)
    srows = rows // P if gran == "page" else rows
    src_ks, src_vs = (torch.rand(srows, hkv, generator=g).to(device) + 1 for _ in range(2))
    dst_k = torch.zeros(4 * P, hkv, d, dtype=torch.float8_e4m3fn, device=device)
    dst_v = torch.zeros_like(dst_k)
    drows = 4 if gran == "page" else 4 * P
    dst_ks, dst_vs = (torch.full((drows, hkv), -1.0, device=device) for _ in range(2))
    src = torch.tensor([[5 * P, -1], [2 * P, 7 * P]], dtype=torch.int32, device=device)  # [Hkv, K] pool rows
    table = torch.tensor([[0, 1 * P], [2 * P, 3 * P]], dtype=torch.int32, device=device)  # cache rows
    with cpu_backend("reference") if backend == "reference" else contextlib.nullcontext():
        page_cache_fill(src_k, src_v, dst_k, dst_v, src, table, page_size=P)
        page_cache_fill_scales(src_ks, src_vs, dst_ks, dst_vs, src, table, page_size=P, granularity=gran)
    u = lambda t: t.view(torch.uint8).cpu()  # noqa: E731
    div = P if gran == "page" else 1
    n = 1 if gran == "page" else P
    for h in range(hkv):
        for j in range(2):
            s, t = int(src[h, j]), int(table[h, j])
            if s < 0:
                assert (u(dst_k[t:t + P, h]) == 0).all() and (dst_ks[t // div:t // div + n, h] == -1).all()
                continue
            assert torch.equal(u(dst_k[t:t + P, h]), u(src_k[s:s + P, h]))
            assert torch.equal(u(dst_v[t:t + P, h]), u(src_v[s:s + P, h]))
            assert torch.equal(dst_ks[t // div:t // div + n, h], src_ks[s // div:s // div + n, h])
            assert torch.equal(dst_vs[t // div:t // div + n, h], src_vs[s // div:s // div + n, h])
    with pytest.raises(ValueError, match="granularity must be 'page' or 'token', got 'row'"):
        page_cache_fill_scales(src_ks, src_vs, dst_ks, dst_vs, src, table, page_size=P, granularity="row")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_pinned_pool_in_cuda_graph():
    hkv, d, k, n, C = 8, 128, 64, 1024, 128
    pool_k, pool_v = _pool(n * P, hkv, d, torch.bfloat16)
    pool_k, pool_v = pool_k.pin_memory(), pool_v.pin_memory()
    c = _Cache(hkv, d, C, n, torch.bfloat16, "cuda", base=4 * P)
    sels = _selections(6, hkv, k, n, seed=7)
    pages = torch.empty(hkv, k, dtype=torch.int64, device="cuda")
    table = torch.empty(hkv, k, dtype=torch.int32, device="cuda")
    src = torch.empty_like(table)

    def step():
        page_cache_lookup(pages, c.st, table, src, first_page=0, page_size=P, base=c.base, hits=c.hits)
        page_cache_fill(pool_k, pool_v, c.k, c.v, src, table, page_size=P)

    pages.copy_(sels[0])
    step()  # warm-up (compiles)
    torch.cuda.synchronize()
    ref = _Cache(hkv, d, C, n, torch.bfloat16, "cpu", base=4 * P)
    with cpu_backend("reference"):
        ref.step(sels[0], pool_k, pool_v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for pages_h in sels[1:]:
        pages.copy_(pages_h)
        g.replay()
        torch.cuda.synchronize()
        with cpu_backend("reference"):
            t_ref, _ = ref.step(pages_h, pool_k, pool_v)
        assert torch.equal(table.cpu(), t_ref)
        _check_invariants(c, pages_h, table, pool_k, pool_v)
    assert torch.equal(c.hits.cpu(), ref.hits)
