"""The batched Quest store (offload + QuestDecode, ``OffloadQuestBatchKV``): every sequence of a batch
gives the greedy tokens it gives alone (``max_num_seqs=1``: a batch of one of the same store, same
policy; CPU fp32: token for token), with prompt lengths shorter than a page, on page and pool-block
boundaries and past them, sequences joining mid-batch and finishing after one token, a budget that
covers the whole context (every page, dense through the same path: teacher-forced logits equal the
dense resident store's), admission waiting for summary-pool room and refusing what never fits.
GPU tests (marked) compare within bf16 rounding and CUDA graphs against eager."""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kv.table import batch_store_class
from xoffload.kv.quest import OffloadQuestBatchKV
from xoffload.models import random_model
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random
from .test_batch import _check_batch_tracks_alone, _prompts

# pages of 16 in pool blocks of 32: selections cross block boundaries; dense layer 0 read from the pool
POL = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
KW = {"mode": "offload", "kv_block_size": 32, "prefill_attn": "sdpa"}


def _alone(m, prompts, sps, max_model_len, pol=POL, **kw):
    """Each prompt alone (``LLM(max_num_seqs=1)``: a batch of one of the same store)."""
    llm = LLM(m, max_model_len=max_model_len, sparse_decode=pol, **KW, **kw)
    assert llm.config.max_num_seqs == 1
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    return [llm.generate(p, sp)[0] for p, sp in zip(prompts, sps)]


def _batched(m, max_model_len, pol=POL, **kw):
    llm = LLM(m, max_model_len=max_model_len, sparse_decode=pol, **KW, **kw)
    assert batch_store_class(llm.config)[0] is OffloadQuestBatchKV
    return llm


@pytest.mark.parametrize("n", [1, 2])
def test_store_choice(n):
    """The store table picks the same store for every max_num_seqs (one request is a batch of one)."""
    from xoffload.kv import OffloadBatchKV, ResidentBatchKV

    m = tiny_random()
    for pol, cls in ((POL, OffloadQuestBatchKV), (QuestDecode(cache_pages=0), OffloadQuestBatchKV),
                     (QuestDecode(cache_pages=8), OffloadQuestBatchKV),
                     (QuestDecode(cache_pages=0, exact_channels=4), OffloadQuestBatchKV),
                     (QuestDecode(exact_channels=4, bound_scale=0.25), OffloadQuestBatchKV), ("quest-ch", OffloadQuestBatchKV)):
        llm = LLM(m, mode="offload", max_model_len=64, kv_block_size=32, max_num_seqs=n, sparse_decode=pol)
        assert batch_store_class(llm.config)[0] is cls, pol
    for kw, cls in (({"mode": "gpu", "sparse_decode": POL}, OffloadQuestBatchKV), ({"mode": "gpu"}, ResidentBatchKV),
                    ({"mode": "offload"}, OffloadBatchKV), ({"mode": "offload", "offload_decode": "uva"}, OffloadBatchKV)):
        llm = LLM(m, max_model_len=64, kv_block_size=32, max_num_seqs=n, **kw)
        assert batch_store_class(llm.config)[0] is cls, kw
    with pytest.raises(ValueError, match="offload_decode='ring' is not offered"):
        LLM(m, mode="offload", offload_decode="ring", max_model_len=64, max_num_seqs=n)


@pytest.fixture(params=[None, False], ids=["dense-auto", "dense-in-pool"])
def dense_on_gpu(request, monkeypatch):
    """The store's choice for the dense layers: by memory (on the CPU: on the device) or forced
    into the pinned pool (read in place)."""
    monkeypatch.setattr(OffloadQuestBatchKV, "DENSE_ON_GPU", request.param)
    return request.param is not False


