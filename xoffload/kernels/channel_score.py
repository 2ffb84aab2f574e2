"""Page scores for sparse decode from exact values of a few key channels plus Quest's min/max
summary of the rest (:class:`xoffload.sparse.quest.QuestDecode` with ``exact_channels``).
They tighten Quest's bound (:mod:`xoffload.kernels.quest_score`) where it is loosest. Quest's bound takes each
channel's extreme from a different key, and in the retrieval layers of a RoPE model a few channels
with a wide, large-magnitude range (the low-frequency rotary channels) dominate it, so every page
looks alike. For ``r`` such channels per KV head (chosen once per request from the prompt's keys,
:class:`xoffload.sparse.quest.PageSummaries`) the keys' own values are kept (``r / D`` of K's
bytes, the "label cache" of Double Sparsity, Yang et al. 2024) and scored exactly, token by token,
maximised over the page; the other channels keep the min/max summary, scored as its midpoint plus
``alpha`` times its radius (``alpha = 1``: Quest's bound, so the sum stays an upper bound of
``q·k``; smaller ``alpha`` estimates the page's best key instead of bounding it).


One Triton kernel serves one row (:func:`channel_page_scores`, a request's candidate pages) and a
batch (:func:`channel_page_scores_batched`, each row's pages gathered from a shared summary pool
with its own channels): per (row, KV head, 16 pages) two or four ``tl.dot`` for the summary part
(four when ``alpha < 1``: the bound and its lower counterpart) and one ``[G, r] x [r, 16 P]`` dot
with a per-page maximum for the exact part, accumulating in fp32.

CPU tensors run :func:`xoffload.kernels.reference.channel_page_scores_ref` (and
``channel_page_scores_batched_ref``) unless Triton's interpreter is on.
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_tensor, next_pow2, use_triton
from .quest_score import check_batch_index, check_operands, check_summaries, scores_out

__all__ = ["channel_page_scores", "channel_page_scores_batched", "check_channels"]


@triton.jit(do_not_specialize=["N"])
def _channel_score_kernel(Q, KMIN, KMAX, CH, KL, IDX, NV, S, N, GROUP, D, R, alpha,
                          s_qr, s_qh, s_kh, s_kn, s_cr, s_ch, s_lh, s_lt, s_ir, s_sr, s_sh,
                          P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_EXACT: tl.constexpr,
                          GATHER: tl.constexpr, DOT_PREC: tl.constexpr):
    """One program per (row, KV head, 16 pages). ``GATHER``: row ``row``'s candidates are summary
    pages ``IDX[row, :NV[row]]`` of a shared pool (the batch); else pages ``0 .. N - 1`` (one row)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    orr = tl.arange(0, BLOCK_R)
    on = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    gm = og < GROUP
    dm = od < D
    rm = orr < R
    if GATHER:
        valid = on < tl.load(NV + row)
        idx = tl.load(IDX + row.to(tl.int64) * s_ir + on, mask=valid, other=0).to(tl.int64)
    else:
        valid = on < N
        idx = on.to(tl.int64)
    ch = tl.load(CH + row.to(tl.int64) * s_cr + h * s_ch + orr, mask=rm, other=-1)  # the stored channels
    ch = tl.where(rm, tl.minimum(tl.maximum(ch, 0), D - 1), -1)  # clamped into [0, D): never reads outside q
    lab = tl.max((od[None, :] == ch[:, None]).to(tl.int32), axis=0) > 0  # [BLOCK_D]
    qrow = Q + row.to(tl.int64) * s_qr + (h * GROUP + og)[:, None] * s_qh
    q = tl.load(qrow + od[None, :], mask=gm[:, None] & dm[None, :] & ~lab[None, :], other=0.0)
    base = h.to(tl.int64) * s_kh + idx[:, None] * s_kn + od[None, :]
    kmax = tl.load(KMAX + base, mask=valid[:, None] & dm[None, :], other=0.0)
    kmin = tl.load(KMIN + base, mask=valid[:, None] & dm[None, :], other=0.0)
    qp = tl.where(q > 0, q, 0.0).to(kmax.dtype)
    qn = tl.where(q < 0, q, 0.0).to(kmax.dtype)
    up = tl.dot(qp, tl.trans(kmax), input_precision=DOT_PREC)  # q⁺·M + q⁻·m = q·mid + |q|·rad
    up += tl.dot(qn, tl.trans(kmin), input_precision=DOT_PREC)
    if HAS_LOWER:  # q⁺·m + q⁻·M = q·mid - |q|·rad; mid + alpha·rad = ((1+a)·up + (1-a)·low) / 2
        low = tl.dot(qp, tl.trans(kmin), input_precision=DOT_PREC)
        low += tl.dot(qn, tl.trans(kmax), input_precision=DOT_PREC)
        s = 0.5 * (1.0 + alpha) * up + 0.5 * (1.0 - alpha) * low
    else:
        s = up
    if HAS_EXACT:  # the tokens of each page (page p: klab rows p * P + t): [G, r] x [r, BLOCK_N * P], each page's max
        qc = tl.load(qrow + ch[None, :], mask=gm[:, None] & rm[None, :], other=0.0).to(kmax.dtype)
        tok = tl.reshape(idx[:, None] * P + tl.arange(0, P)[None, :], (BLOCK_N * P,))
        tv = tl.reshape(tl.broadcast_to(valid[:, None], (BLOCK_N, P)), (BLOCK_N * P,))
        kl = tl.load(KL + h.to(tl.int64) * s_lh + tok[:, None] * s_lt + orr[None, :],
                     mask=tv[:, None] & rm[None, :], other=0.0)
        ex = tl.dot(qc, tl.trans(kl), input_precision=DOT_PREC)  # [BLOCK_G, BLOCK_N * P]
        s += tl.max(tl.reshape(ex, (BLOCK_G, BLOCK_N, P)), axis=2)
    s = tl.where(gm[:, None], s, float("-inf"))
    best = tl.where(valid, tl.max(s, axis=0), float("-inf"))
    tl.store(S + row.to(tl.int64) * s_sr + h * s_sh + on, best, mask=on < N)


