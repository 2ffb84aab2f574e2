"""Loader errors name the file and the problem (found by adversarial testing)."""
import json

import pytest

from xoffload.models import load_hf_dir


def test_malformed_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_hf_dir(str(tmp_path), device="cpu")


def test_config_missing_key_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json.*missing required key"):
        load_hf_dir(str(tmp_path), device="cpu")


def test_llm_option_and_sampling_edges():
    """Found by adversarial testing: out-of-range sparse options are refused at construction; a
    tiny temperature samples (one-hot) instead of failing inside torch.multinomial."""
    from xoffload.models import LLM, SamplingParams

    with pytest.raises(ValueError, match="sparse_threshold"):
        LLM("tiny-llama", device="cpu", sparse="xattn", sparse_threshold=2.0)
    with pytest.raises(ValueError, match="dense_layers"):
        LLM("tiny-llama", device="cpu", sparse="xattn", dense_layers=(99,))
    llm = LLM("tiny-llama", device="cpu")
    greedy = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids
    tiny = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=1e-45, max_tokens=4))[0].token_ids
    assert tiny == greedy
