"""Quest page scores in one kernel: the upper bound of ``q·k`` over each page from its elementwise
key minima and maxima, maximised over the query heads of each KV head's GQA group (Tang et al.
2024, "Quest"; the group maximum makes one selection per KV head serve every head of the group).

For page summaries ``m`` (min) and ``M`` (max) and a query ``q``, every key ``k`` of the page has
``q·k <= q⁺·M + q⁻·m`` with ``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``. The PyTorch form of this is
nine small kernels per layer (two clamps, two batched products, casts, a sum and a max); here it is
one launch: a program per (KV head, block of pages) holds the group's queries as the M rows of two
``tl.dot`` products and writes the group maximum, accumulating in fp32.

CPU tensors run :func:`xoffload.kernels.reference.quest_page_scores_ref` unless Triton's
interpreter is on.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_out, check_tensor, next_pow2, use_triton

__all__ = ["check_summaries", "quest_page_scores"]


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
    if d > 256:
        raise ValueError(f"head_dim must be <= 256, got {d}")
    if len({q.dtype, kmin.dtype, kmax.dtype}) != 1:
        raise TypeError(f"q, kmin, kmax must share a dtype, got {q.dtype}, {kmin.dtype}, {kmax.dtype}")
    if len({q.device, kmin.device, kmax.device}) != 1:
        raise ValueError(f"q, kmin, kmax must share a device, got {q.device}, {kmin.device}, {kmax.device}")
    for nm_, t in (("q", q), ("kmin", kmin), ("kmax", kmax)):
        if t.stride(-1) != 1:
            raise ValueError(f"{nm_} must have a contiguous last dim, got strides {tuple(t.stride())}")
    if kmin.stride() != kmax.stride():
        raise ValueError(f"kmin and kmax must have the same strides, got {kmin.stride()} and {kmax.stride()}")
    if out is None:
        out = torch.empty(hkv, n, dtype=torch.float32, device=q.device)
    else:
        check_out("out", out, (hkv, n), torch.float32, q.device)
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {tuple(out.stride())}")
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
