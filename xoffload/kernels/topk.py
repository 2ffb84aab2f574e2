"""Exact top-k indices per row in one Triton program per row: sparse decode's page selection.

Sparse decode picks, per KV head and step, the ``k`` best of a few thousand page scores
(128K tokens in 32-token pages: 4096). ``torch.topk`` spends ~28 us per call on that
shape on an H200 (a radix select over several passes and launches; 30 layers a step: 0.84 ms of a
10 ms step). Here each row is held in registers and the k-th largest value is found by bisection
on the scores' order-preserving int32 keys (32 passes of compare + count, no sort); the chosen
indices are then written in ascending index order by a prefix sum. Ties at the k-th value go to
the lowest indices, so the result is a deterministic function of the scores (``torch.topk``
breaks ties arbitrarily). NaN counts as larger than every number (as in ``torch.topk``).

Rows longer than :data:`MAX_REGISTER_ROW`, and CPU tensors without the interpreter, run the
reference (:func:`~xoffload.kernels.reference.topk_ids_ref`: one stable sort, the same keys and
tie rule).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FP32_MAX, check_int, check_tensor, fits_fp32, next_pow2, use_triton
from .reference import topk_ids_ref, topk_ids_rows_ref

__all__ = ["MAX_REGISTER_ROW", "topk_ids"]

#: longest row held in one program's registers (16 warps x 32 lanes x 32 values)
MAX_REGISTER_ROW = 16384


@triton.jit(do_not_specialize=["N", "K"])
def _topk_kernel(S, Out, Prefer, KR, N, K, s_sr, s_or, s_pr, bonus, BLOCK_N: tl.constexpr, HAS_PREFER: tl.constexpr,
                 HAS_KR: tl.constexpr):
    """Program r: the K largest of row r's N scores (``+ bonus`` where ``Prefer[r, j] >= 0``),
    their indices ascending into Out[r, :K]; ``HAS_KR``: row r takes ``min(KR[r], K)``."""
    r = tl.program_id(0).to(tl.int64)
    if HAS_KR:
        K = tl.minimum(tl.maximum(tl.load(KR + r), 0), K)
    n = tl.arange(0, BLOCK_N)
    m = n < N
    x = tl.load(S + r * s_sr + n, mask=m, other=0.0).to(tl.float32)
    if HAS_PREFER:
        pf = tl.load(Prefer + r * s_pr + n, mask=m, other=-1)
        x = tl.where(pf >= 0, x + bonus, x)
    b = x.to(tl.int32, bitcast=True)
    key = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)  # float order == signed int order
    key = tl.where(x != x, 2147483647, key)  # every NaN (either sign) above +inf
    # bisection: lo keeps count(key >= lo) >= K, hi keeps count(key >= hi) < K
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483648, tl.int64)
    for _ in range(32):
        mid = lo + ((hi - lo) >> 1)
        cnt = tl.sum((m & (key >= mid)).to(tl.int32), axis=0)
        ok = cnt >= K
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    gt = m & (key > lo)  # strictly above the k-th value: all taken
    n_gt = tl.sum(gt.to(tl.int32), axis=0)
    eq = m & (key == lo)
    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= K - n_gt))  # the lowest-index ties
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(Out + r * s_or + pos, n.to(tl.int32), mask=take)


def topk_ids(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
             prefer: torch.Tensor | None = None, prefer_bonus: float = 0.0,
             k_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest scores of each row, ascending within a row.

    Args:
        scores: ``[R, N]`` fp32 / fp16 / bf16 (last dim contiguous), e.g. one page score per KV
            head (rows) and candidate page.
        k: ``0 <= k <= N``.
        out: optional int32 ``[R, k]`` destination (last dim contiguous), e.g. a CUDA graph's static
            buffer.
        prefer: optional int32 ``[R, >= N]`` (last dim contiguous, on scores' device): entries
            ``j`` with ``prefer[r, j] >= 0`` compete with ``scores[r, j] + prefer_bonus`` (in fp32),
            e.g. the page cache's ``slot_of`` (pages already on the GPU); the scores themselves are
            not changed.
        prefer_bonus: the amount added to preferred entries, finite in fp32.
        k_rows: optional int32 ``[R]`` (on scores' device): row r takes only its
            ``min(k_rows[r], k)`` largest (clamped at 0; a batch of sequences whose plans read
            different page counts), written to its first entries; the rest of the row is left
            as it was. Not read on the host (no synchronisation).
    Returns:
        int32 ``[R, k]``: per row the indices of its ``k`` (or ``k_rows[r]``) largest scores (ties
        at the k-th value: the lowest indices; NaN above every number, -0.0 below +0.0), in
        ascending order.
    Raises:
        TypeError / ValueError: ``scores`` not 2-D floating point, ``k`` outside ``[0, N]``, a bad
        ``out`` or ``prefer``, a ``prefer_bonus`` not finite in fp32.

    Runs on the current stream without host synchronisation (CUDA-graph safe).
    """
    check_tensor("scores", scores, 2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    rows, n = scores.shape
    k = check_int("k", k, 0, n)
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    else:
        check_tensor("out", out, 2, dtypes=(torch.int32,))
        if tuple(out.shape) != (rows, k) or out.device != scores.device:
            raise ValueError(f"out must be int32 [{rows}, {k}] on {scores.device}, got {tuple(out.shape)} on {out.device}")
        if k > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {tuple(out.stride())}")
    if prefer is not None:
        check_tensor("prefer", prefer, 2, dtypes=(torch.int32,))
        if prefer.shape[0] != rows or prefer.shape[1] < n or prefer.device != scores.device:
            raise ValueError(f"prefer must be int32 [{rows}, >= {n}] on {scores.device}, got "
                             f"{tuple(prefer.shape)} on {prefer.device}")
        # finite in fp32, where it is added: a larger one is inf there, and a preferred -inf score
        # (the batched store's padded pages) + inf is NaN, which ranks above every number
        if isinstance(prefer_bonus, bool) or not isinstance(prefer_bonus, (int, float)) \
                or not fits_fp32(prefer_bonus):
            raise ValueError(f"prefer_bonus must be a number finite in fp32 (|bonus| <= {FP32_MAX:.4g}), got "
                             f"{prefer_bonus!r}")
    if k_rows is not None:
        check_tensor("k_rows", k_rows, 1, dtypes=(torch.int32,))
        if k_rows.shape[0] != rows or k_rows.device != scores.device:
            raise ValueError(f"k_rows must be int32 [{rows}] on {scores.device}, got {tuple(k_rows.shape)} on "
                             f"{k_rows.device}")
    if k == 0 or rows == 0:
        return out
    if prefer is not None and (not use_triton(scores) or n > MAX_REGISTER_ROW):  # the bonus, -0.0 kept
        scores = torch.where(prefer[:, :n] >= 0, scores.float() + float(prefer_bonus), scores.float())
    if k_rows is not None and (not use_triton(scores) or n > MAX_REGISTER_ROW):  # per row, on the device
        ids, mask = topk_ids_rows_ref(scores, k, k_rows)
        out.copy_(torch.where(mask, ids, out))
        return out
    if k == n and k_rows is None:
        out.copy_(torch.arange(n, dtype=torch.int32, device=scores.device).expand(rows, n))
        return out
    if not use_triton(scores) or n > MAX_REGISTER_ROW:
        out.copy_(topk_ids_ref(scores, k))
        return out
    block = max(16, next_pow2(n))
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _topk_kernel[(rows,)](scores, out, prefer if prefer is not None else out, k_rows if k_rows is not None else out,
                          n, k, scores.stride(0), out.stride(0), prefer.stride(0) if prefer is not None else 0,
                          float(prefer_bonus), BLOCK_N=block, HAS_PREFER=prefer is not None,
                          HAS_KR=k_rows is not None, num_warps=warps)
    return out
