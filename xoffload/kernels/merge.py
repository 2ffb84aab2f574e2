"""Exact merging of partial attention states by their log-sum-exp (LSE).

Two attention results over disjoint key sets, ``(o_a, lse_a)`` and ``(o_b, lse_b)``, combine into
the attention over the union (flash-decoding / ring attention merge, Dao et al. 2023; the
``merge_state`` of FlashInfer):

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

computed in fp32 with the max subtracted first. A pair of empty states (-inf, -inf) merges to
(0, -inf), never NaN; a side whose LSE is -inf contributes nothing, even if its output holds NaN
or garbage (e.g. an uninitialised buffer).

Layout (the outputs of :func:`flash_attn_with_lse` and :func:`decode_attn_with_lse`): an output
``o`` has shape ``[..., S, H, D]`` and its LSE has shape ``[..., H, S]`` (fp32, natural log), where
``...`` is any number (>= 0) of leading dims. So the dense layout ``o [B, S, H, D]`` /
``lse [B, H, S]``, the varlen layout ``o [T, H, D]`` / ``lse [H, T]`` and the decode layout
``o [B, 1, H, D]`` / ``lse [B, H, 1]`` are all accepted. Only the last dim of an output ``o`` must
be contiguous; every other stride is honoured. LSEs, input and output, may have any strides (a
transposed ``[S, H].t()`` view, a slice), passed to the kernel as they are. An output LSE whose
leading dims cannot be flattened into one without a copy is written through a contiguous buffer
that is copied back. What an output LSE cannot be: a tensor whose elements share memory (a stride
of 0, an ``expand``-ed view), or one that shares memory with an input or the output ``o`` without
being an input LSE itself (same start, shape and strides; the in-place form): both raise ValueError.

CUDA tensors run an elementwise Triton kernel; CPU tensors run :func:`reference.merge_ref`, or the
Triton code under ``TRITON_INTERPRET=1`` (see :mod:`xoffload.kernels.checks`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_out, check_same, check_tensor, has_internal_overlap, next_pow2, overlaps, use_triton

__all__ = ["merge_attention_states", "merge_attention_states_n", "merge_attention_states_"]


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def _lse_shape(o_shape) -> tuple:
    *lead, s, h, _d = o_shape
    return tuple(lead) + (h, s)


def _check_state(o_name, o, lse_name, lse, min_dim=3):
    check_tensor(o_name, o)
    if o.dim() < min_dim:
        raise ValueError(
            f"{o_name} must have shape [..., S, H, D] (at least {min_dim} dims), got {tuple(o.shape)}"
        )
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"{lse_name} must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{lse_name} must be float32 (natural-log LSE), got {lse.dtype}")
    want = _lse_shape(o.shape)
    if tuple(lse.shape) != want:
        raise ValueError(
            f"{lse_name} has shape {tuple(lse.shape)} but {o_name} {tuple(o.shape)} ([..., S, H, D]) "
            f"needs [..., H, S] = {want}"
        )
    if lse.device != o.device:
        raise ValueError(f"{lse_name} is on {lse.device} but {o_name} is on {o.device}")


def _same_view(a, b) -> bool:
    """``a`` and ``b`` address the same elements in the same order (start, shape, strides)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n > 1))


def _check_out(out, out_lse, o_shape, device, lse_ins, others):
    """``out`` as :func:`check_out`; ``out_lse`` fp32 ``[..., H, S]`` of any strides whose elements
    are distinct in memory, either one of ``lse_ins`` ((name, tensor) pairs) itself or sharing no
    memory with them, with ``others`` or with ``out``."""
    if out is not None:
        check_out("out", out, o_shape, None, device)
    if out_lse is None:
        return
    if not isinstance(out_lse, torch.Tensor):
        raise TypeError(f"out_lse must be a torch.Tensor, got {type(out_lse).__name__}")
    if out_lse.dtype != torch.float32:
        raise TypeError(f"out_lse has dtype {out_lse.dtype}, expected torch.float32")
    want = _lse_shape(o_shape)
    if tuple(out_lse.shape) != want:
        raise ValueError(f"out_lse has shape {tuple(out_lse.shape)}, expected [..., H, S] = {want}")
    if out_lse.device != torch.device(device):
        raise ValueError(f"out_lse is on {out_lse.device}, expected {device}")
    if has_internal_overlap(out_lse):
        raise ValueError(
            f"out_lse with shape {want} strides {tuple(out_lse.stride())} has elements that share memory; "
            f"expected one memory location per element (any strides otherwise)"
        )
    names = " or ".join(n for n, _ in lse_ins) or "an input LSE"
    for i, (name, t) in enumerate(list(lse_ins) + list(others) + [("out", out)]):
        if t is None or (i < len(lse_ins) and _same_view(out_lse, t)):
            continue
        if overlaps(out_lse, t):
            raise ValueError(
                f"out_lse (strides {tuple(out_lse.stride())}) shares memory with {name} (shape {tuple(t.shape)} "
                f"strides {tuple(t.stride())}); expected {names} itself (same start, shape and strides) or "
                f"memory that no input or output uses"
            )


