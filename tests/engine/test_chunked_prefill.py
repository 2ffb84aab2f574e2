"""Chunked prefill (xoffload.kv.chunk, the runner's _prefill_chunked): a prompt longer
than max_num_batched_tokens is prefilled over several steps and gives the tokens of a whole
prefill; running sequences decode between its chunks; a short prompt that arrives meanwhile is
prefilled first; an abort mid-prefill frees its blocks; the option is resolved and refused where
the store cannot chunk. CPU, tiny random model, greedy."""
import itertools

import pytest
import torch

from xoffload import LLMEngine
from xoffload.engine import LLM, SamplingParams
from xoffload.kv.chunk import DEFAULT_CHUNK_TOKENS
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=5, ignore_eos=True)
MODES = {"direct": {"offload_decode": "direct"}, "uva": {"offload_decode": "uva"}}
DECODES = {"dense": None,
           "quest": QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,)),
           "quest-ch": QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                                   exact_channels=4, bound_scale=0.25)}


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lens]


_REF: dict = {}


def _alone(prompts, sp=SP):
    llm = LLM(tiny_random(), mode="resident", max_model_len=256, **SDPA)
    out = []
    for p in prompts:
        key = (tuple(p), sp.max_tokens)
        if key not in _REF:
            _REF[key] = llm.generate(p, sp)[0].token_ids
        out.append(_REF[key])
    return out


def _engine(chunk=40, **kw):
    opts = dict(mode="offload", kv_block_size=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=chunk,
                enable_chunked_prefill=True, **SDPA)
    opts.update(kw)
    return LLMEngine(tiny_random(), **opts)


def _run(e):
    finals = {}
    while e.has_unfinished_requests():
        finals.update({o.request_id: o for o in e.step() if o.finished})
    return finals


@pytest.mark.parametrize("mode,decode,prefix", list(itertools.product(MODES, DECODES, (False, True))))
def test_chunks_give_the_tokens_of_a_whole_prefill(mode, decode, prefix):
    """Prompts of 150 and 201 tokens in chunks of 40 (the second one's chunks continue a cached
    prefix when prefix caching is on) give the one-request tokens; the epoch's prefills are chunks."""
    p1, p2 = _prompts([150, 81], seed=3)
    p2 = p1[:120] + p2  # shares 120 tokens with p1 (one whole 64-token block)
    e = _engine(sparse_decode=DECODES[decode], prefix_caching=prefix, **MODES[mode])
    assert e.config.enable_chunked_prefill and e.config.max_num_batched_tokens == 40
    free0 = e.num_free_blocks
    for rid, p in (("a", p1), ("b", p2)):
        e.add_request(rid, p, SP)
    finals = _run(e)
    assert [finals["a"].token_ids, finals["b"].token_ids] == _alone([p1, p2])
    tokens = [x["tokens"] for x in e.stats["prefills"]]
    assert max(tokens) <= 40 and len(tokens) >= 150 // 40 + 1, tokens
    if prefix:  # the cached prompts stay in the pool until evicted; none is held by a request
        assert e.prefix_cache.evictable_blocks() == free0 - e.num_free_blocks
    else:
        assert e.num_free_blocks == free0


def test_running_sequences_decode_between_chunks_and_short_prompts_go_first():
    """A (30 tokens, prefilled first) decodes while B (200 tokens, chunks of 32) is prefilled: A
    gains a token in each of B's chunk steps; C (a 12-token prompt) arriving mid-prefill gets its first token in the next step,
    before B's; every one gives its one-request tokens."""
    pa, pb, pc = _prompts([30, 200, 12], seed=4)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    e = _engine(chunk=32)
    e.add_request("a", pa, sp)
    e.add_request("b", pb, SP)  # the store opens for both: B is prefilled while A decodes
    seen, finals = {"a": 0}, {}
    grew_while_b_filled, c_first, b_first = 0, None, None
    for step in range(60):
        if step == 2:
            e.add_request("c", pc, SP)
        outs = e.step()
        for o in outs:
            if o.request_id == "a" and not o.finished and len(o.token_ids) > seen["a"]:
                seen["a"] = len(o.token_ids)
                grew_while_b_filled += b_first is None
            if o.request_id == "c" and c_first is None:
                c_first = step
            if o.request_id == "b" and b_first is None:
                b_first = step
            if o.finished:
                finals[o.request_id] = o
        if not e.has_unfinished_requests():
            break
    assert grew_while_b_filled >= 200 // 32 - 1, grew_while_b_filled
    assert c_first == 2 and b_first > c_first, (c_first, b_first)
    assert [finals[r].token_ids for r in "abc"] == _alone([pa, pb, pc], sp)[:1] + _alone([pb, pc])


