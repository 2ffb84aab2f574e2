"""Model tests (issue 4 §4, §6): tiny random Llama / Qwen3 against transformers with the same weights,
GGUF loading (quantized, q/k permutation) against the dequantized weights, offload == gpu, request
isolation, sampling, sparse prefill hook, bad input.

CPU runs use fp32 and the kernels' PyTorch references (LLM does that itself on the CPU).
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from xoffload.kernels import cpu_backend
from xoffload.models import LLM, SamplingParams, get_preset, load_gguf, load_hf_dir, load_model, random_model
from xoffload.models.config import config_from_hf, rope_inv_freq
from xoffload.models.loader import unpermute_qk

HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ helpers
def _tiny_hf(arch: str, seed: int = 0):
    """A tiny transformers model with weights scaled up (so greedy tokens vary) and non-trivial norms."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        hc = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        hf = LlamaForCausalLM(hc)
    else:
        hc = Qwen3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1000000.0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        hf = Qwen3ForCausalLM(hc)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif not (arch == "qwen3" and "embed" in n):  # tied: a large embedding makes greedy repeat
                p.mul_(4.0)
    return hf.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_pair(request, tmp_path_factory):
    hf = _tiny_hf(request.param)
    d = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf.save_pretrained(str(d))
    ours = load_hf_dir(str(d), dtype=torch.float32, device="cpu")
    return request.param, hf, ours, str(d)


def _tiny_llm(mode="gpu", arch="tiny-llama", max_model_len=256, **kw):
    m = _tiny_random(arch)
    return LLM(m, mode=mode, max_model_len=max_model_len, **kw)


_RANDOM = {}


def _tiny_random(arch="tiny-llama"):
    if arch not in _RANDOM:
        _RANDOM[arch] = random_model(arch, dtype=torch.float32, device="cpu", seed=1, std=0.15)
    return _RANDOM[arch]


# ------------------------------------------------------------------------------------------ vs transformers
def test_logits_match_transformers(tiny_pair):
    arch, hf, ours, _ = tiny_pair
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (70,), generator=g)  # past original_max_position_embeddings=32
    with torch.no_grad(), cpu_backend("reference"):
        ref = hf(ids[None]).logits[0].float()
        got = ours.forward(ids, chunk=16)  # several chunks: exercises chunked causal prefill
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 1e-3, f"{arch}: max logit error {err}"
    assert ours.cfg.qk_norm == (arch == "qwen3")
    assert (ours.w.lm_head is ours.w.embed) == (arch == "qwen3")


def test_greedy_16_tokens_match_transformers(tiny_pair):
    arch, hf, ours, _ = tiny_pair
    seen = set()
    for seed, n in ((2, 9), (3, 40)):
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = hf.generate(ids[None], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=16,
                              min_new_tokens=16, do_sample=False, pad_token_id=0)[0, n:].tolist()
        for mode in ("gpu", "offload"):
            out = LLM(ours, mode=mode, max_model_len=128, kv_block_size=16).generate(
                ids.tolist(), SamplingParams(max_tokens=16))[0]
            assert out.token_ids == ref, f"{arch} {mode}: {out.token_ids} vs transformers {ref}"
        seen.update(ref)
    assert len(seen) > 5, "degenerate test: greedy tokens barely vary"


def test_rope_llama3_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = get_preset("llama-3.1-8b")
    hc = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                     max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    got = rope_inv_freq(cfg)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    assert not torch.allclose(got, plain), "llama3 scaling had no effect"


