"""Launch configurations of the tiled kernels, and the one hook that overrides them.

Each kernel picks its :class:`LaunchConfig` from a small fixed rule (its ``_gpu_config``: head
dim, dtype), chosen from recorded H200 sweeps (``benchmarks/results/*.json``). Tests and
benchmarks that need another configuration wrap the call in :func:`launch_override`::

    with launch_override("block_sparse", LaunchConfig(128, 64, 8, 3)):
        out, lse = block_sparse_attn_with_lse(q, k, v, mask)

Kernel names: ``"flash_attn"`` (dense prefill), ``"block_sparse"`` (block-sparse prefill),
``"xattn_stats"`` (XAttention stage 1; ``block_n`` is raised to the strided block width).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

__all__ = ["KERNELS", "LaunchConfig", "launch_override", "override_for"]

KERNELS = ("flash_attn", "block_sparse", "xattn_stats")


class LaunchConfig(NamedTuple):
    """Tile sizes and Triton launch options of one kernel launch.

    block_m, block_n: query rows / keys per tile. num_warps, num_stages: as for any Triton kernel.
    tma: K/V (and, in flash_attn, Q) through tensor descriptors (TMA on sm_90+; block_sparse
    and flash_attn, which fall back to pointer loads in the same tiles when the tensors are not
    16-byte aligned, are fp32 or, in flash_attn, paged).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False

    def name(self) -> str:
        """Short label, e.g. ``128x64w8s3`` or ``128x128w8s3/tma``."""
        s = f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"
        return s + "/tma" if self.tma else s


_OVERRIDES: dict = {name: [] for name in KERNELS}


@contextlib.contextmanager
def launch_override(kernel_name: str, config):
    """Inside the block, ``kernel_name`` launches with ``config`` (a :class:`LaunchConfig` or a
    tuple of its fields) instead of its default rule, on the GPU and under the interpreter.
    Nests (the innermost wins). Raises ValueError for an unknown kernel name or a malformed config."""
    if kernel_name not in _OVERRIDES:
        raise ValueError(f"launch_override: unknown kernel {kernel_name!r}; known: {', '.join(KERNELS)}")
    try:
        cfg = config if isinstance(config, LaunchConfig) else LaunchConfig(*config)
    except TypeError as e:
        raise ValueError(f"launch_override: bad config {config!r} ({e})") from None
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in cfg[:4]):
        raise ValueError(f"launch_override: block sizes, warps and stages must be positive ints, got {cfg!r}")
    _OVERRIDES[kernel_name].append(cfg)
    try:
        yield cfg
    finally:
        _OVERRIDES[kernel_name].pop()


def override_for(kernel_name: str) -> Optional[LaunchConfig]:
    """The innermost :func:`launch_override` config active for ``kernel_name``, or None."""
    stack = _OVERRIDES[kernel_name]
    return stack[-1] if stack else None


def tma_ok(*tensors) -> bool:
    """TMA descriptors need 16-byte aligned base addresses and strides (last dim contiguous)."""
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or t.shape[-1] * es < 16:
            return False
        if any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


def tma_alloc(size: int, alignment: int, stream):
    """Triton allocator for the scratch of descriptors built inside a kernel."""
    return torch.empty(size, dtype=torch.int8, device="cuda")
