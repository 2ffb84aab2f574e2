"""Sessions (LLM.session(), xoffload.engine.session): each turn is a plain request of the engine loop
carrying the whole conversation, its KV found by the prefix cache.

CPU, fp32 (the kernels' references): a 3-turn session equals one-shot generation over the
concatenated conversation on an LLM without prefix caching, token for token, in both modes, with
and without a decode policy, at max_num_seqs 1 and 4; with prefix caching a follow-up turn
prefills only its new tokens (the conversation comes from the cache: ``num_cached_tokens``,
``prefix_reused_tokens``), without it every turn prefills the whole conversation; a conversation
evicted under pool pressure prefills it again (``history_recomputed_tokens``) and answers the same;
two sessions interleaved with plain requests give what each gives alone; bad input leaves the
session serving; ``history_budget`` is refused. GPU test (marked): offload == resident in bf16.
"""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _conversation(llm, prompts, sp=SP):
    """Run ``prompts`` as the turns of one session; returns (answers, outputs)."""
    with llm.session() as s:
        outs = [s.generate(p, sp) for p in prompts]
    return [o.token_ids for o in outs], outs


def _one_shot(llm, prompts, answers, sp=SP):
    """What one-shot generation over the concatenated conversation answers at each turn."""
    conv, res = [], []
    for p, a in zip(prompts, answers):
        conv += p
        res.append(llm.generate(conv, sp)[0].token_ids)
        conv += a
    return res


QUEST = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
CHANNELS = dataclasses.replace(QUEST, exact_channels=4, bound_scale=0.25)
CONFIGS = [("gpu", {}), ("offload", {"kv_block_size": 32}),
           ("gpu", {"sparse_decode": QUEST, "kv_block_size": 32}),
           ("offload", {"sparse_decode": QUEST, "kv_block_size": 32}),
           ("offload", {"sparse_decode": CHANNELS, "kv_block_size": 32})]


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("mode, kw", CONFIGS)
def test_three_turns_equal_one_shot(mode, kw, n):
    """Turns of 300, 40 and 90 tokens (block and page boundaries crossed, Quest reading a part of
    the pages): each answer equals one-shot generation over the whole conversation on an LLM
    without prefix caching; with prefix caching (offload) a follow-up turn reuses the conversation
    so far, the answers' KV included, and prefills only its prompt and the last answer's last token
    (never fed to a decode step); the pool is whole once the cache is cleared."""
    m = tiny_random()
    cache = mode == "offload"
    llm = LLM(m, mode=mode, max_model_len=1024, max_num_seqs=n, prefix_caching=cache, **SDPA, **kw)
    prompts = _prompts([300, 40, 90])
    answers, outs = _conversation(llm, prompts)
    assert answers == _one_shot(LLM(m, mode=mode, max_model_len=1024, **SDPA, **kw), prompts, answers)
    assert outs[1].prompt_token_ids == answers[0] + prompts[1]
    if cache:
        assert [len(a) for a in answers] == [6, 6, 6]
        assert [o.timings["history_tokens"] for o in outs] == [0, 305, 351]  # 300 + 5, 300 + 6 + 40 + 5
        assert [o.num_cached_tokens for o in outs] == [0, 305, 351]
        assert [o.timings["chunk_tokens"] for o in outs] == [300, 41, 91]  # last answer token + prompt
        assert [o.timings["history_recomputed_tokens"] for o in outs] == [0, 0, 0]
        eng = llm.offload
        assert eng.sequences() == []
        llm.prefix_cache.clear()
        assert eng.num_free_blocks == eng.allocator.num_blocks
        eng.allocator.check()
    else:  # resident at max_num_seqs 1..4: the store (and its cache) closes between the turns
        assert [o.timings["chunk_tokens"] for o in outs] == [300, 346, 442]


def test_follow_up_turn_prefills_only_new_tokens_and_without_caching_all():
    """The same conversation with and without prefix caching: equal answers; with it the second
    turn finds the first turn's prompt and answer (but its last token, never fed to a decode step)
    and prefills 1 + 20 tokens, without it all 326, and says it computed the first turn's 300
    again."""
    m = tiny_random()
    prompts = _prompts([300, 20], seed=2)
    kw = dict(mode="offload", kv_block_size=32, max_model_len=1024, **SDPA)
    a, cached = _conversation(LLM(m, prefix_caching=True, **kw), prompts)
    b, plain = _conversation(LLM(m, **kw), prompts)
    assert a == b
    t, u = cached[1].timings, plain[1].timings
    assert (t["prefix_reused_tokens"], t["chunk_tokens"], t["history_recomputed_tokens"]) == (305, 21, 0)
    assert "prefix_reused_tokens" not in u and plain[1].num_cached_tokens == 0
    assert (u["history_tokens"], u["chunk_tokens"], u["history_recomputed_tokens"]) == (0, 326, 300)
    assert t["prefill_ms"] > 0 and u["prefill_ms"] > 0


