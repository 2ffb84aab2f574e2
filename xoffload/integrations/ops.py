"""xoffload kernels as ``torch.library`` custom ops, so they survive ``torch.compile`` and CUDA graphs.

Registered ops (namespace ``xoffload``, callable as ``torch.ops.xoffload.<name>``):

==========================================  =====================================================
``flash_attn_with_lse(q, k, v, causal,      q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` ->
softmax_scale, window_left=-1,              (out ``[B, Sq, Hq, Dv]`` in q's dtype,
window_right=-1, softcap=0.0,               lse ``[B, Hq, Sq]`` fp32); the options of
alibi_slopes=None, block_table=None,        :func:`xoffload.kernels.flash_attn_with_lse` (window
seqused_k=None)``                           as two ints; paged k/v with ``block_table``); runs
                                            with ``check=False`` (no host reads)
``flash_attn_varlen_with_lse(q, k, v,       packed q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, int32
cu_seqlens_q, cu_seqlens_k, max_seqlen_q,   ``cu_seqlens_*`` ``[B+1]`` -> (out ``[Tq, Hq, Dv]``,
max_seqlen_k, causal, softmax_scale,        lse ``[Hq, Tq]`` fp32); the same options
window_left=-1, ..., seqused_k=None)``
``decode_attn_with_lse(q, k_cache,          q ``[B, Sq, Hq, D]``, caches ``[B_cache, S_max, Hkv,
v_cache, cache_seqlens, softmax_scale,      D]``, int32 ``cache_seqlens [B]`` -> (out ``[B, Sq,
causal=False, window_left=-1,               Hq, Dv]``, lse ``[B, Hq, Sq]`` fp32); the options of
window_right=-1, softcap=0.0,               :func:`xoffload.kernels.decode_attn_with_lse`
alibi_slopes=None, cache_leftpad=None,      (window as two ints). Never reads the lengths on
cache_batch_idx=None, num_splits=None)``    the host (CUDA-graph safe).
``paged_decode_attn_with_lse(q, k_pages,    q ``[B, Sq, Hq, D]``, row store ``[R, Hkv, D]`` or
v_pages, page_table, seqlens, page_size,    block store ``[num_blocks, page, Hkv, D]``, int32
softmax_scale, causal=False, ...,           ``page_table [B, 1 or Hkv, P]``, ``seqlens [B]`` ->
num_splits=None)``                          (out, lse) as above; same options (no batch index)
``rotary_emb(x, cos, sin, seqlen_offsets,   flash-attn's rotary embedding of x ``[B, S, H, D]``
interleaved, same_position)``               with tables ``[N, R/2]`` at int32 ``[B]`` start
                                            positions -> rotated copy of x
``merge_attention_states(o_a, lse_a, o_b,   o ``[..., S, H, D]``, lse ``[..., H, S]`` fp32 of any
lse_b)``                                    strides (e.g. ``[S, H].t()``) -> merged (o, lse
                                            contiguous), exact by LSE
``kvcache_append_(k_cache!, v_cache!, k,    writes k/v ``[B, S_new, Hkv, D]`` into the caches at
v, cache_seqlens, cache_batch_idx,          rows ``cache_batch_idx`` (or 0..B-1), positions
block_table=None)``                         ``cache_seqlens[b] + i``; with ``block_table`` int32
                                            ``[B, max_blocks]`` into a paged cache ``[num_blocks,
                                            page, Hkv, D]`` (block ``block_table[b, pos // page]``,
                                            row ``pos % page``); in place, returns nothing
==========================================  =====================================================

Each op has a fake (meta) implementation giving output shapes/dtypes without running a kernel, so
``torch.compile(fullgraph=True)`` traces through it (the kernel is opaque to Dynamo/Inductor) and
``torch.library.opcheck`` passes. Outputs are freshly allocated contiguous tensors (never views of
the inputs). The ops are forward-only (no autograd formula): calling them on tensors that require
grad and then calling ``backward`` raises.

The Python helpers at the bottom (:func:`flash_attn`, :func:`flash_attn_varlen`, :func:`decode_attn`,
:func:`paged_decode_attn`, :func:`rotary`, :func:`merge`, :func:`kvcache_append`) call the kernels directly in eager mode (no dispatcher
overhead) and the custom ops while ``torch.compile`` traces; the rest of
:mod:`xoffload.integrations` uses them.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

import xoffload.kernels as _K

__all__ = [
    "flash_attn",
    "flash_attn_varlen",
    "decode_attn",
    "paged_decode_attn",
    "rotary",
    "merge",
    "kvcache_append",
    "OP_NAMES",
]

OP_NAMES = (
    "flash_attn_with_lse",
    "flash_attn_varlen_with_lse",
    "decode_attn_with_lse",
    "paged_decode_attn_with_lse",
    "rotary_emb",
    "merge_attention_states",
    "kvcache_append_",
)
MUTATING_OPS = ("kvcache_append_",)


def _fresh(t: Tensor, inputs) -> Tensor:
    """``t`` as a contiguous tensor that shares no storage with any of ``inputs`` (custom-op rule)."""
    if not t.is_contiguous():
        return t.contiguous()
    if t.numel() > 0:
        ptr = t.untyped_storage().data_ptr()
        for x in inputs:
            if isinstance(x, Tensor) and x.numel() > 0 and x.untyped_storage().data_ptr() == ptr:
                return t.clone()
    return t


def _decode_kernel(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal=False, window_left=-1, window_right=-1,
                   softcap=0.0, alibi_slopes=None, cache_leftpad=None, cache_batch_idx=None, num_splits=None):
    """The decode kernel without host-side validation of the per-sequence tensors (no device sync)."""
    return _K.decode_attn_with_lse(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale, check=False,
                                   causal=causal, window_size=(window_left, window_right), softcap=softcap,
                                   alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad,
                                   cache_batch_idx=cache_batch_idx, num_splits=num_splits)


def _paged_kernel(q, k_pages, v_pages, page_table, seqlens, page_size, softmax_scale, causal=False, window_left=-1,
                  window_right=-1, softcap=0.0, alibi_slopes=None, cache_leftpad=None, num_splits=None):
    """The paged decode kernel without host-side validation (no device sync)."""
    return _K.paged_decode_attn_with_lse(q, k_pages, v_pages, page_table, seqlens, page_size=page_size,
                                         softmax_scale=softmax_scale, check=False, causal=causal,
                                         window_size=(window_left, window_right), softcap=softcap,
                                         alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad,
                                         num_splits=num_splits)


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------
def _prefill_kwargs(window_left, window_right, softcap, alibi_slopes, block_table, seqused_k):
    """The prefill kernels' option keywords from the ops' flat arguments (host checks off: the
    kernel clamps lengths and table entries, so nothing syncs with the device)."""
    return dict(window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                block_table=block_table, seqused_k=seqused_k, check=False)


@torch.library.custom_op("xoffload::flash_attn_with_lse", mutates_args=())
def _flash_attn_with_lse_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    out, lse = _K.flash_attn_with_lse(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      **_prefill_kwargs(window_left, window_right, softcap, alibi_slopes,
                                                        block_table, seqused_k))
    return _fresh(out, (q, k, v)), _fresh(lse, (q, k, v))


@_flash_attn_with_lse_op.register_fake
def _(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      block_table=None, seqused_k=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("xoffload::flash_attn_varlen_with_lse", mutates_args=())
def _flash_attn_varlen_with_lse_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    kw = _prefill_kwargs(window_left, window_right, softcap, alibi_slopes, block_table, seqused_k)
    # unpaged without seqused_k the kernel trusts cu_seqlens / max_seqlen (check=False reads
    # nothing): a user's values are checked on the host here, except under CUDA-graph capture
    kw["check"] = block_table is None and seqused_k is None and not _capturing(q)
    out, lse = _K.flash_attn_varlen_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        **kw,
    )
    ins = (q, k, v)
    return _fresh(out, ins), _fresh(lse, ins)


@_flash_attn_varlen_with_lse_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None, block_table=None, seqused_k=None):
    t, hq, _ = q.shape
    return q.new_empty((t, hq, v.shape[-1])), q.new_empty((hq, t), dtype=torch.float32)


@torch.library.custom_op("xoffload::decode_attn_with_lse", mutates_args=())
def _decode_attn_with_lse_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: Optional[float],
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    cache_batch_idx: Optional[Tensor] = None,
    num_splits: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    out, lse = _decode_kernel(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, window_left, window_right,
                              softcap, alibi_slopes, cache_leftpad, cache_batch_idx, num_splits)
    ins = (q, k_cache, v_cache)
    return _fresh(out, ins), _fresh(lse, ins)


@_decode_attn_with_lse_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, cache_leftpad=None, cache_batch_idx=None, num_splits=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("xoffload::paged_decode_attn_with_lse", mutates_args=())
def _paged_decode_attn_with_lse_op(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    seqlens: Tensor,
    page_size: Optional[int],
    softmax_scale: Optional[float],
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    num_splits: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    out, lse = _paged_kernel(q, k_pages, v_pages, page_table, seqlens, page_size, softmax_scale, causal, window_left,
                             window_right, softcap, alibi_slopes, cache_leftpad, num_splits)
    ins = (q, k_pages, v_pages)
    return _fresh(out, ins), _fresh(lse, ins)


@_paged_decode_attn_with_lse_op.register_fake
def _(q, k_pages, v_pages, page_table, seqlens, page_size, softmax_scale, causal=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None, cache_leftpad=None, num_splits=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_pages.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("xoffload::rotary_emb", mutates_args=())
def _rotary_emb_op(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Tensor, interleaved: bool,
                   same_position: bool) -> Tensor:
    return _K.apply_rotary(x, cos, sin, seqlen_offsets, interleaved=interleaved, same_position=same_position)


@_rotary_emb_op.register_fake
def _(x, cos, sin, seqlen_offsets, interleaved, same_position):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("xoffload::merge_attention_states", mutates_args=())
def _merge_attention_states_op(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    o, lse = _K.merge_attention_states(o_a, lse_a, o_b, lse_b)
    ins = (o_a, lse_a, o_b, lse_b)
    return _fresh(o, ins), _fresh(lse, ins)


@_merge_attention_states_op.register_fake
def _(o_a, lse_a, o_b, lse_b):
    return o_a.new_empty(o_a.shape), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


@torch.library.custom_op("xoffload::kvcache_append_", mutates_args=("k_cache", "v_cache"))
def _kvcache_append_op(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    cache_seqlens: Tensor,
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor] = None,
) -> None:
    _append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)


@_kvcache_append_op.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table=None):
    return None


def _append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table=None):
    """Device-side scatter (no host read): ``cache[row_b, cache_seqlens[b] + i] = new[b, i]``, or
    for a paged cache ``cache[block_table[b, p // page], p % page] = new[b, i]`` with
    ``p = cache_seqlens[b] + i``."""
    b, s_new = k.shape[:2]
    if b == 0 or s_new == 0:
        return
    dev = k_cache.device
    pos = cache_seqlens.to(device=dev, dtype=torch.long)[:, None] + torch.arange(s_new, device=dev)[None, :]
    if block_table is not None:
        page = k_cache.shape[1]
        # a negative position or block id would wrap around (Python indexing): send it past the end
        # instead, so it fails like any other out-of-range index (an error on the CPU, a device
        # assert on CUDA)
        pos = torch.where(pos < 0, block_table.shape[1] * page, pos)
        blk = torch.gather(block_table.to(device=dev, dtype=torch.long), 1, pos // page)
        blk = torch.where(blk < 0, k_cache.shape[0], blk)
        off = pos % page
        k_cache[blk, off] = k.to(k_cache.dtype)
        v_cache[blk, off] = v.to(v_cache.dtype)
        return
    # a negative position would wrap around (Python indexing): send it past the end instead, so it
    # fails like any other out-of-range position (IndexError on the CPU, device assert on CUDA)
    pos = torch.where(pos < 0, k_cache.shape[1], pos)
    if cache_batch_idx is None:
        rows = torch.arange(b, device=dev)[:, None]
    else:
        rows = cache_batch_idx.to(device=dev, dtype=torch.long)[:, None]
    k_cache[rows, pos] = k.to(k_cache.dtype)
    v_cache[rows, pos] = v.to(v_cache.dtype)


# ----------------------------------------------------------------------------------------------
# helpers used by the rest of xoffload.integrations: direct kernel call in eager, op under compile
# ----------------------------------------------------------------------------------------------
def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _window_ints(window_size):
    """``(left, right)`` as ints for the ops' schema (a malformed value is passed through for the
    kernel's own check to name it)."""
    try:
        return int(window_size[0]), int(window_size[1])
    except (TypeError, IndexError, ValueError):
        return window_size


def flash_attn(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], *,
               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, block_table=None, seqused_k=None,
               check: bool = True):
    """Dense attention with LSE (:func:`xoffload.kernels.flash_attn_with_lse`, all its options:
    window, softcap, ALiBi, paged K/V through ``block_table``, ``seqused_k``); compile-safe.
    ``check=False`` (forced while compiling or capturing a CUDA graph) skips the host validation of
    ``seqused_k`` and the block table's entries (the kernel clamps them instead)."""
    if _compiling():
        wl, wr = _window_ints(window_size)
        return torch.ops.xoffload.flash_attn_with_lse(q, k, v, causal, softmax_scale, wl, wr, float(softcap),
                                                       alibi_slopes, block_table, seqused_k)
    return _K.flash_attn_with_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
                                  seqused_k=seqused_k, check=check and not _capturing(q))


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, *,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, block_table=None, seqused_k=None,
                      check: bool = True):
    """Varlen attention with LSE (:func:`xoffload.kernels.flash_attn_varlen_with_lse`, all its
    options); compile-safe (``check`` as :func:`flash_attn`)."""
    if _compiling():
        wl, wr = _window_ints(window_size)
        return torch.ops.xoffload.flash_attn_varlen_with_lse(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, softmax_scale,
            wl, wr, float(softcap), alibi_slopes, block_table, seqused_k,
        )
    return _K.flash_attn_varlen_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
        seqused_k=seqused_k, check=check and not _capturing(q),
    )


