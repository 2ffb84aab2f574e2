"""Prefix caching in the batched Quest store (offload + QuestDecode + ``prefix_caching``,
``OffloadQuestBatchKV``): questions over one document in one call and across calls, with and
without exact channels, the dense layer on the device or read from the pool, a prompt cached all
but its last token, a pool too small for the cache (evictions), and nothing left behind: every
greedy token equals the same LLM without caching (CPU fp32), and what the store builds for a
reused prefix (page summaries, channels, resident tail tokens, dense-pool rows) equals what a
fresh prefill builds."""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kv.table import batch_store_class
from xoffload.kv.quest import OffloadQuestBatchKV

from .llm_helpers import tiny_random
from .test_batch import _prompts
from .test_batch_quest import POL

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=6, ignore_eos=True)
KW = dict(mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=4, **SDPA)
# exact channels scored with the bound (alpha 1) and with the page's best-key estimate (alpha 0.25)
POLICIES = {"quest": POL, "quest-ch": dataclasses.replace(POL, exact_channels=4),
            "quest-ch-alpha": dataclasses.replace(POL, exact_channels=4, bound_scale=0.25)}


@pytest.fixture(params=[None, False], ids=["dense-on-device", "dense-in-pool"])
def dense_on_gpu(request, monkeypatch):
    """The dense layer 0 in the GPU dense pool (the CPU's choice) or read in place from the pool."""
    monkeypatch.setattr(OffloadQuestBatchKV, "DENSE_ON_GPU", request.param)
    return request.param


class _Books:
    """Checks every store of the test when it closes: nothing admitted, every summary / tail /
    dense-pool block and cache slot free (nothing carried into the next epoch); counts stores."""

    def __init__(self, monkeypatch):
        self.stores = []
        close = OffloadQuestBatchKV.close

        def checked_close(store):
            assert not store._admitted and store._reserved == 0
            assert store.sum_alloc.num_free == store.sum_alloc.num_blocks
            assert store.tail.alloc.num_free == store.tail.num_blocks
            if store.dpool is not None:
                assert store.dpool.alloc.num_free == store.dpool.num_blocks
            store.sum_alloc.check()
            store.tail.alloc.check()
            self.stores.append(store.describe())
            close(store)

        monkeypatch.setattr(OffloadQuestBatchKV, "close", checked_close)


def _llms(m, pol, **kw):
    a = LLM(m, sparse_decode=pol, **{**KW, **kw})
    b = LLM(m, sparse_decode=pol, prefix_caching=True, **{**KW, **kw})
    assert batch_store_class(b.config)[0] is OffloadQuestBatchKV
    return a, b


def _ids(outs):
    return [o.token_ids for o in outs]


def _reused(outs):
    return [o.timings.get("prefix_reused_tokens", 0) for o in outs]


def _whole(llm):
    eng = llm.offload
    assert eng.sequences() == []
    eng.allocator.check()


@pytest.mark.parametrize("pol", list(POLICIES), ids=list(POLICIES))
def test_questions_over_a_document_equal_no_caching(pol, dense_on_gpu, monkeypatch):
    """A 300-token document and 6 questions (page and block edges in the suffixes): one call
    reuses the document for every prompt after the first; a second call reuses the first's blocks
    for all of them; the tokens equal the LLM without caching in both calls."""
    books = _Books(monkeypatch)
    m = tiny_random()
    doc = _prompts([300], seed=80)[0]
    prompts = [doc + q for q in _prompts([20, 1, 16, 33, 64, 7], seed=81)]
    ref, llm = _llms(m, POLICIES[pol])
    want = _ids(ref.generate(prompts, SP))
    outs = llm.generate(prompts, SP)
    assert _ids(outs) == want
    r = _reused(outs)
    assert r[0] == 0 and all(n >= 288 for n in r[1:]), r  # whole pool blocks of the document at least
    again = llm.generate(prompts[::-1], SP)
    assert _ids(again) == want[::-1]
    assert all(n > 0 for n in _reused(again)) and all(n >= 300 for n in _reused(again)), _reused(again)
    _whole(llm)
    assert len(books.stores) == 3 and all(s["dense_on_gpu"] is (dense_on_gpu is None) for s in books.stores)
    assert all(s["candidate_pages"] > s["pages_per_step"] > 0 for s in books.stores)  # sparse