def test_lengths_around_pages_and_blocks_equal_alone(dense_on_gpu):
    """Prompts of 1 and 15 (under a page: no candidates), 16, 17, 31, 32, 33 (page and block
    edges), 100, 129, 200, 263 (k pages of many candidates; each row its own plan): each sequence's
    greedy tokens equal its run alone (a batch of one); h2d per token counts the selected pages of
    the sparse layers and (read in place) every candidate page of the dense one, as alone."""
    m = tiny_random()
    lens = [1, 15, 16, 17, 31, 32, 33, 100, 129, 200, 263]
    prompts = _prompts(lens, seed=11)
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    ref = _alone(m, prompts, sp, 300)
    llm = _batched(m, 300, max_num_seqs=16, max_num_batched_tokens=4096)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    st = llm.batch_stats
    assert st["max_running"] == len(lens) and {x["rows"] for x in st["decode_steps"]} == {16}
    tok_layer = m.cfg.kv_bytes_per_token(m.dtype) // m.cfg.num_layers
    for n, o, r in zip(lens, outs, ref):  # the sparse layers' misses (each row's cache evolves as alone)
        p = POL.plan(n)
        dense = 0 if dense_on_gpu else p.num_candidates * 16 * tok_layer
        assert o.timings["h2d_bytes_per_token"] == r.timings["h2d_bytes_per_token"] >= dense, n
        if p.pages_per_step:
            assert o.timings["cache_hit_rate"] == r.timings["cache_hit_rate"], n
    assert any((o.timings.get("cache_hit_rate") or 0) > 0 for o in outs)
    assert any(POL.plan(n).pages_per_step < POL.plan(n).num_candidates for n in lens)  # some rows select
    assert llm.offload.sequences() == [] and llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


CH = dataclasses.replace(POL, exact_channels=4, bound_scale=0.25)


def test_exact_channels_in_a_batch_equal_alone(dense_on_gpu):
    """Exact key channels (each sequence choosing its own at prefill) in the batched store: the
    same greedy tokens as one request at a time, for prompt lengths under a page, on page and block
    edges and past them, joining mid-batch; the summary pool counts the channel values."""
    m = tiny_random()
    lens = [15, 16, 33, 100, 129, 200, 263]
    prompts = _prompts(lens, seed=21)
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    ref = _alone(m, prompts, sp, 300, pol=CH)
    llm = _batched(m, 300, pol=CH, max_num_seqs=3)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert any(CH.plan(n).pages_per_step < CH.plan(n).num_candidates for n in lens)  # some rows select
    quest = [o.token_ids for o in _batched(m, 300, max_num_seqs=3).generate(prompts, sp)]
    assert quest != [o.token_ids for o in outs]  # the channels change some choice (else the test proves nothing)
    assert llm.offload.sequences() == [] and llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def test_channel_scores_batched_match_reference_and_rows(device):
    """channel_page_scores_batched: each row over its own pages of a shared pool with its own
    channels equals the one-row scorer over those pages and the reference; -inf past the count."""
    from helpers import EPS32
    from xoffload.kernels.channel_score import channel_page_scores, channel_page_scores_batched
    from xoffload.kernels.reference import channel_page_scores_batched_ref

    g = torch.Generator().manual_seed(5)
    R, hq, hkv, d, NP, P, r, N = 3, 6, 2, 32, 30, 16, 5, 12
    k = torch.randn(hkv, NP, P, d, generator=g)
    kmin, kmax = k.amin(2).contiguous(), k.amax(2).contiguous()
    ch = torch.stack([torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]) for _ in range(R)])
    owner = torch.arange(NP) % R
    klab = torch.zeros(hkv, NP * P, r)
    for p_ in range(NP):
        klab[:, p_ * P:(p_ + 1) * P] = torch.gather(k[:, p_], 2, ch[owner[p_]][:, None, :].expand(hkv, P, r))
    idx = torch.zeros(R, N, dtype=torch.int32)
    nv = torch.tensor([10, 0, 7], dtype=torch.int32)
    for i in range(R):
        mine = (owner == i).nonzero().flatten()[: int(nv[i])]
        idx[i, : len(mine)] = mine.to(torch.int32)
    q = torch.randn(R, hq, d, generator=g)
    args = [t.to(device) for t in (q, kmin, kmax, ch.to(torch.int32), klab, idx, nv)]
    for alpha in (1.0, 0.25):
        s = channel_page_scores_batched(*args, alpha=alpha)
        ref = channel_page_scores_batched_ref(*args, alpha)
        tol = 4 * d * EPS32 * float(q.abs().sum(-1).max() * k.abs().max())
        assert bool((torch.isinf(s) == torch.isinf(ref)).all()) and bool(torch.isinf(s[1]).all())
        fin = torch.isfinite(ref)
        assert float((s[fin] - ref[fin]).abs().max()) <= tol
        for i in (0, 2):
            n = int(nv[i])
            pid = idx[i, :n].long()
            tok = (pid[:, None] * P + torch.arange(P)).flatten()
            one = channel_page_scores(args[0][i], args[1][:, pid.to(device)].contiguous(),
                                      args[2][:, pid.to(device)].contiguous(), args[3][i],
                                      args[4][:, tok.to(device)].contiguous(), alpha=alpha)
            assert float((one - s[i, :, :n]).abs().max()) <= tol
    with pytest.raises(ValueError, match="channels must be"):
        channel_page_scores_batched(args[0], args[1], args[2], args[3][0], args[4], args[5], args[6])
    with pytest.raises(ValueError, match="n_valid must be"):
        channel_page_scores_batched(*args[:6], args[6].long())


