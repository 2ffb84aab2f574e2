"""XAttention sparse prefill: estimate block importance, select blocks, run block-sparse attention.

XAttention (Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal Scoring"):

1. :func:`xoffload.kernels.xattn_estimate` scores every ``block_size x block_size`` block by
   strided antidiagonal sums (stride S) and a per-row softmax;
2. :func:`xoffload.sparse.select.select_blocks` keeps, per (batch, query head, query block), the sink
   and diagonal blocks plus the highest-scoring blocks until a fraction ``threshold`` of the row's
   mass is covered;
3. :func:`xoffload.kernels.block_sparse_attn_with_lse` computes attention over the kept blocks.

Layerwise prefill holds the whole layer's K/V on the GPU, so all three steps run there.
"""
from __future__ import annotations

import torch

from ..kernels.block_sparse import block_sparse_attn_with_lse
from ..kernels.checks import check_qkv, is_int
from ..kernels.flash_attn import flash_attn_with_lse
from ..kernels.xattn import check_geometry, xattn_estimate
from .select import causal_block_visibility, mask_density, select_blocks, thresholds

__all__ = ["xattention_prefill", "xattention_mask", "dense_query_blocks", "dense_rows", "DEFAULT_DENSE_FALLBACK_LEN",
           "DEFAULT_DENSE_LAST_Q"]

#: key lengths up to this many tokens run dense attention (estimation would cost more than it saves)
DEFAULT_DENSE_FALLBACK_LEN = 1024

#: ``dense_last_q`` default: None = ``block_size`` rows (the query blocks holding the last
#: ``block_size`` rows attend to every visible key block)
DEFAULT_DENSE_LAST_Q = None


def _check_inputs(q, k, v):
    check_qkv(q, k, v, 4, "[B, S, H, D]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch")


def dense_rows(dense_last_q, block_size) -> int:
    """``dense_last_q`` validated and resolved to a row count (None -> ``block_size``)."""
    if dense_last_q is None:
        return int(block_size)
    if not is_int(dense_last_q):
        raise TypeError(f"dense_last_q must be None or an int (query rows), got {type(dense_last_q).__name__}")
    if dense_last_q < 0:
        raise ValueError(f"dense_last_q must be >= 0, got {dense_last_q}")
    return dense_last_q


