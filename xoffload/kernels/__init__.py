"""Triton attention kernels that return log-sum-exp, with PyTorch references.

Conventions (docs/DESIGN.md): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (flash-attn layout, GQA
with ``Hq % Hkv == 0``); LSE natural log, fp32, ``[B, Hq, Sq]``; causal is bottom-right aligned;
rows that see no key give output 0 and LSE -inf. CUDA tensors run the Triton kernels; CPU tensors
run the reference (:mod:`xoffload.kernels.reference`), or the Triton code under ``TRITON_INTERPRET=1``.

One op per module: ``flash_attn`` (dense prefill, padded and varlen), ``decode`` (split-KV decode),
``merge`` (LSE merge), ``block_sparse`` (block-sparse prefill), ``block_index`` (its mask ->
index lists), ``xattn`` (XAttention's strided estimate), ``norm`` / ``swiglu`` / ``rope`` (fused
per-token layer ops; ``rope`` also has flash-attn's ``apply_rotary``), ``paged_decode`` (decode
over a page list per KV head, pages on the GPU or in pinned host memory, row stores or flash-attn's
block stores, 16-bit or fp8 e4m3 pages; ``decode`` and ``paged_decode`` take flash-attn's inference
options: several query tokens, causal, window, softcap, ALiBi, left padding), ``fp8`` (e4m3 KV
pages: quantization with per-page or per-token fp32 scales, dequantization, the GPU check),
``gather`` (block copy out of pinned host memory), ``attention_dispatch`` (picks cuDNN or ours for whole-prompt causal attention), ``topk`` (exact
top-k indices per row: sparse decode's page choice); ``checks``
holds the shared input checks and dispatch rules, ``launch`` the launch-config type and the one
override hook (:func:`launch_override`).
"""
from __future__ import annotations

from .attention_dispatch import causal_attention, causal_attention_backend
from .block_index import BlockIndex, block_mask_to_indices
from .block_sparse import block_sparse_attn_with_lse
from .checks import cpu_backend, interpreter_on
from .decode import decode_attn_with_lse
from .flash_attn import flash_attn_varlen_with_lse, flash_attn_with_lse
from .fp8 import check_fp8_supported, dequantize_kv_fp8, quantize_kv_fp8
from .gather import gather_blocks
from .launch import LaunchConfig, launch_override
from .merge import merge_attention_states, merge_attention_states_, merge_attention_states_n
from .paged_decode import paged_decode_attn_with_lse
from .norm import rms_norm
from .rope import apply_rotary, qkv_rope
from .swiglu import silu_mul
from .topk import topk_ids
from .xattn import XAttnChunkStats, xattn_block_scores, xattn_chunk_stats, xattn_estimate, xattn_merge_stats

__all__ = [
    "BlockIndex", "LaunchConfig", "XAttnChunkStats", "apply_rotary", "block_mask_to_indices", "block_sparse_attn_with_lse",
    "causal_attention", "causal_attention_backend", "check_fp8_supported", "cpu_backend", "decode_attn_with_lse",
    "dequantize_kv_fp8",
    "flash_attn_varlen_with_lse", "flash_attn_with_lse", "gather_blocks", "interpreter_on", "launch_override",
    "merge_attention_states", "merge_attention_states_", "merge_attention_states_n", "paged_decode_attn_with_lse",
    "qkv_rope", "quantize_kv_fp8", "rms_norm", "silu_mul", "topk_ids", "xattn_block_scores", "xattn_chunk_stats",
    "xattn_estimate", "xattn_merge_stats",
]
