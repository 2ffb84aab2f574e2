"""The KV layer's contracts (xoffload.kv.protocols): every store the table can return, and the
runtime's allocator, provide what the protocols require."""
import pytest
import torch

from xoffload.kv import protocols as P
from xoffload.kv.offload import OffloadBatchKV
from xoffload.kv.quest import OffloadQuestBatchKV
from xoffload.kv.resident import ResidentBatchKV
from xoffload.kv.resident_prefix import ResidentPrefixBatchKV
from xoffload.runtime.allocator import BlockAllocator
from xoffload.sparse import QuestDecode
from tests.engine.llm_helpers import tiny_random
from xoffload.engine import LLMEngine, SamplingParams

STORES = [ResidentBatchKV, ResidentPrefixBatchKV, OffloadBatchKV, OffloadQuestBatchKV]


def test_protocol_members_are_the_contract():
    m = P.protocol_members(P.KVStore)
    for name in ("check", "can_admit", "admit", "release", "prefill_start", "prefill_tokens", "set_batch",
                 "begin_step", "attend", "end_step", "advance", "sink", "close", "pos", "capturable"):
        assert name in m
    assert "history" in P.protocol_members(P.HistorySink) and "history" not in P.protocol_members(P.PrefillSink)


@pytest.mark.parametrize("cls", STORES, ids=lambda c: c.__name__)
def test_every_store_has_the_methods_and_a_placement(cls):
    for name in P.protocol_members(P.KVStore):
        if name in ("pos", "max_num_seqs"):  # instance attributes, checked on an opened store below
            continue
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    assert cls.__name__ in P.PLACEMENTS and "prompt" in P.PLACEMENTS[cls.__name__]


@pytest.mark.parametrize("opts", [dict(mode="resident"), dict(mode="offload"),
                                  dict(mode="offload", sparse_decode=QuestDecode(token_budget=64, page_size=16)),
                                  dict(mode="resident", prefix_caching=True)],
                         ids=["resident", "offload", "offload-quest", "resident-prefix"])
def test_opened_stores_and_their_sinks_satisfy_the_protocols(opts):
    eng = LLMEngine(tiny_random(), max_model_len=256, max_num_seqs=2, **opts)
    seen = {}
    orig = eng.store_cls.sink

    def spy(self, seq):
        s = orig(self, seq)
        seen["store"], seen["sink"] = self, s
        return s

    eng.store_cls.sink = spy
    try:
        eng.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=3))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.store_cls.sink = orig
    assert isinstance(seen["store"], P.KVStore) and isinstance(seen["store"], P.Admission)
    assert isinstance(seen["sink"], P.PrefillSink)


def test_allocator_is_a_block_ledger():
    a = BlockAllocator(4, 16)
    assert isinstance(a, P.BlockLedger)
    a.add(0)
    a.allocate(0, 2)
    assert a.num_free == 2 and all(a.refcount(b) == 1 for b in a.table(0))
    a.free(0)
    assert a.num_free == 4
