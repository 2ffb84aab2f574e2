"""``mode="resident"`` + QuestDecode through the batched Quest store (``OffloadQuestBatchKV``) over a
runtime whose pool is on the model's device (``DeviceKVPool``): the store table's route, the
pool's sizing and refusals, and tokens (CPU fp32: token for token) -- equal to resident dense
decode when the budget covers the context, equal to the same policy over the pinned pool (offload,
no page cache: the same selection in the other placement) at a real budget, with ``max_num_seqs``
1 and N;
prefix caching over the device pool gives the same tokens as without it; nothing is left in the
pool once the engine is idle. GPU tests (marked) compare graphs with eager and bf16 tracking."""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kv.quest import OffloadQuestBatchKV
from xoffload.kv.table import batch_store_class
from xoffload.models import random_model
from xoffload.runtime import DeviceKVPool, PoolAllocationError
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random
from .test_batch import _check_batch_tracks_alone, _prompts

# pages of 16 in pool blocks of 32: selections cross block boundaries; dense layer 0 read from the pool
POL = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
CH = dataclasses.replace(POL, exact_channels=4, bound_scale=0.25)
KW = {"mode": "resident", "kv_block_size": 32, "prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=6, ignore_eos=True)


def _idle_and_whole(llm):
    """The engine is idle: no pool sequence left; every block free except those only the prefix
    cache holds; the allocator's books balance."""
    eng = llm.offload
    assert isinstance(eng.pool, DeviceKVPool) and eng.pool.placement == "device"
    assert eng.sequences() == []
    eng.allocator.check()
    cached = llm.engine.prefix_cache.evictable_blocks() if llm.engine.prefix_cache is not None else 0
    assert eng.num_free_blocks + cached == eng.allocator.num_blocks
    if llm.engine.prefix_cache is not None:
        llm.engine.prefix_cache.clear()
        assert eng.num_free_blocks == eng.allocator.num_blocks


def test_store_table_routes_resident_quest_to_the_device_pool():
    """resident + QuestDecode at every max_num_seqs: the batched Quest store over a device-pool
    runtime; the device pool's blocks hold what the engine can run: max_num_seqs sequences of
    max_model_len (the CPU) or kv_cache_tokens."""
    m = tiny_random()
    batched = OffloadQuestBatchKV
    for pol, n, want in ((POL, 2, batched), (CH, 3, batched), ("quest-ch", 2, batched), (POL, 1, batched)):
        llm = LLM(m, max_model_len=100, max_num_seqs=n, sparse_decode=pol, **KW)
        cls, kw = batch_store_class(llm.config)
        assert cls is want, (pol, n)
        if want is OffloadQuestBatchKV:
            assert kw == {"pool_placement": "device"}
            assert isinstance(llm.offload.pool, DeviceKVPool) and llm.offload.pool.device == m.device
            assert llm.offload.allocator.num_blocks == n * 4  # ceil(100 / 32) blocks per sequence
        else:
            assert llm.offload is None
    llm = LLM(m, max_model_len=100, max_num_seqs=2, sparse_decode=POL, kv_cache_tokens=70, **KW)
    assert llm.offload.allocator.num_blocks == 3
    with pytest.raises(ValueError, match="kv_block_size 40 must be a multiple of the decode policy's page_size 16"):
        LLM(m, max_model_len=100, max_num_seqs=2, sparse_decode=POL, **{**KW, "kv_block_size": 40})


@pytest.mark.parametrize("n", [1, 4])
def test_budget_covering_the_context_equals_resident_dense(n):
    """A budget that covers every page (and None): greedy tokens equal resident dense decode, one
    request at a time; fed the same tokens, each batch row's logits equal the dense store's to
    float rounding; h2d is 0 and no page cache is made."""
    m = tiny_random()
    prompts = _prompts([5, 48, 90, 177, 263], seed=13)
    dense = LLM(m, mode="resident", max_model_len=300, prefill_attn="sdpa")
    want = [dense.generate(p, SP)[0].token_ids for p in prompts]
    for budget in (None, 4096):
        pol = QuestDecode(token_budget=budget, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(1,))
        llm = LLM(m, max_model_len=300, max_num_seqs=n, sparse_decode=pol, **KW)
        outs = llm.generate(prompts, SP)
        assert [o.token_ids for o in outs] == want, budget
        assert all(o.timings["h2d_bytes_per_token"] == 0 for o in outs if o.timings.get("decode_steps"))
        st = llm.batch_stats["store"]
        assert st["store"] == "OffloadQuestBatchKV" and st["pool"] == "device"
        assert st["cache_slots"] == 0 and st["dense_pool_bytes"] == 0 and not st["dense_on_gpu"]
        _idle_and_whole(llm)
    if n == 4:
        _check_batch_tracks_alone(m, prompts, "gpu", 4, lambda la: 1e-4 * float(la.abs().max()), kv_block_size=32,
                                  sparse_decode=QuestDecode(token_budget=None, page_size=16, sink_tokens=16,
                                                            recent_tokens=32, dense_layers=(1,)))


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("pol", [POL, CH], ids=["quest", "quest-ch"])
def test_real_budget_equals_the_same_selection_over_the_pinned_pool(n, pol):
    """Budget 96 (some rows select 2-3 of up to 15 pages), prompt lengths under a page, on page and
    block edges and past them, sequences joining mid-batch (n=3) and finishing after one token:
    each sequence's greedy tokens equal those of the same policy over the pinned pool (offload, no
    page cache: the pages are chosen by the same scores), one request at a time."""
    m = tiny_random()
    lens = [1, 15, 16, 17, 31, 32, 33, 100, 129, 200, 263]
    prompts = _prompts(lens, seed=11)
    sps = [SP] * len(lens)
    sps[3] = SamplingParams(max_tokens=1)
    one = LLM(m, max_model_len=300, sparse_decode=dataclasses.replace(pol, cache_pages=0),
              **{**KW, "mode": "offload"})
    ref = [one.generate(p, sp)[0].token_ids for p, sp in zip(prompts, sps)]
    llm = LLM(m, max_model_len=300, max_num_seqs=n, max_num_batched_tokens=4096, sparse_decode=pol, **KW)
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == ref
    assert llm.batch_stats["store"]["store"] == "OffloadQuestBatchKV" and llm.batch_stats["store"]["pool"] == "device"
    assert any(pol.plan(k).pages_per_step < pol.plan(k).num_candidates for k in lens)  # some rows select
    assert llm.batch_stats["max_running"] == min(n, len(lens))
    _idle_and_whole(llm)


def test_prefix_caching_over_the_device_pool_equals_no_caching():
    """Questions over one document (the prefix ends mid-block: copy-on-write), an exact repeat and
    a second call: with prefix caching the tokens equal the run without it, later prompts report
    num_cached_tokens > 0, and a too-small pool evicts cached blocks and still answers."""
    m = tiny_random()
    doc = _prompts([150], seed=80)[0]
    prompts = [doc + q for q in _prompts([20, 1, 16, 33], seed=81)] + [doc + [3]]
    for pol in (POL, CH):
        kw = dict(max_model_len=300, max_num_seqs=3, sparse_decode=pol, **KW)
        ref = LLM(m, **kw).generate(prompts, SP)
        llm = LLM(m, prefix_caching=True, **kw)
        assert llm.engine.prefix_cache is not None and llm.engine.prefix_cache.engine is llm.offload
        outs = llm.generate(prompts, SP)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= 128 for o in outs[1:]), \
            [o.num_cached_tokens for o in outs]
        again = llm.generate(prompts[::-1], SP)
        assert [o.token_ids for o in again] == [r.token_ids for r in ref][::-1]
        assert all(o.num_cached_tokens >= 150 for o in again), [o.num_cached_tokens for o in again]
        _idle_and_whole(llm)
    small = LLM(m, prefix_caching=True, kv_cache_tokens=12 * 32, **{**kw, "sparse_decode": POL})
    other = _prompts([100, 120], seed=82)
    mixed = prompts[:2] + other + prompts[2:]
    want = [o.token_ids for o in LLM(m, **{**kw, "sparse_decode": POL}).generate(mixed, SP)]
    for _ in range(2):
        assert [o.token_ids for o in small.generate(mixed, SP)] == want
    assert small.engine.prefix_cache.stats().evictions > 0
    _idle_and_whole(small)


