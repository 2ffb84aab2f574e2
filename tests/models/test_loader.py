"""Loaders (xoffload.models.loader): GGUF loading (quantized, q/k permutation) against the
dequantized weights, random presets, and errors that name the file and the problem (found by
adversarial testing)."""
import json
import os

import numpy as np
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kernels import cpu_backend
from xoffload.models import load_gguf, load_hf_dir, load_model, random_model
from xoffload.models.loader import unpermute_qk


def test_malformed_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_hf_dir(str(tmp_path), device="cpu")


def test_config_missing_key_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json.*missing required key"):
        load_hf_dir(str(tmp_path), device="cpu")


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


def test_random_preset_runs_on_cpu():
    m = random_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    assert m.tokenizer is None and m.cfg.qk_norm
    out = LLM(m, max_model_len=64).generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text is None
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(m).generate("text")


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")



# ---------------------------------------------------------------------------- device resolution
def test_resolve_dtype_device_cpu_and_defaults():
    from xoffload.models.loader import resolve_dtype_device

    assert resolve_dtype_device(None, "cpu") == (torch.float32, torch.device("cpu"))
    assert resolve_dtype_device("bf16", torch.device("cpu")) == (torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_dtype_device(None, "tpu")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype_device("int8", "cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7", torch.device("cuda")],
                         ids=["plain", "index0", "index7", "torch_device"])  # an id "cuda" would be skipped on CPUs
def test_cuda_without_cuda_is_one_value_error(monkeypatch, device):
    """Asking for CUDA where there is none (a CPU build of torch, or no visible GPU): a ValueError
    naming the device, not torch's AssertionError "Torch not compiled with CUDA enabled"."""
    from xoffload.models.loader import resolve_dtype_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda(:\d)?' asked for, but no CUDA is available") as e:
        resolve_dtype_device(None, device)
    assert "device='cpu'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_llm_on_cuda_without_cuda_says_so():
    import xoffload

    with pytest.raises(ValueError, match="device 'cuda' asked for, but no CUDA is available"):
        xoffload.LLM("tiny-llama", device="cuda")
