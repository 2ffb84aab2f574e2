"""xoffload: long-context LLM inference on one GPU whose memory cannot hold the KV cache.

Layers: :mod:`xoffload.kernels` (Triton attention with LSE), :mod:`xoffload.runtime` (pinned CPU
KV pool, GPU layer ring), :mod:`xoffload.sparse` (block-selection policies, XAttention),
:mod:`xoffload.models` (Llama/Qwen3, ``LLM``), :mod:`xoffload.integrations` (transformers,
flash-attn-style API, torch custom ops).
"""
__version__ = "0.1.0"

import importlib as _importlib

_LAZY = {
    "flash_attn_func": "xoffload.integrations.flash_api",
    "flash_attn_varlen_func": "xoffload.integrations.flash_api",
    "flash_attn_with_kvcache": "xoffload.integrations.flash_api",
    "xattention_prefill": "xoffload.sparse.xattention",
    "LLM": "xoffload.models",
    "SamplingParams": "xoffload.models",
}


def __getattr__(name):
    """Lazy top-level names (flash-attn-style API, xattention_prefill, LLM): nothing heavy is
    imported until first use."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'xoffload' has no attribute {name!r}")
    value = getattr(_importlib.import_module(mod), name)
    globals()[name] = value
    return value
