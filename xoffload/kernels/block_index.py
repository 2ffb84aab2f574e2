"""Block mask -> per-row index lists for :func:`xoffload.kernels.block_sparse_attn_with_lse`.

For every (batch, mask head, query block) of a bool block mask ``[Bm, Hm, ceil(sq/bs),
ceil(sk/bs)]``, the kept key blocks that every row of the query block sees in full come first
(the attention kernel visits them without masking), then the partial ones (diagonal / ragged last
block, visited with masks), with the two counts. Under both causal and non-causal masking the
fully visible blocks are a prefix of the key blocks and the partial ones the range right after it,
so the list is simply the kept visible blocks in ascending order.

On CUDA (or under Triton's interpreter) one small Triton program per mask row builds the lists on
the device (no host sync); otherwise a PyTorch cumsum + scatter does, with identical results.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import check_pow2, next_pow2, use_triton

__all__ = ["BlockIndex", "block_mask_to_indices"]


class BlockIndex(NamedTuple):
    """Kept key blocks per query block, as index lists (from :func:`block_mask_to_indices`).

    indices: int32 ``[Bm, Hm, nqb, nkb]``: row ``[b, h, I]`` lists the fully visible kept blocks
        (ascending), then the partially visible ones (ascending); entries past ``n_total`` are 0.
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


@triton.jit(do_not_specialize=["n_mheads", "nqb", "nkb", "sq", "sk"])
def _mask_to_idx_kernel(M, IDX, NF, NT, stride_mb, stride_mh, stride_mi, stride_mj,
                        n_mheads, nqb, nkb, sq, sk,
                        BS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per mask row (b, h, I): stream-compact the kept visible blocks (ascending),
    # count those inside the fully visible prefix, zero the rest of the row
    row = tl.program_id(0)
    i = row % nqb
    bh = row // nqb
    h = bh % n_mheads
    b = bh // n_mheads
    m_row = M + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + i.to(tl.int64) * stride_mi
    o_row = IDX + row.to(tl.int64) * nkb
    n_inside = sk // BS  # blocks with no ragged key tail
    if CAUSAL:
        shift = sk - sq
        x = i * BS + shift + 1  # block j is fully visible iff (j + 1) * BS <= x
        n_fullvis = tl.where(x > 0, x // BS, 0)
        y = tl.minimum((i + 1) * BS, sq) - 1 + shift  # block j is visible iff j * BS <= y
        n_vis = tl.where(y >= 0, y // BS + 1, 0)
        n_fullvis = tl.minimum(n_fullvis, n_inside)
    else:
        n_fullvis = n_inside
        n_vis = nkb
    cnt = 0
    cnt_full = 0
    offs = tl.arange(0, BLOCK_K)
    for j0 in range(0, nkb, BLOCK_K):
        j = j0 + offs
        m = tl.load(m_row + j.to(tl.int64) * stride_mj, mask=j < nkb, other=0)
        keep = (m != 0) & (j < n_vis)
        keep_i = keep.to(tl.int32)
        pos = cnt + tl.cumsum(keep_i, 0) - 1
        tl.store(o_row + pos, j, mask=keep)
        cnt += tl.sum(keep_i, 0)
        cnt_full += tl.sum((keep & (j < n_fullvis)).to(tl.int32), 0)
    for j0 in range(0, nkb, BLOCK_K):
        j = j0 + offs
        tl.store(o_row + j, tl.zeros([BLOCK_K], dtype=tl.int32), mask=(j >= cnt) & (j < nkb))
    tl.store(NF + row, cnt_full)
    tl.store(NT + row, cnt)


def check_mask_geometry(block_mask, sq, sk, block_size):
    """``(nqb, nkb)`` of a bool ``[B, H, nqb, nkb]`` mask fitting (sq, sk, block_size); raises
    TypeError / ValueError otherwise."""
    check_pow2("block_size", block_size, 16)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool torch.Tensor, got "
                        f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must be [B, H, q_blocks, k_blocks], got shape {tuple(block_mask.shape)}")
    nqb, nkb = triton.cdiv(sq, block_size), triton.cdiv(sk, block_size)
    if tuple(block_mask.shape[2:]) != (nqb, nkb):
        raise ValueError(
            f"block_mask {tuple(block_mask.shape)} does not fit sq={sq}, sk={sk}, block_size={block_size}: "
            f"expected [B, H, {nqb}, {nkb}]"
        )
    return nqb, nkb


def mask_to_indices_torch(block_mask, sq, sk, block_size, causal):
    """The index lists by cumsum + scatter in PyTorch (CPU path; the Triton kernel's reference)."""
    nqb, nkb = block_mask.shape[2], block_mask.shape[3]
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
    return idx[..., :nkb].contiguous(), n_full.contiguous(), n_total.contiguous()


def mask_to_indices_triton(block_mask, sq, sk, block_size, causal):
    """The index lists by :func:`_mask_to_idx_kernel` (one program per mask row)."""
    bm, hm, nqb, nkb = block_mask.shape
    dev = block_mask.device
    idx = torch.empty((bm, hm, nqb, nkb), dtype=torch.int32, device=dev)
    nf = torch.zeros((bm, hm, nqb), dtype=torch.int32, device=dev)
    nt = torch.zeros((bm, hm, nqb), dtype=torch.int32, device=dev)
    rows = bm * hm * nqb
    if rows == 0 or nkb == 0:
        return idx, nf, nt
    m8 = block_mask.view(torch.uint8)
    block_k = min(next_pow2(nkb), 2048)
    _mask_to_idx_kernel[(rows,)](
        m8, idx, nf, nt, m8.stride(0), m8.stride(1), m8.stride(2), m8.stride(3),
        hm, nqb, nkb, sq, sk, BS=block_size, CAUSAL=causal, BLOCK_K=block_k,
        num_warps=4 if block_k >= 512 else 1,
    )
    return idx, nf, nt


def block_mask_to_indices(block_mask, sq, sk, *, block_size=128, causal=True) -> BlockIndex:
    """Convert a bool block mask into per-row index lists (:class:`BlockIndex`), on its device.

    Args:
        block_mask: bool ``[Bm, Hm, ceil(sq/bs), ceil(sk/bs)]`` (any strides).
        sq, sk: query / key lengths in tokens.
        block_size: bs, a power of two >= 16.
        causal: bottom-right causal (query row i sees key j iff ``j <= i + sk - sq``); blocks that
            no row of a query block can see are dropped, blocks crossing the diagonal go last.

    On CUDA (or under Triton's interpreter) one Triton program per mask row; otherwise PyTorch.
    Both give identical tensors.

    Raises:
        TypeError / ValueError: non-bool mask, wrong rank or shape for (sq, sk, block_size).
    """
    check_mask_geometry(block_mask, sq, sk, block_size)
    build = mask_to_indices_triton if use_triton(block_mask) else mask_to_indices_torch
    idx, nf, nt = build(block_mask, sq, sk, block_size, causal)
    return BlockIndex(idx, nf, nt, int(sq), int(sk), int(block_size), bool(causal))


def indices_to_mask(bi: BlockIndex) -> torch.Tensor:
    """Bool mask of the blocks listed in a :class:`BlockIndex` (for the CPU reference path)."""
    nkb = bi.indices.shape[-1]
    pos = torch.arange(nkb, device=bi.indices.device)
    listed = pos < bi.n_total[..., None]
    idx = torch.where(listed, bi.indices.long(), torch.full_like(bi.indices, nkb, dtype=torch.long))
    mask = torch.zeros(bi.indices.shape[:-1] + (nkb + 1,), dtype=torch.bool, device=bi.indices.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :nkb]
