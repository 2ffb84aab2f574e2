"""The batched Quest store with a page cache reads the sparse layers' tail in the same attention
call as the cached pages (the tail's rows follow the cache's in one row store, each row's tail
pages after its own ``k_r`` pages): it must answer as the store that attends to the two apart and
merges them by LSE, for rows of different page counts in one batch, through prefix reuse, and
with a padded bucket."""
import pytest
import torch

from xoffload import LLM, SamplingParams
from xoffload.kv.quest import OffloadQuestBatchKV
from xoffload.models import random_model
from xoffload.sparse import QuestDecode

POL = QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=())


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 200, (n,), generator=g).tolist() for n in lens]


def _run(monkeypatch, fused, prompts, **kw):
    monkeypatch.setattr(OffloadQuestBatchKV, "FUSE_TAIL", fused)
    m = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=1)
    llm = LLM(m, mode="offload", kv_block_size=64, max_model_len=1024, prefill_attn="sdpa", sparse_decode=POL, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    return [o.token_ids for o in outs], llm.engine.stats["store"]


@pytest.mark.parametrize("max_num_seqs,prefix", [(3, False), (4, True)])
def test_fused_tail_answers_as_the_merged_one(monkeypatch, max_num_seqs, prefix):
    # 700, 500 and 300 tokens: 12, 10 and 3 pages per step (k_r differ per row); 3 rows pad to a
    # bucket of 4 with max_num_seqs 4; with a prefix cache the last prompt reuses the first's head
    ps = _prompts([700, 500, 300], seed=3)
    if prefix:
        ps.append(ps[0][:640] + ps[2][:100])
    a, sa = _run(monkeypatch, True, ps, max_num_seqs=max_num_seqs, prefix_caching=prefix)
    b, sb = _run(monkeypatch, False, ps, max_num_seqs=max_num_seqs, prefix_caching=prefix)
    assert sa["fused_tail"] is True and sb["fused_tail"] is False and sa["cache_slots"] > 0
    assert a == b


def test_no_fusion_without_a_page_cache(monkeypatch):
    pol = QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(), cache_pages=0)
    monkeypatch.setattr(OffloadQuestBatchKV, "FUSE_TAIL", True)
    m = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=1)
    llm = LLM(m, mode="offload", kv_block_size=64, max_model_len=1024, prefill_attn="sdpa", sparse_decode=pol)
    llm.generate(_prompts([400], seed=4), SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.engine.stats["store"]["fused_tail"] is False and llm.engine.stats["store"]["cache_slots"] == 0
