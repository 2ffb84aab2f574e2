"""Decode attention (a few query tokens per sequence) over a KV cache, returning LSE.

(Over 450 lines on purpose: the split kernel, its shared tile step and the split reduce, which
``paged_decode`` imports; the options are constexpr branches of the same loop.)

Split-KV "flash-decoding" (Dao, Haziza, Massa, Sizov 2023): the keys of each sequence are cut into
``num_splits`` chunks that run in parallel, each producing a partial (output, LSE) in fp32; a second
kernel merges the splits exactly by their LSE (:mod:`xoffload.kernels.merge`). The query heads that
share a KV head (GQA group) are packed into the M dimension of one program so that ``tl.dot`` sees
>= 16 rows and each K/V tile is read from HBM once per group; with ``Sq > 1`` query tokens (a
draft to verify, a small chunk) the M rows are (token, head of the group) pairs, token-major.

flash-attn's inference options run inside the kernel, each behind a ``tl.constexpr`` flag so the
plain path compiles to the same code as before:

* ``causal`` / ``window_size=(left, right)``: query row i sits at position ``n - Sq + i`` of its
  sequence of n keys (bottom-right aligned) and sees key j iff ``j <= pos + right`` (right = 0 with
  causal) and ``j >= pos - left`` (-1: no limit). Each program only visits the key range its rows
  can see (the splits cut that range), so a window's cost is proportional to its width; with
  ``Sq == 1`` the window is only that range (no per-row mask).
* ``softcap > 0``: scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before the
  softmax (Gemma 2).
* ``alibi_slopes`` fp32 ``[Hq]`` / ``[B, Hq]``: ``-slope * |pos - j|`` added after the soft-cap
  (flash-attn's sign and position convention; its CUDA kernel adds ``slope * j`` under causal, the
  same output with an LSE larger by ``slope * pos``).
* ``cache_leftpad`` int32 ``[B]``: keys before ``cache_leftpad[b]`` are not attended (left padded
  caches); positions are still cache indices.
* ``cache_batch_idx`` int32 ``[B]``: item b reads cache row ``cache_batch_idx[b]``.
* fp8 caches (:mod:`xoffload.kernels.fp8`): ``float8_e4m3fn`` k/v with fp32 ``k_scale`` /
  ``v_scale`` per (token, KV head) or per (``scale_page_size`` positions, KV head); the tiles are
  converted to fp16 in registers (q too: :func:`_fp8_query`) and the scales applied in fp32
  (:func:`_attend_tile`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import reference
from .checks import (
    check_alibi_slopes, check_bool, check_heads, check_lengths, check_qkv, check_same, check_softcap, check_tensor,
    check_window, default_scale, next_pow2, use_triton,
)
from .fp8 import FP8_DTYPE, check_cache_scales, check_fp8_supported

__all__ = ["decode_attn_with_lse"]


class DecodeOptions(NamedTuple):
    """The validated attention options of a decode launch (see :func:`decode_options`)."""

    causal: bool
    left: int  # window left (-1: none)
    right: int  # window right after causal (-1: none)
    has_left: bool  # the left bound cuts keys
    has_right: bool  # the right bound cuts keys (only possible with Sq > 1)
    row_left: bool  # the left bound differs between the rows (Sq > 1)
    softcap: float
    alibi: Optional[torch.Tensor]  # fp32 [B or 1, Hq] or None

    def span(self, cap: int, sq: int) -> int:
        """Keys one program may visit (shapes only): the window's width when it has a left bound."""
        return min(cap, self.left + sq) if self.has_left else cap


def decode_options(q, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None) -> DecodeOptions:
    """Validate flash-attn's options for q ``[B, Sq, Hq, D]``: ``causal`` a bool, ``window_size``
    a pair of ints >= -1, ``softcap`` a float >= 0, ``alibi_slopes`` fp32 ``[Hq]`` or ``[B, Hq]``
    on q's device. Raises TypeError / ValueError naming the value."""
    causal = check_bool("causal", causal)
    left, right = check_window(window_size)
    cap = check_softcap(softcap)
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    alibi = check_alibi_slopes(alibi_slopes, b, hq, q.device)
    if causal:
        right = 0
    # with one query token (at position n - 1) a right bound >= 0 never hides a key
    return DecodeOptions(causal, left, right, left >= 0, right >= 0 and sq > 1, left >= 0 and sq > 1, cap, alibi)


def _check_aux(name, t, b, device):
    """An optional int32 [B] per-sequence tensor (cache_leftpad, cache_batch_idx)."""
    if t is not None:
        check_lengths(name, t, b, device)


