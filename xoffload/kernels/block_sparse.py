"""Block-sparse attention with LSE: the FlashAttention-2 loop over the kept key blocks only.

A boolean block mask ``[B or 1, H, ceil(Sq/bs), ceil(Sk/bs)]`` (``H`` = query heads, or KV heads:
one mask shared by the query heads of a KV head) says which ``bs x bs`` blocks of the attention
matrix are computed; everything else is treated as masked out. Query blocks are counted from the
first query row, key blocks from the first key. Conventions are those of
:func:`xoffload.kernels.flash_attn_with_lse` (DESIGN.md): flash-attn layout, GQA, bottom-right
causal inside the kept blocks, natural-log fp32 LSE ``[B, Hq, Sq]``, rows that see no key give
output 0 and LSE -inf. With a full mask the result is dense attention; the cost is proportional to
the number of kept blocks.

The mask is turned into per-row index lists on the device (:mod:`xoffload.kernels.block_index`);
the attention kernel walks a row's list in ``BLOCK_N``-key tiles (``BLOCK_N`` may be smaller than
the mask's block size), the fully visible blocks without masks, then the partial ones with masks,
with the online softmax in base 2. Programs run KV-head major: (batch, KV head) slowest, then the
query tiles last-first, the group's query heads fastest, so programs running together share one
KV head's blocks in L2. K/V come through tensor descriptors (TMA) in the default D <= 128 config.
Launch configs: :class:`~xoffload.kernels.launch.LaunchConfig`, overridable with
:func:`~xoffload.kernels.launch.launch_override` (``"block_sparse"``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .block_index import BlockIndex, block_mask_to_indices, indices_to_mask
from .checks import check_bool, check_pow2, check_qkv, default_scale, next_pow2, use_triton
from .flash_attn import _online_softmax_step
from .launch import LaunchConfig, override_for, tma_alloc, tma_ok

__all__ = ["BlockIndex", "block_mask_to_indices", "block_sparse_attn_with_lse"]


@triton.jit
def _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row, offs_m, offs_n,
              d_ok, it_lo, it_hi, seqlen_k, diag_shift, qk_scale, stride_kn, stride_vn,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_K: tl.constexpr,
              IS_FP32: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              USE_TMA: tl.constexpr):
    # The block index of the next iteration is loaded ahead (a loop-carried scalar). Loading it in
    # the iteration that uses it made Triton's pipeliner stage the index load as an async copy
    # and wait for all copies at the top of every iteration (K/V latency exposed: 1.45x the dense
    # kernel at 100% density on an H200); with the carried index the K/V copies run num_stages
    # deep as in the dense kernel. Index loads mostly hit L1.
    LOAD_MASK: tl.constexpr = MASKED and not EVEN_K
    blk_n1 = tl.load(idx_row + it_lo // SUB, mask=it_lo < it_hi, other=0)
    for it in tl.range(it_lo, it_hi):
        blk = blk_n1
        blk_n1 = tl.load(idx_row + (it + 1) // SUB, mask=it + 1 < it_hi, other=0)
        start_n = blk * BLOCK_SIZE + (it % SUB) * BLOCK_N
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn + k_offs
        v_ptrs = v_base + start_n.to(tl.int64) * stride_vn + v_offs
        if LOAD_MASK:
            n_ok = (start_n + offs_n) < seqlen_k
        if USE_TMA:  # rows past seqlen_k and columns past D arrive as zeros
            k = k_desc.load([start_n, 0])
        elif LOAD_MASK:
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        p, m_new, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, start_n, offs_n, offs_m, seqlen_k,
                                                  diag_shift, qk_scale, MASKED, CAUSAL)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        elif LOAD_MASK:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "n_heads", "group", "mask_group", "num_m_blocks", "stride_lb",
                               "stride_lh", "stride_lm", "stride_ib", "stride_ih", "stride_ii", "stride_cb",
                               "stride_ch"])
def _bs_attn_fwd(Q, K, V, O, LSE, IDX, NFULL, NTOT,
                 stride_qb, stride_qm, stride_qh,
                 stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh,
                 stride_ob, stride_om, stride_oh,
                 stride_lb, stride_lh, stride_lm,
                 stride_ib, stride_ih, stride_ii,
                 stride_cb, stride_ch,
                 Sq, Sk, n_heads, group, mask_group, num_m_blocks, qk_scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 IS_FP32: tl.constexpr, MASK_BATCH: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_TMA: tl.constexpr):
    pid = tl.program_id(0)
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    # KV-head major: (batch, KV head) slowest, query tiles last-first, the group's heads fastest
    per_kv = num_m_blocks * group
    bkv = pid // per_kv
    r = pid % per_kv
    mb = num_m_blocks - 1 - r // group
    n_kv = n_heads // group
    b = bkv // n_kv
    h = (bkv % n_kv) * group + r % group
    m0 = mb * BLOCK_M
    if m0 < Sq:
        h_kv = h // group
        h_m = h // mask_group
        qb = m0 // BLOCK_SIZE
        EVEN_D: tl.constexpr = D == BLOCK_D
        if MASK_BATCH:
            b_m = b
        else:
            b_m = b * 0
        c_off = b_m.to(tl.int64) * stride_cb + h_m.to(tl.int64) * stride_ch + qb
        n_full = tl.load(NFULL + c_off)
        n_tot = tl.load(NTOT + c_off)
        idx_row = IDX + b_m.to(tl.int64) * stride_ib + h_m.to(tl.int64) * stride_ih + qb.to(tl.int64) * stride_ii

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < Sq
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
        q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if USE_TMA:
            # per-(batch, KV head) 2-D views [Sk, D]; the host checked 16-byte alignment
            k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Sk, 1), D], strides=[stride_kn, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(Sk, 1), D], strides=[stride_vn, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
        else:
            k_desc = k_base
            v_desc = v_base
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        diag_shift = Sk - Sq
        k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]
        acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row,
                                  offs_m, offs_n, d_ok, 0, n_full * SUB, Sk, diag_shift, qk_scale,
                                  stride_kn, stride_vn, False, CAUSAL, EVEN_D, EVEN_K, IS_FP32, BLOCK_N, SUB,
                                  BLOCK_SIZE, USE_TMA)
        acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row,
                                  offs_m, offs_n, d_ok, n_full * SUB, n_tot * SUB, Sk, diag_shift, qk_scale,
                                  stride_kn, stride_vn, True, CAUSAL, EVEN_D, EVEN_K, IS_FP32, BLOCK_N, SUB,
                                  BLOCK_SIZE, USE_TMA)
        empty = l_i == 0.0
        l_div = tl.where(empty, 1.0, l_i)
        out = acc / l_div[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
        o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
        tl.store(l_base + offs_m * stride_lm, lse, mask=m_ok)


_INTERP_CFG = LaunchConfig(32, 32, 4, 1)  # BLOCK_M and BLOCK_N are capped at the block size


def _gpu_config(block_d: int, dtype: torch.dtype) -> LaunchConfig:
    """Launch configuration on CUDA (the sweep: ``python benchmarks/bench_block_sparse.py --sweep``)."""
    if dtype == torch.float32:
        return LaunchConfig(64, 32, 4, 2)
    if block_d <= 64:
        return LaunchConfig(128, 64, 4, 3)
    if block_d <= 128:
        # H200 sweep (benchmarks/results/xattn_bs_sweep.json, 128K, 32/8 heads, D=128): 30.8 ms at
        # 10% (0.90x FlexAttention, 0.104x dense) and 0.94x dense at 100%; the old 128x64 default
        # took 37.8 ms / 1.07x dense
        return LaunchConfig(128, 128, 8, 3, tma=True)
    return LaunchConfig(64, 32, 4, 2)


def _check_mask(block_mask, q, k, block_size, causal):
    """Raise unless ``block_mask`` (bool tensor or BlockIndex) fits q, k and the block geometry."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    nqb, nkb = triton.cdiv(sq, block_size), triton.cdiv(sk, block_size)
    if isinstance(block_mask, BlockIndex):
        got = (block_mask.sq, block_mask.sk, block_mask.block_size, block_mask.causal)
        if got != (sq, sk, block_size, causal):
            raise ValueError(
                f"BlockIndex was built for sq={got[0]}, sk={got[1]}, block_size={got[2]}, causal={got[3]}; "
                f"called with sq={sq}, sk={sk}, block_size={block_size}, causal={causal}")
        t, what = block_mask.indices, "block index lists"
    elif not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool torch.Tensor or a BlockIndex, got "
                        f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
    else:
        t, what = block_mask, "block_mask"
    if t.dim() != 4:
        raise ValueError(f"{what} must be [B, H, q_blocks, k_blocks], got shape {tuple(t.shape)}")
    if t.shape[0] not in (1, b) or t.shape[1] not in (hq, hkv) or tuple(t.shape[2:]) != (nqb, nkb):
        raise ValueError(
            f"{what} has shape {tuple(t.shape)}; expected [{b} or 1, {hq} (q heads) or {hkv} (kv heads), "
            f"{nqb}, {nkb}] for Sq, Sk and the block size")
    if t.device != q.device:
        raise ValueError(f"block_mask is on {t.device} but q is on {q.device}")


