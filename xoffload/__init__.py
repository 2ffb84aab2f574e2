"""xoffload: long-context LLM inference on one GPU whose memory cannot hold the KV cache.

Layers: :mod:`xoffload.kernels` (Triton attention with LSE), :mod:`xoffload.runtime` (pinned CPU
KV pool, GPU layer ring), :mod:`xoffload.sparse` (block-selection policies, XAttention),
:mod:`xoffload.models` (Llama/Qwen3 and loaders), :mod:`xoffload.engine` (``LLM``, KV stores),
:mod:`xoffload.evals` (needle and RULER-style tasks), :mod:`xoffload.integrations` (transformers,
flash-attn-style API, torch custom ops).
"""
__version__ = "0.1.0"

from .integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from .sparse import DensePrefill, PrefillPolicy, XAttentionPrefill, xattention_prefill

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "PrefillPolicy", "DensePrefill",
           "XAttentionPrefill", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "xattention_prefill"]
