"""Decode attention (one query token per sequence) over a KV cache, returning LSE.

Split-KV "flash-decoding" (Dao, Haziza, Massa, Sizov 2023): the keys of each sequence are cut into
``num_splits`` chunks that run in parallel, each producing a partial (output, LSE) in fp32; a second
kernel merges the splits exactly by their LSE (:mod:`xoffload.kernels.merge`). The query heads that
share a KV head (GQA group) are packed into the M dimension of one program so that ``tl.dot`` sees
>= 16 rows and each K/V tile is read from HBM once per group.
"""
from __future__ import annotations

import torch

from . import reference
from ._common import check_heads, check_same, check_tensor, default_scale, use_triton

__all__ = ["decode_attn_with_lse"]


def _check_inputs(q, k_cache, v_cache, cache_seqlens, check: bool):
    check_tensor("q", q, ndim=4)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    check_same([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    b, sq, hq, d = q.shape
    if sq != 1:
        raise ValueError(f"q must have shape [B, 1, Hq, D] (one query token), got {tuple(q.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape"
        )
    bk, s_max, hkv, dk = k_cache.shape
    if bk != b:
        raise ValueError(f"k_cache batch {bk} != q batch {b} (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})")
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} != q head_dim {d} (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})")
    check_heads(hq, hkv, d, "q", "k_cache")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have shape [B] = [{b}], got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    if check and b > 0:
        # Host read (one small D2H copy, synchronising the stream): validation only. Callers that
        # capture CUDA graphs or run a hot loop pass check=False; the kernel then clamps each
        # length to [0, S_max] so that it never reads outside the cache.
        lens = cache_seqlens.cpu()
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > s_max:
            raise ValueError(
                f"cache_seqlens must be in [0, S_max={s_max}] (k_cache {tuple(k_cache.shape)}), "
                f"got min {lo}, max {hi}"
            )


def decode_attn_with_lse(q, k_cache, v_cache, cache_seqlens, *, softmax_scale=None, num_splits=None,
                         check=True):
    """Attention of one new query token per sequence over its cached keys/values, with LSE.

    Args:
        q: ``[B, 1, Hq, D]`` fp16/bf16/fp32 (only the last dim must be contiguous).
        k_cache, v_cache: ``[B, S_max, Hkv, D]``, same dtype/device as q, any strides but the last
            dim (e.g. slices of a larger buffer). ``Hq % Hkv == 0``; query head h reads KV head
            ``h // (Hq // Hkv)``. ``D <= 256``.
        cache_seqlens: int32 ``[B]`` on q's device; sequence b attends to its first
            ``cache_seqlens[b]`` cached tokens, ``0 <= cache_seqlens[b] <= S_max``. 0 gives output 0
            and LSE -inf.
        softmax_scale: default ``1/sqrt(D)``.
        num_splits: number of key chunks per sequence (Triton path). Default: chosen from the
            shapes only (B, Hkv, S_max, the GPU's SM count), never from the values of
            ``cache_seqlens``, so a CUDA graph captured once stays valid as lengths grow.
        check: when True (default) the lengths are read on the host once to validate them (a
            small device->host copy that synchronises the stream). Pass False inside CUDA-graph
            capture or a hot loop; lengths are then clamped to ``[0, S_max]`` in the kernel.

    Returns:
        ``(out, lse)``: out ``[B, 1, Hq, D]`` in q.dtype; lse fp32 ``[B, Hq, 1]`` (natural log).

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, cache_seqlens not int32.
        ValueError: wrong ranks/shapes (named with their shapes), Hq % Hkv != 0, D > 256, a
            non-contiguous last dim, different devices, cache_seqlens of the wrong length or
            (with check=True) outside ``[0, S_max]``, an invalid softmax_scale or num_splits.
    """
    _check_inputs(q, k_cache, v_cache, cache_seqlens, check)
    scale = default_scale(q.shape[-1], softmax_scale)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    b, _, hq, d = q.shape
    if b == 0:
        return (torch.empty(0, 1, hq, d, dtype=q.dtype, device=q.device),
                torch.empty(0, hq, 1, dtype=torch.float32, device=q.device))
    if use_triton(q):
        return _decode_triton(q, k_cache, v_cache, cache_seqlens, scale, num_splits)
    s_max = k_cache.shape[1]
    lens = cache_seqlens.clamp(0, s_max)
    out, lse = reference.decode_attention_ref(q, k_cache, v_cache, lens, softmax_scale=scale)
    return out.to(q.dtype), lse


def _decode_triton(q, k_cache, v_cache, cache_seqlens, scale, num_splits):
    # Placeholder until the split-KV Triton kernel lands: the fp32 reference (same results).
    s_max = k_cache.shape[1]
    lens = cache_seqlens.clamp(0, s_max)
    out, lse = reference.decode_attention_ref(q, k_cache, v_cache, lens, softmax_scale=scale)
    return out.to(q.dtype), lse