def _check_fp8_qkv(q, k_cache, v_cache):
    """q fp16/bf16 and float8_e4m3fn caches of one shape on q's device, head_dim and GQA ratio
    as :func:`~xoffload.kernels.checks.check_qkv`."""
    check_tensor("q", q, 4, dtypes=(torch.float16, torch.bfloat16))
    for n, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(n, t, 4, dtypes=(FP8_DTYPE,))
    check_same([("k_cache", k_cache), ("v_cache", v_cache)])
    if k_cache.device != q.device:
        raise ValueError(f"k_cache is on {k_cache.device} but q is on {q.device}; all must be on one device")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k_cache must have the same head_dim: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    check_heads(q.shape[2], k_cache.shape[2], q.shape[3], "q", "k_cache")


def _check_inputs(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, check: bool):
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype == FP8_DTYPE:
        _check_fp8_qkv(q, k_cache, v_cache)
    else:
        check_qkv(q, k_cache, v_cache, 4, names=("q", "k_cache", "v_cache"))
    b = q.shape[0]
    bk, s_max = k_cache.shape[0], k_cache.shape[1]
    if cache_batch_idx is None and bk != b:
        raise ValueError(f"k_cache batch {bk} != q batch {b} (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}); "
                         f"pass cache_batch_idx to read other cache rows")
    check_lengths("cache_seqlens", cache_seqlens, b, q.device)
    _check_aux("cache_leftpad", cache_leftpad, b, q.device)
    _check_aux("cache_batch_idx", cache_batch_idx, b, q.device)
    if check and b > 0:
        # Host read (one small D2H copy, synchronising the stream): validation only. Callers that
        # capture CUDA graphs or run a hot loop pass check=False; the kernel then clamps each
        # length to [0, S_max] (left pads to [0, length], cache rows to [0, B_cache-1]) so that it
        # never reads outside the cache.
        lens = cache_seqlens.cpu()
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > s_max:
            raise ValueError(
                f"cache_seqlens must be in [0, S_max={s_max}] (k_cache {tuple(k_cache.shape)}), "
                f"got min {lo}, max {hi}"
            )
        if cache_leftpad is not None:
            lp = cache_leftpad.cpu()
            bad = (lp < 0) | (lp > lens)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"cache_leftpad[{i}] = {int(lp[i])} must be in [0, cache_seqlens[{i}] = {int(lens[i])}]")
        if cache_batch_idx is not None:
            bi = cache_batch_idx.cpu()
            bad = (bi < 0) | (bi >= bk)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"cache_batch_idx[{i}] = {int(bi[i])} is outside [0, B_cache={bk})")


def check_num_splits(num_splits):
    """``num_splits``: None (heuristic) or an int >= 1. Raises ValueError otherwise."""
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    return num_splits


def empty_outputs(q, dv):
    """Outputs of a call with no work (B = 0 or Sq = 0): out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]``."""
    b, sq, hq = q.shape[:3]
    return (torch.empty(b, sq, hq, dv, dtype=q.dtype, device=q.device),
            torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device))