def test_join_mid_batch_and_finish_after_one_token(dense_on_gpu):
    """max_num_seqs=2: B finishes after its first token, C joins while A decodes, D waits; each
    sequence gives its tokens alone."""
    m = tiny_random()
    prompts = _prompts([140, 60, 210, 9], seed=12)
    sps = [SamplingParams(max_tokens=14, ignore_eos=True), SamplingParams(max_tokens=1),
           SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)]
    ref = _alone(m, prompts, sps, 256)
    llm = _batched(m, 256, max_num_seqs=2)
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [len(o.token_ids) for o in outs] == [14, 1, 4, 6] and outs[1].timings["decode_steps"] == 0
    keys = ("cache_hit_rate", "cache_slots")  # the page cache's figures, as alone
    assert [[o.timings.get(k, "absent") for k in keys] for o in outs] == \
        [[r.timings.get(k, "absent") for k in keys] for r in ref]
    seqs = [x["seqs"] for x in llm.batch_stats["decode_steps"]]
    assert seqs[0] == 1 and seqs[1] == 2 and seqs[-1] == 1 and sum(seqs) == 13 + 0 + 3 + 5
    assert llm.offload.sequences() == []


def test_page_cache_with_reuse_bias_equals_alone():
    """Per-sequence page caches in the batch (a small cache, 12 steps): with a reuse bias every
    sequence gives its tokens and its cache hit rate alone, and the bias is live in the batch
    (hit rates above the unbiased run's); the row's cache slot is released and reused by the
    sequences that join later (max_num_seqs=2)."""
    m = tiny_random()
    prompts = _prompts([120, 200, 263, 150], seed=31)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for bias in (1.0, 16.0):
        pol = dataclasses.replace(POL, cache_pages=4, reuse_bias=bias)
        ref = _alone(m, prompts, sp, 300, pol=pol)
        llm = _batched(m, 300, pol=pol, max_num_seqs=2)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], bias
        assert [o.timings["cache_hit_rate"] for o in outs] == [r.timings["cache_hit_rate"] for r in ref], bias
        assert [o.timings["h2d_bytes_per_token"] for o in outs] == [r.timings["h2d_bytes_per_token"] for r in ref]
        assert llm.batch_stats["store"]["cache_slots"] == 4
        runs[bias] = [o.timings["cache_hit_rate"] for o in outs]
        # the caches are sized for max_num_seqs sequences (requests that arrive later join), 8 here
        one = _batched(m, 300, pol=pol, max_num_seqs=8)
        one.generate(prompts[:2], sp)
        assert one.batch_stats["store"]["cache_bytes"] == 4 * llm.batch_stats["store"]["cache_bytes"]
    assert all(b >= a for a, b in zip(runs[1.0], runs[16.0])) and sum(runs[16.0]) > sum(runs[1.0])
    # a sequence with a cache that finishes after its first token reports it as alone (no lookup yet)
    sps = [SamplingParams(max_tokens=1), sp]
    ref = _alone(m, prompts[1:3], sps, 300, pol=pol)
    outs = _batched(m, 300, pol=pol, max_num_seqs=2).generate(prompts[1:3], sps)
    keys = ("cache_hit_rate", "cache_slots")
    assert ref[0].timings["cache_hit_rate"] is None and ref[0].timings["cache_slots"] == 4
    assert [[o.timings[k] for k in keys] for o in outs] == [[r.timings[k] for k in keys] for r in ref]


