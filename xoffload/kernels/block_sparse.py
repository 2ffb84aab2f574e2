"""Block-sparse attention with LSE: the FlashAttention-2 loop over the kept key blocks only.

A boolean block mask ``[B or 1, H, ceil(Sq/bs), ceil(Sk/bs)]`` (``H`` = query heads, or KV heads:
one mask shared by the query heads of a KV head) says which ``bs x bs`` blocks of the attention
matrix are computed; everything else is treated as masked out. Query blocks are counted from the
first query row, key blocks from the first key. Conventions are those of
:func:`xoffload.kernels.flash_attn_with_lse` (DESIGN.md): flash-attn layout, GQA, bottom-right
causal inside the kept blocks, natural-log fp32 LSE ``[B, Hq, Sq]``, rows that see no key give
output 0 and LSE -inf. With a full mask the result is dense attention; the cost is proportional to
the number of kept blocks.

The mask is turned into per-row index lists on the device (:func:`block_mask_to_indices`: one
small Triton kernel, one program per mask row, no host sync): for every (batch, mask head, query
block) the kept key blocks that every row of the query block sees in full come first (the kernel
visits them without masking), then the partial ones (diagonal / ragged last block, visited with
masks), with the two counts. Under both causal and non-causal masking the fully visible blocks
are a prefix of the key blocks and the partial ones the range right after it, so the list is
simply the kept visible blocks in ascending order. The attention kernel walks the list in
``BLOCK_N``-key tiles (``BLOCK_N`` may be smaller than the mask's block size), with the online
softmax in base 2.

Launch variants (:class:`BSConfig`, chosen by :func:`_gpu_config`; the benchmark sweeps them):
tile sizes / warps / stages; how far ahead the next block index is loaded (1 or 2 iterations);
the program order (``"rev"``: last query tiles first, (batch, head) fastest; ``"kv"``: KV-head
major, so programs running together share one KV head's blocks in L2; ``"sorted"``: mask rows
with the most kept blocks first, from a device argsort of ``n_total``); tensor-descriptor (TMA)
loads of K/V; one loop with a per-tile mask branch instead of two loops; warp specialization.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_heads, check_same, check_tensor, default_scale, next_pow2, use_triton
from .flash_attn import _online_softmax_step, _tma_alloc, _tma_ok

__all__ = ["BlockIndex", "BSConfig", "block_mask_to_indices", "block_sparse_attn_with_lse"]


class BlockIndex(NamedTuple):
    """Kept key blocks per query block, as index lists (from :func:`block_mask_to_indices`).

    indices: int32 ``[Bm, Hm, nqb, nkb]``: row ``[b, h, I]`` lists the fully visible kept blocks
        (ascending), then the partially visible ones (ascending); entries past ``n_total`` are 0.
    n_full: int32 ``[Bm, Hm, nqb]``: how many leading entries need no mask.
    n_total: int32 ``[Bm, Hm, nqb]``: how many entries are kept.
    sq, sk, block_size, causal: the geometry the lists were built for.
    order: optional int32 ``[Bm * Hm * nqb]``: the mask rows (flat ``(b * Hm + h) * nqb + I``)
        by decreasing ``n_total`` (ties: later query block first, then lower head), used by the
        ``"sorted"`` program order; built by ``block_mask_to_indices(..., with_order=True)`` or,
        when absent, by the launcher on each call.

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
    order: Optional[torch.Tensor] = None


