"""The batched prefill of a group of sequences (LlamaModel.prefill_batch + the resident stores'
BatchPrefillSink, xoffload.engine.kv_batch_prefill) and the runner's grouping of short admitted
prompts (xoffload.engine.runner).

CPU, fp32 (the kernels' references; tolerances from fp32 rounding): the group's logits and the
K/V it writes into each member's pool rows equal one-at-a-time prefills, for lengths 1, 2, 17,
64, 130, with and without a reused history, a group mixing both, both model archs (Qwen3's q/k
norms) and the per-sequence attention backends; through ``generate``: one document + 8 questions
with prefix caching and plain short prompts without it give each prompt's greedy tokens alone,
the questions prefilled as one group, every prompt registered in the prefix cache and the pool's
blocks all back when the call ends; a member that stops after one token; two new prompts sharing
a block that is not cached yet are not grouped (the second still reuses the first's block).
"""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.engine.request import Request
from xoffload.engine.scheduler import Sequence
from xoffload.kernels import cpu_backend, interpreter_on

from .llm_helpers import tiny_random

BLOCK = 32


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _store(m, prompts, prefix=True):
    """A batched resident store (prefix caching or not) over ``prompts``, each admitted."""
    from xoffload.engine.kv_batch import batch_store_class

    kw = dict(mode="resident", kv_block_size=BLOCK, max_model_len=512, max_num_seqs=len(prompts) + 1)
    llm = LLM(m, prefix_caching=prefix, **kw)
    cls, okw = batch_store_class(llm._store, llm.config)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=512, seed=0, stop_ids=(), device=m.device))
            for i, p in enumerate(prompts)]
    st = cls.open(m, llm.config, None, seqs, **okw)
    for s in seqs:
        st.admit(s)
    return st, seqs