def test_step_api_refuses_what_never_fits_and_conversations_reuse():
    """add_request refuses a prompt over the device pool (kv_cache_tokens) naming the sizes; the
    step API and a batched conversation (PrefixSession over the prefix cache) give the tokens of
    the one-request store's runs."""
    m = tiny_random()
    llm = LLM(m, max_model_len=300, max_num_seqs=2, sparse_decode=POL, kv_cache_tokens=128, prefix_caching=True, **KW)
    e = llm.engine
    with pytest.raises(ValueError, match=r"prompt big needs 160 tokens of KV in the device pool \(150 prompt tokens "
                                         r"in blocks of 32\) but the pool holds 128 tokens"):
        e.add_request("big", _prompts([150], seed=3)[0], SP)
    one = LLM(m, max_model_len=300, sparse_decode=POL, **KW)
    p1, p2 = _prompts([70, 90], seed=4)
    e.add_request("a", p1, SP)
    e.add_request("b", p2, SP)
    finals = {}
    while e.has_unfinished_requests():
        finals.update({o.request_id: o for o in e.step() if o.finished})
    assert [finals["a"].token_ids, finals["b"].token_ids] == [one.generate(p, SP)[0].token_ids for p in (p1, p2)]
    with llm.session() as s:
        a1 = s.generate(p1[:40], SP)
        a2 = s.generate(p1[40:60], SP)
    assert a2.num_cached_tokens > 0 and a2.timings["history_tokens"] > 0
    assert a1.token_ids == one.generate(p1[:40], SP)[0].token_ids
    assert a2.token_ids == one.generate(p1[:40] + a1.token_ids + p1[40:60], SP)[0].token_ids
    _idle_and_whole(llm)


