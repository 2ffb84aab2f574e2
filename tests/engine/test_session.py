"""Sessions (LLM.session(), xoffload.engine.session): a conversation's KV stays stored between turns
and each turn prefills only its new tokens against the history.

CPU, fp32 (the kernels' references): a 3-turn session equals one-shot generation over the
concatenated conversation, token for token, in both modes (offload == gpu), with and without a
decode policy; sparse history reading every page equals dense history; a budget below the history
reads fewer pages and fewer bytes; the page choice keeps the sink, the recent pages and a planted
page; two sessions interleaved, and 20 turns interleaved with plain requests, give what each gives
alone; closing frees every pool block; an idle session is evicted (LRU) to make room, never the
one in use, and answers the same afterwards; bad input leaves the session serving. GPU tests
(marked): offload == resident in bf16, the chunk's history staging delayed on its copy stream
gives the same result, and the CUDA-graph decode of a turn equals eager.
"""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.engine.session import history_page_ids
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _conversation(llm, prompts, sp=SP, **session_kw):
    """Run ``prompts`` as the turns of one session; returns (answers, outputs)."""
    s = llm.session(**session_kw)
    outs = [s.generate(p, sp) for p in prompts]
    s.close()
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
           ("offload", {"sparse_decode": QUEST, "kv_block_size": 32})]