def block_sparse_attn_with_lse(q, k, v, block_mask, *, block_size=128, causal=True, softmax_scale=None):
    """Attention restricted to the kept ``block_size x block_size`` blocks, with LSE.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32 (last dim contiguous).
        k, v: ``[B, Sk, Hkv, D]``, same dtype/device; ``Hq % Hkv == 0``; ``D <= 256``.
        block_mask: bool ``[B or 1, Hq or Hkv, ceil(Sq/bs), ceil(Sk/bs)]`` (Hkv: one mask per KV
            head, shared by its query heads), or a :class:`BlockIndex` built for the same
            geometry by :func:`block_mask_to_indices`.
        block_size: bs of the mask, a power of two >= 16 (the kernel may use smaller key tiles).
        causal: bottom-right aligned inside the kept blocks (query i sees key j iff
            ``j <= i + Sk - Sq``).
        softmax_scale: default ``1/sqrt(D)``.

    Returns:
        ``(out, lse)``: out ``[B, Sq, Hq, D]`` in q's dtype; lse fp32 ``[B, Hq, Sq]`` natural log.
        Rows that see no key in the kept blocks give out 0 and lse -inf. A full mask gives dense
        attention (:func:`flash_attn_with_lse`).

    Runs the Triton kernel for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``), else
    :func:`reference.block_sparse_attention_ref`.

    Raises:
        TypeError: non-tensors, bad dtypes, non-bool mask or causal.
        ValueError: wrong ranks/shapes, GQA ratio, mask shape not matching, bad block_size, a
            BlockIndex built for another geometry.
    """
    check_bool("causal", causal)
    check_pow2("block_size", block_size, 16)
    check_qkv(q, k, v, 4, same_batch=True)
    _check_mask(block_mask, q, k, block_size, causal)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = default_scale(d, softmax_scale)
    if not use_triton(q):
        bm = indices_to_mask(block_mask) if isinstance(block_mask, BlockIndex) else block_mask
        if bm.shape[0] != b:
            bm = bm.expand(b, *bm.shape[1:])
        out, lse = reference.block_sparse_attention_ref(q, k, v, bm, block_size=block_size, causal=causal,
                                                        softmax_scale=scale)
        return out.to(q.dtype), lse
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lse.numel() == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
        return out.zero_(), lse
    bi = block_mask if isinstance(block_mask, BlockIndex) else block_mask_to_indices(
        block_mask, sq, sk, block_size=block_size, causal=causal)
    cfg = override_for("block_sparse") or (
        _gpu_config(max(16, next_pow2(d)), q.dtype) if q.is_cuda else _INTERP_CFG)
    _launch(q, k, v, out, lse, bi, cfg, scale)
    return out, lse


def _launch(q, k, v, out, lse, bi: BlockIndex, cfg: LaunchConfig, scale: float):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_size, causal = bi.block_size, bi.causal
    block_m, block_n = min(cfg.block_m, block_size), min(cfg.block_n, block_size)
    idx, nf, nt = bi.indices, bi.n_full, bi.n_total
    bm, hm = idx.shape[0], idx.shape[1]
    num_m = triton.cdiv(sq, block_m)
    tma = bool(cfg.tma) and tma_ok(k, v)
    if tma and q.is_cuda:
        triton.set_allocator(tma_alloc)  # scratch for the descriptors built inside the kernel
    _bs_attn_fwd[(num_m * b * hq,)](
        q, k, v, out, lse, idx, nf, nt,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2),
        nf.stride(0), nf.stride(1),
        sq, sk, hq, hq // hkv, hq // hm, num_m, scale * 1.4426950408889634,
        D=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        CAUSAL=causal, IS_FP32=q.dtype == torch.float32, MASK_BATCH=bm != 1, EVEN_K=sk % block_size == 0,
        USE_TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
