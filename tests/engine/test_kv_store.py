"""KV stores (xoffload.engine.kv_store): offload == resident token for token, the offload prefill's
staging buffer (one, reused by every layer after its copy out), the mode registry ("gpu" alias, canonical names) and a new store plugged in
through the factory."""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.models import random_model

from .llm_helpers import tiny_random as _tiny_random


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_offload_equals_gpu_32_steps_cpu(arch):
    m = _tiny_random(arch)
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    a = LLM(m, mode="gpu", max_model_len=128).generate(ids, sp)[0]
    llm = LLM(m, mode="offload", max_model_len=128, kv_block_size=16, num_kv_buffers=2)
    b = llm.generate(ids, sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    assert len(set(a.token_ids)) > 3
    assert llm.offload.sequences() == []  # freed at the end
    # sampled too: the same seed gives the same tokens in both modes
    sp = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True)
    assert LLM(m, mode="gpu", max_model_len=128).generate(ids, sp)[0].token_ids == llm.generate(ids, sp)[0].token_ids


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offload_equals_gpu_32_steps_cuda(dtype):
    m = random_model("llama-3.2-1b", dtype=dtype, device="cuda", seed=0, std=0.02)
    ids = torch.randint(0, m.cfg.vocab_size, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    a = LLM(m, mode="gpu", max_model_len=4096).generate(ids, sp)[0]
    # the ring sums attention in the resident cache's order: bit-identical logits, same tokens
    # (the direct paged path merges pool pages and tail by LSE: tests/engine/test_kv_paged.py)
    b = LLM(m, mode="offload", max_model_len=4096, offload_decode="ring").generate(ids, sp)[0]
    assert a.token_ids == b.token_ids
    assert a.peak_gpu_memory_bytes > 0 and b.timings["decode_ms_per_token"] > 0


def _staging_run(device, dtype):
    from xoffload.kernels import cpu_backend
    from xoffload.engine.kv_store import OffloadKV, ResidentKV

    import dataclasses

    from xoffload.models.config import get_preset

    cfg4 = dataclasses.replace(get_preset("tiny-llama"), num_layers=5)
    m = random_model(cfg4, dtype=dtype, device=device, seed=1, std=0.15)
    cfg = m.cfg
    llm = LLM(m, mode="offload", max_model_len=256, kv_block_size=32)
    ids = torch.randint(0, cfg.vocab_size, (77,), generator=torch.Generator().manual_seed(5)).to(device)
    seq = llm.offload.add_sequence()
    kv = OffloadKV(llm.offload, seq, cfg, m.dtype, m.device, m.scale)
    ptrs = []
    orig = kv.buffers

    def spy(layer, T):
        k, v = orig(layer, T)
        ptrs.append((k.data_ptr(), v.data_ptr()))
        return k, v

    kv.buffers = spy
    ref = ResidentKV(cfg, 80, m.dtype, m.device, m.scale)
    with torch.no_grad(), cpu_backend("reference"):
        a = m.prefill(ids, kv, chunk=32)
        b = m.prefill(ids, ref, chunk=32)
    # every layer reuses one staging buffer (bounded memory), and every layer's K/V reached the
    # pool intact although the next layer overwrote the buffer
    assert len(set(ptrs)) == 1 and len(ptrs) == cfg.num_layers
    assert torch.equal(a, b)
    for layer in range(cfg.num_layers):
        hk, hv = llm.offload.host_kv(seq, layer)
        assert torch.equal(hk, ref.k[layer, :77].cpu()) and torch.equal(hv, ref.v[layer, :77].cpu())
    llm.close()


def test_offload_prefill_reuses_one_staging_buffer():
    _staging_run("cpu", torch.float32)


def test_prefill_staging_buffers_in_turn():
    from xoffload.engine.kv_store import PrefillStaging

    class _Eng:
        def reclaim(self):
            pass

    st = PrefillStaging(2, 8, torch.float32, "cpu", num_buffers=3)
    ptrs = [st.buffers(_Eng(), layer, 5)[0].data_ptr() for layer in range(6)]
    assert len(set(ptrs)) == 3 and ptrs[:3] == ptrs[3:]
    assert st.buffers(_Eng(), 0, 9)[0].shape == (9, 2, 8)  # grows to the longest T
    with pytest.raises(ValueError, match="num_buffers"):
        PrefillStaging(2, 8, torch.float32, "cpu", num_buffers=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_prefill_staging_reuse_cuda():
    _staging_run("cuda", torch.bfloat16)



def test_modes_canonical_and_gpu_alias():
    from xoffload.engine.config import EngineConfig
    from xoffload.engine.kv_paged import OffloadPagedKV, ResidentPagedKV
    from xoffload.engine.kv_store import MODE_ALIASES, STORES, OffloadKV, ResidentKV, canonical_mode

    m = _tiny_random("tiny-llama")
    assert STORES["resident"] is ResidentKV and STORES["offload"] is OffloadPagedKV and MODE_ALIASES["gpu"] == "resident"
    # the configuration picks the class once: ring decode, and the paged store under a decode policy
    variant = lambda mode, **kw: STORES[mode].variant(EngineConfig.from_kwargs(mode=mode, **kw))  # noqa: E731
    assert variant("offload", offload_decode="ring") is OffloadKV and variant("offload") is OffloadPagedKV
    assert variant("resident") is ResidentKV and variant("resident", token_budget=256) is ResidentPagedKV
    for mode, want in (("gpu", "resident"), ("resident", "resident"), ("offload", "offload")):
        llm = LLM(m, mode=mode, max_model_len=64, kv_block_size=16)
        assert llm.mode == want and llm.config.mode == want
        assert (llm.offload is None) == (want == "resident")
    assert LLM(m, max_model_len=64).mode == "resident"  # the default
    with pytest.raises(ValueError, match="'disk'"):
        canonical_mode("disk")
    ids = list(range(5, 25))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert (LLM(m, mode="gpu", max_model_len=64).generate(ids, sp)[0].token_ids
            == LLM(m, mode="resident", max_model_len=64).generate(ids, sp)[0].token_ids)


def test_new_store_plugs_in_through_the_factory():
    """A new store is one registered class: here a resident store that counts the interface calls.
    The LLM picks it by mode name, runs every request through it, and closes it after each."""
    from xoffload.engine.kv_store import MODE_ALIASES, STORES, KVStore, ResidentKV, register_store

    calls = {}

    class CountingKV(KVStore):
        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def for_request(cls, model, shared, req, config):
            calls["for_request"] = calls.get("for_request", 0) + 1
            return cls(ResidentKV.for_request(model, shared, req, config))

        @property
        def capturable(self):
            return self.inner.capturable

        def __getattr__(self, name):  # pos_t, capacity of the inner store
            return getattr(self.inner, name)

    for meth in ("buffers", "done", "begin_step", "attend", "end_step", "advance", "close"):
        def counted(self, *a, _m=meth):
            calls[_m] = calls.get(_m, 0) + 1
            return getattr(self.inner, _m)(*a)
        setattr(CountingKV, meth, counted)

    register_store("counting", "count")(CountingKV)
    try:
        m = _tiny_random("tiny-llama")
        L = m.cfg.num_layers
        llm = LLM(m, mode="count", max_model_len=64)
        assert llm.mode == "counting" and llm.offload is None
        ids = list(range(3, 20))
        sp = SamplingParams(max_tokens=5, ignore_eos=True)
        got = llm.generate([ids, ids], sp)
        ref = LLM(m, mode="resident", max_model_len=64).generate(ids, sp)[0]
        assert [o.token_ids for o in got] == [ref.token_ids] * 2
        assert calls["for_request"] == 2 and calls["close"] == 2
        assert calls["buffers"] == calls["done"] == 2 * L
        assert calls["begin_step"] == calls["end_step"] == 2 * 4 and calls["attend"] == 2 * 4 * L
        assert "advance" not in calls  # eager on the CPU
    finally:
        STORES.pop("counting")
        MODE_ALIASES.pop("count")