@pytest.mark.parametrize("mode, kw", CONFIGS)
def test_three_turns_equal_one_shot(mode, kw):
    """Turns of 300, 40 and 90 tokens (history 0 / 300 / 346: block and page boundaries crossed,
    Quest reading a part of the pages): each answer equals the one-shot run over the whole
    conversation; the timings name the history read; offload frees every block at close."""
    m = tiny_random()
    llm = LLM(m, mode=mode, max_model_len=1024, **SDPA, **kw)
    prompts = _prompts([300, 40, 90])
    answers, outs = _conversation(llm, prompts)
    assert answers == _one_shot(llm, prompts, answers)
    assert [o.timings["history_tokens"] for o in outs] == [0, 300, 346]
    assert [o.timings["chunk_tokens"] for o in outs] == [300, 46, 96]  # last answer + prompt
    assert outs[1].prompt_token_ids == answers[0] + prompts[1]
    if llm.offload is not None:
        assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks
        assert llm.offload.sequences() == []
    if mode == "offload" and "sparse_decode" not in kw:
        B = m.cfg.kv_bytes_per_token(m.dtype)
        assert outs[1].timings["history_h2d_bytes"] == -(-300 // 32) * 32 * B  # whole blocks, once


@pytest.mark.parametrize("budget", [96, 4096])
def test_exact_channels_are_chosen_at_the_first_turn(budget):
    """With exact channels the session's summaries choose them from its first turn's keys and keep
    them: turn one equals one-shot generation; with a budget covering the history every turn does
    (one-shot chooses its channels from the whole conversation, so a sparse later turn may not)."""
    m = tiny_random()
    pol = dataclasses.replace(CHANNELS, token_budget=budget)
    llm = LLM(m, mode="offload", max_model_len=1024, kv_block_size=32, sparse_decode=pol, **SDPA)
    prompts = _prompts([300, 40, 90], seed=3)
    s = llm.session()
    outs = [s.generate(prompts[0], SP)]
    first = s._summ.channels.clone()
    outs += [s.generate(p, SP) for p in prompts[1:]]
    assert torch.equal(s._summ.channels, first)
    s.close()
    answers = [o.token_ids for o in outs]
    ref = _one_shot(llm, prompts, answers)
    assert answers[0] == ref[0]
    if budget >= 1024:
        assert answers == ref


def test_offload_session_equals_gpu_session():
    m = tiny_random()
    prompts = _prompts([200, 33, 64], seed=3)
    a = _conversation(LLM(m, mode="gpu", max_model_len=1024, **SDPA), prompts)[0]
    b = _conversation(LLM(m, mode="offload", kv_block_size=64, max_model_len=1024, **SDPA), prompts)[0]
    assert a == b


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_sparse_history_reading_every_page_equals_dense(mode):
    """A budget >= the history takes the dense path; a budget below it whose forced pages (sink +
    recent) already cover the history takes the sparse path and reads every page: both equal
    dense history."""
    m = tiny_random()
    llm = LLM(m, mode=mode, kv_block_size=32, max_model_len=1024, **SDPA)
    prompts = _prompts([150, 30, 20], seed=5)
    dense = _conversation(llm, prompts)[0]
    assert _conversation(llm, prompts, history_budget=1024, dense_layers=1)[0] == dense
    a, outs = _conversation(llm, prompts, history_budget=96, recent_pages=16, dense_layers=1)
    assert a == dense
    assert outs[1].timings["history_sparse_layers"] == m.cfg.num_layers - 1


def test_sparse_history_below_the_history_reads_fewer_bytes():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=2048, **SDPA)
    prompts = _prompts([900, 20], seed=6)
    _, dense = _conversation(llm, prompts)
    _, sparse = _conversation(llm, prompts, history_budget=192, recent_pages=2, dense_layers=1)
    d, s = dense[1].timings, sparse[1].timings
    assert s["history_sparse_layers"] == m.cfg.num_layers - 1
    L, B = m.cfg.num_layers, m.cfg.kv_bytes_per_token(m.dtype) // m.cfg.num_layers
    n = d["history_tokens"]
    # the dense layer reads every block; each sparse layer 192 tokens per KV head (the partial
    # last page read whole)
    assert s["history_h2d_bytes"] == -(-n // 32) * 32 * B + (L - 1) * 192 * B
    assert s["history_h2d_bytes"] < d["history_h2d_bytes"] == L * -(-n // 32) * 32 * B
    assert len(sparse[1].token_ids) == SP.max_tokens
    assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def test_history_page_ids_keep_sink_recent_and_a_planted_page():
    torch.manual_seed(0)
    hkv, g, d, n = 2, 3, 16, 40
    kmin = torch.randn(hkv, n, d) - 1.0
    kmax = kmin + 0.5
    q = torch.randn(5, hkv * g, d) * 0.1
    # page 17 of KV head 1 bounds a large score for one query token of its group
    kmax[1, 17] = 5.0 * q[3, g + 1].sign().clamp(min=0)
    kmin[1, 17] = 5.0 * q[3, g + 1].sign().clamp(max=0)
    ids = history_page_ids(q, kmin, kmax, 8, recent_pages=3)
    assert ids.shape == (hkv, 8)
    for h in range(hkv):
        got = set(ids[h].tolist())
        assert len(got) == 8 and {0, 37, 38, 39} <= got
    assert 17 in set(ids[1].tolist())
    assert history_page_ids(q, kmin, kmax, 100).shape == (hkv, n)  # all pages
    assert history_page_ids(q, kmin, kmax, 0, recent_pages=2).shape == (hkv, 3)  # the forced ones
    with pytest.raises(ValueError, match="k must be"):
        history_page_ids(q, kmin, kmax, -1)
    with pytest.raises(ValueError, match="not a multiple"):
        history_page_ids(q[:, :5], kmin, kmax, 4)


def test_history_page_ids_with_exact_channels_score_each_token_and_keep_the_best():
    """With exact channels the history pages are the top pages of the channel score maximised over
    the chunk's tokens (checked against the fp32 reference scorer, token by token), plus the forced
    ones. A page whose best key is large on two channels at once (the needle) beats pages whose
    two channels peak in different tokens (decoys): exact scoring finds it, Quest's bound, which
    takes each channel's extreme from a different token, ranks every decoy above it."""
    from xoffload.kernels.reference import channel_page_scores_ref

    torch.manual_seed(1)
    hkv, g, d, n, P, r = 2, 2, 16, 30, 16, 2
    keys = torch.randn(hkv, n, P, d) * 0.1
    keys[1, :, 0, 1] = 4.0  # decoys: channel 1 peaks in token 0, channel 2 in token 1
    keys[1, :, 1, 2] = 4.0
    keys[1, 11, :2, 1:3] = 0.0  # the needle page: one token large on both (true score 6 > 4)
    keys[1, 11, 5, 1:3] = 3.0
    kmin, kmax = keys.amin(2), keys.amax(2)
    channels = torch.tensor([[1, 2], [1, 2]], dtype=torch.int32)
    klab = keys[..., 1:3].reshape(hkv, n * P, r).contiguous()
    q = torch.randn(70, hkv * g, d) * 0.01  # 70 tokens: two blocks of the batched scorer
    q[40, g:, 1:3] = 1.0  # one token of KV head 1's group looks along channels 1 and 2
    ids = history_page_ids(q, kmin, kmax, 6, recent_pages=2, channels=channels, klab=klab, alpha=0.25)
    best = torch.stack([channel_page_scores_ref(q[t], kmin, kmax, channels, klab, 0.25) for t in range(70)]).amax(0)
    forced = [0, 28, 29]
    best[:, forced] = float("inf")
    for h in range(hkv):
        assert sorted(ids[h].tolist()) == sorted(best[h].topk(6).indices.tolist())
    assert 11 in ids[1].tolist() and set(forced) <= set(ids[1].tolist())
    assert 11 not in history_page_ids(q, kmin, kmax, 6, recent_pages=2)[1].tolist()  # Quest's bound misses it
    with pytest.raises(ValueError, match="come together"):
        history_page_ids(q, kmin, kmax, 6, channels=channels)


def test_sparse_history_with_exact_channels_reading_every_page_equals_dense(monkeypatch):
    """A quest-ch style session: its sparse history, scored with the exact channels, reads every
    page when the forced pages cover the history (then equals dense history), and reads fewer
    bytes below it."""
    from xoffload.engine import kv_history

    calls = []
    orig = kv_history._channel_best
    monkeypatch.setattr(kv_history, "_channel_best", lambda *a: calls.append(1) or orig(*a))
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=2048, sparse_decode=CHANNELS, **SDPA)
    prompts = _prompts([150, 30, 20], seed=5)
    dense = _conversation(llm, prompts, dense_layers=1)[0]
    assert _conversation(llm, prompts, history_budget=96, recent_pages=16, dense_layers=1)[0] == dense
    prompts = _prompts([900, 20], seed=6)
    _, d = _conversation(llm, prompts, dense_layers=1)
    _, sp = _conversation(llm, prompts, history_budget=192, recent_pages=2, dense_layers=1)
    assert sp[1].timings["history_h2d_bytes"] < d[1].timings["history_h2d_bytes"]
    assert len(sp[1].token_ids) == SP.max_tokens
    assert calls  # the channel score chose the pages


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_interleaved_sessions_and_requests_do_not_see_each_other(mode):
    """20 turns: sessions A and B alternate, with a plain request between turns (the seeds'
    request-switch pollution); every answer equals its session run alone, every plain request its
    run on a fresh LLM."""
    m = tiny_random()
    kw = {"kv_block_size": 32} if mode == "offload" else {}
    pa, pb = _prompts([60] + [12] * 9, seed=10), _prompts([45] + [9] * 9, seed=11)
    plain = _prompts([30] * 10, seed=12)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = LLM(m, mode=mode, max_model_len=1024, **SDPA, **kw)
    alone_a = _conversation(llm, pa, sp)[0]
    alone_b = _conversation(llm, pb, sp)[0]
    fresh = [LLM(m, mode=mode, max_model_len=1024, **SDPA, **kw).generate(p, sp)[0].token_ids for p in plain[:2]]
    sa, sb = llm.session(), llm.session()
    got_a, got_b, got_plain = [], [], []
    for i in range(10):
        got_a.append(sa.generate(pa[i], sp).token_ids)
        got_plain.append(llm.generate(plain[i], sp)[0].token_ids)
        got_b.append(sb.generate(pb[i], sp).token_ids)
    assert got_a == alone_a and got_b == alone_b
    assert got_plain[:2] == fresh
    assert sa.turns == sb.turns == 10
    sa.close()
    sb.close()
    if llm.offload is not None:
        assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def test_idle_session_evicted_lru_never_the_one_in_use():
    """A pool of 12 blocks of 32 tokens: sessions A (5 blocks) and B (5 blocks) fit; C's turn
    needs 6 and evicts A, the least recently used, not B; A's next turn prefills its conversation
    again and answers as if never evicted. A turn that cannot fit even after evicting every idle
    session raises naming the sizes and leaves its session serving."""
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, kv_cache_tokens=12 * 32, max_model_len=1024, **SDPA)
    eng = llm.offload
    p = _prompts([150, 140, 180, 20, 20], seed=20)
    ref = LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, **SDPA)
    want_a = _conversation(ref, [p[0], p[3]])[0]
    sa, sb, sc = llm.session(), llm.session(), llm.session()
    a1 = sa.generate(p[0], SP)
    sb.generate(p[1], SP)
    assert eng.num_free_blocks == 2
    sc.generate(p[2], SP)  # needs 6 blocks: A goes (LRU), B stays
    assert sa.history_len == 0 and sb.history_len == 140 and sc.history_len == 180
    a2 = sa.generate(p[3], SP)  # evicts B now (C was used later)
    assert [a1.token_ids, a2.token_ids] == want_a
    assert a2.timings["history_tokens"] == 0 and a2.timings["chunk_tokens"] == 150 + 6 + 20
    assert sb.history_len == 0 and sc.history_len == 180
    with pytest.raises(ValueError, match=r"needs \d+ more pool blocks .* free of 12 .* cached prefixes hold 6 more"):
        sc.generate(list(range(1, 200)), SP)  # 180 + 6 + 199 tokens > 12 blocks even alone
    assert sc.history_len == 180 and sa.history_len == 176
    assert len(sc.generate(p[4], SP).token_ids) == SP.max_tokens
    for s in (sa, sb, sc):
        s.close()
    assert eng.num_free_blocks == 12