def test_config_from_hf_variants():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    c = config_from_hf(dict(base, rope_theta=5.0, eos_token_id=[3, 4]))
    assert c.num_kv_heads == 2 and c.head_dim == 4 and c.rope_theta == 5.0 and c.eos_token_ids == (3, 4)
    c = config_from_hf(dict(base, rope_parameters={"rope_type": "llama3", "rope_theta": 7.0, "factor": 2.0}))
    assert c.rope_theta == 7.0 and c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 2.0
    with pytest.raises(ValueError, match="unsupported architecture"):
        config_from_hf(dict(base, model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="bias"):
        config_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ValueError, match="rope scaling"):
        config_from_hf(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ------------------------------------------------------------------------------------------ GGUF
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what unpermute_qk undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_permutation():
    w = np.random.default_rng(0).standard_normal((4 * 16, 24)).astype(np.float32)
    back = unpermute_qk(torch.from_numpy(_llamacpp_permute(w, 4)), 4).numpy()
    np.testing.assert_array_equal(back, w)


def _write_gguf(path, hf, arch="llama", qtypes=None, tensors_override=None):
    """Write a tiny HF llama as a GGUF the way llama.cpp does (q/k permuted, quantized tensors).

    Returns the state dict (HF names) holding the dequantized values the file really contains."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = hf.config
    T = gguf.GGMLQuantizationType
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for k, v in per.items():
            names[f"model.layers.{i}.{k}.weight"] = f"blk.{i}.{v}.weight"
    real = {}
    for hname, gname in names.items():
        a = sd[hname]
        if "attn_q" in gname:
            a = _llamacpp_permute(a, cfg.num_attention_heads)
        elif "attn_k" in gname:
            a = _llamacpp_permute(a, cfg.num_key_value_heads)
        qt = T.F32 if a.ndim == 1 else qtypes.get(gname.split(".")[-2], T.F32)
        if qt == T.F32:
            w.add_tensor(gname, a)
            deq = a
        elif qt == T.F16:
            w.add_tensor(gname, a.astype(np.float16))
            deq = a.astype(np.float16).astype(np.float32)
        else:
            qa = quantize(a, qt)
            w.add_tensor(gname, qa, raw_dtype=qt)
            deq = dequantize(qa, qt)
        if "attn_q" in gname:
            deq = unpermute_qk(torch.from_numpy(np.ascontiguousarray(deq)), cfg.num_attention_heads).numpy()
        elif "attn_k" in gname:
            deq = unpermute_qk(torch.from_numpy(np.ascontiguousarray(deq)), cfg.num_key_value_heads).numpy()
        real[hname] = torch.from_numpy(np.ascontiguousarray(deq))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return real


def test_gguf_quantized_loader_matches_dequantized_weights(tmp_path):
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    T = gguf.GGMLQuantizationType
    torch.manual_seed(0)
    hc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_theta=10000.0, tie_word_embeddings=False)
    hf = LlamaForCausalLM(hc).eval()
    qtypes = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.F16, "ffn_gate": T.Q4_1,
              "ffn_up": T.Q8_0, "ffn_down": T.Q4_0, "token_embd": T.Q8_0, "output": T.F16}
    real = _write_gguf(tmp_path / "tiny.gguf", hf, qtypes=qtypes)
    hf.load_state_dict(real)
    ours = load_gguf(tmp_path / "tiny.gguf", dtype=torch.float32, device="cpu", load_tokenizer=False)
    assert ours.cfg.arch == "llama" and ours.cfg.num_kv_heads == 2 and not ours.cfg.tie_word_embeddings
    assert ours.cfg.eos_token_ids == (2,)
    ids = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), cpu_backend("reference"):
        ref = hf(ids[None]).logits[0]
        got = ours.forward(ids)
    assert (got - ref).abs().max().item() < 1e-3


def test_gguf_bad_files(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(FileNotFoundError, match="not found"):
        load_gguf(tmp_path / "missing.gguf", load_tokenizer=False)
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="corrupt|cannot read"):
        load_model(str(bad), device="cpu")
    notg = tmp_path / "text.gguf"
    notg.write_text("hello")
    with pytest.raises(ValueError):
        load_model(str(notg), device="cpu")
    hc = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    _write_gguf(tmp_path / "gpt2.gguf", LlamaForCausalLM(hc), arch="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_gguf(tmp_path / "gpt2.gguf", load_tokenizer=False)


# ------------------------------------------------------------------------------------------ presets
def test_presets_and_unknown():
    for name, (L, hq, hkv, d) in {"llama-3.1-8b": (32, 32, 8, 128), "llama-3.2-1b": (16, 32, 8, 64),
                                  "qwen3-8b": (36, 32, 8, 128), "qwen3-0.6b": (28, 16, 8, 128)}.items():
        c = get_preset(name)
        assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (L, hq, hkv, d)
    assert abs(get_preset("llama-3.1-8b").num_params() / 8.03e9 - 1) < 0.01
    assert abs(get_preset("qwen3-8b").num_params() / 8.19e9 - 1) < 0.01
    with pytest.raises(ValueError, match="unknown model preset|unknown model"):
        LLM("llama-9-900b", device="cpu")
    with pytest.raises(ValueError, match="unknown model"):
        load_model("definitely-not-a-model", device="cpu")


def test_random_preset_runs_on_cpu():
    m = random_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    assert m.tokenizer is None and m.cfg.qk_norm
    out = LLM(m, max_model_len=64).generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text is None
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(m).generate("text")


# ------------------------------------------------------------------------------------------ modes
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
    assert llm.engine.sequences() == []  # freed at the end
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
    b = LLM(m, mode="offload", max_model_len=4096).generate(ids, sp)[0]
    assert a.token_ids == b.token_ids
    assert a.peak_gpu_memory_bytes > 0 and b.timings["decode_ms_per_token"] > 0


def test_device_position_step_equals_host_position_step():
    """The graph-safe decode body (position and lengths on the device, advanced in place) gives the
    same logits as host-driven eager steps (CPU: the body of the CUDA-graph path, without a graph)."""
    from xoffload.models.llm import _GPUCache

    m = _tiny_random("tiny-llama")
    ids = torch.arange(3, 40)
    T, n_new = ids.numel(), 6
    caches = [_GPUCache(m.cfg, T + n_new, m.dtype, m.device, m.scale, max_len=T + n_new) for _ in range(2)]
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
    """gpu mode with the CUDA-graph decode == the eager loop == offload mode, token for token over 32
    steps (greedy and seeded sampling), on a random Llama-3.2-1B (bf16, 2000-token prompt); the
    graph really is captured and replayed, and released at the end of each request."""
    from xoffload.models import llm as llm_mod

    seen = []
    orig_close = llm_mod._GraphDecode.close

    def spy_close(self):
        seen.append(self.graph is not None)
        orig_close(self)

    monkeypatch.setattr(llm_mod._GraphDecode, "close", spy_close)
    m = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0, std=0.02)
    ids = torch.randint(0, m.cfg.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    graph = LLM(m, mode="gpu", max_model_len=4096)
    eager = LLM(m, mode="gpu", max_model_len=4096, cuda_graph=False)
    off = LLM(m, mode="offload", max_model_len=4096)
    for sp in (SamplingParams(max_tokens=33, ignore_eos=True),
               SamplingParams(max_tokens=33, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)):
        a = graph.generate(ids, sp)[0]
        b = eager.generate(ids, sp)[0]
        c = off.generate(ids, sp)[0]
        assert len(a.token_ids) == 33 and a.timings["decode_steps"] == 32
        assert a.token_ids == b.token_ids
        assert a.token_ids == c.token_ids
        # a second request on the same LLM (fresh graph, nothing shared) gives the same tokens
        assert graph.generate(ids, sp)[0].token_ids == a.token_ids
    assert seen == [True] * 4


def test_twenty_requests_share_nothing():
    """20 requests of different lengths in one LLM, one after another, each equal to a fresh LLM."""
    m = _tiny_random("tiny-llama")
    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 120, (20,), generator=g)]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    sps = [SamplingParams(max_tokens=int(3 + i % 5), temperature=0.7 if i % 3 == 0 else 0.0, seed=i) for i in range(20)]
    for mode in ("gpu", "offload"):
        shared = LLM(m, mode=mode, max_model_len=160, kv_block_size=32, num_kv_buffers=2)
        for p, sp in zip(prompts, sps):
            got = shared.generate(p, sp)[0]
            fresh = LLM(m, mode=mode, max_model_len=160, kv_block_size=32, num_kv_buffers=2).generate(p, sp)[0]
            assert got.token_ids == fresh.token_ids, (mode, len(p))
        if mode == "offload":
            assert shared.engine.sequences() == []
    # several prompts in one call == one by one
    llm = LLM(m, mode="offload", max_model_len=160, kv_block_size=32)
    many = llm.generate(prompts[:4], SamplingParams(max_tokens=5))
    assert [o.token_ids for o in many] == [llm.generate(p, SamplingParams(max_tokens=5))[0].token_ids for p in prompts[:4]]


def test_eos_stops_and_length_cap():
    m = _tiny_random("tiny-llama")
    ids = list(range(10, 30))
    base = LLM(m, max_model_len=64).generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    for mode in ("gpu", "offload"):
        llm = LLM(m, mode=mode, max_model_len=64, kv_block_size=16)
        o = llm.generate(ids, SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,)))[0]
        assert o.finish_reason == "stop" and o.token_ids == base.token_ids[:first + 1]
        # prompt + generated never exceeds max_model_len: 60 prompt tokens leave room for 5 new ones
        o = llm.generate(list(range(60)), SamplingParams(max_tokens=50, ignore_eos=True))[0]
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.timings["decode_steps"] == 4 and o.timings["prefill_tok_per_s"] > 0


def test_timings_fields():
    llm = _tiny_llm()
    o = llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(o) == 2
    t = o[0].timings
    for k in ("prefill_ms", "prefill_tok_per_s", "ttft_ms", "decode_ms_per_token", "decode_steps", "total_ms"):
        assert k in t
    assert t["prompt_tokens"] == 4 and t["ttft_ms"] >= t["prefill_ms"] and o[0].peak_gpu_memory_bytes is None


# ------------------------------------------------------------------------------------------ sparse
def test_sparse_xattn_hook():
    pytest.importorskip("xoffload.sparse.xattention")
    m = _tiny_random("tiny-llama")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    dense = LLM(m, max_model_len=512).generate(ids, sp)[0]
    for mode in ("gpu", "offload"):
        # threshold 1 keeps every causal block: the same tokens as dense attention
        kw = dict(sparse_block_size=64, sparse_kwargs={"dense_fallback_len": 0}, kv_block_size=64)
        llm = LLM(m, mode=mode, max_model_len=512, sparse="xattn", sparse_threshold=1.0, dense_layers=[0], **kw)
        o = llm.generate(ids, sp)[0]
        assert o.token_ids == dense.token_ids
        d = o.timings["density"]
        assert d[0] is None and d[1] is not None and abs(d[1] - 1.0) < 1e-6
        # a low threshold really skips blocks
        o = LLM(m, mode=mode, max_model_len=512, sparse="xattn", sparse_threshold=0.05, dense_layers=[],
                **kw).generate(ids, sp)[0]
        assert all(x is not None for x in o.timings["density"]) and o.timings["mean_density"] < 1.0
    with pytest.raises(ValueError, match="sparse"):
        LLM(m, sparse="bogus")


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_then_still_serves():
    m = _tiny_random("tiny-llama")
    for mode in ("gpu", "offload"):
        llm = LLM(m, mode=mode, max_model_len=32, kv_block_size=8)
        good = llm.generate([1, 2, 3], SamplingParams(max_tokens=4))[0].token_ids
        with pytest.raises(ValueError, match="empty"):
            llm.generate([])
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[1, 2], []])
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(list(range(33)))
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([1, 2, 10**6])
        with pytest.raises(TypeError):
            llm.generate([1.5, 2])
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0)
        # a failure inside a request frees its KV; the next request is unaffected
        orig = m.prefill

        def boom(*a, **k):
            raise RuntimeError("injected")

        m.prefill = boom
        try:
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate([1, 2, 3])
        finally:
            m.prefill = orig
        if mode == "offload":
            assert llm.engine.sequences() == []
        assert llm.generate([1, 2, 3], SamplingParams(max_tokens=4))[0].token_ids == good
    with pytest.raises(ValueError, match="mode"):
        LLM(m, mode="disk")


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")


def test_prefill_attn_sdpa_matches_xoffload():
    m = _tiny_random("tiny-qwen3")
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a = LLM(m, max_model_len=128, prefill_chunk=32).generate(ids, sp)[0]
    b = LLM(m, mode="offload", max_model_len=128, prefill_chunk=32, prefill_attn="sdpa", kv_block_size=32).generate(ids, sp)[0]
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="prefill_attn"):
        LLM(m, prefill_attn="flash3")
    with pytest.raises(ValueError, match="cudnn"):  # the model is on the CPU
        LLM(m, prefill_attn="cudnn")


def _staging_run(device, dtype):
    from xoffload.kernels import cpu_backend
    from xoffload.models.llm import _GPUCache, _OffloadKV

    import dataclasses

    from xoffload.models.config import get_preset

    cfg4 = dataclasses.replace(get_preset("tiny-llama"), num_layers=5)
    m = random_model(cfg4, dtype=dtype, device=device, seed=1, std=0.15)
    cfg = m.cfg
    llm = LLM(m, mode="offload", max_model_len=256, kv_block_size=32)
    ids = torch.randint(0, cfg.vocab_size, (77,), generator=torch.Generator().manual_seed(5)).to(device)
    seq = llm.engine.add_sequence()
    kv = _OffloadKV(llm.engine, seq, cfg, m.dtype, m.device, m.scale)
    ptrs = []
    orig = kv.buffers

    def spy(layer, T):
        k, v = orig(layer, T)
        ptrs.append((k.data_ptr(), v.data_ptr()))
        return k, v

    kv.buffers = spy
    ref = _GPUCache(cfg, 80, m.dtype, m.device, m.scale)
    with torch.no_grad(), cpu_backend("reference"):
        a = m.prefill(ids, kv, chunk=32)
        b = m.prefill(ids, ref, chunk=32)
    # layers alternate between two staging buffers (bounded memory), and every layer's K/V
    # reached the pool intact although the buffers were overwritten two layers later
    assert len(set(ptrs)) == 2 and all(ptrs[i] == ptrs[i % 2] for i in range(len(ptrs)))
    assert torch.equal(a, b)
    for layer in range(cfg.num_layers):
        hk, hv = llm.engine.host_kv(seq, layer)
        assert torch.equal(hk, ref.k[layer, :77].cpu()) and torch.equal(hv, ref.v[layer, :77].cpu())
    llm.close()


def test_offload_prefill_alternates_two_staging_buffers():
    _staging_run("cpu", torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_prefill_staging_reuse_cuda():
    _staging_run("cuda", torch.bfloat16)
