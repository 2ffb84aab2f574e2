"""Dense prefill attention that also returns the log-sum-exp (LSE) of each query row.

(Over 450 lines on purpose: one kernel with its wrapper, as every kernel file; the flash-attn
options — window, softcap, ALiBi, paged K/V — are constexpr branches of the same tile loop.)

FlashAttention-2 style forward pass (Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023): each program owns one block of query rows of one head
and walks the key/value blocks with an online softmax (running row max ``m``, running row sum
``l``, fp32 accumulator), in base 2 (``exp2`` with the scale folded into ``log2(e)``). The LSE it
returns lets partial attentions over disjoint key sets merge exactly
(:func:`xoffload.kernels.merge_attention_states`).

Conventions (DESIGN.md): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; query head ``h`` reads KV
head ``h // (Hq // Hkv)``; only the last dim must be contiguous; LSE natural log, fp32,
``[B, Hq, Sq]`` (varlen ``[Hq, total_q]``); causal is bottom-right aligned (query ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``); a row that sees no key gives output 0 and LSE -inf.

One Triton kernel serves the padded-batch and the varlen (packed, ``cu_seqlens``) forms. Under
causal masking each query block runs two loops: the key blocks every row of the block sees, with
no masking, then the few blocks on the diagonal, masked. Programs are ordered so that the query
blocks with the most keys (the last ones, under causal) start first.

flash-attn's inference options run inside the same kernel, behind compile-time flags (a call
without them compiles to the plain kernel, instruction for instruction): ``window_size`` (sliding
window; the key tiles outside a query block's window are never visited, :func:`window_tile_bounds`),
``softcap`` (``softcap * tanh(s / softcap)``), ``alibi_slopes`` (``-slope * |pos - j|``),
``block_table`` (paged K/V ``[num_pages, page_size, Hkv, D]`` read through the table) and
``seqused_k`` (keys used per sequence). With a window, softcap, ALiBi or pages each query block
runs three loops: the masked left edge of its window, the unmasked interior, the masked right edge
(non-causal ALiBi splits the interior at the diagonal); with a window or ALiBi both masked edges
share one loop, run first. That option path lives in
:mod:`xoffload.kernels.flash_attn_opts`, with ALiBi's per-tile bias forms.

Where the tensors allow it (16-bit, K/V not paged, 16-byte aligned: :func:`_tma_possible`) Q, K
and V go through TMA descriptors built inside the kernel, one per sequence and head, so TMA
zero-fills the rows past ``seqlen_q`` / ``seqlen_k`` (``seqused_k`` included) and the columns past
``D`` that pointer loads mask. Freed of per-thread address registers, a 128x64 tile fits one
warpgroup (4 warps, 2 stages): the sm_90 tiles of plain, softcap and windowed calls at 64 < D <=
128; ALiBi without a window at D <= 64 also loads through TMA, in its 128x64 / 4-warp / 3-stage
tiles (:func:`_gpu_config`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .checks import (
    check_bool, check_cu_seqlens, check_heads, check_int, check_lengths, check_qkv, check_same, check_tensor,
    default_scale, interpreter_on, is_int, next_pow2, use_triton,
)
from .flash_attn_opts import _attn_opt_loops, _tanh, _window_tile_bounds  # noqa: F401 (re-exported)
from .launch import LaunchConfig, override_for, tma_alloc, tma_ok
from .reference import attention_ref, varlen_attention_ref

__all__ = ["flash_attn_with_lse", "flash_attn_varlen_with_lse", "window_tile_bounds"]

_INT32_MAX = 2 ** 31 - 1


def _check_max_seqlen(name: str, value, cu: torch.Tensor, cu_name: str) -> int:
    value = check_int(name, value, 0)
    lens = cu.cpu().diff()
    longest = int(lens.max()) if lens.numel() else 0
    if value < longest:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence in {cu_name} ({longest})")
    return value


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _online_softmax_step(qk, m_i, l_i, acc, start_n, offs_n, offs_m, seqlen_k, diag_shift, qk_scale,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One online-softmax update (FlashAttention-2) for a tile of raw scores ``qk`` [M, N].

    Returns ``(p, m_new, l_i, acc)``: the tile's unnormalised probabilities (base 2, scale
    folded in), the new row max, and l_i / acc rescaled to it. With ``MASKED`` keys at or past
    ``seqlen_k`` (and, with ``CAUSAL``, keys after ``offs_m + diag_shift``) get probability 0; a
    row that has seen no key yet keeps m = -inf and subtracts 0 instead (no NaN). Shared by the
    dense and block-sparse kernels (inlined by Triton).
    """
    if MASKED:
        ok = ((start_n + offs_n) < seqlen_k)[None, :]
        if CAUSAL:
            ok = ok & ((start_n + offs_n)[None, :] <= (offs_m[:, None] + diag_shift))
        qk = tl.where(ok, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _attn_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, offs_m, offs_n,
                d_ok, lo, hi, seqlen_k, diag_shift, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                IS_FP32: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, stride_kn, stride_vn):
    for start_n in tl.range(lo, hi, BLOCK_N):
        if USE_TMA:  # keys past seqlen_k and columns past D arrive as zeros
            k = k_desc.load([start_n, 0])
        elif MASKED:
            n_ok = (start_n + offs_n) < seqlen_k
            k = tl.load(k_base + k_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_base + k_offs)
        else:
            k = tl.load(k_base + k_offs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        p, m_new, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, start_n, offs_n, offs_m, seqlen_k,
                                                  diag_shift, qk_scale, MASKED, CAUSAL)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        elif MASKED:
            v = tl.load(v_base + v_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_base + v_offs)
        else:
            v = tl.load(v_base + v_offs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        k_base += BLOCK_N * stride_kn
        v_base += BLOCK_N * stride_vn
    return acc, l_i, m_i

@triton.jit(do_not_specialize=["Sq", "Sk", "win_left", "win_right", "max_entry"])
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K,
              stride_qb, stride_qm, stride_qh,
              stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh,
              stride_ob, stride_om, stride_oh,
              stride_lb, stride_lh, stride_lm,
              Sq, Sk, n_bh, n_heads, group, num_m_blocks, qk_scale,
              BT, SEQUSED, ALIBI_SLOPES, stride_btb, stride_btn, stride_alb, stride_alh,
              win_left, win_right, cap_in, cap_out, max_entry,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
              IS_FP32: tl.constexpr, HAS_SEQUSED: tl.constexpr = False, PAGED: tl.constexpr = False,
              PAGE: tl.constexpr = 16, HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
              SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, FAST_TANH: tl.constexpr = False,
              EDGES_ONE_LOOP: tl.constexpr = False, USE_TMA: tl.constexpr = False):
    # Options (all compile-time flags; with none set the code is the plain kernel's):
    # HAS_SEQUSED: key length of item b is SEQUSED[b] (clamped to the keys there are); PAGED: K/V
    # are [num_pages, PAGE, Hkv, D] caches read through the block table BT [B, P] (stride_kb /
    # stride_vb are then the page strides); HAS_LEFT / HAS_RIGHT: sliding window bounds;
    # SOFTCAP: cap_in = scale / softcap, cap_out = softcap * log2(e); ALIBI: per-(b, h) slopes;
    # EDGES_ONE_LOOP: the option path walks both masked edges of a block in one loop; USE_TMA:
    # Q, K and V through tensor descriptors built here (per sequence and head, so TMA zero-fills
    # rows past seqlen_q / seqlen_k and columns past D; 16-bit, not paged, 16-byte aligned);
    # 1-D grid: the (batch, head) index varies fastest, so the first programs launched are
    # the last query block of every head (the longest rows under causal) and programs that
    # run together share K/V heads (GQA) in L2.
    pid = tl.program_id(0)
    bh = pid % n_bh
    mb = num_m_blocks - 1 - pid // n_bh
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        seqlen_k = tl.load(CU_K + b + 1) - k_start
        q_row0 = q_start.to(tl.int64)
        k_row0 = k_start.to(tl.int64)
    else:
        seqlen_q = Sq
        seqlen_k = Sk
        q_row0 = 0
        k_row0 = 0
    if HAS_SEQUSED:
        seqlen_k = tl.minimum(tl.maximum(tl.load(SEQUSED + b), 0), seqlen_k)
    if PAGED:
        k_row0 = 0
    m0 = mb * BLOCK_M
    if m0 < seqlen_q:
        EVEN_D: tl.constexpr = D == BLOCK_D
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < seqlen_q
        # int64 bases: batch / head / row products can pass 2^31 elements
        q_seq = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_row0 * stride_qm  # row 0
        k_base = (K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
                  + k_row0 * stride_kn)
        v_base = (V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
                  + k_row0 * stride_vn)
        rows = tl.arange(0, BLOCK_M)
        if USE_TMA:
            q_desc = tl.make_tensor_descriptor(q_seq, shape=[seqlen_q, D],
                                               strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D])
            k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(seqlen_k, 1), D], strides=[stride_kn, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(seqlen_k, 1), D], strides=[stride_vn, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
            q = q_desc.load([m0, 0])
        else:
            k_desc = k_base
            v_desc = v_base
            q = tl.load(q_seq + m0.to(tl.int64) * stride_qm + rows[:, None] * stride_qm + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        diag_shift = seqlen_k - seqlen_q
        HAS_OPTS: tl.constexpr = PAGED or HAS_LEFT or HAS_RIGHT or SOFTCAP or ALIBI
        if HAS_OPTS:
            # masked left edge of the window, unmasked interior (split at the diagonal for
            # non-causal ALiBi), masked right edge; tiles outside the window are never visited
            slope2 = 0.0
            if ALIBI:
                slope2 = tl.load(ALIBI_SLOPES + b.to(tl.int64) * stride_alb + h * stride_alh) * 1.4426950408889634
            bt_row = BT + b.to(tl.int64) * stride_btb
            k_head = h_kv.to(tl.int64) * stride_kh
            v_head = h_kv.to(tl.int64) * stride_vh
            acc, l_i, m_i, alibi_base, shift2 = _attn_opt_loops(
                acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head,
                offs_m, offs_n, offs_d, d_ok, m0, seqlen_q, seqlen_k, diag_shift, win_left, win_right,
                qk_scale, cap_in, cap_out, slope2, max_entry, stride_kn, stride_vn, stride_kb, stride_vb, stride_btn,
                CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, FAST_TANH, PAGED, PAGE,
                EVEN_D, IS_FP32, EDGES_ONE_LOOP, USE_TMA, BLOCK_M, BLOCK_N)
            if ALIBI and not IS_FP32:  # the loops carry the per-row shift shift2 * (pos - alibi_base) in m_i
                m_i = m_i - shift2 * (offs_m + diag_shift - alibi_base).to(tl.float32)
        else:
            if CAUSAL:
                hi = tl.minimum(seqlen_k, tl.maximum(m0 + BLOCK_M + diag_shift, 0))
                # keys < m0 + diag_shift + 1 are visible to every row of the block
                full = tl.minimum(tl.maximum(m0 + diag_shift + 1, 0), seqlen_k)
                full = (full // BLOCK_N) * BLOCK_N
            else:
                hi = seqlen_k
                full = (seqlen_k // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _attn_inner(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, offs_m, offs_n, d_ok,
                0, full, seqlen_k, diag_shift, qk_scale,
                False, CAUSAL, EVEN_D, IS_FP32, USE_TMA, BLOCK_N, stride_kn, stride_vn)
            acc, l_i, m_i = _attn_inner(
                acc, l_i, m_i, q, k_base + full.to(tl.int64) * stride_kn,
                v_base + full.to(tl.int64) * stride_vn, k_desc, v_desc, k_offs, v_offs, offs_m, offs_n,
                d_ok, full, hi, seqlen_k, diag_shift, qk_scale,
                True, CAUSAL, EVEN_D, IS_FP32, USE_TMA, BLOCK_N, stride_kn, stride_vn)

        empty = l_i == 0.0
        l_div = tl.where(empty, 1.0, l_i)
        out = acc / l_div[:, None]
        # m_i is in log2 units (scores scaled by log2(e)); convert back to natural log
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
        o_base = (O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + (q_row0 + m0.to(tl.int64)) * stride_om)
        tl.store(o_base + rows[:, None] * stride_om + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        l_base = (LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
                  + (q_row0 + m0.to(tl.int64)) * stride_lm)
        tl.store(l_base + rows * stride_lm, lse, mask=m_ok)


_INTERP_CFG = LaunchConfig(64, 32, 4, 1)  # BLOCK_M != BLOCK_N, as on the GPU


def _gpu_config(block_d: int, dtype: torch.dtype, page_size: int = 0, *, window: bool = False,
                alibi: bool = False, tma: bool = False) -> LaunchConfig:
    """Launch configuration on a CUDA device (chosen from timings on an H200).

    fp32 runs the exact (non-tf32) product, which Hopper's tensor cores do not do: small tiles
    that keep register spills low; it is an accuracy path, not a fast one. ``page_size``: a paged
    call (0: contiguous K/V); ``window``: a sliding window bounds the keys; ``alibi``: ALiBi slopes;
    ``tma``: Q / K / V can go through TMA descriptors (:func:`_tma_possible`).
    """
    if page_size and page_size % 128 and 64 < block_d <= 128 and dtype != torch.float32:
        # pages smaller than a 128-key tile take one table entry per key row: with 128x128 tiles
        # ptxas (sm_90a, CUDA 13.4) spills ~1 KB per thread, with 128x64 ~24 B (not timed yet)
        return LaunchConfig(128, 64, 8, 3)
    if dtype == torch.float32:
        return LaunchConfig(32, 16, 4, 2) if block_d <= 128 else LaunchConfig(16, 16, 4, 1)
    # H200, bf16, causal window 4096 (tools/diag_option_forms.py): at 128K 128x64 tiles with
    # 8 warps run best (option_forms_run4.json: D=64 406-412 TFLOP/s against 378-382 in 64x64 / 4
    # warps, D=128 453-457 against 421-442; an earlier 32K sweep had 8 warps losing, 319 against
    # 415 at D=64, before later kernel changes). A window with ALiBi at D=64 keeps 64x64 /
    # 4 warps (32K: 385 against 311 with 8 warps); with softcap the tiles tie. ALiBi at D=64 in
    # 128x64 with 4 warps (causal 379 vs 320). Softcap at D=64 keeps the plain tiles
    # (TMA in them: 347 / 340 TFLOP/s against 335 / 350, non-causal / causal; softcap_ws_s13_d64.json).
    if window and alibi and block_d <= 64:
        return LaunchConfig(64, 64, 4, 3)
    if alibi and block_d <= 64:
        # through TMA where it can (32K, head to head: causal
        # 432 TFLOP/s against 412 with pointer loads, non-causal 405 against 400; the final
        # benchmark, attention_options_scores.json: causal 423, non-causal 385 against 398-402
        # with pointer loads in two earlier runs)
        return LaunchConfig(128, 64, 4, 3, tma=tma)
    if 64 < block_d <= 128 and tma and not alibi:
        # With Q / K / V through TMA a 128x64 tile fits one warpgroup (4 warps, 2
        # stages) without the address registers of pointer loads (with pointer loads these tiles
        # spill: 150-180 TFLOP/s). 32K, D=128 (softcap_ws_run2.json, attention_options*.json):
        # plain 514-532 TFLOP/s against 503-511 in 128x128 / 8 warps, softcap 471-487 against
        # 410-437; a causal 4096 window at 128K 1.05x the area-scaled causal time against 1.12x.
        # ALiBi keeps its pointer tiles (TMA 128x64: 0.79-0.81x plain
        # against 0.92-0.95x).
        return LaunchConfig(128, 64, 4, 2, tma=True)
    if window and block_d <= 128:
        return LaunchConfig(128, 64, 8, 3)
    # H200, bf16, causal, 32K (benchmarks/results/attention.json, sweep): D=64 9/3 heads:
    # 128x64 8 warps 486 TFLOP/s (128x128: 375-452, 64x64: 463); D=128 32/8 heads: 128x128
    # 8 warps 3 stages 508 (TMA K/V loads in these tiles: the same; warp specialization: 479;
    # 128x64: 477-501; 2 stages: 445). D=64 with TMA in 128x64 / 4 warps: 399-415 against 452
    # (softcap_ws_run2.json).
    if block_d <= 64:
        return LaunchConfig(128, 64, 8, 3)
    if block_d <= 128:
        return LaunchConfig(128, 128, 8, 3)
    return LaunchConfig(64, 32, 4, 2)


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    """sm_90 or newer (Hopper's TMA); Triton lowers descriptors to pointer loads below that, in
    tiles that would then spill."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_possible(q, k, v, opts) -> bool:
    """Whether Q / K / V can go through TMA descriptors: 16-bit, K/V not paged and not empty, the
    last dim contiguous and at least 16 bytes, 16-byte aligned bases and strides
    (:func:`launch.tma_ok`), rows that do not overlap (the
    sequence stride, dim -3 of padded ``[B, S, H, D]`` and varlen ``[T, H, D]`` alike, at least D
    elements: a descriptor's row stride cannot be smaller than its row), and on a GPU one with TMA
    (sm_90+). The interpreter takes descriptors on any such tensors (tests)."""
    if q.dtype == torch.float32 or opts.block_table is not None or k.numel() == 0:
        return False
    if q.is_cuda and not _has_tma(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return False
    return tma_ok(q, k, v) and all(t.stride(-3) >= t.shape[-1] for t in (q, k, v))


def _edges_one_loop(opts) -> bool:
    """Whether the option path walks both masked edges of a query block in one loop: windows and
    ALiBi. H200: causal ALiBi at 32K, D=128, 0.98x plain
    against 0.94-0.95x with three loops (two runs); a 4096 window at 128K, D=128, in 64x64 tiles
    1.10x the area-scaled causal time against 1.15x, and at its own 128x64 / 8-warp tiles within
    noise either way (D=64 1.11x against 1.09x, D=128 1.07x against 1.06x in one run; 1.10x / 1.04x
    with one loop in another). Softcap alone keeps three loops (one loop at D=64, causal, 8 warps:
    0.60x plain against 0.78x), and so do pages alone (not measured)."""
    return opts.windowed or opts.alibi is not None


class _Options(NamedTuple):
    """The options of one call, checked and normalised (see :func:`_normalise_options`)."""

    causal: bool
    left: int  # -1: unbounded
    right: int  # -1: unbounded; 0 with causal
    softcap: float  # 0: off
    alibi: Optional[torch.Tensor]  # fp32 [Hq] or [B, Hq]
    block_table: Optional[torch.Tensor]  # int32 [B, P]
    seqused_k: Optional[torch.Tensor]  # int32 [B]

    @property
    def windowed(self) -> bool:
        """A window bounds the keys (a left bound, or a right one that causal does not set)."""
        return self.left >= 0 or (self.right >= 0 and not self.causal)

    @property
    def plain(self) -> bool:
        """No option that needs the option path of the kernel (seqused_k alone does not)."""
        return (self.left < 0 and (self.causal or self.right < 0) and self.softcap == 0.0
                and self.alibi is None and self.block_table is None)

    def flags(self) -> dict:
        """The kernel's compile-time option flags (all False for a plain call)."""
        return {
            "HAS_SEQUSED": self.seqused_k is not None,
            "PAGED": self.block_table is not None,
            "HAS_LEFT": self.left >= 0,
            "HAS_RIGHT": (not self.causal) and self.right >= 0,  # windowed = HAS_LEFT or HAS_RIGHT
            "SOFTCAP": self.softcap > 0.0,
            "ALIBI": self.alibi is not None,
        }


_PLAIN = _Options(False, -1, -1, 0.0, None, None, None)


def _check_window(window_size) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(is_int(x) for x in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded, got {window_size!r}")
    left, right = (int(x) for x in window_size)
    if left < -1:
        raise ValueError(f"window_size left must be >= -1 (-1 = unbounded), got {left} "
                         f"(window_size={tuple(window_size)})")
    if right < -1:
        raise ValueError(f"window_size right must be >= -1 (-1 = unbounded), got {right} "
                         f"(window_size={tuple(window_size)})")
    return left, right


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__} {softcap!r}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0.0 = off), got {softcap!r}")
    return softcap


def _check_alibi(alibi, batch: int, hq: int, device) -> Optional[torch.Tensor]:
    if alibi is None:
        return None
    if not isinstance(alibi, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi).__name__}")
    if alibi.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi.dtype}")
    if tuple(alibi.shape) not in ((hq,), (batch, hq)):
        raise ValueError(f"alibi_slopes must have shape [Hq] = [{hq}] or [B, Hq] = [{batch}, {hq}], "
                         f"got {tuple(alibi.shape)}")
    if alibi.device != torch.device(device):
        raise ValueError(f"alibi_slopes is on {alibi.device} but q is on {device}")
    return alibi


def _check_paged_kv(q, k, v, block_table, batch: int) -> int:
    """Checks of a paged call (k/v ``[num_pages, page_size, Hkv, D]``, block_table int32 ``[B, P]``);
    returns page_size."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4)
    check_same([("q", q), ("k", k), ("v", v)])
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape ([num_pages, page_size, Hkv, D]), got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim: q {tuple(q.shape)}, k {tuple(k.shape)} "
                         "([num_pages, page_size, Hkv, D])")
    check_heads(q.shape[-2], k.shape[-2], q.shape[-1], "q", "k")
    num_pages, page_size = k.shape[0], k.shape[1]
    if page_size < 16 or page_size % 16:
        raise ValueError(f"page size (k.shape[1]) must be a multiple of 16, got {page_size} "
                         f"(k {tuple(k.shape)}, [num_pages, page_size, Hkv, D])")
    if num_pages < 1:
        raise ValueError(f"k has no pages: {tuple(k.shape)} ([num_pages, page_size, Hkv, D])")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape [B, max_pages_per_seq] = [{batch}, P], "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    if block_table.shape[1] * page_size > _INT32_MAX:
        raise ValueError(f"block_table holds {block_table.shape[1]} pages of {page_size} tokens, more than "
                         "int32 lengths can count (2^31 - 1)")
    return page_size


def _check_key_lengths(lens: torch.Tensor, avail: torch.Tensor, what: str) -> None:
    """Host check that each used key length is in ``[0, avail]`` (int64 CPU tensors)."""
    bad = (lens < 0) | (lens > avail)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"seqused_k[{i}] = {int(lens[i])} must be in [0, {int(avail[i])}] ({what})")


def _check_block_entries(block_table: torch.Tensor, lens: torch.Tensor, page_size: int, num_pages: int) -> None:
    """Host check that the table entries of the pages holding keys (page j < ceil(len_b / page_size))
    point inside the cache."""
    if block_table.numel() == 0 or lens.numel() == 0:
        return
    used = -(-lens.clamp(min=0) // page_size)  # [B]
    tab = block_table.cpu().to(torch.int64)
    visited = torch.arange(tab.shape[1])[None, :] < used[:, None]
    if not bool(visited.any()):
        return
    vals = tab[visited]
    bad = (vals < 0) | (vals >= num_pages)
    if bool(bad.any()):
        rows, cols = (visited & ((tab < 0) | (tab >= num_pages))).nonzero()[0].tolist()
        raise ValueError(f"block_table[{rows}, {cols}] = {int(tab[rows, cols])} points past the cache: entries of "
                         f"pages holding keys must be in [0, num_pages) = [0, {num_pages}) "
                         f"(k has {num_pages} pages of {page_size} tokens)")


def _normalise_options(causal, window_size, softcap, alibi_slopes, block_table, seqused_k, *, batch, hq,
                       device, max_q: int, max_k: int) -> _Options:
    """Checked options with flash-attn's rules applied: causal forces ``right = 0``; a non-causal
    ``right = 0`` is the causal mask; a bound that no query/key pair can reach (``left >= max_k - 1``,
    ``right >= max_q - 1``) is dropped (-1), so such a window costs nothing."""
    left, right = _check_window(window_size)
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, hq, device)
    if seqused_k is not None:
        check_lengths("seqused_k", seqused_k, batch, device)
    if causal:
        right = 0
    elif right == 0:
        causal = True
    if left >= max(max_k - 1, 0):
        left = -1
    if not causal and right >= max(max_q - 1, 0):
        right = -1
    return _Options(causal, left, right, softcap, alibi, block_table, seqused_k)


def window_tile_bounds(m0: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                       window_size=(-1, -1)) -> tuple[int, int, int, int]:
    """The key tiles the kernel visits for the query block of rows ``[m0, m0 + block_m)``.

    Returns ``(lo, full_lo, full_hi, hi)``, key indices: tiles ``[lo, full_lo)`` and ``[full_hi, hi)``
    run with the causal/window mask, tiles ``[full_lo, full_hi)`` without it (every row of the block
    sees every key there); keys outside ``[lo, hi)`` are seen by no row of the block and are never
    loaded, so a window's cost grows with its width, not with ``seqlen_k``. ``lo``, ``full_lo`` and
    ``full_hi`` are multiples of ``block_n`` (or ``full_lo == hi``). The same rule as the kernel's
    ``_window_tile_bounds`` (tested against it), with the options normalised as the public functions
    do (causal forces ``right = 0``). Window semantics as flash-attn: query ``i`` (bottom-right
    aligned, position ``i + seqlen_k - seqlen_q``) sees key ``j`` iff
    ``pos - left <= j <= pos + right``, -1 = unbounded.
    """
    o = _normalise_options(causal, window_size, 0.0, None, None, None, batch=1, hq=1, device="cpu",
                           max_q=seqlen_q, max_k=seqlen_k)
    diag = seqlen_k - seqlen_q
    p_lo = m0 + diag
    p_hi = min(m0 + block_m, seqlen_q) - 1 + diag
    vis_hi = full_hi_key = seqlen_k
    if o.causal:
        vis_hi = min(seqlen_k, max(p_hi + 1, 0))
        full_hi_key = min(seqlen_k, max(p_lo + 1, 0))
    elif o.right >= 0:
        vis_hi = min(seqlen_k, max(p_hi + o.right + 1, 0))
        full_hi_key = min(seqlen_k, max(p_lo + o.right + 1, 0))
    lo = full_lo = 0
    if o.left >= 0:
        vis_lo = min(max(p_lo - o.left, 0), vis_hi)
        lo = (vis_lo // block_n) * block_n
        full_lo = min(max(-(-max(p_hi - o.left, 0) // block_n) * block_n, lo), vis_hi)
    full_hi = max((full_hi_key // block_n) * block_n, full_lo)
    return lo, full_lo, full_hi, vis_hi


def _launch(q, k, v, out, lse, *, varlen, cu_q, cu_k, batch, sq, sk, max_sq, causal, scale, opts=_PLAIN):
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    paged = opts.block_table is not None
    block_d = max(16, next_pow2(d))
    page = k.shape[1] if paged else 0
    tma = _tma_possible(q, k, v, opts)
    cfg = override_for("flash_attn") or (_gpu_config(block_d, q.dtype, page, window=opts.windowed,
                                                      alibi=opts.alibi is not None, tma=tma)
                                         if q.is_cuda else _INTERP_CFG)
    use_tma = bool(cfg.tma) and tma  # else pointer loads in the same tiles
    if use_tma and q.is_cuda:
        triton.set_allocator(tma_alloc)  # scratch for the descriptors built inside the kernel
    block_m, block_n = cfg.block_m, cfg.block_n
    num_m = triton.cdiv(max_sq, block_m)
    n_bh = batch * hq
    grid = (num_m * n_bh,)
    if grid[0] == 0:
        return
    if paged:  # [num_pages, page_size, Hkv, D]: the "batch" stride is the page stride
        skb, skn, skh = k.stride(0), k.stride(1), k.stride(2)
        svb, svn, svh = v.stride(0), v.stride(1), v.stride(2)
    elif varlen:
        skb = svb = 0
        skn, skh = k.stride(0), k.stride(1)
        svn, svh = v.stride(0), v.stride(1)
    else:
        skb, skn, skh = k.stride(0), k.stride(1), k.stride(2)
        svb, svn, svh = v.stride(0), v.stride(1), v.stride(2)
    if varlen:
        sqb = sob = 0
        sqm, sqh = q.stride(0), q.stride(1)
        som, soh = out.stride(0), out.stride(1)
        slb, slh, slm = 0, lse.stride(0), lse.stride(1)
    else:
        sqb, sqm, sqh = q.stride(0), q.stride(1), q.stride(2)
        sob, som, soh = out.stride(0), out.stride(1), out.stride(2)
        slb, slh, slm = lse.stride(0), lse.stride(1), lse.stride(2)
    dummy = cu_q if varlen else lse
    bt = opts.block_table if paged else dummy
    stride_btb, stride_btn = (bt.stride(0), bt.stride(1)) if paged else (0, 0)
    alibi = opts.alibi
    if alibi is not None:
        stride_alb, stride_alh = (alibi.stride(0), alibi.stride(1)) if alibi.dim() == 2 else (0, alibi.stride(0))
    else:
        alibi, stride_alb, stride_alh = dummy, 0, 0
    seqused = opts.seqused_k.contiguous() if opts.seqused_k is not None else dummy
    flags = opts.flags()
    cap_in = scale / opts.softcap if opts.softcap > 0 else 0.0
    cap_out = opts.softcap * 1.4426950408889634
    _attn_fwd[grid](
        q, k, v, out, lse, cu_q if varlen else dummy, cu_k if varlen else dummy,
        sqb, sqm, sqh, skb, skn, skh, svb, svn, svh, sob, som, soh, slb, slh, slm,
        sq, sk, n_bh, hq, hq // hkv, num_m, scale * 1.4426950408889634,
        bt, seqused, alibi, stride_btb, stride_btn, stride_alb, stride_alh,
        max(opts.left, 0), max(opts.right, 0), cap_in, cap_out, (k.shape[0] - 1) if paged else 0,
        D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=varlen,
        IS_FP32=q.dtype == torch.float32, PAGE=k.shape[1] if paged else 16,
        FAST_TANH=bool(q.is_cuda and q.dtype != torch.float32 and not interpreter_on()),
        EDGES_ONE_LOOP=_edges_one_loop(opts), USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )


def _reference_options(opts: _Options, k) -> dict:
    """The options as the fp32 reference takes them, with the kernel's clamping applied (so that
    ``check=False`` gives the same answer on both paths)."""
    bt = opts.block_table
    if bt is not None:
        bt = bt.clamp(0, k.shape[0] - 1)
    return {"window_size": (opts.left, opts.right), "softcap": opts.softcap, "alibi_slopes": opts.alibi,
            "block_table": bt, "seqused_k": opts.seqused_k}


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------

def flash_attn_with_lse(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, block_table=None, seqused_k=None, check=True):
    """Scaled dot-product attention over a padded batch, returning the output and its LSE.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16 / bf16 / fp32; only the last dim must be contiguous. This is
            flash-attn's layout ``[batch, seqlen, heads, head_dim]``, not PyTorch SDPA's
            ``[B, H, S, D]``: a transposed q, k or v is named in the error when the shapes then
            disagree (:func:`~xoffload.kernels.checks.check_qkv`).
        k, v: ``[B, Sk, Hkv, D]``, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA: query
            head ``h`` reads KV head ``h // (Hq // Hkv)``); ``D <= 256``. With ``block_table``:
            paged caches ``[num_pages, page_size, Hkv, D]`` and ``Sk`` is
            ``max_pages_per_seq * page_size`` (or ``seqused_k[b]``).
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
        softmax_scale: multiplies ``q @ k^T`` before the softmax; default ``1/sqrt(D)``.
        window_size: ``(left, right)`` ints, flash-attn's local attention: query ``i`` at position
            ``pos = i + Sk - Sq`` (bottom-right aligned) sees key ``j`` iff
            ``pos - left <= j <= pos + right``; -1 = unbounded on that side (default ``(-1, -1)``:
            no window). ``causal=True`` forces ``right = 0``. Key tiles outside the window are
            skipped, so the cost grows with the window's width.
        softcap: float >= 0; with ``softcap > 0`` scores are ``softcap * tanh(s / softcap)``,
            ``s = softmax_scale * q.k``, before the bias and the softmax (Gemma 2). 0.0 = off.
        alibi_slopes: None or fp32 ``[Hq]`` / ``[B, Hq]`` on q's device: adds the bias
            ``-slope[b, h] * |pos - j|`` to the (capped) scores, natural-log units, as flash-attn's
            non-causal formula. Under causal flash-attn's CUDA kernel adds ``slope * j`` instead
            (the same softmax, an LSE larger by ``slope * pos``); ours stays the LSE of the formula
            above, so states merge exactly.
        block_table: None or int32 ``[B, max_pages_per_seq]`` on q's device: k and v are then paged
            caches ``[num_pages, page_size, Hkv, D]`` (flash-attn's paged layout, ``page_size`` a
            multiple of 16: 16, 256, 1024, ...); key ``j`` of sequence ``b`` is row
            ``j % page_size`` of page ``block_table[b, j // page_size]``. Read inside the kernel.
        seqused_k: None or int32 ``[B]`` on q's device: sequence ``b`` uses only its first
            ``seqused_k[b]`` keys (and is bottom-right aligned to that length).
        check: validate ``seqused_k`` and the block table's entries on the host (reads them; a
            device->host copy that synchronises). ``check=False`` skips that (CUDA-graph capture,
            hot loops): the kernel then clamps lengths to the keys there are and entries to
            ``[0, num_pages - 1]``, so it never reads outside k/v.

    Returns:
        ``(out, lse)``: out ``[B, Sq, Hq, D]`` in q's dtype (contiguous); lse ``[B, Hq, Sq]`` fp32,
        natural log of the softmax denominator of the final scores (after softcap and ALiBi), so
        results over disjoint key sets merge exactly (:func:`merge_attention_states`). Rows that
        see no key (``Sk == 0``, ``i + Sk - Sq < 0`` under causal, an empty window) give out 0 and
        lse -inf.

    Runs the Triton kernel for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``), the
    fp32 PyTorch reference otherwise (with the same options).

    Raises:
        TypeError: non-tensor inputs, unsupported or mismatched dtypes, non-bool ``causal`` or
            ``check``, window_size not a pair of ints, softcap not a number, alibi_slopes not
            fp32, block_table or seqused_k not int32.
        ValueError: wrong ranks, non-contiguous last dim, devices differ, k/v shapes disagree,
            batch sizes or head dims differ, ``Hq % Hkv != 0``, ``D > 256``, bad ``softmax_scale``;
            window left or right < -1; softcap < 0 or not finite; alibi_slopes not ``[Hq]`` /
            ``[B, Hq]`` or on another device; block_table not ``[B, P]`` or on another device; a
            page size not a multiple of 16; seqused_k not ``[B]``; with ``check``: a seqused_k
            outside ``[0, Sk]`` or a table entry of a page holding keys outside
            ``[0, num_pages)``.
    """
    causal = check_bool("causal", causal)
    check = check_bool("check", check)
    paged = block_table is not None
    if paged:
        check_tensor("q", q, 4)
        b, sq, hq, d = q.shape
        page_size = _check_paged_kv(q, k, v, block_table, b)
        sk = block_table.shape[1] * page_size
    else:
        check_qkv(q, k, v, 4, "[B, Sk, Hkv, D]", same_batch=True)
        b, sq, hq, d = q.shape
        sk = k.shape[1]
    scale = default_scale(d, softmax_scale)
    opts = _normalise_options(causal, window_size, softcap, alibi_slopes, block_table, seqused_k,
                              batch=b, hq=hq, device=q.device, max_q=sq, max_k=sk)
    if check and b > 0 and (seqused_k is not None or paged):
        avail = torch.full((b,), sk, dtype=torch.int64)
        lens = seqused_k.cpu().to(torch.int64) if seqused_k is not None else avail
        if seqused_k is not None:
            _check_key_lengths(lens, avail, f"keys per sequence: {sk}")
        if paged:
            _check_block_entries(block_table, lens, page_size, k.shape[0])
    if not use_triton(q):
        seq = opts.seqused_k.clamp(0, sk) if opts.seqused_k is not None else None
        ropts = {**_reference_options(opts, k), "seqused_k": seq}
        out, lse = attention_ref(q, k, v, causal=opts.causal, softmax_scale=scale, **ropts)
        return out.to(q.dtype), lse
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    _launch(q, k, v, out, lse, varlen=False, cu_q=None, cu_k=None, batch=b, sq=sq, sk=sk,
            max_sq=sq, causal=opts.causal, scale=scale, opts=opts)
    return out, lse


def flash_attn_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, block_table=None, seqused_k=None, check=True):
    """Attention over packed variable-length sequences (flash-attn's varlen layout), with LSE.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]`` (fp16 / bf16 / fp32, last dim
            contiguous, same dtype and device; ``Hq % Hkv == 0``; ``D <= 256``). With
            ``block_table``: paged caches ``[num_pages, page_size, Hkv, D]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on the inputs' device, starting at 0,
            non-decreasing, ending at ``total_q`` / ``total_k``; sequence ``b`` owns query rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.
            With ``block_table`` cu_seqlens_k gives only the key lengths (each at most
            ``max_pages_per_seq * page_size``; its end is not tied to k's shape).
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence (the grid is
            sized from ``max_seqlen_q``).
        causal: bottom-right aligned within each sequence (``j <= i + Sk_b - Sq_b``).
        softmax_scale: default ``1/sqrt(D)``.
        window_size, softcap, alibi_slopes, block_table, seqused_k, check: as for
            :func:`flash_attn_with_lse`, per sequence: positions are bottom-right aligned within
            each sequence (``pos = i + Sk_b - Sq_b``), ``block_table[b]`` lists sequence b's pages,
            ``seqused_k[b]`` is at most the length cu_seqlens_k gives. ``check=False`` on a call
            without ``block_table`` and ``seqused_k`` reads nothing on the host (no
            synchronisation: a batched prefill's hot loop): cu_seqlens' values and max_seqlen_*
            are then the caller's guarantee (only their dtype, shape and device are checked).

    Returns:
        ``(out, lse)``: out ``[total_q, Hq, D]`` in q's dtype; lse ``[Hq, total_q]`` fp32 natural
        log; rows that see no key give out 0 and lse -inf.

    Validation reads ``cu_seqlens_*`` on the host (not with ``check=False``, unpaged, no ``seqused_k``).

    Raises:
        TypeError: as :func:`flash_attn_with_lse`; cu_seqlens not int32; max_seqlen not an int.
        ValueError: as :func:`flash_attn_with_lse`; cu_seqlens of different lengths, not starting
            at 0, decreasing, not ending at the packed length (not paged), on another device; a
            max_seqlen smaller than the longest sequence; (paged) a key length past the table's
            pages.
    """
    causal = check_bool("causal", causal)
    check = check_bool("check", check)
    paged = block_table is not None
    if paged:
        check_tensor("q", q, 3)
    else:
        check_qkv(q, k, v, 3, "[total_k, Hkv, D]")
    # without check (and unpaged, no seqused_k) nothing is read on the host: no synchronisation
    host = check or paged or seqused_k is not None
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, values=host)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], q.device, values=host)
    if paged:
        page_size = _check_paged_kv(q, k, v, block_table, cu_seqlens_q.numel() - 1)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must have the same length (batch + 1)"
        )
    if host:
        max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
        max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")
    else:
        max_seqlen_q, max_seqlen_k = check_int("max_seqlen_q", max_seqlen_q, 0), check_int("max_seqlen_k", max_seqlen_k, 0)
    total_q, hq, d = q.shape
    batch = cu_seqlens_q.numel() - 1
    scale = default_scale(d, softmax_scale)
    opts = _normalise_options(causal, window_size, softcap, alibi_slopes, block_table, seqused_k,
                              batch=batch, hq=hq, device=q.device, max_q=max_seqlen_q, max_k=max_seqlen_k)
    if paged or seqused_k is not None:
        # (host reads: cu_seqlens_k is read on the host by its check above already)
        avail = cu_seqlens_k.cpu().to(torch.int64).diff()
        if paged:
            cap = block_table.shape[1] * page_size
            if batch > 0 and int(avail.max()) > cap:
                i = int(avail.argmax())
                raise ValueError(f"sequence {i} has {int(avail[i])} keys (cu_seqlens_k) but block_table holds "
                                 f"{block_table.shape[1]} pages of {page_size} = {cap} tokens")
        if check and batch > 0:
            lens = avail
            if seqused_k is not None:
                lens = seqused_k.cpu().to(torch.int64)
                _check_key_lengths(lens, avail, "the key lengths cu_seqlens_k gives")
            if paged:
                _check_block_entries(block_table, lens, page_size, k.shape[0])
    if not use_triton(q):
        seq = None
        if opts.seqused_k is not None:
            seq = torch.minimum(opts.seqused_k.clamp(min=0), cu_seqlens_k.diff().to(opts.seqused_k.device))
        ropts = {**_reference_options(opts, k), "seqused_k": seq}
        out, lse = varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=opts.causal,
                                        softmax_scale=scale, **ropts)
        return out.to(q.dtype), lse
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    # the kernel indexes cu_seqlens as CU + b: strided views are made contiguous
    _launch(q, k, v, out, lse, varlen=True, cu_q=cu_seqlens_q.contiguous(), cu_k=cu_seqlens_k.contiguous(),
            batch=batch, sq=0, sk=0, max_sq=max_seqlen_q, causal=opts.causal, scale=scale, opts=opts)
    return out, lse
