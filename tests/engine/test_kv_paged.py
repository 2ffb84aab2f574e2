"""PagedKV (xoffload.engine.kv_paged): decode over the prompt's pages read in place (pool or device
row store) plus a resident tail. CPU (the kernels' references; the pool in host mode); GPU marked.

- dense decode (no policy) and Quest with a budget >= the context give the tokens of the resident
  cache, in both placements;
- one sparse layer's attention equals attention over exactly the sink, the selected pages and the
  tail, with the pages' K/V read back from the pool bit for bit;
- 20 sequential requests through one engine are unaffected by the ones before;
- the pool and tails are released.
"""
import dataclasses

import pytest
import torch

from xoffload.engine.kv_paged import PagedKV
from xoffload.kernels import cpu_backend
from xoffload.kernels.reference import attention_ref
from xoffload.models.loader import random_model
from xoffload.runtime import OffloadRuntime
from xoffload.sparse.quest import QuestDecode

T, N = 300, 10


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model("tiny-llama", dtype=torch.float32, device="cpu", std=0.2)


def _resident_reference(m, ids, n):
    """Greedy tokens and last logits with the plain resident cache of the model tests."""
    cfg = m.cfg

    class Cache:
        def __init__(self):
            self.k = torch.zeros(cfg.num_layers, len(ids) + n, cfg.num_kv_heads, cfg.head_dim)
            self.v = torch.zeros_like(self.k)
            self.pos = 0

        def buffers(self, layer, t):
            return self.k[layer, :t], self.v[layer, :t]

        def done(self, layer, k, v):
            pass

        def begin_step(self, pos=None):
            self.pos = pos

        def attend(self, layer, q, k_new, v_new):
            self.k[layer, self.pos] = k_new[0]
            self.v[layer, self.pos] = v_new[0]
            L = self.pos + 1
            o = attention_ref(q[None], self.k[layer, :L][None], self.v[layer, :L][None], causal=False,
                              softmax_scale=m.scale)[0]
            return o[0, 0]

        def end_step(self):
            pass

    return _run(m, ids, Cache(), n)


def _run(m, ids, kv, n):
    with cpu_backend("reference"), torch.no_grad():
        lg = m.prefill(ids, kv, chunk=128)
        toks, pos = [int(lg.argmax())], len(ids)
        for _ in range(n):
            kv.begin_step(pos)
            lg = m.decode_step(torch.tensor([toks[-1]]), pos, kv)
            kv.end_step()
            pos += 1
            toks.append(int(lg.argmax()))
    return toks, lg


def _engine(cfg, max_tokens, block=64):
    return OffloadRuntime(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32, device="cpu",
                         max_tokens=max_tokens, block_size=block)


@pytest.mark.parametrize("placement", ["resident", "offload", "offload-uva"])
@pytest.mark.parametrize("policy", [None, QuestDecode(token_budget=4096, page_size=16, dense_layers=()),
                                    QuestDecode(token_budget=T, page_size=32, dense_layers=(1,)),
                                    QuestDecode(token_budget=T, page_size=16, dense_layers=(), group_score="softmax"),
                                    QuestDecode(token_budget=T, page_size=16, dense_layers=(), exact_channels=4,
                                                bound_scale=0.25)])
def test_dense_equivalents_match_resident_cache(model, placement, policy):
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    if placement == "offload-uva" and policy is not None:
        pytest.skip("stage_dense applies to dense decode only")
    ref, lref = _resident_reference(model, ids, N)
    eng = _engine(cfg, T + N) if placement != "resident" else None
    seq = eng.add_sequence() if eng is not None else None
    kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=N, policy=policy,
                 engine=eng, seq=seq, stage_dense=placement != "offload-uva")
    assert kv.staged == (placement == "offload" and policy is None)
    if policy is not None:
        assert kv.plan.dense
    toks, lg = _run(model, ids, kv, N)
    assert toks == ref
    assert float((lg - lref).abs().max()) < 1e-3
    kv.close()  # frees the pool sequence too
    kv.close()  # idempotent
    if eng is not None:
        assert kv.h2d_bytes_per_step > 0
        assert eng.num_free_blocks == eng.allocator.num_blocks
        eng.close()


