"""Paged decode attention (a few query tokens per sequence) over a row or block store, returning LSE.

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
(b, h) is row ``page_table[b, h, t // page_size] + t % page_size`` of a row store ``[R, Hkv, D]``,
or row ``t % page_size`` of block ``page_table[b, h, t // page_size]`` of a block store
``[num_blocks, page_size, Hkv, D]`` (flash-attn's / vLLM's ``block_table`` layout, read in place:
no gather, no copy). Any page size that is a multiple of 16: a tile reads one table entry when the
page size is a multiple of the tile (BLOCK_N), else one per key row.

The options of :mod:`xoffload.kernels.decode` (several query tokens, causal, local window,
soft-capping, ALiBi, left padding) are the same constexpr-gated code in both kernels.

fp8 stores (:mod:`xoffload.kernels.fp8`): k/v pages in ``float8_e4m3fn`` with fp32 scales per
(page, KV head) or (token, KV head) beside them (``k_scale`` / ``v_scale``); the kernel reads one
byte per element in tiles of 128 keys, converts them to fp16 in registers (q too, a bf16 q as rows
scaled by powers of two) and applies the scales in fp32 (``decode._attend_tile``'s KV_SCALE
branch, a constexpr: the 16-bit path compiles as before).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .fp8 import FP8_DTYPE, check_fp8_supported, check_kv_scales, dequantize_kv_fp8
from .checks import (
    HostPtr, check_heads, check_lengths, check_same, check_tensor, default_scale, device_can_read_host, is_int,
    next_pow2, use_triton, SUPPORTED_DTYPES,
)
from .decode import (
    _attend_tile, _block_m, _default_config, _fp8_query, _key_range, _program_rows, _sm_count, _store_split_state,
    check_num_splits, decode_options, default_num_splits, empty_outputs, option_args, reduce_splits, split_buffers,
)

__all__ = ["paged_decode_attn_with_lse"]

_INT32_MAX = 2 ** 31 - 1


def _check_page_size(page_size) -> int:
    if not is_int(page_size) or page_size < 16 or page_size % 16:
        raise ValueError(f"page_size must be a positive multiple of 16 (16, 32, 48, ..., 256, ...), got {page_size!r}")
    return int(page_size)


def _store_layout(k_pages, v_pages, page_size):
    """``(page_size, blocked)``: a row store ``[R, Hkv, D]`` needs ``page_size``; a block store
    ``[num_blocks, page_size, Hkv, D]`` carries it (a given page_size must agree)."""
    check_tensor("k_pages", k_pages, dtypes=SUPPORTED_DTYPES + (FP8_DTYPE,))
    check_tensor("v_pages", v_pages, dtypes=SUPPORTED_DTYPES + (FP8_DTYPE,))
    if k_pages.dim() == 4:
        ps = k_pages.shape[1]
        if ps < 16 or ps % 16:
            raise ValueError(f"k_pages has pages of {ps} tokens (block store {tuple(k_pages.shape)} = [num_blocks, "
                             f"page_size, Hkv, D]); page_size must be a positive multiple of 16")
        if page_size is not None and page_size != ps:
            raise ValueError(f"page_size={page_size!r} but the block store k_pages {tuple(k_pages.shape)} has pages "
                             f"of {ps} tokens")
        return ps, True
    if k_pages.dim() != 3:
        raise ValueError(f"k_pages must have 3 dims ([R, Hkv, D] row store) or 4 ([num_blocks, page_size, Hkv, D] "
                         f"block store), got shape {tuple(k_pages.shape)}")
    return _check_page_size(page_size), False


def _check_inputs(q, k_pages, v_pages, page_table, seqlens, page_size, blocked, cache_leftpad, check: bool,
                  aligned: bool = False):
    check_tensor("q", q, ndim=4)
    check_same([("k_pages", k_pages), ("v_pages", v_pages)])
    if k_pages.dtype == FP8_DTYPE:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q has dtype {q.dtype}; float8_e4m3fn k_pages/v_pages need an fp16 or bf16 q")
    elif k_pages.dtype != q.dtype:
        raise TypeError(f"k_pages has dtype {k_pages.dtype} but q has {q.dtype}; all must match")
    b, sq, hq, d = q.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must have the same shape"
        )
    hkv, dk = k_pages.shape[-2], k_pages.shape[-1]
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
    r = k_pages.shape[0]
    if blocked:
        if n_pages > 0 and r < 1:
            raise ValueError(f"k_pages has no block (shape {tuple(k_pages.shape)}): no table entry points inside it")
        max_entry, what = r - 1, f"[0, num_blocks - 1 = {r - 1}] (block store k_pages {tuple(k_pages.shape)})"
    else:
        if n_pages > 0 and r < page_size:
            raise ValueError(f"k_pages has {r} rows, fewer than one page (page_size {page_size}): no table entry "
                             f"keeps a page inside the store")
        max_entry = r - page_size
        what = f"[0, R - page_size = {r - page_size}] (k_pages {tuple(k_pages.shape)}, page_size {page_size})"
    if n_pages * page_size > _INT32_MAX:
        raise ValueError(f"page_table holds {n_pages} pages of {page_size} tokens = {n_pages * page_size} tokens, "
                         f"more than int32 lengths can count (2^31 - 1)")
    check_lengths("seqlens", seqlens, b, q.device)
    if cache_leftpad is not None:
        check_lengths("cache_leftpad", cache_leftpad, b, q.device)
    if check and b > 0:
        # Host reads (small D2H copies that synchronise the stream): validation only. With
        # check=False the kernel clamps lengths to [0, P*page_size], left pads to [0, length] and
        # entries to [0, R-page_size] (row store) or [0, num_blocks-1] (block store).
        cap = n_pages * page_size
        lens = seqlens.cpu()
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > cap:
            raise ValueError(f"seqlens must be in [0, P*page_size={cap}] (page_table {tuple(page_table.shape)}, "
                             f"page_size {page_size}), got min {lo}, max {hi}")
        if cache_leftpad is not None:
            lp = cache_leftpad.cpu()
            bad = (lp < 0) | (lp > lens)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"cache_leftpad[{i}] = {int(lp[i])} must be in [0, seqlens[{i}] = {int(lens[i])}]")
        if hi > 0:
            # only the entries of visited pages (j < ceil(seqlens[b] / page_size)) must be valid
            used = -(-lens.to(torch.int64) // page_size)  # [B]
            tab = page_table.cpu().to(torch.int64)
            visited = torch.arange(n_pages)[None, None, :] < used[:, None, None]
            vals = tab.expand(b, tab.shape[1], n_pages)[visited.expand(b, tab.shape[1], n_pages)]
            vmin, vmax = int(vals.min()), int(vals.max())
            if vmin < 0 or vmax > max_entry:
                raise ValueError(f"page_table entries of visited pages must be in {what}, got min {vmin}, max {vmax}")
            if aligned and bool((vals % page_size != 0).any()):
                bad = int(vals[vals % page_size != 0][0])
                raise ValueError(f"page_table entry {bad} of a visited page is not a multiple of page_size {page_size}: "
                                 f"page scales [R / page_size, Hkv] of a row store need page-aligned entries")


def paged_decode_attn_with_lse(q, k_pages, v_pages, page_table, seqlens, *, page_size=None, softmax_scale=None,
                               num_splits=None, check=True, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, cache_leftpad=None, k_scale=None, v_scale=None):
    """Attention of the last ``Sq`` (usually 1) query tokens of each sequence over keys/values
    scattered in pages, with LSE.

    Split-KV decode (flash-decoding, Dao et al. 2023) over a page list per (sequence, KV head):
    serves paged KV caches (block tables), decode straight from a pinned host KV pool over PCIe
    (UVA, no staging copy) and per-KV-head sparse page selection (Quest, Tang et al. 2024).

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32 on CUDA (or the CPU: reference / interpreter); only the
            last dim must be contiguous. ``Hq % Hkv == 0``; query head h reads KV head
            ``h // (Hq // Hkv)``. ``D <= 256``. Query row i sits at position ``n - Sq + i`` of the
            sequence's n tokens.
        k_pages, v_pages: q's dtype (or ``float8_e4m3fn`` with ``k_scale`` / ``v_scale``), only the
            last dim contiguous, either
            a row store ``[R, Hkv, D]`` (R token rows, e.g. one layer of the pool as
            ``[num_blocks * block_size, Hkv, D]``; table entries are row indices), or
            a block store ``[num_blocks, page_size, Hkv, D]`` (flash-attn's / vLLM's paged cache;
            table entries are block indices; any strides, read in place). On q's device, or, for q
            on CUDA, pinned host tensors (``pin_memory=True`` or ``cudaHostRegister``), which the
            kernel reads directly over PCIe.
        page_table: int32 ``[B, Hkv, P]`` (a page list per KV head) or ``[B, 1, P]`` (one list
            shared by every KV head; e.g. flash-attn's ``block_table[:, None]``), on q's device, any
            strides. Entry j locates the j-th page visited by (b, h): the row of its first token
            (row store; the page covers rows ``[entry, entry + page_size)``) or its block index
            (block store). Entries past a sequence's last page are never read.
        seqlens: int32 ``[B]`` on q's device: number of valid tokens along the page list (pages
            ``0 .. ceil(n / page_size) - 1``, the last may be partial), ``0 <= n <= P*page_size``.
            A row that sees no key gives output 0 and LSE -inf.
        page_size: tokens per page (keyword, a positive multiple of 16; a compile-time constant).
            Required for a row store; for a block store it defaults to ``k_pages.shape[1]``.
        softmax_scale: default ``1/sqrt(D)``.
        num_splits: chunks per page list (Triton path). Default: from the shapes only (B, Hkv,
            ``P * page_size`` or the window width, the GPU's SM count), never from the values of
            seqlens or the table, so a CUDA graph captured once stays valid.
        check: when True (default) seqlens, left pads and the visited table entries are read on
            the host to validate them (small device->host copies that synchronise the stream). Pass
            False in CUDA-graph capture or a hot loop; the kernel then clamps lengths to
            ``[0, P*page_size]``, left pads to ``[0, n]`` and entries to ``[0, R - page_size]``
            (row store) or ``[0, num_blocks - 1]`` (block store) so it stays inside the store.
        causal, window_size, softcap, alibi_slopes, cache_leftpad: as
            :func:`xoffload.kernels.decode_attn_with_lse` (positions are token indices along the
            page list).
        k_scale, v_scale: for ``float8_e4m3fn`` k/v only (both required; None for 16-bit k/v):
            fp32 scales (:func:`xoffload.kernels.fp8.quantize_kv_fp8`'s), value = code * scale. Per
            (page, KV head): ``[num_blocks, Hkv]`` (block store) or ``[ceil(R / page_size), Hkv]``
            (row store; page j covers rows ``[j * page_size, (j + 1) * page_size)``, so visited
            table entries must be multiples of page_size). Per (token, KV head): the store's shape
            without D, ``[num_blocks, page_size, Hkv]`` or ``[R, Hkv]``. On q's device or, like
            the store, in pinned host memory. q must then be fp16 or bf16; accumulation is fp32 as
            for 16-bit stores.

    Returns:
        ``(out, lse)``: out ``[B, Sq, Hq, D]`` in q.dtype; lse fp32 ``[B, Hq, Sq]`` (natural log).

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes (an fp8 store with an fp32 q),
            page_table, seqlens or cache_leftpad not int32, alibi slopes or fp8 scales not fp32, a
            non-bool causal.
        ValueError: page_size not a positive multiple of 16 (or disagreeing with a block store),
            wrong ranks/shapes (named with their shapes), Hq % Hkv != 0, head_dim mismatch or > 256,
            a non-contiguous last dim, the table/lengths on another device than q, a store on
            another device that is not pinned host memory, (with check=True) seqlens outside
            ``[0, P*page_size]``, a left pad outside ``[0, n]`` or a visited entry outside the
            store, a window value < -1, softcap < 0, alibi_slopes of the wrong shape, an invalid
            softmax_scale or num_splits; fp8 pages without both scales, scales with 16-bit pages,
            scales of the wrong shape or device, (with check=True) an unaligned row-store entry
            with page scales.
        RuntimeError: fp8 pages on a GPU of compute capability < 8.9.
    """
    page_size, blocked = _store_layout(k_pages, v_pages, page_size)
    gran = check_kv_scales(k_pages, v_pages, k_scale, v_scale, page_size, q.device)
    _check_inputs(q, k_pages, v_pages, page_table, seqlens, page_size, blocked, cache_leftpad, check,
                  aligned=gran == "page" and not blocked)
    if gran is not None and q.is_cuda:
        check_fp8_supported(q.device)
    opts = decode_options(q, causal, window_size, softcap, alibi_slopes)
    scale = default_scale(q.shape[-1], softmax_scale)
    check_num_splits(num_splits)
    b, sq = q.shape[:2]
    if b == 0 or sq == 0:
        return empty_outputs(q, v_pages.shape[-1])
    if use_triton(q):
        # the kernel indexes per-sequence tensors as T + b: strided views must be made contiguous
        return _paged_triton(q, k_pages, v_pages, page_table, seqlens.contiguous(), page_size, scale, num_splits,
                             opts=opts, cache_leftpad=None if cache_leftpad is None else cache_leftpad.contiguous(),
                             k_scale=k_scale, v_scale=v_scale)
    if gran is not None:  # the CPU reference reads the dequantized store (exact in fp32)
        k_pages = dequantize_kv_fp8(k_pages, k_scale, torch.float32,
                                    page_size=page_size, granularity=gran)
        v_pages = dequantize_kv_fp8(v_pages, v_scale, torch.float32, page_size=page_size, granularity=gran)
    # CPU reference, with the kernel's clamping (so check=False gives the same answer)
    r = k_pages.shape[0]
    lens = seqlens.clamp(0, page_table.shape[2] * page_size)
    table = page_table.clamp(0, max(r - 1, 0) if blocked else max(r - page_size, 0))
    lp = None if cache_leftpad is None else torch.minimum(cache_leftpad.clamp(min=0), lens)
    out, lse = reference.paged_decode_attn_ref(q, k_pages, v_pages, table, lens, page_size=page_size,
                                               softmax_scale=scale, causal=opts.causal,
                                               window_size=(opts.left, opts.right), softcap=opts.softcap,
                                               alibi_slopes=alibi_slopes, cache_leftpad=lp)
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N_PAGES", "MAX_ENTRY", "NUM_SPLITS"])  # see decode._decode_split_kernel
def _paged_split_kernel(
    Q, K, V, T, Lens, Lpad, Slopes, O, L, KS, VS,
    qk_scale, cap_scale, N_PAGES, MAX_ENTRY, Hkv, GROUP, SQ, D, NUM_SPLITS, M_BLOCKS, WIN_LEFT, WIN_RIGHT,
    s_qb, s_qs, s_qh,
    s_ke, s_kr, s_kh,
    s_ve, s_vr, s_vh,
    s_tb, s_th, s_tp,
    s_ab,
    s_os, s_ob, s_osq, s_oh,
    s_ls, s_lb, s_lsq, s_lh,
    s_kse, s_ksr, s_ksh, s_vse, s_vsr, s_vsh,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ROW_LEFT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LEFTPAD: tl.constexpr,
    KV_FP8: tl.constexpr = 0, SCALE_TOKEN: tl.constexpr = False, SCALE_DIV: tl.constexpr = 1,
):
    """One program: KV head ``hk`` of sequence ``b`` (the (token, group head) pairs as the M rows,
    in blocks of BLOCK_M), split ``program_id(1)`` of the tokens of its page list that its rows can
    see (:func:`decode._key_range`: tiles start at multiples of BLOCK_N). Token t is at
    ``T[b, hk, t // PAGE] * s_ke + (t % PAGE) * s_kr`` in K (``s_ke == s_kr`` for a row store,
    the block stride for a block store; ``s_th`` = 0 for a table shared by the KV heads).
    PAGE % BLOCK_N == 0: a tile lies inside one page, so one table entry per tile; otherwise one
    entry per key row.

    KV_FP8 (e4m3 K/V): 0 = 16-bit K/V; 1 = one scale per tile (page scales, PAGE % BLOCK_N == 0);
    2 = a scale per key row. Page scales (SCALE_TOKEN False) are at ``KS + (entry // SCALE_DIV) *
    s_kse + hk * s_ksh`` (SCALE_DIV = PAGE for a row store, 1 for a block store), token scales at
    ``KS + entry * s_kse + in_page * s_ksr + hk * s_ksh`` (the store's addressing without D).
    Same for VS."""
    b, hk, mb, mmask, s_row, hq = _program_rows(M_BLOCKS, Hkv, GROUP, SQ, BLOCK_M)
    split = tl.program_id(1)

    seqlen = tl.load(Lens + b)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), N_PAGES * PAGE)
    kstart = 0
    if LEFTPAD:
        kstart = tl.minimum(tl.maximum(tl.load(Lpad + b), 0), seqlen)
    lo_k, lo, hi = _key_range(seqlen, kstart, mb, GROUP, SQ, WIN_LEFT, WIN_RIGHT, NUM_SPLITS,
                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

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

    t_row = T + b * s_tb + hk.to(tl.int64) * s_th
    k_base = K + hk * s_kh + offs_d[None, :]
    v_base = V + hk * s_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        kmask = tok < hi
        if HAS_LEFT or LEFTPAD:
            kmask = kmask & (tok >= lo_k)
        if PAGE % BLOCK_N == 0:
            entry = tl.load(t_row + (start // PAGE) * s_tp)
            entry = tl.minimum(tl.maximum(entry, 0), MAX_ENTRY).to(tl.int64)
            in_page = (start % PAGE) + offs_n
        else:
            entry = tl.load(t_row + (tok // PAGE) * s_tp, mask=kmask, other=0)
            entry = tl.minimum(tl.maximum(entry, 0), MAX_ENTRY).to(tl.int64)
            in_page = tok % PAGE
        k_ptrs = k_base + (entry * s_ke + in_page * s_kr)[:, None]
        v_ptrs = v_base + (entry * s_ve + in_page * s_vr)[:, None]
        if KV_FP8 == 0:
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC)
        elif KV_FP8 == 1:  # page scales, one page per tile: one scale per tile
            ks = tl.load(KS + (entry // SCALE_DIV) * s_kse + hk * s_ksh)
            vs = tl.load(VS + (entry // SCALE_DIV) * s_vse + hk * s_vsh)
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC, ks, vs, 1, qs)
        else:  # a scale per key row
            if SCALE_TOKEN:
                ks_off = entry * s_kse + in_page * s_ksr + hk * s_ksh
                vs_off = entry * s_vse + in_page * s_vsr + hk * s_vsh
            else:  # page scales, one table entry per key row
                ks_off = (entry // SCALE_DIV) * s_kse + hk * s_ksh + 0 * in_page
                vs_off = (entry // SCALE_DIV) * s_vse + hk * s_vsh + 0 * in_page
            ksv = tl.load(KS + ks_off, mask=kmask, other=0.0)
            vsv = tl.load(VS + vs_off, mask=kmask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k_ptrs, v_ptrs, tok, kmask, dmask, m_i, l_i, acc, qk_scale, cap_scale,
                                         qpos, slope, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, ROW_LEFT, HAS_RIGHT,
                                         DOT_PREC, ksv, vsv, 2, qs)

    _store_split_state(O, L, acc, m_i, l_i, split, b, s_row, hq, offs_d, mmask, dmask,
                       s_os, s_ob, s_osq, s_oh, s_ls, s_lb, s_lsq, s_lh)


def _kernel_arg(t: torch.Tensor, q: torch.Tensor):
    """A store argument for the kernel: the tensor itself on q's device (or under the
    interpreter), a :class:`HostPtr` (UVA alias) for a pinned host tensor read by a GPU kernel."""
    if q.is_cuda and not t.is_cuda:
        return HostPtr(t)
    return t


def _scale_args(k_pages, k_scale, v_scale, page_size, blocked, block_n):
    """``(KV_FP8, SCALE_TOKEN, SCALE_DIV, k strides, v strides)`` of the kernel for fp8 scales (see
    :func:`_paged_split_kernel`); 16-bit stores: ``(0, False, 1, zeros, zeros)``."""
    if k_scale is None:
        return 0, False, 1, (0, 0, 0), (0, 0, 0)
    token = tuple(k_scale.shape) == tuple(k_pages.shape[:-1])
    out = []
    for s in (k_scale, v_scale):
        if token:
            out.append((s.stride(0), s.stride(1), s.stride(2)) if blocked else (s.stride(0), s.stride(0), s.stride(1)))
        else:
            out.append((s.stride(0), 0, s.stride(1)))
    per_tile = not token and page_size % block_n == 0
    return (1 if per_tile else 2), token, (1 if blocked or token else page_size), out[0], out[1]


def _paged_triton(q, k_pages, v_pages, page_table, seqlens, page_size, scale, num_splits, config=None, *,
                  opts=None, cache_leftpad=None, k_scale=None, v_scale=None):
    """Launch the paged split kernel and the shared reduce kernel (when num_splits > 1).
    ``config`` (block_n, num_warps, num_stages; optional maxnreg, ptxas' register cap per thread)
    overrides the default tiles (benchmarks sweep it);
    ``opts`` the :class:`~xoffload.kernels.decode.DecodeOptions` (default: none). A 4-D
    ``k_pages`` is a block store (entries are block indices); ``k_scale`` / ``v_scale`` the fp32
    scales of a ``float8_e4m3fn`` store (checked by the caller)."""
    b, sq, hq, d = q.shape
    blocked = k_pages.dim() == 4
    r, hkv = k_pages.shape[0], k_pages.shape[-2]
    if opts is None:
        opts = decode_options(q)
    n_pages = page_table.shape[2]
    group = hq // hkv
    block_m = _block_m(group * sq)
    m_blocks = -(-(group * sq) // block_m)
    block_d = max(16, next_pow2(d))
    cfg = dict(_default_config(d, q.dtype, k_scale is not None))
    if config:
        cfg.update(config)
    kv_fp8, scale_token, scale_div, kss, vss = _scale_args(k_pages, k_scale, v_scale, page_size, blocked,
                                                           cfg["block_n"])
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, group, opts.span(n_pages * page_size, sq), _sm_count(q.device), sq)
    out, lse, o_dst, l_dst, o_strides, l_strides = split_buffers(q, num_splits, v_pages.shape[-1])
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale, cap_scale, slopes, s_ab, flags = option_args(q, opts, scale)
    s_th = page_table.stride(1) if page_table.shape[1] > 1 else 0
    if blocked:
        max_entry = max(r - 1, 0)
        ks = (k_pages.stride(0), k_pages.stride(1), k_pages.stride(2))
        vs = (v_pages.stride(0), v_pages.stride(1), v_pages.stride(2))
    else:
        max_entry = min(max(r - page_size, 0), _INT32_MAX)
        ks = (k_pages.stride(0), k_pages.stride(0), k_pages.stride(1))
        vs = (v_pages.stride(0), v_pages.stride(0), v_pages.stride(1))
    grid = (b * hkv * m_blocks, num_splits)
    _paged_split_kernel[grid](
        q, _kernel_arg(k_pages, q), _kernel_arg(v_pages, q), page_table, seqlens,
        cache_leftpad if cache_leftpad is not None else seqlens, slopes, o_dst, l_dst,
        q if k_scale is None else _kernel_arg(k_scale, q), q if v_scale is None else _kernel_arg(v_scale, q),
        qk_scale, cap_scale, n_pages, max_entry, hkv, group, sq, d, num_splits, m_blocks,
        max(opts.left, 0), max(opts.right, 0),
        q.stride(0), q.stride(1), q.stride(2),
        *ks, *vs,
        page_table.stride(0), s_th, page_table.stride(2),
        s_ab,
        *o_strides, *l_strides,
        *kss, *vss,
        PAGE=page_size, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, DOT_PREC=prec,
        LEFTPAD=cache_leftpad is not None, KV_FP8=kv_fp8, SCALE_TOKEN=scale_token, SCALE_DIV=scale_div, **flags,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    reduce_splits(o_dst, l_dst, out, lse, num_splits)
    return out, lse
