"""Whole-prompt causal attention without LSE: the fastest correct kernel available, in bounded memory.

Prefill of one layer needs ``softmax(q k^T) v`` over the whole prompt with ``Sq == Sk`` and no LSE
(nothing is merged afterwards). Then the fastest kernel on the machine may be used, not only ours:

* ``"cudnn"``: PyTorch SDPA restricted to the cuDNN backend (cuDNN's fused flash attention,
  ``enable_gqa=True``: K/V are not repeated). On an H200 with bf16, D=128, 32/8 heads at 32K
  tokens it ran at 601 TFLOP/s against 508 for our Triton kernel (benchmarks/results/attention.json).
* ``"xoffload"``: :func:`~xoffload.kernels.flash_attn_with_lse` (Triton; the reference on the CPU).
* ``"sdpa"``: PyTorch SDPA with its own backend choice.
* ``"auto"`` (default): ``"cudnn"`` where it can run (CUDA, fp16/bf16, ``Sq == Sk``, D a multiple
  of 8 and <= 128, PyTorch built with it), else ``"xoffload"``. If cuDNN refuses a shape at run
  time (RuntimeError), the call falls back to ``"xoffload"`` and remembers that for the shape.

Memory: the work is split over groups of KV heads (with their query heads) so the temporary output
of one group stays under ``max_tmp_bytes``; ``out`` may be ``q`` itself (in place: a group's query
rows are read before its output is written there), so a 128K-token layer of Llama-3.1-8B needs
one q-sized buffer instead of two.
"""
from __future__ import annotations

import torch

from .checks import check_out, check_qkv, default_scale, is_int
from .flash_attn import flash_attn_with_lse

__all__ = ["causal_attention", "causal_attention_backend"]

_BACKENDS = ("auto", "cudnn", "xoffload", "sdpa")
_CUDNN_REFUSED: set = set()  # (dtype, D, Hg, Hkv_g) signatures cuDNN raised on


def _cudnn_possible(q: torch.Tensor, sq: int, sk: int, d: int) -> bool:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or sq != sk:
        return False
    if d % 8 != 0 or d > 128:
        return False
    try:
        from torch.nn.attention import SDPBackend  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch.backends.cudnn, "is_available", lambda: False)())


