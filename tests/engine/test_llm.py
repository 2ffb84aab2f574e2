"""LLM (xoffload.engine.llm): requests share nothing, bad input leaves the LLM serving, the sparse
prefill policy reaches the model, prefill attention backends agree."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.sparse import XAttentionPrefill

from .llm_helpers import tiny_random as _tiny_random


def test_twenty_requests_share_nothing():
    """20 requests of different lengths in one LLM, one after another, each equal to a fresh LLM."""
    m = _tiny_random("tiny-llama")
    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 120, (20,), generator=g)]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    sps = [SamplingParams(max_tokens=int(3 + i % 5), temperature=0.7 if i % 3 == 0 else 0.0, seed=i) for i in range(20)]
    for mode in ("gpu", "offload"):
        shared = LLM(m, mode=mode, max_model_len=160, kv_block_size=32)
        for p, sp in zip(prompts, sps):
            got = shared.generate(p, sp)[0]
            fresh = LLM(m, mode=mode, max_model_len=160, kv_block_size=32).generate(p, sp)[0]
            assert got.token_ids == fresh.token_ids, (mode, len(p))
        if mode == "offload":
            assert shared.offload.sequences() == []
    # several prompts in one call == one by one
    llm = LLM(m, mode="offload", max_model_len=160, kv_block_size=32)
    many = llm.generate(prompts[:4], SamplingParams(max_tokens=5))
    assert [o.token_ids for o in many] == [llm.generate(p, SamplingParams(max_tokens=5))[0].token_ids for p in prompts[:4]]


def test_sparse_xattn_hook():
    m = _tiny_random("tiny-llama")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    dense = LLM(m, max_model_len=512).generate(ids, sp)[0]
    for mode in ("gpu", "offload"):
        # threshold 1 keeps every causal block: the same tokens as dense attention
        pol = dict(block_size=64, dense_fallback_len=0)
        llm = LLM(m, mode=mode, max_model_len=512, kv_block_size=64,
                  sparse=XAttentionPrefill(threshold=1.0, dense_layers=[0], **pol))
        o = llm.generate(ids, sp)[0]
        assert o.token_ids == dense.token_ids
        d = o.timings["density"]
        assert d[0] is None and d[1] is not None and abs(d[1] - 1.0) < 1e-6
        # a low threshold really skips blocks
        o = LLM(m, mode=mode, max_model_len=512, kv_block_size=64,
                sparse=XAttentionPrefill(threshold=0.05, dense_layers=[], **pol)).generate(ids, sp)[0]
        assert all(x is not None for x in o.timings["density"]) and o.timings["mean_density"] < 1.0
    with pytest.raises(ValueError, match="sparse"):
        LLM(m, sparse="bogus")


def test_bad_input_then_still_serves():
    m = _tiny_random("tiny-llama")
    for mode, kw in (("gpu", {}), ("offload", {"kv_block_size": 16}),
                     ("offload", {"kv_block_size": 16, "offload_decode": "uva"})):
        llm = LLM(m, mode=mode, max_model_len=32, **kw)
        good = llm.generate([1, 2, 3], SamplingParams(max_tokens=4))[0].token_ids
        with pytest.raises(ValueError, match="empty"):
            llm.generate([])
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[1, 2], []])
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(list(range(33)))
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([1, 2, 10**6])
        with pytest.raises(TypeError):
            llm.generate([1.5, 2])
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0)
        # a failure inside a request frees its KV; the next request is unaffected
        orig = m.prefill

        def boom(*a, **k):
            raise RuntimeError("injected")

        m.prefill = boom
        try:
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate([1, 2, 3])
        finally:
            m.prefill = orig
        if mode == "offload":
            assert llm.offload.sequences() == []
        assert llm.generate([1, 2, 3], SamplingParams(max_tokens=4))[0].token_ids == good
    with pytest.raises(ValueError, match="mode"):
        LLM(m, mode="disk")


def test_prefill_attn_sdpa_matches_xoffload():
    m = _tiny_random("tiny-qwen3")
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a = LLM(m, max_model_len=128, prefill_chunk=32).generate(ids, sp)[0]
    b = LLM(m, mode="offload", max_model_len=128, prefill_chunk=32, prefill_attn="sdpa", kv_block_size=32).generate(ids, sp)[0]
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="prefill_attn"):
        LLM(m, prefill_attn="flash3")
    with pytest.raises(ValueError, match="cudnn"):  # the model is on the CPU
        LLM(m, prefill_attn="cudnn")



def test_one_request_prompt_over_the_pool_is_refused_naming_kv_cache_tokens():
    """max_num_seqs=1, offload: a prompt whose KV alone exceeds the pinned pool (kv_cache_tokens)
    is refused before any request runs, one line naming the sizes; the LLM keeps serving."""
    llm = LLM("tiny-llama", mode="offload", max_model_len=1024, kv_block_size=256, kv_cache_tokens=256)
    ok = [i % 200 for i in range(100)]
    want = llm.generate(ok)[0].token_ids
    with pytest.raises(ValueError, match=r"prompt 1 needs 768 tokens of KV in the CPU pool .* holds 256 tokens "
                                         r"\(kv_cache_tokens=256\)") as e:
        llm.generate([ok, [i % 200 for i in range(600)]])
    assert "\n" not in str(e.value)
    assert llm.generate(ok)[0].token_ids == want