def test_chunked_prefill_over_the_device_pool():
    """enable_chunked_prefill works over the device pool (the chunks read back from it): the same
    tokens as whole prefills."""
    m = tiny_random()
    prompts = _prompts([200, 40, 263], seed=5)
    kw = dict(max_model_len=300, max_num_seqs=3, sparse_decode=POL, **KW)
    want = [o.token_ids for o in LLM(m, **kw).generate(prompts, SP)]
    llm = LLM(m, enable_chunked_prefill=True, max_num_batched_tokens=64, **kw)
    assert [o.token_ids for o in llm.generate(prompts, SP)] == want
    tokens = [x["tokens"] for x in llm.batch_stats["prefills"]]
    assert max(tokens) <= 64 and len(tokens) >= 200 // 64 + 263 // 64 + 2, tokens
    _idle_and_whole(llm)


def test_device_pool_sizing_cut_to_memory_and_refused_when_nothing_fits(monkeypatch):
    """Under a memory limit (faked), the pool holds what fits after the tails and the summaries
    each pool token pays for; with no room for a block the LLM is refused at construction, naming
    the sizes; kv_cache_tokens overrides the limit."""
    import xoffload.kv.device_runtime as dr

    m = tiny_random()
    c = m.cfg
    kw = dict(max_model_len=256, max_num_seqs=4, sparse_decode=POL, **KW)
    tok = c.kv_bytes_per_token(m.dtype)
    summ = (c.num_layers - 1) * c.num_kv_heads * 2 * c.head_dim * 4 / 16
    tails = 4 * (POL.largest_plan(256)[2] + dr.TAIL_NEW_TOKENS) * tok  # the most resident up to 256
    monkeypatch.setattr(dr, "_pool_memory_limit", lambda *a: int(tails + 5.5 * 32 * (tok + summ)))
    llm = LLM(m, **kw)
    assert llm.offload.allocator.num_blocks == 5
    out = llm.generate(_prompts([100], seed=6), SP)[0]
    assert len(out.token_ids) == 6
    monkeypatch.setattr(dr, "_pool_memory_limit", lambda *a: int(tails + 10 ** 9 * tok))
    assert LLM(m, **kw).offload.allocator.num_blocks == 4 * 8  # capped at max_num_seqs * max_model_len
    monkeypatch.setattr(dr, "_pool_memory_limit", lambda *a: int(tails))
    with pytest.raises(PoolAllocationError, match=r"no KV block of 32 tokens fits .*max_model_len=256.*"
                                                  r"max_num_seqs=4.*set kv_cache_tokens"):
        LLM(m, **kw)
    assert LLM(m, kv_cache_tokens=64, **kw).offload.allocator.num_blocks == 2