def test_tied_scores_and_per_row_page_counts_select_as_alone():
    """Every page score of the sparse layer tied (its keys zeroed), prompts whose plans read
    different page counts (the recent tail's length shifts the budget by a page): the batched
    selection breaks ties and counts pages per row as the one-request store does (topk_ids with
    per-row counts), with and without the page cache and the reuse bias."""
    m = tiny_random()
    c = m.cfg
    q_rows = c.num_heads * c.head_dim
    m.w.layers[1].wqkv[q_rows:q_rows + c.num_kv_heads * c.head_dim] = 0  # layer 1's keys: all zero
    prompts = _prompts([200, 263, 129, 271], seed=33)
    base = dataclasses.replace(POL, token_budget=100)  # 100 - resident (49..63 tokens): 2 or 3 pages
    ks = [base.plan(len(p)).pages_per_step for p in prompts]
    assert ks == [2, 2, 3, 2] and all(base.plan(len(p)).num_candidates > 3 for p in prompts)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for pol in (base, dataclasses.replace(base, reuse_bias=1.0), dataclasses.replace(base, cache_pages=0),
                dataclasses.replace(base, cache_pages=4)):
        ref = _alone(m, prompts, sp, 300, pol=pol)
        outs = _batched(m, 300, pol=pol, max_num_seqs=4).generate(prompts, sp)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], pol
        assert [o.timings.get("cache_hit_rate") for o in outs] == [r.timings.get("cache_hit_rate") for r in ref]


def test_page_cache_cut_to_memory_and_none_when_a_step_does_not_fit(monkeypatch):
    """Under a GPU memory limit the per-sequence caches get the slots that fit (the cache is
    transparent without a reuse bias: tokens still equal alone); fewer than a step's pages for all
    three: two at a time, each with a cache (``run_limit``); not allowed to run fewer
    (``CACHE_OVER_BATCH = 1``): no cache, every selected page read in place."""
    from xoffload.kv import quest as kv_batch
    from xoffload.kv.page_cache import BatchPageCache

    m = tiny_random()
    prompts = _prompts([120, 200, 263], seed=32)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    pol = dataclasses.replace(POL, reuse_bias=1.0)
    ref = _alone(m, prompts, sp, 300, pol=pol)
    llm = _batched(m, 300, pol=pol, max_num_seqs=3)
    llm.generate(prompts, sp)
    info = llm.batch_stats["store"]
    k = info["pages_per_step"]
    assert info["cache_slots"] > k + 1  # uncut: as alone
    assert info["run_limit"] == 3 and not info["cache_limited"]
    base = info["tail_bytes"] + info["summary_bytes"] + info["dense_pool_bytes"]
    sb = BatchPageCache.slot_bytes(m.cfg.num_layers - 1, m.cfg.num_kv_heads, m.cfg.head_dim, 16, m.dtype)
    for slots, over, want, run in ((k + 1, 8, k + 1, 3), (k - 1, 8, None, 2), (k - 1, 1, 0, 3)):
        monkeypatch.setattr(kv_batch, "_pool_memory_limit", lambda *a, s=slots: base + 3 * s * sb + 8)
        monkeypatch.setattr(OffloadQuestBatchKV, "CACHE_OVER_BATCH", over)
        llm = _batched(m, 300, pol=pol, max_num_seqs=3)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], slots
        st = llm.batch_stats["store"]
        assert st["run_limit"] == run and st["cache_limited"] == (run < 3), (slots, over)
        assert llm.batch_stats["max_running"] <= run
        if want is None:  # two at a time: the memory of three cut caches, at least a step's pages each
            assert k <= st["cache_slots"] and 2 * st["cache_slots"] * sb <= 3 * slots * sb + base, st
        else:
            assert st["cache_slots"] == want, (slots, over)
        assert not st["memory_limited"], slots
        assert ("cache_hit_rate" in outs[-1].timings) == bool(st["cache_slots"])


