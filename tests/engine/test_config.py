"""LLM options (xoffload.engine.config.EngineConfig): filled by field name, checked once, with the
value named in the error."""
import pytest
import torch

from xoffload.engine import LLM, EngineConfig, SamplingParams
from xoffload.sparse import DensePrefill, QuestDecode, XAttentionPrefill

from .llm_helpers import tiny_random


def test_llm_option_and_sampling_edges():
    """Found by adversarial testing: out-of-range sparse options are refused at construction; a
    tiny temperature samples (one-hot) instead of failing inside torch.multinomial."""
    with pytest.raises(ValueError, match="threshold"):
        LLM("tiny-llama", device="cpu", sparse=XAttentionPrefill(threshold=2.0))
    with pytest.raises(ValueError, match="dense_layers"):
        LLM("tiny-llama", device="cpu", sparse=XAttentionPrefill(dense_layers=(99,)))
    from xoffload.sparse import QuestDecode

    with pytest.raises(ValueError, match="exact_channels=16 must be below the model's head_dim 16"):
        LLM("tiny-llama", device="cpu", sparse_decode=QuestDecode(exact_channels=16))
    # the named policy fits its channels to the model (head_dim 16: 8 channels), in both modes
    for mode in ("gpu", "offload"):
        llm = LLM("tiny-llama", device="cpu", mode=mode, max_model_len=512, sparse_decode="quest-ch", token_budget=64)
        assert llm.config.decode_policy == QuestDecode(token_budget=64, exact_channels=8, bound_scale=0.25,
                                                       fit_channels=True)
        assert len(llm.generate([list(range(200))], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
    llm = LLM("tiny-llama", device="cpu")
    greedy = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids
    tiny = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=1e-45, max_tokens=4))[0].token_ids
    assert tiny == greedy


def test_from_kwargs_by_field_name():
    c = EngineConfig.from_kwargs(mode="gpu", max_model_len=64, sparse="xattn", seed=3)
    assert c.mode == "resident" and c.max_model_len == 64 and c.seed == 3
    assert isinstance(c.sparse, XAttentionPrefill) and c.policy is c.sparse
    assert isinstance(EngineConfig().sparse, DensePrefill)
    with pytest.raises(TypeError, match="'bogus_option'"):
        EngineConfig.from_kwargs(bogus_option=1)
    # the removed sparse keyword arguments say what replaces them
    for k in ("sparse_threshold", "sparse_stride", "sparse_block_size", "sparse_kwargs", "dense_layers"):
        with pytest.raises(TypeError, match=f"{k}.*XAttentionPrefill"):
            LLM(tiny_random(), **{k: 1})


@pytest.mark.parametrize("kw, err, match", [
    (dict(max_model_len=0), ValueError, "max_model_len.*0"),
    (dict(max_model_len=True), ValueError, "max_model_len"),
    (dict(prefill_chunk=0), ValueError, "prefill_chunk.*0"),
    (dict(prefill_attn="flash3"), ValueError, "prefill_attn.*flash3"),
    (dict(cuda_graph="yes"), TypeError, "cuda_graph.*yes"),
    (dict(mode="disk"), ValueError, "mode.*disk"),
    (dict(sparse="bogus"), ValueError, "sparse.*bogus"),
    (dict(sparse=0.5), TypeError, "sparse.*0.5"),
    (dict(num_kv_buffers=4), TypeError, "num_kv_buffers.*was removed"),
    (dict(mode="offload", offload_decode="ring"), ValueError, "offload_decode='ring' is not offered"),
    (dict(kv_block_size="big"), TypeError, "kv_block_size"),
])
def test_bad_options_name_the_value(kw, err, match):
    with pytest.raises(err, match=match):
        EngineConfig.from_kwargs(**kw)


def test_bind_fills_model_defaults():
    m = tiny_random()
    c = EngineConfig().bind(m)
    assert c.max_model_len == m.cfg.max_position_embeddings and c.prefill_chunk == 512
    assert c.dtype == m.dtype and c.device == m.device
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype=torch.float16).bind(m)
    with pytest.raises(ValueError, match="cudnn"):
        EngineConfig(prefill_attn="cudnn").bind(m)


def test_kv_cache_tokens_below_one_block_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_tokens=512 holds less than one KV block \(kv_block_size=1024\)"):
        EngineConfig.from_kwargs(max_num_seqs=4, kv_cache_tokens=512)
    assert EngineConfig.from_kwargs(max_num_seqs=4, kv_cache_tokens=1024).kv_cache_tokens == 1024


def test_removed_decode_variants_are_refused_at_construction():
    """A bound below 1 without exact channels has nothing to weigh it against: refused when the
    policy is made, naming the value; the removed next-layer prefetch is an unknown field."""
    with pytest.raises(ValueError, match="bound_scale=0.5 .*needs exact_channels > 0"):
        QuestDecode(bound_scale=0.5)
    with pytest.raises(TypeError, match="prefetch"):
        QuestDecode(prefetch=True)
    assert QuestDecode(bound_scale=0.5, exact_channels=4).bound_scale == 0.5
