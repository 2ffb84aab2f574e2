"""OffloadBatchKV (xoffload/kv/offload.py): offload_decode="direct" copies each layer's prompt blocks
into GPU staging buffers one layer ahead (kv/staging.LayerStaging), "uva" reads them in place; direct
falls back to in place when the buffers do not fit. CPU (fp32): greedy tokens staged == in place ==
resident dense for max_num_seqs 1 (bucket (1,), routed to OffloadBatchKV) and 3 with prompts of
different lengths; teacher-forced logits staged == in place with the staging buffers full of NaN
(padding rows and pages past a row's blocks are never read); the H2D figures. GPU (marked): the
same in bf16 within rounding, CUDA graphs against eager."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kv import OffloadBatchKV
from xoffload.models import random_model
from xoffload.models.config import get_preset

from engine.llm_helpers import tiny_random

BLOCK = 16  # pool block (tokens): prompts below span 1 to 6 blocks, most with a partly filled last one


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _generate(m, prompts, sps, **kw):
    llm = LLM(m, **kw)
    outs = llm.generate(prompts, sps)
    return llm, outs


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_greedy_tokens_staged_equal_in_place_equal_resident(max_num_seqs, monkeypatch):
    """Five prompts (1 to 90 tokens) through ``max_num_seqs`` places, each with its own token
    count (batches shrink and grow: buckets 3, 2, 1): offload direct (staged) == offload uva (in
    place) == resident dense one at a time, token for token; the H2D figure of a staged sequence is
    its whole blocks, in place its tokens."""
    m = tiny_random()
    prompts = _prompts([33, 1, 90, 16, 47], seed=11)
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 3, 9, 5, 6)]
    ref = [LLM(m, mode="gpu", max_model_len=128).generate(p, sp)[0].token_ids for p, sp in zip(prompts, sps)]
    kv_tok = m.cfg.kv_bytes_per_token(m.dtype)
    for decode, read in (("direct", "staged"), ("uva", "in place")):
        llm, outs = _generate(m, prompts, sps, mode="offload", offload_decode=decode, max_model_len=128,
                              kv_block_size=BLOCK, max_num_seqs=max_num_seqs)
        assert [o.token_ids for o in outs] == ref, decode
        info = llm.batch_stats["store"]
        assert info["store"] == "OffloadBatchKV" and info["prompt_read"] == read and not info["staging_limited"]
        assert llm.batch_stats["max_running"] == max_num_seqs
        for p, o in zip(prompts, outs):
            n = -(-len(p) // BLOCK) * BLOCK if read == "staged" else len(p)
            assert o.timings["h2d_bytes_per_token"] == n * kv_tok, (decode, len(p))
        assert llm.offload.sequences() == []


def test_direct_falls_back_to_in_place_when_staging_does_not_fit(monkeypatch):
    """With no GPU memory left for the staging buffers, direct decode reads in place and says so
    in describe(); the tokens are the in-place ones."""
    import xoffload.kv.offload as offload_mod

    m = tiny_random()
    prompts = _prompts([40, 70, 9], seed=12)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(mode="offload", max_model_len=128, kv_block_size=BLOCK, max_num_seqs=2)
    _, uva = _generate(m, prompts, sp, offload_decode="uva", **kw)
    monkeypatch.setattr(offload_mod, "_pool_memory_limit", lambda *a, **k: 1024)
    llm, outs = _generate(m, prompts, sp, offload_decode="direct", **kw)
    info = llm.batch_stats["store"]
    assert info["prompt_read"] == "in place" and info["staging_limited"] and info["staging_bytes"] > 1024
    assert [o.token_ids for o in outs] == [o.token_ids for o in uva]
    assert outs[1].timings["h2d_bytes_per_token"] == 70 * m.cfg.kv_bytes_per_token(m.dtype)


# ------------------------------------------------------------------- the store, teacher forced
def _store_logits(m, prompts, toks, n_steps, decode, max_num_seqs, poison=False, block=BLOCK):
    """Per prompt, fp32 logits ``[n_steps, V]`` of decode steps fed ``toks[b][i]`` at step i, the
    prompts decoded ``max_num_seqs`` at a time by an :class:`OffloadBatchKV` (a group of fewer rows
    than its bucket has padding rows, whose logits must stay finite). ``poison``: the staging buffers
    are filled with NaN before the steps."""
    from xoffload.engine.request import Request
    from xoffload.engine.scheduler import Sequence
    from xoffload.kernels import cpu_backend

    L = max(map(len, prompts)) + n_steps + 8
    llm = LLM(m, mode="offload", offload_decode=decode, kv_block_size=block, max_model_len=L,
              max_num_seqs=max_num_seqs)
    sp = SamplingParams(max_tokens=n_steps + 1, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=L, seed=0, stop_ids=(), device=m.device))
            for i, p in enumerate(prompts)]
    st = OffloadBatchKV.open(m, llm.config, llm.offload, seqs)
    assert st.buckets[-1] == max_num_seqs and st.staged == (decode == "direct")
    m.rope_tables(st.max_len + 1)
    out = [[] for _ in prompts]
    with torch.no_grad(), cpu_backend("reference"):
        for g0 in range(0, len(seqs), max_num_seqs):
            group = seqs[g0:g0 + max_num_seqs]
            for s in group:
                st.admit(s)
                m.prefill(torch.tensor(s.req.ids, device=m.device), st.sink(s))
                s.n_out = 1
            rows = st.set_batch(group)
            if poison and st.staged:
                for t in st.stager.k + st.stager.v:
                    t.fill_(float("nan"))
            tok = torch.zeros(rows, dtype=torch.int64, device=m.device)
            for i in range(n_steps):
                tok[:len(group)] = torch.tensor([toks[s.index][i] for s in group], device=m.device)
                st.begin_step()
                lg = m.decode_step(tok, st.pos[:rows], st)
                st.end_step()
                st.advance()
                assert bool(torch.isfinite(lg).all()), (decode, rows, i)  # padding rows too
                for b, s in enumerate(group):
                    out[s.index].append(lg[b].float().clone())
            for s in group:
                st.release(s)
    st.close()
    llm.close()
    return [torch.stack(o) for o in out]


def _deep_tiny():
    """The engine tests' tiny random Llama with 5 layers: staging buffer reuse (layer l + 2 into
    layer l's buffer) happens from layer 2 on."""
    return random_model(get_preset("tiny-llama").replace(num_layers=5), dtype=torch.float32, device="cpu", seed=1,
                        std=0.15)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_teacher_forced_staged_equals_in_place_with_nan_staging(max_num_seqs):
    """Fed the resident run's greedy tokens, staged logits equal in-place logits at every step
    (fp32 rounding), though every staged block the step does not copy holds NaN: the 4-row bucket
    has a padding row, and rows of 1 or 2 blocks sit beside one of 6."""
    m = _deep_tiny()
    prompts = _prompts([90, 1, 17], seed=13)
    n = 5
    sp = SamplingParams(max_tokens=n + 1, ignore_eos=True)
    toks = [LLM(m, mode="gpu", max_model_len=128).generate(p, sp)[0].token_ids for p in prompts]
    a = _store_logits(m, prompts, toks, n, "direct", max_num_seqs, poison=True)
    b = _store_logits(m, prompts, toks, n, "uva", max_num_seqs)
    for x, y in zip(a, b):
        assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max())