@pytest.mark.parametrize("budget", [None, 4096])
def test_budget_covering_the_context_is_dense(budget, dense_on_gpu):
    """A budget >= the context (or None) reads every candidate page: tokens equal alone, and
    teacher-forced logits equal the dense resident store's to float rounding."""
    m = tiny_random()
    pol = QuestDecode(token_budget=budget, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(1,))
    prompts = _prompts([5, 48, 90, 177], seed=13)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = _alone(m, prompts, sp, 256, pol=pol)
    outs = _batched(m, 256, pol=pol, max_num_seqs=4).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    _check_batch_tracks_alone(m, prompts, "offload", 4, lambda la: 1e-4 * float(la.abs().max()),
                              kv_block_size=32, sparse_decode=pol)


def test_every_layer_sparse_or_dense_and_budget_below_resident(dense_on_gpu):
    """dense_layers=() (every layer selects), every layer dense, and a budget below sink + recent
    (no page read)."""
    m = tiny_random()
    prompts = _prompts([70, 130, 190], seed=14)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    L = m.cfg.num_layers
    for pol in (QuestDecode(token_budget=64, page_size=16, sink_tokens=16, recent_tokens=16, dense_layers=()),
                QuestDecode(token_budget=64, page_size=16, sink_tokens=16, recent_tokens=16,
                            dense_layers=tuple(range(L))),
                QuestDecode(token_budget=20, page_size=16, sink_tokens=16, recent_tokens=32)):
        ref = _alone(m, prompts, sp, 256, pol=pol)
        outs = _batched(m, 256, pol=pol, max_num_seqs=3).generate(prompts, sp)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], pol


