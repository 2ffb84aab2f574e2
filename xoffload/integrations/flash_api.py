"""flash-attn 2 style entry points backed by xoffload's Triton kernels.

(Over 450 lines on purpose: flash-attn's three entry points with their exact signatures,
argument checks and docstrings, one table of supported options.)

Code written for ``flash_attn`` switches by changing the import::

    from xoffload.integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The argument names, defaults, shapes and return conventions are those of flash-attn 2.x
(``flash_attn/flash_attn_interface.py``): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (GQA when
``Hq % Hkv == 0``), packed varlen ``[total, H, D]`` with int32 ``cu_seqlens`` of length B+1, causal
aligned to the bottom-right corner, ``softmax_lse`` fp32 natural log ``[B, Hq, Sq]`` (varlen
``[Hq, total_q]``).

Differences from flash-attn, all explicit:

* Forward only. Inputs that require grad while grad mode is on raise ``NotImplementedError`` (use
  ``torch.no_grad()`` / ``torch.inference_mode()``).
* Not supported (raise ``NotImplementedError`` naming the option): ``dropout_p > 0`` (which
  options each entry point runs is the table ``_SUPPORTED``). ``deterministic`` is accepted and
  ignored (the forward pass is deterministic); ``return_attn_probs`` returns None as the
  probabilities (as flash-attn does without dropout).
* ``flash_attn_func`` / ``flash_attn_varlen_func`` run ``window_size``, ``softcap`` and
  ``alibi_slopes`` inside the prefill kernel (key tiles outside the window are not read), and
  ``flash_attn_varlen_func`` runs ``block_table``: k/v are then paged caches ``[num_blocks,
  page_size, Hkv, D]`` (any page size that is a multiple of 16; flash-attn 2 wants 256) and
  ``cu_seqlens_k`` gives only the key lengths. flash-attn 2's Python functions have no
  ``seqused_k``; :func:`xoffload.kernels.flash_attn_varlen_with_lse` takes it.
* ``flash_attn_with_kvcache`` runs all of flash-attn's options: ``block_table`` (paged caches
  ``[num_blocks, page_size, Hkv, D]``, any page size that is a multiple of 16, read in place by the
  paged decode kernel), ``k``/``v`` appended in place (also into pages), ``rotary_cos`` /
  ``rotary_sin`` / ``rotary_interleaved``, ``cache_leftpad`` (also with pages), ``cache_batch_idx``,
  ``window_size``, ``softcap``, ``alibi_slopes`` and ``num_splits`` (0 = heuristic), with any
  ``Sq`` (the decode kernels pack the Sq query tokens with the GQA group).
* fp32 inputs are accepted as well as fp16/bf16; CPU tensors run the PyTorch reference (or the
  Triton code under ``TRITON_INTERPRET=1``).
* A query row that sees no key returns output 0 and LSE ``-inf`` (flash-attn returns ``+inf``
  there); ``-inf`` is the log of the empty sum and merges correctly.
* ALiBi under ``causal`` (every entry point): flash-attn's CUDA kernel adds ``slope * j`` (key
  index) where its reference adds ``-slope * |p_i - j|``; both give the same output, we return the
  LSE of the latter, the one that merges exactly with other partial states (flash-attn's
  ``softmax_lse`` is larger by ``slope * p_i``, ``p_i = i + Sk - Sq`` the position of query row i).
* Bad option values raise a one-line ``ValueError`` / ``TypeError`` naming the value: window left
  or right < -1 (or not a pair of ints), softcap < 0 or not finite, alibi_slopes not fp32
  ``[Hq]`` / ``[B, Hq]``, a block table of the wrong shape, dtype or device, a page size that is
  not a multiple of 16, a table entry of a page holding keys outside the cache.
"""
from __future__ import annotations

import torch

from xoffload.kernels.checks import check_bool, check_int, check_lengths, check_same, check_tensor
from xoffload.kernels.decode import decode_options
from xoffload.kernels.rope import check_rotary_tables

from . import ops

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

# The flash-attn options each entry point runs (the others raise NotImplementedError when set to
# anything but their default). Turning an option on for an entry point is adding its name here.
_SUPPORTED = {
    "flash_attn_func": frozenset({"window_size", "softcap", "alibi_slopes"}),
    "flash_attn_varlen_func": frozenset({"window_size", "softcap", "alibi_slopes", "block_table"}),
    "flash_attn_with_kvcache": frozenset({
        "window_size", "softcap", "alibi_slopes", "rotary_cos", "rotary_sin", "cache_leftpad", "block_table",
    }),
}