#: pages per program and warps of the score kernel (``bench_quest_score.py --sweep`` times others)
BLOCK_N = 16


def _launch(q, kmin, kmax, channels, klab, index, n_valid, out, r, P, alpha, group, block_n=None, num_warps=None):
    """The kernel over ``q`` ``[R, Hq, D]`` (``index`` None: one row over pages ``0 .. n - 1``);
    ``block_n`` (a power of two >= 16, default :data:`BLOCK_N`) pages per program and
    ``num_warps`` (default 4, 8 past 512 tokens per program) for tuning runs."""
    R, _, d = q.shape
    hkv = kmin.shape[0]
    n = out.shape[-1]
    gather = index is not None
    if r:
        channels = channels.contiguous()
        s_cr, s_ch = (channels.stride(0), channels.stride(1)) if gather else (0, channels.stride(0))
        s_lh, s_lt = klab.stride(0), klab.stride(1)
    else:  # never read (HAS_EXACT False, the channel mask all-false)
        channels, klab, s_cr, s_ch, s_lh, s_lt = torch.zeros(1, dtype=torch.int32, device=q.device), kmin, 0, 0, 0, 0
    if gather:
        index, n_valid = index.contiguous(), n_valid.contiguous()
        s_ir, s_sr, s_sh = index.stride(0), out.stride(0), out.stride(1)
    else:
        index, n_valid, s_ir, s_sr, s_sh = channels, channels, 0, 0, out.stride(0)
    block_n = BLOCK_N if block_n is None else int(block_n)
    if num_warps is None:
        num_warps = 4 if block_n * P <= 512 else 8
    _channel_score_kernel[(R, hkv, triton.cdiv(n, block_n))](
        q, kmin, kmax, channels, klab, index, n_valid, out, n, group, d, r, alpha,
        q.stride(0) if gather else 0, q.stride(-2), kmin.stride(0), kmin.stride(1), s_cr, s_ch, s_lh, s_lt, s_ir,
        s_sr, s_sh,
        P=P, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_R=max(16, next_pow2(r)), HAS_LOWER=alpha != 1.0, HAS_EXACT=r > 0, GATHER=gather,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps)


