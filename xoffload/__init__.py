"""xoffload: long-context LLM inference on one GPU whose memory cannot hold the KV cache.

Layers: :mod:`xoffload.kernels` (Triton attention with LSE), :mod:`xoffload.runtime` (pinned CPU
KV pool, GPU layer ring), :mod:`xoffload.sparse` (block-selection policies, XAttention),
:mod:`xoffload.models` (Llama/Qwen3, ``LLM``), :mod:`xoffload.integrations` (transformers,
flash-attn-style API, torch custom ops).
"""
__version__ = "0.1.0"