def _is_default(name, val) -> bool:
    if name == "dropout_p":
        return val is None or float(val) == 0.0
    if name == "window_size":
        return val is not None and tuple(int(x) for x in val) == (-1, -1)
    if name == "softcap":
        return val is None or float(val) == 0.0
    return val is None


_WHY = {
    "dropout_p": "is not supported (xoffload is forward/inference only; use 0.0)",
    "window_size": "(sliding-window / local attention) is not supported here yet; use (-1, -1)",
    "softcap": "is not supported here yet; use 0.0",
}


def _unsupported(fn: str, **options):
    """Raise NotImplementedError naming the first option set to a non-default value that ``fn``
    does not run (see ``_SUPPORTED``)."""
    supported = _SUPPORTED[fn]
    for name, val in options.items():
        if name in supported or _is_default(name, val):
            continue
        shown = f"={val}" if name in _WHY else ""
        why = _WHY.get(name, "is not supported here yet; pass None")
        raise NotImplementedError(f"{fn}: {name}{shown} {why}")


def _softcap(softcap):
    """flash-attn's ``softcap`` with None read as 0.0 (off); other values go to the kernel's check."""
    return 0.0 if softcap is None else softcap


def _prologue(fn: str, causal, tensors, **options) -> bool:
    """The checks every entry point starts with: unsupported options (NotImplementedError), inputs
    requiring grad under grad mode (NotImplementedError), ``causal`` a bool (TypeError: ``bool("False")``
    would be True). Returns ``causal``."""
    _unsupported(fn, **options)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"{fn}: xoffload attention is forward-only (no backward); an input requires grad. "
            "Run under torch.no_grad() or torch.inference_mode(), or detach the inputs"
        )
    return check_bool(f"{fn}: causal", causal)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Dense (optionally causal, GQA) attention, flash-attn 2's ``flash_attn_func``.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32; k, v: ``[B, Sk, Hkv, D]`` (``Hq % Hkv == 0``,
            D <= 256, last dim contiguous).
        dropout_p: must be 0.0 (else NotImplementedError).
        softmax_scale: scale of QK^T before the softmax; default ``1/sqrt(D)``.
        causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + Sk - Sq``).
        window_size: ``(left, right)``, -1 = unlimited: query i at position ``p_i = i + Sk - Sq``
            sees keys ``p_i - left <= j <= p_i + right`` (causal sets right = 0); key tiles outside
            the window are not read.
        softcap: 0 (off) or > 0: scores become ``softcap * tanh(s / softcap)`` (Gemma 2).
        alibi_slopes: None or fp32 ``[Hq]`` / ``[B, Hq]``: ``-slope * |p_i - j|`` added to the
            (capped) score of key j. The LSE returned is that of this formula also under causal,
            where flash-attn's CUDA kernel returns one larger by ``slope * p_i`` (module doc).
        deterministic: ignored (the forward pass is deterministic).
        return_attn_probs: if True return ``(out, softmax_lse, None)`` like flash-attn (which also
            returns None as the third element when dropout is off).

    Returns:
        out ``[B, Sq, Hq, D]`` in q's dtype; with ``return_attn_probs`` also softmax_lse
        ``[B, Hq, Sq]`` fp32 (natural log) and None.

    Raises:
        NotImplementedError: ``dropout_p > 0``, or inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes, devices or ``softmax_scale``; a window value
            < -1, softcap < 0, alibi_slopes of the wrong shape or dtype (from the kernel, naming
            the value).
    """
    causal = _prologue("flash_attn_func", causal, (q, k, v), dropout_p=dropout_p, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = ops.flash_attn(q, k, v, causal, softmax_scale, window_size=window_size, softcap=_softcap(softcap),
                              alibi_slopes=alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Variable-length (packed) attention, flash-attn 2's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths (start at 0, end at total).
        max_seqlen_q, max_seqlen_k: int, the longest sequence in the batch.
        causal: bottom-right aligned per sequence.
        window_size, softcap, alibi_slopes: as :func:`flash_attn_func`, positions bottom-right
            aligned within each sequence (``p_i = i + Sk_b - Sq_b``).
        block_table: None or int32 ``[B, max_blocks]``: k and v are then paged caches
            ``[num_blocks, page_size, Hkv, D]`` (page_size a multiple of 16), key j of sequence b
            is row ``j % page_size`` of block ``block_table[b, j // page_size]``, and
            ``cu_seqlens_k`` gives the key lengths (each at most ``max_blocks * page_size``). The
            entries of the pages holding keys are checked on the host (one sync).
        Other options as :func:`flash_attn_func`.

    Returns:
        out ``[total_q, Hq, D]``; with ``return_attn_probs`` also softmax_lse ``[Hq, total_q]``
        fp32 and None.

    Raises:
        NotImplementedError: ``dropout_p > 0``, or inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes or cu_seqlens; bad option values as
            :func:`flash_attn_func`; a block table of the wrong shape, dtype or device, a page size
            not a multiple of 16, a key length past the table's pages, a used table entry outside
            ``[0, num_blocks)`` (from the kernel, naming the value).
    """
    causal = _prologue("flash_attn_varlen_func", causal, (q, k, v), dropout_p=dropout_p, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table)
    out, lse = ops.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, window_size=window_size, softcap=_softcap(softcap),
                                     alibi_slopes=alibi_slopes, block_table=block_table)
    return (out, lse, None) if return_attn_probs else out