def test_plain_request_evicts_idle_sessions():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, kv_cache_tokens=8 * 32, max_model_len=256, **SDPA)
    s = llm.session()
    s.generate(_prompts([200])[0], SP)
    out = llm.generate(_prompts([230], seed=1)[0], SP)[0]
    assert len(out.token_ids) == SP.max_tokens
    assert s.history_len == 0 and len(s.tokens) == 206  # dropped KV, kept tokens
    s.close()
    assert llm.offload.num_free_blocks == 8


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_bad_input_leaves_the_session_serving(mode):
    m = tiny_random()
    kw = {"kv_block_size": 32} if mode == "offload" else {}
    llm = LLM(m, mode=mode, max_model_len=128, **SDPA, **kw)
    prompts = _prompts([50, 20], seed=30)
    want = _conversation(llm, prompts)[0]
    s = llm.session()
    s.generate(prompts[0], SP)
    with pytest.raises(ValueError, match="max_model_len=128"):
        s.generate(list(range(100)), SP)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.generate([1, 2, 10 ** 6], SP)
    with pytest.raises(ValueError, match="empty"):
        s.generate([], SP)
    assert s.generate(prompts[1], SP).token_ids == want[1]
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.generate(prompts[1], SP)
    with pytest.raises(ValueError, match="history_budget"):
        llm.session(history_budget=33)
    with pytest.raises(ValueError, match="history_budget=64: sessions with max_num_seqs=2 read their history whole"):
        LLM(m, mode=mode, max_num_seqs=2, max_model_len=128, **kw).session(history_budget=64)
    with pytest.raises(ValueError, match="ring"):
        LLM(m, mode="offload", offload_decode="ring", max_model_len=128).session()


