"""flash-attn 2 style entry points backed by xoffload's Triton kernels.

Code written for ``flash_attn`` switches by changing the import::

    from xoffload.integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The argument names, defaults, shapes and return conventions are those of flash-attn 2.x
(``flash_attn/flash_attn_interface.py``): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (GQA when
``Hq % Hkv == 0``), packed varlen ``[total, H, D]`` with int32 ``cu_seqlens`` of length B+1, causal
aligned to the bottom-right corner, ``softmax_lse`` fp32 natural log ``[B, Hq, Sq]`` (varlen
``[Hq, total_q]``).

Differences from flash-attn, all explicit:

* Forward only. Inputs that require grad while grad mode is on raise ``NotImplementedError`` (use
  ``torch.no_grad()`` / ``torch.inference_mode()``).
* Not supported (raise ``NotImplementedError`` naming the option): ``dropout_p > 0``,
  ``window_size != (-1, -1)``, ``softcap != 0``, ``alibi_slopes``, ``block_table`` (paged KV),
  ``rotary_cos``/``rotary_sin``, ``cache_leftpad``. ``deterministic`` and ``num_splits`` are
  accepted and ignored (the forward pass is deterministic; the split count is chosen by the kernel).
* fp32 inputs are accepted as well as fp16/bf16; CPU tensors run the PyTorch reference (or the
  Triton code under ``TRITON_INTERPRET=1``).
* A query row that sees no key returns output 0 and LSE ``-inf`` (flash-attn returns ``+inf``
  there); ``-inf`` is the log of the empty sum and merges correctly.
"""
from __future__ import annotations

import torch

from xoffload.kernels.checks import check_bool, check_same, check_tensor

from . import ops

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _unsupported(fn: str, *, dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, **others):
    """Raise NotImplementedError naming the first option that is set to something unsupported."""
    if dropout_p is not None and float(dropout_p) != 0.0:
        raise NotImplementedError(f"{fn}: dropout_p={dropout_p} is not supported (xoffload is forward/inference only; use 0.0)")
    if window_size is None or tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"{fn}: window_size={window_size} (sliding-window / local attention) is not supported; use (-1, -1)"
        )
    if softcap is not None and float(softcap) != 0.0:
        raise NotImplementedError(f"{fn}: softcap={softcap} is not supported; use 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{fn}: alibi_slopes is not supported; pass None")
    for name, val in others.items():
        if val is not None:
            raise NotImplementedError(f"{fn}: {name} is not supported; pass None")


def _prologue(fn: str, causal, tensors, **options) -> bool:
    """The checks every entry point starts with: unsupported options (NotImplementedError), inputs
    requiring grad under grad mode (NotImplementedError), ``causal`` a bool (TypeError: ``bool("False")``
    would be True). Returns ``causal``."""
    _unsupported(fn, **options)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"{fn}: xoffload attention is forward-only (no backward); an input requires grad. "
            "Run under torch.no_grad() or torch.inference_mode(), or detach the inputs"
        )
    return check_bool(f"{fn}: causal", causal)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Dense (optionally causal, GQA) attention, flash-attn 2's ``flash_attn_func``.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32; k, v: ``[B, Sk, Hkv, D]`` (``Hq % Hkv == 0``,
            D <= 256, last dim contiguous).
        dropout_p: must be 0.0 (else NotImplementedError).
        softmax_scale: scale of QK^T before the softmax; default ``1/sqrt(D)``.
        causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + Sk - Sq``).
        window_size, softcap, alibi_slopes: only the defaults are supported.
        deterministic: ignored (the forward pass is deterministic).
        return_attn_probs: if True return ``(out, softmax_lse, None)`` like flash-attn (which also
            returns None as the third element when dropout is off).

    Returns:
        out ``[B, Sq, Hq, D]`` in q's dtype; with ``return_attn_probs`` also softmax_lse
        ``[B, Hq, Sq]`` fp32 (natural log) and None.

    Raises:
        NotImplementedError: an unsupported option, or inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes, devices or ``softmax_scale`` (from the kernel).
    """
    causal = _prologue("flash_attn_func", causal, (q, k, v), dropout_p=dropout_p, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = ops.flash_attn(q, k, v, causal, softmax_scale)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Variable-length (packed) attention, flash-attn 2's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths (start at 0, end at total).
        max_seqlen_q, max_seqlen_k: int, the longest sequence in the batch.
        causal: bottom-right aligned per sequence.
        block_table: paged KV is not supported (must be None).
        Other options as :func:`flash_attn_func`.

    Returns:
        out ``[total_q, Hq, D]``; with ``return_attn_probs`` also softmax_lse ``[Hq, total_q]``
        fp32 and None.

    Raises:
        NotImplementedError: an unsupported option, or inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes or cu_seqlens (from the kernel).
    """
    causal = _prologue("flash_attn_varlen_func", causal, (q, k, v), dropout_p=dropout_p, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table)
    out, lse = ops.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale)
    return (out, lse, None) if return_attn_probs else out