def check_channels(channels, klab, alpha, hkv: int, n: int, d: int, dtype, *, check: bool = True) -> tuple:
    """``(r, P, alpha)`` of the exact-channel arguments of :func:`channel_page_scores` for summaries
    of ``n`` pages of ``hkv`` KV heads and head dim ``d`` (``r = 0``, ``P = 16`` without channels),
    after checking that they fit: ``channels`` and ``klab`` both given or both None, ``channels``
    int32/int64 ``[hkv, r]`` with ``1 <= r <= 64``, ``klab`` ``[hkv, n * P, r]`` of ``dtype`` with
    ``P`` a power of two in ``[16, 256]``, ``alpha`` a number in ``[0, 1]``. With ``check`` the
    channel values too: each in ``[0, d)`` and distinct within a KV head (a host read of
    ``channels``, which synchronises when they are on a GPU; callers in a decode step or a CUDA
    graph pass ``check=False``: the kernel then clamps them into ``[0, d)``). Raises TypeError /
    ValueError naming the value."""
    if (channels is None) != (klab is None):
        raise ValueError("channels and klab come together (both None: no exact part)")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a number in [0, 1], got {type(alpha).__name__} {alpha!r}")
    a = float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if channels is None:
        return 0, 16, a
    if not isinstance(channels, torch.Tensor) or channels.dtype not in (torch.int32, torch.int64) \
            or channels.dim() != 2 or channels.shape[0] != hkv or not 1 <= channels.shape[1] <= 64:
        raise ValueError(f"channels must be an int32/int64 [Hkv={hkv}, r] tensor with 1 <= r <= 64, got "
                         f"{tuple(channels.shape) if isinstance(channels, torch.Tensor) else type(channels).__name__}"
                         f"{' ' + str(channels.dtype) if isinstance(channels, torch.Tensor) else ''}")
    r = channels.shape[1]
    check_tensor("klab", klab, 3)
    if klab.shape[0] != hkv or klab.shape[2] != r or (n and klab.shape[1] % n):
        raise ValueError(f"klab must be [Hkv={hkv}, n_pages * P, r={r}] for {n} pages, got {tuple(klab.shape)}")
    P = klab.shape[1] // n if n else 16
    if n and (P < 16 or P > 256 or P & (P - 1)):
        raise ValueError(f"klab holds {P} tokens per page; it must be a power of two in [16, 256]")
    if klab.dtype != dtype:
        raise TypeError(f"klab must have q's dtype {dtype}, got {klab.dtype}")
    if check:  # host read: validation only (check=False: the kernel clamps)
        c = channels.cpu()
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi >= d:
            raise ValueError(f"channels must be in [0, head_dim={d}), got min {lo}, max {hi}")
        srt = c.sort(-1).values
        rep = (srt[:, 1:] == srt[:, :-1]).any(-1).nonzero()
        if len(rep):
            h = int(rep[0])
            raise ValueError(f"channels of KV head {h} repeat a channel: {c[h].tolist()}")
    return r, P, a


