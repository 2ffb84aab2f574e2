"""Quest with a measured set of dense layers between sparse ones (the calibrated dense layers: SmolLM2's calibrated
``dense_layers=(0, 1, 8, 15, 18, 19)``): on a 4-layer model with ``dense_layers=(0, 2)`` the dense
layer in the middle attends every token, and every placement / decode path (resident, offload with
the pages read in place, with the page cache, with the next-layer prefetch across the dense layer)
gives the same tokens. CPU, fp32, the kernels' references."""
import dataclasses

import pytest
import torch

from xoffload.engine.kv_paged import PagedKV
from xoffload.kernels import cpu_backend
from xoffload.models.config import get_preset
from xoffload.models.loader import random_model
from xoffload.runtime import OffloadRuntime
from xoffload.sparse.quest import QuestDecode

T, N = 300, 6
POL = dict(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32)


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(get_preset("tiny-llama"), num_layers=4)
    return random_model(cfg, dtype=torch.float32, device="cpu", std=0.2, seed=1)


def _engine(cfg, max_tokens):
    return OffloadRuntime(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32, device="cpu",
                         max_tokens=max_tokens, block_size=64)


def _run(m, ids, kv, n):
    with cpu_backend("reference"), torch.no_grad():
        lg = m.prefill(ids, kv, chunk=128)
        toks, pos = [int(lg.argmax())], len(ids)
        for _ in range(n):
            kv.begin_step(pos)
            lg = m.decode_step(torch.tensor([toks[-1]]), pos, kv)
            kv.end_step()
            pos += 1
            toks.append(int(lg.argmax()))
    return toks, lg


def test_middle_dense_layer_attends_every_token(model):
    """After prefill, an attend of dense layer 2 equals exact attention over all T prompt tokens
    plus the new one; sparse layer 3 does not (it reads the sink, k pages and the tail)."""
    cfg = model.cfg
    hkv, d, g = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    eng = _engine(cfg, T + 4)
    kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=4,
                 policy=QuestDecode(dense_layers=(0, 2), **POL), engine=eng, seq=eng.add_sequence())
    assert kv.dense == {0, 2} and kv.sparse == {1, 3} and not kv.plan.dense
    gen = torch.Generator().manual_seed(5)
    K = torch.randn(cfg.num_layers, T, hkv, d, generator=gen)
    V = torch.randn(cfg.num_layers, T, hkv, d, generator=gen)
    for layer in range(cfg.num_layers):
        k, v = kv.buffers(layer, T)
        k.copy_(K[layer])
        v.copy_(V[layer])
        kv.done(layer, k, v)
    kv.begin_step(T)
    q = torch.randn(1, cfg.num_heads, d, generator=gen)
    kn, vn = torch.randn(1, hkv, d, generator=gen), torch.randn(1, hkv, d, generator=gen)
    with cpu_backend("reference"):
        outs = {layer: kv.attend(layer, q, kn, vn) for layer in (2, 3)}
    for layer, want_equal in ((2, True), (3, False)):
        err = 0.0
        for h in range(hkv):
            kk, vv = torch.cat([K[layer, :, h], kn[:, h]]), torch.cat([V[layer, :, h], vn[:, h]])
            for j in range(g):
                ref = torch.softmax((q[0, h * g + j] @ kk.T) * model.scale, -1) @ vv
                err = max(err, float((outs[layer][h * g + j] - ref).abs().max()))
        assert (err < 1e-5) == want_equal, (layer, err)
    kv.close()
    eng.close()


def test_placements_agree_with_a_middle_dense_layer(model):
    """dense_layers=(0, 2): resident, offload (pages in place), offload + page cache and offload +
    cache + prefetch give the same tokens and logits (fp32; no reuse bias, which would make the
    cached placements choose by their cache); the set matters (dense_layers=(0,) gives other logits)."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(6))
    res = {}
    for name, dense, cp, pf, offload in (("resident", (0, 2), None, False, False),
                                         ("in place", (0, 2), 0, False, True),
                                         ("cache", (0, 2), None, False, True),
                                         ("prefetch", (0, 2), None, True, True),
                                         ("only 0 dense", (0,), None, False, False)):
        eng = _engine(cfg, T + N + 1) if offload else None
        kv = PagedKV(cfg, torch.float32, torch.device("cpu"), model.scale, prompt_len=T, max_new=N + 1,
                     policy=QuestDecode(dense_layers=dense, cache_pages=cp, prefetch=pf, reuse_bias=1.0, **POL),
                     engine=eng,
                     seq=eng.add_sequence() if eng is not None else None)
        if pf:
            assert kv.lookahead == {1, 3}  # layer 3's pages are prefetched during dense layer 2
        res[name] = _run(model, ids, kv, N)
        kv.close()
        if eng is not None:
            assert eng.num_free_blocks == eng.allocator.num_blocks
            eng.close()
    toks, lg = res["resident"]
    for name in ("in place", "cache", "prefetch"):
        assert res[name][0] == toks, name
        assert float((res[name][1] - lg).abs().max()) < 1e-4, name
    assert float((res["only 0 dense"][1] - lg).abs().max()) > 1e-3