# ------------------------------------------------------------------------------------------ GPU
def _common(x, y) -> int:
    """Length of the common prefix of two token lists."""
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))


@pytest.mark.cuda
def test_gpu_resident_quest_batch_on_the_device_pool():
    """fp16, random Llama-3.2-1B, resident + Quest (budget 512): the pool is on the GPU, the CUDA
    graph batch gives the eager batch's tokens, no host bytes per step; every row shares its first
    token and >= 60% of its tokens (as common prefixes: a bf16 near-tie sends a row down another
    path) with the one-request store; with prefix caching, graphs equal eager exactly, rows share
    >= 60% with the run without caching (the history merge sums in another order) and the repeated
    document is reused; budget None tracks the dense resident store's logits within bf16
    rounding; the pool is whole once idle. fp16, not bf16: the random model's logits are flat, and
    bf16's 8-bit mantissa turns the batch's other summation order into a flipped near-tie within a
    few tokens (38 of 72 tokens shared on an H100)."""
    m = random_model("llama-3.2-1b", dtype=torch.float16, device="cuda", seed=0, std=0.02)
    doc = _prompts([3000], seed=7, vocab=m.cfg.vocab_size)[0]
    prompts = _prompts([1, 700, 1025, 4100], vocab=m.cfg.vocab_size) + [doc + [5, 6], doc + [7]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = {"mode": "resident", "kv_block_size": 1024, "max_model_len": 4200, "max_num_seqs": 8,
          "max_num_batched_tokens": 16384, "sparse_decode": QuestDecode(token_budget=512)}
    graph = LLM(m, **kw)
    assert graph.offload.pool.placement == "device" and graph.offload.pool.k[0].is_cuda
    outs = graph.generate(prompts, sp)
    a = [o.token_ids for o in outs]
    assert graph.batch_stats["graph_buckets"] == [8] and graph.batch_stats["store"]["cache_slots"] == 0
    assert all(o.timings.get("h2d_bytes_per_token", 0) == 0 for o in outs)
    assert a == [o.token_ids for o in LLM(m, cuda_graph=False, **kw).generate(prompts, sp)]
    alone = LLM(m, **{**kw, "max_num_seqs": 1})
    ref = [alone.generate(p, sp)[0].token_ids for p in prompts]
    same = [_common(x, y) for x, y in zip(a, ref)]
    assert all(n >= 1 for n in same) and sum(same) >= 0.6 * sum(map(len, ref)), same
    cached = LLM(m, prefix_caching=True, **kw)
    c_outs = cached.generate(prompts, sp)
    c = [o.token_ids for o in c_outs]
    assert c_outs[-1].num_cached_tokens >= 3000
    assert c == [o.token_ids for o in LLM(m, prefix_caching=True, cuda_graph=False, **kw).generate(prompts, sp)]
    same = [_common(x, y) for x, y in zip(c, a)]
    assert all(n >= 1 for n in same) and sum(same) >= 0.6 * sum(map(len, a)), same
    _idle_and_whole(cached)
    _idle_and_whole(graph)
    eps = torch.finfo(torch.float16).eps
    _check_batch_tracks_alone(m, prompts[:4], "gpu", 8, lambda la: m.cfg.num_layers * eps * float(la.abs().max()),
                              kv_block_size=1024, sparse_decode=QuestDecode(token_budget=None))


@pytest.mark.cuda
def test_gpu_device_pool_sized_from_free_memory():
    """Without kv_cache_tokens the GPU pool takes what fits under the process's cap (less a
    prefill's headroom and the tails), at most max_num_seqs x max_model_len; a request over it is
    refused at add_request naming the GPU pool."""
    from xoffload.kv.device_runtime import device_pool_blocks

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    llm = LLM(m, mode="resident", max_model_len=8192, max_num_seqs=4, sparse_decode="quest")
    assert llm.offload.allocator.num_blocks == 4 * 8  # fits on an H200
    assert device_pool_blocks(m, llm.config) <= 4 * 8
    small = LLM(m, mode="resident", max_model_len=8192, max_num_seqs=4, sparse_decode="quest", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match=r"tokens of KV in the GPU pool .* holds 2048 tokens"):
        small.engine.add_request("x", _prompts([3000], vocab=m.cfg.vocab_size)[0], SamplingParams(max_tokens=2))
