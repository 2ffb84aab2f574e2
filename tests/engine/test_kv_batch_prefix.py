"""Prefix caching in batched resident generation (xoffload.kv.resident_prefix): the prompts of a
call share the GPU pool blocks of their common prefixes.

CPU, fp32 (the kernels' references): 8 questions over one document give the same tokens as without
caching and as each prompt alone, every prompt after the first reusing the document; prefixes
ending inside a block (copy-on-write), exact repeats and a small pool that must evict cached
blocks give the same tokens; the allocator's books balance and a copied block never changes
another holder's KV; bad configurations are refused; fed the same tokens, the cached rows' logits
equal each prompt alone. GPU (marked): bf16 with the CUDA-graph decode equal to eager, and the
teacher-forced logits within bf16 rounding of each prompt alone.
"""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SP = SamplingParams(max_tokens=6, ignore_eos=True)
SDPA = {"prefill_attn": "sdpa"}


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _store_spy(monkeypatch):
    """Record every ResidentPrefixBatchKV the calls open (to inspect its pool before close)."""
    from xoffload.kv import resident_prefix as kp

    seen = []
    orig_close = kp.ResidentPrefixBatchKV.close

    def close(self):
        alloc = self.pool.alloc
        alloc.check()
        seen.append({"cow": self.cow_copies, "seq_blocks": alloc.usage()["seq_held"],
                     "hits": self.cache.stats().hits, "evictions": self.cache.stats().evictions})
        orig_close(self)

    monkeypatch.setattr(kp.ResidentPrefixBatchKV, "close", close)
    return seen


def test_eight_questions_over_one_document(monkeypatch):
    seen = _store_spy(monkeypatch)
    m = tiny_random()
    doc = _prompts([300], seed=70)[0]
    prompts = [doc + q for q in _prompts([20 + i for i in range(8)], seed=71)]
    kw = dict(mode="resident", kv_block_size=32, max_model_len=1024, max_num_seqs=4, **SDPA)
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, SP)]
    alone = [LLM(m, mode="resident", max_model_len=1024, **SDPA).generate(p, SP)[0].token_ids for p in prompts[:2]]
    assert want[:2] == alone
    llm = LLM(m, prefix_caching=True, **kw)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    reused = [o.timings.get("prefix_reused_tokens", 0) for o in outs]
    assert reused[0] == 0 and all(r >= 288 for r in reused[1:]), reused  # the document's 9 whole blocks at least
    assert seen[-1]["seq_blocks"] == 0 and seen[-1]["hits"] >= 7 * 288
    # the prefill figures count what the prefills computed, not the reused tokens
    assert llm.batch_stats["prefill_tokens"] == sum(len(p) for p in prompts) - sum(reused)
    t = outs[1].timings
    assert t["prefill_tok_per_s"] == pytest.approx((len(prompts[1]) - reused[1]) / t["prefill_ms"] * 1e3)
    assert llm.prefix_cache is None  # resident: the cache is the call's


def test_one_sequence_at_a_time_reuses_the_store_epochs_blocks(monkeypatch):
    """max_num_seqs=1 (a batch of one): the prompts of one call run one after another in one store
    epoch, and each after the first reuses the document's blocks the earlier ones left in the
    pool; the tokens of each prompt alone without caching; the pool's books balance."""
    seen = _store_spy(monkeypatch)
    m = tiny_random()
    doc = _prompts([300], seed=73)[0]
    prompts = [doc + q for q in _prompts([20, 25, 31], seed=74)]
    alone = LLM(m, mode="resident", max_model_len=1024, **SDPA)
    want = [alone.generate(p, SP)[0].token_ids for p in prompts]
    llm = LLM(m, mode="resident", kv_block_size=32, max_model_len=1024, prefix_caching=True, **SDPA)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    assert [o.timings.get("prefix_reused_tokens", 0) for o in outs] == [0, 300, 300]
    assert llm.batch_stats["max_running"] == 1 and llm.batch_stats["store"]["store"] == "ResidentPrefixBatchKV"
    assert len(seen) == 1 and seen[0]["seq_blocks"] == 0 and seen[0]["hits"] >= 2 * 300