def test_history_budget_is_checked_as_an_int():
    """A numpy integer is an int (as everywhere check_int runs); a non-int or a non-positive value is
    one ValueError naming it."""
    np = pytest.importorskip("numpy")
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=128, **SDPA)
    s = llm.session(history_budget=np.int64(64))
    assert s.history_budget == 64 and type(s.history_budget) is int
    for bad, msg in (("x", "history_budget must be an int, got str 'x'"), (True, "got bool True"),
                     (0, "history_budget must be >= 1, got 0"), (1.5, "got float 1.5")):
        with pytest.raises(ValueError, match=msg):
            s.history_budget = bad
    s.close()


def test_llm_close_closes_sessions():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=256, **SDPA)
    s = llm.session()
    s.generate(_prompts([40])[0], SP)
    llm.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        llm.session()


def test_chat_turns_equal_the_rendered_conversation(smollm2_llm):
    """SmolLM2 and its chat template: the second chat turn answers what one-shot generation over
    the template's rendering of the whole conversation answers."""
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
    assert o2.timings["history_tokens"] > 0
    s.close()


@pytest.fixture(scope="module")
def smollm2_llm():
    from helpers import smollm2

    m = smollm2()
    return LLM(m, mode="gpu", max_model_len=512, **SDPA)


# ---------------------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_model(dtype=torch.bfloat16):
    from xoffload.models import random_model

    return random_model("tiny-llama", dtype=dtype, device="cuda", seed=1, std=0.15)


