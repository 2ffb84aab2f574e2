"""Quest page scores in one kernel: the upper bound of ``q·k`` over each page from its elementwise
key minima and maxima, maximised over the query heads of each KV head's GQA group (Tang et al.
2024, "Quest"; the group maximum makes one selection per KV head serve every head of the group).

For page summaries ``m`` (min) and ``M`` (max) and a query ``q``, every key ``k`` of the page has
``q·k <= q⁺·M + q⁻·m`` with ``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``. The PyTorch form of this is
nine small kernels per layer (two clamps, two batched products, casts, a sum and a max); here it is
one launch: a program per (KV head, block of pages) holds the group's queries as the M rows of two
``tl.dot`` products and writes the group maximum, accumulating in fp32.

:func:`quest_page_scores_batched` scores a whole decode batch in one launch: row ``r``'s query against
its own candidate pages, gathered by a ``[R, N]`` index from one shared summary pool, padded to ``N``
per row with ``-inf`` past the row's count (the batched Quest store,
:class:`xoffload.kv.quest.OffloadQuestBatchKV`).


CPU tensors run :func:`xoffload.kernels.reference.quest_page_scores_ref` (and
``quest_page_scores_batched_ref``) unless Triton's interpreter is on. The exact-channel scores
that tighten this bound are :mod:`xoffload.kernels.channel_score`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_out, check_tensor, next_pow2, use_triton

__all__ = ["check_summaries", "quest_page_scores", "quest_page_scores_batched"]


@triton.jit(do_not_specialize=["N"])
def _score_kernel(Q, KMIN, KMAX, S, N, GROUP, D,
                  s_qh, s_kh, s_kn, s_sh,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    h = tl.program_id(0)
    nb = tl.program_id(1)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    on = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    gm = og < GROUP
    dm = od < D
    nm = on < N
    q = tl.load(Q + (h * GROUP + og)[:, None] * s_qh + od[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    base = h.to(tl.int64) * s_kh + on[:, None].to(tl.int64) * s_kn + od[None, :]
    kmax = tl.load(KMAX + base, mask=nm[:, None] & dm[None, :], other=0.0)
    kmin = tl.load(KMIN + base, mask=nm[:, None] & dm[None, :], other=0.0)
    qp = tl.where(q > 0, q, 0.0).to(kmax.dtype)  # q⁺ and q⁻ in the keys' dtype (exact)
    qn = tl.where(q < 0, q, 0.0).to(kmax.dtype)
    s = tl.dot(qp, tl.trans(kmax), input_precision=DOT_PREC)
    s += tl.dot(qn, tl.trans(kmin), input_precision=DOT_PREC)
    s = tl.where(gm[:, None], s, float("-inf"))
    tl.store(S + h * s_sh + on, tl.max(s, axis=0), mask=nm)


def check_summaries(q, kmin, kmax) -> tuple:
    """``(Hq, Hkv, n_pages, D)`` of a query ``[Hq, D]`` and page summaries ``[Hkv, n_pages, D]``
    after checking that they fit (tensors of a supported dtype, one shape for kmin and kmax,
    ``Hq % Hkv == 0``, one head_dim). Raises TypeError / ValueError naming the shapes."""
    check_tensor("q", q, 2)
    check_tensor("kmin", kmin, 3)
    check_tensor("kmax", kmax, 3)
    hq, d = q.shape
    hkv, n, dk = kmin.shape
    if tuple(kmax.shape) != tuple(kmin.shape):
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must have one shape")
    if dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit summaries {tuple(kmin.shape)} (GQA, head_dim)")
    return hq, hkv, n, d


def _described(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_batch_index(index, n_valid, R: int) -> None:
    """The candidate index of a batched scorer: ``index`` int32/int64 ``[R, N]`` and ``n_valid``
    int32 ``[R]``. Raises ValueError naming the one that does not fit (shape and dtype)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 2 \
            or index.shape[0] != R:
        raise ValueError(f"index must be an int32/int64 [R={R}, N] tensor, got {_described(index)}")
    if not isinstance(n_valid, torch.Tensor) or n_valid.dtype != torch.int32 or tuple(n_valid.shape) != (R,):
        raise ValueError(f"n_valid must be an int32 [R={R}] tensor, got {_described(n_valid)}")