class BSConfig(NamedTuple):
    """Launch configuration of the block-sparse kernel (a plain 4-tuple means the defaults below).

    block_m, block_n: query rows / keys per tile (capped at the mask's block size; ``block_n`` may
        be smaller than it: each block is then visited in ``block_size // block_n`` tiles).
    num_warps, num_stages: as for any Triton kernel (stages = K/V tiles in flight).
    prefetch: 1 or 2: how many iterations ahead the next block index is loaded.
    order: ``"rev"`` (last query tiles first, (batch, head) fastest), ``"kv"`` (KV-head major:
        (batch, KV head) slowest, then query tiles last-first, the group's query heads fastest) or
        ``"sorted"`` (mask rows by decreasing kept-block count; needs a device argsort).
    tma: K/V through tensor descriptors (TMA on sm_90+); falls back to pointer loads when the
        tensors are not 16-byte aligned.
    one_loop: one pipelined loop over all kept tiles, masking the partial ones in a branch,
        instead of an unmasked loop followed by a masked one.
    warp_spec: ``warp_specialize`` on the unmasked loop (Triton's producer/consumer warps).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: int = 1
    order: str = "rev"
    tma: bool = False
    one_loop: bool = False
    warp_spec: bool = False

    def name(self) -> str:
        """Short label, e.g. ``128x64w8s3`` or ``128x128w8s3/kv/pf2/tma``."""
        s = f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"
        if self.order != "rev":
            s += f"/{self.order}"
        if self.prefetch != 1:
            s += f"/pf{self.prefetch}"
        if self.tma:
            s += "/tma"
        if self.one_loop:
            s += "/1loop"
        if self.warp_spec:
            s += "/ws"
        return s


_ORDERS = {"rev": 0, "kv": 1, "sorted": 2}


def _as_config(cfg) -> BSConfig:
    c = cfg if isinstance(cfg, BSConfig) else BSConfig(*cfg)
    if c.order not in _ORDERS:
        raise ValueError(f"BSConfig.order must be one of {sorted(_ORDERS)}, got {c.order!r}")
    if c.prefetch not in (1, 2):
        raise ValueError(f"BSConfig.prefetch must be 1 or 2, got {c.prefetch!r}")
    return c


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_block_size(block_size):
    if not _is_int(block_size):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")


# ----------------------------------------------------------------------------------------------
# mask -> index lists
# ----------------------------------------------------------------------------------------------

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


def _check_mask_geometry(block_mask, sq, sk, block_size):
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
    return nqb, nkb


def _mask_to_indices_torch(block_mask, sq, sk, block_size, causal):
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


def _mask_to_indices_triton(block_mask, sq, sk, block_size, causal):
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


def _row_order(n_total: torch.Tensor, nkb: int) -> torch.Tensor:
    """int32 permutation of the flat mask rows: most kept blocks first; ties: later query block
    first, then lower (batch, head). Device ops only (no host sync)."""
    nqb = n_total.shape[-1]
    qb = torch.arange(nqb, device=n_total.device, dtype=torch.int64)
    key = (nkb - n_total.to(torch.int64)) * max(nqb, 1) + (nqb - 1 - qb)
    return torch.argsort(key.reshape(-1), stable=True).to(torch.int32)


def block_mask_to_indices(block_mask, sq, sk, *, block_size=128, causal=True, with_order=False) -> BlockIndex:
    """Convert a bool block mask into per-row index lists (:class:`BlockIndex`), on its device.

    Args:
        block_mask: bool ``[Bm, Hm, ceil(sq/bs), ceil(sk/bs)]`` (any strides).
        sq, sk: query / key lengths in tokens.
        block_size: bs, a power of two >= 16.
        causal: bottom-right causal (query row i sees key j iff ``j <= i + sk - sq``); blocks that
            no row of a query block can see are dropped, blocks crossing the diagonal go last.
        with_order: also build ``order`` (rows by decreasing kept-block count) for the
            ``"sorted"`` program order (one device argsort over ``Bm * Hm * nqb`` rows).

    On CUDA (or under Triton's interpreter) one Triton program per mask row; otherwise PyTorch.
    Both give identical tensors.

    Raises:
        TypeError / ValueError: non-bool mask, wrong rank or shape for (sq, sk, block_size).
    """
    nqb, nkb = _check_mask_geometry(block_mask, sq, sk, block_size)
    if use_triton(block_mask):
        idx, nf, nt = _mask_to_indices_triton(block_mask, sq, sk, block_size, causal)
    else:
        idx, nf, nt = _mask_to_indices_torch(block_mask, sq, sk, block_size, causal)
    order = _row_order(nt, nkb) if with_order else None
    return BlockIndex(idx, nf, nt, int(sq), int(sk), int(block_size), bool(causal), order)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row, offs_m, offs_n,
              d_ok, it_lo, it_hi, it_mask, seqlen_k, diag_shift, qk_scale, stride_kn, stride_vn,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_K: tl.constexpr,
              IS_FP32: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              PREFETCH: tl.constexpr, USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,
              WARP_SPEC: tl.constexpr):
    # The block index of a later iteration is loaded ahead (loop-carried scalars). Loading it in
    # the iteration that uses it made Triton's pipeliner stage the index load as an async copy
    # and wait for all copies at the top of every iteration (K/V latency exposed: 1.45x the dense
    # kernel at 100% density on an H200); with the carried index the K/V copies run num_stages
    # deep as in the dense kernel. Index loads mostly hit L1.
    # ONE_LOOP: tiles it >= it_mask get the causal / key-length mask (a runtime branch).
    LOAD_MASK: tl.constexpr = (MASKED or ONE_LOOP) and not EVEN_K
    # PREFETCH == 2 carries the indices of iterations it and it + 1 packed in one int64 (two
    # separate carried scalars, one copied into the other, kept Triton's pipeliner from
    # pipelining the K/V loads at all: sm_90 compile shows no async copies).
    blk_n1 = tl.load(idx_row + it_lo // SUB, mask=it_lo < it_hi, other=0)
    if PREFETCH == 2:
        blk_n2 = tl.load(idx_row + (it_lo + 1) // SUB, mask=it_lo + 1 < it_hi, other=0)
        pair = blk_n1.to(tl.int64) | (blk_n2.to(tl.int64) << 32)
    else:
        pair = blk_n1.to(tl.int64)
    for it in tl.range(it_lo, it_hi, warp_specialize=WARP_SPEC):
        if PREFETCH == 2:
            blk = (pair & 0xFFFFFFFF).to(tl.int32)
            nxt = tl.load(idx_row + (it + 2) // SUB, mask=it + 2 < it_hi, other=0)
            pair = (pair >> 32) | (nxt.to(tl.int64) << 32)
        else:
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
        if ONE_LOOP:
            if it >= it_mask:
                ok = ((start_n + offs_n) < seqlen_k)[None, :]
                if CAUSAL:
                    ok = ok & ((start_n + offs_n)[None, :] <= (offs_m[:, None] + diag_shift))
                qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk * qk_scale - m_sub[:, None])
            alpha = tl.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        else:
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


@triton.jit(do_not_specialize=["Sq", "Sk", "n_bh", "n_heads", "group", "mask_group", "n_mheads", "n_qb",
                               "num_m_blocks", "n_rep", "stride_lb", "stride_lh", "stride_lm", "stride_ib",
                               "stride_ih", "stride_ii", "stride_cb", "stride_ch"])
def _bs_attn_fwd(Q, K, V, O, LSE, IDX, NFULL, NTOT, ORD,
                 stride_qb, stride_qm, stride_qh,
                 stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh,
                 stride_ob, stride_om, stride_oh,
                 stride_lb, stride_lh, stride_lm,
                 stride_ib, stride_ih, stride_ii,
                 stride_cb, stride_ch,
                 Sq, Sk, n_bh, n_heads, group, mask_group, n_mheads, n_qb, num_m_blocks, n_rep, qk_scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 IS_FP32: tl.constexpr, MASK_BATCH: tl.constexpr, EVEN_K: tl.constexpr,
                 ORDER: tl.constexpr, PREFETCH: tl.constexpr, USE_TMA: tl.constexpr,
                 ONE_LOOP: tl.constexpr, WARP_SPEC: tl.constexpr):
    pid = tl.program_id(0)
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    SUBM: tl.constexpr = BLOCK_SIZE // BLOCK_M
    if ORDER == 0:
        # the last query tiles (most keys under causal) first, (batch, head) fastest
        bh = pid % n_bh
        mb = num_m_blocks - 1 - pid // n_bh
        b = bh // n_heads
        h = bh % n_heads
    elif ORDER == 1:
        # KV-head major: (batch, KV head) slowest, query tiles last-first, the group's heads fastest
        per_kv = num_m_blocks * group
        bkv = pid // per_kv
        r = pid % per_kv
        mb = num_m_blocks - 1 - r // group
        n_kv = n_heads // group
        b = bkv // n_kv
        h = (bkv % n_kv) * group + r % group
    else:
        # ORD lists the mask rows, heaviest first; each row stands for n_rep programs:
        # (batch if the mask is broadcast) x (query heads sharing the mask) x (query tiles of a block)
        row = tl.load(ORD + pid // n_rep)
        inner = pid % n_rep
        qb_r = row % n_qb
        bh_m = row // n_qb
        h_m0 = bh_m % n_mheads
        sub = inner % SUBM
        t = inner // SUBM
        h = h_m0 * mask_group + t % mask_group
        if MASK_BATCH:
            b = bh_m // n_mheads
        else:
            b = t // mask_group
        mb = qb_r * SUBM + sub
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
        if ONE_LOOP:
            acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row,
                                      offs_m, offs_n, d_ok, 0, n_tot * SUB, n_full * SUB, Sk, diag_shift, qk_scale,
                                      stride_kn, stride_vn, False, CAUSAL, EVEN_D, EVEN_K, IS_FP32, BLOCK_N, SUB,
                                      BLOCK_SIZE, PREFETCH, USE_TMA, True, WARP_SPEC)
        else:
            acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row,
                                      offs_m, offs_n, d_ok, 0, n_full * SUB, 0, Sk, diag_shift, qk_scale,
                                      stride_kn, stride_vn, False, CAUSAL, EVEN_D, EVEN_K, IS_FP32, BLOCK_N, SUB,
                                      BLOCK_SIZE, PREFETCH, USE_TMA, False, WARP_SPEC)
            acc, l_i, m_i = _bs_inner(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, k_offs, v_offs, idx_row,
                                      offs_m, offs_n, d_ok, n_full * SUB, n_tot * SUB, 0, Sk, diag_shift, qk_scale,
                                      stride_kn, stride_vn, True, CAUSAL, EVEN_D, EVEN_K, IS_FP32, BLOCK_N, SUB,
                                      BLOCK_SIZE, PREFETCH, USE_TMA, False, False)
        empty = l_i == 0.0
        l_div = tl.where(empty, 1.0, l_i)
        out = acc / l_div[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
        o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
        tl.store(l_base + offs_m * stride_lm, lse, mask=m_ok)


# Launch configurations (BSConfig; a 4-tuple (BLOCK_M, BLOCK_N, num_warps, num_stages) means the
# other fields at their defaults). BLOCK_M and BLOCK_N are capped at the block size.
_INTERP_CFG = BSConfig(32, 32, 4, 1)
_CFG_OVERRIDE: list = []  # benchmark / test hook: the last entry replaces _gpu_config (and _INTERP_CFG)


def _gpu_config(block_d: int, dtype: torch.dtype) -> BSConfig:
    """Launch configuration on CUDA. To change the default after a sweep
    (``python benchmarks/bench_xattn.py --sweep-bs``), edit the D <= 128 line, e.g.
    ``BSConfig(128, 128, 8, 3, order="kv")``."""
    if dtype == torch.float32:
        return BSConfig(64, 32, 4, 2)
    if block_d <= 64:
        return BSConfig(128, 64, 4, 3)
    if block_d <= 128:
        # H200 sweep (bench_xattn.py --sweep-bs --quick, 128K, 32/8 heads, D=128): 30.8 ms at 10%
        # (0.90x FlexAttention, 0.104x dense) and 0.94x dense at 100%; the old 128x64 "rev" default
        # took 37.8 ms / 1.07x dense
        return BSConfig(128, 128, 8, 3, order="kv", tma=True)
    return BSConfig(64, 32, 4, 2)


# Variants the benchmark sweeps (bf16, D = 128, block 128); the first is the current default.
SWEEP_CONFIGS = [
    BSConfig(128, 64, 8, 3),
    BSConfig(128, 128, 8, 3),
    BSConfig(128, 64, 8, 3, prefetch=2),
    BSConfig(128, 128, 8, 3, prefetch=2),
    BSConfig(128, 64, 8, 3, order="kv"),
    BSConfig(128, 128, 8, 3, order="kv"),
    BSConfig(128, 64, 8, 3, order="sorted"),
    BSConfig(128, 128, 8, 3, order="sorted"),
    BSConfig(128, 64, 8, 3, tma=True),
    BSConfig(128, 128, 8, 3, tma=True),
    BSConfig(128, 128, 8, 3, order="kv", tma=True),
    BSConfig(128, 128, 8, 3, one_loop=True),
    BSConfig(128, 64, 8, 3, one_loop=True),
    BSConfig(128, 64, 8, 4),
    BSConfig(128, 128, 8, 2),
    BSConfig(64, 64, 4, 3),
    BSConfig(128, 64, 8, 3, tma=True, warp_spec=True),
    BSConfig(128, 128, 8, 3, order="kv", prefetch=2),
    BSConfig(128, 128, 8, 3, order="kv", one_loop=True),
    BSConfig(128, 64, 8, 3, order="kv", tma=True),
]
SWEEP_CONFIGS_QUICK = SWEEP_CONFIGS[:12]


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
    if _CFG_OVERRIDE:
        cfg = _as_config(_CFG_OVERRIDE[-1])
    elif q.is_cuda:
        cfg = _gpu_config(block_d, q.dtype)
    else:
        cfg = _INTERP_CFG
    _launch(q, k, v, out, lse, bi, cfg, scale)
    return out, lse


def _launch(q, k, v, out, lse, bi: BlockIndex, cfg: BSConfig, scale: float):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_size, causal = bi.block_size, bi.causal
    block_d = max(16, next_pow2(d))
    block_m, block_n = min(cfg.block_m, block_size), min(cfg.block_n, block_size)
    idx, nf, nt = bi.indices, bi.n_full, bi.n_total
    bm, hm, nqb, nkb = idx.shape
    mask_batch = bm != 1
    num_m = triton.cdiv(sq, block_m)
    n_bh = b * hq
    order = _ORDERS[cfg.order]
    n_rep = (block_size // block_m) * (hq // hm) * (1 if mask_batch else b)
    if order == 2:
        ordt = bi.order if bi.order is not None else _row_order(nt, nkb)
        grid = (bm * hm * nqb * n_rep,)
    else:
        ordt = nt  # unused
        grid = (num_m * n_bh,)
    tma = bool(cfg.tma) and _tma_ok(k, v)
    if tma and q.is_cuda:
        triton.set_allocator(_tma_alloc)  # scratch for the descriptors built inside the kernel
    _bs_attn_fwd[grid](
        q, k, v, out, lse, idx, nf, nt, ordt,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2),
        nf.stride(0), nf.stride(1),
        sq, sk, n_bh, hq, hq // hkv, hq // hm, hm, nqb, num_m, n_rep, scale * 1.4426950408889634,
        D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, CAUSAL=causal,
        IS_FP32=q.dtype == torch.float32, MASK_BATCH=mask_batch, EVEN_K=sk % block_size == 0,
        ORDER=order, PREFETCH=cfg.prefetch, USE_TMA=tma, ONE_LOOP=bool(cfg.one_loop),
        WARP_SPEC=bool(cfg.warp_spec),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _indices_to_mask(bi: BlockIndex) -> torch.Tensor:
    """Bool mask of the blocks listed in a :class:`BlockIndex` (for the CPU reference path)."""
    nkb = bi.indices.shape[-1]
    pos = torch.arange(nkb, device=bi.indices.device)
    listed = pos < bi.n_total[..., None]
    idx = torch.where(listed, bi.indices.long(), torch.full_like(bi.indices, nkb, dtype=torch.long))
    mask = torch.zeros(bi.indices.shape[:-1] + (nkb + 1,), dtype=torch.bool, device=bi.indices.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :nkb]