@pytest.mark.cuda
@cuda
def test_gpu_offload_session_equals_resident_session():
    m = _gpu_model()
    prompts = _prompts([3000, 64, 200], seed=40)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    a = _conversation(LLM(m, mode="gpu", max_model_len=4096), prompts, sp)[0]
    b = _conversation(LLM(m, mode="offload", kv_block_size=256, max_model_len=4096), prompts, sp)[0]
    assert a == b
    c = _conversation(LLM(m, mode="offload", kv_block_size=256, max_model_len=4096, cuda_graph=False), prompts, sp)[0]
    assert c == b


@pytest.mark.cuda
@cuda
def test_gpu_history_staging_delayed_on_its_copy_stream(monkeypatch):
    """The seeds' race: copies on one stream, their readers on another. Each dense-history layer's
    gather is delayed ~2 ms on the copy stream; the answers must not change."""
    import xoffload.engine.kv_history as sess

    m = _gpu_model()
    prompts = _prompts([2500, 40], seed=41)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(m, mode="offload", kv_block_size=256, max_model_len=4096)
    want = _conversation(llm, prompts, sp)[0]
    real = sess.gather_blocks

    def slow(*a, **k):
        torch.cuda._sleep(2_000_000)
        return real(*a, **k)

    monkeypatch.setattr(sess, "gather_blocks", slow)
    assert _conversation(llm, prompts, sp)[0] == want
    assert _conversation(llm, prompts, sp, history_budget=512)[0] is not None


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
        assert outs[1].timings["chunk_tokens"] == 25
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
    with pytest.raises(ValueError, match="prefix_caching"):
        LLM(m, mode="gpu", prefix_caching=True)


def test_first_turn_on_a_reused_prefix_reads_it_whole():
    """A session with sparse history whose first turn reuses a cached prefix reads that prefix
    whole: prefix caching never changes the tokens."""
    m = tiny_random()
    x, q = _prompts([200, 20], seed=60)
    res = []
    for pc in (False, True):
        llm = LLM(m, mode="offload", kv_block_size=16, max_model_len=512, prefix_caching=pc, **SDPA)
        if pc:
            llm.generate(x, SP)
        s = llm.session(history_budget=64, dense_layers=0, recent_pages=0)
        o = s.generate(x + q, SP)
        assert o.timings["history_sparse_layers"] == 0
        res.append(o.token_ids)
        s.close()
    assert res[0] == res[1]


def test_reserve_counts_the_copy_of_a_shared_partial_block():
    """Reusing a cached partial block costs a copy before the first write: with the pool full of
    an idle session's blocks the turn evicts it up front instead of failing mid-prefill."""
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=16, kv_cache_tokens=128, max_model_len=256, prefix_caching=True,
              **SDPA)
    x, y = _prompts([40, 80], seed=61)
    llm.generate(x, SP)  # cached: 2 full blocks + a partial one of 8 tokens
    d = llm.session()
    d.generate(y, SP)
    assert llm.offload.num_free_blocks == 0
    b = llm.session()
    assert len(b.generate(x + [7] * 8, SP).token_ids) == SP.max_tokens
    assert d.history_len == 0  # evicted
    llm.offload.allocator.check()