def test_partial_blocks_repeats_and_a_small_pool_that_evicts(monkeypatch):
    """Prefixes ending inside a block (its copy-on-write), exact repeats, and a pool of 8 blocks
    for 2 sequences at a time (cached blocks evicted to admit the next): the tokens of the run
    without caching, every call."""
    seen = _store_spy(monkeypatch)
    m = tiny_random()
    a, b, c = _prompts([64, 33, 95], seed=72)
    prompts = [a, a + b, a, a + b[:10], c, a + b + [5], c[:40], a + b]
    kw = dict(mode="resident", kv_block_size=32, max_model_len=256, max_num_seqs=2, kv_cache_tokens=8 * 32, **SDPA)
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, SP)]
    llm = LLM(m, prefix_caching=True, **kw)
    for _ in range(2):
        outs = llm.generate(prompts, SP)
        assert [o.token_ids for o in outs] == want
        reused = [o.timings.get("prefix_reused_tokens", 0) for o in outs]
        assert reused[2] == 63 and reused[7] > 64, reused  # a repeat: all but its last token
    st = seen[-1]
    assert st["cow"] > 0 and st["evictions"] > 0 and st["seq_blocks"] == 0


def test_copy_on_write_keeps_the_other_holders_kv():
    """Two prompts sharing a prefix that ends inside a block: the second copies that block before
    writing its own tokens there, so the first's KV rows are unchanged (checked in the pool)."""
    from xoffload.kv.resident_prefix import ResidentPrefixBatchKV
    from xoffload.engine.scheduler import Sequence
    from xoffload.engine.request import Request

    m = tiny_random()
    llm = LLM(m, mode="resident", kv_block_size=32, max_model_len=256, max_num_seqs=2, prefix_caching=True, **SDPA)
    a, b = _prompts([40, 30], seed=5)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=256, seed=0, stop_ids=set(), device=m.device))
            for i, p in enumerate([a, a[:36] + b])]
    st = ResidentPrefixBatchKV(m, llm.config, None, seqs)
    for s in seqs:
        st.admit(s)
    assert st.prefill_start(seqs[0]) == 0
    m.prefill(torch.tensor(a), st.sink(seqs[0]))
    t0 = seqs[0].kv["table"]
    before = st.pool.k[:, t0[1] * 32:(t0[1] + 1) * 32].clone()
    assert st.prefill_start(seqs[1]) == 36
    t1 = seqs[1].kv["table"]
    assert t1[0] == t0[0] and t1[1] != t0[1] and st.cow_copies == 1
    m.prefill(torch.tensor((a[:36] + b)[36:]), st.sink(seqs[1]), start=36)
    assert torch.equal(st.pool.k[:, t0[1] * 32:(t0[1] + 1) * 32], before)
    assert torch.equal(st.pool.k[:, t1[1] * 32:t1[1] * 32 + 4], before[:, :4])  # the copied rows
    st.close()


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_token_budget_counts_the_tokens_to_prefill(mode):
    """max_num_batched_tokens bounds the tokens prefilled between two decode steps: a prompt whose
    prefix is cached counts only the rest, so the questions over a document that fills the budget
    join the batch together once the first has prefilled it (not one per decode step). Offload's
    cache outlives the call: a second call finds the document cached and admits them all at once
    (resident's lives as long as the call's pool)."""
    m = tiny_random()
    doc = _prompts([190], seed=73)[0]
    prompts = [doc + q for q in _prompts([10] * 4, seed=74)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = dict(mode=mode, kv_block_size=32, max_model_len=256, max_num_seqs=4, **SDPA)  # budget: 256 tokens
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, sp)]
    llm = LLM(m, prefix_caching=True, **kw)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == want
    assert [o.timings.get("prefix_reused_tokens", 0) for o in outs] == [0, 190, 190, 190]
    assert [x["seqs"] for x in llm.batch_stats["decode_steps"]] == [1, 4, 4, 3]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert [x["seqs"] for x in llm.batch_stats["decode_steps"]] == ([4, 4, 4] if mode == "offload" else [1, 4, 4, 3])
    if mode == "offload":  # chunked prefill: the questions are prefilled whole, in one step
        llm = LLM(m, prefix_caching=True, **dict(kw, enable_chunked_prefill=True))
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == want
        assert [o.timings.get("prefix_reused_tokens", 0) for o in outs] == [0, 190, 190, 190]
        assert [x["seqs"] for x in llm.batch_stats["decode_steps"]] == [4, 4, 4]


