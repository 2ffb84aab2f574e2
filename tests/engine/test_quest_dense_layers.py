"""Quest with a measured set of dense layers between sparse ones (the calibrated dense layers: SmolLM2's
calibrated ``dense_layers=(0, 1, 8, 15, 18, 19)``): on a 4-layer model with ``dense_layers=(0, 2)``
every placement / decode path (resident: the Quest store over a device pool; offload with the pages
read in place; with the page cache) gives the same tokens, and a policy whose layers are all dense
gives dense decode's tokens. CPU, fp32, the kernels' references."""
import dataclasses

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kernels import cpu_backend
from xoffload.models.config import get_preset
from xoffload.models.loader import random_model
from xoffload.sparse.quest import QuestDecode

T, N = 300, 6
POL = dict(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32)


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(get_preset("tiny-llama"), num_layers=4)
    return random_model(cfg, dtype=torch.float32, device="cpu", std=0.2, seed=1)


def _tokens(m, ids, mode, pol):
    llm = LLM(m, mode=mode, max_model_len=T + N + 8, kv_block_size=64, sparse_decode=pol)
    with cpu_backend("reference"):
        out = llm.generate(ids, SamplingParams(max_tokens=N + 1, ignore_eos=True))[0].token_ids
    if llm.offload is not None:
        assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks
    llm.close()
    return out


def test_every_layer_dense_is_dense_decode(model):
    """A policy whose dense layers are all the model's reads every token: dense decode's tokens,
    resident and offloaded."""
    ids = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(5)).tolist()
    for mode in ("gpu", "offload"):
        ref = _tokens(model, ids, mode, None)
        assert _tokens(model, ids, mode, QuestDecode(dense_layers=(0, 1, 2, 3), reuse_bias=1.0, **POL)) == ref, mode


def test_placements_agree_with_a_middle_dense_layer(model):
    """dense_layers=(0, 2): resident, offload (pages in place) and offload + page cache give the
    same tokens (fp32; no reuse bias, which would make the cached placement choose by its cache)."""
    ids = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(6)).tolist()
    res = {name: _tokens(model, ids, mode, QuestDecode(dense_layers=(0, 2), cache_pages=cp, reuse_bias=1.0, **POL))
           for name, mode, cp in (("resident", "gpu", None), ("in place", "offload", 0), ("cache", "offload", None))}
    assert res["in place"] == res["resident"] and res["cache"] == res["resident"]