def decode_attn(q, k_cache, v_cache, cache_seqlens, softmax_scale, check: bool = True, *, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, cache_leftpad=None, cache_batch_idx=None,
                num_splits=None):
    """Decode attention with LSE (:func:`xoffload.kernels.decode_attn_with_lse`, all its options);
    compile- and CUDA-graph-safe. ``check=False`` (forced while compiling or capturing a CUDA graph)
    skips the host-side validation of the per-sequence tensors' values, so nothing syncs with the
    device."""
    wl, wr = int(window_size[0]), int(window_size[1])
    if _compiling():
        return torch.ops.xoffload.decode_attn_with_lse(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, wl,
                                                        wr, float(softcap), alibi_slopes, cache_leftpad,
                                                        cache_batch_idx, num_splits)
    if check and not _capturing(q):
        return _K.decode_attn_with_lse(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                                       window_size=(wl, wr), softcap=softcap, alibi_slopes=alibi_slopes,
                                       cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                                       num_splits=num_splits)
    return _decode_kernel(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, wl, wr, softcap, alibi_slopes,
                          cache_leftpad, cache_batch_idx, num_splits)


def paged_decode_attn(q, k_pages, v_pages, page_table, seqlens, softmax_scale, check: bool = True, *, page_size=None,
                      causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, cache_leftpad=None,
                      num_splits=None):
    """Paged decode attention with LSE (:func:`xoffload.kernels.paged_decode_attn_with_lse`, all
    its options); compile- and CUDA-graph-safe (``check`` as :func:`decode_attn`)."""
    wl, wr = int(window_size[0]), int(window_size[1])
    if _compiling():
        return torch.ops.xoffload.paged_decode_attn_with_lse(q, k_pages, v_pages, page_table, seqlens, page_size,
                                                              softmax_scale, causal, wl, wr, float(softcap),
                                                              alibi_slopes, cache_leftpad, num_splits)
    if check and not _capturing(q):
        return _K.paged_decode_attn_with_lse(q, k_pages, v_pages, page_table, seqlens, page_size=page_size,
                                             softmax_scale=softmax_scale, causal=causal, window_size=(wl, wr),
                                             softcap=softcap, alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad,
                                             num_splits=num_splits)
    return _paged_kernel(q, k_pages, v_pages, page_table, seqlens, page_size, softmax_scale, causal, wl, wr, softcap,
                         alibi_slopes, cache_leftpad, num_splits)


