"""Sampling (xoffload.engine.sampling): parameter checks, greedy, tiny temperatures, top-p."""
import pytest
import torch

from xoffload.engine import SamplingParams, sample


def test_params_checked():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_sample_greedy_tiny_temperature_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert int(sample(logits, SamplingParams(), g)) == 1
    assert int(sample(logits, SamplingParams(temperature=1e-45), g)) == 1  # one-hot, no NaN
    # top_p small: only the most likely token survives
    picks = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.01), g)) for _ in range(20)}
    assert picks == {1}
    picks = {int(sample(logits, SamplingParams(temperature=1.0), g)) for _ in range(200)}
    assert {1, 3} <= picks


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample(logits, SamplingParams(temperature=5.0, top_k=2), g)) for _ in range(200)}
    assert picks == {1, 3}
    assert int(sample(logits, SamplingParams(top_k=1), g)) == 1
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
