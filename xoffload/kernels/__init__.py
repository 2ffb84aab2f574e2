"""Triton attention kernels that return log-sum-exp, with PyTorch references.

Conventions (DESIGN.md): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (flash-attn layout, GQA
with ``Hq % Hkv == 0``); LSE natural log, fp32, ``[B, Hq, Sq]``; causal is bottom-right aligned;
rows that see no key give output 0 and LSE -inf. CUDA tensors run the Triton kernels; CPU tensors
run the reference, or the Triton code under ``TRITON_INTERPRET=1``.

Names are imported lazily (Triton is imported on first use).
"""
from __future__ import annotations

import importlib

from ._common import cpu_backend, interpreter_on

_LAZY = {
    "flash_attn_with_lse": ".flash_attn",
    "flash_attn_varlen_with_lse": ".flash_attn",
    "causal_attention": ".prefill_attention",
    "causal_attention_backend": ".prefill_attention",
    "decode_attn_with_lse": ".decode",
    "paged_decode_attn_with_lse": ".paged_decode",
    "merge_attention_states": ".merge",
    "merge_attention_states_n": ".merge",
    "merge_attention_states_": ".merge",
    "block_sparse_attn_with_lse": ".block_sparse",
    "BlockIndex": ".block_sparse",
    "block_mask_to_indices": ".block_sparse",
    "XAttnChunkStats": ".xattn",
    "xattn_estimate": ".xattn",
    "xattn_chunk_stats": ".xattn",
    "xattn_merge_stats": ".xattn",
    "xattn_block_scores": ".xattn",
    "select_blocks": ".block_select",
    "kv_head_union": ".block_select",
    "mask_density": ".block_select",
    "causal_block_visibility": ".block_select",
    "forced_blocks": ".block_select",
    "rms_norm": ".norm",
    "silu_mul": ".swiglu",
    "qkv_rope": ".rope",
}

__all__ = sorted(_LAZY) + ["cpu_backend", "interpreter_on"]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'xoffload.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
