"""Paged decode attention (one query token per sequence) over a row store, returning LSE.

One kernel for three uses:

1. paged KV decode as in flash-attn's ``block_table`` / vLLM: a sequence's tokens live in pages
   scattered over a pool, listed in order by a page table;
2. full-offload decode reading the pinned CPU KV pool directly over PCIe (zero copy, UVA): the
   row store may be a pinned host tensor, read by the kernel through its device alias (no staging
   copy);
3. sparse decode with per-KV-head page selection as in Quest (Tang et al. 2024): each KV head has
   its own list of selected pages (``page_table`` ``[B, Hkv, P]``), all of the same length.

The split-KV design is that of :mod:`xoffload.kernels.decode` (flash-decoding, Dao et al. 2023):
the page list of each (sequence, KV head) is cut into ``num_splits`` chunks that run in parallel,
each giving a partial (output, LSE) in fp32, merged exactly by the same reduce kernel. The query
heads of a GQA group are the M rows of ``tl.dot``. The online-softmax tile step is shared with the
contiguous kernel (``decode._attend_tile``); only the address of each key row differs: token t of
(b, h) is row ``page_table[b, h, t // page_size] + t % page_size`` of the store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import (
    HostPtr, check_heads, check_lengths, check_same, check_tensor, default_scale, device_can_read_host, next_pow2, use_triton,
)
from .decode import (
    _LOG2E, _attend_tile, _block_m, _default_config, _sm_count, _store_split_state, default_num_splits,
    reduce_splits, split_buffers,
)

__all__ = ["paged_decode_attn_with_lse"]

_INT32_MAX = 2 ** 31 - 1


def _check_page_size(page_size) -> int:
    if (not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 16
            or page_size & (page_size - 1)):
        raise ValueError(f"page_size must be a power of two >= 16 (16, 32, 64, ..., 1024, ...), got {page_size!r}")
    return page_size


def _check_inputs(q, k_pages, v_pages, page_table, seqlens, page_size, check: bool):
    check_tensor("q", q, ndim=4)
    check_tensor("k_pages", k_pages, ndim=3)
    check_tensor("v_pages", v_pages, ndim=3)
    check_same([("k_pages", k_pages), ("v_pages", v_pages)])
    if k_pages.dtype != q.dtype:
        raise TypeError(f"k_pages has dtype {k_pages.dtype} but q has {q.dtype}; all must match")
    b, sq, hq, d = q.shape
    if sq != 1:
        raise ValueError(f"q must have shape [B, 1, Hq, D] (one query token), got {tuple(q.shape)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must have the same shape"
        )
    r, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"k_pages head_dim {dk} != q head_dim {d} (q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)})")
    check_heads(hq, hkv, d, "q", "k_pages")
    if k_pages.device != q.device:
        # the one allowed mismatch: q on a GPU reading a pinned host store through UVA
        if not (q.is_cuda and k_pages.device.type == "cpu"):
            raise ValueError(f"k_pages/v_pages are on {k_pages.device} but q is on {q.device}; the store must be "
                             f"on q's device or, for q on CUDA, in pinned host memory")
        for n, t in (("k_pages", k_pages), ("v_pages", v_pages)):
            if not device_can_read_host(t):
                raise ValueError(f"{n} is a host tensor that is not pinned (page-locked); a GPU kernel reads host "
                                 f"memory only through UVA: allocate it with pin_memory=True or cudaHostRegister")
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32, got {page_table.dtype}")
    if page_table.dim() != 3 or page_table.shape[0] != b or page_table.shape[1] not in (1, hkv):
        raise ValueError(f"page_table must have shape [B, Hkv, P] = [{b}, {hkv}, P] or [B, 1, P] = [{b}, 1, P], "
                         f"got {tuple(page_table.shape)}")
    if page_table.device != q.device:
        raise ValueError(f"page_table is on {page_table.device} but q is on {q.device}")
    n_pages = page_table.shape[2]
    if n_pages > 0 and r < page_size:
        raise ValueError(f"k_pages has {r} rows, fewer than one page (page_size {page_size}): no table entry "
                         f"keeps a page inside the store")
    if n_pages * page_size > _INT32_MAX:
        raise ValueError(f"page_table holds {n_pages} pages of {page_size} tokens = {n_pages * page_size} tokens, "
                         f"more than int32 lengths can count (2^31 - 1)")
    check_lengths("seqlens", seqlens, b, q.device)
    if check and b > 0:
        # Host reads (small D2H copies that synchronise the stream): validation only. With
        # check=False the kernel clamps lengths to [0, P*page_size] and entries to [0, R-page_size].
        cap = n_pages * page_size
        lens = seqlens.cpu()
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > cap:
            raise ValueError(f"seqlens must be in [0, P*page_size={cap}] (page_table {tuple(page_table.shape)}, "
                             f"page_size {page_size}), got min {lo}, max {hi}")
        if hi > 0:
            # only the entries of visited pages (j < ceil(seqlens[b] / page_size)) must be valid
            used = -(-lens.to(torch.int64) // page_size)  # [B]
            tab = page_table.cpu().to(torch.int64)
            visited = torch.arange(n_pages)[None, None, :] < used[:, None, None]
            vals = tab.expand(b, tab.shape[1], n_pages)[visited.expand(b, tab.shape[1], n_pages)]
            vmin, vmax = int(vals.min()), int(vals.max())
            if vmin < 0 or vmax > r - page_size:
                raise ValueError(f"page_table entries of visited pages must be in [0, R - page_size = {r - page_size}] "
                                 f"(k_pages {tuple(k_pages.shape)}, page_size {page_size}), got min {vmin}, max {vmax}")


def paged_decode_attn_with_lse(q, k_pages, v_pages, page_table, seqlens, *, page_size, softmax_scale=None,
                               num_splits=None, check=True):
    """Attention of one new query token per sequence over keys/values scattered in pages, with LSE.

    Split-KV decode (flash-decoding, Dao et al. 2023) over a page list per (sequence, KV head):
    serves paged KV caches (block tables), decode straight from a pinned host KV pool over PCIe
    (UVA, no staging copy) and per-KV-head sparse page selection (Quest, Tang et al. 2024).

    Args:
        q: ``[B, 1, Hq, D]`` fp16/bf16/fp32 on CUDA (or the CPU: reference / interpreter); only the
            last dim must be contiguous. ``Hq % Hkv == 0``; query head h reads KV head
            ``h // (Hq // Hkv)``. ``D <= 256``.
        k_pages, v_pages: row stores ``[R, Hkv, D]`` of q's dtype (R token rows, e.g. one layer of
            the pool as ``[num_blocks * block_size, Hkv, D]``); only the last dim must be
            contiguous. On q's device, or, for q on CUDA, pinned host tensors (``pin_memory=True``
            or ``cudaHostRegister``), which the kernel reads directly over PCIe.
        page_table: int32 ``[B, Hkv, P]`` (a page list per KV head) or ``[B, 1, P]`` (one list
            shared by every KV head), on q's device, any strides. Entry j is the row of the first
            token of the j-th page visited by (b, h); that page covers rows
            ``[entry, entry + page_size)``. Entries past a sequence's last page are never read.
        seqlens: int32 ``[B]`` on q's device: number of valid tokens along the page list (pages
            ``0 .. ceil(n / page_size) - 1``, the last may be partial), ``0 <= n <= P*page_size``.
            0 gives output 0 and LSE -inf.
        page_size: tokens per page (keyword, a power of two >= 16; a compile-time constant).
        softmax_scale: default ``1/sqrt(D)``.
        num_splits: chunks per page list (Triton path). Default: from the shapes only (B, Hkv,
            ``P * page_size``, the GPU's SM count), never from the values of seqlens or the
            table, so a CUDA graph captured once stays valid.
        check: when True (default) seqlens and the visited table entries are read on the host to
            validate them (small device->host copies that synchronise the stream). Pass False in
            CUDA-graph capture or a hot loop; the kernel then clamps lengths to
            ``[0, P*page_size]`` and entries to ``[0, R - page_size]`` so it stays inside the store.

    Returns:
        ``(out, lse)``: out ``[B, 1, Hq, D]`` in q.dtype; lse fp32 ``[B, Hq, 1]`` (natural log).

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, page_table or seqlens not int32.
        ValueError: page_size not a power of two >= 16, wrong ranks/shapes (named with their
            shapes), Hq % Hkv != 0, head_dim mismatch or > 256, a non-contiguous last dim, the
            table/lengths on another device than q, a store on another device that is not pinned
            host memory, (with check=True) seqlens outside ``[0, P*page_size]`` or a visited entry
            outside ``[0, R - page_size]``, an invalid softmax_scale or num_splits.
    """
    page_size = _check_page_size(page_size)
    _check_inputs(q, k_pages, v_pages, page_table, seqlens, page_size, check)
    scale = default_scale(q.shape[-1], softmax_scale)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    b, _, hq, d = q.shape
    if b == 0:
        return (torch.empty(0, 1, hq, d, dtype=q.dtype, device=q.device),
                torch.empty(0, hq, 1, dtype=torch.float32, device=q.device))
    if use_triton(q):
        # the kernel indexes lengths as Lens + b: a strided view must be made contiguous
        return _paged_triton(q, k_pages, v_pages, page_table, seqlens.contiguous(), page_size, scale, num_splits)
    # CPU reference, with the kernel's clamping (so check=False gives the same answer)
    r = k_pages.shape[0]
    lens = seqlens.clamp(0, page_table.shape[2] * page_size)
    table = page_table.clamp(0, max(r - page_size, 0))
    out, lse = reference.paged_decode_attn_ref(q, k_pages, v_pages, table, lens, page_size=page_size,
                                               softmax_scale=scale)
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _paged_split_kernel(
    Q, K, V, T, Lens, O, L,
    qk_scale, N_PAGES, MAX_ENTRY, Hkv, GROUP, D, NUM_SPLITS, M_BLOCKS,
    s_qb, s_qh,
    s_kr, s_kh,
    s_vr, s_vh,
    s_tb, s_th, s_tp,
    s_os, s_ob, s_oh,
    s_ls, s_lb, s_lh,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program: KV head ``hk`` of sequence ``b`` (its GROUP query heads as the M rows, in
    blocks of BLOCK_M), tokens ``[split*chunk, (split+1)*chunk)`` of its page list with
    chunk = ceil(len/NUM_SPLITS) rounded up to BLOCK_N. Token t is row
    ``T[b, hk, t // PAGE] + t % PAGE`` of K/V (``s_th`` = 0 for a table shared by the KV heads).
    PAGE >= BLOCK_N: a tile lies inside one page (both are powers of two and tiles start at
    multiples of BLOCK_N), so one table entry per tile; PAGE < BLOCK_N: one entry per key row."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % M_BLOCKS
    t = pid // M_BLOCKS
    hk = t % Hkv
    b = (t // Hkv).to(tl.int64)

    seqlen = tl.load(Lens + b)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), N_PAGES * PAGE)
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

    t_row = T + b * s_tb + hk.to(tl.int64) * s_th
    k_base = K + hk * s_kh + offs_d[None, :]
    v_base = V + hk * s_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        nmask = tok < hi
        if PAGE >= BLOCK_N:
            entry = tl.load(t_row + (start // PAGE) * s_tp)
            entry = tl.minimum(tl.maximum(entry, 0), MAX_ENTRY).to(tl.int64)
            rows = entry + (start % PAGE) + offs_n
        else:
            entry = tl.load(t_row + (tok // PAGE) * s_tp, mask=nmask, other=0)
            entry = tl.minimum(tl.maximum(entry, 0), MAX_ENTRY).to(tl.int64)
            rows = entry + (tok % PAGE)
        k_ptrs = k_base + rows[:, None] * s_kr
        v_ptrs = v_base + rows[:, None] * s_vr
        m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, nmask, dmask, m_i, l_i, acc, qk_scale, DOT_PREC)

    _store_split_state(O, L, acc, m_i, l_i, split, b, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_oh, s_ls, s_lb, s_lh)


def _kernel_arg(t: torch.Tensor, q: torch.Tensor):
    """A store argument for the kernel: the tensor itself on q's device (or under the
    interpreter), a :class:`HostPtr` (UVA alias) for a pinned host tensor read by a GPU kernel."""
    if q.is_cuda and not t.is_cuda:
        return HostPtr(t)
    return t


def _paged_triton(q, k_pages, v_pages, page_table, seqlens, page_size, scale, num_splits, config=None):
    """Launch the paged split kernel and the shared reduce kernel (when num_splits > 1).
    ``config`` (block_n, num_warps, num_stages) overrides the default tiles (benchmarks sweep it)."""
    b, _, hq, d = q.shape
    r, hkv, _ = k_pages.shape
    n_pages = page_table.shape[2]
    group = hq // hkv
    block_m = _block_m(group)
    m_blocks = -(-group // block_m)
    block_d = max(16, next_pow2(d))
    cfg = dict(_default_config(d, q.dtype))
    if config:
        cfg.update(config)
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, group, n_pages * page_size, _sm_count(q.device))
    out, lse, o_dst, l_dst, o_strides, l_strides = split_buffers(q, num_splits)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    s_th = page_table.stride(1) if page_table.shape[1] > 1 else 0
    max_entry = min(max(r - page_size, 0), _INT32_MAX)
    grid = (b * hkv * m_blocks, num_splits)
    _paged_split_kernel[grid](
        q, _kernel_arg(k_pages, q), _kernel_arg(v_pages, q), page_table, seqlens, o_dst, l_dst,
        scale * _LOG2E, n_pages, max_entry, hkv, group, d, num_splits, m_blocks,
        q.stride(0), q.stride(2),
        k_pages.stride(0), k_pages.stride(1),
        v_pages.stride(0), v_pages.stride(1),
        page_table.stride(0), s_th, page_table.stride(2),
        *o_strides, *l_strides,
        PAGE=page_size, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, DOT_PREC=prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    reduce_splits(o_dst, l_dst, out, lse, num_splits)
    return out, lse
