"""xoffload: long-context LLM inference on one GPU whose memory cannot hold the KV cache.

Layers: :mod:`xoffload.kernels` (Triton attention with LSE), :mod:`xoffload.runtime` (pinned CPU
KV pool, GPU layer ring), :mod:`xoffload.sparse` (block-selection policies, XAttention),
:mod:`xoffload.models` (Llama/Qwen3 and loaders), the engine (``LLM``), :mod:`xoffload.evals`
(needle and RULER-style tasks), :mod:`xoffload.integrations` (transformers, flash-attn-style API,
torch custom ops).
"""
__version__ = "0.1.0"

from .integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .models.llm import LLM, SamplingParams
from .sparse.xattention import xattention_prefill

__all__ = ["LLM", "SamplingParams", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "xattention_prefill"]
