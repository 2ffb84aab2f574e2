"""Batched generation (LLM(max_num_seqs > 1), xoffload.engine.runner / kv_batch): every sequence of a
batch gives the tokens it gives alone (greedy, CPU fp32: token for token, in both modes, so offload
== gpu), with lengths around a KV block boundary, sequences joining mid-batch and finishing after
one token, per-sequence sampling parameters and stop ids, admission refused with the sizes named,
50 requests through 4 slots in submission order, a failed call leaving the LLM serving. GPU tests
(marked) compare against the one-request path within bf16 rounding and CUDA graphs against eager."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.models import random_model
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}  # the same prefill in every run, faster on the CPU than the reference


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _alone(m, prompts, sps, max_model_len, **kw):
    llm = LLM(m, mode="gpu", max_model_len=max_model_len, **kw)
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    return [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, sps)]


def test_lengths_around_a_block_boundary_equal_alone_in_both_modes():
    """Lengths 1, 1023, 1024, 1025, 2100 in one batch (blocks of 1024 / 256): each sequence's
    greedy tokens equal its one-request run; offload == gpu."""
    m = tiny_random()
    prompts = _prompts([1, 1023, 1024, 1025, 2100])
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = _alone(m, prompts, sp, 2200, **SDPA)
    for mode, kw in (("gpu", {}), ("offload", {"kv_block_size": 256})):
        llm = LLM(m, mode=mode, max_model_len=2200, max_num_seqs=8, max_num_batched_tokens=8192, **SDPA, **kw)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref, mode
        assert [o.prompt_token_ids for o in outs] == prompts
        st = llm.batch_stats
        assert st["max_running"] == 5 and {x["rows"] for x in st["decode_steps"]} == {8}  # 5 rows padded to 8
        if mode == "offload":
            # staged (offload_decode="direct"): whole blocks cross PCIe, 9 blocks of 256 for 2100 tokens
            assert outs[4].timings["h2d_bytes_per_token"] == 9 * 256 * m.cfg.kv_bytes_per_token(m.dtype)
            assert llm.offload.sequences() == []


@pytest.mark.parametrize("mode, kw", [("gpu", {}), ("offload", {"kv_block_size": 32}),
                                      ("gpu", {"token_budget": 64, "kv_block_size": 32}),
                                      ("offload", {"token_budget": 64, "kv_block_size": 32}),
                                      ("offload", {"offload_decode": "uva", "kv_block_size": 16})])
def test_join_mid_batch_finish_after_one_token_every_store(mode, kw):
    """max_num_seqs=2: B finishes after its first token (prefill only), C joins while A decodes,
    D waits for a free place; every store gives each sequence its tokens alone."""
    m = tiny_random()
    prompts = _prompts([40, 25, 70, 9], seed=1)
    sps = [SamplingParams(max_tokens=14, ignore_eos=True), SamplingParams(max_tokens=1),
           SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)]
    ref = _alone(m, prompts, sps, 128, **kw)
    llm = LLM(m, mode=mode, max_model_len=128, max_num_seqs=2, **kw)
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == ref
    assert [len(o.token_ids) for o in outs] == [14, 1, 4, 6] and outs[1].timings["decode_steps"] == 0
    seqs = [x["seqs"] for x in llm.batch_stats["decode_steps"]]
    # A alone for one step (B left at once), then A + C, then A + D, then A alone
    assert seqs[0] == 1 and seqs[1] == 2 and llm.batch_stats["max_running"] == 2 and seqs[-1] == 1
    assert sum(seqs) == 13 + 0 + 3 + 5
    if llm.offload is not None:
        assert llm.offload.sequences() == []


def test_quest_page_cache_in_a_batch():
    """Offload + Quest with its page cache, three sequences through two places: each gives its
    tokens alone (pages selected per sequence), and the cache's figures reach each request's
    timings."""
    m = tiny_random()
    prompts = _prompts([200, 150, 260], seed=9)
    pol = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 3, 6)]
    kw = dict(mode="offload", max_model_len=300, kv_block_size=32, sparse_decode=pol)
    alone = LLM(m, **kw)
    ref = [alone.generate(p, sp)[0] for p, sp in zip(prompts, sps)]
    outs = LLM(m, max_num_seqs=2, **kw).generate(prompts, sps)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o, r in zip(outs, ref):
        assert o.timings["cache_hit_rate"] == r.timings["cache_hit_rate"]
        assert o.timings["h2d_bytes_per_token"] == r.timings["h2d_bytes_per_token"] > 0


def test_per_sequence_sampling_and_stop_ids_do_not_stall_others():
    m = tiny_random()
    prompts = _prompts([30, 31, 32, 33], seed=2)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    first = _alone(m, [prompts[2]], greedy, 128)[0]
    stop = first[3]  # the greedy run of prompt 2 stops on its 4th token (or earlier, if repeated)
    sps = [greedy, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
           SamplingParams(max_tokens=12, stop_token_ids=(stop,)),
           SamplingParams(max_tokens=9, temperature=1.3, seed=6, ignore_eos=True)]
    ref = _alone(m, prompts, sps, 128)
    for mode in ("gpu", "offload"):
        outs = LLM(m, mode=mode, max_model_len=128, kv_block_size=32, max_num_seqs=4).generate(prompts, sps)
        assert [o.token_ids for o in outs] == ref, mode
        assert outs[2].finish_reason == "stop" and outs[2].token_ids[-1] == stop and len(outs[2].token_ids) <= 4
        assert [len(o.token_ids) for o in (outs[0], outs[1], outs[3])] == [12, 12, 9]
    # the one-request path takes the list too
    assert [o.token_ids for o in LLM(m, max_model_len=128).generate(prompts, sps)] == ref
    with pytest.raises(ValueError, match="list of 3, but there are 4 prompts"):
        LLM(m, max_model_len=128, max_num_seqs=2).generate(prompts, sps[:3])
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be SamplingParams"):
        LLM(m, max_model_len=128).generate(prompts[:2], [sps[0], {"max_tokens": 3}])


def test_admission_waits_for_room_and_refuses_a_prompt_that_never_fits():
    m = tiny_random()
    prompts = _prompts([130, 140, 135], seed=3)  # two blocks of 128 each (prompt + 7 new)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = _alone(m, prompts, sp, 512)
    for mode in ("gpu", "offload"):
        # room for one sequence at a time (256 tokens): the others wait, nothing is lost
        llm = LLM(m, mode=mode, max_model_len=512, kv_block_size=128, kv_cache_tokens=256, max_num_seqs=4)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
        assert llm.batch_stats["max_running"] == 1
        too_long = _prompts([300], seed=4)[0]
        with pytest.raises(ValueError, match=r"prompt 1 needs 384 tokens of KV.*holds 256 tokens.*kv_cache_tokens"):
            llm.generate([prompts[0], too_long], sp)
        if mode == "offload":
            assert llm.offload.sequences() == []
        assert [o.token_ids for o in llm.generate(prompts[:2], sp)] == ref[:2]  # still serving


def test_fifty_requests_through_four_places_in_submission_order():
    m = tiny_random()
    g = torch.Generator().manual_seed(5)
    lens = [int(x) for x in torch.randint(1, 40, (50,), generator=g)]
    prompts = _prompts(lens, seed=6)
    sps = [SamplingParams(max_tokens=int(1 + i % 7), ignore_eos=True, temperature=0.9 if i % 5 == 0 else 0.0, seed=i)
           for i in range(50)]
    ref = _alone(m, prompts, sps, 64)
    llm = LLM(m, mode="gpu", max_model_len=64, kv_block_size=16, max_num_seqs=4)
    outs = llm.generate(prompts, sps, use_tqdm=True)
    assert len(outs) == 50 and [o.prompt_token_ids for o in outs] == prompts
    assert [o.token_ids for o in outs] == ref
    assert [len(o.token_ids) for o in outs] == [1 + i % 7 for i in range(50)]
    st = llm.batch_stats
    assert st["max_running"] == 4 and max(x["seqs"] for x in st["decode_steps"]) == 4
    assert st["decode_tokens"] == sum(len(o.token_ids) - 1 for o in outs)


def test_failure_inside_a_batch_frees_everything_and_the_llm_keeps_serving():
    m = tiny_random()
    prompts = _prompts([20, 21, 22], seed=7)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    for mode in ("gpu", "offload"):
        llm = LLM(m, mode=mode, max_model_len=64, kv_block_size=16, max_num_seqs=2)
        good = [o.token_ids for o in llm.generate(prompts, sp)]
        calls = []

        def boom(orig):
            def f(*a, **k):
                calls.append(1)
                if len(calls) == 2:  # the second prefill call (gpu: the first two prompts are one
                    raise RuntimeError("injected")  # group), while a sequence is running
                return orig(*a, **k)
            return f

        m.prefill, m.prefill_batch = boom(m.prefill), boom(m.prefill_batch)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate(prompts, sp)
        finally:
            del m.prefill, m.prefill_batch  # the class's methods again
        if mode == "offload":
            assert llm.offload.sequences() == [] and llm.offload.num_free_blocks == llm.offload.allocator.num_blocks
        assert [o.token_ids for o in llm.generate(prompts, sp)] == good
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[1, 2], []])


def test_batch_options_are_checked():
    m = tiny_random()
    with pytest.raises(ValueError, match="max_num_seqs.*0"):
        LLM(m, max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_tokens.*-1"):
        LLM(m, kv_cache_tokens=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(m, max_num_batched_tokens=0)
    for n in (1, 2):
        with pytest.raises(ValueError, match="kv_block_size must be a power of two.*resident dense decode.*100"):
            LLM(m, max_num_seqs=n, kv_block_size=100)
    assert LLM(m, max_model_len=64).config.max_num_batched_tokens == 64  # the default: max_model_len


def test_one_request_is_a_batch_of_one():
    """max_num_seqs=1: the batched store of the mode serves the request with one bucket, (1,) (one
    CUDA graph per bucket on a GPU; the per-request graph path is only the serial store's); the
    buckets of larger batches are the powers of two below max_num_seqs and itself."""
    from xoffload import LLMEngine
    from xoffload.kv import OffloadBatchKV, ResidentBatchKV
    from xoffload.kv.base import batch_buckets

    assert [batch_buckets(n) for n in (1, 2, 6, 16)] == [(1,), (1, 2), (1, 2, 4, 6), (1, 2, 4, 8, 16)]
    m = tiny_random()
    (p,) = _prompts([40], seed=9)
    for kw, cls in (({"mode": "gpu"}, ResidentBatchKV), ({"mode": "offload", "kv_block_size": 32}, OffloadBatchKV)):
        e = LLMEngine(m, max_model_len=128, **SDPA, **kw)
        e.add_request("a", p, SamplingParams(max_tokens=4, ignore_eos=True))
        e.step()
        r = e._runner
        assert type(r.store) is cls and r.store.buckets == (1,)
        while e.has_unfinished_requests():
            e.step()
        assert e.stats["decode_steps"] and all(x["rows"] == 1 for x in e.stats["decode_steps"])


# ------------------------------------------------------------------- teacher forcing (CPU and GPU)
def _batch_logits(m, prompts, toks, n_steps, mode, **kw):
    """Per sequence, the logits ``[n_steps, V]`` of decode steps fed ``toks[b][i]`` at step i, all
    sequences in one batch (the batched store of an LLM(mode, max_num_seqs=len(prompts), **kw));
    each prefill starts where the store's ``prefill_start`` says (a reused prefix)."""
    from xoffload.kv.table import batch_store_class
    from xoffload.engine.request import Request
    from xoffload.engine.scheduler import Sequence
    from xoffload.kernels import cpu_backend

    llm = LLM(m, mode=mode, max_model_len=max(map(len, prompts)) + n_steps + 8, max_num_seqs=len(prompts), **kw)
    cls, okw = batch_store_class(llm.config)
    sp = SamplingParams(max_tokens=n_steps + 1, ignore_eos=True)
    seqs = [Sequence(i, Request.make(p, sp, max_model_len=llm.max_model_len, seed=0, stop_ids=(), device=m.device))
            for i, p in enumerate(prompts)]
    st = cls.open(m, llm.config, llm.offload, seqs, **okw)
    out = [[] for _ in prompts]
    with torch.no_grad(), cpu_backend("reference"):
        for s in seqs:
            st.admit(s)
            start = st.prefill_start(s)  # a prefix the store already holds (prefix caching), else 0
            m.prefill(torch.tensor(s.req.ids[start:], device=m.device), st.sink(s), start=start)
            s.n_out = 1
        rows = st.set_batch(seqs)
        m.rope_tables(st.max_len + 1)
        tok = torch.zeros(rows, dtype=torch.int64, device=m.device)
        for i in range(n_steps):
            tok[:len(seqs)] = torch.tensor([t[i] for t in toks], device=m.device)
            st.begin_step()
            lg = m.decode_step(tok, st.pos[:rows], st)
            st.end_step()
            st.advance()
            for b in range(len(seqs)):
                out[b].append(lg[b].clone())
        for s in seqs:
            st.release(s)
    st.close()
    llm.close()
    return [torch.stack(o) for o in out]


def _check_batch_tracks_alone(m, prompts, mode, n_steps, tol, **kw):
    """Fed the one-request run's greedy tokens, each batch row's logits are within ``tol(logits)``
    of the model's plain forward over the prompt and those tokens (no KV cache) at every step."""
    from xoffload.kernels import cpu_backend

    sp = SamplingParams(max_tokens=n_steps + 1, ignore_eos=True)
    alone = LLM(m, mode="gpu", max_model_len=max(map(len, prompts)) + n_steps + 8)
    toks = [alone.generate(p, sp)[0].token_ids for p in prompts]  # step i feeds toks[b][i]
    batch = _batch_logits(m, prompts, toks, n_steps, mode, **kw)
    for b, p in enumerate(prompts):
        T = len(p)
        with torch.no_grad(), cpu_backend("reference"):
            ref = m.forward(torch.tensor(list(p) + list(toks[b][:n_steps]), device=m.device))
        for i in range(n_steps):
            la = ref[T + i]  # the logits after feeding toks[b][i] at position T + i
            assert float((la - batch[b][i]).abs().max()) <= tol(la), (mode, b, i)


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_teacher_forced_batch_logits_equal_alone_cpu(mode):
    """CPU fp32: each row of a batch (padded to a bucket, block tables scattered by earlier
    sequences) has its one-request logits at every step, to float rounding."""
    m = tiny_random()
    _check_batch_tracks_alone(m, _prompts([1, 31, 32, 33, 90], seed=8), mode, 4, lambda la: 1e-4 * float(la.abs().max()),
                              kv_block_size=32)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_gpu_batch_tracks_alone_and_graphs_equal_eager(mode):
    """bf16, random Llama-3.2-1B, lengths 1, 1023, 1024, 1025, 8192 in one batch: (1) the CUDA-graph
    batch gives the eager batch's tokens exactly; (2) fed the one-request run's tokens, each row's
    logits stay within bf16 rounding of the one-request store's (different GEMM shapes and
    attention summation order: one bf16 eps of the logit scale per layer)."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    prompts = _prompts([1, 1023, 1024, 1025, 8192], vocab=m.cfg.vocab_size)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = {"kv_block_size": 1024, "max_model_len": 8300, "max_num_seqs": 8, "max_num_batched_tokens": 16384}
    graph = LLM(m, mode=mode, **kw)
    a = [o.token_ids for o in graph.generate(prompts, sp)]
    assert graph.batch_stats["graph_buckets"] == [8]
    assert a == [o.token_ids for o in LLM(m, mode=mode, cuda_graph=False, **kw).generate(prompts, sp)]
    eps = torch.finfo(torch.bfloat16).eps
    _check_batch_tracks_alone(m, prompts, mode, 8, lambda la: m.cfg.num_layers * eps * float(la.abs().max()),
                              kv_block_size=1024)


@pytest.mark.cuda
def test_gpu_continuous_batching_graphs_equal_eager():
    """50 requests through max_num_seqs=4 on the GPU (bf16): the buckets' graphs, captured while
    sequences join and leave, give the eager batch's tokens; outputs in submission order."""
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    g = torch.Generator().manual_seed(5)
    lens = [int(x) for x in torch.randint(1, 3000, (50,), generator=g)]
    prompts = _prompts(lens, seed=6, vocab=m.cfg.vocab_size)
    sps = [SamplingParams(max_tokens=int(1 + i % 9), ignore_eos=True) for i in range(50)]
    for mode in ("gpu", "offload"):
        kw = dict(mode=mode, max_model_len=3100, kv_block_size=256, max_num_seqs=4)
        a = LLM(m, **kw).generate(prompts, sps)
        b = LLM(m, cuda_graph=False, **kw).generate(prompts, sps)
        assert [o.prompt_token_ids for o in a] == prompts
        assert [o.token_ids for o in a] == [o.token_ids for o in b], mode
        assert [len(o.token_ids) for o in a] == [1 + i % 9 for i in range(50)]