def test_admission_waits_for_summary_room_and_refuses_what_never_fits(monkeypatch):
    """A summary pool with room for one sequence at a time (the GPU memory limit, faked here) runs
    them one by one with the same tokens; a prompt whose summaries alone pass the pool, or whose
    KV passes the CPU pool, is refused before anything runs, naming the sizes."""
    import xoffload.kv.base as kb

    m = tiny_random()
    prompts = _prompts([200, 210, 190], seed=15)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = [r.token_ids for r in _alone(m, prompts, sp, 512)]
    el = 4  # fp32
    per_block = 2 * (m.cfg.num_layers - 1) * m.cfg.num_kv_heads * kb.SUMMARY_BLOCK * m.cfg.head_dim * el
    # the tail pool's bytes (3 rows of the most sink + recent tokens of a prompt up to each one's
    # length, + new tokens; blocks of 64, one scratch block)
    c = m.cfg
    tail_blocks = sum(-(-(POL.largest_plan(len(p))[2] + 3) // kb.TAIL_BLOCK) for p in prompts)
    tail_bytes = 2 * c.num_layers * (tail_blocks + 1) * kb.TAIL_BLOCK * c.num_kv_heads * c.head_dim * el
    # the limit leaves room for the tails and one summary block
    monkeypatch.setattr(kb, "_gpu_kv_limit_bytes", lambda dev, headroom: tail_bytes + per_block)
    llm = _batched(m, 512, max_num_seqs=3)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref  # 200-token prompts: 11 candidates, one block
    assert llm.batch_stats["max_running"] == 1
    with pytest.raises(ValueError, match=r"prompt 1 needs 32 pages of Quest summaries .*holds 16 pages"):
        llm.generate([prompts[0], _prompts([400], seed=16)[0], prompts[2]], sp)
    assert llm.offload.sequences() == []
    monkeypatch.undo()
    small = _batched(m, 512, max_num_seqs=2, kv_cache_tokens=256)
    with pytest.raises(ValueError, match=r"prompt 0 needs 320 tokens of KV in the CPU pool.*holds 256 tokens"):
        small.generate([_prompts([300], seed=17)[0]], sp)
    assert [o.token_ids for o in small.generate(prompts[:2], sp)] == ref[:2]  # still serving


def test_store_step_triton_code_equals_reference(dense_on_gpu):
    """One decode step's attention of every layer through the store, for a padded batch of rows
    with different plans: the Triton code (interpreter: batched scores, topk, paged launches over
    the pool and the tail, merge) equals the fp32 reference to float rounding."""
    from xoffload.engine.request import Request
    from xoffload.engine.scheduler import Sequence
    from xoffload.kernels import cpu_backend
    from xoffload.kernels.checks import interpreter_on

    if not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    m = tiny_random()
    llm = _batched(m, 300, max_num_seqs=4)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=300, seed=0, stop_ids=(), device=m.device))
            for i, p in enumerate(_prompts([263, 15, 129], seed=18))]
    st = OffloadQuestBatchKV.open(m, llm.config, llm.offload, seqs)
    assert st.dense_on_gpu == dense_on_gpu
    with torch.no_grad(), cpu_backend("reference"):
        for s in seqs:
            st.admit(s)
            m.prefill(torch.tensor(s.req.ids), st.sink(s))
            s.n_out = 1
    rows = st.set_batch(seqs)
    assert rows == 4
    g = torch.Generator().manual_seed(19)
    c = m.cfg
    st.begin_step()
    for layer in range(c.num_layers):
        q = torch.randn(rows, c.num_heads, c.head_dim, generator=g)
        k, v = (torch.randn(rows, c.num_kv_heads, c.head_dim, generator=g) for _ in range(2))
        outs = []
        for backend in ("reference", "interpreter"):
            with cpu_backend(backend):
                outs.append(st.attend(layer, q, k, v))
        assert float((outs[0][:3] - outs[1][:3]).abs().max()) <= 1e-5, layer
        assert float(outs[1][3].abs().max()) == 0.0  # the padding row attends to nothing
    for s in seqs:
        st.release(s)
    st.close()
    assert llm.offload.sequences() == []


def test_batched_scores_bad_input():
    from xoffload.kernels.quest_score import quest_page_scores_batched

    q, km = torch.zeros(2, 4, 16), torch.zeros(2, 8, 16)
    idx, nv = torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    assert quest_page_scores_batched(q, km, km, idx, nv).shape == (2, 2, 5)
    with pytest.raises(ValueError, match=r"index must be an int32/int64 \[R=2, N\] tensor, got \(3, 5\)"):
        quest_page_scores_batched(q, km, km, torch.zeros(3, 5, dtype=torch.int32), nv)
    with pytest.raises(ValueError, match=r"n_valid must be an int32 \[R=2\] tensor, got \(2,\) torch.int64"):
        quest_page_scores_batched(q, km, km, idx, nv.long())
    with pytest.raises(ValueError, match="does not fit summaries"):
        quest_page_scores_batched(torch.zeros(2, 3, 16), km, km, idx, nv)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