def decode_attn_with_lse(q, k_cache, v_cache, cache_seqlens, *, softmax_scale=None, num_splits=None,
                         check=True, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         cache_leftpad=None, cache_batch_idx=None, k_scale=None, v_scale=None, scale_page_size=None):
    """Attention of the last ``Sq`` (usually 1) query tokens of each sequence over its cached
    keys/values, with LSE.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32 (only the last dim must be contiguous); ``Sq`` small
            (1 for decode; a few for a speculative draft; the rows of all Sq tokens share each K/V
            tile). Query row i sits at position ``n - Sq + i`` of its sequence of n keys. This is
            flash-attn's layout ``[batch, seqlen, heads, head_dim]`` (also of the caches), not
            PyTorch SDPA's ``[B, H, S, D]``: a transposed tensor is named in the error when the
            shapes then disagree (:func:`~xoffload.kernels.checks.check_qkv`).
        k_cache, v_cache: ``[B_cache, S_max, Hkv, D]``, same dtype/device as q (or
            ``float8_e4m3fn`` with ``k_scale`` / ``v_scale``), any strides but the last dim (e.g.
            slices of a larger buffer). ``Hq % Hkv == 0``; query head h reads KV head
            ``h // (Hq // Hkv)``. ``D <= 256``. ``B_cache == B`` unless ``cache_batch_idx`` is given.
        cache_seqlens: int32 ``[B]`` on q's device; sequence b attends to its first
            ``n = cache_seqlens[b]`` cached tokens, ``0 <= n <= S_max``. A row that sees no key
            gives output 0 and LSE -inf.
        softmax_scale: default ``1/sqrt(D)``.
        num_splits: number of key chunks per sequence (Triton path). Default: chosen from the
            shapes only (B, Hkv, S_max or the window width, the GPU's SM count), never from the
            values of ``cache_seqlens``, so a CUDA graph captured once stays valid as lengths grow.
        check: when True (default) the lengths (and left pads / cache rows) are read on the host
            once to validate them (a small device->host copy that synchronises the stream). Pass
            False inside CUDA-graph capture or a hot loop; values are then clamped in the kernel
            (lengths to ``[0, S_max]``, left pads to ``[0, n]``, cache rows to ``[0, B_cache-1]``).
        causal: bottom-right aligned causal mask between the Sq query tokens (changes nothing for
            ``Sq == 1`` except with ALiBi's LSE convention, see the module docstring).
        window_size: ``(left, right)`` local attention (flash-attn's convention; -1 = no limit):
            row i sees keys ``pos_i - left .. pos_i + right``; causal sets right to 0. Keys outside
            every row's window are never read.
        softcap: 0 (off) or > 0: ``softcap * tanh(s / softcap)`` on the scaled scores.
        alibi_slopes: None or fp32 ``[Hq]`` / ``[B, Hq]`` on q's device: ``-slope * |pos_i - j|``
            added to the (soft-capped) score of key j.
        cache_leftpad: None or int32 ``[B]``: keys ``< cache_leftpad[b]`` are not attended.
        cache_batch_idx: None or int32 ``[B]``: cache row read by item b.
        k_scale, v_scale: for ``float8_e4m3fn`` caches only (both required; q then fp16/bf16):
            fp32 scales on q's device, value = code * scale: per (token, KV head)
            ``[B_cache, S_max, Hkv]``, or per (page of ``scale_page_size`` positions, KV head)
            ``[B_cache, ceil(S_max / scale_page_size), Hkv]``.
        scale_page_size: None (token scales) or the positions sharing a scale (page scales).

    Returns:
        ``(out, lse)``: out ``[B, Sq, Hq, D]`` in q.dtype; lse fp32 ``[B, Hq, Sq]`` (natural log of
        the softmax denominator of the scores as defined above; merge-compatible).

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, int tensors not int32, alibi
            slopes not fp32, a non-bool causal, a window that is not a pair of ints.
        ValueError: wrong ranks/shapes (named with their shapes), Hq % Hkv != 0, D > 256, a
            non-contiguous last dim, different devices, per-sequence tensors of the wrong length or
            (with check=True) values outside their ranges, a window value < -1, softcap < 0,
            alibi_slopes of the wrong shape, an invalid softmax_scale or num_splits; fp8 caches
            without both scales, scales (or scale_page_size) with 16-bit caches, scales of the wrong
            shape or device (scales not fp32, or an fp8 cache with an fp32 q: TypeError).
        RuntimeError: an fp8 cache on a GPU of compute capability < 8.9.
    """
    _check_inputs(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, check)
    spage = check_cache_scales(k_cache, v_cache, k_scale, v_scale, scale_page_size, q.device)
    if spage is not None and q.is_cuda:
        check_fp8_supported(q.device)
    opts = decode_options(q, causal, window_size, softcap, alibi_slopes)
    scale = default_scale(q.shape[-1], softmax_scale)
    check_num_splits(num_splits)
    b, sq = q.shape[:2]
    if b == 0 or sq == 0:
        return empty_outputs(q, v_cache.shape[-1])
    if use_triton(q):
        # the kernel indexes per-sequence tensors as T + b: strided views must be made contiguous
        return _decode_triton(q, k_cache, v_cache, cache_seqlens.contiguous(), scale, num_splits, opts=opts,
                              cache_leftpad=None if cache_leftpad is None else cache_leftpad.contiguous(),
                              cache_batch_idx=None if cache_batch_idx is None else cache_batch_idx.contiguous(),
                              k_scale=k_scale, v_scale=v_scale, scale_page_size=spage)
    if spage is not None:  # the CPU reference reads the dequantized cache (exact in fp32)
        k_cache = reference.dequantize_cache_fp8_ref(k_cache, k_scale, spage)
        v_cache = reference.dequantize_cache_fp8_ref(v_cache, v_scale, spage)
    # CPU reference, with the kernel's clamping (so check=False gives the same answer)
    s_max = k_cache.shape[1]
    lens = cache_seqlens.clamp(0, s_max)
    lp = None if cache_leftpad is None else torch.minimum(cache_leftpad.clamp(min=0), lens)
    bi = None if cache_batch_idx is None else cache_batch_idx.clamp(0, k_cache.shape[0] - 1)
    out, lse = reference.decode_attention_ref(q, k_cache, v_cache, lens, softmax_scale=scale, causal=opts.causal,
                                              window_size=(opts.left, opts.right), softcap=opts.softcap,
                                              alibi_slopes=alibi_slopes, cache_leftpad=lp, cache_batch_idx=bi)
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
_LOG2E = 1.4426950408889634
_MIN_CHUNK = 256  # keys: a split shorter than this costs more in merging than it gains
_MAX_SPLITS = 128
_PROGRAMS_PER_SM = 8