# ------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_gpu_staged_tracks_in_place_and_graphs_equal_eager(max_num_seqs, monkeypatch):
    """bf16, random Llama-3.2-1B, prompts of 1, 1023, 1025 and 3000 tokens in pool blocks of 256:
    (1) for direct (staged) and uva (in place), the CUDA-graph steps give the eager steps' tokens
    exactly; (2) fed the same tokens, staged and in-place logits stay within bf16 rounding (one
    eps of the logit scale per layer; the two read the same pages through different tables)."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    prompts = _prompts([1, 1023, 1025, 3000], vocab=m.cfg.vocab_size)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(mode="offload", kv_block_size=256, max_model_len=3100, max_num_seqs=max_num_seqs)
    toks = {}
    for decode, read in (("direct", "staged"), ("uva", "in place")):
        llm, outs = _generate(m, prompts, sp, offload_decode=decode, **kw)
        assert llm.batch_stats["store"]["prompt_read"] == read and llm.batch_stats["graph_buckets"]
        _, eager = _generate(m, prompts, sp, offload_decode=decode, cuda_graph=False, **kw)
        toks[decode] = [o.token_ids for o in outs]
        assert toks[decode] == [o.token_ids for o in eager], decode
    feed = toks["uva"]  # step i feeds each row's i-th generated token
    a = _store_logits(m, prompts, feed, 8, "direct", max_num_seqs, poison=True, block=256)
    b = _store_logits(m, prompts, feed, 8, "uva", max_num_seqs, block=256)
    eps = torch.finfo(torch.bfloat16).eps
    for x, y in zip(a, b):
        assert float((x - y).abs().max()) <= m.cfg.num_layers * eps * float(y.abs().max())


@pytest.mark.cuda
def test_gpu_staging_copies_delayed_on_their_stream(monkeypatch):
    """Copies on one stream, their readers on another: with each layer's gather delayed ~2 ms on
    the copy stream (in the graphs too), the staged tokens do not change."""
    import xoffload.kv.staging as staging

    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    prompts = _prompts([700, 2100, 40], seed=14, vocab=m.cfg.vocab_size)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(mode="offload", offload_decode="direct", kv_block_size=256, max_model_len=2200, max_num_seqs=2)
    want = [o.token_ids for o in _generate(m, prompts, sp, **kw)[1]]
    real = staging.gather_blocks

    def slow(*a, **k):
        torch.cuda._sleep(2_000_000)
        return real(*a, **k)

    monkeypatch.setattr(staging, "gather_blocks", slow)
    for graphs in (True, False):
        assert [o.token_ids for o in _generate(m, prompts, sp, cuda_graph=graphs, **kw)[1]] == want, graphs


def _pool_sequence(n_tokens, device, dtype):
    """An offload runtime holding one sequence of ``n_tokens`` tokens of random K/V in 3 layers."""
    from xoffload.runtime import OffloadRuntime

    eng = OffloadRuntime(num_layers=3, num_kv_heads=2, head_dim=16, max_tokens=1024, block_size=BLOCK,
                         num_blocks=64, dtype=dtype, device=device)
    sid = eng.add_sequence()
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(n_tokens, 2, 16, generator=g).to(device, dtype),
           torch.randn(n_tokens, 2, 16, generator=g).to(device, dtype)) for _ in range(3)]
    for layer, (k, v) in enumerate(kv):
        eng.offload_layer(sid, layer, k, v)
    return eng, sid, kv


def test_prefix_reader_reads_each_layer_once_and_one_ahead():
    """Layers asked in order are handed from the read started at the layer before (two of three),
    equal to the sequence's K/V; a layer asked out of order is read at once."""
    from xoffload.kv.staging import PrefixReader

    eng, sid, kv = _pool_sequence(37, "cpu", torch.float32)
    r = PrefixReader(eng, sid, 37, 3)
    for layer in range(3):
        k, v = r.get(layer)
        assert torch.equal(k, kv[layer][0]) and torch.equal(v, kv[layer][1])
    assert r.reads_ahead == 2
    r2 = PrefixReader(eng, sid, 20, 3)
    k, v = r2.get(1)  # not the layer read ahead (none): read now
    assert torch.equal(k, kv[1][0][:20]) and r2.reads_ahead == 0
    k, v = r2.get(2)
    assert torch.equal(v, kv[2][1][:20]) and r2.reads_ahead == 1
    with pytest.raises(ValueError):
        PrefixReader(eng, sid, 0, 3)


@pytest.mark.cuda
def test_gpu_prefix_reader_delayed_reads_on_their_stream(monkeypatch):
    """Reads on a copy stream, their readers on the current one: with every read delayed ~2 ms on
    the copy stream, each layer's prefix as the current stream sees it is the sequence's K/V."""
    import xoffload.kv.staging as staging

    eng, sid, kv = _pool_sequence(300, "cuda", torch.float16)
    real = eng.fetch_blocks

    def slow(*a, **k):
        torch.cuda._sleep(2_000_000)
        return real(*a, **k)

    monkeypatch.setattr(eng, "fetch_blocks", slow)
    r = staging.PrefixReader(eng, sid, 300, 3)
    got = []
    for layer in range(3):
        k, v = r.get(layer)
        got.append((k.clone(), v.clone()))
    torch.cuda.synchronize()
    assert r.reads_ahead == 2
    for (k, v), (k0, v0) in zip(got, kv):
        assert torch.equal(k, k0) and torch.equal(v, v0)
