"""CUDA-graph decode (xoffload.engine.cuda_graph): the graph-safe step body equals host-driven steps
(CPU), and on a GPU graph == eager token for token; a single request is a batch of one (bucket 1's
graph) in every configuration."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kernels import cpu_backend
from xoffload.models import random_model

from .llm_helpers import tiny_random as _tiny_random


def test_device_position_steps_equal_the_plain_forward():
    """The graph-safe step body (positions and lengths on the device, advanced in place; on the CPU
    run eagerly) of a batch of one gives the greedy tokens of the model's plain forward over the
    growing sequence (no KV cache), in both modes."""
    m = _tiny_random("tiny-llama")
    ids = list(range(3, 40))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = []
    with cpu_backend("reference"), torch.no_grad():
        for _ in range(6):
            ref.append(int(m.forward(torch.tensor(ids + ref))[-1].argmax()))
    for mode in ("gpu", "offload"):
        llm = LLM(m, mode=mode, max_model_len=64, kv_block_size=16)
        assert llm.generate(ids, sp)[0].token_ids == ref, mode
    with pytest.raises(TypeError, match="cuda_graph"):
        LLM(m, cuda_graph="yes")


@pytest.mark.cuda
def test_cuda_graph_decode_equals_eager_and_offload_cuda(monkeypatch):
    """gpu mode with the CUDA-graph decode (a request is a batch of one: the graph of bucket 1) ==
    the eager loop, and offload's graph == offload's eager loop, token for token over 32 steps (greedy and seeded
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
    off = LLM(m, mode="offload", max_model_len=4096)
    off_eager = LLM(m, mode="offload", max_model_len=4096, cuda_graph=False)
    for sp in (SamplingParams(max_tokens=33, ignore_eos=True),
               SamplingParams(max_tokens=33, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)):
        a = graph.generate(ids, sp)[0]
        assert graph.batch_stats["graph_buckets"] == [1]
        b = eager.generate(ids, sp)[0]
        c = off.generate(ids, sp)[0]
        assert len(a.token_ids) == 33 and a.timings["decode_steps"] == 32
        assert a.token_ids == b.token_ids
        assert c.token_ids == off_eager.generate(ids, sp)[0].token_ids
        # a second request on the same LLM (fresh graph, nothing shared) gives the same tokens
        assert graph.generate(ids, sp)[0].token_ids == a.token_ids
    assert seen == [[1]] * 6  # per sampling: two resident epochs and one offload epoch with graphs


@pytest.mark.cuda
def test_resident_quest_is_a_batch_of_one_cuda():
    """Resident + Quest decode at max_num_seqs=1 runs the batched Quest store over a device pool
    through the graph of bucket 1 and gives the eager loop's tokens."""
    from xoffload.sparse import QuestDecode

    m = random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=1, std=0.15)
    ids = torch.randint(0, m.cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    pol = QuestDecode(token_budget=256, page_size=16)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    graph = LLM(m, mode="gpu", max_model_len=1024, sparse_decode=pol)
    a = graph.generate(ids, sp)[0]
    assert graph.batch_stats["store"]["store"] == "OffloadQuestBatchKV" and graph.batch_stats["graph_buckets"] == [1]
    assert a.token_ids == LLM(m, mode="gpu", max_model_len=1024, sparse_decode=pol,
                              cuda_graph=False).generate(ids, sp)[0].token_ids
