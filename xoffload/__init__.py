"""xoffload: long-context LLM inference on one GPU whose memory cannot hold the KV cache.

Layers: :mod:`xoffload.kernels` (Triton attention with LSE), :mod:`xoffload.runtime` (pinned CPU
KV pool, GPU layer ring), :mod:`xoffload.sparse` (block-selection policies, XAttention),
:mod:`xoffload.models` (Llama/Qwen3 and loaders), :mod:`xoffload.engine` (``LLM``, KV stores),
:mod:`xoffload.evals` (needle and RULER-style tasks), :mod:`xoffload.integrations` (transformers,
flash-attn-style API, torch custom ops).
"""
__version__ = "0.1.0"

from ._lazy import lazy_exports

# Names resolved on first use (PEP 562), so that ``import xoffload`` and the command line's
# ``--help`` load no torch, Triton or model code.
_LAZY = {
    "LLM": ".engine", "LLMEngine": ".engine", "EngineConfig": ".engine", "RequestOutput": ".engine",
    "SamplingParams": ".engine",
    "PrefillPolicy": ".sparse", "DensePrefill": ".sparse", "XAttentionPrefill": ".sparse",
    "xattention_prefill": ".sparse",
    "flash_attn_func": ".integrations.flash_api", "flash_attn_varlen_func": ".integrations.flash_api",
    "flash_attn_with_kvcache": ".integrations.flash_api",
}

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "PrefillPolicy", "DensePrefill",
           "XAttentionPrefill", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "xattention_prefill"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