@pytest.mark.parametrize("pol", ["quest", "quest-ch"])
def test_prompt_cached_but_its_last_token(pol, dense_on_gpu, monkeypatch):
    """An exact repeat (its last token recomputed: the reused prefix ends mid-block, the shared
    block copied before the write), a prompt one token past a cached one, a prefix of a cached
    prompt and a prompt on a block edge: tokens equal the run without caching."""
    _Books(monkeypatch)
    m = tiny_random()
    a, b = _prompts([200, 64], seed=82)
    prompts = [a, a, a + [7], a[:150], a + b, a + b]
    ref, llm = _llms(m, POLICIES[pol], max_num_seqs=2)
    want = _ids(ref.generate(prompts, SP))
    outs = llm.generate(prompts, SP)
    assert _ids(outs) == want
    assert _reused(outs)[1:] == [199, 200, 149, 200, 263], _reused(outs)
    assert _ids(llm.generate([a], SP)) == want[:1]
    _whole(llm)


def test_small_pool_evicts_cached_blocks_and_leaks_nothing(dense_on_gpu, monkeypatch):
    """A 16-block pool (4 sequences of up to 4 blocks + the copy-on-write block each) through
    prompts that share and do not: cached blocks give way (evictions), every answer equals the
    run without caching, over three calls; the pool's books balance and it is whole after clear()."""
    _Books(monkeypatch)
    m = tiny_random()
    a, b, c, d = _prompts([96, 33, 100, 70], seed=83)
    prompts = [a, a + b[:10], c, a + [5], c[:40] + d, d, a + b, c + [1, 2]]
    ref, llm = _llms(m, POL, kv_cache_tokens=16 * 32, max_num_seqs=3)
    want = _ids(ref.generate(prompts, SP))
    for i in range(3):
        assert _ids(llm.generate(prompts if i != 1 else prompts[::-1], SP)) == (want if i != 1 else want[::-1])
        _whole(llm)
    st = llm.prefix_cache.stats()
    assert st.evictions > 0 and st.hits > 0, st
    eng = llm.offload
    llm.prefix_cache.clear()
    assert eng.num_free_blocks == eng.allocator.num_blocks
    eng.allocator.check()


def _snapshot(store, seq) -> dict:
    """What the store built for ``seq``'s prompt (host copies): page summaries of its candidates,
    exact channels and their values, resident tail tokens, dense-pool rows."""
    kv, P = seq.kv, store.page
    p = kv["plan"]
    out = {}
    res = p.resident_prompt_tokens
    if res:
        rows = store.tail.rows(kv["tail"], res)
        L = len(store.tail.k)  # per layer: the sparse layers' tail rows may live in the page cache's store
        out["tail"] = tuple(torch.stack([t[l][rows] for l in range(L)]) for t in (store.tail.k, store.tail.v))
    ns = store._summary_pages(p)
    if ns:
        srows = store._summary_rows(kv["stab"], ns)
        out["summ"] = (store.summ.kmin[:, :, srows].clone(), store.summ.kmax[:, :, srows].clone())
        if store.r:
            lrows = (srows[:, None] * P + torch.arange(P)[None, :]).flatten()
            out["chan"] = kv["chan"].clone()
            out["klab"] = store.summ.klab[:, :, lrows].clone()
    if store.dpool is not None:
        rows = store.dpool.rows(kv["dtab"], seq.prompt_len)
        out["dense"] = (store.dpool.k[:, rows].clone(), store.dpool.v[:, rows].clone())
    return out


