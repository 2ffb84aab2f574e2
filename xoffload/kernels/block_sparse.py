"""Block-sparse attention with LSE: the FlashAttention-2 loop over the kept key blocks only.

A boolean block mask ``[B or 1, H, ceil(Sq/bs), ceil(Sk/bs)]`` (``H`` = query heads, or KV heads:
one mask shared by the query heads of a KV head) says which ``bs x bs`` blocks of the attention
matrix are computed; everything else is treated as masked out. Query blocks are counted from the
first query row, key blocks from the first key. Conventions are those of
:func:`xoffload.kernels.flash_attn_with_lse` (DESIGN.md): flash-attn layout, GQA, bottom-right
causal inside the kept blocks, natural-log fp32 LSE ``[B, Hq, Sq]``, rows that see no key give
output 0 and LSE -inf. With a full mask the result is dense attention; the cost is proportional to
the number of kept blocks.

The mask is turned into per-row index lists on the device (:func:`block_mask_to_indices`: cumsum
+ scatter, no host sync): for every (batch, mask head, query block) the kept key blocks that every
row of the query block sees in full come first (the kernel visits them without masking), then the
partial ones (diagonal / ragged last block, visited with masks), each group ascending, with the two
counts. The Triton kernel walks the list in ``BLOCK_N``-key tiles (``BLOCK_N`` may be smaller
than the mask's block size), with the online softmax in base 2.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import reference
from ._common import check_heads, check_same, check_tensor, default_scale, next_pow2, use_triton
from .flash_attn import _online_softmax_step

__all__ = ["BlockIndex", "block_mask_to_indices", "block_sparse_attn_with_lse"]


class BlockIndex(NamedTuple):
    """Kept key blocks per query block, as index lists (from :func:`block_mask_to_indices`).

    indices: int32 ``[Bm, Hm, nqb, nkb]``: row ``[b, h, I]`` lists the fully visible kept blocks
        (ascending), then the partially visible ones (ascending); entries past ``n_total`` unused.
    n_full: int32 ``[Bm, Hm, nqb]``: how many leading entries need no mask.
    n_total: int32 ``[Bm, Hm, nqb]``: how many entries are kept.
    sq, sk, block_size, causal: the geometry the lists were built for.

    The lists are trusted (checking them would cost a host sync per call): build them with
    :func:`block_mask_to_indices`; hand-edited entries outside ``[0, nkb)`` give undefined results.
    """

    indices: torch.Tensor
    n_full: torch.Tensor
    n_total: torch.Tensor
    sq: int
    sk: int
    block_size: int
    causal: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_block_size(block_size):
    if not _is_int(block_size):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")


def block_mask_to_indices(block_mask, sq, sk, *, block_size=128, causal=True) -> BlockIndex:
    """Convert a bool block mask into per-row index lists (:class:`BlockIndex`), on its device.

    Args:
        block_mask: bool ``[Bm, Hm, ceil(sq/bs), ceil(sk/bs)]``.
        sq, sk: query / key lengths in tokens.
        block_size: bs, a power of two >= 16.
        causal: bottom-right causal (query row i sees key j iff ``j <= i + sk - sq``); blocks that
            no row of a query block can see are dropped, blocks crossing the diagonal go last.

    Raises:
        TypeError / ValueError: non-bool mask, wrong rank or shape for (sq, sk, block_size).
    """
    _check_block_size(block_size)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool torch.Tensor, got "
                        f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must be [B, H, q_blocks, k_blocks], got shape {tuple(block_mask.shape)}")
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    if tuple(block_mask.shape[2:]) != (nqb, nkb):
        raise ValueError(
            f"block_mask {tuple(block_mask.shape)} does not fit sq={sq}, sk={sk}, block_size={block_size}: "
            f"expected [B, H, {nqb}, {nkb}]"
        )
    dev = block_mask.device
    I = torch.arange(nqb, device=dev)[:, None]
    J = torch.arange(nkb, device=dev)[None, :]
    shift = sk - sq
    inside = (J + 1) * block_size <= sk  # no ragged key tail
    if causal:
        last_row = torch.clamp((I + 1) * block_size, max=sq) - 1
        vis = J * block_size <= last_row + shift
        full = inside & ((J + 1) * block_size - 1 <= I * block_size + shift)
    else:
        vis = torch.ones(nqb, nkb, dtype=torch.bool, device=dev)
        full = inside.expand(nqb, nkb)
    m = block_mask & vis
    mf = m & full
    mp = m & ~full
    n_full = mf.sum(-1, dtype=torch.int32)
    n_total = n_full + mp.sum(-1, dtype=torch.int32)
    pos_f = torch.cumsum(mf, -1, dtype=torch.int32) - 1
    pos_p = n_full[..., None] + torch.cumsum(mp, -1, dtype=torch.int32) - 1
    pos = torch.where(mf, pos_f, torch.where(mp, pos_p, torch.full_like(pos_f, nkb)))
    idx = torch.zeros(m.shape[:-1] + (nkb + 1,), dtype=torch.int32, device=dev)
    src = torch.arange(nkb, dtype=torch.int32, device=dev).expand(m.shape).contiguous()
    idx.scatter_(-1, pos.long(), src)
    return BlockIndex(idx[..., :nkb].contiguous(), n_full.contiguous(), n_total.contiguous(),
                      int(sq), int(sk), int(block_size), bool(causal))


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, idx_row, offs_m, offs_n, d_ok,
              it_lo, it_hi, seqlen_k, diag_shift, qk_scale, stride_kn, stride_vn,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
              IS_FP32: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
              BLOCK_SIZE: tl.constexpr):
    # The block index of the next iteration is loaded one iteration ahead (a loop-carried
    # scalar). Loading it in the iteration that uses it made Triton's pipeliner stage the index
    # load as an async copy and wait for all copies at the top of every iteration (K/V latency
    # exposed: 1.45x the dense kernel at 100% density on an H200); with the carried index the
    # K/V copies run num_stages deep as in the dense kernel. Index loads mostly hit L1.
    blk_next = tl.load(idx_row + it_lo // SUB, mask=it_lo < it_hi, other=0)
    for it in range(it_lo, it_hi):
        blk = blk_next
        blk_next = tl.load(idx_row + (it + 1) // SUB, mask=it + 1 < it_hi, other=0)
        start_n = blk * BLOCK_SIZE + (it % SUB) * BLOCK_N
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn + k_offs
        v_ptrs = v_base + start_n.to(tl.int64) * stride_vn + v_offs
        if MASKED:
            n_ok = (start_n + offs_n) < seqlen_k
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
        if MASKED:
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


@triton.jit(do_not_specialize=["Sq", "Sk", "n_bh", "n_heads", "group", "mask_group", "n_qb", "num_m_blocks",
                               "stride_lb", "stride_lh", "stride_lm", "stride_ib", "stride_ih", "stride_ii",
                               "stride_cb", "stride_ch"])
def _bs_attn_fwd(Q, K, V, O, LSE, IDX, NFULL, NTOT,
                 stride_qb, stride_qm, stride_qh,
                 stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh,
                 stride_ob, stride_om, stride_oh,
                 stride_lb, stride_lh, stride_lm,
                 stride_ib, stride_ih, stride_ii,
                 stride_cb, stride_ch,
                 Sq, Sk, n_bh, n_heads, group, mask_group, n_qb, num_m_blocks, qk_scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 IS_FP32: tl.constexpr, MASK_BATCH: tl.constexpr):
    # 1-D grid, (batch, head) fastest; the last query tiles (most keys under causal) first.
    pid = tl.program_id(0)
    bh = pid % n_bh
    mb = num_m_blocks - 1 - pid // n_bh
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    h_m = h // mask_group
    m0 = mb * BLOCK_M
    qb = m0 // BLOCK_SIZE
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag_shift = Sk - Sq
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]
    acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, idx_row, offs_m, offs_n, d_ok,
                              0, n_full * SUB, Sk, diag_shift, qk_scale, stride_kn, stride_vn,
                              False, CAUSAL, EVEN_D, IS_FP32, BLOCK_N, SUB, BLOCK_SIZE)
    acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, idx_row, offs_m, offs_n, d_ok,
                              n_full * SUB, n_tot * SUB, Sk, diag_shift, qk_scale, stride_kn, stride_vn,
                              True, CAUSAL, EVEN_D, IS_FP32, BLOCK_N, SUB, BLOCK_SIZE)
    empty = l_i == 0.0
    l_div = tl.where(empty, 1.0, l_i)
    out = acc / l_div[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    tl.store(l_base + offs_m * stride_lm, lse, mask=m_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M and BLOCK_N are capped at the block size.
_INTERP_CFG = (32, 32, 4, 1)
_CFG_OVERRIDE: list = []  # benchmark hook


def _gpu_config(block_d: int, dtype: torch.dtype):
    """Launch configuration on CUDA (the dense kernel's tiles for the same head_dim)."""
    if dtype == torch.float32:
        return (64, 32, 4, 2)
    if block_d <= 64:
        return (128, 64, 4, 3)
    if block_d <= 128:
        return (128, 64, 8, 3)
    return (64, 32, 4, 2)


def _check_mask_shape(block_mask, b, hq, hkv, nqb, nkb):
    if isinstance(block_mask, BlockIndex):
        t = block_mask.indices
        what = "block index lists"
    else:
        t = block_mask
        what = "block_mask"
    if t.dim() != 4:
        raise ValueError(f"{what} must be [B, H, q_blocks, k_blocks], got shape {tuple(t.shape)}")
    bm, hm = t.shape[0], t.shape[1]
    if bm not in (1, b) or hm not in (hq, hkv) or tuple(t.shape[2:]) != (nqb, nkb):
        raise ValueError(
            f"{what} has shape {tuple(t.shape)}; expected [{b} or 1, {hq} (q heads) or {hkv} (kv heads), "
            f"{nqb}, {nkb}] for Sq, Sk and the block size"
        )


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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_block_size(block_size)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4)
    check_same([("q", q), ("k", k), ("v", v)])
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    check_heads(hq, hkv, d)
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    if isinstance(block_mask, BlockIndex):
        if (block_mask.sq, block_mask.sk, block_mask.block_size, block_mask.causal) != (sq, sk, block_size, causal):
            raise ValueError(
                f"BlockIndex was built for sq={block_mask.sq}, sk={block_mask.sk}, block_size="
                f"{block_mask.block_size}, causal={block_mask.causal}; called with sq={sq}, sk={sk}, "
                f"block_size={block_size}, causal={causal}"
            )
    elif not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool torch.Tensor or a BlockIndex, got "
                        f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
    _check_mask_shape(block_mask, b, hq, hkv, nqb, nkb)
    mask_t = block_mask.indices if isinstance(block_mask, BlockIndex) else block_mask
    if mask_t.device != q.device:
        raise ValueError(f"block_mask is on {mask_t.device} but q is on {q.device}")
    scale = default_scale(d, softmax_scale)

    if not use_triton(q):
        bm = block_mask
        if isinstance(bm, BlockIndex):
            bm = _indices_to_mask(bm)
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
    block_d = max(16, next_pow2(d))
    if q.is_cuda:
        cfg = _CFG_OVERRIDE[-1] if _CFG_OVERRIDE else _gpu_config(block_d, q.dtype)
    else:
        cfg = _INTERP_CFG
    block_m, block_n, warps, stages = cfg
    block_m, block_n = min(block_m, block_size), min(block_n, block_size)
    num_m = triton.cdiv(sq, block_m)
    n_bh = b * hq
    hm = bi.indices.shape[1]
    idx, nf, nt = bi.indices, bi.n_full, bi.n_total
    _bs_attn_fwd[(num_m * n_bh,)](
        q, k, v, out, lse, idx, nf, nt,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2),
        nf.stride(0), nf.stride(1),
        sq, sk, n_bh, hq, hq // hkv, hq // hm, nqb, num_m, scale * 1.4426950408889634,
        D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, CAUSAL=causal,
        IS_FP32=q.dtype == torch.float32, MASK_BATCH=idx.shape[0] != 1,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def _indices_to_mask(bi: BlockIndex) -> torch.Tensor:
    """Bool mask of the blocks listed in a :class:`BlockIndex` (for the CPU reference path)."""
    nkb = bi.indices.shape[-1]
    pos = torch.arange(nkb, device=bi.indices.device)
    listed = pos < bi.n_total[..., None]
    idx = torch.where(listed, bi.indices.long(), torch.full_like(bi.indices, nkb, dtype=torch.long))
    mask = torch.zeros(bi.indices.shape[:-1] + (nkb + 1,), dtype=torch.bool, device=bi.indices.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :nkb]