def test_prefix_caching_composes_and_its_one_refusal():
    """Prefix caching runs in every mode and decode policy at every max_num_seqs; the one refusal
    is tensor parallelism (the cache shares blocks of one device's pool), named in one line."""
    from xoffload.engine import EngineConfig

    with pytest.raises(ValueError, match="prefix_caching .*needs one device, got tensor_parallel_size=2$"):
        EngineConfig.from_kwargs(prefix_caching=True, tensor_parallel_size=2)
    m = tiny_random()
    for n in (1, 2):
        for mode in ("offload", "resident"):
            for pol in (None, QuestDecode(token_budget=64, page_size=16)):
                llm = LLM(m, mode=mode, prefix_caching=True, max_num_seqs=n, max_model_len=256, kv_block_size=16,
                          sparse_decode=pol)
                assert llm.engine.prefix_cache is not None or (mode == "resident" and pol is None)


def test_prefix_cached_teacher_forced_logits_equal_alone_cpu(monkeypatch):
    """CPU fp32: fed the one-request run's tokens, every row of a prefix-cached batch (the later
    rows prefilling only their suffix against the first one's blocks, one of them through a
    copy-on-write block) has its one-request logits at every step, to float rounding."""
    from xoffload.kv import resident_prefix as kp

    from .test_batch import _check_batch_tracks_alone

    starts = []
    orig = kp.ResidentPrefixBatchKV.prefill_start
    monkeypatch.setattr(kp.ResidentPrefixBatchKV, "prefill_start",
                        lambda self, seq: starts.append(orig(self, seq)) or starts[-1])
    m = tiny_random()
    doc = _prompts([70], seed=81)[0]
    prompts = [doc + q for q in _prompts([5, 9, 1], seed=82)] + [doc[:40] + _prompts([3], seed=83)[0]]
    _check_batch_tracks_alone(m, prompts, "gpu", 4, lambda la: 1e-4 * float(la.abs().max()), kv_block_size=32,
                              prefix_caching=True, **SDPA)
    assert starts == [0, 70, 70, 40]  # rows 1-3 prefilled only their suffix; row 3 from a partly shared block


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_resident_prefix_caching_bf16_graphs():
    """bf16, random Llama-3.2-1B, 6 prompts sharing a 3000-token document: (1) the CUDA-graph
    decode gives the eager decode's tokens exactly, every prompt after the first reusing the
    document; (2) fed the one-request run's tokens, each row's logits stay within bf16 rounding of
    the one-request store's (the suffix prefill sums attention over the reused prefix in another
    order than a whole prefill: one bf16 eps of the logit scale per layer, as the batch test).
    Greedy tokens of the cached and uncached runs are not compared: a random model's near-tied
    logits flip under that rounding."""
    from xoffload.models import random_model

    from .test_batch import _check_batch_tracks_alone

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, m.cfg.vocab_size, (3000,), generator=g).tolist()
    prompts = [doc + torch.randint(0, m.cfg.vocab_size, (40 + i,), generator=g).tolist() for i in range(6)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(mode="resident", kv_block_size=256, max_model_len=4096, max_num_seqs=4, prefix_caching=True)
    graph = LLM(m, **kw)
    outs = graph.generate(prompts, sp)
    assert all(o.timings.get("prefix_reused_tokens", 0) >= 2816 for o in outs[1:])
    assert graph.batch_stats["graph_buckets"]
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(m, cuda_graph=False, **kw).generate(prompts, sp)]
    eps = torch.finfo(torch.bfloat16).eps
    _check_batch_tracks_alone(m, prompts[:4], "gpu", 6, lambda la: m.cfg.num_layers * eps * float(la.abs().max()),
                              kv_block_size=256, prefix_caching=True)


