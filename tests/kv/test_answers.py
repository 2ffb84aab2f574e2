"""A finished answer's KV is kept in the pool and the prefix cache (xoffload.kv.answers), so a
conversation's next turn prefills only its new tokens.

CPU, fp32 (the kernels' references), offload mode with prefix caching, dense and Quest decode:
the kept rows equal what a prefill of the same tokens writes (to fp32 rounding through a few layers:
decode and prefills of other lengths sum attention in other orders); an aborted answer is not kept; the pool is whole
once the cache is cleared.
"""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.sparse import QuestDecode

from engine.llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
QUEST = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
POLICIES = [pytest.param({}, id="dense"), pytest.param({"sparse_decode": QUEST}, id="quest")]


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cached_kv(llm, ids):
    """Every layer's K and V of the cached prefix ``ids`` (the whole of it must be cached), read
    from the pool: ``[(k, v)]`` of ``[len(ids), Hkv, D]``."""
    eng, cache = llm.offload, llm.prefix_cache
    sid, n = cache.add_sequence(ids)
    assert n == len(ids)
    try:
        nb = -(-n // eng.block_size)
        out = []
        for layer in range(llm.engine.model.cfg.num_layers):
            k, v = eng.fetch_blocks(sid, layer, list(range(nb)))
            out.append((k[:n].clone(), v[:n].clone()))
        return out
    finally:
        eng.free(sid)


def _llm(**kw):
    return LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, prefix_caching=True, **SDPA, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_kept_answer_equals_a_prefill_of_it(policy):
    """Turn one answers 12 tokens over a 150-token prompt; the cache then holds prompt + the 11 fed
    answer tokens, and their K/V equal those a prefill of the same 161 tokens writes."""
    prompt = _ids(150, 1)
    llm = _llm(**policy)
    with llm.session() as s:
        ans = s.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
        ids = prompt + ans[:11]
        assert llm.prefix_cache.peek(ids + [0]) == 161
        kept = _cached_kv(llm, ids)
    ref = _llm(**policy)
    ref.generate([ids + [0]], SamplingParams(max_tokens=1, ignore_eos=True))  # registers its prompt
    want = _cached_kv(ref, ids)
    assert torch.equal(kept[0][0][:150], want[0][0][:150])  # layer 0's prompt rows: the same computation
    for (k, v), (k0, v0) in zip(kept, want):
        torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-5)
    for x in (llm, ref):
        x.prefix_cache.clear()
        assert x.offload.num_free_blocks == x.offload.allocator.num_blocks
        x.offload.allocator.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_next_turn_prefills_only_its_new_tokens(policy):
    """Two turns: the second finds the first turn's prompt and answer but its last token, prefills
    that token and its own 20, and answers as a conversation without caching does."""
    p1, p2 = _ids(200, 2), _ids(20, 3)
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    llm = _llm(**policy)
    with llm.session() as s:
        o1, o2 = s.generate(p1, sp), s.generate(p2, sp)
    plain = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, **SDPA, **policy)
    with plain.session() as s:
        r1, r2 = s.generate(p1, sp), s.generate(p2, sp)
    assert (o1.token_ids, o2.token_ids) == (r1.token_ids, r2.token_ids)
    assert (o2.num_cached_tokens, o2.timings["chunk_tokens"]) == (200 + 8, 1 + 20)
    assert (r2.num_cached_tokens, r2.timings["chunk_tokens"]) == (0, 229)


def test_an_aborted_answer_is_not_kept():
    """A request aborted mid-decode leaves its prompt cached, not its partial answer."""
    prompt = _ids(100, 4)
    llm = _llm()
    e = llm.engine
    e.add_request("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    n = 0
    while True:
        outs = e.step()
        n = max([len(o.token_ids) for o in outs if o.request_id == "a"] + [n])
        if n >= 5:
            break
    e.abort_request("a")
    while e.has_unfinished_requests():
        e.step()
    assert llm.prefix_cache.peek(prompt + [0] * 10) == 100
    assert llm.offload.sequences() == []
    llm.prefix_cache.clear()
    assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def test_resident_keeps_an_answer_while_the_store_is_open():
    """Resident mode with prefix caching: while a long request keeps the store open, a
    conversation's second turn finds the first turn's prompt and answer (but its last token) in
    the GPU pool and answers as without caching."""
    p1, p2 = _ids(120, 5), _ids(10, 6)
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    llm = LLM(tiny_random(), mode="resident", kv_block_size=32, max_model_len=512, max_num_seqs=2,
              prefix_caching=True, **SDPA)
    e = llm.engine
    e.add_request("long", _ids(50, 7), SamplingParams(max_tokens=60, ignore_eos=True))
    outs = {}
    with llm.session() as s:
        for p in (p1, p2):
            rid = s.submit(p, sp)
            while rid not in outs:
                outs.update({o.request_id: o for o in e.step() if o.finished})
        assert e.has_unfinished_requests()  # the long request kept the store open
        first, second = [outs[r] for r in list(outs)[-2:]]
    while e.has_unfinished_requests():
        e.step()
    plain = LLM(tiny_random(), mode="resident", kv_block_size=32, max_model_len=512, **SDPA)
    with plain.session() as s:
        want = [s.generate(p1, sp).token_ids, s.generate(p2, sp).token_ids]
    assert [first.token_ids, second.token_ids] == want
    assert (second.num_cached_tokens, second.timings["chunk_tokens"]) == (120 + 6, 1 + 10)


@pytest.mark.parametrize("mode", ["offload", "resident"])
def test_a_sparse_answer_below_the_top_layer_is_not_kept(mode):
    """Quest selecting pages in layer 0 of two: the answer's layer-1 K/V were computed from
    attention to the selected pages, not what a prefill of the answer computes, so the answer is
    not kept (the next turn finds only the prompt and prefills the answer) and three turns answer
    as without prefix caching; with every page read (a budget covering the context) it is kept."""
    p1, p2, p3 = _ids(200, 8), _ids(20, 9), _ids(30, 10)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    low = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=())
    full = QuestDecode(token_budget=None, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=())
    for pol, kept in ((low, False), (full, True)):
        runs = {}
        for pc in (True, False):
            llm = LLM(tiny_random(), mode=mode, kv_block_size=32, max_model_len=512, prefix_caching=pc,
                      sparse_decode=pol, **SDPA)
            with llm.session() as s:
                runs[pc] = [s.generate(p, sp) for p in (p1, p2, p3)]
        assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]], pol
        assert runs[True][1].num_cached_tokens == (200 + 7 if kept else 200), pol
