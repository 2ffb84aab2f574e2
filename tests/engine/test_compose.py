"""Every documented combination composes: mode (resident, offload direct, offload uva) x decode
(dense, quest, quest-ch) x max_num_seqs (1, 4) x prefix_caching (off, on) x use (generate, a
conversation, the step API). With a sparse budget that covers the context, greedy tokens equal the
plain reference (resident, dense, one request at a time); a combination that stays refused is
refused when it is constructed, with its reason (the README's table lists the same ones)."""
import itertools

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.sparse import QuestDecode

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=4, ignore_eos=True)
MODES = {"resident": {"mode": "resident", "kv_block_size": 64},
         "direct": {"mode": "offload", "offload_decode": "direct", "kv_block_size": 64},
         "uva": {"mode": "offload", "offload_decode": "uva", "kv_block_size": 64}}
# budgets that cover the 256-token context: every page is read
DECODES = {"dense": None,
           "quest": QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,)),
           "quest-ch": QuestDecode(token_budget=256, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,),
                                   exact_channels=4, bound_scale=0.25)}

#: (mode, decode, max_num_seqs, prefix_caching) -> the words the refusal must contain
#: combinations refused at construction (none: every one composes)
REFUSED = {}


def _prompts():
    g = torch.Generator().manual_seed(21)
    doc = torch.randint(1, 256, (90,), generator=g).tolist()
    return doc + torch.randint(1, 256, (20,), generator=g).tolist(), doc + torch.randint(1, 256, (31,), generator=g).tolist()


_REF = {}


def _reference(prompts):
    key = tuple(map(tuple, prompts))
    if key not in _REF:
        ref = LLM(tiny_random(), mode="resident", max_model_len=256, **SDPA)
        _REF[key] = [ref.generate(p, SP)[0].token_ids for p in prompts]
    return _REF[key]


@pytest.mark.parametrize("mode,decode,n,prefix", list(itertools.product(MODES, DECODES, (1, 4), (False, True))))
def test_combination(mode, decode, n, prefix):
    kw = dict(MODES[mode], sparse_decode=DECODES[decode], max_num_seqs=n, prefix_caching=prefix, max_model_len=256,
              **SDPA)
    why = REFUSED.get((mode, decode, n, prefix))
    if why is not None:
        with pytest.raises(ValueError, match=why):
            LLM(tiny_random(), **kw)
        return
    llm = LLM(tiny_random(), **kw)
    p1, p2 = _prompts()
    # generate: both prompts in one call (twice: the second call may reuse the first's prefix)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate([p1, p2], SP)] == _reference([p1, p2]), "generate"
    # the step API
    e = llm.engine
    e.add_request("a", p1, SP)
    e.add_request("b", p2, SP)
    finals = {}
    while e.has_unfinished_requests():
        finals.update({o.request_id: o for o in e.step() if o.finished})
    assert [finals["a"].token_ids, finals["b"].token_ids] == _reference([p1, p2]), "step API"
    # a conversation: turn 2 continues turn 1's prompt and answer
    with llm.session() as s:
        a1 = s.generate(p1, SP).token_ids
        a2 = s.generate(p2[90:], SP).token_ids
    whole = p1 + a1 + p2[90:]
    assert [a1, a2] == [_reference([p1])[0], _reference([whole])[0]], "session"
    if llm.offload is not None:  # offload, and resident + Quest (the pool on the device)
        assert llm.offload.sequences() == []
        llm.offload.allocator.check()
    assert (llm.offload is not None) == (mode != "resident" or decode != "dense")
