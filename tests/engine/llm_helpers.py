"""Shared setup of the engine tests: tiny random models (built once per process) and LLMs on them."""
import torch

from xoffload.engine import LLM
from xoffload.models import random_model

_RANDOM = {}


def tiny_random(arch="tiny-llama"):
    """A tiny random model (fp32, CPU, weights scaled so greedy tokens vary), cached per arch."""
    if arch not in _RANDOM:
        _RANDOM[arch] = random_model(arch, dtype=torch.float32, device="cpu", seed=1, std=0.15)
    return _RANDOM[arch]


def tiny_llm(mode="gpu", arch="tiny-llama", max_model_len=256, **kw):
    return LLM(tiny_random(arch), mode=mode, max_model_len=max_model_len, **kw)