def channel_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, channels: torch.Tensor | None,
                        klab: torch.Tensor | None, *, alpha: float = 1.0,
                        out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Page scores from exact scores on ``r`` stored key channels plus the min/max summary of the
    rest (module docstring), maximised over each KV head's query-head group, in one launch.

    Args:
        q: ``[Hq, D]`` one layer's (post-RoPE) query; fp16/bf16/fp32; last dim contiguous.
        kmin, kmax: ``[Hkv, n_pages, D]`` page minima / maxima (as :func:`quest_page_scores`).
        channels: int32/int64 ``[Hkv, r]``, ``1 <= r <= 64``, distinct channels in ``[0, D)`` per KV
            head, on q's device; or None (with ``klab`` None): no exact part, every channel scored
            from the summary.
        klab: ``[Hkv, n_pages * P, r]`` the keys' values in those channels, token by token, of the
            same ``n_pages`` pages of ``P`` tokens (``P`` a power of two, 16..256); q's dtype.
        alpha: weight of the key range's radius on the other channels, in ``[0, 1]`` (1: Quest's
            bound, and the score is an upper bound of ``q_g·k`` for every key of the page).
        out: optional fp32 ``[Hkv, n_pages]`` written in place (last dim contiguous).
        check: check on the host that ``channels`` are in ``[0, D)`` and distinct per KV head (reads
            them: a device->host copy that synchronises). ``check=False`` skips that (a decode step,
            CUDA-graph capture; :class:`xoffload.sparse.quest.PageSummaries` chooses them distinct
            and in range): entries are then clamped into ``[0, D)``, so the kernel never reads
            outside q, and the reference does the same (a repeated channel is then counted once per
            entry in the exact part: not a bound).
    Returns:
        fp32 ``[Hkv, n_pages]`` (:func:`xoffload.kernels.reference.channel_page_scores_ref`).
    Raises:
        TypeError / ValueError: dtypes, shapes, devices, ``alpha`` or (with ``check``) channel
        values that do not fit (named).
    """
    hq, hkv, n, d = check_summaries(q, kmin, kmax)
    if len({q.dtype, kmin.dtype, kmax.dtype}) != 1:
        raise TypeError(f"q, kmin, kmax must share a dtype, got {q.dtype}, {kmin.dtype}, {kmax.dtype}")
    r, P, a = check_channels(channels, klab, alpha, hkv, n, d, q.dtype, check=check)
    check_operands(q, kmin, kmax, d, (("channels", channels), ("klab", klab)) if r else ())
    out = scores_out(out, (hkv, n), q.device)
    if n == 0:
        return out
    if not use_triton(q):
        out.copy_(reference.channel_page_scores_ref(q, kmin, kmax, channels, klab, a))
        return out
    _launch(q[None], kmin, kmax, channels, klab, None, None, out, r, P, a, hq // hkv)
    return out


def channel_page_scores_batched(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, channels: torch.Tensor,
                                klab: torch.Tensor, index: torch.Tensor, n_valid: torch.Tensor, *,
                                alpha: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`channel_page_scores` of a decode batch in one launch, each row over its own candidate
    pages of a shared summary pool (as :func:`quest_page_scores_batched`) with its own channels.

    Args:
        q: ``[R, Hq, D]`` one layer's (post-RoPE) query per row; fp16/bf16/fp32; last dim contiguous.
        kmin, kmax: ``[Hkv, NP, D]`` the shared summary pool (q's dtype and device, same strides).
        channels: int32/int64 ``[R, Hkv, r]``, ``1 <= r <= 64``: row r's stored channels per KV
            head (chosen distinct and in ``[0, D)`` by the store; clamped into it, never checked:
            no host read in a decode step).
        klab: ``[Hkv, NP * P, r]`` the pool's token values in each row's channels: summary page
            ``p`` holds tokens ``p * P .. p * P + P - 1`` (``P`` a power of two, 16..256); q's dtype.
        index: int32/int64 ``[R, N]``: summary page of row r's candidate j (entries ``j >=
            n_valid[r]`` never read; the others in ``[0, NP)``, not checked).
        n_valid: int32 ``[R]``: candidates of each row.
        alpha: the radius weight on the other channels, in ``[0, 1]``.
        out: optional fp32 ``[R, Hkv, N]`` written in place.
    Returns:
        fp32 ``[R, Hkv, N]``: row r's candidate j scored as :func:`channel_page_scores` of its page,
        ``-inf`` for ``j >= n_valid[r]``
        (:func:`xoffload.kernels.reference.channel_page_scores_batched_ref`).
    Raises:
        TypeError / ValueError: dtypes, shapes, devices or ``alpha`` that do not fit (named).
    """
    check_tensor("q", q, 3)
    R, hq, d = q.shape
    check_summaries(q[0] if R else q.new_empty(hq, d), kmin, kmax)
    hkv, npg = kmin.shape[0], kmin.shape[1]
    if len({q.dtype, kmin.dtype, kmax.dtype}) != 1:
        raise TypeError(f"q, kmin, kmax must share a dtype, got {q.dtype}, {kmin.dtype}, {kmax.dtype}")
    if not isinstance(channels, torch.Tensor) or channels.dim() != 3 or channels.shape[0] != R:
        raise ValueError(f"channels must be an int32/int64 [R={R}, Hkv={hkv}, r] tensor, got "
                         f"{tuple(channels.shape) if isinstance(channels, torch.Tensor) else type(channels).__name__}")
    # the per-row shape checks of the one-row scorer (channels [Hkv, r], klab [Hkv, NP * P, r], alpha)
    r, P, a = check_channels(channels[0] if R else channels.new_zeros(hkv, max(1, channels.shape[2])), klab, alpha,
                             hkv, npg, d, q.dtype, check=False)
    check_batch_index(index, n_valid, R)
    check_operands(q, kmin, kmax, d, (("channels", channels), ("klab", klab), ("index", index),
                                       ("n_valid", n_valid)))
    n = index.shape[1]
    out = scores_out(out, (R, hkv, n), q.device)
    if n == 0 or R == 0:
        return out
    if not use_triton(q):
        out.copy_(reference.channel_page_scores_batched_ref(q, kmin, kmax, channels, klab, index, n_valid, a))
        return out
    _launch(q, kmin, kmax, channels, klab, index, n_valid, out, r, P, a, hq // hkv)
    return out