def _rows(st, s):
    t = torch.arange(s.prompt_len)
    tab = torch.tensor(s.kv["table"])
    return tab[t // st.block] * st.block + t % st.block


def _run(m, doc, prompts, batched, backend="auto", cpu="reference"):
    """Prefill ``doc`` alone (registering it), then ``prompts`` one at a time or as one group
    (``cpu``: the kernels' references or their Triton code under the interpreter); returns (logits
    [B, V], per prompt its K and V rows [L, T, Hkv, D], starts, tokens the cache holds of each)."""
    st, seqs = _store(m, [doc] + prompts)
    with torch.no_grad(), cpu_backend(cpu):
        st.prefill_start(seqs[0])
        m.prefill(torch.tensor(doc), st.sink(seqs[0]))
        group = seqs[1:]
        starts = [st.prefill_start(s) for s in group] if batched else None
        if batched:
            sink = st.batch_sink(group)
            assert sink.starts == starts and sink.lens == [s.prompt_len - a for s, a in zip(group, starts)]
            ids = torch.tensor([t for s, a in zip(group, starts) for t in s.req.ids[a:]])
            logits = m.prefill_batch(ids, sink.lens, starts, sink, chunk=48, attn_backend=backend)
        else:
            starts, out = [], []
            for s in group:
                a = st.prefill_start(s)
                starts.append(a)
                out.append(m.prefill(torch.tensor(s.req.ids[a:]), st.sink(s), start=a, chunk=48,
                                     attn_backend=backend))
            logits = torch.cat(out)
        kv = [(st.pool.k[:, _rows(st, s)].clone(), st.pool.v[:, _rows(st, s)].clone()) for s in group]
        registered = [st.cache.peek(s.req.ids) for s in group]
    st.close()
    return logits, kv, starts, registered


def _close(a, b):
    tol = 1e-4 * float(b.abs().max())
    assert float((a - b).abs().max()) <= tol, float((a - b).abs().max())


LENS = [1, 2, 17, 64, 130]


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("history", ["none", "all", "mixed"])
def test_group_equals_one_at_a_time(arch, history):
    """Logits and the K/V written into each member's rows: the group == one prefill each (the
    histories ending inside a block: their copy-on-write in the group too)."""
    m = tiny_random(arch)
    doc = _prompts([75], seed=1)[0]  # 2 full blocks + a partial one
    qs = _prompts(LENS, seed=2)
    heads = {"none": [False] * 5, "all": [True] * 5, "mixed": [True, False, True, False, True]}[history]
    prompts = [(doc[:75 - 9 * i] + q if h else q) for i, (q, h) in enumerate(zip(qs, heads))]
    want, kv_want, starts_want, reg_want = _run(m, doc, prompts, batched=False)
    got, kv_got, starts, reg = _run(m, doc, prompts, batched=True)
    assert starts == starts_want and [a > 0 for a in starts] == heads
    assert got.shape == (5, m.cfg.vocab_size) and got.dtype == torch.float32
    _close(got, want)
    for (k, v), (kw, vw) in zip(kv_got, kv_want):
        _close(k, kw)
        _close(v, vw)
    assert reg == [len(p) for p in prompts] == reg_want  # every member registered its prompt


@pytest.mark.parametrize("backend", ["sdpa", "xoffload"])
def test_group_with_other_attention_backends(backend):
    m = tiny_random()
    doc = _prompts([64], seed=3)[0]
    qs = _prompts([3, 40, 1], seed=4)
    prompts = [doc + qs[0], qs[1], doc[:50] + qs[2]]
    want, kv_want, _, _ = _run(m, doc, prompts, batched=False, backend=backend)
    got, kv_got, starts, _ = _run(m, doc, prompts, batched=True, backend=backend)
    assert starts == [64, 0, 50]
    _close(got, want)
    for (k, _v), (kw, _vw) in zip(kv_got, kv_want):
        _close(k, kw)


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1 (the tests' default on a CPU)")
def test_group_equals_one_at_a_time_triton_interpreter():
    """The Triton code of the kernels the group runs (RoPE at per-token positions, the varlen
    kernel unchecked, the padded paged history over a block-store view, the varlen-layout merge)
    under the interpreter: the group == one prefill each."""
    m = tiny_random()
    doc = _prompts([40], seed=7)[0]
    qs = _prompts([3, 17, 5], seed=8)
    prompts = [doc + qs[0], qs[1], doc[:36] + qs[2]]
    want, kv_want, _, _ = _run(m, doc, prompts, batched=False, cpu="interpreter")
    got, kv_got, starts, _ = _run(m, doc, prompts, batched=True, cpu="interpreter")
    assert starts == [40, 0, 36]
    _close(got, want)
    for (k, v), (kw, vw) in zip(kv_got, kv_want):
        _close(k, kw)
        _close(v, vw)


def test_group_without_prefix_caching_store():
    """ResidentBatchKV (no prefix cache): no history; scattered block tables."""
    m = tiny_random()
    prompts = _prompts(LENS, seed=5)
    ref = []
    with torch.no_grad(), cpu_backend("reference"):
        st, seqs = _store(m, prompts, prefix=False)
        for s in seqs:
            ref.append(m.prefill(torch.tensor(s.req.ids), st.sink(s)))
        kv_ref = [st.pool.k[:, _rows(st, s)].clone() for s in seqs]
        st.close()
        st, seqs = _store(m, prompts, prefix=False)
        sink = st.batch_sink(seqs)
        assert not hasattr(sink, "history") and sink.starts == [0] * 5
        got = m.prefill_batch(torch.tensor([t for p in prompts for t in p]), sink.lens, sink.starts, sink)
        _close(got, torch.cat(ref))
        for s, kw in zip(seqs, kv_ref):
            _close(st.pool.k[:, _rows(st, s)], kw)
        st.close()


def test_prefill_batch_argument_errors():
    m = tiny_random()
    st, seqs = _store(m, _prompts([4, 5], seed=6), prefix=False)
    sink = st.batch_sink(seqs)
    ids = torch.zeros(9, dtype=torch.int64)
    with pytest.raises(ValueError, match="attn_backend"):
        m.prefill_batch(ids, [4, 5], [0, 0], sink, attn_backend="flash")
    with pytest.raises(ValueError, match="one start per sequence"):
        m.prefill_batch(ids, [4, 5], [0], sink)
    with pytest.raises(ValueError, match="lens >= 1"):
        m.prefill_batch(ids, [9, 0], [0, 0], sink)
    with pytest.raises(ValueError, match=r"ids must be \[sum\(lens\)\] = \[8\]"):
        m.prefill_batch(ids, [4, 4], [0, 0], sink)
    with pytest.raises(ValueError, match="needs a sink with history"):
        m.prefill_batch(ids, [4, 5], [0, 3], sink)
    st.close()