def test_gpu_quest_batch_graphs_equal_eager_and_track_alone():
    """bf16, random Llama-3.2-1B, prompts 1, 700, 1024, 1025, 4100, 8192 with Quest (budget 512,
    pages of 32, pool blocks of 1024): (1) the CUDA-graph batch gives the eager batch's tokens
    exactly; (2) budget None (every page, dense through the same path): fed the one-request
    tokens, each row's logits stay within bf16 rounding of the dense resident store's; (3) budget
    512: every row's greedy tokens share a prefix with the one-request path's, >= 60% of all tokens
    and half the rows whole (measured on the H200 at b0efda3, before the batch had page caches:
    56 of 72 tokens equal). (3) runs without the reuse bias: with it, a page's choice depends on
    what each cache holds, and the batch's caches are cut to the memory left (not the one-request
    size), so the paths may choose differently by design (at bias 8, 7f2ce10: 36 of 72)."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    prompts = _prompts([1, 700, 1024, 1025, 4100, 8192], vocab=m.cfg.vocab_size)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    pol = QuestDecode(token_budget=512)
    kw = {"mode": "offload", "kv_block_size": 1024, "max_model_len": 8300, "sparse_decode": pol}
    graph = LLM(m, max_num_seqs=8, max_num_batched_tokens=16384, **kw)
    assert batch_store_class(graph.config)[0] is OffloadQuestBatchKV
    a = [o.token_ids for o in graph.generate(prompts, sp)]
    assert graph.batch_stats["graph_buckets"] == [8]
    eager = LLM(m, max_num_seqs=8, max_num_batched_tokens=16384, cuda_graph=False, **kw)
    assert a == [o.token_ids for o in eager.generate(prompts, sp)]
    kw["sparse_decode"] = QuestDecode(token_budget=512, reuse_bias=1.0)
    a = [o.token_ids for o in LLM(m, max_num_seqs=8, max_num_batched_tokens=16384, **kw).generate(prompts, sp)]
    alone = LLM(m, **kw)
    ref = [alone.generate(p, sp)[0].token_ids for p in prompts]
    # once a row's greedy token differs (a near-tied page score or logit rounding the other way
    # in bf16: random weights give nearly flat logits) the rest of the row follows another path,
    # so agreement is measured as each row's common prefix; a wrong row's pages or lengths would
    # make every row differ from its second token on
    def prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    pre = [prefix(ra, rr) for ra, rr in zip(a, ref)]
    assert all(p >= 1 for p in pre), pre  # the first token comes from the same prefill
    assert sum(pre) >= 0.6 * sum(map(len, ref)) and sum(p == len(r) for p, r in zip(pre, ref)) >= len(ref) // 2, pre
    eps = torch.finfo(torch.bfloat16).eps
    _check_batch_tracks_alone(m, prompts, "offload", 8, lambda la: m.cfg.num_layers * eps * float(la.abs().max()),
                              kv_block_size=1024, sparse_decode=QuestDecode(token_budget=None))


@pytest.mark.cuda
def test_gpu_exact_channels_batch_graphs_equal_eager_and_track_alone():
    """bf16, random Llama-3.2-1B, quest-ch (16 exact channels, alpha 0.25) at budget 512 in the
    batched store: the CUDA-graph batch gives the eager batch's tokens exactly, and every row
    starts with the one-request path's first token and shares >= 60% of the tokens with it (as
    the Quest test above: a bf16 near-tie sends a row down another path)."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    prompts = _prompts([1, 700, 1025, 4100], vocab=m.cfg.vocab_size)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = {"mode": "offload", "kv_block_size": 1024, "max_model_len": 4200, "sparse_decode": "quest-ch",
          "token_budget": 512}
    graph = LLM(m, max_num_seqs=4, max_num_batched_tokens=8192, **kw)
    assert batch_store_class(graph.config)[0] is OffloadQuestBatchKV
    a = [o.token_ids for o in graph.generate(prompts, sp)]
    eager = LLM(m, max_num_seqs=4, max_num_batched_tokens=8192, cuda_graph=False, **kw)
    assert a == [o.token_ids for o in eager.generate(prompts, sp)]
    kw["sparse_decode"] = QuestDecode(token_budget=512, reuse_bias=1.0)
    a = [o.token_ids for o in LLM(m, max_num_seqs=8, max_num_batched_tokens=16384, **kw).generate(prompts, sp)]
    alone = LLM(m, **kw)
    ref = [alone.generate(p, sp)[0].token_ids for p in prompts]
    same = [next((i for i, (x, y) in enumerate(zip(ra, rr)) if x != y), len(rr)) for ra, rr in zip(a, ref)]
    assert all(n >= 1 for n in same) and sum(same) >= 0.6 * sum(map(len, ref)), same


