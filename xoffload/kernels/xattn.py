"""XAttention block-importance estimate: strided antidiagonal scoring in three stages.

(Over 450 lines on purpose: the three stages of one estimate share the strided-row layout and
workspace rules stated below; split, each file would need them restated.)

XAttention (Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal Scoring") scores
each ``B x B`` block of the attention matrix by sums along strided antidiagonals. With stride ``S``
the strided query row ``i`` pairs query rows ``i*S + (S-1-t)`` with key rows ``j*S + t``
(``t = 0..S-1``): one antidiagonal of the ``S x S`` cell ``(i, j)``. Its score is

    s[i, j] = softmax_scale / S * sum_t q[i*S + S-1-t] . k[j*S + t]

over the *valid* terms only: both rows exist (padding never counts) and, under ``causal``, the
key's absolute position is at most the query's. A cell with no valid term is not visible. Each
strided row is softmax-normalised over its visible cells, and the block score of query block
``I`` and key block ``J`` is the sum of the normalised cells of its ``B/S`` strided rows and
``B/S`` strided columns. Every strided row sums to 1, so a query block's row of block scores sums
to its number of strided rows that see any key (at most ``B/S``).

Positions. Query row ``r`` (0-based in ``q``) sits at absolute position ``q_start + r``; key row
``r`` of a chunk starting at ``k_offset`` sits at ``k_offset + r``. Strided query rows and query
blocks are counted from the first query row; strided key columns and key blocks are absolute
(key block ``J`` holds keys ``J*B .. J*B + B - 1``). ``q_start`` defaults to ``Sk - Sq`` (the
bottom-right alignment of the attention kernels). With ``q_start`` not a multiple of ``B`` a query
block straddles two key blocks on its diagonal; both are visible, nothing after the query's own
position is ever counted.

Stages (so that K can arrive in chunks, e.g. from an offload pool; every chunk but the last holds
a multiple of ``B`` keys):

1. :func:`xattn_chunk_stats` reads Q and one K chunk once (the strided reshape is fused into the
   loads: no strided copy of Q or K is made) and returns, per strided row, the chunk's softmax
   statistics (row max, row sum) and, per (strided row, key block), the block's log-sum-exp.
2. :func:`xattn_merge_stats` merges the (row max, row sum) of all chunks.
3. :func:`xattn_block_scores` normalises a chunk's block log-sum-exps by the merged statistics and
   sums the rows of each query block: block scores ``[B, Hq, q_blocks, chunk_k_blocks]``.

Because a block's log-sum-exp depends only on that block's keys, K is read once, whatever the
chunking; the one-shot :func:`xattn_estimate` is the same three stages with one chunk. Chunked and
one-shot estimates differ only in the fp32 rounding of the row normaliser (a few ulps).

Scores are accumulated in fp32 from fp16/bf16/fp32 inputs (``tl.dot`` with fp32 accumulation;
fp32 inputs use TF32 on the GPU) and exponentiated in base 2 with the scale folded into
``log2(e)``; statistics are returned in natural-log units. GQA: query head ``h`` reads KV head
``h // (Hq // Hkv)`` directly, K is never repeated.

Workspace: the block log-sum-exps take ``4 * B * Hq * ceil(Sq/B)*(B/S) * ceil(Sk/B)`` bytes
(2 GiB at 128K tokens, S=8, 32 heads); :func:`xattn_estimate` processes KV-head groups in turn
so that at most ``max_workspace_bytes`` (default 1 GiB) is live at once.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_bool, check_out, check_pow2, check_qkv, default_scale, is_int, next_pow2, use_triton
from .launch import LaunchConfig, override_for

__all__ = [
    "XAttnChunkStats",
    "xattn_chunk_stats",
    "xattn_merge_stats",
    "xattn_block_scores",
    "xattn_estimate",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


class XAttnChunkStats(NamedTuple):
    """Stage-1 result for one KV chunk.

    row_max: fp32 ``[B, Hq, R]``, max strided score of each strided row over the chunk (natural
        units; -inf where the row sees no cell of the chunk). ``R = ceil(Sq/B) * (B/S)``: strided
        rows padded to whole query blocks (padding rows are -inf / 0).
    row_sum: fp32 ``[B, Hq, R]``, ``sum exp(s - row_max)`` over the chunk (0 where none).
    block_lse: fp32 ``[B, Hq, R, ceil(chunk_len/B)]``, log of the sum of ``exp(s)`` over the row's
        cells in each key block of the chunk (-inf where none is visible).
    k_block_start: index of the chunk's first key block (``k_offset // block_size``).
    """

    row_max: torch.Tensor
    row_sum: torch.Tensor
    block_lse: torch.Tensor
    k_block_start: int


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------

def check_geometry(stride, block_size) -> None:
    """Raise ValueError/TypeError unless ``block_size`` is a power of two >= 16 and ``stride`` a
    positive power of two dividing it."""
    check_pow2("block_size", block_size, 16)
    if not is_int(stride):
        raise TypeError(f"stride must be an int, got {type(stride).__name__}")
    if stride < 1 or block_size % stride or stride & (stride - 1):
        raise ValueError(
            f"stride must be a power of two that divides block_size={block_size} (e.g. 4, 8, 16), got {stride}"
        )


# ----------------------------------------------------------------------------------------------
# stage 1: per-chunk statistics (Triton)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _strided_tile(acc, q_tile, k_tile, q_offs, k_offs, lrows, lcols, d_ok, stride_qs, stride_ks,
                  q_left, k_left, kq_shift_tile, S: tl.constexpr, MASK_TERMS: tl.constexpr,
                  EVEN_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """acc[i, j] += sum_t q[(row0 + i)*S + S-1-t] . k[(col0 + j)*S + t].

    ``q_tile`` / ``k_tile`` point at query row ``row0*S`` / key row ``col0*S``; ``q_offs`` /
    ``k_offs`` are the in-tile offsets of rows ``i*S`` / ``j*S``; ``q_left`` / ``k_left`` the rows
    that exist from the tile start. With MASK_TERMS, term t of cell (i, j) counts only when the
    key is causal for the query: ``(j*S + t) - (i*S + S-1-t) <= kq_shift_tile``.
    """
    for t in tl.range(0, S, num_stages=NUM_STAGES):
        qr = lrows * S + (S - 1 - t)
        kr = lcols * S + t
        q_ptrs = q_tile + (S - 1 - t) * stride_qs + q_offs
        k_ptrs = k_tile + t * stride_ks + k_offs
        if EVEN_D:
            qt = tl.load(q_ptrs, mask=(qr < q_left)[:, None], other=0.0)
            kt = tl.load(k_ptrs, mask=(kr < k_left)[:, None], other=0.0)
        else:
            qt = tl.load(q_ptrs, mask=(qr < q_left)[:, None] & d_ok[None, :], other=0.0)
            kt = tl.load(k_ptrs, mask=(kr < k_left)[:, None] & d_ok[None, :], other=0.0)
        if MASK_TERMS:
            ok = (kr[None, :] - qr[:, None]) <= kq_shift_tile
            acc += tl.where(ok, tl.dot(qt, tl.trans(kt)), 0.0)
        else:
            acc = tl.dot(qt, tl.trans(kt), acc)
    return acc


@triton.jit
def _tile_stats(acc, m_i, l_i, c0, rows, cols, t_lo, Sk, kq_shift, n_rows, qk_scale2,
                BL_row_base, stride_lr, n_blocks, R,
                S: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Visible-cell mask, per-block log-sum-exp (stored) and the running row statistics."""
    NB: tl.constexpr = BN // CB
    vis = (rows < n_rows)[:, None] & ((cols * S)[None, :] + t_lo[:, None] < Sk)
    if CAUSAL:
        # some term t >= t_lo is causal iff cols*S + t_lo - (rows*S + S-1 - t_lo) <= kq_shift
        vis = vis & ((cols * S)[None, :] + 2 * t_lo[:, None] - (rows * S + S - 1)[:, None] <= kq_shift)
    s = tl.where(vis, acc * qk_scale2, float("-inf"))
    s3 = tl.reshape(s, (BM, NB, CB))
    mb = tl.max(s3, axis=2)  # [BM, NB]
    mb_safe = tl.where(mb == float("-inf"), 0.0, mb)
    lb = tl.sum(tl.exp2(s3 - mb_safe[:, :, None]), axis=2)
    lse_b = tl.where(lb > 0.0, mb_safe + tl.log2(tl.where(lb > 0.0, lb, 1.0)), float("-inf"))
    blk = c0 // CB + tl.arange(0, NB)
    tl.store(BL_row_base + rows.to(tl.int64)[:, None] * stride_lr + blk[None, :], lse_b * 0.6931471805599453,
             mask=(rows < R)[:, None] & (blk < n_blocks)[None, :])
    m_new = tl.maximum(m_i, tl.max(mb, axis=1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_sub) + tl.sum(lb * tl.exp2(mb - m_sub[:, None]), axis=1)
    return m_new, l_i


@triton.jit(do_not_specialize=["Sq", "Sk", "k_offset", "q_start", "n_rows", "R", "n_blocks", "n_bh",
                               "H", "GROUP", "LEN_BUCKET", "stride_lb", "stride_lh", "stride_lr",
                               "stride_rb", "stride_rh"])
def _xattn_stats_kernel(Q, K, BL, RM, RS,
                        stride_qb, stride_qs, stride_qh,
                        stride_kb, stride_ks, stride_kh,
                        stride_lb, stride_lh, stride_lr,
                        stride_rb, stride_rh,
                        Sq, Sk, k_offset, q_start, n_rows, R, n_blocks, n_bh, H, GROUP, LEN_BUCKET,
                        qk_scale2,
                        S: tl.constexpr, CB: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    # 1-D grid, (batch, head) fastest; the last row tiles (most keys under causal) start first.
    pid = tl.program_id(0)
    n_mt = tl.cdiv(n_rows, BM)
    bh = pid % n_bh
    mt = n_mt - 1 - pid // n_bh
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    rows = mt * BM + tl.arange(0, BM)  # strided query rows
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    BL_row_base = BL + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    kq_shift = q_start - k_offset  # key row kr (chunk-local) is causal for query row qr iff kr - qr <= kq_shift
    n_cols = (Sk + S - 1) // S
    # first query row that exists in a strided row: t >= t_lo
    t_lo = tl.maximum(rows * S + S - Sq, 0)
    if CAUSAL:
        # last key (chunk-local) any row of the tile may see; keys < first_ok are seen by all terms
        last_q = tl.minimum(mt * BM * S + BM * S, Sq) - 1
        max_key = last_q + kq_shift
        hi = tl.where(max_key < 0, 0, tl.minimum(n_cols, max_key // S + 1))
        x = mt * BM * S + kq_shift + 1  # keys kr < x are causal for every real query row of the tile
        full = tl.where(x < 0, 0, x // S)
        full = tl.minimum((full // BN) * BN, hi)
    else:
        hi = n_cols
        full = n_cols
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    offs_n = tl.arange(0, BN)
    lrows = tl.arange(0, BM)
    EVEN_D: tl.constexpr = D == BD
    q_offs = (lrows * (S * stride_qs))[:, None] + offs_d[None, :]
    k_offs = (offs_n * (S * stride_ks))[:, None] + offs_d[None, :]
    row0 = mt * BM
    q_tile = q_base + (row0 * S).to(tl.int64) * stride_qs
    stride_ks64 = stride_ks.to(tl.int64)
    q_left = Sq - row0 * S
    for c0 in range(0, full, BN):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        cols = c0 + offs_n
        k_tile = k_base + c0 * S * stride_ks64
        acc = _strided_tile(acc, q_tile, k_tile, q_offs, k_offs, lrows, offs_n, d_ok, stride_qs, stride_ks,
                            q_left, Sk - c0 * S, kq_shift + row0 * S - c0 * S, S, False, EVEN_D, NUM_STAGES)
        m_i, l_i = _tile_stats(acc, m_i, l_i, c0, rows, cols, t_lo, Sk, kq_shift, n_rows, qk_scale2,
                               BL_row_base, stride_lr, n_blocks, R, S, CB, BM, BN, False)
    for c0 in range(full, hi, BN):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        cols = c0 + offs_n
        k_tile = k_base + c0 * S * stride_ks64
        acc = _strided_tile(acc, q_tile, k_tile, q_offs, k_offs, lrows, offs_n, d_ok, stride_qs, stride_ks,
                            q_left, Sk - c0 * S, kq_shift + row0 * S - c0 * S, S, CAUSAL, EVEN_D, NUM_STAGES)
        m_i, l_i = _tile_stats(acc, m_i, l_i, c0, rows, cols, t_lo, Sk, kq_shift, n_rows, qk_scale2,
                               BL_row_base, stride_lr, n_blocks, R, S, CB, BM, BN, CAUSAL)
    r_ok = rows < R
    r_off = b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh + rows
    tl.store(RM + r_off, m_i * 0.6931471805599453, mask=r_ok)
    tl.store(RS + r_off, l_i, mask=r_ok)


# (BM strided rows, BN strided columns, num_warps, num_stages). On the GPU, long inputs pick among
# these by timing (triton.autotune, keyed on stride, head_dim, causal and the length bucket);
# short inputs and the interpreter use the first / the small one.
# launch_override("xattn_stats", cfg) fixes the config (block_n is raised to the block width).
_GPU_STATS_CONFIGS = [LaunchConfig(128, 64, 8, 3), LaunchConfig(128, 128, 8, 3), LaunchConfig(128, 128, 8, 2)]
_INTERP_STATS_CONFIG = LaunchConfig(32, 32, 1, 1)
_AUTOTUNE_MIN_ROWS = 2048  # strided rows (16K tokens at S=8)


def _stats_grid(n_rows, n_bh):
    return lambda meta: (triton.cdiv(n_rows, meta["BM"]) * n_bh,)


_xattn_stats_tuned = triton.autotune(
    configs=[triton.Config({"BM": bm, "BN": bn, "NUM_STAGES": st}, num_warps=w, num_stages=st)
             for bm, bn, w, st, _ in _GPU_STATS_CONFIGS],
    key=["S", "D", "CAUSAL", "LEN_BUCKET"],
)(_xattn_stats_kernel)


def _stats_config(q: torch.Tensor, cb: int, n_rows: int):
    """A fixed (BM, BN, num_warps, num_stages), or None to autotune."""
    cfg = override_for("xattn_stats")
    if cfg is None and not q.is_cuda:
        cfg = _INTERP_STATS_CONFIG
    if cfg is None and q.dtype == torch.float32:
        cfg = LaunchConfig(64, 64, 4, 2)
    if cfg is None and n_rows >= _AUTOTUNE_MIN_ROWS and cb <= 64:
        return None
    cfg = cfg or _GPU_STATS_CONFIGS[0]
    return cfg.block_m, max(cfg.block_n, cb), cfg.num_warps, cfg.num_stages


def _launch_stats(q, k, block_lse, row_max, row_sum, *, stride, block_size, q_start, k_offset,
                  causal, scale):
    b, sq, hq, d = q.shape
    skc, hkv = k.shape[1], k.shape[2]
    cb = block_size // stride
    n_rows = -(-sq // stride)
    r = row_max.shape[-1]
    n_blocks = block_lse.shape[-1]
    n_bh = b * hq
    if n_rows == 0 or n_bh == 0 or n_blocks == 0:
        return
    args = (q, k, block_lse, row_max, row_sum,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            block_lse.stride(0), block_lse.stride(1), block_lse.stride(2),
            row_max.stride(0), row_max.stride(1),
            sq, skc, k_offset, q_start, n_rows, r, n_blocks, n_bh, hq, hq // hkv, next_pow2(n_rows),
            scale / stride * _LOG2E)
    consts = dict(S=stride, CB=cb, D=d, BD=max(16, next_pow2(d)), CAUSAL=causal)
    cfg = _stats_config(q, cb, n_rows)
    if cfg is None:
        _xattn_stats_tuned[_stats_grid(n_rows, n_bh)](*args, **consts)
        return
    bm, bn, warps, stages = cfg
    _xattn_stats_kernel[_stats_grid(n_rows, n_bh)](*args, **consts, BM=bm, BN=bn, NUM_STAGES=stages,
                                                   num_warps=warps, num_stages=stages)


def xattn_chunk_stats(q, k, *, q_start, k_offset=0, stride=8, block_size=128, causal=True,
                      softmax_scale=None) -> XAttnChunkStats:
    """Stage 1: softmax statistics of the strided antidiagonal scores against one KV chunk.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32 (last dim contiguous); row ``r`` at absolute
            position ``q_start + r``.
        k: ``[B, Sk_chunk, Hkv, D]`` the chunk's keys, same dtype/device; key row ``r`` at
            absolute position ``k_offset + r``. ``Hq % Hkv == 0`` (GQA, no repeated K).
        q_start: int, absolute position of ``q[:, 0]`` (required: a chunk does not know the total
            key length). May be negative (rows at negative positions see nothing).
        k_offset: int >= 0, multiple of ``block_size``.
        stride: S, a power of two dividing ``block_size`` (4, 8, 16 in the paper).
        block_size: B, power of two >= 16.
        causal: count only key positions <= the query's position.
        softmax_scale: default ``1/sqrt(D)``; the strided scores use ``softmax_scale / S``.

    Returns:
        :class:`XAttnChunkStats` (fp32; see its fields for shapes).

    Raises:
        TypeError / ValueError: bad tensors, dtypes, shapes, GQA ratio, stride/block geometry,
            ``k_offset`` not a non-negative multiple of ``block_size``.
    """
    check_qkv(q, k, None, 4, same_batch=True)
    check_geometry(stride, block_size)
    causal = check_bool("causal", causal)
    if not is_int(q_start):
        raise TypeError(f"q_start must be an int, got {type(q_start).__name__}")
    if not is_int(k_offset) or k_offset < 0 or k_offset % block_size:
        raise ValueError(f"k_offset must be a non-negative multiple of block_size={block_size}, got {k_offset!r}")
    b, sq, hq, d = q.shape
    skc = k.shape[1]
    scale = default_scale(d, softmax_scale)
    cb = block_size // stride
    nqb = -(-sq // block_size)
    nkb = -(-skc // block_size)
    r = nqb * cb
    if not use_triton(q):
        rm, rs, bl = reference.xattn_chunk_stats_ref(
            q, k, stride=stride, block_size=block_size, q_start=q_start, k_offset=k_offset,
            causal=causal, softmax_scale=scale)
        return XAttnChunkStats(rm, rs, bl, k_offset // block_size)
    dev = q.device
    block_lse = torch.full((b, hq, r, nkb), float("-inf"), dtype=torch.float32, device=dev)
    row_max = torch.full((b, hq, r), float("-inf"), dtype=torch.float32, device=dev)
    row_sum = torch.zeros((b, hq, r), dtype=torch.float32, device=dev)
    _launch_stats(q, k, block_lse, row_max, row_sum, stride=stride, block_size=block_size,
                  q_start=q_start, k_offset=k_offset, causal=causal, scale=scale)
    return XAttnChunkStats(row_max, row_sum, block_lse, k_offset // block_size)


# ----------------------------------------------------------------------------------------------
# stage 2: merge
# ----------------------------------------------------------------------------------------------

def xattn_merge_stats(stats: Sequence):
    """Stage 2: merge per-chunk (row max, row sum) statistics into the statistics over all keys.

    Args:
        stats: non-empty sequence whose items are :class:`XAttnChunkStats` or ``(row_max,
            row_sum)`` pairs, all fp32 of one shape ``[B, Hq, R]``.

    Returns:
        ``(row_max, row_sum)`` fp32 ``[B, Hq, R]``: ``row_max = max_c m_c`` and ``row_sum =
        sum_c l_c * exp(m_c - row_max)``; rows seen by no chunk stay (-inf, 0), never NaN.

    Raises:
        ValueError: empty sequence or shapes differ; TypeError: non-tensor or non-fp32 items.
    """
    items = list(stats)
    if not items:
        raise ValueError("xattn_merge_stats needs at least one chunk's statistics")
    pairs = []
    for n, it in enumerate(items):
        m, l = it[0], it[1]
        for name, t in (("row_max", m), ("row_sum", l)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"stats[{n}].{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise TypeError(f"stats[{n}].{name} must be float32, got {t.dtype}")
        if m.shape != items[0][0].shape or l.shape != m.shape:
            raise ValueError(
                f"stats[{n}] has row_max {tuple(m.shape)} / row_sum {tuple(l.shape)}; "
                f"expected both {tuple(items[0][0].shape)}"
            )
        pairs.append((m, l))
    if len(pairs) == 1:
        return pairs[0][0].clone(), pairs[0][1].clone()
    m_all = torch.stack([p[0] for p in pairs])
    l_all = torch.stack([p[1] for p in pairs])
    m = m_all.amax(0)
    m_sub = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    l = (l_all * torch.exp(m_all - m_sub)).sum(0)
    return m, l


# ----------------------------------------------------------------------------------------------
# stage 3: normalise and block-sum (Triton)
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_blocks", "H", "stride_lb", "stride_lh", "stride_lr", "stride_rb",
                               "stride_rh", "stride_ob", "stride_oh", "stride_oi"])
def _xattn_block_sum_kernel(BL, RM, RS, OUT,
                            stride_lb, stride_lh, stride_lr,
                            stride_rb, stride_rh,
                            stride_ob, stride_oh, stride_oi,
                            n_blocks, H, CB: tl.constexpr, BJ: tl.constexpr):
    I = tl.program_id(0)
    bh = tl.program_id(1)
    jt = tl.program_id(2)
    b = bh // H
    h = bh % H
    rows = I * CB + tl.arange(0, CB)
    cols = jt * BJ + tl.arange(0, BJ)
    c_ok = cols < n_blocks
    r_off = b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh + rows
    mx = tl.load(RM + r_off)
    sm = tl.load(RS + r_off)
    ok = sm > 0.0
    lse = tl.where(ok, mx + tl.log(tl.where(ok, sm, 1.0)), 0.0)
    bl = tl.load(BL + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
                 + rows.to(tl.int64)[:, None] * stride_lr + cols[None, :],
                 mask=c_ok[None, :], other=float("-inf"))
    p = tl.where(ok[:, None], tl.exp(bl - lse[:, None]), 0.0)
    acc = tl.sum(p, axis=0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + I.to(tl.int64) * stride_oi
             + cols, acc, mask=c_ok)


def xattn_block_scores(block_lse, row_max, row_sum, *, stride=8, block_size=128, out=None):
    """Stage 3: normalise one chunk's block log-sum-exps and sum the strided rows of each query block.

    Args:
        block_lse: fp32 ``[B, Hq, R, nkb_chunk]`` from :func:`xattn_chunk_stats`
            (``R = q_blocks * block_size/stride``).
        row_max, row_sum: fp32 ``[B, Hq, R]``, merged over *all* chunks (:func:`xattn_merge_stats`).
        stride, block_size: as in stage 1.
        out: optional fp32 ``[B, Hq, q_blocks, nkb_chunk]`` (may be a column slice of a larger
            tensor; last dim contiguous) to write into.

    Returns:
        fp32 ``[B, Hq, q_blocks, nkb_chunk]``: ``sum_{rows of I} exp(block_lse - row_lse)``
        (0 for blocks nothing sees).

    Raises:
        TypeError / ValueError: non-fp32 or mismatched shapes, bad geometry.
    """
    check_geometry(stride, block_size)
    cb = block_size // stride
    for name, t, nd in (("block_lse", block_lse, 4), ("row_max", row_max, 3), ("row_sum", row_sum, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}")
    b, h, r, nkb = block_lse.shape
    if tuple(row_max.shape) != (b, h, r) or tuple(row_sum.shape) != (b, h, r):
        raise ValueError(
            f"row_max {tuple(row_max.shape)} and row_sum {tuple(row_sum.shape)} must be {(b, h, r)} "
            f"to match block_lse {tuple(block_lse.shape)}"
        )
    if r % cb:
        raise ValueError(f"block_lse has {r} strided rows, not a multiple of block_size/stride = {cb}")
    nqb = r // cb
    if out is not None:
        check_out("out", out, (b, h, nqb, nkb), torch.float32, block_lse.device)
    if not use_triton(block_lse):
        res = reference.xattn_block_scores_ref(block_lse, row_max, row_sum, rows_per_block=cb)
        if out is not None:
            out.copy_(res)
            return out
        return res
    if out is None:
        out = torch.empty((b, h, nqb, nkb), dtype=torch.float32, device=block_lse.device)
    if out.numel() == 0:
        return out
    block_lse = block_lse if block_lse.stride(-1) == 1 else block_lse.contiguous()
    row_max = row_max.contiguous()
    row_sum = row_sum.contiguous()
    bj = min(256, max(16, 4096 // cb))
    grid = (nqb, b * h, triton.cdiv(nkb, bj))
    _xattn_block_sum_kernel[grid](
        block_lse, row_max, row_sum, out,
        block_lse.stride(0), block_lse.stride(1), block_lse.stride(2),
        row_max.stride(0), row_max.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        nkb, h, CB=cb, BJ=bj, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------
# one call
# ----------------------------------------------------------------------------------------------

def _estimate_heads(q, k, *, stride, block_size, chunk_size, q_start, causal, scale, out):
    sq, sk = q.shape[1], k.shape[1]
    chunk = sk if chunk_size is None else chunk_size
    # causal: chunks that start after the last query position are invisible (scores stay 0)
    last_pos = q_start + sq - 1
    stats = []
    for c0 in range(0, sk, max(chunk, 1)):
        if causal and c0 > last_pos:
            break
        kc = k[:, c0:c0 + chunk]
        stats.append(xattn_chunk_stats(q, kc, q_start=q_start, k_offset=c0, stride=stride,
                                       block_size=block_size, causal=causal, softmax_scale=scale))
    if not stats:
        return
    m, l = xattn_merge_stats(stats)
    for st in stats:
        j0 = st.k_block_start
        nkb_c = st.block_lse.shape[-1]
        xattn_block_scores(st.block_lse, m, l, stride=stride, block_size=block_size,
                           out=out[..., j0:j0 + nkb_c])


def xattn_estimate(q, k, *, stride=8, block_size=128, chunk_size=None, q_start=None, causal=True,
                   softmax_scale=None, max_workspace_bytes=1 << 30):
    """XAttention block scores of ``q`` against ``k`` (stages 1-3; see the module docstring).

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32, last dim contiguous.
        k: ``[B, Sk, Hkv, D]`` same dtype/device, ``Hq % Hkv == 0``.
        stride: S, power of two dividing ``block_size`` (4, 8 or 16 typical).
        block_size: B, power of two >= 16 (128 with the block-sparse kernel).
        chunk_size: None (one chunk) or a positive multiple of ``block_size``: K is processed in
            chunks of that many keys (last one shorter); the result equals the one-shot estimate.
        q_start: absolute position of ``q[:, 0]``; default ``Sk - Sq`` (bottom-right, as the
            attention kernels).
        causal: only keys at positions <= a query's position count.
        softmax_scale: default ``1/sqrt(D)``; the strided scores use ``softmax_scale / S``.
        max_workspace_bytes: KV-head groups are processed in turn to keep the block log-sum-exp
            workspace under this size (at least one KV head at a time).

    Returns:
        fp32 ``[B, Hq, ceil(Sq/B), ceil(Sk/B)]`` block scores; each query block's row sums to the
        number of its strided rows that see some key; causally invisible blocks are 0.

    Raises:
        TypeError / ValueError: bad tensors or dtypes, batch/head_dim mismatch, GQA ratio,
            stride not dividing block_size, block_size not a power of two >= 16, chunk_size not a
            positive multiple of block_size, non-int q_start.
    """
    check_qkv(q, k, None, 4, same_batch=True)
    check_geometry(stride, block_size)
    causal = check_bool("causal", causal)
    if chunk_size is not None:
        if not is_int(chunk_size) or chunk_size <= 0 or chunk_size % block_size:
            raise ValueError(f"chunk_size must be None or a positive multiple of block_size={block_size}, "
                             f"got {chunk_size!r}")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if q_start is None:
        q_start = sk - sq
    elif not is_int(q_start):
        raise TypeError(f"q_start must be an int, got {type(q_start).__name__}")
    scale = default_scale(d, softmax_scale)
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    out = torch.zeros((b, hq, nqb, nkb), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    group = hq // hkv
    per_kv_head = 4 * b * group * nqb * (block_size // stride) * nkb
    kv_per_step = max(1, min(hkv, int(max_workspace_bytes) // max(per_kv_head, 1)))
    for g0 in range(0, hkv, kv_per_step):
        g1 = min(hkv, g0 + kv_per_step)
        _estimate_heads(q[:, :, g0 * group:g1 * group], k[:, :, g0:g1], stride=stride,
                        block_size=block_size, chunk_size=chunk_size, q_start=q_start,
                        causal=causal, scale=scale, out=out[:, g0 * group:g1 * group])
    return out
