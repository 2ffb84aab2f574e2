"""Block gather: copy a list of KV blocks out of the (pinned) host pool into device memory in one
kernel launch.

One ``cudaMemcpyAsync`` per block is limited by per-copy overhead below ~1 MiB per copy (64 KiB
pieces reach ~8 GB/s on the H200); a Triton kernel that reads pinned host memory directly over
UVA reaches ~51 GB/s (DESIGN.md, Runtime). The kernel is handed, for the host arguments, a small
object exposing the pinned tensor's ``data_ptr()`` and ``dtype``; Triton's launcher maps the host
pointer to its device alias (``cuPointerGetAttribute``), which exists for memory registered with
``cudaHostRegister``.

On CPU tensors the kernel runs under Triton's interpreter when it is on (``TRITON_INTERPRET=1``),
else a torch ``index_select`` fallback runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import HostPtr, interpreter_on, next_pow2  # noqa: F401 (HostPtr re-exported)

DEFAULT_BLOCK = 8192  # elements per program per tensor (16 KiB of bf16)
DEFAULT_WARPS = 8

_MAX_GRID_Y = 65535
_HOST_ARG = ["ptr"]  # how host sources are handed to Triton: HostPtr, or the tensor if that fails


@triton.jit
def _copy_block(src_k, src_v, dst_k, dst_v, src, dst, offs, block_elems, EVEN: tl.constexpr):
    if EVEN:
        kk = tl.load(src_k + src)
        vv = tl.load(src_v + src)
        tl.store(dst_k + dst, kk)
        tl.store(dst_v + dst, vv)
    else:
        m = offs < block_elems
        kk = tl.load(src_k + src, mask=m)
        vv = tl.load(src_v + src, mask=m)
        tl.store(dst_k + dst, kk, mask=m)
        tl.store(dst_v + dst, vv, mask=m)


@triton.jit
def _gather_blocks_kernel(src_k, src_v, dst_k, dst_v, ids_ptr, block_elems,
                          BLOCK: tl.constexpr, EVEN: tl.constexpr, SKIP: tl.constexpr):
    c = tl.program_id(0)  # chunk inside a block
    i = tl.program_id(1)  # position in the id list
    b = tl.load(ids_ptr + i).to(tl.int64)
    offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src = b * block_elems + offs
    dst = i.to(tl.int64) * block_elems + offs
    if SKIP:  # a negative id: nothing read, the output block left as it is
        if b >= 0:
            _copy_block(src_k, src_v, dst_k, dst_v, src, dst, offs, block_elems, EVEN)
    else:
        _copy_block(src_k, src_v, dst_k, dst_v, src, dst, offs, block_elems, EVEN)


_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check(src_k, src_v, ids, out_k, out_v):
    for n, t in (("src_k", src_k), ("src_v", src_v), ("out_k", out_k), ("out_v", out_v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{n} must be contiguous, got strides {tuple(t.stride())}")
    if src_k.shape != src_v.shape or src_k.dtype != src_v.dtype:
        raise ValueError(f"src_k {tuple(src_k.shape)} {src_k.dtype} and src_v {tuple(src_v.shape)} {src_v.dtype} differ")
    if src_k.dim() < 1:
        raise ValueError("src_k must be [num_blocks, ...]")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise TypeError(f"block_ids must be a 1-D int32/int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    want = (ids.shape[0],) + tuple(src_k.shape[1:])
    for n, t in (("out_k", out_k), ("out_v", out_v)):
        if tuple(t.shape) != want or t.dtype != src_k.dtype:
            raise ValueError(f"{n} must be {want} {src_k.dtype}, got {tuple(t.shape)} {t.dtype}")
    if ids.device != out_k.device or out_v.device != out_k.device:
        raise ValueError(f"block_ids ({ids.device}), out_k ({out_k.device}), out_v ({out_v.device}) must share a device")


def gather_blocks(src_k: torch.Tensor, src_v: torch.Tensor, block_ids: torch.Tensor,
                  out_k: torch.Tensor, out_v: torch.Tensor, *, block: int = DEFAULT_BLOCK,
                  num_warps: int = DEFAULT_WARPS, backend: str | None = None,
                  skip_negative: bool = False) -> None:
    """``out_k[i] = src_k[block_ids[i]]`` and the same for V, for every i, in one launch.

    Args:
        src_k, src_v: contiguous ``[num_blocks, ...]`` source blocks: pinned (registered) host
            memory, or device memory, or plain CPU memory (fallback / interpreter).
        block_ids: 1-D int32/int64 tensor on the output device; ids must be in ``[0, num_blocks)``
            (not checked on the device; the caller validates), or negative with ``skip_negative``.
        out_k, out_v: contiguous ``[len(block_ids), ...]`` outputs of the sources' dtype.
        block, num_warps: kernel tuning (elements per program per tensor, warps).
        backend: ``"triton"``, ``"torch"`` or None (Triton for CUDA outputs or under the
            interpreter, else torch).
        skip_negative: a negative id copies nothing (``out_k[i]`` / ``out_v[i]`` keep what they
            held and no source byte is read): a fixed-length id list, e.g. one captured in a CUDA
            graph, that copies only the entries a step needs. The id list is read on the device
            only (no host sync).

    Runs on the current stream; the caller orders it after writes to the sources (events).
    Raises TypeError/ValueError for mismatched shapes, dtypes or devices.
    """
    _check(src_k, src_v, block_ids, out_k, out_v)
    n = block_ids.shape[0]
    if n == 0:
        return
    if backend is None:
        backend = "triton" if (out_k.is_cuda or interpreter_on()) else "torch"
    if backend == "torch":
        if skip_negative:
            keep = (block_ids >= 0).view((-1,) + (1,) * (src_k.dim() - 1))
            idx = block_ids.clamp(min=0).to(src_k.device)
            out_k.copy_(torch.where(keep, src_k.index_select(0, idx).to(out_k.device), out_k))
            out_v.copy_(torch.where(keep, src_v.index_select(0, idx).to(out_v.device), out_v))
            return
        idx = block_ids.to(src_k.device)
        if src_k.device == out_k.device:
            torch.index_select(src_k, 0, idx, out=out_k)
            torch.index_select(src_v, 0, idx, out=out_v)
        else:
            out_k.copy_(src_k.index_select(0, idx))
            out_v.copy_(src_v.index_select(0, idx))
        return
    if backend != "triton":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    raw = _RAW[src_k.element_size()]
    block_elems = src_k[0].numel()
    host_src = out_k.is_cuda and not src_k.is_cuda
    if host_src and _HOST_ARG[0] == "ptr":
        sk, sv = HostPtr(src_k, raw), HostPtr(src_v, raw)
    else:
        sk, sv = src_k.view(raw), src_v.view(raw)
    dk, dv = out_k.view(raw), out_v.view(raw)
    blk = min(block, next_pow2(block_elems))
    kern = _gather_blocks_kernel
    for i0 in range(0, n, _MAX_GRID_Y):  # grid dim 1 is limited to 65535
        i1 = min(n, i0 + _MAX_GRID_Y)
        if i0 == 0 and i1 == n:
            ids, ok, ov = block_ids, dk, dv
        else:
            ids, ok, ov = block_ids[i0:i1], dk[i0:i1], dv[i0:i1]
        grid = (triton.cdiv(block_elems, blk), i1 - i0)
        try:
            kern[grid](sk, sv, ok, ov, ids, block_elems, BLOCK=blk, EVEN=(block_elems % blk == 0),
                       SKIP=bool(skip_negative), num_warps=num_warps)
        except (TypeError, ValueError, AttributeError, KeyError):
            # argument processing failed before any launch: retry once with the host tensors
            # themselves (Triton maps registered host pointers through cuPointerGetAttribute)
            if not (host_src and _HOST_ARG[0] == "ptr"):
                raise
            _HOST_ARG[0] = "tensor"
            sk, sv = src_k.view(raw), src_v.view(raw)
            kern[grid](sk, sv, ok, ov, ids, block_elems, BLOCK=blk, EVEN=(block_elems % blk == 0),
                       SKIP=bool(skip_negative), num_warps=num_warps)

