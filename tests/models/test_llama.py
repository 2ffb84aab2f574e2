"""LlamaModel (xoffload.models.llama): tiny random Llama / Qwen3 against transformers with the same
weights (logits, and greedy tokens through LLM in both KV modes).

CPU runs use fp32 and the kernels' PyTorch references (LLM does that itself on the CPU).
"""
import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kernels import cpu_backend
from xoffload.models import load_hf_dir


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