def _as4(name, o):
    """View ``[..., S, H, D]`` as ``[L, S, H, D]`` (copying only a non-viewable input)."""
    s, h, d = o.shape[-3:]
    lead = 1
    for x in o.shape[:-3]:
        lead *= x
    try:
        return o.view(lead, s, h, d)
    except RuntimeError:
        if name in ("out",):
            raise ValueError(
                f"{name} with shape {tuple(o.shape)} strides {tuple(o.stride())}: its leading dims "
                f"cannot be flattened into one without a copy; pass a tensor whose leading dims can"
            ) from None
        return o.reshape(lead, s, h, d)


def _as3(lse, copy=True):
    """View ``[..., H, S]`` (any strides) as ``[L, H, S]``; where the leading dims cannot be
    flattened without a copy, a contiguous copy (``copy``) or None."""
    h, s = lse.shape[-2:]
    lead = 1
    for x in lse.shape[:-2]:
        lead *= x
    try:
        return lse.view(lead, h, s)
    except RuntimeError:
        return lse.reshape(lead, h, s) if copy else None


def _lse_target(out_lse, shape3):
    """(``[L, H, S]`` tensor the kernel writes, whether it must be copied into ``out_lse`` after)."""
    lo = _as3(out_lse, copy=False)
    if lo is None:
        return torch.empty(shape3, dtype=torch.float32, device=out_lse.device), True
    return lo, False


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_offsets(pid, S, H, so_l, so_h, so_s, sl_l, sl_h, sl_s, BLOCK_S: tl.constexpr):
    """Program ``pid`` -> (l, h, block of BLOCK_S positions s): int64 offsets into o ``[L, S, H, D]``
    (rows) and lse ``[L, H, S]``, and the row mask. The (l, h) split is one scalar division per
    program (no per-element integer division), and the LSE accesses of a program are contiguous."""
    n_sblk = tl.cdiv(S, BLOCK_S)
    sblk = pid % n_sblk
    t = pid // n_sblk
    h = (t % H).to(tl.int64)
    l = (t // H).to(tl.int64)
    s = sblk * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s < S
    s64 = s.to(tl.int64)
    return l * so_l + h * so_h + s64 * so_s, l * sl_l + h * sl_h + s64 * sl_s, smask


@triton.jit
def _merge2_kernel(
    OA, LA, OB, LB, O, LO,
    S, H, D,
    sa_l, sa_h, sa_s, sla_l, sla_h, sla_s,
    sb_l, sb_h, sb_s, slb_l, slb_h, slb_s,
    so_l, so_h, so_s, slo_l, slo_h, slo_s,
    WRITE_LSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    oa_off, la_off, rmask = _tile_offsets(pid, S, H, sa_l, sa_h, sa_s, sla_l, sla_h, sla_s, BLOCK_S)
    ob_off, lb_off, _ = _tile_offsets(pid, S, H, sb_l, sb_h, sb_s, slb_l, slb_h, slb_s, BLOCK_S)
    oo_off, lo_off, _ = _tile_offsets(pid, S, H, so_l, so_h, so_s, slo_l, slo_h, slo_s, BLOCK_S)
    la = tl.load(LA + la_off, mask=rmask, other=float("-inf"))
    lb = tl.load(LB + lb_off, mask=rmask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)  # exp(-inf) = 0
    wb = tl.exp(lb - m_safe)
    tot = wa + wb
    tot_safe = tl.where(tot != 0.0, tot, 1.0)
    inv = tl.where(tot != 0.0, 1.0 / tot_safe, 0.0)
    wa = wa * inv
    wb = wb * inv
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        msk = rmask[:, None] & (d < D)[None, :]
        # a side with weight 0 (LSE -inf) is not read at all: garbage/NaN there cannot leak in
        oa = tl.load(OA + oa_off[:, None] + d[None, :], mask=msk & (wa > 0.0)[:, None], other=0.0)
        ob = tl.load(OB + ob_off[:, None] + d[None, :], mask=msk & (wb > 0.0)[:, None], other=0.0)
        o = wa[:, None] * oa.to(tl.float32) + wb[:, None] * ob.to(tl.float32)
        tl.store(O + oo_off[:, None] + d[None, :], o.to(O.dtype.element_ty), mask=msk)
    if WRITE_LSE:
        lse = tl.where(tot != 0.0, m_safe + tl.log(tot_safe), float("-inf"))
        tl.store(LO + lo_off, lse, mask=rmask)


@triton.jit
def _mergen_kernel(
    OS, LS, O, LO,
    N, S, H, D,
    si_n, si_l, si_h, si_s, sli_n, sli_l, sli_h, sli_s,
    so_l, so_h, so_s, slo_l, slo_h, slo_s,
    WRITE_LSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    oi_off, li_off, rmask = _tile_offsets(pid, S, H, si_l, si_h, si_s, sli_l, sli_h, sli_s, BLOCK_S)
    oo_off, lo_off, _ = _tile_offsets(pid, S, H, so_l, so_h, so_s, slo_l, slo_h, slo_s, BLOCK_S)
    # pass 1 over the (small) LSEs: max, then sum of exp; pointers advance in 64-bit steps
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l_ptrs = LS + li_off
    for n in range(0, N):
        m = tl.maximum(m, tl.load(l_ptrs, mask=rmask, other=float("-inf")))
        l_ptrs += sli_n
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.zeros([BLOCK_S], tl.float32)
    l_ptrs = LS + li_off
    for n in range(0, N):
        tot += tl.exp(tl.load(l_ptrs, mask=rmask, other=float("-inf")) - m_safe)
        l_ptrs += sli_n
    tot_safe = tl.where(tot != 0.0, tot, 1.0)
    inv = tl.where(tot != 0.0, 1.0 / tot_safe, 0.0)
    # pass 2 over the outputs
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        msk = rmask[:, None] & (d < D)[None, :]
        acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        l_ptrs = LS + li_off
        o_ptrs = OS + oi_off[:, None] + d[None, :]
        for n in range(0, N):
            w = tl.exp(tl.load(l_ptrs, mask=rmask, other=float("-inf")) - m_safe) * inv
            on = tl.load(o_ptrs, mask=msk & (w > 0.0)[:, None], other=0.0).to(tl.float32)
            acc += w[:, None] * on
            l_ptrs += sli_n
            o_ptrs += si_n
        tl.store(O + oo_off[:, None] + d[None, :], acc.to(O.dtype.element_ty), mask=msk)
    if WRITE_LSE:
        lse = tl.where(tot != 0.0, m_safe + tl.log(tot_safe), float("-inf"))
        tl.store(LO + lo_off, lse, mask=rmask)


def _block_sizes(d: int, elem_bytes: int):
    block_d = min(next_pow2(max(d, 16)), 256)
    # ~8 KiB of each input per program: enough bytes in flight, many programs
    block_s = max(1, min(128, 8192 // (block_d * elem_bytes)))
    block_s = next_pow2(block_s)
    return block_s, block_d


def _geometry(o4, l3):
    """(S, H, o strides (l, h, s), lse strides (l, h, s)) of o ``[L, S, H, D]`` / lse ``[L, H, S]``.

    With S == 1 (decode layout ``[B, 1, H, D]`` / ``[B, H, 1]``) the roles of S and H swap, so that a
    program still covers a contiguous run of rows and LSEs."""
    _, s, h, _ = o4.shape
    os_ = (o4.stride(0), o4.stride(2), o4.stride(1))
    ls_ = (l3.stride(0), l3.stride(1), l3.stride(2))
    if s == 1 and h > 1:
        return h, 1, (os_[0], os_[2], os_[1]), (ls_[0], ls_[2], ls_[1])
    return s, h, os_, ls_


def _launch_merge2(o_a, lse_a, o_b, lse_b, out, out_lse):
    """Triton 2-way merge; all tensors already validated, out/out_lse allocated (out_lse may be None)."""
    oa, ob, oo = _as4("o_a", o_a), _as4("o_b", o_b), _as4("out", out)
    la, lb = _as3(lse_a), _as3(lse_b)
    lo, copy_back = _lse_target(out_lse, la.shape) if out_lse is not None else (la, False)
    L, _, _, D = oa.shape
    if oa.numel() == 0:
        return
    S, H, sa, sla = _geometry(oa, la)
    _, _, sb, slb = _geometry(ob, lb)
    _, _, so, slo = _geometry(oo, lo)
    block_s, block_d = _block_sizes(D, oa.element_size())
    grid = (L * H * triton.cdiv(S, block_s),)
    _merge2_kernel[grid](
        oa, la, ob, lb, oo, lo,
        S, H, D, *sa, *sla, *sb, *slb, *so, *slo,
        WRITE_LSE=out_lse is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
    )
    if copy_back:
        out_lse.copy_(lo.view(out_lse.shape))


def _launch_mergen(outs, lses, out, out_lse):
    """Triton N-way merge over dim 0 of outs ``[N, ..., S, H, D]`` / lses ``[N, ..., H, S]``.

    Tensors already validated; out ``[..., S, H, D]`` (any float dtype), out_lse may be None.
    """
    N = outs.shape[0]
    s, h, d = outs.shape[-3:]
    lead = 1
    for x in outs.shape[1:-3]:
        lead *= x
    try:
        oi = outs.view(N, lead, s, h, d)
    except RuntimeError:
        oi = outs.reshape(N, lead, s, h, d)
    try:
        li = lses.view(N, lead, h, s)
    except RuntimeError:
        li = lses.reshape(N, lead, h, s)
    oo = _as4("out", out)
    lo, copy_back = _lse_target(out_lse, li.shape[1:]) if out_lse is not None else (li[0], False)
    if oo.numel() == 0:
        return
    S, H, si, sli = _geometry(oi[0], li[0])
    _, _, so, slo = _geometry(oo, lo)
    block_s, block_d = _block_sizes(d, oi.element_size())
    grid = (lead * H * triton.cdiv(S, block_s),)
    _mergen_kernel[grid](
        oi, li, oo, lo,
        N, S, H, d, oi.stride(0), *si, li.stride(0), *sli, *so, *slo,
        WRITE_LSE=out_lse is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
    )
    if copy_back:
        out_lse.copy_(lo.view(out_lse.shape))


def _merge_reference(outs, lses):
    """CPU path: :func:`reference.merge_ref` in our layout; an empty (-inf) state's output is
    zeroed first so that garbage there cannot leak in (0 * NaN)."""
    lt = lses.transpose(-1, -2)  # [N, ..., S, H]
    outs = torch.where(torch.isneginf(lt).unsqueeze(-1), torch.zeros((), dtype=outs.dtype), outs)
    o, lse = reference.merge_ref(outs, lt)
    return o, lse


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def merge_attention_states(o_a, lse_a, o_b, lse_b, *, out=None, out_lse=None):
    """Merge two partial attention states over disjoint key sets into the state over their union.

    Args:
        o_a, o_b: outputs ``[..., S, H, D]`` (fp16/bf16/fp32, same dtype, shape and device; only
            the last dim must be contiguous). E.g. ``[B, S, H, D]`` (dense), ``[T, H, D]``
            (varlen), ``[B, 1, H, D]`` (decode).
        lse_a, lse_b: fp32 natural-log LSEs ``[..., H, S]`` (``[B, H, S]``, ``[H, T]``,
            ``[B, H, 1]``) of any strides (e.g. a ``[S, H].t()`` view); -inf marks an empty state.
        out: optional output ``[..., S, H, D]`` of any supported float dtype (cast on store); may
            be ``o_a`` or ``o_b`` itself (in-place). Its leading dims must be flattenable.
        out_lse: optional fp32 ``[..., H, S]`` of any strides whose elements are distinct in
            memory; may be ``lse_a`` or ``lse_b`` itself (same start, shape and strides), else it
            must share no memory with the inputs or ``out``.

    Returns:
        ``(o, lse)``: o ``[..., S, H, D]`` in ``o_a.dtype`` (or ``out``), lse fp32 ``[..., H, S]``.
        Computed in fp32; (-inf, -inf) gives (0, -inf); a -inf side contributes exactly 0.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, mismatched output dtypes, a non-fp32 LSE.
        ValueError: shapes that disagree (naming the argument and shapes), tensors on different
            devices, a non-contiguous last dim of an output ``o``, leading dims of ``out`` that
            cannot be flattened, an ``out_lse`` whose elements share memory (stride 0, ``expand``)
            or that shares memory with an input or ``out`` without being ``lse_a`` / ``lse_b``.
    """
    _check_state("o_a", o_a, "lse_a", lse_a)
    _check_state("o_b", o_b, "lse_b", lse_b)
    check_same([("o_a", o_a), ("o_b", o_b)])
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a has shape {tuple(o_a.shape)} but o_b has {tuple(o_b.shape)}; they must match")
    _check_out(out, out_lse, o_a.shape, o_a.device, [("lse_a", lse_a), ("lse_b", lse_b)],
               [("o_a", o_a), ("o_b", o_b)])
    if out is None:
        out = torch.empty(o_a.shape, dtype=o_a.dtype, device=o_a.device)
    if out_lse is None:
        out_lse = torch.empty(_lse_shape(o_a.shape), dtype=torch.float32, device=o_a.device)
    if use_triton(o_a):
        _launch_merge2(o_a, lse_a, o_b, lse_b, out, out_lse)
    else:
        o, lse = _merge_reference(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
        out.copy_(o)
        out_lse.copy_(lse.transpose(-1, -2))
    return out, out_lse


def merge_attention_states_n(outs, lses, *, out=None, out_lse=None):
    """Merge N partial attention states stacked along a leading dim (N-way form).

    Args:
        outs: ``[N, ..., S, H, D]`` (fp16/bf16/fp32; last dim contiguous), e.g. ``[N, B, S, H, D]``
            or ``[N, T, H, D]``.
        lses: fp32 ``[N, ..., H, S]`` of any strides, e.g. ``[N, B, H, S]`` or ``[N, H, T]``.
        out: optional ``[..., S, H, D]`` of any supported float dtype (cast on store).
        out_lse: optional fp32 ``[..., H, S]`` of any strides whose elements are distinct in
            memory; may be one ``lses[i]`` itself, else shares no memory with the inputs or ``out``.

    Returns:
        ``(o, lse)``: o ``[..., S, H, D]`` in ``outs.dtype`` (or ``out``), lse fp32 ``[..., H, S]``.
        N = 0 gives (0, -inf). Computed in fp32; all -inf gives (0, -inf), never NaN.

    Raises:
        TypeError / ValueError as :func:`merge_attention_states`.
    """
    _check_state("outs", outs, "lses", lses, min_dim=4)
    o_shape = tuple(outs.shape[1:])
    lse_ins = [(f"lses[{i}]", lses[i]) for i in range(outs.shape[0])] if out_lse is not None else []
    _check_out(out, out_lse, o_shape, outs.device, lse_ins, [("outs", outs)])
    if out is None:
        out = torch.empty(o_shape, dtype=outs.dtype, device=outs.device)
    if out_lse is None:
        out_lse = torch.empty(_lse_shape(o_shape), dtype=torch.float32, device=outs.device)
    if outs.shape[0] == 0:
        out.zero_()
        out_lse.fill_(float("-inf"))
    elif use_triton(outs):
        _launch_mergen(outs, lses, out, out_lse)
    else:
        o, lse = _merge_reference(outs, lses)
        out.copy_(o)
        out_lse.copy_(lse.transpose(-1, -2))
    return out, out_lse


def merge_attention_states_(o_acc, lse_acc, o_b, lse_b):
    """In-place accumulation: ``(o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_b, lse_b))``.

    Shapes and dtypes as :func:`merge_attention_states` (``o_b`` must have ``o_acc``'s dtype):
    ``o_acc`` ``[..., S, H, D]`` (last dim contiguous, leading dims flattenable: any plain tensor),
    ``lse_acc`` fp32 ``[..., H, S]`` of any strides (e.g. a ``[S, H].t()`` view) whose elements
    are distinct in memory. Start an accumulator with ``o_acc = 0``, ``lse_acc = -inf``. Both are
    updated in place; returns ``(o_acc, lse_acc)``.

    Raises:
        TypeError / ValueError as :func:`merge_attention_states` (with ``out=o_acc``,
        ``out_lse=lse_acc``): e.g. ValueError for an ``expand``-ed ``lse_acc``.
    """
    return merge_attention_states(o_acc, lse_acc, o_b, lse_b, out=o_acc, out_lse=lse_acc)