def dense_query_blocks(sq, dense_last_q, block_size):
    """Index of the first query block made dense by ``dense_last_q`` (``ceil(sq/bs)`` when none).

    The query blocks holding any of the last ``dense_last_q`` rows (of ``sq``) are dense, so at least
    ``min(dense_last_q, sq)`` rows (whole blocks, up to ``dense_last_q + block_size - 1``) are.
    """
    nqb = -(-sq // block_size)
    if dense_last_q <= 0 or sq <= 0:
        return nqb
    return max(0, sq - dense_last_q) // block_size


def xattention_mask(q, k, *, threshold=0.9, stride=8, block_size=128, chunk_size=None, causal=True,
                    keep_last=0, dense_last_q=DEFAULT_DENSE_LAST_Q, softmax_scale=None):
    """Block mask XAttention keeps for ``q`` against ``k`` (bottom-right aligned: ``q_start = Sk - Sq``).

    Returns bool ``[B, Hq, ceil(Sq/bs), ceil(Sk/bs)]``. Arguments as :func:`xattention_prefill`;
    ``dense_last_q=0`` gives the plain selection of :func:`xoffload.sparse.select.select_blocks`.
    """
    n_dense = dense_rows(dense_last_q, block_size)
    sq, sk = q.shape[1], k.shape[1]
    scores = xattn_estimate(q, k, stride=stride, block_size=block_size, chunk_size=chunk_size,
                            q_start=sk - sq, causal=causal, softmax_scale=softmax_scale)
    mask = select_blocks(scores, threshold, sq=sq, sk=sk, block_size=block_size, q_start=sk - sq,
                         causal=causal, keep_last=keep_last)
    qb0 = dense_query_blocks(sq, n_dense, block_size)
    if qb0 < mask.shape[2]:
        vis = causal_block_visibility(sq, sk, block_size, q_start=sk - sq, causal=causal, device=mask.device)
        mask[:, :, qb0:] |= vis[qb0:]
    return mask


def xattention_prefill(q, k, v, *, threshold=0.9, stride=8, block_size=128, chunk_size=None, q_start=None,
                       dense_fallback_len=DEFAULT_DENSE_FALLBACK_LEN, causal=True, keep_last=0,
                       dense_last_q=DEFAULT_DENSE_LAST_Q, softmax_scale=None):
    """Sparse prefill attention (XAttention) returning ``(out, lse, density)``.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16 (fp32 accepted), last dim contiguous.
        k, v: ``[B, Sk, Hkv, D]``, same dtype/device, ``Hq % Hkv == 0`` (GQA, never repeated).
        threshold: tau in [0, 1], float or per-query-head tensor ``[Hq]``; 1 = dense.
        stride: antidiagonal stride S (4, 8 or 16; a power of two dividing ``block_size``).
        block_size: attention block size (power of two >= 16; 128 for speed).
        chunk_size: estimate K in chunks of this many keys (multiple of ``block_size``); the mask
            does not depend on it.
        q_start: absolute position of ``q[:, 0]``; default ``Sk - Sq``. Keys past the last query
            position (``q_start + Sq``) cannot be seen under causal and are ignored; requires
            ``0 <= q_start <= Sk - Sq``.
        dense_fallback_len: if ``Sk <= dense_fallback_len`` (after the ``q_start`` cut) dense
            attention runs instead (density 1).
        causal: causal prefill (bottom-right aligned); False attends to all keys.
        keep_last: also keep the ``keep_last`` key blocks ending at each diagonal.
        dense_last_q: the query blocks holding the last ``dense_last_q`` query rows attend to every
            causally visible key block (dense rows). None (default) = ``block_size`` rows; 0 = off
            (the plain XAttention selection).
            Generation reads the prompt's last rows: the final row gives the first token's logits
            and the trailing rows (the question) are what later tokens attend to, while the
            estimate scores whole blocks of rows, in which a few question rows weigh little. Cost:
            each dense query block visits every key block, about ``2 / ceil(Sq/block_size)`` of
            dense causal attention (0.2% at 128K tokens); its blocks count in ``density``.
        softmax_scale: default ``1/sqrt(D)``.

    Returns:
        ``(out, lse, density)``: out ``[B, Sq, Hq, D]`` in q's dtype; lse fp32 ``[B, Hq, Sq]``
        (natural log); density fp32 tensor ``[Hq]`` on q's device: kept fraction of the causally
        visible blocks per query head, averaged over the batch (all ones on the dense path; use
        ``float(density.mean())`` for one number).

    Raises:
        TypeError / ValueError: bad tensors or dtypes, shapes, GQA ratio, stride not dividing
            block_size, threshold outside [0, 1] or of the wrong length, bad chunk_size or q_start,
            dense_last_q not None or an int >= 0.
    """
    _check_inputs(q, k, v)
    dense_rows(dense_last_q, 1)
    check_geometry(stride, block_size)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not is_int(dense_fallback_len) or dense_fallback_len < 0:
        raise ValueError(f"dense_fallback_len must be an int >= 0, got {dense_fallback_len!r}")
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if q_start is not None:
        if not is_int(q_start):
            raise TypeError(f"q_start must be an int, got {type(q_start).__name__}")
        if q_start < 0 or q_start + sq > sk:
            raise ValueError(f"q_start={q_start} with Sq={sq} needs 0 <= q_start <= Sk - Sq = {sk - sq}")
        if causal and q_start + sq < sk:
            k = k[:, : q_start + sq]
            v = v[:, : q_start + sq]
            sk = q_start + sq
    # validate threshold before choosing a path (select_blocks re-checks)
    thresholds(threshold, hq, q.device)
    if sk <= dense_fallback_len:
        out, lse = flash_attn_with_lse(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out, lse, torch.ones(hq, dtype=torch.float32, device=q.device)
    mask = xattention_mask(q, k, threshold=threshold, stride=stride, block_size=block_size,
                           chunk_size=chunk_size, causal=causal, keep_last=keep_last,
                           dense_last_q=dense_last_q, softmax_scale=softmax_scale)
    out, lse = block_sparse_attn_with_lse(q, k, v, mask, block_size=block_size, causal=causal,
                                          softmax_scale=softmax_scale)
    density = mask_density(mask, sq, sk, block_size, causal=causal)
    return out, lse, density