def scores_out(out, shape: tuple, device) -> torch.Tensor:
    """The fp32 scores ``out`` of a page scorer: a new ``[*shape]`` tensor, or the caller's, checked
    (shape, dtype, device, a contiguous last dim: the kernels write each row's pages with stride
    1). Raises TypeError / ValueError naming what does not fit."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    check_out("out", out, shape, torch.float32, device)
    if out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dim, got strides {tuple(out.stride())}")
    return out


def check_operands(q, kmin, kmax, d, others=()) -> None:
    """The checks every page scorer shares: ``head_dim <= 256``, one dtype for q and the summaries,
    one device for them and ``others`` (``(name, tensor)`` pairs), contiguous last dims, and the
    same strides for kmin and kmax. Raises TypeError / ValueError naming what does not fit."""
    if d > 256:
        raise ValueError(f"head_dim must be <= 256, got {d}")
    if len({q.dtype, kmin.dtype, kmax.dtype}) != 1:
        raise TypeError(f"q, kmin, kmax must share a dtype, got {q.dtype}, {kmin.dtype}, {kmax.dtype}")
    named = [("q", q), ("kmin", kmin), ("kmax", kmax), *others]
    devs = {t.device for _, t in named}
    if len(devs) != 1:
        raise ValueError(f"{', '.join(n for n, _ in named)} must share a device, got {sorted(map(str, devs))}")
    for nm_, t in named[:3]:
        if t.stride(-1) != 1:
            raise ValueError(f"{nm_} must have a contiguous last dim, got strides {tuple(t.stride())}")
    if kmin.stride() != kmax.stride():
        raise ValueError(f"kmin and kmax must have the same strides, got {kmin.stride()} and {kmax.stride()}")


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's upper bound of ``q·k`` per page, maximised over each KV head's query-head group.

    Args:
        q: ``[Hq, D]`` one layer's (post-RoPE) query; fp16/bf16/fp32; last dim contiguous.
        kmin, kmax: ``[Hkv, n_pages, D]`` page minima / maxima of the same (post-RoPE) keys, q's
            dtype and device, last dim contiguous (e.g. a slice of the candidate pages of
            :class:`xoffload.sparse.quest.PageSummaries`). ``Hq % Hkv == 0``, ``D <= 256``.
        out: optional fp32 ``[Hkv, n_pages]`` written in place (last dim contiguous).
    Returns:
        fp32 ``[Hkv, n_pages]``: ``max over g of (q_g⁺ · M + q_g⁻ · m)``, an upper bound of
        ``q_g · k`` for every key k of the page and every query head g of the group (exact up to
        fp32 accumulation of the products).
    Raises:
        TypeError / ValueError: dtypes, shapes or devices that do not fit (named in the message).
    """
    hq, hkv, n, d = check_summaries(q, kmin, kmax)
    check_operands(q, kmin, kmax, d)
    out = scores_out(out, (hkv, n), q.device)
    if n == 0:
        return out
    if not use_triton(q):
        out.copy_(reference.quest_page_scores_ref(q, kmin, kmax))
        return out
    group = hq // hkv
    block_n = 64 if d <= 128 else 32
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (hkv, triton.cdiv(n, block_n))
    _score_kernel[grid](q, kmin, kmax, out, n, group, d,
                        q.stride(0), kmin.stride(0), kmin.stride(1), out.stride(0),
                        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(d)),
                        DOT_PREC=prec, num_warps=4)
    return out


