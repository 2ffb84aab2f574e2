"""tools/diag_quest.py and tools/diag_quest_ruler.py on a tiny random model (CPU, fp32): the Quest
store the engine runs (StoreKV: one sequence of LLMEngine(mode, sparse_decode=policy,
max_num_seqs=1)'s store) under the independent checker, and the ruler tool's replay of recorded
prompt K/V and its teacher forcing."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import diag_quest as D  # noqa: E402
import diag_quest_ruler as R  # noqa: E402

from xoffload.kernels import cpu_backend  # noqa: E402
from xoffload.models import random_model  # noqa: E402
from xoffload.sparse import QuestDecode  # noqa: E402

# 2 layers: layer 0 dense, layer 1 sparse; pages of 16, 2 of 15 candidates chosen per step at T=300
SMALL = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
WHOLE = QuestDecode(token_budget=1200, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
N = 6


@pytest.fixture(scope="module")
def model():
    return random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=1, std=0.15)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()


def test_check_model_the_store_equals_the_independent_reference(model, ids):
    rows = D.check_model(model, ids, N, (WHOLE, SMALL), kv_block_size=32)
    assert [(r["placement"], r["policy"].token_budget) for r in rows] == [
        ("resident", 1200), ("resident", 96), ("offload", 1200), ("offload", 96)]
    for r in rows:
        assert r["maxdiff"] <= 1e-5 and r["sel_mismatch"] == 0, r
        assert r["dense_plan"] == (r["policy"].token_budget == 1200) and len(r["tokens"]) == N
        # a budget over the prompt is dense decode; the small one selects at every step, in each KV head
        assert r["same_as_dense"] if r["dense_plan"] else r["sel_checked"] == (N - 1) * model.cfg.num_kv_heads
    assert rows[2]["policy"].reuse_bias == 1.0  # offload: the cache's bonus off (the bare top-k)
    assert rows[1]["tokens"] == rows[3]["tokens"]  # the same pages, the same tokens, either placement


def test_the_checker_sees_a_wrong_output(model, ids):
    """A store whose sparse layer's output is off by 1e-3 is caught (maxdiff), as is one that
    selects other pages (sel_mismatch)."""
    def shifted(base):
        checked = D._make_checked(base)

        class Off(base):
            def attend(self, layer, q, k_new, v_new):
                o = base.attend(self, layer, q, k_new, v_new)
                return o + 1e-3 if layer == 1 else o

        return type("Checked", (checked, Off), {})

    with cpu_backend("reference"), torch.no_grad():
        kv = D.StoreKV(model, SMALL, ids, N, wrap_store=shifted, kv_block_size=32)
        try:
            D.greedy(model, torch.tensor(ids), kv, N)
        finally:
            kv.close()
    assert kv.store.maxdiff >= 9e-4 and kv.store.sel_mismatch == 0


def test_store_kv_positions_are_checked(model, ids):
    kv = D.StoreKV(model, SMALL, ids, N, kv_block_size=32)
    try:
        with torch.no_grad():
            model.prefill(torch.tensor(ids), kv)
            with pytest.raises(ValueError, match="at position 300, the step asks for 301"):
                kv.begin_step(301)
    finally:
        kv.close()
    assert kv.engine.offload.sequences() == []  # the device pool holds nothing once closed


def _record(model, ids):
    """What diag_quest_ruler --cache saves, for a dense greedy run of ``ids``."""
    T = len(ids)
    rec = D.RecordKV(model.cfg, T, N, model.scale)
    with cpu_backend("reference"), torch.no_grad():
        dense = D.greedy(model, torch.tensor(ids), rec, N)
    return dict(ids=ids, k=rec.k, v=rec.v, dense=dense, T=T)


def test_replay_of_recorded_kv_equals_a_prefill(model, ids):
    rec = _record(model, ids)
    with cpu_backend("reference"), torch.no_grad():
        assert R.replay(model, rec, WHOLE, N) == rec["dense"]  # a budget over the prompt: dense
        kv = D.StoreKV(model, SMALL, ids, N)
        try:
            prefilled = D.greedy(model, torch.tensor(ids), kv, N)
        finally:
            kv.close()
        assert R.replay(model, rec, SMALL, N) == prefilled != rec["dense"]
        kv = D.StoreKV(model, WHOLE, ids, N)
        try:
            assert R.teacher_forced(model, ids, kv, rec["dense"]) == rec["dense"]
        finally:
            kv.close()