def causal_attention_backend(q: torch.Tensor, k: torch.Tensor, backend: str = "auto") -> str:
    """The backend :func:`causal_attention` uses for these inputs: ``"cudnn"`` or ``"xoffload"``
    for ``"auto"``, else ``backend`` itself. Raises ValueError for an unknown backend name."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    d = q.shape[-1]
    hq, hkv = q.shape[2], k.shape[2]
    if _cudnn_possible(q, q.shape[1], k.shape[1], d) and (q.dtype, d, hq, hkv) not in _CUDNN_REFUSED:
        return "cudnn"
    return "xoffload"


def _sdpa(q, k, v, scale, cudnn_only: bool):
    import torch.nn.functional as F

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views, no copy
    gqa = q.shape[2] != k.shape[2]
    if cudnn_only:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)  # [B, S, Hg, D] (a view of SDPA's output)


def _ours(q, k, v, scale):
    return flash_attn_with_lse(q, k, v, causal=True, softmax_scale=scale)[0]


def causal_attention(q, k, v, *, softmax_scale=None, backend: str = "auto", out=None,
                     max_tmp_bytes: int = 256 << 20):
    """Causal attention of a whole prompt, no LSE, with the fastest available kernel.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16/bf16/fp32, last dim contiguous (other strides allowed).
        k, v: ``[B, Sk, Hkv, D]`` same dtype/device, ``Hq % Hkv == 0``. Causal is bottom-right
            aligned (query i sees key j iff ``j <= i + Sk - Sq``); with ``Sq == Sk`` that is the
            usual lower triangle. ``"cudnn"``/``"sdpa"`` need ``Sq == Sk`` (their ``is_causal`` is
            top-left aligned).
        softmax_scale: default ``1/sqrt(D)``.
        backend: ``"auto"``, ``"cudnn"``, ``"xoffload"`` or ``"sdpa"`` (module docstring).
        out: optional ``[B, Sq, Hq, D]`` destination in q's dtype, last dim contiguous; may be
            ``q`` itself (in place). Default: a new tensor.
        max_tmp_bytes: bound (bytes) on the temporary output of one group of KV heads; the heads are
            processed in the fewest groups (divisors of Hkv) that respect it. Every kernel runs on
            whole groups, so results do not depend on it.

    Returns:
        ``out`` ``[B, Sq, Hq, D]`` in q's dtype. Rows that see no key (only when ``Sq > Sk``) are 0.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes (``out`` included).
        ValueError: bad ranks/shapes, GQA ratio, unknown backend, ``"cudnn"``/``"sdpa"`` with
            ``Sq != Sk``, a bad ``out``, ``max_tmp_bytes < 1``.
        RuntimeError: ``backend="cudnn"`` where PyTorch's cuDNN attention cannot run (CPU tensors,
            fp32, ``Sq != Sk``, an unsupported head_dim, or cuDNN refusing the call).
    """
    check_qkv(q, k, v, 4, "[B, Sk, Hkv, D]", same_batch=True)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = default_scale(d, softmax_scale)
    if not is_int(max_tmp_bytes) or max_tmp_bytes < 1:
        raise ValueError(f"max_tmp_bytes must be an int >= 1, got {max_tmp_bytes!r}")
    chosen = causal_attention_backend(q, k, backend)
    if chosen == "cudnn" and not _cudnn_possible(q, sq, sk, d):
        raise RuntimeError(f"backend 'cudnn' needs CUDA fp16/bf16 tensors with Sq == Sk, D a multiple of 8 "
                           f"and <= 128, and PyTorch with cuDNN; got {q.dtype} on {q.device}, Sq={sq}, "
                           f"Sk={sk}, D={d}: use backend='auto' or 'xoffload'")
    if chosen in ("cudnn", "sdpa") and sq != sk:
        raise ValueError(f"backend {chosen!r} needs Sq == Sk (its causal mask is top-left aligned); got "
                         f"Sq={sq}, Sk={sk}: use backend='xoffload'")
    if out is None:
        out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    else:
        check_out("out", out, (b, sq, hq, d), q.dtype, q.device)
    if out.numel() == 0:
        return out
    return _by_head_groups(q, k, v, out, scale, chosen, backend, max_tmp_bytes)


def _by_head_groups(q, k, v, out, scale, chosen, backend, max_tmp_bytes):
    """Run ``chosen`` over the fewest groups of KV heads (divisors of Hkv) whose temporary output
    stays under ``max_tmp_bytes``, copying each group's output into ``out``."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    per_kv_head = b * sq * group * d * q.element_size()
    n_groups = hkv
    for g in range(1, hkv + 1):  # fewest groups that divide Hkv and keep a group's output small
        if hkv % g == 0 and per_kv_head * (hkv // g) <= max_tmp_bytes:
            n_groups = g
            break
    kv_per = hkv // n_groups
    for gi in range(n_groups):
        ks, ke = gi * kv_per, (gi + 1) * kv_per
        qs, qe = ks * group, ke * group
        qg, kg, vg = q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke]
        if chosen == "cudnn":
            try:
                og = _sdpa(qg, kg, vg, scale, cudnn_only=True)
            except RuntimeError:
                if backend == "cudnn":
                    raise
                _CUDNN_REFUSED.add((q.dtype, d, hq, hkv))
                chosen = "xoffload"
                og = _ours(qg, kg, vg, scale)
        elif chosen == "sdpa":
            og = _sdpa(qg, kg, vg, scale, cudnn_only=False)
        else:
            og = _ours(qg, kg, vg, scale)
        out[:, :, qs:qe].copy_(og)
        del og
    return out