@triton.jit
def _tanh(x):
    """tanh in fp32 through exp2 (no tanh in tl.math; libdevice does not run in the interpreter):
    ``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (absolute error ~1 fp32 ulp of 1)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _program_rows(M_BLOCKS, Hkv, GROUP, SQ, BLOCK_M: tl.constexpr):
    """Axis 0 of the split grid: (sequence b, KV head hk, M block mb). The M rows are
    ``r = s * GROUP + g`` (query token s, head g of the group): returns b (int64), hk, mb, the row
    mask, each row's token ``s`` and query head ``hq``."""
    pid = tl.program_id(0)
    mb = pid % M_BLOCKS
    t = pid // M_BLOCKS
    hk = t % Hkv
    b = (t // Hkv).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < GROUP * SQ
    s_row = offs_m // GROUP
    hq = hk * GROUP + offs_m % GROUP
    return b, hk, mb, mmask, s_row, hq


@triton.jit
def _key_range(seqlen, kstart, mb, GROUP, SQ, WIN_LEFT, WIN_RIGHT, NUM_SPLITS,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys ``[lo_k, hi_k)`` that some row of M block ``mb`` can see (left pad, window), and this
    split's part ``[lo, hi)`` of them: the range from ``lo_k`` rounded down to a multiple of
    BLOCK_N is cut into NUM_SPLITS chunks of a multiple of BLOCK_N keys (so tiles start at
    multiples of BLOCK_N: a paged tile never straddles a page whose size is a multiple of BLOCK_N)."""
    split = tl.program_id(1)
    lo_k = kstart
    hi_k = seqlen
    s_first = (mb * BLOCK_M) // GROUP
    s_last = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // GROUP, SQ - 1)
    if HAS_LEFT:
        lo_k = tl.maximum(lo_k, seqlen - SQ + s_first - WIN_LEFT)
    if HAS_RIGHT:
        hi_k = tl.minimum(hi_k, seqlen - SQ + s_last + WIN_RIGHT + 1)
    a0 = (lo_k // BLOCK_N) * BLOCK_N
    # an empty range visits no tile (else its first tile would hold no valid key); otherwise only
    # a split's first tile can start below lo_k, and it holds key lo_k
    width = tl.where(hi_k > lo_k, hi_k - a0, 0)
    chunk = tl.cdiv(tl.cdiv(width, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = a0 + split * chunk
    hi = tl.minimum(lo + chunk, hi_k)
    return lo_k, lo, hi


#: fp8 tiles: p is kept as ``2^_P_SHIFT * exp2(s - m)`` (the running max is stored minus _P_SHIFT),
#: so its fp16 copy (at most 2^14) keeps weights down to 2^-38 instead of fp16's 2^-24
_P_SHIFT = tl.constexpr(14.0)


@triton.jit
def _fp8_query(q, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """q ``[BLOCK_M, BLOCK_D]`` (fp16 / bf16) as the fp16 operand of the fp8 tile step, and each
    row's factor (fp32 ``[BLOCK_M]``) that takes ``q16 . k_codes`` to the kernel's score units:
    ``cap_scale`` (SOFTCAP) or ``qk_scale`` times the power of two the row was scaled by. An fp16 q
    is used as is; each row of a bf16 q is multiplied by ``2^-e`` (exact) with
    ``e = floor(log2 max|row|) - 14``, so its largest magnitude lies in ``[2^14, 2^15)`` and every
    element down to ``2^-31`` of it converts to fp16 exactly (bf16 keeps 8 significant bits, fp16
    11 down to 2^-14 and 8 down to 2^-17)."""
    if SOFTCAP:
        base = cap_scale
    else:
        base = qk_scale
    if q.dtype == tl.bfloat16:
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141  # floor(log2 amax) - 14
        e = tl.minimum(tl.maximum(e, -100), 100)
        q16 = (qf * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        qs = ((127 + e) << 23).to(tl.float32, bitcast=True) * base
    else:
        q16 = q
        qs = tl.full([q.shape[0]], 1.0, tl.float32) * base
    return q16, qs


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale, qpos, slope,
                 WIN_LEFT, WIN_RIGHT, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ROW_LEFT: tl.constexpr,
                 ROW_RIGHT: tl.constexpr, DOT_PREC: tl.constexpr, ks=1.0, vs=1.0, KV_SCALE: tl.constexpr = 0,
                 qs=1.0):
    """One online-softmax step over a tile of BLOCK_N keys: load K at ``k_ptrs`` and V at
    ``v_ptrs`` (``[BLOCK_N, BLOCK_D]`` pointer tiles; keys ``tok`` with ``kmask`` False are masked,
    columns with ``dmask`` False are head-dim padding), update the running row max ``m_i`` (log2
    units), row sum ``l_i`` and unnormalised output ``acc``. Shared by the contiguous and the paged
    decode kernels (they differ only in how the key rows' addresses are formed).

    Options (constexpr): SOFTCAP (``qk_scale`` is then ``softcap * log2e`` and ``cap_scale`` =
    ``scale / softcap``; else ``qk_scale = scale * log2e``), ALIBI (``slope`` per row, log2 units,
    ``qpos`` each row's position), ROW_LEFT / ROW_RIGHT (per-row window bounds ``qpos - WIN_LEFT``
    / ``qpos + WIN_RIGHT``; a row may then see no key of a tile, handled without NaN). Without the
    row bounds the tile must hold at least one valid key.

    KV_SCALE (fp8 e4m3 K/V, :mod:`xoffload.kernels.fp8`): 0 = none (16-bit K/V, the code above
    unchanged); 1 = one scale per tile (``ks``, ``vs`` fp32 scalars: the tile lies in one page);
    2 = a scale per key (``ks``, ``vs`` fp32 ``[BLOCK_N]``). q and ``qs`` are then
    :func:`_fp8_query`'s fp16 operand and row factors, so the scores are
    ``(q16 . codes) * (qs * ks)`` (with SOFTCAP ``tanh`` of that, times ``qk_scale``; ``cap_scale``
    unused). The e4m3 tiles convert to fp16 exactly (two codes per instruction on
    sm_89+), whatever q's dtype. p is kept ``2^_P_SHIFT`` times larger (``m_i`` stores the row max
    minus _P_SHIFT; ``m + log2(l)`` and ``acc / l`` are unchanged) so its fp16 copy loses no weight
    above ``2^-38``. The V scale multiplies the dot's fp32 result (per tile) or is folded into p
    (per key: ``p * vs / max(vs)`` before the cast, ``* max(vs)`` after the dot)."""
    k = tl.load(k_ptrs, mask=kmask[:, None] & dmask[None, :], other=0.0)
    if KV_SCALE == 0:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SOFTCAP:
            s = _tanh(s * cap_scale) * qk_scale  # log2 units
        else:
            s = s * qk_scale  # log2 units
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float16)), input_precision=DOT_PREC)
        if KV_SCALE == 1:
            s = s * (qs * ks)[:, None]
        else:
            s = s * qs[:, None] * ks[None, :]
        if SOFTCAP:
            s = _tanh(s) * qk_scale  # log2 units
    if ALIBI:
        s = s - slope[:, None] * tl.abs(qpos[:, None] - tok[None, :]).to(tl.float32)
    valid = kmask[None, :]
    if ROW_LEFT:
        valid = valid & (tok[None, :] >= (qpos - WIN_LEFT)[:, None])
    if ROW_RIGHT:
        valid = valid & (tok[None, :] <= (qpos + WIN_RIGHT)[:, None])
    s = tl.where(valid, s, float("-inf"))
    if KV_SCALE == 0:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) - _P_SHIFT)
    if ROW_LEFT or ROW_RIGHT:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep 0s
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kmask[:, None] & dmask[None, :], other=0.0)
    if KV_SCALE == 0:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    elif KV_SCALE == 1:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16), input_precision=DOT_PREC) * vs
    else:
        vmax = tl.max(vs, 0)
        vmax = tl.where(vmax > 0.0, vmax, 1.0)
        pv = p * (vs / vmax)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float16), v.to(tl.float16), input_precision=DOT_PREC) * vmax
    return m_new, l_i, acc


@triton.jit
def _store_split_state(O, L, acc, m_i, l_i, split, b, s_row, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_osq, s_oh, s_ls, s_lb, s_lsq, s_lh):
    """Normalise a split's state and store out ``[BLOCK_M, BLOCK_D]`` (cast to O's element type)
    and its natural-log LSE (-inf, out 0 for a row that saw no key)."""
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    split64 = split.to(tl.int64)
    tl.store(O + split64 * s_os + b * s_ob + s_row[:, None] * s_osq + hq[:, None] * s_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
    tl.store(L + split64 * s_ls + b * s_lb + s_row * s_lsq + hq * s_lh, lse, mask=mmask)


# Length-dependent integers are not specialised (divisible by 16 / equal to 1): a request at a
# length not seen before must not compile a new variant (a 0.6 s stall was seen).
@triton.jit(do_not_specialize=["S_max", "B_cache", "NUM_SPLITS"])
def _decode_split_kernel(
    Q, K, V, Lens, Lpad, Bidx, Slopes, O, L, KS, VS,
    qk_scale, cap_scale, S_max, B_cache, Hkv, GROUP, SQ, D, NUM_SPLITS, M_BLOCKS, WIN_LEFT, WIN_RIGHT,
    s_qb, s_qs, s_qh,
    s_kb, s_kn, s_kh,
    s_vb, s_vn, s_vh,
    s_ab,
    s_os, s_ob, s_osq, s_oh,
    s_ls, s_lb, s_lsq, s_lh,
    s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ROW_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
    KV_FP8: tl.constexpr = 0, SPAGE: tl.constexpr = 1,
):
    """One program: KV head ``hk`` of sequence ``b`` (the (token, group head) pairs as the M rows,
    in blocks of BLOCK_M), split ``program_id(1)`` of the keys its rows can see (see
    :func:`_key_range`). Writes out = softmax(scores) v over that chunk and its natural-log LSE
    (-inf, out 0 for a row that saw no key), cast to O's / L's element type.

    KV_FP8 (e4m3 caches): 0 = 16-bit; 1 = one scale per tile (SPAGE % BLOCK_N == 0); 2 = a scale
    per key. Key j's scale is at ``KS + cb * s_ksb + (j // SPAGE) * s_kss + hk * s_ksh`` (SPAGE
    = 1: token scales). Same for VS."""
    b, hk, mb, mmask, s_row, hq = _program_rows(M_BLOCKS, Hkv, GROUP, SQ, BLOCK_M)
    split = tl.program_id(1)

    seqlen = tl.load(Lens + b)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), S_max)
    kstart = 0
    if LEFTPAD:
        kstart = tl.minimum(tl.maximum(tl.load(Lpad + b), 0), seqlen)
    lo_k, lo, hi = _key_range(seqlen, kstart, mb, GROUP, SQ, WIN_LEFT, WIN_RIGHT, NUM_SPLITS,
                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    cb = b
    if BATCH_IDX:
        cb = tl.minimum(tl.maximum(tl.load(Bidx + b), 0), B_cache - 1).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + b * s_qb + s_row[:, None] * s_qs + hq[:, None] * s_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    qpos = seqlen - SQ + s_row
    slope = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope = tl.load(Slopes + b * s_ab + hq, mask=mmask, other=0.0) * 1.4426950408889634

    qs = 1.0
    if KV_FP8 != 0:
        q, qs = _fp8_query(q, qk_scale, cap_scale, SOFTCAP)

    lo64 = lo.to(tl.int64)
    k_ptrs = K + cb * s_kb + hk * s_kh + lo64 * s_kn + offs_n[:, None] * s_kn + offs_d[None, :]
    v_ptrs = V + cb * s_vb + hk * s_vh + lo64 * s_vn + offs_n[:, None] * s_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        kmask = tok < hi
        if HAS_LEFT or LEFTPAD:
            kmask = kmask & (tok >= lo_k)
        if KV_FP8 == 0:
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC)
        elif KV_FP8 == 1:  # the tile lies in one scale's page
            ks = tl.load(KS + cb * s_ksb + (start // SPAGE) * s_kss + hk * s_ksh)
            vs = tl.load(VS + cb * s_vsb + (start // SPAGE) * s_vss + hk * s_vsh)
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC, ks, vs, 1, qs)
        else:
            sidx = (tok // SPAGE).to(tl.int64)
            ksv = tl.load(KS + cb * s_ksb + sidx * s_kss + hk * s_ksh, mask=kmask, other=0.0)
            vsv = tl.load(VS + cb * s_vsb + sidx * s_vss + hk * s_vsh, mask=kmask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC, ksv, vsv, 2, qs)
        k_ptrs += BLOCK_N * s_kn
        v_ptrs += BLOCK_N * s_vn

    _store_split_state(O, L, acc, m_i, l_i, split, b, s_row, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_osq, s_oh, s_ls, s_lb, s_lsq, s_lh)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _decode_reduce_kernel(
    OP, LP, O, L,
    Hq, SQ, D, NUM_SPLITS,
    s_ps, s_pb, s_psq, s_ph, s_lps, s_lpb, s_lpsq, s_lph,
    s_ob, s_osq, s_oh, s_lb, s_lsq, s_lh,
    SPLITS_P2: tl.constexpr, SPLIT_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ((b * Sq + s) * Hq + h, d block): LSE-weighted merge of the NUM_SPLITS partial
    states of one query row over BLOCK_D of its dims (D is split over programs so that B=1 still
    spreads the reduction over many SMs)."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    h = pid % Hq
    t = pid // Hq
    sq = t % SQ
    b = (t // SQ).to(tl.int64)
    row_p = b * s_pb + sq * s_psq + h * s_ph
    row_l = b * s_lpb + sq * s_lpsq + h * s_lph
    sp = tl.arange(0, SPLITS_P2)
    lp = tl.load(LP + sp * s_lps + row_l, mask=sp < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lp, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp(lp - m_safe), 0)
    tot_safe = tl.where(tot > 0.0, tot, 1.0)
    inv = tl.where(tot > 0.0, 1.0 / tot_safe, 0.0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, SPLIT_BLOCK):
        si = s0 + tl.arange(0, SPLIT_BLOCK)
        smask = si < NUM_SPLITS
        ls = tl.load(LP + si * s_lps + row_l, mask=smask, other=float("-inf"))
        w = tl.exp(ls - m_safe) * inv
        o = tl.load(OP + si[:, None].to(tl.int64) * s_ps + row_p + offs_d[None, :],
                    mask=(smask & (w > 0.0))[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(O + b * s_ob + sq * s_osq + h * s_oh + offs_d, acc.to(O.dtype.element_ty), mask=dmask)
    if pid_d == 0:
        lse = tl.where(tot > 0.0, m_safe + tl.log(tot_safe), float("-inf"))
        tl.store(L + b * s_lb + sq * s_lsq + h * s_lh, lse)


_SM_COUNT = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, so that the split/merge path is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_num_splits(batch: int, hkv: int, group: int, s_max: int, num_sms: int, sq: int = 1) -> int:
    """Split count from shapes only (never from cache_seqlens' values; CUDA-graph safe).

    Aim for about eight programs per SM (``batch * hkv * m_blocks * splits ~= 8 * num_sms``) so a
    single long sequence fills the GPU over a few waves with a short tail (B=1, Hkv=8 at 128K on
    132 SMs: 128 splits of 1K keys, 1024 programs, ~3 CTAs resident per SM), but no split shorter
    than 256 keys of ``s_max`` (the keys one program may visit: S_max, or a window's width) and at
    most 128 splits. The partial states cost ``splits * B * Sq * Hq * D * 8`` bytes of writes +
    reads (< 1% of the K/V bytes at 128K).
    """
    rows = group * sq
    m_blocks = -(-rows // _block_m(rows))
    progs = max(1, batch * hkv * m_blocks)
    want = -(-_PROGRAMS_PER_SM * num_sms // progs)
    by_len = max(1, -(-s_max // _MIN_CHUNK))
    return int(max(1, min(want, by_len, _MAX_SPLITS)))


def _block_m(rows: int) -> int:
    return min(max(16, next_pow2(rows)), 64)


def _default_config(d: int, dtype, kv_fp8: bool = False) -> dict:
    """Tiles of the split kernels: ``block_n`` keys per loop iteration, warps, pipeline stages.
    ``kv_fp8`` (the paged kernel over an e4m3 store): e4m3 tiles hold half the bytes of 16-bit
    ones, so they take twice the keys (128 at D <= 128): the per-tile work (the softmax's row
    reductions across warps, q's operand reload, the loop itself) is spread over more keys and
    twice the bytes are in flight per program (sm_90 SASS of the 8B shape: 34-37 warp-instructions
    per key against 41-53 at 64 keys; ~198 registers against 140-184, so two programs share an SM
    where 64-key tiles fit two or three, with 64 KiB of tiles in flight against 32-48;
    ``tools/diag_fp8_decode_sass.py``). The contiguous kernel keeps 64-key tiles for fp8 caches
    (at 128 it needs 253-255 registers and spills)."""
    block_d = max(16, next_pow2(d))
    if kv_fp8:
        return dict(block_n=128 if block_d <= 128 else 64, num_warps=4, num_stages=3)
    if dtype == torch.float32:
        return dict(block_n=32 if block_d > 128 else 64, num_warps=4, num_stages=2)
    if block_d > 128:
        return dict(block_n=32, num_warps=4, num_stages=3)
    return dict(block_n=64, num_warps=4, num_stages=3)


def option_args(q, opts: DecodeOptions, scale: float):
    """Kernel arguments of the options: ``(qk_scale, cap_scale, slopes, slope_batch_stride, flags)``
    with flags the constexprs HAS_LEFT, HAS_RIGHT, ROW_LEFT, SOFTCAP, ALIBI."""
    if opts.softcap > 0:
        qk_scale, cap_scale = opts.softcap * _LOG2E, scale / opts.softcap
    else:
        qk_scale, cap_scale = scale * _LOG2E, 1.0
    slopes = opts.alibi
    s_ab = 0 if slopes is None or slopes.shape[0] == 1 else slopes.stride(0)
    flags = dict(HAS_LEFT=opts.has_left, HAS_RIGHT=opts.has_right, ROW_LEFT=opts.row_left,
                 SOFTCAP=opts.softcap > 0, ALIBI=slopes is not None)
    return qk_scale, cap_scale, (slopes if slopes is not None else q), s_ab, flags


def _decode_triton(q, k_cache, v_cache, cache_seqlens, scale, num_splits, config=None, *, opts=None,
                   cache_leftpad=None, cache_batch_idx=None, k_scale=None, v_scale=None, scale_page_size=None):
    """Launch the split kernel (and the reduce kernel when num_splits > 1). ``config`` (block_n,
    num_warps, num_stages) overrides the default tile choice (benchmarks sweep it); ``opts`` the
    :class:`DecodeOptions` (default: none); ``k_scale`` / ``v_scale`` the fp32 scales of an fp8
    cache with ``scale_page_size`` positions each (1: token scales; checked by the caller)."""
    b, sq, hq, d = q.shape
    bc, s_max, hkv, _ = k_cache.shape
    if opts is None:
        opts = decode_options(q)
    group = hq // hkv
    block_m = _block_m(group * sq)
    m_blocks = -(-(group * sq) // block_m)
    block_d = max(16, next_pow2(d))
    cfg = dict(_default_config(d, q.dtype))
    if config:
        cfg.update(config)
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, group, opts.span(s_max, sq), _sm_count(q.device), sq)
    out, lse, o_dst, l_dst, o_strides, l_strides = split_buffers(q, num_splits, v_cache.shape[-1])
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale, cap_scale, slopes, s_ab, flags = option_args(q, opts, scale)
    if k_scale is None:
        kv_fp8, spage, kss, vss = 0, 1, (0, 0, 0), (0, 0, 0)
    else:
        spage = int(scale_page_size or 1)
        kv_fp8 = 1 if spage % cfg["block_n"] == 0 else 2
        kss, vss = k_scale.stride(), v_scale.stride()
    grid = (b * hkv * m_blocks, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, cache_seqlens,
        cache_leftpad if cache_leftpad is not None else cache_seqlens,
        cache_batch_idx if cache_batch_idx is not None else cache_seqlens,
        slopes, o_dst, l_dst, q if k_scale is None else k_scale, q if v_scale is None else v_scale,
        qk_scale, cap_scale, s_max, bc, hkv, group, sq, d, num_splits, m_blocks,
        max(opts.left, 0), max(opts.right, 0),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        s_ab,
        *o_strides, *l_strides,
        *kss, *vss,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, DOT_PREC=prec,
        LEFTPAD=cache_leftpad is not None, BATCH_IDX=cache_batch_idx is not None, KV_FP8=kv_fp8, SPAGE=spage, **flags,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    reduce_splits(o_dst, l_dst, out, lse, num_splits)
    return out, lse


def split_buffers(q, num_splits, dv=None):
    """Outputs of a split-KV decode launch for q ``[B, Sq, Hq, D]``: ``(out, lse, o_dst, l_dst,
    o_strides, l_strides)``. With one split the split kernel writes ``out`` [B,Sq,Hq,Dv] (q.dtype)
    and ``lse`` [B,Hq,Sq] directly; otherwise it writes fp32 partials ``o_dst`` [S,B,Sq,Hq,Dv] and
    ``l_dst`` [S,B,Sq,Hq] that :func:`reduce_splits` merges. Strides are (split, batch, token, head)."""
    b, sq, hq, d = q.shape
    dv = d if dv is None else dv
    out = torch.empty(b, sq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        return (out, lse, out, lse, (0, out.stride(0), out.stride(1), out.stride(2)),
                (0, lse.stride(0), lse.stride(2), lse.stride(1)))
    o_dst = torch.empty(num_splits, b, sq, hq, dv, dtype=torch.float32, device=q.device)
    l_dst = torch.empty(num_splits, b, sq, hq, dtype=torch.float32, device=q.device)
    return out, lse, o_dst, l_dst, o_dst.stride()[:4], l_dst.stride()


def reduce_splits(o_dst, l_dst, out, lse, num_splits):
    """LSE-merge the ``num_splits`` partial states from :func:`split_buffers` into out/lse (one
    launch of the reduce kernel; nothing to do for one split)."""
    if num_splits == 1:
        return
    _, b, sq, hq, d = o_dst.shape
    block_d = max(16, next_pow2(d))
    splits_p2 = max(_MAX_SPLITS, next_pow2(num_splits))  # one variant for every split count <= 128
    block_dr = min(block_d, 32)
    _decode_reduce_kernel[(b * sq * hq, triton.cdiv(d, block_dr))](
        o_dst, l_dst, out, lse,
        hq, sq, d, num_splits,
        o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), o_dst.stride(3),
        l_dst.stride(0), l_dst.stride(1), l_dst.stride(2), l_dst.stride(3),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(2), lse.stride(1),
        SPLITS_P2=splits_p2, SPLIT_BLOCK=min(splits_p2, 128), BLOCK_D=block_dr,
        num_warps=4,
    )
