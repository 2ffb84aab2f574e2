"""Fused RMSNorm (Zhang & Sennrich 2019) with HF Llama's rounding order, one read and one write.

    y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)

The mean and the scaling run in fp32; the normalized value is rounded to ``x.dtype`` first and only
then multiplied by the weight, the product rounded once to ``x.dtype`` (as ``w * xf.to(x.dtype)``
in PyTorch/HF Llama, whose half-precision multiply is an fp32 multiply rounded once: the product of
two fp16/bf16 numbers is exact in fp32, so the two agree bit for bit up to the fp32 mean/rsqrt).

CUDA tensors run the Triton kernel; CPU tensors run :func:`rms_norm_ref`, or the Triton code under
``TRITON_INTERPRET=1`` (see :mod:`xoffload.kernels.checks`).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .checks import check_eps, check_out, check_tensor, next_pow2, use_triton

__all__ = ["rms_norm", "rms_norm_ref"]

# rows up to this many (padded) elements are held in registers (one read); longer rows loop twice
MAX_FUSED_H = 16384


@triton.jit
def _rms_norm_kernel(
    X, W, Y, N, H, sx, sy, eps,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    x_row = X + r64[:, None] * sx
    y_row = Y + r64[:, None] * sy
    if SINGLE:
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        msk = rmask[:, None] & cmask[None, :]
        x = tl.load(x_row + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / H
        r = tl.math.rsqrt(ms + eps)
        xn = (x * r[:, None]).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(y_row + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=msk)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            msk = rmask[:, None] & (cols < H)[None, :]
            x = tl.load(x_row + cols[None, :], mask=msk, other=0.0).to(tl.float32)
            acc += x * x
        ms = tl.sum(acc, axis=1) / H
        r = tl.math.rsqrt(ms + eps)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            msk = rmask[:, None] & cmask[None, :]
            x = tl.load(x_row + cols[None, :], mask=msk, other=0.0).to(tl.float32)
            xn = (x * r[:, None]).to(Y.dtype.element_ty).to(tl.float32)
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(y_row + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=msk)


def launch_config(h: int) -> dict:
    """Launch parameters for rows of ``h`` elements (memory-bound: ~4K elements per program).

    ``BLOCK_H``: padded row (or the chunk of a row longer than :data:`MAX_FUSED_H`); ``BLOCK_M``:
    rows per program; ``SINGLE``: the whole row is held in registers (one read of x).
    """
    bh = next_pow2(max(h, 16))
    if bh <= MAX_FUSED_H:
        bm = max(1, min(64, 4096 // bh))
        warps = max(4, min(16, (bm * bh) // 512))
        return {"BLOCK_M": bm, "BLOCK_H": bh, "SINGLE": True, "num_warps": warps}
    return {"BLOCK_M": 1, "BLOCK_H": 4096, "SINGLE": False, "num_warps": 8}


def _launch(x, weight, out, eps, config=None):
    n, h = x.shape
    cfg = dict(launch_config(h))
    if config:
        cfg.update(config)
    grid = (triton.cdiv(n, cfg["BLOCK_M"]),)
    _rms_norm_kernel[grid](x, weight, out, n, h, x.stride(0), out.stride(0), float(eps), **cfg)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch version with the kernel's rounding points: fp32 statistics, normalized value rounded
    to ``x.dtype``, product with the weight in fp32 rounded once to ``x.dtype``. x ``[N, H]``."""
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (xn.float() * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None):
    """RMSNorm over the last dim in one pass: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    Same semantics as ``xoffload.models.llama.rms_norm`` (HF Llama): statistics in fp32, the
    normalized value rounded to ``x.dtype``, then multiplied by ``weight`` with one rounding to
    ``x.dtype``.

    Args:
        x: ``[N, H]`` fp16/bf16/fp32; rows may be strided, the last dim must be contiguous. N >= 0.
        weight: ``[H]`` fp16/bf16/fp32 (normally ``x``'s dtype; another dtype is read exactly and the
            product is still rounded once to ``x.dtype``), contiguous, on ``x``'s device.
        eps: added to the mean of squares; a finite float >= 0.
        out: optional ``[N, H]`` output in ``x.dtype`` (rows may be strided); may be ``x`` itself.

    Returns:
        ``y`` ``[N, H]`` in ``x.dtype`` (``out`` when given).

    Raises:
        TypeError: a non-tensor, an unsupported dtype, ``out`` of another dtype than ``x``.
        ValueError: ``x`` not 2-D, ``weight`` not ``[H]``, ``out`` not ``[N, H]``, a non-contiguous
            last dim, tensors on different devices, a negative or non-finite ``eps``.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("weight", weight, ndim=1)
    n, h = x.shape
    if tuple(weight.shape) != (h,):
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x {tuple(x.shape)} needs [H] = ({h},)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    check_eps(eps)
    if out is None:
        out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    else:
        check_out("out", out, (n, h), x.dtype, x.device)
    if n == 0 or h == 0:
        return out
    if use_triton(x):
        _launch(x, weight, out, eps)
    else:
        out.copy_(rms_norm_ref(x, weight, eps))
    return out
