"""Sparse attention policies: which KV blocks a step needs.

- :class:`FullPrefill`: every block (dense attention).
- :class:`XAttentionPrefill` / :func:`xattention_prefill`: XAttention estimate + block selection +
  block-sparse attention for prefill (Xu et al. 2025).

Both policies are callables ``policy(q, k, v) -> (out, lse, density)`` with q ``[B, Sq, Hq, D]``,
k/v ``[B, Sk, Hkv, D]``, causal bottom-right prefill; density is an fp32 ``[Hq]`` tensor (kept
fraction of the causally visible blocks per query head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .xattention import DEFAULT_DENSE_FALLBACK_LEN, DEFAULT_DENSE_LAST_Q, xattention_mask, xattention_prefill

__all__ = ["FullPrefill", "XAttentionPrefill", "xattention_prefill", "xattention_mask", "full", "xattention"]


@dataclass(frozen=True)
class FullPrefill:
    """Dense causal prefill (:func:`xoffload.kernels.flash_attn_with_lse`); density is all ones."""

    causal: bool = True

    def __call__(self, q, k, v):
        from ..kernels import flash_attn_with_lse

        out, lse = flash_attn_with_lse(q, k, v, causal=self.causal)
        return out, lse, torch.ones(q.shape[2], dtype=torch.float32, device=q.device)


@dataclass(frozen=True)
class XAttentionPrefill:
    """XAttention prefill with fixed settings (see :func:`xattention_prefill` for their meaning)."""

    threshold: float = 0.9
    stride: int = 8
    block_size: int = 128
    chunk_size: int | None = None
    dense_fallback_len: int = DEFAULT_DENSE_FALLBACK_LEN
    keep_last: int = 0
    dense_last_q: int | None = DEFAULT_DENSE_LAST_Q
    causal: bool = True

    def __call__(self, q, k, v):
        return xattention_prefill(q, k, v, threshold=self.threshold, stride=self.stride,
                                  block_size=self.block_size, chunk_size=self.chunk_size,
                                  dense_fallback_len=self.dense_fallback_len, keep_last=self.keep_last,
                                  dense_last_q=self.dense_last_q, causal=self.causal)


def full(causal: bool = True) -> FullPrefill:
    """The dense policy."""
    return FullPrefill(causal=causal)


def xattention(threshold: float = 0.9, stride: int = 8, **kwargs) -> XAttentionPrefill:
    """The XAttention prefill policy (keyword arguments as :class:`XAttentionPrefill`)."""
    return XAttentionPrefill(threshold=threshold, stride=stride, **kwargs)