@pytest.mark.parametrize("n", [1, 2])
def test_evicted_conversation_prefills_again_and_answers_the_same(n):
    """A 12-block pool and three 180-token conversations: the third evicts the cached blocks of the
    least recently used one, whose next turn prefills its history again (and says how much) and
    answers as if nothing was evicted; the most recent one is still cached."""
    m = tiny_random()
    p = _prompts([180, 180, 180, 20, 20], seed=20)
    kw = dict(mode="offload", kv_block_size=32, max_model_len=1024, **SDPA)
    want = [_conversation(LLM(m, **kw), [p[i], p[3]])[0] for i in (0, 2)]
    llm = LLM(m, kv_cache_tokens=12 * 32, max_num_seqs=n, prefix_caching=True, **kw)
    sa, sb, sc = llm.session(), llm.session(), llm.session()
    first = [s.generate(q, SP).token_ids for s, q in zip((sa, sb, sc), p[:3])]
    c2 = sc.generate(p[3], SP)
    a2 = sa.generate(p[3], SP)
    assert [[first[0], a2.token_ids], [first[2], c2.token_ids]] == want
    assert c2.timings["history_recomputed_tokens"] == 0 and c2.timings["history_tokens"] == 180 + 5
    assert a2.timings["history_recomputed_tokens"] > 0 and a2.timings["history_tokens"] < 180 + 5
    assert llm.prefix_cache.stats().evictions > 0
    for s in (sa, sb, sc):
        s.close()
    assert llm.offload.sequences() == []
    llm.offload.allocator.check()


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_interleaved_sessions_and_requests_do_not_see_each_other(mode):
    """20 turns: sessions A and B alternate, with a plain request between turns; every answer
    equals its session run alone, every plain request its run on a fresh LLM."""
    m = tiny_random()
    kw = {"kv_block_size": 32, "prefix_caching": True} if mode == "offload" else {}
    pa, pb = _prompts([60] + [12] * 9, seed=10), _prompts([45] + [9] * 9, seed=11)
    plain = _prompts([30] * 10, seed=12)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = LLM(m, mode=mode, max_model_len=1024, **SDPA, **kw)
    alone_a = _conversation(llm, pa, sp)[0]
    alone_b = _conversation(llm, pb, sp)[0]
    fresh = [LLM(m, mode=mode, max_model_len=1024, **SDPA).generate(p, sp)[0].token_ids for p in plain[:2]]
    sa, sb = llm.session(), llm.session()
    got_a, got_b, got_plain = [], [], []
    for i in range(10):
        got_a.append(sa.generate(pa[i], sp).token_ids)
        got_plain.append(llm.generate(plain[i], sp)[0].token_ids)
        got_b.append(sb.generate(pb[i], sp).token_ids)
    assert got_a == alone_a and got_b == alone_b
    assert got_plain[:2] == fresh
    assert sa.turns == sb.turns == 10 and sa.history_len == 60 + 9 * 15 and len(sa.tokens) == sa.history_len + 3
    sa.close()
    sb.close()
    if llm.offload is not None:
        assert llm.offload.sequences() == []
        llm.offload.allocator.check()


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_bad_input_leaves_the_session_serving(mode):
    m = tiny_random()
    kw = {"kv_block_size": 32} if mode == "offload" else {}
    llm = LLM(m, mode=mode, max_model_len=128, **SDPA, **kw)
    prompts = _prompts([50, 20], seed=30)
    want = _conversation(llm, prompts)[0]
    s = llm.session()
    s.generate(prompts[0], SP)
    with pytest.raises(ValueError, match=r"would hold 156 tokens, more than max_model_len=128"):
        s.generate(list(range(100)), SP)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.generate([1, 2, 10 ** 6], SP)
    with pytest.raises(ValueError, match="empty"):
        s.generate([], SP)
    assert s.generate(prompts[1], SP).token_ids == want[1]
    assert not s.queued and not s.busy
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.generate(prompts[1], SP)


def test_history_budget_is_refused_with_one_line():
    for kw in ({}, {"max_num_seqs": 2, "prefix_caching": True}):
        llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=128, **SDPA, **kw)
        with pytest.raises(ValueError, match=r"^history_budget=256 is not an option: a session's history is read "
                                             r"whole through the prefix cache.*decode policy") as e:
            llm.session(history_budget=256)
        assert "\n" not in str(e.value)
    s = llm.session()
    with pytest.raises(ValueError, match="history_budget=64 is not an option"):
        s.history_budget = 64
    assert s.history_budget is None
    with pytest.raises(TypeError):
        llm.session(dense_layers=1)
    s.close()