def _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Validate flash_attn_with_kvcache's tensors (shapes/dtypes only: nothing is read on the host).

    Returns ``(seqlens, capacity)``: the int32 ``[B]`` cache_seqlens tensor (``None`` means the
    whole cache is valid) and the number of tokens a sequence can hold (``S_cache``, or
    ``max_blocks * page_size`` with a block table)."""
    check_tensor("q", q, 4)
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    b, sq, hq, d = q.shape
    bc, s_max, hkv, dk = k_cache.shape
    if tuple(v_cache.shape[:3]) != (bc, s_max, hkv):
        dims = "[num_blocks, page_size, nheads_k]" if block_table is not None else "[batch_cache, seqlen_cache, nheads_k]"
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}; {dims} must match")
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} (shape {tuple(k_cache.shape)}) differs from q's {d} (shape {tuple(q.shape)})")
    check_same([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v (new keys/values) or neither")
    if k is not None:
        check_tensor("k", k, 4)
        check_tensor("v", v, 4)
        if tuple(k.shape) != (b, k.shape[1], hkv, d):
            raise ValueError(
                f"k has shape {tuple(k.shape)}; expected [batch={b}, seqlen_new, nheads_k={hkv}, headdim={d}]"
            )
        if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[-1] != v_cache.shape[-1]:
            raise ValueError(f"v has shape {tuple(v.shape)}; expected {tuple(k.shape[:3]) + (v_cache.shape[-1],)}")
        check_same([("q", q), ("k", k), ("v", v)])
        if cache_seqlens is None:
            raise ValueError(
                "flash_attn_with_kvcache: appending k/v needs cache_seqlens (where to write); got None"
            )
    capacity = s_max
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("flash_attn_with_kvcache: a paged cache (block_table) does not take cache_batch_idx "
                             "(as in flash-attn); index the block table's rows instead")
        if s_max < 16 or s_max % 16:
            raise ValueError(f"paged k_cache {tuple(k_cache.shape)} = [num_blocks, page_size, nheads_k, headdim] has "
                             f"page_size {s_max}; it must be a positive multiple of 16")
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            what = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
            raise TypeError(f"block_table must be an int32 tensor [batch, max_blocks], got {what}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape [batch={b}, max_blocks], got {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        capacity = block_table.shape[1] * s_max
    elif cache_batch_idx is not None:
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError("cache_batch_idx must be an int32 tensor of shape [batch]")
        if tuple(cache_batch_idx.shape) != (b,):
            raise ValueError(f"cache_batch_idx has shape {tuple(cache_batch_idx.shape)}, expected ({b},)")
        if cache_batch_idx.device != q.device:
            raise ValueError(f"cache_batch_idx is on {cache_batch_idx.device} but q is on {q.device}")
    elif bc != b:
        raise ValueError(
            f"k_cache has batch {bc} but q has batch {b}; they must match unless cache_batch_idx is given"
        )
    if cache_seqlens is None:
        return None, capacity
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens={cache_seqlens} is outside [0, seqlen_cache={capacity}]")
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device), capacity
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}, expected ({b},)")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    return cache_seqlens, capacity


def _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, capacity):
    """flash-attn's rotary arguments: both tables or neither, new k/v to rotate, tables
    ``[seqlen_ro, rotary_dim / 2]`` covering the cache (``seqlen_ro >= capacity``). Returns
    whether rotary is on."""
    check_bool("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("flash_attn_with_kvcache: pass both rotary_cos and rotary_sin or neither")
    if k is None:
        raise ValueError("flash_attn_with_kvcache: rotary_cos/rotary_sin rotate the new k, so k and v must be given")
    check_rotary_tables(rotary_cos, rotary_sin, q.shape[-1], q.device)
    if rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions (shape {tuple(rotary_cos.shape)}) "
                         f"but the cache holds {capacity} tokens; the tables must cover the cache (as in flash-attn)")
    return True


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention against a pre-allocated KV cache, flash-attn 2's ``flash_attn_with_kvcache``.

    If ``k``/``v`` are given they are first written **in place** into ``k_cache``/``v_cache`` at
    positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of sequence b (cache row
    ``cache_batch_idx[b]``, default b; or, with ``block_table``, the pages it lists); then q attends
    to the first ``n = cache_seqlens[b] + seqlen_new`` cached tokens, query row i at position
    ``n - Sq + i``. ``cache_seqlens`` itself is not modified (as in flash-attn).

    Args:
        q: ``[B, Sq, Hq, D]``, any ``Sq >= 1``.
        k_cache, v_cache: ``[B_cache, S_cache, Hkv, D]``, or with ``block_table`` paged caches
            ``[num_blocks, page_size, Hkv, D]`` (page_size a multiple of 16: 16, 256, 1024, ...),
            last dim contiguous, same dtype as q.
        k, v: optional ``[B, seqlen_new, Hkv, D]`` new tokens to append.
        rotary_cos, rotary_sin: optional ``[seqlen_ro, rotary_dim / 2]`` tables (``rotary_dim <=
            D``, ``seqlen_ro`` >= the cache's capacity; needs k/v): the new k are rotated at
            positions ``cache_seqlens[b] + i`` before the append; q too, at the same positions when
            causal or local, else every q token at ``cache_seqlens[b]`` (flash-attn's convention).
        cache_seqlens: int, or int32 ``[B]``: tokens already in the cache. None = the whole cache
            (not allowed together with ``k``/``v``).
        cache_batch_idx: optional int32 ``[B]``: cache row of each batch item (not with
            ``block_table``).
        cache_leftpad: optional int32 ``[B]``: keys before ``cache_leftpad[b]`` are not attended.
        block_table: optional int32 ``[B, max_blocks]``: the cache blocks of sequence b in order
            (token t in block ``block_table[b, t // page_size]``, row ``t % page_size``).
        softmax_scale: default ``1/sqrt(D)``.
        causal: bottom-right aligned over the n keys (for ``Sq == 1`` it changes nothing).
        window_size: ``(left, right)``, -1 = unlimited: row i sees keys ``pos_i - left ..
            pos_i + right`` (right = 0 with causal); keys outside every row's window are not read.
        softcap: 0 or > 0: ``softcap * tanh(s / softcap)`` on the scaled scores.
        rotary_interleaved: GPT-J layout (pairs ``2i, 2i+1``) if True, else GPT-NeoX (``i, i + R/2``).
        alibi_slopes: optional fp32 ``[Hq]`` or ``[B, Hq]``: ``-slope * |pos_i - j|`` added to the
            score of key j.
        num_splits: 0 = heuristic (from shapes only), else the number of key splits per sequence.
        return_softmax_lse: also return softmax_lse ``[B, Hq, Sq]`` fp32.

    Returns:
        out ``[B, Sq, Hq, D]`` in q's dtype, or ``(out, softmax_lse)``.

    Device syncs: every call that runs the decode kernels (``Sq == 1``; a paged cache; window,
    softcap, ALiBi or left padding; any Sq) runs entirely on the device (rotary + append + split-KV
    decode) and can be captured in a CUDA graph; the host validation of the per-sequence values
    (lengths, batch indices, left pads, visited block-table entries) is skipped while a graph is
    being captured or ``torch.compile`` traces. A contiguous cache with ``Sq > 1`` and none of those
    options reads ``cache_seqlens`` on the host (one sync) and runs the dense kernel on each item's
    cache prefix.

    Raises:
        NotImplementedError: inputs requiring grad under grad mode.
        TypeError / ValueError: bad dtypes, shapes, devices, cache lengths past the cache or the
            block table, block-table entries outside the cache, a page size that is not a
            multiple of 16, a window value < -1, softcap < 0, alibi_slopes of the wrong shape,
            rotary tables of the wrong shape or too short (each error names the value).
    """
    fn = "flash_attn_with_kvcache"
    causal = _prologue(fn, causal, (q, k_cache, v_cache, k, v), window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       cache_leftpad=cache_leftpad, block_table=block_table)
    seqlens, capacity = _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    opts = decode_options(q, causal, window_size, softcap, alibi_slopes)
    rotary = _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, capacity)
    if cache_leftpad is not None:
        check_lengths("cache_leftpad", cache_leftpad, q.shape[0], q.device)
    num_splits = check_int("num_splits", num_splits, 0) or None
    b, sq = q.shape[:2]
    paged = block_table is not None
    s_new = 0 if k is None else k.shape[1]
    # the decode kernels take every option and any Sq; the dense kernel (per item, host lengths)
    # stays the path of a contiguous cache with several query tokens and no option
    kernel = sq == 1 or paged or cache_leftpad is not None or opts.has_left or opts.softcap > 0 \
        or opts.alibi is not None or (opts.right >= 0 and not causal)
    lens = rows = None
    if not kernel or not (torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        # validate before writing anything (small host reads); skipped while compiling / capturing
        lens, rows = _host_lengths(k_cache, seqlens, s_new, cache_batch_idx, b, capacity, paged)
        _host_checks(k_cache, lens, cache_leftpad, block_table)
    if seqlens is None:
        seqlens = torch.full((b,), capacity, dtype=torch.int32, device=q.device)
    if rotary:
        # flash-attn: q rotated at its own positions when causal or local, else all at cache_seqlens
        cap = capacity
        local = (0 <= opts.left < cap) or (0 <= int(window_size[1]) < cap)
        q = ops.rotary(q, rotary_cos, rotary_sin, seqlens, rotary_interleaved, not (causal or local))
        k = ops.rotary(k, rotary_cos, rotary_sin, seqlens, rotary_interleaved, False)
    if k is not None:
        ops.kvcache_append(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table)
    total = seqlens + s_new if s_new else seqlens
    if not kernel:
        out, lse = _kvcache_general(q, k_cache, v_cache, lens, rows, causal, softmax_scale)
        return (out, lse) if return_softmax_lse else out
    kw = dict(causal=causal, window_size=(opts.left, int(window_size[1])), softcap=opts.softcap,
              alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad, num_splits=num_splits)
    if paged:
        out, lse = ops.paged_decode_attn(q, k_cache, v_cache, block_table[:, None, :], total, softmax_scale,
                                         check=False, **kw)
    else:
        bidx = None if cache_batch_idx is None else cache_batch_idx.to(torch.int32)
        out, lse = ops.decode_attn(q, k_cache, v_cache, total, softmax_scale, check=False, cache_batch_idx=bidx, **kw)
    return (out, lse) if return_softmax_lse else out


def _host_lengths(k_cache, seqlens, s_new, cache_batch_idx, b, capacity, paged=False):
    """Per item (keys after the append, cache row), read on the host and range-checked."""
    bc = k_cache.shape[0]
    base = [capacity] * b if seqlens is None else seqlens.tolist()
    rows = list(range(b)) if cache_batch_idx is None else cache_batch_idx.tolist()
    lens = []
    for i, (n, r) in enumerate(zip(base, rows)):
        if n < 0 or n + s_new > capacity:
            where = "the block table's capacity max_blocks * page_size" if paged else "seqlen_cache"
            raise ValueError(
                f"cache_seqlens[{i}] = {n} must be >= 0 and, plus seqlen_new = {s_new}, at most "
                f"{where} = {capacity}"
            )
        if not 0 <= r < bc:
            raise ValueError(f"cache_batch_idx[{i}] = {r} is outside [0, batch_cache={bc})")
        lens.append(n + s_new)
    return lens, rows


def _host_checks(k_cache, lens, cache_leftpad, block_table):
    """Host checks of the values the kernels would otherwise clamp: left pads in ``[0, n]``, the
    block-table entries of the visited pages in ``[0, num_blocks)``."""
    if cache_leftpad is not None:
        for i, (p, n) in enumerate(zip(cache_leftpad.tolist(), lens)):
            if not 0 <= p <= n:
                raise ValueError(f"cache_leftpad[{i}] = {p} must be in [0, {n}] (the sequence's keys after the append)")
    if block_table is not None:
        page, nb = k_cache.shape[1], k_cache.shape[0]
        tab = block_table.cpu()
        for i, n in enumerate(lens):
            used = tab[i, :-(-n // page)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
                j = int(((used < 0) | (used >= nb)).nonzero()[0, 0])
                raise ValueError(f"block_table[{i}, {j}] = {int(used[j])} points outside the paged cache "
                                 f"(num_blocks = {nb}, k_cache {tuple(k_cache.shape)})")


def _kvcache_general(q, k_cache, v_cache, lens, rows, causal, softmax_scale):
    """Sq >= 1 against per-item cache prefixes (lengths already on the host): one dense call per item."""
    b, sq, hq, _ = q.shape
    out = torch.empty(b, sq, hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for i, (n, r) in enumerate(zip(lens, rows)):
        o_i, l_i = ops.flash_attn(q[i : i + 1], k_cache[r : r + 1, :n], v_cache[r : r + 1, :n], causal, softmax_scale)
        out[i : i + 1] = o_i
        lse[i : i + 1] = l_i
    return out, lse