# ------------------------------------------------------------------ the reused prefix's attention
def _pool_blocks(n_blocks, block, hkv, d, dtype, seed):
    """A layer of the pool as ResidentPrefixBatchKV.sink's history() sees it: rows
    ``[n_blocks * block, Hkv, D]`` viewed as blocks ``[n_blocks, block, Hkv, D]``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_blocks * block, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_blocks * block, hkv, d, generator=g).to(dtype)
    return k.view(-1, block, hkv, d), v.view(-1, block, hkv, d)


@pytest.mark.parametrize("rows,prefix,hq,hkv,d,dtype", [
    (1, 70, 4, 4, 64, torch.float16),      # one query row (a repeat's recomputed last token), GQA 1
    (127, 70, 8, 2, 64, torch.float32),    # a partial last block (70 = 2 x 32 + 6), GQA 4
    (128, 96, 4, 1, 128, torch.float16),   # the split path's largest chunk; whole blocks; GQA 4, D 128
    (129, 45, 4, 4, 128, torch.float32),   # the prefill path's smallest chunk; GQA 1, D 128
    (128, 33, 8, 2, 64, torch.float16),    # one row past a block
])
def test_history_split_and_prefill_paths_agree(rows, prefix, hq, hkv, d, dtype):
    """history()'s two routes over a reused prefix, called as it calls them (blocks of the pool
    through a shuffled block table, ``seqused_k`` the prefix): the split-KV paged decode kernel
    (chunks of <= HISTORY_SPLIT_ROWS rows, non-causal) and the prefill kernel give the same output
    and LSE (``[1, Hq, T]``, natural log). Each route is within the kernel tolerance rule of the fp32
    reference (2x PyTorch-in-dtype error + 2 ulps: tests/helpers.py), so they differ by at most the
    sum of the two; LSEs within a few fp32 ulps of the reference and of each other."""
    from helpers import assert_lse_match, max_err, out_tol, sdpa_in_dtype
    from xoffload.kernels import flash_attn_with_lse, paged_decode_attn_with_lse
    from xoffload.kernels.reference import attention_ref

    block, scale = 32, d ** -0.5
    nb = -(-prefix // block)
    kb, vb = _pool_blocks(nb + 3, block, hkv, d, dtype, seed=rows + prefix)
    perm = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(9))[:nb]
    bt = perm.to(torch.int32)[None]  # [1, nb]: the sequence's blocks, out of order in the pool
    used = torch.full((1,), prefix, dtype=torch.int32)
    q = torch.randn(rows, hq, d, generator=torch.Generator().manual_seed(rows)).to(dtype)  # [T', Hq, D]
    o_s, l_s = paged_decode_attn_with_lse(q[None], kb, vb, bt[:, None], used, softmax_scale=scale, check=False)
    o_f, l_f = flash_attn_with_lse(q[None], kb, vb, causal=False, softmax_scale=scale, block_table=bt,
                                   seqused_k=used, check=False)
    assert o_s.shape == o_f.shape == (1, rows, hq, d) and o_s.dtype == o_f.dtype == dtype
    assert l_s.shape == l_f.shape == (1, hq, rows) and l_s.dtype == l_f.dtype == torch.float32
    ro, rl = attention_ref(q[None], kb, vb, causal=False, softmax_scale=scale, block_table=bt.long(),
                           seqused_k=used.long())
    kc = kb[bt[0].long()].flatten(0, 1)[None, :prefix]  # the prefix, contiguous [1, prefix, Hkv, D]
    vc = vb[bt[0].long()].flatten(0, 1)[None, :prefix]
    tol = out_tol(ro, sdpa_in_dtype(q[None], kc, vc, softmax_scale=scale), dtype)
    assert max_err(o_s, ro) <= tol and max_err(o_f, ro) <= tol
    assert max_err(o_s, o_f) <= 2 * tol
    assert_lse_match(l_s, rl)
    assert_lse_match(l_f, rl)
    assert_lse_match(l_s, l_f)


def test_history_routes_by_chunk_rows_and_reads_the_reused_prefix(monkeypatch):
    """The store's own history(): a chunk of 1, 127 or 128 query rows goes through the split-KV
    paged decode kernel, 129 through the prefill kernel, and each gives the fp32 attention of its
    queries over the reused prefix as the first prompt's prefill wrote it in the pool (70 tokens:
    two whole blocks and a partly filled one, read through the second sequence's table)."""
    from helpers import assert_lse_match, max_err, out_tol, sdpa_in_dtype
    from xoffload.kv import resident_prefix as kp
    from xoffload.engine.request import Request
    from xoffload.engine.scheduler import Sequence
    from xoffload.kernels.reference import masked_attention_ref

    calls = []
    for name in ("paged_decode_attn_with_lse", "flash_attn_with_lse"):
        orig = getattr(kp, name)
        monkeypatch.setattr(kp, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    m = tiny_random()
    cfg = m.cfg
    llm = LLM(m, mode="resident", kv_block_size=32, max_model_len=512, max_num_seqs=2, prefix_caching=True, **SDPA)
    a, b = _prompts([70, 130], seed=6)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=512, seed=0, stop_ids=set(), device=m.device))
            for i, p in enumerate([a, a + b])]
    st = kp.ResidentPrefixBatchKV(m, llm.config, None, seqs)
    for s in seqs:
        st.admit(s)
    st.prefill_start(seqs[0])
    m.prefill(torch.tensor(a), st.sink(seqs[0]))
    assert st.prefill_start(seqs[1]) == 70
    sink = st.sink(seqs[1])
    rows = st.pool.rows(seqs[1].kv["table"], 70)  # the prefix's pool rows, in order
    g = torch.Generator().manual_seed(7)
    for n, want in ((1, "paged_decode_attn_with_lse"), (127, "paged_decode_attn_with_lse"),
                    (kp.HISTORY_SPLIT_ROWS, "paged_decode_attn_with_lse"), (129, "flash_attn_with_lse")):
        for layer in range(cfg.num_layers):
            q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)
            calls.clear()
            o, lse = sink.history(layer, q)
            assert calls == [want], (n, calls)
            assert o.shape == (1, n, cfg.num_heads, cfg.head_dim) and lse.shape == (1, cfg.num_heads, n)
            kh, vh = st.pool.k[layer][rows], st.pool.v[layer][rows]
            ro, rl = masked_attention_ref(q, kh, vh, softmax_scale=m.scale)
            tol = out_tol(ro, sdpa_in_dtype(q[None], kh[None], vh[None], softmax_scale=m.scale)[0], torch.float32)
            assert max_err(o[0], ro) <= tol, n
            assert_lse_match(lse[0], rl)
    st.close()