@pytest.mark.cuda
def test_gpu_quest_continuous_batching_graphs_equal_eager():
    """40 requests through max_num_seqs=4 (bf16, Quest budget 256): the buckets' graphs, captured
    while sequences join and leave, give the eager batch's tokens."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    g = torch.Generator().manual_seed(5)
    lens = [int(x) for x in torch.randint(1, 3000, (40,), generator=g)]
    prompts = _prompts(lens, seed=6, vocab=m.cfg.vocab_size)
    sps = [SamplingParams(max_tokens=int(1 + i % 9), ignore_eos=True) for i in range(40)]
    kw = dict(mode="offload", max_model_len=3100, kv_block_size=256, max_num_seqs=4,
              sparse_decode=QuestDecode(token_budget=256))
    a = LLM(m, **kw).generate(prompts, sps)
    b = LLM(m, cuda_graph=False, **kw).generate(prompts, sps)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [len(o.token_ids) for o in a] == [1 + i % 9 for i in range(40)]


@pytest.mark.parametrize("mode, kw", [("gpu", {}), ("offload", {"kv_block_size": 32})])
def test_exact_channels_batched_equal_alone_and_full_budget_equals_dense(mode, kw):
    """Found holding under adversarial testing, kept as a regression test: with exact channels
    (offload: the batched Quest store over the pinned pool; gpu: the same store over a device
    pool) each sequence's greedy tokens equal its one-request run, prompts under a page (no
    candidate page: channels never chosen) included; a budget covering the context gives dense
    decode's tokens; repeated requests are unaffected by earlier ones."""
    m = tiny_random("tiny-qwen3")
    pol = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(),
                      exact_channels=8, bound_scale=0.25)
    base = dict(mode=mode, max_model_len=512, prefill_attn="sdpa", **kw)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = _prompts([5, 40, 263, 300], seed=4)
    one = LLM(m, sparse_decode=pol, **base)
    alone = [one.generate(p, sp)[0].token_ids for p in prompts]
    batch = LLM(m, sparse_decode=pol, max_num_seqs=4, **base)
    assert batch_store_class(batch.config)[0] is OffloadQuestBatchKV
    assert [o.token_ids for o in batch.generate(prompts, sp)] == alone
    assert [one.generate(p, sp)[0].token_ids for p in prompts[::-1]] == alone[::-1]
    dense = [o.token_ids for o in LLM(m, **base).generate(prompts, sp)]
    full = LLM(m, sparse_decode=dataclasses.replace(pol, token_budget=1024), **base)
    assert [full.generate(p, sp)[0].token_ids for p in prompts] == dense


@pytest.mark.parametrize("mode,pol", [("offload", POL), ("offload", dataclasses.replace(POL, cache_pages=0)),
                                      ("offload", dataclasses.replace(POL, reuse_bias=1.0)), ("resident", POL)])
def test_a_later_shorter_prompt_reading_more_pages_equals_alone(mode, pol):
    """The store opens for a 250-token prompt (2 pages per step, 58 resident tokens); requests
    that join while it decodes are shorter but read more pages per step (160 tokens: 3) or keep
    more tokens resident (175 tokens: 63, a second tail block): the store's rows are sized for
    any prompt up to its longest, so each gives its tokens alone (offload with and without the
    page cache and the reuse bias, and over the device pool)."""
    m = tiny_random()
    lens = [250, 160, 175]
    plans = [pol.plan(n) for n in lens]
    assert [p.pages_per_step for p in plans] == [2, 3, 2] and [p.resident_prompt_tokens for p in plans] == [58, 48, 63]
    prompts = _prompts(lens, seed=41)
    sps = [SamplingParams(max_tokens=7, ignore_eos=True)] * 3
    kw = {"mode": mode, "kv_block_size": 32, "prefill_attn": "sdpa"}
    ref = [LLM(m, max_model_len=300, sparse_decode=pol, **kw).generate(p, sp)[0].token_ids
           for p, sp in zip(prompts, sps)]
    llm = LLM(m, max_model_len=300, sparse_decode=pol, max_num_seqs=3, **kw)
    eng, done = llm.engine, {}
    eng.add_request("a", prompts[0], sps[0])
    done.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("b", prompts[1], sps[1])
    eng.add_request("c", prompts[2], sps[2])
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[r].token_ids for r in "abc"] == ref
    assert llm.engine.stats["max_running"] == 3  # one store epoch: they shared decode steps
    assert llm.offload.sequences() == []