def test_one_long_prompt_fills_at_a_time_and_short_ones_pass_it():
    """A and B (200 tokens each, chunks of 32) and C (12 tokens) arrive together: C is admitted and
    prefilled in the first step, past B, which waits (not admitted, holding no KV) until A's
    prefill is done; every one gives its one-request tokens."""
    pa, pb, pc = _prompts([200, 200, 12], seed=7)
    e = _engine(chunk=32)
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        e.add_request(rid, p, SP)
    first, finals, b_admitted = {}, {}, None
    for step in range(80):
        for o in e.step():
            first.setdefault(o.request_id, step)
            if o.finished:
                finals[o.request_id] = o
        running = {s.request_id for s in e._runner.sched.running} if e._runner is not None else set()
        if "b" in running and b_admitted is None:
            b_admitted = step
        if not e.has_unfinished_requests():
            break
    assert first["c"] == 0 < first["a"] <= b_admitted < first["b"], (first, b_admitted)
    assert [finals[r].token_ids for r in "abc"] == _alone([pa, pb, pc])


def test_abort_mid_prefill_frees_its_blocks():
    """Aborting B between its chunks frees its pool blocks at once; A still gives its tokens."""
    pa, pb = _prompts([30, 220], seed=5)
    e = _engine(chunk=32)
    free0 = e.num_free_blocks
    e.add_request("a", pa, SP)
    e.add_request("b", pb, SP)
    e.step()
    e.step()
    e.abort_request("b")
    finals = _run(e)
    assert finals["b"].finish_reason == "abort" and finals["b"].token_ids == []
    assert finals["a"].token_ids == _alone([pa])[0]
    assert e.num_free_blocks == free0


def test_option_is_resolved_per_store():
    """Default: off (the budget then defaults to max_model_len); True on a batched offload store:
    4096-token chunks unless max_num_batched_tokens says otherwise; True where the store cannot
    chunk is refused; False: one prefill per prompt; max_num_seqs=1 chunks as a batch of one."""
    m = tiny_random()
    c = LLMEngine(m, mode="offload", max_num_seqs=2, max_model_len=256).config
    assert c.enable_chunked_prefill is False and c.max_num_batched_tokens == 256
    c = LLMEngine(m, mode="offload", max_num_seqs=2, max_model_len=256, enable_chunked_prefill=True).config
    assert c.enable_chunked_prefill is True and c.max_num_batched_tokens == DEFAULT_CHUNK_TOKENS
    for kw in ({"mode": "resident", "max_num_seqs": 2}, {"mode": "offload", "sparse": "xattn"}):
        c = LLMEngine(m, max_model_len=256, **kw).config
        assert c.enable_chunked_prefill is False and c.max_num_batched_tokens == 256
        with pytest.raises(ValueError, match="enable_chunked_prefill=True needs a store that prefills in chunks"):
            LLMEngine(m, max_model_len=256, enable_chunked_prefill=True, **kw)
    with pytest.raises(TypeError, match="enable_chunked_prefill must be a bool"):
        LLMEngine(m, enable_chunked_prefill="yes")
    (pa,) = _prompts([150], seed=6)
    e = _engine(chunk=40, enable_chunked_prefill=False)
    e.add_request("a", pa, SP)
    assert _run(e)["a"].token_ids == _alone([pa])[0]
    assert [x["tokens"] for x in e.stats["prefills"]] == [150]
    e = _engine(chunk=40, max_num_seqs=1)  # a batch of one chunks its prefill too
    e.add_request("a", pa, SP)
    assert _run(e)["a"].token_ids == _alone([pa])[0]
    assert [x["tokens"] for x in e.stats["prefills"]] == [40, 40, 40, 30]


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["dense", "quest"])
def test_gpu_chunks_against_a_whole_prefill(decode):
    """fp16, random Llama-3.2-1B, pool blocks of 1024, CUDA graphs: prompts of 6000 and 2500
    tokens in chunks of 1024 (the first one's chunks read back from pinned memory by the gather
    kernel) against the same engine without chunking: every row's first token is equal and rows
    share >= 60% of their tokens as a common prefix (the chunk-history merge sums in another
    order, as a reused prefix does; the random model's logits are nearly flat); the chunks ran; no block is left held."""
    from xoffload.models import random_model

    m = random_model("llama-3.2-1b", dtype=torch.float16, device="cuda", seed=0, std=0.02)
    g = torch.Generator().manual_seed(90)
    prompts = [torch.randint(1, m.cfg.vocab_size, (n,), generator=g).tolist() for n in (6000, 2500)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    pol = None if decode == "dense" else QuestDecode(token_budget=1024)
    kw = dict(mode="offload", kv_block_size=1024, max_model_len=6100, max_num_seqs=4, sparse_decode=pol)
    whole = [o.token_ids for o in LLM(m, enable_chunked_prefill=False, **kw).generate(prompts, sp)]
    llm = LLM(m, max_num_batched_tokens=1024, enable_chunked_prefill=True, **kw)
    free0 = llm.engine.num_free_blocks
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert max(x["tokens"] for x in llm.batch_stats["prefills"]) <= 1024
    pre = [_common(a, b) for a, b in zip(got, whole)]
    assert all(p >= 1 for p in pre) and sum(pre) >= 0.6 * sum(map(len, whole)), pre
    assert llm.engine.num_free_blocks == free0
