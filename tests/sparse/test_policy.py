"""Prefill policies (xoffload.sparse.policy): names resolve to objects once, bad specs name the value,
the policy object is what reaches LlamaModel.prefill (and its options reach xattention_prefill),
and which layers it applies to."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.models.loader import random_model
from xoffload.sparse import (DEFAULT_DENSE_LAYERS, DecodePolicy, DensePrefill, PrefillPolicy, XAttentionPrefill,
                             resolve_prefill)


def _tiny():
    return random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=1, std=0.15)


def test_resolve_prefill():
    assert resolve_prefill(None) == DensePrefill() and resolve_prefill("dense") == DensePrefill()
    assert resolve_prefill("xattn") == XAttentionPrefill()
    pol = XAttentionPrefill(threshold=0.5)
    assert resolve_prefill(pol) is pol
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_prefill("bogus")
    with pytest.raises(TypeError, match="function"):
        resolve_prefill(lambda q, k, v: None)
    with pytest.raises(ValueError, match="sparse"):
        LLM(_tiny(), sparse="bogus")


@pytest.mark.parametrize("kw, err, match", [
    (dict(threshold=1.5), ValueError, "threshold.*1.5"),
    (dict(threshold="0.9"), TypeError, "threshold"),
    (dict(stride=3, block_size=16), ValueError, "stride.*3"),
    (dict(block_size=100), ValueError, "block_size.*100"),
    (dict(dense_fallback_len=-1), ValueError, "dense_fallback_len"),
    (dict(keep_last=-2), ValueError, "keep_last"),
    (dict(dense_last_q=-1), ValueError, "dense_last_q"),
    (dict(dense_last_q=1.5), TypeError, "dense_last_q"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(dense_layers=["a"]), TypeError, "dense_layers"),
    (dict(causal=1), TypeError, "causal"),
])
def test_bad_options_name_the_value(kw, err, match):
    with pytest.raises(err, match=match):
        XAttentionPrefill(**kw)


def test_layers():
    assert DensePrefill().layers(30) == ()
    assert XAttentionPrefill().layers(30) == tuple(range(DEFAULT_DENSE_LAYERS, 30))
    assert XAttentionPrefill().layers(3) == ()  # a smaller model: all dense
    assert XAttentionPrefill(dense_layers=[0, -1]).layers(5) == (1, 2, 3)
    assert XAttentionPrefill(dense_layers=()).layers(4) == (0, 1, 2, 3)
    assert XAttentionPrefill(dense_layers=[1]).dense_layers == (1,)  # stored as a tuple (hashable)
    with pytest.raises(ValueError, match=r"dense_layers \[7\]"):
        XAttentionPrefill(dense_layers=[7]).layers(5)
    with pytest.raises(NotImplementedError):
        PrefillPolicy()(None, None, None)
    with pytest.raises(NotImplementedError, match="plan"):
        DecodePolicy().plan(10)


def test_llm_resolves_once_and_reports_policy():
    m = _tiny()
    llm = LLM(m, sparse="xattn", max_model_len=64)
    assert isinstance(llm.policy, XAttentionPrefill) and llm.sparse_layers == XAttentionPrefill().layers(m.cfg.num_layers)
    pol = XAttentionPrefill(dense_layers=[0], block_size=16, stride=4)
    llm = LLM(m, sparse=pol, max_model_len=64)
    assert llm.policy is pol and llm.sparse_layers == tuple(range(1, m.cfg.num_layers))
    assert isinstance(LLM(m, max_model_len=64).policy, DensePrefill)


def test_policy_object_reaches_model_prefill(monkeypatch):
    """The LLM hands its policy object itself to LlamaModel.prefill, which calls it with
    (q, k, v) on exactly policy.layers(num_layers) and records its density."""
    m = _tiny()
    seen, calls = [], []

    class Spy(PrefillPolicy):
        def __call__(self, q, k, v, *, softmax_scale=None):
            calls.append(tuple(q.shape))
            return DensePrefill()(q, k, v)

        def layers(self, num_layers):
            return (1,)

    pol = Spy()
    orig = m.prefill

    def spy_prefill(ids, sink, **kw):
        seen.append(kw["policy"])
        return orig(ids, sink, **kw)

    monkeypatch.setattr(m, "prefill", spy_prefill)
    ids = list(range(3, 40))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    o = LLM(m, sparse=pol, max_model_len=64).generate(ids, sp)[0]
    assert seen == [pol] and calls == [(1, len(ids), m.cfg.num_heads, m.cfg.head_dim)]
    assert o.timings["density"][1] == 1.0 and o.timings["density"][0] is None
    monkeypatch.undo()
    assert o.token_ids == LLM(m, max_model_len=64).generate(ids, sp)[0].token_ids


def test_llm_policy_options_reach_xattention():
    """XAttentionPrefill(dense_last_q=...) given to LLM reaches xattention_prefill (density per
    layer changes); a bad option is refused when the policy is built."""
    m = _tiny()
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    dens = {}
    for n in (0, 64, 300):
        pol = XAttentionPrefill(threshold=0.05, block_size=64, dense_layers=[], dense_fallback_len=0, dense_last_q=n)
        o = LLM(m, max_model_len=512, sparse=pol).generate(ids, sp)[0]
        dens[n] = o.timings["mean_density"]
    assert dens[0] < dens[64] < 1.0
    assert abs(dens[300] - 1.0) < 1e-6
    with pytest.raises(ValueError, match="dense_last_q"):
        LLM(m, max_model_len=512, sparse=XAttentionPrefill(dense_layers=[], dense_fallback_len=0,
                                                           dense_last_q=-1)).generate(ids, sp)
