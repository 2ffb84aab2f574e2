"""Model configs (xoffload.models.config): HF config variants, Llama-3 RoPE scaling against
transformers, presets."""
import pytest
import torch

from xoffload.engine import LLM
from xoffload.models import get_preset, load_model
from xoffload.models.config import config_from_hf, rope_inv_freq


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

