"""Decode attention (one query token per sequence) over a KV cache, returning LSE.

Split-KV "flash-decoding" (Dao, Haziza, Massa, Sizov 2023): the keys of each sequence are cut into
``num_splits`` chunks that run in parallel, each producing a partial (output, LSE) in fp32; a second
kernel merges the splits exactly by their LSE (:mod:`xoffload.kernels.merge`). The query heads that
share a KV head (GQA group) are packed into the M dimension of one program so that ``tl.dot`` sees
>= 16 rows and each K/V tile is read from HBM once per group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_lengths, check_qkv, default_scale, next_pow2, use_triton

__all__ = ["decode_attn_with_lse"]


def _check_inputs(q, k_cache, v_cache, cache_seqlens, check: bool):
    check_qkv(q, k_cache, v_cache, 4, names=("q", "k_cache", "v_cache"))
    b, sq = q.shape[0], q.shape[1]
    if sq != 1:
        raise ValueError(f"q must have shape [B, 1, Hq, D] (one query token), got {tuple(q.shape)}")
    bk, s_max = k_cache.shape[0], k_cache.shape[1]
    if bk != b:
        raise ValueError(f"k_cache batch {bk} != q batch {b} (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})")
    check_lengths("cache_seqlens", cache_seqlens, b, q.device)
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
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    b, _, hq, d = q.shape
    if b == 0:
        return (torch.empty(0, 1, hq, d, dtype=q.dtype, device=q.device),
                torch.empty(0, hq, 1, dtype=torch.float32, device=q.device))
    if use_triton(q):
        # the kernel indexes lengths as Lens + b: a strided view must be made contiguous
        return _decode_triton(q, k_cache, v_cache, cache_seqlens.contiguous(), scale, num_splits)
    s_max = k_cache.shape[1]
    lens = cache_seqlens.clamp(0, s_max)
    out, lse = reference.decode_attention_ref(q, k_cache, v_cache, lens, softmax_scale=scale)
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
_LOG2E = 1.4426950408889634
_MIN_CHUNK = 256  # keys: a split shorter than this costs more in merging than it gains
_MAX_SPLITS = 128
_PROGRAMS_PER_SM = 8


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, nmask, dmask, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One online-softmax step over a tile of BLOCK_N keys: load K at ``k_ptrs`` and V at
    ``v_ptrs`` (``[BLOCK_N, BLOCK_D]`` pointer tiles; rows with ``nmask`` False are masked keys,
    columns with ``dmask`` False are head-dim padding), update the running row max ``m_i`` (log2
    units), row sum ``l_i`` and unnormalised output ``acc``. Shared by the contiguous and the paged
    decode kernels (they differ only in how the key rows' addresses are formed). The tile must hold
    at least one valid key."""
    k = tl.load(k_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # log2 units
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _store_split_state(O, L, acc, m_i, l_i, split, b, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_oh, s_ls, s_lb, s_lh):
    """Normalise a split's state and store out ``[BLOCK_M, BLOCK_D]`` (cast to O's element type)
    and its natural-log LSE (-inf, out 0 for a split that saw no key)."""
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    split64 = split.to(tl.int64)
    tl.store(O + split64 * s_os + b * s_ob + hq[:, None] * s_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
    tl.store(L + split64 * s_ls + b * s_lb + hq * s_lh, lse, mask=mmask)


@triton.jit
def _decode_split_kernel(
    Q, K, V, Lens, O, L,
    qk_scale, S_max, Hkv, GROUP, D, NUM_SPLITS, M_BLOCKS,
    s_qb, s_qh,
    s_kb, s_kn, s_kh,
    s_vb, s_vn, s_vh,
    s_os, s_ob, s_oh,
    s_ls, s_lb, s_lh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: KV head ``hk`` of sequence ``b`` (its GROUP query heads as the M rows, in
    blocks of BLOCK_M), keys ``[split*chunk, (split+1)*chunk)`` with chunk = ceil(len/NUM_SPLITS)
    rounded up to BLOCK_N. Writes out = softmax(q k^T) v over that chunk and its natural-log LSE
    (-inf, out 0 for an empty chunk), cast to O's / L's element type."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % M_BLOCKS
    t = pid // M_BLOCKS
    hk = t % Hkv
    b = (t // Hkv).to(tl.int64)

    seqlen = tl.load(Lens + b)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), S_max)
    chunk = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # index inside the GQA group
    mmask = offs_m < GROUP
    hq = hk * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + b * s_qb + hq[:, None] * s_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)

    lo64 = lo.to(tl.int64)
    k_ptrs = K + b * s_kb + hk * s_kh + lo64 * s_kn + offs_n[:, None] * s_kn + offs_d[None, :]
    v_ptrs = V + b * s_vb + hk * s_vh + lo64 * s_vn + offs_n[:, None] * s_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # every block visited holds >= 1 valid key, so m_i is finite after the first block
    for start in range(lo, hi, BLOCK_N):
        nmask = (start + offs_n) < hi
        m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, nmask, dmask, m_i, l_i, acc, qk_scale, DOT_PREC)
        k_ptrs += BLOCK_N * s_kn
        v_ptrs += BLOCK_N * s_vn

    _store_split_state(O, L, acc, m_i, l_i, split, b, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_oh, s_ls, s_lb, s_lh)