@pytest.mark.parametrize("pol", ["quest", "quest-ch"])
def test_reused_prefix_builds_what_a_fresh_prefill_builds(pol, dense_on_gpu, monkeypatch):
    """Per sequence, at its first decode step: the summaries (and channels, their values), the
    resident sink / recent tokens and the dense pool's rows with a reused prefix equal those of a
    fresh prefill of the same prompt (float rounding of the prefix's other prefill)."""
    m = tiny_random()
    doc = _prompts([260], seed=84)[0]
    prompts = [doc + q for q in _prompts([30, 3, 45], seed=85)] + [doc]
    seen = {}
    set_batch = OffloadQuestBatchKV.set_batch

    def spy(store, seqs):
        for s in seqs:
            seen.setdefault(s.index, _snapshot(store, s))
        return set_batch(store, seqs)

    monkeypatch.setattr(OffloadQuestBatchKV, "set_batch", spy)
    ref, llm = _llms(m, POLICIES[pol], max_num_seqs=2)
    want = _ids(ref.generate(prompts, SP))
    fresh, seen = seen, {}
    outs = llm.generate(prompts, SP)
    assert _ids(outs) == want and min(_reused(outs)[1:]) >= 256
    assert fresh.keys() == seen.keys() == set(range(len(prompts)))
    for i in fresh:
        assert fresh[i].keys() == seen[i].keys() and "summ" in fresh[i], i
        assert ("dense" in fresh[i]) is (dense_on_gpu is None)
        for name, want_t in fresh[i].items():
            got_t = seen[i][name]
            if name == "chan":
                assert torch.equal(got_t, want_t), (i, name)
                continue
            for g, w in zip(got_t, want_t) if isinstance(want_t, tuple) else [(got_t, want_t)]:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"prompt {i}: {name}")
    _whole(llm)


def _common(x, y) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


@pytest.mark.cuda
def test_gpu_quest_prefix_caching_graphs_and_no_caching():
    """bf16, random Llama-3.2-1B, Quest budget 512 (and quest-ch), pool blocks of 1024: a 3000-token
    document and 4 questions with prefix caching, CUDA graphs on: (1) tokens equal the eager run
    with caching exactly (the reused prefix is read back on the device: fetch_blocks' gather, the
    staging's ordering after the pool writes); (2) against no caching the first token of every row
    is equal and rows share >= 60% of their tokens as a common prefix (bf16: the history merge sums
    in another order); (3) later prompts reuse the document; the pool's books balance."""
    from xoffload.models import random_model
    from xoffload.sparse import QuestDecode

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    doc = _prompts([3000], seed=86, vocab=m.cfg.vocab_size)[0]
    prompts = [doc + q for q in _prompts([40, 1, 700, 1100], seed=87, vocab=m.cfg.vocab_size)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for pol in (QuestDecode(token_budget=512, reuse_bias=1.0),
                QuestDecode(token_budget=512, reuse_bias=1.0, exact_channels=16, bound_scale=0.25)):
        kw = dict(mode="offload", kv_block_size=1024, max_model_len=4200, max_num_seqs=4, sparse_decode=pol)
        graph = LLM(m, prefix_caching=True, **kw)
        assert batch_store_class(graph.config)[0] is OffloadQuestBatchKV
        outs = graph.generate(prompts, sp)
        a = _ids(outs)
        assert _reused(outs)[0] == 0 and min(_reused(outs)[1:]) >= 3000, _reused(outs)
        assert graph.batch_stats["graph_buckets"]
        eager = LLM(m, prefix_caching=True, cuda_graph=False, **kw)
        assert _ids(eager.generate(prompts, sp)) == a
        ref = _ids(LLM(m, **kw).generate(prompts, sp))
        pre = [_common(x, y) for x, y in zip(a, ref)]
        assert all(p >= 1 for p in pre) and sum(pre) >= 0.6 * sum(map(len, ref)), pre
        again = graph.generate(prompts[:2], sp)
        # the first prompt now reuses the document too (its prefill sums in another order)
        assert all(_common(x, y) >= 1 for x, y in zip(_ids(again), a[:2])) and min(_reused(again)) >= 3000
        for llm in (graph, eager):
            _whole(llm)