@pytest.mark.parametrize("kw", [pytest.param({"mode": "offload"}, id="offload"),
                                pytest.param({"mode": "offload", "sparse_decode": QuestDecode(
                                    token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32,
                                    dense_layers=(0,))}, id="offload-quest"),
                                pytest.param({"mode": "resident", "sparse_decode": QuestDecode(
                                    token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32,
                                    dense_layers=(0,))}, id="resident-quest")])
def test_a_prompt_that_fills_the_pool_runs_with_prefix_caching(kw):
    """A pool of exactly a 300-token prompt's ten blocks, prefix caching on: the prompt runs (no
    copy-on-write block to spare: none is reserved), as without caching; a second prompt sharing
    the first's 100 tokens (a prefix ending inside a block) then reuses its whole blocks only
    (96 tokens), with the same tokens as without caching; the pool is whole at the end."""
    base, extra = _prompts([300, 200], seed=21)
    second = base[:100] + extra
    runs = {}
    for pc in (True, False):
        llm = LLM(tiny_random(), kv_block_size=32, max_model_len=512, kv_cache_tokens=320, prefix_caching=pc,
                  **SDPA, **kw)
        outs = [llm.generate(p, SP)[0] for p in (base, second)]
        assert [o.finish_reason for o in outs] == ["length", "length"]
        runs[pc] = outs
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert [o.num_cached_tokens for o in runs[True]] == [0, 96]
    llm.offload.allocator.check()