def test_append_then_ask_and_a_turn_at_a_time():
    """append() computes (and caches) a document without answering; a second turn while one is
    queued is refused; the answer equals one-shot generation over the document and question."""
    m = tiny_random()
    doc, q = _prompts([200, 15], seed=31)
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=512, prefix_caching=True, **SDPA)
    s = llm.session()
    r = s.append(doc)
    assert r["chunk_tokens"] == 200 and r["history_tokens"] == 0 and r["prefill_ms"] > 0
    assert s.tokens == doc and s.turns == 0
    rid = s.submit(q, SP)
    assert s.queued
    with pytest.raises(ValueError, match="one turn at a time"):
        s.submit(q, SP)
    out = llm.engine.wait(rid)
    assert out.timings["history_tokens"] == 200 and out.timings["chunk_tokens"] == 15
    assert out.token_ids == LLM(m, mode="offload", kv_block_size=32, max_model_len=512,
                                **SDPA).generate(doc + q, SP)[0].token_ids
    assert s.turns == 1 and not s.queued and s.last_used > 0
    s.close()


def test_llm_close_closes_sessions():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=256, **SDPA)
    s = llm.session()
    s.generate(_prompts([40])[0], SP)
    llm.close()
    assert s.closed and llm.engine.sessions == {}
    with pytest.raises(ValueError, match="closed"):
        llm.session()


def test_chat_turns_equal_the_rendered_conversation(smollm2_llm):
    """SmolLM2 and its chat template: the second chat turn answers what one-shot generation over
    the template's rendering of the whole conversation answers, the first turn's tokens found in
    the prefix cache."""
    llm = smollm2_llm
    sp = SamplingParams(max_tokens=8)
    s = llm.session()
    o1 = s.chat("My name is Ada. Remember it.", sp)
    o2 = s.chat("What is my name?", sp)
    msgs = [{"role": "user", "content": "My name is Ada. Remember it."},
            {"role": "assistant", "content": o1.text},
            {"role": "user", "content": "What is my name?"}]
    ref = llm.generate(llm.apply_chat_template(msgs), sp)[0]
    assert o2.token_ids == ref.token_ids
    assert o2.timings["history_tokens"] >= len(o1.prompt_token_ids) - 1
    s.close()


@pytest.fixture(scope="module")
def smollm2_llm():
    from helpers import smollm2

    m = smollm2()
    return LLM(m, mode="offload", kv_block_size=32, max_model_len=512, prefix_caching=True, **SDPA)


# ------------------------------------------------------------------------------ prefix caching
def test_prefix_reuse_gives_the_same_tokens_as_no_reuse():
    """Questions over one document: from the second request on, the document's blocks (full and
    the partly filled last one) are reused and only the question is prefilled; answers equal an
    LLM without prefix caching, with dense and with Quest decode (summaries rebuilt from the pool);
    clearing the cache returns every block."""
    m = tiny_random()
    doc = _prompts([300], seed=50)[0]
    qs = _prompts([20, 25, 30], seed=51)
    for kw in ({}, {"sparse_decode": QUEST}):
        want = [LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, **SDPA, **kw).generate(doc + q, SP)[0]
                for q in qs]
        llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, prefix_caching=True, **SDPA, **kw)
        outs = [llm.generate(doc + q, SP)[0] for q in qs]
        assert [o.token_ids for o in outs] == [w.token_ids for w in want]
        assert [o.prompt_token_ids for o in outs] == [doc + q for q in qs]
        assert "prefix_reused_tokens" not in outs[0].timings
        assert [o.timings["prefix_reused_tokens"] for o in outs[1:]] == [300, 300]
        eng = llm.offload
        assert eng.sequences() == [] and eng.num_free_blocks < eng.allocator.num_blocks
        llm.prefix_cache.clear()
        assert eng.num_free_blocks == eng.allocator.num_blocks


def test_session_first_turn_reuses_a_closed_sessions_blocks():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, prefix_caching=True, **SDPA)
    p = _prompts([200, 30], seed=52)
    a = _conversation(llm, p)[0]
    s = llm.session()
    o = s.generate(p[0] + a[0] + p[1], SP)  # the closed session's conversation, asked at once
    assert o.timings["prefix_reused_tokens"] == 200 + len(a[0]) + 30 - 1
    assert o.token_ids == a[1]
    s.close()


def test_prefix_cache_evicted_when_the_pool_runs_short():
    """A pool of 10 blocks and 12 different 150-token prompts: cached blocks give way (LRU), every
    request completes and equals its run without caching."""
    m = tiny_random()
    ps = _prompts([150] * 12, seed=53)
    llm = LLM(m, mode="offload", kv_block_size=32, kv_cache_tokens=10 * 32, max_model_len=256,
              prefix_caching=True, **SDPA)
    ref = LLM(m, mode="offload", kv_block_size=32, max_model_len=256, **SDPA)
    assert [llm.generate(p, SP)[0].token_ids for p in ps] == [ref.generate(p, SP)[0].token_ids for p in ps]
    assert llm.prefix_cache.stats().evictions > 0
    assert LLM(m, mode="gpu", prefix_caching=True, sparse_decode=QUEST, kv_block_size=32,
               max_model_len=256).engine.prefix_cache is not None  # resident + Quest: over its device pool