@pytest.mark.parametrize("cache_pages,channels", [(0, 0), (None, 0), (None, 4)])
def test_sparse_layer_reads_exactly_sink_selected_pages_and_tail(model, cache_pages, channels):
    """After prefill, one attend of a sparse layer equals exact attention over sink + the pages in
    the device page table + the tail (incl. the new token), the pages' rows taken from the pool
    (read in place, cache_pages=0) or from the GPU page cache they were copied into."""
    cfg = model.cfg
    hkv, d, g = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    pol = QuestDecode(token_budget=112, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                      cache_pages=cache_pages, exact_channels=channels, bound_scale=0.25 if channels else 1.0)
    eng = _engine(cfg, T + 4)
    seq = eng.add_sequence()
    kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=4, policy=pol,
                 engine=eng, seq=seq)
    p = kv.plan
    assert p.pages_per_step == (112 - 16 - (T - p.tail_start)) // 16 > 0
    slot_bytes = 2 * (cfg.num_layers - 1) * hkv * 16 * d * 4  # K and V of a slot in every sparse layer, fp32
    by_bytes = max(4 * p.pages_per_step, (2 << 30) // slot_bytes)
    assert kv.cache_slots == (0 if cache_pages == 0 else min(by_bytes, p.num_candidates))
    gen = torch.Generator().manual_seed(3)
    K = torch.randn(cfg.num_layers, T, hkv, d, generator=gen)
    V = torch.randn(cfg.num_layers, T, hkv, d, generator=gen)
    for layer in range(cfg.num_layers):
        k, v = kv.buffers(layer, T)
        k.copy_(K[layer])
        v.copy_(V[layer])
        kv.done(layer, k, v)
    kv.begin_step(T)
    q = torch.randn(1, cfg.num_heads, d, generator=gen)
    kn, vn = torch.randn(1, hkv, d, generator=gen), torch.randn(1, hkv, d, generator=gen)
    with cpu_backend("reference"):
        out = kv.attend(1, q, kn, vn)
    bt = eng.block_table(seq)
    if cache_pages == 0:
        rows = kv._table[0]  # [Hkv, k] rows of the chosen pages in the pool
        kp, vp = eng.pool.k_rows(1), eng.pool.v_rows(1)
    else:
        rows = kv._ctab[0, :, :p.pages_per_step]  # rows of the chosen pages in the layer's cache
        kp, vp = kv._ck[1], kv._cv[1]
        assert kv.decode_stats()["cache_hit_rate"] == 0.0  # first step: every page missed
    for h in range(hkv):
        toks = set(range(p.sink_len)) | set(range(p.tail_start, T))
        for r in rows[h].tolist():
            if cache_pages == 0:
                blk, off = divmod(r, eng.block_size)
                logical = bt.index(blk) * eng.block_size + off
            else:
                page_id = int(kv._cstate[1].tag[h, (r - kv._cbase) // 16])
                logical = (page_id + p.first_page) * 16
            assert p.sink_len <= logical < p.tail_start and logical % 16 == 0
            assert torch.equal(kp[r:r + 16, h], K[1, logical:logical + 16, h])  # fetched data == prefill K
            assert torch.equal(vp[r:r + 16, h], V[1, logical:logical + 16, h])
            toks |= set(range(logical, logical + 16))
        assert len(toks) == p.sink_len + (T - p.tail_start) + 16 * p.pages_per_step
        idx = torch.tensor(sorted(toks))
        kk = torch.cat([K[1, idx, h], kn[:, h]])
        vv = torch.cat([V[1, idx, h], vn[:, h]])
        for j in range(g):
            s = (q[0, h * g + j] @ kk.T) * model.scale
            ref = torch.softmax(s, -1) @ vv
            assert torch.allclose(out[h * g + j], ref, atol=1e-5, rtol=1e-5)
    kv.close()
    eng.close()


def test_page_cache_gives_the_uncached_tokens_and_counts_hits(model):
    """A sparse budget (not dense): offload with the page cache (with and without the next-layer
    prefetch) decodes the tokens of offload without it (fp32, logits within fp32 rounding of a
    different summation order), reports a hit rate, and its mean H2D bytes per step follow from the
    counted misses."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    res = {}
    variants = [(0, False), (None, False), (3, False), (None, True)]
    for cp, pf in variants:
        pol = QuestDecode(token_budget=128, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                          cache_pages=cp, prefetch=pf, reuse_bias=1.0)  # no bias: the cache is transparent
        eng = _engine(cfg, T + N)
        kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=N, policy=pol,
                     engine=eng, seq=eng.add_sequence())
        assert not kv.plan.dense
        assert kv.lookahead == (frozenset(range(1, cfg.num_layers)) if pf and cp != 0 else frozenset())
        toks, lg = _run(model, ids, kv, N)
        res[cp, pf] = (toks, lg, kv.h2d_bytes_per_step, kv.decode_stats())
        kv.close()
        assert eng.num_free_blocks == eng.allocator.num_blocks
        eng.close()
    k = QuestDecode(token_budget=128, page_size=16, sink_tokens=16, recent_tokens=32).plan(T).pages_per_step
    full = res[0, False][2]
    for key in variants[1:]:
        toks, lg, h2d, st = res[key]
        assert toks == res[0, False][0]
        assert float((lg - res[0, False][1]).abs().max()) < 1e-4
        n_cand = QuestDecode(token_budget=128, page_size=16, sink_tokens=16, recent_tokens=32).plan(T).num_candidates
        assert st["cache_slots"] == (max(3, k) if key[0] == 3 else n_cand)  # >= one step's pages; 2 GiB holds all
        assert 0.0 <= st["cache_hit_rate"] < 1.0
        share = st["prefetch_share"]
        assert (share > 0) == key[1]
        assert h2d == pytest.approx((1 - st["cache_hit_rate"]) / (1 - share) * full, abs=1)  # int bytes
    assert res[0, False][3] == {}
    assert res[None, False][3]["cache_hit_rate"] > 0  # consecutive steps choose some pages again
    # the prefetched pages are found by the exact selection more often than the cache alone finds them
    assert res[None, True][3]["cache_hit_rate"] > res[None, False][3]["cache_hit_rate"]


def test_reuse_bias_keeps_cached_pages_and_is_exact_at_a_full_budget(model):
    """QuestDecode(reuse_bias=B): cached pages compete with their score + ln(B) / scale, so with
    a small cache the hit rate rises and the bytes per step fall against B = 1 (the same plan);
    the selection differs only by that bias (checked on one layer's step against topk of the
    shifted scores); with a budget covering the prompt every page is read and the tokens equal
    dense offload decode."""
    import math

    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    stats = {}
    for bias in (1.0, 64.0):
        pol = QuestDecode(token_budget=128, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                          cache_pages=4, reuse_bias=bias)
        eng = _engine(cfg, T + N)
        kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=N, policy=pol,
                     engine=eng, seq=eng.add_sequence())
        assert kv.cache_slots == kv.plan.pages_per_step == 4
        if bias != 1.0:  # one selection, seen from outside: topk_ids of the scores shifted on cached pages
            import xoffload.engine.kv_paged as kp

            seen = []
            orig = kp.select_page_ids

            def spy(sc, k, **kw):
                out = orig(sc, k, **kw)
                seen.append((sc.clone(), kw["prefer"].clone(), kw["prefer_bonus"], out.clone()))
                return out

            kp.select_page_ids = spy
        try:
            _run(model, ids, kv, N)
        finally:
            if bias != 1.0:
                kp.select_page_ids = orig
        stats[bias] = (kv.decode_stats()["cache_hit_rate"], kv.h2d_bytes_per_step)
        kv.close()
        eng.close()
    sc, pref, bonus, out = seen[-1]
    assert bonus == pytest.approx(math.log(64.0) / model.scale)
    shifted = sc + (pref[:, :sc.shape[1]] >= 0).float() * bonus
    assert torch.equal(out, kp.select_page_ids(shifted, 4))  # the shifted scores' own top 4
    assert stats[64.0][0] > stats[1.0][0] and stats[64.0][1] < stats[1.0][1]
    # a full budget reads every page whatever the bias
    dense_pol = QuestDecode(token_budget=None, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                            reuse_bias=1.0)
    toks = {}
    for pol in (dense_pol, dataclasses.replace(dense_pol, reuse_bias=8.0)):
        eng = _engine(cfg, T + N)
        kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=N, policy=pol,
                     engine=eng, seq=eng.add_sequence())
        toks[pol.reuse_bias] = _run(model, ids, kv, N)[0]
        kv.close()
        eng.close()
    assert toks[1.0] == toks[8.0]


def test_twenty_sequential_requests_are_independent(model):
    """One engine serves 20 requests of different lengths, sparse and dense, one after another;
    each gives what it gives alone (the seeds' request-switch bug: 66% -> 100%)."""
    cfg = model.cfg
    eng = _engine(cfg, 400)
    alone = {}
    pol = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=())
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=gen) for n in torch.randint(40, 390, (20,),
                                                                                                 generator=gen)]
    for i, ids in enumerate(prompts[:5]):
        e1 = _engine(cfg, 400)
        s1 = e1.add_sequence()
        alone[i] = _run(model, ids, PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=len(ids),
                                            max_new=3, policy=pol, engine=e1, seq=s1), 3)[0]
        e1.close()  # (its sequence goes with it)
    for i, ids in enumerate(prompts):
        seq = eng.add_sequence()
        kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=len(ids), max_new=3,
                     policy=pol if i % 2 == 0 or i < 5 else None, engine=eng, seq=seq)
        toks = _run(model, ids, kv, 3)[0]
        if i in alone:
            assert toks == alone[i], i
        kv.close()
    assert eng.num_free_blocks == eng.allocator.num_blocks
    eng.close()


