"""Fused SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``
read from the stacked gate/up projection output, one read of each half, one write.

Rounding follows PyTorch eager / HF Llama's MLP (``act_fn(gate) * up`` in the model dtype): silu
is computed in fp32 and rounded to the input dtype, then multiplied by ``up`` in fp32 and rounded
once more (a product of two fp16/bf16 numbers is exact in fp32, so that multiply matches PyTorch's
half-precision multiply bit for bit; only the fp32 ``exp`` may differ in the last fp32 bits).

CUDA tensors run the Triton kernel; CPU tensors run :func:`silu_mul_ref`, or the Triton code under
``TRITON_INTERPRET=1`` (see :mod:`xoffload.kernels.checks`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_int, check_out, check_tensor, next_pow2, use_triton

__all__ = ["silu_mul", "silu_mul_ref"]


@triton.jit
def _silu_mul_kernel(GU, A, I, s_gu, s_a, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = cols < I
    g_ptr = GU + row * s_gu + cols
    g = tl.load(g_ptr, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + I, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(A.dtype.element_ty).to(tl.float32)
    tl.store(A + row * s_a + cols, (s * u).to(A.dtype.element_ty), mask=m)


def launch_config(i: int) -> dict:
    """Launch parameters for ``i`` output columns per row: ``BLOCK_I`` columns per program (grid
    ``(N, cdiv(I, BLOCK_I))``), 8 elements (16 B of bf16) per thread."""
    bi = min(2048, next_pow2(max(i, 64)))
    return {"BLOCK_I": bi, "num_warps": max(1, min(8, bi // 256))}


def _launch(gate_up, out, i, config=None):
    n = gate_up.shape[0]
    cfg = dict(launch_config(i))
    if config:
        cfg.update(config)
    grid = (n, triton.cdiv(i, cfg["BLOCK_I"]))
    _silu_mul_kernel[grid](gate_up, out, i, gate_up.stride(0), out.stride(0), **cfg)


def silu_mul_ref(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """PyTorch version with the kernel's rounding points (silu in fp32 rounded to the input dtype,
    product in fp32 rounded once). gate_up ``[N, 2*I]``; returns ``[N, I]``."""
    g = gate_up[:, :intermediate].float()
    u = gate_up[:, intermediate:].float()
    return (F.silu(g).to(gate_up.dtype).float() * u).to(gate_up.dtype)


def silu_mul(gate_up: torch.Tensor, intermediate: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` of the stacked gate/up projection output.

    Same result as ``F.silu(gate_up[:, :I]) * gate_up[:, I:]`` in the input dtype (the MLP of
    ``xoffload.models.llama`` and HF Llama), computed in fp32 with that code's two roundings.

    Args:
        gate_up: ``[N, 2*I]`` fp16/bf16/fp32 (gate in columns ``[0, I)``, up in ``[I, 2I)``, as
            ``x @ w_gate_up.t()`` gives); rows may be strided, the last dim must be contiguous.
        intermediate: ``I`` (a positive int), the MLP's intermediate size.
        out: optional ``[N, I]`` output in ``gate_up``'s dtype (rows may be strided; may be the
            view ``gate_up[:, :I]``: each element is read before it is written).

    Returns:
        ``a`` ``[N, I]`` in ``gate_up.dtype`` (``out`` when given).

    Raises:
        TypeError: a non-tensor, an unsupported dtype, a non-int ``intermediate``, ``out`` of
            another dtype.
        ValueError: ``gate_up`` not 2-D or its width not ``2 * intermediate``, ``out`` not
            ``[N, I]`` or on another device, a non-contiguous last dim.
    """
    check_tensor("gate_up", gate_up, ndim=2)
    intermediate = check_int("intermediate", intermediate, 1)
    n, w = gate_up.shape
    if w != 2 * intermediate:
        raise ValueError(
            f"gate_up has shape {tuple(gate_up.shape)} but intermediate={intermediate} needs "
            f"[N, 2*I] = [N, {2 * intermediate}]"
        )
    if out is None:
        out = torch.empty((n, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    else:
        check_out("out", out, (n, intermediate), gate_up.dtype, gate_up.device)
    if n == 0:
        return out
    if use_triton(gate_up):
        _launch(gate_up, out, intermediate)
    else:
        out.copy_(silu_mul_ref(gate_up, intermediate))
    return out
