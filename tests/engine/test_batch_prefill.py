"""The batched prefill of a group of sequences (LlamaModel.prefill_batch + the resident stores'
BatchPrefillSink, xoffload.kv.batch_prefill) and the runner's grouping of short admitted
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


def _store(m, prompts, prefix=True, block=BLOCK):
    """A batched resident store (prefix caching or not) over ``prompts``, each admitted."""
    from xoffload.kv.table import batch_store_class

    n = max(map(len, prompts)) + 8
    kw = dict(mode="resident", kv_block_size=block, max_model_len=max(512, n), max_num_seqs=len(prompts) + 1)
    llm = LLM(m, prefix_caching=prefix, **kw)
    cls, okw = batch_store_class(llm.config)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=max(512, n), seed=0, stop_ids=(), device=m.device))
            for i, p in enumerate(prompts)]
    st = cls.open(m, llm.config, None, seqs, **okw)
    for s in seqs:
        st.admit(s)
    return st, seqs


def _rows(st, s):
    t = torch.arange(s.prompt_len)
    tab = torch.tensor(s.kv["table"])
    return tab[t // st.block] * st.block + t % st.block


def _run(m, doc, prompts, batched, backend="auto", cpu="reference", block=BLOCK):
    """Prefill ``doc`` alone (registering it), then ``prompts`` one at a time or as one group
    (``cpu``: the kernels' references or their Triton code under the interpreter); returns (logits
    [B, V], per prompt its K and V rows [L, T, Hkv, D], starts, tokens the cache holds of each)."""
    st, seqs = _store(m, [doc] + prompts, block=block)
    with torch.no_grad(), cpu_backend(cpu):
        dev = m.device
        st.prefill_start(seqs[0])
        m.prefill(torch.tensor(doc, device=dev), st.sink(seqs[0]))
        group = seqs[1:]
        starts = [st.prefill_start(s) for s in group] if batched else None
        if batched:
            sink = st.batch_sink(group)
            assert sink.starts == starts and sink.lens == [s.prompt_len - a for s, a in zip(group, starts)]
            ids = torch.tensor([t for s, a in zip(group, starts) for t in s.req.ids[a:]], device=dev)
            logits = m.prefill_batch(ids, sink.lens, starts, sink, chunk=48, attn_backend=backend)
        else:
            starts, out = [], []
            for s in group:
                a = st.prefill_start(s)
                starts.append(a)
                out.append(m.prefill(torch.tensor(s.req.ids[a:], device=dev), st.sink(s), start=a, chunk=48,
                                     attn_backend=backend))
            logits = torch.cat(out)
        kv = [(st.pool.k[:, _rows(st, s)].clone(), st.pool.v[:, _rows(st, s)].clone()) for s in group]
        registered = [st.cache.peek(s.req.ids) for s in group]
    st.close()
    return logits, kv, starts, registered


def _close(a, b, rel=1e-4):
    tol = rel * float(b.abs().max())
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


@pytest.mark.parametrize("lens", [[17] * 4, [20, 31, 17, 25]])
def test_history_launches_one_per_length_class(lens, monkeypatch):
    """Questions of one power-of-two length class over histories of different lengths: one
    history launch per layer (equal lengths: on q itself, no padding copy); lengths across
    classes: one launch per class. Each equals one prefill per question."""
    from xoffload.kv import batch_prefill as kbp

    calls = []
    orig = kbp.paged_decode_attn_with_lse
    monkeypatch.setattr(kbp, "paged_decode_attn_with_lse", lambda q, *a, **k: calls.append(tuple(q.shape)) or
                        orig(q, *a, **k))
    m = tiny_random()
    doc = _prompts([75], seed=9)[0]
    prompts = [doc[:75 - 11 * i] + q for i, q in enumerate(_prompts(lens, seed=10))]
    want, kv_want, _, _ = _run(m, doc, prompts, batched=False)
    got, kv_got, starts, _ = _run(m, doc, prompts, batched=True)
    assert starts == [75, 64, 53, 42]
    assert calls == [(4, max(lens), 4, 16)] * m.cfg.num_layers
    _close(got, want)
    for (k, v), (kw, vw) in zip(kv_got, kv_want):
        _close(k, kw)
        _close(v, vw)
    calls.clear()
    mixed = [prompts[0], doc[:40] + _prompts([3], seed=11)[0], prompts[2]]
    _run(m, doc, mixed, batched=True)
    assert sorted(calls[:2]) == sorted([(2, max(lens[0], lens[2]), 4, 16), (1, 3, 4, 16)])


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


# ------------------------------------------------------------------ through generate
SP = SamplingParams(max_tokens=6, ignore_eos=True)


def _alone(m, prompts, sps, max_model_len=1024):
    llm = LLM(m, mode="resident", max_model_len=max_model_len)
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    return [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, sps)]


def _spy(monkeypatch, prompts):
    """Record, when each ResidentPrefixBatchKV closes: the tokens its cache holds of each prompt,
    the blocks sequences still hold, and the free blocks once the cache is emptied."""
    from xoffload.kv import resident_prefix as kp

    seen = []
    orig = kp.ResidentPrefixBatchKV.close

    def close(self):
        alloc = self.pool.alloc
        alloc.check()
        rec = {"cached": [self.cache.peek(p) for p in prompts], "seq_held": alloc.usage()["seq_held"]}
        self.cache.clear()
        rec["free"], rec["blocks"] = alloc.num_free, self.pool.num_blocks
        seen.append(rec)
        orig(self)

    monkeypatch.setattr(kp.ResidentPrefixBatchKV, "close", close)
    return seen


def _groups(llm):
    return [x["group"] for x in llm.batch_stats["prefills"]]


def test_document_and_eight_questions_in_groups_equal_alone(monkeypatch):
    """One 300-token document + 8 questions, prefix caching, max_num_seqs=8: the first prompt
    is prefilled alone (the second shares its uncached blocks, so it waits for them), the others
    in groups over the document's blocks; greedy tokens equal each prompt alone, every prompt is
    registered and every block is back when the call ends."""
    m = tiny_random()
    doc = _prompts([300], seed=10)[0]
    prompts = [doc + q for q in _prompts([20 + i for i in range(8)], seed=11)]
    seen = _spy(monkeypatch, prompts)
    want = _alone(m, prompts, SP)
    llm = LLM(m, mode="resident", kv_block_size=BLOCK, max_model_len=1024, max_num_seqs=8, prefix_caching=True)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    reused = [o.timings.get("prefix_reused_tokens", 0) for o in outs]
    assert reused[0] == 0 and all(r == 300 for r in reused[1:]), reused
    st = llm.batch_stats
    g = _groups(llm)
    assert g[0] == 1 and all(x > 1 for x in g[1:]) and len(st["prefill_groups"]) < 8, g
    assert sum(x["seqs"] for x in st["prefill_groups"]) == 8
    assert st["prefill_tokens"] == sum(len(p) for p in prompts) - sum(reused)
    assert st["prefill_ms"] == pytest.approx(sum(x["ms"] for x in st["prefill_groups"]))
    assert seen[-1]["cached"] == [len(p) for p in prompts]  # every prompt registered
    assert seen[-1]["seq_held"] == 0 and seen[-1]["free"] == seen[-1]["blocks"]


def test_bench_shape_long_document_then_seven_questions_as_one_group(monkeypatch):
    """The benchmark's shape: a document longer than GROUP_PREFILL_MAX_TOKENS is prefilled alone
    (and registered), then the 7 other prompts, admitted together, are one group of 7."""
    from xoffload.engine import runner

    monkeypatch.setattr(runner, "GROUP_PREFILL_MAX_TOKENS", 64)
    m = tiny_random()
    doc = _prompts([200], seed=12)[0]
    prompts = [doc + q for q in _prompts([16] * 8, seed=13)]
    want = _alone(m, prompts, SP)
    # the budget admits the document's prompt alone first (as the benchmark's 32K document)
    llm = LLM(m, mode="resident", kv_block_size=BLOCK, max_model_len=512, max_num_seqs=8, prefix_caching=True,
              max_num_batched_tokens=256)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    assert _groups(llm) == [1] + [7] * 7
    assert [x["seqs"] for x in llm.batch_stats["prefill_groups"]] == [1, 7]
    assert [o.timings.get("prefix_reused_tokens", 0) for o in outs] == [0] + [200] * 7


def test_plain_resident_short_prompts_grouped_equal_alone():
    """No prefix cache (ResidentBatchKV): short prompts of different lengths admitted together
    are one group; each gives its tokens alone, with per-sequence sampling."""
    m = tiny_random()
    prompts = _prompts([1, 2, 17, 64, 130, 33], seed=14)
    sps = [SP, SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True), SP,
           SamplingParams(max_tokens=7, temperature=1.1, top_p=0.9, seed=4, ignore_eos=True), SP, SP]
    want = _alone(m, prompts, sps, 256)
    llm = LLM(m, mode="resident", kv_block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=1024)
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == want
    assert _groups(llm) == [6] * 6


def test_group_member_that_stops_after_one_token():
    """A member whose first token is a stop id (or whose max_tokens is 1) leaves after the group's
    prefill; the others go on with their tokens alone."""
    m = tiny_random()
    prompts = _prompts([9, 30, 12, 21], seed=15)
    first = _alone(m, [prompts[1]], SP, 128)[0][0]
    sps = [SP, SamplingParams(max_tokens=6, stop_token_ids=(first,)), SamplingParams(max_tokens=1), SP]
    want = _alone(m, prompts, sps, 128)
    llm = LLM(m, mode="resident", kv_block_size=16, max_model_len=128, max_num_seqs=4)
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == want
    assert outs[1].token_ids == [first] and outs[1].finish_reason == "stop" and len(outs[2].token_ids) == 1
    assert _groups(llm) == [4] * 4
    assert [x["seqs"] for x in llm.batch_stats["decode_steps"]][0] == 2


def test_two_new_prompts_sharing_an_uncached_block_are_not_grouped(monkeypatch):
    """Two short prompts admitted together whose common prefix spans a whole block that nobody
    registered yet: the second waits for the first's prefill and reuses that block (a group
    would compute it twice); a third one sharing nothing joins the second."""
    m = tiny_random()
    a, b, c, d = _prompts([40, 10, 12, 50], seed=16)
    prompts = [a + b, a + c, d]
    seen = _spy(monkeypatch, prompts)
    want = _alone(m, prompts, SP, 256)
    llm = LLM(m, mode="resident", kv_block_size=BLOCK, max_model_len=256, max_num_seqs=4, prefix_caching=True,
              max_num_batched_tokens=512)
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == want
    assert [o.timings.get("prefix_reused_tokens", 0) for o in outs] == [0, 40, 0]
    assert _groups(llm) == [1, 2, 2]
    assert seen[-1]["cached"] == [len(p) for p in prompts] and seen[-1]["free"] == seen[-1]["blocks"]


def test_group_member_whose_cached_prefix_an_earlier_member_evicts(monkeypatch):
    """The group is counted against the cache before its blocks are taken: a member's allocation
    (a fresh prompt, the pool short) evicts the cached document a later member counted on, which
    then has more to prefill. The group keeps to max_num_batched_tokens (and
    GROUP_PREFILL_MAX_TOKENS): that member is prefilled by itself; tokens equal alone."""
    from xoffload.engine import runner
    from xoffload.models.llama import LlamaModel

    monkeypatch.setattr(runner, "GROUP_PREFILL_MAX_TOKENS", 40)
    calls = []
    orig = LlamaModel.prefill_batch

    def prefill_batch(self, ids, lens, starts, sink, **kw):
        calls.append(list(lens))
        return orig(self, ids, lens, starts, sink, **kw)

    monkeypatch.setattr(LlamaModel, "prefill_batch", prefill_batch)
    m = tiny_random()
    doc, a, other, fresh, b = _prompts([64, 4, 64, 38, 4], seed=50)
    prompts = [doc + a, other, fresh, doc + b]
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    want = _alone(m, prompts, sp, 256)
    llm = LLM(m, mode="resident", kv_block_size=16, max_model_len=256, max_num_seqs=2, prefix_caching=True,
              max_num_batched_tokens=48, kv_cache_tokens=160)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == want
    reused = [o.timings.get("prefix_reused_tokens", 0) for o in outs]
    assert 0 < reused[3] < 64, reused  # the eviction happened: part of the document is gone
    for lens in calls:  # (was one group of [38, 20]: 58 tokens past the budget of 48)
        assert sum(lens) <= 48 and max(lens) <= 40, calls
    assert sum(x["seqs"] for x in llm.batch_stats["prefill_groups"]) == 4


# ------------------------------------------------------------------ GPU (marked)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_group_tracks_one_at_a_time_bf16():
    """bf16, random Llama-3.2-1B, a 3000-token document: questions of 1, 2, 17, 64, 130 tokens
    over it and two prompts without history as one group: logits and K/V within bf16 rounding of
    one prefill each (other GEMM shapes, the varlen kernel, the split-KV history for 130 rows where
    the one-sequence sink uses the prefill kernel: one bf16 eps of the scale per layer)."""
    from xoffload.models import random_model

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    doc = _prompts([3000], seed=20, vocab=m.cfg.vocab_size)[0]
    qs = _prompts(LENS + [40, 90], seed=21, vocab=m.cfg.vocab_size)
    prompts = [doc + q for q in qs[:5]] + qs[5:]
    want, kv_want, _, _ = _run(m, doc, prompts, batched=False, block=256)
    got, kv_got, starts, reg = _run(m, doc, prompts, batched=True, block=256)
    assert starts == [3000] * 5 + [0, 0] and reg == [len(p) for p in prompts]
    rel = m.cfg.num_layers * torch.finfo(torch.bfloat16).eps
    _close(got, want, rel)
    for (k, v), (kw, vw) in zip(kv_got, kv_want):
        _close(k.float(), kw.float(), rel)
        _close(v.float(), vw.float(), rel)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_document_and_questions_group_graphs_equal_eager():
    """bf16 on the GPU: a 3000-token document + 8 questions with prefix caching: the document alone,
    the 7 others one group; the CUDA-graph run gives the eager run's tokens."""
    from xoffload.models import random_model

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    doc = _prompts([3000], seed=22, vocab=m.cfg.vocab_size)[0]
    prompts = [doc + q for q in _prompts([64] * 8, seed=23, vocab=m.cfg.vocab_size)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(mode="resident", kv_block_size=256, max_model_len=4096, max_num_seqs=8, prefix_caching=True)
    graph = LLM(m, **kw)
    a = graph.generate(prompts, sp)
    assert _groups(graph) == [1] + [7] * 7
    assert all(o.timings.get("prefix_reused_tokens", 0) == 3000 for o in a[1:])
    assert [o.token_ids for o in a] == [o.token_ids for o in LLM(m, cuda_graph=False, **kw).generate(prompts, sp)]
