"""CUDA-graph decode (xoffload.engine.cuda_graph): the graph-safe step body equals host-driven steps
(CPU), and on a GPU graph == eager == offload token for token; a single request is a batch of one
(bucket 1's graph), per-request stores keep their own graph."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kernels import cpu_backend
from xoffload.models import random_model

from .llm_helpers import tiny_random as _tiny_random


def test_device_position_step_equals_host_position_step():
    """The graph-safe decode body (position and lengths on the device, advanced in place) gives the
    same logits as host-driven eager steps (CPU: the body of the CUDA-graph path, without a graph)."""
    from xoffload.engine.kv_store import ResidentKV

    m = _tiny_random("tiny-llama")
    ids = torch.arange(3, 40)
    T, n_new = ids.numel(), 6
    caches = [ResidentKV(m.cfg, T + n_new, m.dtype, m.device, m.scale, max_len=T + n_new) for _ in range(2)]
    with cpu_backend("reference"), torch.no_grad():
        toks = []
        for kv in caches:
            tok = m.prefill(ids, kv).argmax(-1)
            kv.pos_t.fill_(T)
            m.rope_tables(T + n_new + 1)
            seq = []
            for i in range(n_new):
                if kv is caches[0]:
                    kv.begin_step(T + i)
                    logits = m.decode_step(tok, T + i, kv)
                else:
                    kv.begin_step(None)
                    logits = m.decode_step(tok, kv.pos_t, kv)
                    kv.advance()
                kv.end_step()
                seq.append(logits)
                tok = logits.argmax(-1)
            toks.append(seq)
    assert int(caches[1].pos_t) == T + n_new and int(caches[1].lens) == T + n_new
    for a, b in zip(*toks):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="cuda_graph"):
        LLM(m, cuda_graph="yes")


@pytest.mark.cuda
def test_cuda_graph_decode_equals_eager_and_offload_cuda(monkeypatch):
    """gpu mode with the CUDA-graph decode (a request is a batch of one: the graph of bucket 1) ==
    the eager loop == offload mode (the ring), token for token over 32 steps (greedy and seeded
    sampling), on a random Llama-3.2-1B (bf16, 2000-token prompt); the graph really is captured and
    replayed, and released when its store epoch ends."""
    from xoffload.engine.cuda_graph import BatchGraphs

    seen = []
    orig_close = BatchGraphs.close

    def spy_close(self):
        if self.use:
            seen.append(sorted(self.graphs))
        orig_close(self)

    monkeypatch.setattr(BatchGraphs, "close", spy_close)
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    ids = torch.randint(0, m.cfg.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    graph = LLM(m, mode="gpu", max_model_len=4096)
    eager = LLM(m, mode="gpu", max_model_len=4096, cuda_graph=False)
    off = LLM(m, mode="offload", max_model_len=4096, offload_decode="ring")
    for sp in (SamplingParams(max_tokens=33, ignore_eos=True),
               SamplingParams(max_tokens=33, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)):
        a = graph.generate(ids, sp)[0]
        assert graph.batch_stats["graph_buckets"] == [1]
        b = eager.generate(ids, sp)[0]
        c = off.generate(ids, sp)[0]
        assert len(a.token_ids) == 33 and a.timings["decode_steps"] == 32
        assert a.token_ids == b.token_ids
        assert a.token_ids == c.token_ids
        # a second request on the same LLM (fresh graph, nothing shared) gives the same tokens
        assert graph.generate(ids, sp)[0].token_ids == a.token_ids
    assert seen == [[1]] * 4


@pytest.mark.cuda
def test_per_request_stores_keep_their_own_graph_cuda(monkeypatch):
    """A configuration no batched store serves (resident + Quest decode: per-request stores behind
    SerialBatchKV) at max_num_seqs=1 decodes through the request's own graph (GraphDecode), no
    bucket graph, and gives the eager loop's tokens."""
    from xoffload.engine.cuda_graph import GraphDecode
    from xoffload.sparse import QuestDecode

    seen = []
    orig_close = GraphDecode.close

    def spy_close(self):
        seen.append(self.graph is not None)
        orig_close(self)

    monkeypatch.setattr(GraphDecode, "close", spy_close)
    m = random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=1, std=0.15)
    ids = torch.randint(0, m.cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    pol = QuestDecode(token_budget=256, page_size=16)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    graph = LLM(m, mode="gpu", max_model_len=1024, sparse_decode=pol)
    a = graph.generate(ids, sp)[0]
    assert graph.batch_stats["store"]["store"] == "SerialBatchKV" and graph.batch_stats["graph_buckets"] == []
    assert seen == [True]
    assert a.token_ids == LLM(m, mode="gpu", max_model_len=1024, sparse_decode=pol,
                              cuda_graph=False).generate(ids, sp)[0].token_ids