def test_blocks_shared_with_a_session_in_use_are_not_counted_as_freeable():
    """An idle session sharing cached blocks with the turn's own prefix frees nothing by leaving:
    the turn that cannot fit raises before evicting anyone."""
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=16, kv_cache_tokens=128, max_model_len=256, prefix_caching=True,
              **SDPA)
    x = _prompts([64], seed=62)[0]
    llm.generate(x, SP)
    a = llm.session()
    a.generate(x + [1], SP)
    held = a.blocks_held()
    b = llm.session()
    with pytest.raises(ValueError, match="could be freed"):
        b.generate(x + list(range(76)), SP)  # 140 tokens: 9 blocks > the 8-block pool
    assert a.blocks_held() == held
    llm.offload.allocator.check()


def test_cached_prefixes_give_way_before_idle_sessions():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=16, kv_cache_tokens=128, max_model_len=256, prefix_caching=True,
              **SDPA)
    p = _prompts([64, 40, 60], seed=63)
    llm.generate(p[0], SP)  # 4 blocks held only by the cache
    a = llm.session()
    a.generate(p[1], SP)  # 3 blocks
    llm.session().generate(p[2], SP)  # needs 4: 1 free + cached ones, A untouched
    assert a.blocks_held() == 3


def test_plain_request_evicts_only_when_its_prompt_needs_the_room():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=16, kv_cache_tokens=128, max_model_len=256, **SDPA)
    a = llm.session()
    a.generate(_prompts([60], seed=64)[0], SP)
    llm.generate(_prompts([20], seed=65)[0], SamplingParams(max_tokens=100, ignore_eos=True))  # tokens: GPU tail
    assert a.blocks_held() == 4


def test_a_refused_first_turn_still_reuses_the_cache_next_time():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=16, kv_cache_tokens=128, max_model_len=256, prefix_caching=True,
              **SDPA)
    x = _prompts([64], seed=66)[0]
    llm.generate(x, SP)
    s = llm.session()
    with pytest.raises(ValueError, match="more pool blocks"):
        s.generate([1] * 200, SP)
    assert s.generate(x + [3], SP).timings["prefix_reused_tokens"] == 64


def test_dense_layers_as_indices_and_from_the_decode_policy():
    m = tiny_random()
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, **SDPA)
    assert llm.session().dense_layers == (0, 1)
    assert llm.session(dense_layers=1).dense_layers == (0,)
    assert llm.session(dense_layers=[1]).dense_layers == (1,)
    q = LLM(m, mode="offload", kv_block_size=32, max_model_len=1024, sparse_decode=QuestDecode(
        token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(1,)), **SDPA)
    assert q.session().dense_layers == (1,)
    for bad in (3, -1, [2], ["a"], 1.5):
        with pytest.raises(ValueError, match="dense_layers"):
            llm.session(dense_layers=bad)
    # layer 1 dense, layer 0 sparse: the sparse path reads every page (recent pages cover them)
    prompts = _prompts([150, 30], seed=67)
    dense = _conversation(llm, prompts)[0]
    a, outs = _conversation(llm, prompts, history_budget=96, recent_pages=16, dense_layers=[1])
    assert a == dense and outs[1].timings["history_sparse_layers"] == 1


def test_prefix_caching_in_a_batch():
    """8 questions over one document in one batched call (max_num_seqs=4): every sequence after
    the first reuses the document, prefilled once; answers equal a batched LLM without caching
    and each prompt alone; a second call reuses it too; the pool is whole after clear()."""
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
    with pytest.raises(ValueError, match="needs prefetch=False"):  # one per-request store per sequence
        LLM(m, prefix_caching=True, sparse_decode=dataclasses.replace(QUEST, prefetch=True), **kw)


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