@triton.jit(do_not_specialize=["N"])
def _batched_score_kernel(Q, KMIN, KMAX, IDX, NV, S, N, GROUP, D,
                          s_qr, s_qh, s_kh, s_kn, s_ir, s_sr, s_sh,
                          BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          DOT_PREC: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    on = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    gm = og < GROUP
    dm = od < D
    nv = tl.load(NV + r)
    valid = on < nv
    idx = tl.load(IDX + r.to(tl.int64) * s_ir + on, mask=valid, other=0).to(tl.int64)
    q = tl.load(Q + r.to(tl.int64) * s_qr + (h * GROUP + og)[:, None] * s_qh + od[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    base = h.to(tl.int64) * s_kh + idx[:, None] * s_kn + od[None, :]
    kmax = tl.load(KMAX + base, mask=valid[:, None] & dm[None, :], other=0.0)
    kmin = tl.load(KMIN + base, mask=valid[:, None] & dm[None, :], other=0.0)
    qp = tl.where(q > 0, q, 0.0).to(kmax.dtype)
    qn = tl.where(q < 0, q, 0.0).to(kmax.dtype)
    s = tl.dot(qp, tl.trans(kmax), input_precision=DOT_PREC)
    s += tl.dot(qn, tl.trans(kmin), input_precision=DOT_PREC)
    s = tl.where(gm[:, None], s, float("-inf"))
    best = tl.where(valid, tl.max(s, axis=0), float("-inf"))
    tl.store(S + r.to(tl.int64) * s_sr + h * s_sh + on, best, mask=on < N)


def quest_page_scores_batched(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, index: torch.Tensor,
                              n_valid: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quest page bounds of a decode batch in one launch, each row over its own candidate pages.

    Args:
        q: ``[R, Hq, D]`` one layer's (post-RoPE) query per row; fp16/bf16/fp32; last dim contiguous.
        kmin, kmax: ``[Hkv, NP, D]`` a shared summary pool (page minima / maxima of the keys), q's
            dtype and device, last dim contiguous, the same strides. ``Hq % Hkv == 0``, ``D <= 256``.
        index: int32 or int64 ``[R, N]`` on q's device: summary page of row r's candidate j
            (entries ``j >= n_valid[r]`` are never read; the others must be in ``[0, NP)``, not
            checked: no host read).
        n_valid: int32 ``[R]`` on q's device: candidates of each row (``0 <= n_valid[r] <= N``).
        out: optional fp32 ``[R, Hkv, N]`` written in place (last dim contiguous).
    Returns:
        fp32 ``[R, Hkv, N]``: ``max over g of (q_g⁺ · M + q_g⁻ · m)`` of row r's candidate j
        (as :func:`quest_page_scores`), ``-inf`` for ``j >= n_valid[r]``.
    Raises:
        TypeError / ValueError: dtypes, shapes or devices that do not fit (named in the message).
    """
    check_tensor("q", q, 3)
    R, hq, d = q.shape
    check_summaries(q[0] if R else q.new_empty(hq, d), kmin, kmax)
    hkv = kmin.shape[0]
    if len({q.dtype, kmin.dtype, kmax.dtype}) != 1:
        raise TypeError(f"q, kmin, kmax must share a dtype, got {q.dtype}, {kmin.dtype}, {kmax.dtype}")
    check_batch_index(index, n_valid, R)
    check_operands(q, kmin, kmax, d, (("index", index), ("n_valid", n_valid)))
    n = index.shape[1]
    out = scores_out(out, (R, hkv, n), q.device)
    if n == 0 or R == 0:
        return out
    if not use_triton(q):
        out.copy_(reference.quest_page_scores_batched_ref(q, kmin, kmax, index, n_valid))
        return out
    group = hq // hkv
    block_n = 64 if d <= 128 else 32
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    index = index.contiguous()
    grid = (R, hkv, triton.cdiv(n, block_n))
    _batched_score_kernel[grid](q, kmin, kmax, index, n_valid.contiguous(), out, n, group, d,
                                q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), index.stride(0),
                                out.stride(0), out.stride(1),
                                BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(d)),
                                DOT_PREC=prec, num_warps=4)
    return out