def test_prefix_caching_in_a_batch():
    """8 questions over one document in one batched call (max_num_seqs=4): every sequence after
    the first reuses the document, prefilled once; answers equal a batched LLM without caching;
    a second call reuses it too; the pool is whole after clear()."""
    m = tiny_random()
    doc = _prompts([300], seed=70)[0]
    prompts = [doc + q for q in _prompts([20 + i for i in range(8)], seed=71)]
    kw = dict(mode="offload", kv_block_size=32, max_model_len=1024, max_num_seqs=4, **SDPA)
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, SP)]
    llm = LLM(m, prefix_caching=True, **kw)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    reused = [o.timings.get("prefix_reused_tokens", 0) for o in outs]
    assert reused[0] == 0 and all(r >= 300 for r in reused[1:]), reused
    again = llm.generate(prompts[:2], SP)
    assert [o.token_ids for o in again] == want[:2]
    assert all(o.timings.get("prefix_reused_tokens", 0) >= 300 for o in again)
    eng = llm.offload
    assert eng.sequences() == []
    llm.prefix_cache.clear()
    assert eng.num_free_blocks == eng.allocator.num_blocks
    eng.allocator.check()


def test_prefix_caching_in_a_batch_with_a_small_pool_and_repeats():
    """Repeated and partly shared prompts (block and page boundaries, an exact repeat) through a
    6-block pool with 2 sequences at a time: every answer equals the run without caching; the
    allocator's books balance after each call."""
    m = tiny_random()
    a, b, c = _prompts([64, 33, 95], seed=72)
    prompts = [a, a + b, a, a + b[:10], c, a + b + [5], c[:40]]
    kw = dict(mode="offload", kv_block_size=32, max_model_len=256, max_num_seqs=2, kv_cache_tokens=6 * 32, **SDPA)
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, SP)]
    llm = LLM(m, prefix_caching=True, **kw)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, SP)] == want
        llm.offload.allocator.check()
        assert llm.offload.sequences() == []


# ---------------------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_model(dtype=torch.bfloat16):
    from xoffload.models import random_model

    return random_model("tiny-llama", dtype=dtype, device="cuda", seed=1, std=0.15)


@pytest.mark.cuda
@cuda
def test_gpu_offload_session_equals_resident_session():
    """bf16 on the GPU: an offload session with prefix caching (turns reading the cached
    conversation from the pinned pool, one CUDA graph per bucket) answers as a resident one and as
    its eager run."""
    m = _gpu_model()
    prompts = _prompts([3000, 64, 200], seed=40)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    a = _conversation(LLM(m, mode="gpu", max_model_len=4096), prompts, sp)[0]
    llm = LLM(m, mode="offload", kv_block_size=256, max_model_len=4096, prefix_caching=True)
    b, outs = _conversation(llm, prompts, sp)
    assert a == b and outs[2].timings["history_tokens"] > 3000
    assert llm.engine.stats["graph_buckets"] == [1]  # sessions run on the engine (generate sets batch_stats)
    c = _conversation(LLM(m, mode="offload", kv_block_size=256, max_model_len=4096, cuda_graph=False,
                          prefix_caching=True), prompts, sp)[0]
    assert c == b


@pytest.mark.parametrize("kw", [{}, {"sparse_decode": QUEST}], ids=["dense", "quest"])
def test_conversation_of_max_model_len_fits_the_default_pool(kw):
    """The default pool (kv_cache_tokens unset) holds a conversation as long as max_model_len with
    prefix caching on: the follow-up reuses the first turn's partly filled last block, whose
    copy-on-write needs one block past the conversation's own (refused before the default pool
    left room for it)."""
    m = tiny_random()
    first, follow = _prompts([300, 20], seed=5)
    # 300 + 6 + 20 = 326 prompt tokens + 6 new = 332 <= 336 = 10.5 blocks of 32: 11 blocks of its own
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=336, prefix_caching=True, **SDPA, **kw)
    a, outs = _conversation(llm, [first, follow])
    assert outs[1].timings["prefix_reused_tokens"] > 0 and outs[1].error is None
    assert llm.engine.offload.allocator.num_blocks == 11 + 1
    plain = LLM(m, mode="offload", kv_block_size=32, max_model_len=336, **SDPA, **kw)
    assert a == _conversation(plain, [first, follow])[0]
    assert plain.engine.offload.allocator.num_blocks == 11