def test_bad_page_size_for_pool(model):
    cfg = model.cfg
    eng = _engine(cfg, 400, block=48)
    with pytest.raises(ValueError, match="must divide the pool's block size"):
        PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=100, max_new=2,
                policy=QuestDecode(page_size=32), engine=eng, seq=eng.add_sequence())
    eng.close()


@pytest.mark.cuda
@pytest.mark.parametrize("cache_pages,channels", [(0, 0), (None, 0), (0, 8)])
def test_gpu_offload_sparse_equals_resident_sparse_bf16(cache_pages, channels):
    """On the GPU (bf16): the same Quest selection read from the pinned pool over UVA or from a
    device row store gives the same logits bit for bit; through the GPU page cache (one attention
    call over pages + tail instead of two merged) within bf16 rounding per layer."""
    m = random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", std=0.2)
    cfg = m.cfg
    ids = torch.randint(0, cfg.vocab_size, (600,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pol = QuestDecode(token_budget=160, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                      cache_pages=cache_pages, exact_channels=channels, bound_scale=0.25 if channels else 1.0,
                      reuse_bias=1.0)  # the same selection in both placements (the bias would follow the cache)
    outs, toks = [], None
    for offload in (False, True):
        eng = OffloadRuntime(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda",
                            max_tokens=700, block_size=64) if offload else None
        seq = eng.add_sequence() if eng else None
        kv = PagedKV(cfg, torch.bfloat16, torch.device("cuda"), m.scale, prompt_len=600, max_new=8, policy=pol,
                     engine=eng, seq=seq)
        with torch.no_grad():
            m.prefill(ids, kv)
            lgs, tok, fed = [], torch.zeros(1, dtype=torch.int64, device="cuda"), []
            for i in range(8):
                kv.begin_step(600 + i)
                lg = m.decode_step(tok if toks is None else toks[i], 600 + i, kv)
                fed.append(tok if toks is None else toks[i])
                tok = lg.argmax(-1)
                lgs.append(lg)
        toks = fed if toks is None else toks
        outs.append(torch.cat(lgs))
        if offload:
            assert (kv.cache_slots > 0) == (cache_pages is None)
        kv.close()
        if eng:
            eng.close()
    if cache_pages == 0:
        assert torch.equal(outs[0], outs[1])
    else:
        tol = cfg.num_layers * torch.finfo(torch.bfloat16).eps * float(outs[0].abs().max())
        assert float((outs[0] - outs[1]).abs().max()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("budget,offload_decode", [(None, "direct"), (None, "uva"), (256, "direct")])
def test_gpu_direct_offload_graph_equals_eager_and_tracks_resident(budget, offload_decode):
    """Offload mode's direct decode on the GPU (bf16, random Llama-3.2-1B, 2000-token prompt):
    the CUDA-graph steps give the eager loop's tokens exactly, sequential requests repeat
    themselves, and (dense, budget None) each step's logits, fed the resident run's tokens, stay
    within bf16 rounding of the resident cache's (the two sum attention in different orders)."""
    from xoffload import LLM, SamplingParams
    from xoffload.engine.kv_store import ResidentKV

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    ids = torch.randint(0, m.cfg.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(max_tokens=17, ignore_eos=True)
    graph = LLM(m, mode="offload", max_model_len=4096, token_budget=budget, offload_decode=offload_decode)
    eager = LLM(m, mode="offload", max_model_len=4096, token_budget=budget, cuda_graph=False,
                offload_decode=offload_decode)
    a = graph.generate(ids, sp)[0]
    assert a.token_ids == eager.generate(ids, sp)[0].token_ids == graph.generate(ids, sp)[0].token_ids
    assert a.timings["decode_steady_ms_per_token"] > 0
    if budget is not None:
        return
    res = LLM(m, mode="resident", max_model_len=4096).generate(ids, sp)[0]
    toks = torch.tensor([ids[-1]] + res.token_ids, device="cuda")
    ids_t = torch.tensor(ids, device="cuda")
    T, n = len(ids), 8
    r = ResidentKV(m.cfg, T + n, m.dtype, m.device, m.scale, max_len=T + n)
    eng = graph.offload
    d = PagedKV(m.cfg, m.dtype, m.device, m.scale, prompt_len=T, max_new=n, engine=eng, seq=eng.add_sequence(),
                stage_dense=offload_decode == "direct")
    with torch.no_grad():
        la, lb = m.prefill(ids_t, r), m.prefill(ids_t, d)
        assert torch.equal(la, lb)  # the same prefill
        for i in range(n):
            r.begin_step(T + i)
            d.begin_step(T + i)
            la = m.decode_step(toks[i + 1:i + 2], T + i, r)
            lb = m.decode_step(toks[i + 1:i + 2], T + i, d)
            # attention outputs differ by bf16 rounding of a different summation order in each
            # layer: allow one bf16 eps of the logit scale per layer
            tol = m.cfg.num_layers * torch.finfo(torch.bfloat16).eps * float(la.abs().max())
            assert float((la - lb).abs().max()) <= tol, i
    d.close()
    r.close()


def test_policy_with_every_layer_dense_uses_no_cache(model):
    """Quest's default dense layers (0, 1) on a 2-layer model leave no sparse layer: no page cache
    (it used to fail with a KeyError at the first step) and the resident cache's tokens."""
    cfg = model.cfg
    assert cfg.num_layers == 2
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(6))
    ref, _ = _resident_reference(model, ids, 4)
    eng = _engine(cfg, T + 4)
    kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=4,
                 policy=QuestDecode(token_budget=64, page_size=16), engine=eng, seq=eng.add_sequence())
    assert kv.sparse == frozenset() and kv.cache_slots == 0
    assert _run(model, ids, kv, 4)[0] == ref
    kv.close()
    eng.close()