@triton.jit
def _decode_reduce_kernel(
    OP, LP, O, L,
    Hq, D, NUM_SPLITS,
    s_ps, s_pb, s_ph, s_lps, s_lpb, s_lph,
    s_ob, s_oh, s_lb, s_lh,
    SPLITS_P2: tl.constexpr, SPLIT_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b * Hq + h, d block): LSE-weighted merge of the NUM_SPLITS partial states of one
    query head over BLOCK_D of its dims (D is split over programs so that B=1 still spreads the
    reduction over many SMs)."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    h = pid % Hq
    b = (pid // Hq).to(tl.int64)
    sp = tl.arange(0, SPLITS_P2)
    lp = tl.load(LP + sp * s_lps + b * s_lpb + h * s_lph, mask=sp < NUM_SPLITS, other=float("-inf"))
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
        ls = tl.load(LP + si * s_lps + b * s_lpb + h * s_lph, mask=smask, other=float("-inf"))
        w = tl.exp(ls - m_safe) * inv
        o = tl.load(OP + si[:, None].to(tl.int64) * s_ps + b * s_pb + h * s_ph + offs_d[None, :],
                    mask=(smask & (w > 0.0))[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(O + b * s_ob + h * s_oh + offs_d, acc.to(O.dtype.element_ty), mask=dmask)
    if pid_d == 0:
        lse = tl.where(tot > 0.0, m_safe + tl.log(tot_safe), float("-inf"))
        tl.store(L + b * s_lb + h * s_lh, lse)


_SM_COUNT = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, so that the split/merge path is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_num_splits(batch: int, hkv: int, group: int, s_max: int, num_sms: int) -> int:
    """Split count from shapes only (never from cache_seqlens' values; CUDA-graph safe).

    Aim for about eight programs per SM (``batch * hkv * m_blocks * splits ~= 8 * num_sms``) so a
    single long sequence fills the GPU over a few waves with a short tail (B=1, Hkv=8 at 128K on
    132 SMs: 128 splits of 1K keys, 1024 programs, ~3 CTAs resident per SM), but no split shorter
    than 256 keys of ``S_max`` and at most 128 splits. The partial states cost
    ``splits * B * Hq * D * 8`` bytes of writes + reads (< 1% of the K/V bytes at 128K).
    """
    m_blocks = -(-group // _block_m(group))
    progs = max(1, batch * hkv * m_blocks)
    want = -(-_PROGRAMS_PER_SM * num_sms // progs)
    by_len = max(1, -(-s_max // _MIN_CHUNK))
    return int(max(1, min(want, by_len, _MAX_SPLITS)))


def _block_m(group: int) -> int:
    return min(max(16, next_pow2(group)), 64)


def _default_config(d: int, dtype) -> dict:
    block_d = max(16, next_pow2(d))
    if dtype == torch.float32:
        return dict(block_n=32 if block_d > 128 else 64, num_warps=4, num_stages=2)
    if block_d > 128:
        return dict(block_n=32, num_warps=4, num_stages=3)
    return dict(block_n=64, num_warps=4, num_stages=3)


def _decode_triton(q, k_cache, v_cache, cache_seqlens, scale, num_splits, config=None):
    """Launch the split kernel (and the reduce kernel when num_splits > 1). ``config`` (block_n,
    num_warps, num_stages) overrides the default tile choice (benchmarks sweep it)."""
    b, _, hq, d = q.shape
    _, s_max, hkv, _ = k_cache.shape
    group = hq // hkv
    block_m = _block_m(group)
    m_blocks = -(-group // block_m)
    block_d = max(16, next_pow2(d))
    cfg = dict(_default_config(d, q.dtype))
    if config:
        cfg.update(config)
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, group, s_max, _sm_count(q.device))
    out, lse, o_dst, l_dst, o_strides, l_strides = split_buffers(q, num_splits)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (b * hkv * m_blocks, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, cache_seqlens, o_dst, l_dst,
        scale * _LOG2E, s_max, hkv, group, d, num_splits, m_blocks,
        q.stride(0), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *l_strides,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, DOT_PREC=prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    reduce_splits(o_dst, l_dst, out, lse, num_splits)
    return out, lse


def split_buffers(q, num_splits):
    """Outputs of a split-KV decode launch for q ``[B, 1, Hq, D]``: ``(out, lse, o_dst, l_dst,
    o_strides, l_strides)``. With one split the split kernel writes ``out`` [B,1,Hq,D] (q.dtype)
    and ``lse`` [B,Hq,1] directly; otherwise it writes fp32 partials ``o_dst`` [S,B,Hq,D] and
    ``l_dst`` [S,B,Hq] that :func:`reduce_splits` merges. Strides are (split, batch, head)."""
    b, _, hq, d = q.shape
    out = torch.empty(b, 1, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, 1, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        return out, lse, out, lse, (0, out.stride(0), out.stride(2)), (0, lse.stride(0), lse.stride(1))
    o_dst = torch.empty(num_splits, b, hq, d, dtype=torch.float32, device=q.device)
    l_dst = torch.empty(num_splits, b, hq, dtype=torch.float32, device=q.device)
    return out, lse, o_dst, l_dst, o_dst.stride()[:3], l_dst.stride()


def reduce_splits(o_dst, l_dst, out, lse, num_splits):
    """LSE-merge the ``num_splits`` partial states from :func:`split_buffers` into out/lse (one
    launch of the reduce kernel; nothing to do for one split)."""
    if num_splits == 1:
        return
    _, b, hq, d = o_dst.shape
    block_d = max(16, next_pow2(d))
    splits_p2 = next_pow2(num_splits)
    block_dr = min(block_d, 32)
    _decode_reduce_kernel[(b * hq, triton.cdiv(d, block_dr))](
        o_dst, l_dst, out, lse,
        hq, d, num_splits,
        o_dst.stride(0), o_dst.stride(1), o_dst.stride(2),
        l_dst.stride(0), l_dst.stride(1), l_dst.stride(2),
        out.stride(0), out.stride(2), lse.stride(0), lse.stride(1),
        SPLITS_P2=splits_p2, SPLIT_BLOCK=min(splits_p2, 128), BLOCK_D=block_dr,
        num_warps=4,
    )