def _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx):
    """Validate flash_attn_with_kvcache's tensors (shapes/dtypes only: nothing is read on the host).

    Returns the int32 ``[B]`` cache_seqlens tensor (``None`` means the whole cache is valid)."""
    check_tensor("q", q, 4)
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    b, sq, hq, d = q.shape
    bc, s_max, hkv, dk = k_cache.shape
    if tuple(v_cache.shape[:3]) != (bc, s_max, hkv):
        raise ValueError(
            f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}; "
            "[batch_cache, seqlen_cache, nheads_k] must match"
        )
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} (shape {tuple(k_cache.shape)}) differs from q's {d} (shape {tuple(q.shape)})")
    check_same([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v (new keys/values) or neither")
    if k is not None:
        check_tensor("k", k, 4)
        check_tensor("v", v, 4)
        if tuple(k.shape) != (b, k.shape[1], hkv, d):
            raise ValueError(
                f"k has shape {tuple(k.shape)}; expected [batch={b}, seqlen_new, nheads_k={hkv}, headdim={d}]"
            )
        if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[-1] != v_cache.shape[-1]:
            raise ValueError(f"v has shape {tuple(v.shape)}; expected {tuple(k.shape[:3]) + (v_cache.shape[-1],)}")
        check_same([("q", q), ("k", k), ("v", v)])
        if cache_seqlens is None:
            raise ValueError(
                "flash_attn_with_kvcache: appending k/v needs cache_seqlens (where to write); got None"
            )
    if cache_batch_idx is not None:
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError("cache_batch_idx must be an int32 tensor of shape [batch]")
        if tuple(cache_batch_idx.shape) != (b,):
            raise ValueError(f"cache_batch_idx has shape {tuple(cache_batch_idx.shape)}, expected ({b},)")
        if cache_batch_idx.device != q.device:
            raise ValueError(f"cache_batch_idx is on {cache_batch_idx.device} but q is on {q.device}")
    elif bc != b:
        raise ValueError(
            f"k_cache has batch {bc} but q has batch {b}; they must match unless cache_batch_idx is given"
        )
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= s_max:
            raise ValueError(f"cache_seqlens={cache_seqlens} is outside [0, seqlen_cache={s_max}]")
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}, expected ({b},)")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    return cache_seqlens


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention against a pre-allocated KV cache, flash-attn 2's ``flash_attn_with_kvcache``.

    If ``k``/``v`` are given they are first written **in place** into ``k_cache``/``v_cache`` at
    positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` (of cache row
    ``cache_batch_idx[b]``, default b); then q attends to the first ``cache_seqlens[b] +
    seqlen_new`` cached tokens. ``cache_seqlens`` itself is not modified (as in flash-attn).

    Args:
        q: ``[B, Sq, Hq, D]``, any ``Sq >= 1``.
        k_cache, v_cache: ``[B_cache, S_cache, Hkv, D]`` (last dim contiguous; same dtype as q).
        k, v: optional ``[B, seqlen_new, Hkv, D]`` new tokens to append.
        cache_seqlens: int, or int32 ``[B]``: tokens already in the cache. None = the whole cache
            (not allowed together with ``k``/``v``).
        cache_batch_idx: optional int32 ``[B]``: cache row of each batch item.
        causal: bottom-right aligned over the ``cache_seqlens + seqlen_new`` keys (for ``Sq == 1``
            it changes nothing).
        rotary_cos, rotary_sin, cache_leftpad, block_table, alibi_slopes, window_size, softcap:
            not supported (NotImplementedError naming the option); ``rotary_interleaved`` and
            ``num_splits`` are ignored.
        return_softmax_lse: also return softmax_lse ``[B, Hq, Sq]`` fp32.

    Returns:
        out ``[B, Sq, Hq, D]`` in q's dtype, or ``(out, softmax_lse)``.

    Device syncs: the ``Sq == 1`` path without ``cache_batch_idx`` runs entirely on the device
    (append + split-KV decode kernel) and can be captured in a CUDA graph; host validation of the
    lengths is skipped while a graph is being captured or ``torch.compile`` traces. ``Sq > 1`` or
    ``cache_batch_idx`` read ``cache_seqlens`` on the host (one sync) and run the dense kernel on
    each item's cache prefix.

    Raises:
        NotImplementedError: an unsupported option, or inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes, devices or cache lengths.
    """
    causal = _prologue("flash_attn_with_kvcache", causal, (q, k_cache, v_cache, k, v), window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       cache_leftpad=cache_leftpad, block_table=block_table)
    seqlens = _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx)
    b, sq = q.shape[:2]
    s_new = 0 if k is None else k.shape[1]
    fast = sq == 1 and cache_batch_idx is None
    lens = rows = None
    if not fast or not (torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        # validate before writing anything (one host read); skipped while compiling / capturing
        lens, rows = _host_lengths(k_cache, seqlens, s_new, cache_batch_idx, b)
    if k is not None:
        ops.kvcache_append(k_cache, v_cache, k, v, seqlens, cache_batch_idx)
    if seqlens is None:
        seqlens = torch.full((b,), k_cache.shape[1], dtype=torch.int32, device=q.device)
    total = seqlens + s_new if s_new else seqlens
    if fast:
        out, lse = ops.decode_attn(q, k_cache, v_cache, total, softmax_scale, check=False)
    else:
        out, lse = _kvcache_general(q, k_cache, v_cache, lens, rows, causal, softmax_scale)
    return (out, lse) if return_softmax_lse else out


def _host_lengths(k_cache, seqlens, s_new, cache_batch_idx, b):
    """Per item (keys after the append, cache row), read on the host and range-checked."""
    bc, s_max = k_cache.shape[:2]
    base = [s_max] * b if seqlens is None else seqlens.tolist()
    rows = list(range(b)) if cache_batch_idx is None else cache_batch_idx.tolist()
    lens = []
    for i, (n, r) in enumerate(zip(base, rows)):
        if n < 0 or n + s_new > s_max:
            raise ValueError(
                f"cache_seqlens[{i}] = {n} must be >= 0 and, plus seqlen_new = {s_new}, at most "
                f"seqlen_cache = {s_max}"
            )
        if not 0 <= r < bc:
            raise ValueError(f"cache_batch_idx[{i}] = {r} is outside [0, batch_cache={bc})")
        lens.append(n + s_new)
    return lens, rows


def _kvcache_general(q, k_cache, v_cache, lens, rows, causal, softmax_scale):
    """Sq >= 1 against per-item cache prefixes (lengths already on the host): one dense call per item."""
    b, sq, hq, _ = q.shape
    out = torch.empty(b, sq, hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for i, (n, r) in enumerate(zip(lens, rows)):
        o_i, l_i = ops.flash_attn(q[i : i + 1], k_cache[r : r + 1, :n], v_cache[r : r + 1, :n], causal, softmax_scale)
        out[i : i + 1] = o_i
        lse[i : i + 1] = l_i
    return out, lse