def rotary(x, cos, sin, seqlen_offsets, interleaved: bool, same_position: bool = False):
    """flash-attn's rotary embedding (:func:`xoffload.kernels.rope.apply_rotary`) into a new tensor;
    compile-safe (``seqlen_offsets`` an int32 ``[B]`` tensor, read on the device)."""
    if _compiling():
        return torch.ops.xoffload.rotary_emb(x, cos, sin, seqlen_offsets, interleaved, same_position)
    return _K.apply_rotary(x, cos, sin, seqlen_offsets, interleaved=interleaved, same_position=same_position)


def merge(o_a, lse_a, o_b, lse_b):
    """Two-way LSE merge (:func:`xoffload.kernels.merge_attention_states`): o ``[..., S, H, D]``,
    fp32 LSEs ``[..., H, S]`` of any strides -> (o, lse ``[..., H, S]``); compile-safe. Raises
    TypeError / ValueError as the kernel."""
    if _compiling():
        return torch.ops.xoffload.merge_attention_states(o_a, lse_a, o_b, lse_b)
    return _K.merge_attention_states(o_a, lse_a, o_b, lse_b)


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None) -> None:
    """Write ``k``/``v`` ``[B, S_new, Hkv, D]`` into the caches in place at ``cache_seqlens`` (no
    host sync), contiguous ``[B_cache, S, Hkv, D]`` caches (rows ``cache_batch_idx``) or paged
    ``[num_blocks, page, Hkv, D]`` ones through ``block_table`` int32 ``[B, max_blocks]``; compile-
    and CUDA-graph-safe. Out-of-range positions or blocks raise an IndexError / RuntimeError on the
    CPU and a device-side assert on CUDA."""
    if _compiling():
        torch.ops.xoffload.kvcache_append_(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    else:
        _append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
