"""FP8 (e4m3) KV pages: quantization to ``torch.float8_e4m3fn`` with fp32 scales, dequantization,
the scale checks of the attention kernels that read such pages, and the GPU capability check.

Format. Each value is stored as ``q = e4m3(x / scale)``, read back as ``q * scale``. e4m3
(``float8_e4m3fn``) has 1 sign, 4 exponent and 3 mantissa bits, no infinities, largest finite
value 448, smallest normal 2^-6, subnormals down to 2^-9. The scale is fp32, one per group:

* ``granularity="page"``: one per (page, KV head), over the page's tokens and the head's D
  channels: ``[num_pages, Hkv]``;
* ``granularity="token"``: one per (token, KV head), over D channels: ``x.shape[:-1]``.

``scale = amax / 448`` (correctly rounded fp32 division; floored at 2^-126, the smallest normal
fp32, so ``x / scale`` cannot overflow; 1 for an all-zero group). ``x / scale`` (correctly rounded)
is clamped to ``[-448, 448]`` (saturation: finite inputs never give inf or NaN) and rounded to
the nearest e4m3 value, ties to even. So each element's error is at most half an e4m3 ulp of its
scaled value: ``|x - q * scale| <= scale * max(|x / scale| * 2^-4, 2^-10)`` (2^-4: half of 3
mantissa bits' ulp, relative; 2^-10: half the subnormal spacing 2^-9). The Triton kernel does the
rounding itself in fp32 integer/float arithmetic and casts only exact e4m3 values (Triton's
interpreter rounds its own fp32 -> fp8 casts differently: ties away from zero, wrong subnormals,
NaN past 448), so the kernel equals the torch reference bit for bit on the GPU and under the
interpreter. On sm_90 both divisions compile to IEEE ``div.rn.f32`` (no approximate division, no
flush to zero), the one fused multiply-add contracts an exact power-of-two product, and the final
cast is ``cvt.rn.satfinite.e4m3x2.f32`` of exact values (``test_compile_sm90`` checks the PTX).
The reference divides by a tensor, never by the number 448 (PyTorch's CUDA division by a Python
number multiplies by its reciprocal: :func:`reference.fp8_scale_from_amax`).

Layouts (those of :func:`~xoffload.kernels.paged_decode.paged_decode_attn_with_lse`'s stores):
a row store ``[T, Hkv, D]`` whose pages are ``page_size`` consecutive rows (the last may be
partial; page scales ``[ceil(T / page_size), Hkv]``, token scales ``[T, Hkv]``) or a block store
``[num_pages, page_size, Hkv, D]`` (page scales ``[num_pages, Hkv]``, token scales
``[num_pages, page_size, Hkv]``).

Dequantization happens where the values are used: the decode kernels (paged and contiguous,
``k_scale`` / ``v_scale``) load e4m3 tiles, convert them to fp16 (exact: every e4m3 value is an
fp16 value; two codes per ``cvt.rn.f16x2.e4m3x2``), take a bf16 q as fp16 rows scaled by powers
of two, and apply the scales in fp32 around their two ``tl.dot`` s (``decode._attend_tile``);
:func:`dequantize_kv_fp8` (torch) serves the CPU and the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .checks import check_tensor, device_can_read_host, is_int, next_pow2, use_triton

__all__ = ["FP8_DTYPE", "FP8_MAX", "check_fp8_supported", "dequantize_kv_fp8", "fp8_scale_shape", "quantize_kv_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = reference.FP8_E4M3_MAX
GRANULARITIES = ("page", "token")
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) convert e4m3 in hardware
_SUPPORTED: dict = {}


def check_fp8_supported(device) -> None:
    """Raise RuntimeError unless ``device`` can run the fp8 kernels: a CPU (torch reference or
    Triton's interpreter) or a CUDA GPU of compute capability >= 8.9 (Ada, Hopper and later:
    Triton's ``float8e4nv`` conversions). The message names the device and its capability. Meant to
    be called once when an fp8 KV cache is built; the fp8 entry points call it too (cached)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SUPPORTED:
        cap = tuple(torch.cuda.get_device_capability(idx))
        _SUPPORTED[idx] = (cap >= _FP8_CAPABILITY, cap, torch.cuda.get_device_name(idx))
    ok, cap, name = _SUPPORTED[idx]
    if not ok:
        raise RuntimeError(f"an fp8 (e4m3) KV cache needs a GPU of compute capability >= 8.9 (Ada, Hopper or later); "
                           f"cuda:{idx} ({name}) has {cap[0]}.{cap[1]}: use a 16-bit KV cache on this GPU")


def _check_granularity(granularity) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be 'page' or 'token', got {granularity!r}")
    return granularity


def _layout(name, x, page_size) -> int:
    """The page size of a row (``[T, Hkv, D]``, page_size required) or block store
    (``[num_pages, page_size, Hkv, D]``, page_size optional and must agree)."""
    if x.dim() == 4:
        if page_size is not None and page_size != x.shape[1]:
            raise ValueError(f"page_size={page_size!r} but {name} {tuple(x.shape)} = [num_pages, page_size, Hkv, D] "
                             f"has pages of {x.shape[1]} tokens")
        return int(x.shape[1])
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, Hkv, D] (rows) or [num_pages, page_size, Hkv, D] (blocks), "
                         f"got shape {tuple(x.shape)}")
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be a positive int for a row layout {name} {tuple(x.shape)}, "
                         f"got {page_size!r}")
    return int(page_size)


def fp8_scale_shape(shape, page_size: int, granularity: str = "page") -> tuple:
    """Shape of the fp32 scales of a K/V tensor ``shape`` (row ``[T, Hkv, D]`` or block
    ``[num_pages, page_size, Hkv, D]``): page ``[ceil(T / page_size), Hkv]`` / ``[num_pages, Hkv]``,
    token ``shape[:-1]``."""
    shape = tuple(shape)
    if granularity == "token":
        return shape[:-1]
    if len(shape) == 4:
        return (shape[0], shape[2])
    return (-(-shape[0] // page_size), shape[1])


def _check_scale(name, scale, shape, device, allow_host: bool):
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be fp32, got {scale.dtype}")
    if tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}, expected {tuple(shape)}")
    if scale.device != torch.device(device):
        if not (allow_host and scale.device.type == "cpu" and device_can_read_host(scale)):
            raise ValueError(f"{name} is on {scale.device}, expected {device}"
                             + (" or pinned host memory" if allow_host else ""))


def quantize_kv_fp8(x, *, page_size=None, granularity="page", out=None, scale_out=None):
    """Quantize K or V pages to fp8 e4m3 with fp32 scales (see the module docstring for the format).

    Args:
        x: fp16/bf16/fp32, a row store ``[T, Hkv, D]`` (pages of ``page_size`` consecutive rows,
            the last may be partial) or a block store ``[num_pages, page_size, Hkv, D]``; only the
            last dim must be contiguous. Values must be finite (inf / NaN give NaN scales).
        page_size: tokens per page (any int >= 1); required for a row store, else taken from
            ``x.shape[1]`` (a given value must agree).
        granularity: ``"page"`` (a scale per (page, KV head)) or ``"token"`` (per (token, KV head)).
        out: optional ``float8_e4m3fn`` tensor of x's shape on x's device (last dim contiguous).
        scale_out: optional fp32 tensor of :func:`fp8_scale_shape` on x's device.

    Returns:
        ``(q, scale)``: q ``float8_e4m3fn`` of x's shape, scale fp32 (``[num_pages, Hkv]`` for
        pages, ``x.shape[:-1]`` for tokens), dequantized value ``q * scale`` in x's units.

    Raises:
        TypeError: x not a tensor or of another dtype, out / scale_out of the wrong dtype.
        ValueError: wrong ranks, a non-contiguous last dim, a bad page_size or granularity, out /
            scale_out of the wrong shape or device.
        RuntimeError: a CUDA x on a GPU without fp8 support (:func:`check_fp8_supported`).
    """
    check_tensor("x", x, dtypes=_IN_DTYPES)
    page_size = _layout("x", x, page_size)
    granularity = _check_granularity(granularity)
    sshape = fp8_scale_shape(x.shape, page_size, granularity)
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    else:
        check_tensor("out", out, dtypes=(FP8_DTYPE,))
        if out.shape != x.shape or out.device != x.device:
            raise ValueError(f"out has shape {tuple(out.shape)} on {out.device}, expected {tuple(x.shape)} on {x.device}")
    if scale_out is None:
        scale_out = torch.empty(sshape, dtype=torch.float32, device=x.device)
    else:
        _check_scale("scale_out", scale_out, sshape, x.device, allow_host=False)
    if x.is_cuda:
        check_fp8_supported(x.device)
    if x.numel() == 0:
        scale_out.fill_(1.0)
        return out, scale_out
    if use_triton(x):
        _quantize_triton(x, out, scale_out, page_size, granularity == "token")
    else:
        q, s = reference.quantize_kv_fp8_ref(x, page_size=page_size, granularity=granularity)
        out.copy_(q)
        scale_out.copy_(s)
    return out, scale_out


def dequantize_kv_fp8(q, scale, dtype=torch.bfloat16, *, page_size=None, granularity=None):
    """``q * scale`` in ``dtype`` (torch; the CPU path and the tests' reference).

    Args:
        q: ``float8_e4m3fn``, row ``[T, Hkv, D]`` or block ``[num_pages, page_size, Hkv, D]`` layout.
        scale: fp32, the scales :func:`quantize_kv_fp8` gave for q, on q's device.
        dtype: the output's dtype (fp16, bf16 or fp32).
        page_size: required for a row layout with page scales; else from ``q.shape[1]``.
        granularity: ``"page"`` / ``"token"``; default: read from scale's shape (``q.shape[:-1]``
            means per token).

    Returns: a tensor of q's shape in ``dtype`` (exact in fp32; rounded once for 16-bit dtypes).

    Raises: TypeError (dtypes), ValueError (shapes, page_size, granularity, devices).
    """
    check_tensor("q", q, dtypes=(FP8_DTYPE,))
    if dtype not in _IN_DTYPES:
        raise TypeError(f"dtype must be fp16, bf16 or fp32, got {dtype}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if granularity is None:
        granularity = "token" if tuple(scale.shape) == tuple(q.shape[:-1]) else "page"
    granularity = _check_granularity(granularity)
    if granularity == "token" and q.dim() == 3:
        page_size = 1 if page_size is None else page_size
    page_size = _layout("q", q, page_size)
    _check_scale("scale", scale, fp8_scale_shape(q.shape, page_size, granularity), q.device, allow_host=False)
    return reference.dequantize_kv_fp8_ref(q, scale, page_size=page_size, granularity=granularity, dtype=dtype)


def _scales_present(k, k_scale, v_scale, what: str) -> bool:
    """True for float8_e4m3fn ``k`` with both scales given as tensors; False for 16-bit ``k`` with
    none. Raises ValueError (a scale missing or unexpected) or TypeError (not a tensor)."""
    if k.dtype != FP8_DTYPE:
        for n, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{n} is given but {what} are {k.dtype}: scales belong to float8_e4m3fn "
                                 f"caches only")
        return False
    for n, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{what} are float8_e4m3fn: {n} (fp32, per (page, KV head) or (token, KV head)) "
                             f"is required")
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(s).__name__}")
    return True


def check_cache_scales(k_cache, v_cache, k_scale, v_scale, scale_page_size, device):
    """The scales of a contiguous cache ``[B_cache, S_max, Hkv, D]`` (dense decode): None for
    16-bit caches (scales and ``scale_page_size`` must then be None), else the tokens per scale:
    1 for token scales ``[B_cache, S_max, Hkv]`` (``scale_page_size`` None), P for page scales
    ``[B_cache, ceil(S_max / P), Hkv]`` (``scale_page_size=P``: cache positions ``[j*P, (j+1)*P)``
    share scale j). fp32 on ``device``. Raises TypeError / ValueError naming the argument."""
    if not _scales_present(k_cache, k_scale, v_scale, "k_cache/v_cache"):
        if scale_page_size is not None:
            raise ValueError(f"scale_page_size={scale_page_size!r} is given but k_cache/v_cache are "
                             f"{k_cache.dtype}: it sizes the scales of float8_e4m3fn caches only")
        return None
    bc, s_max, hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if scale_page_size is None:
        page, shape = 1, (bc, s_max, hkv)
    else:
        if not is_int(scale_page_size) or scale_page_size < 1:
            raise ValueError(f"scale_page_size must be a positive int (tokens per scale) or None (a scale per "
                             f"token), got {scale_page_size!r}")
        page, shape = int(scale_page_size), (bc, -(-s_max // int(scale_page_size)), hkv)
    for n, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(n, s, shape, device, allow_host=False)
    return page


def check_kv_scales(k_pages, v_pages, k_scale, v_scale, page_size: int, device):
    """The scales of a paged attention call's store: None for 16-bit k/v (then both scales must
    be None), else ``"page"`` or ``"token"``, read from the shapes (both the same): for a row store
    ``[R, Hkv, D]`` page ``[ceil(R / page_size), Hkv]`` or token ``[R, Hkv]``, for a block store
    ``[num_blocks, page_size, Hkv, D]`` page ``[num_blocks, Hkv]`` or token
    ``[num_blocks, page_size, Hkv]``. fp32, on ``device`` or (a GPU call) pinned host memory.
    Raises TypeError (not tensors, not fp32) or ValueError (missing, unexpected, wrong shape or
    device), naming the argument."""
    if not _scales_present(k_pages, k_scale, v_scale, "k_pages/v_pages"):
        return None
    gran = "token" if tuple(k_scale.shape) == tuple(k_pages.shape[:-1]) else "page"
    for n, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(n, s, fp8_scale_shape(k_pages.shape, page_size, gran), device, allow_host=True)
    return gran


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _scale_of(amax):
    """fp32 scale of a group from its absolute maximum (:func:`reference.fp8_scale_from_amax`)."""
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # 2^-126
    return tl.where(amax > 0.0, s, 1.0)


@triton.jit
def _to_e4m3(x, scale):
    """``x / scale`` (correctly rounded) clamped to [-448, 448] and rounded to the nearest e4m3
    value, ties to even, in exact fp32 arithmetic: the spacing of e4m3 values around ``|y|`` is
    ``2^(max(e, -6) - 3)`` with e the binary exponent of ``|y|`` (2^-9 for subnormals), and
    ``|y| / spacing`` < 16 rounds as an integer. The result is an exact e4m3 value, so the cast
    does no rounding of its own."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    neg = y.to(tl.int32, bitcast=True) < 0
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    t = a * ((130 - e) << 23).to(tl.float32, bitcast=True)  # a / step, exact: a power-of-two scaling
    f = t.to(tl.int32)  # floor (t >= 0)
    d = t - f.to(tl.float32)
    up = (d > 0.5) | ((d == 0.5) & ((f & 1) == 1))
    r = (f + up.to(tl.int32)).to(tl.float32) * step
    # the sign goes on as a bit (a negative value that rounds to zero stays -0, as torch's cast
    # gives it: float negation of 0 may be folded to +0 when the compiler ignores signed zeros)
    sign = neg.to(tl.int32) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    X, Q, S, T_TOTAL, D,
    s_xp, s_xt, s_xh, s_qp, s_qt, s_qh, s_sp, s_st, s_sh,
    PAGE: tl.constexpr, TOKEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: page ``program_id(0)`` of KV head ``program_id(1)``; token t of the page is at
    ``p * s_xp + t * s_xt`` (a row store: ``s_xp = PAGE * s_xt``) and exists iff
    ``p * PAGE + t < T_TOTAL``. TOKEN: one pass, a scale per row (``S + p*s_sp + t*s_st``); else
    two passes over the page (max, then quantize) and one scale at ``S + p*s_sp``."""
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    x_base = X + p * s_xp + h * s_xh
    q_base = Q + p * s_qp + h * s_qh
    n_tok = tl.minimum(T_TOTAL - p * PAGE, PAGE)
    if TOKEN:
        for t0 in range(0, PAGE, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            m = (offs_t < n_tok)[:, None] & dmask[None, :]
            x = tl.load(x_base + offs_t[:, None] * s_xt + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
            scale = _scale_of(tl.max(tl.abs(x), 1))
            q = _to_e4m3(x, scale[:, None])
            tl.store(q_base + offs_t[:, None] * s_qt + offs_d[None, :], q.to(Q.dtype.element_ty), mask=m)
            tl.store(S + p * s_sp + offs_t * s_st + h * s_sh, scale, mask=offs_t < n_tok)
    else:
        amax = tl.zeros([BLOCK_D], tl.float32)
        for t0 in range(0, PAGE, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            m = (offs_t < n_tok)[:, None] & dmask[None, :]
            x = tl.load(x_base + offs_t[:, None] * s_xt + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
        scale = _scale_of(tl.max(amax, 0))
        for t0 in range(0, PAGE, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            m = (offs_t < n_tok)[:, None] & dmask[None, :]
            x = tl.load(x_base + offs_t[:, None] * s_xt + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
            q = _to_e4m3(x, scale)
            tl.store(q_base + offs_t[:, None] * s_qt + offs_d[None, :], q.to(Q.dtype.element_ty), mask=m)
        tl.store(S + p * s_sp + h * s_sh, scale)


def _quantize_triton(x, out, scale, page_size: int, token: bool):
    """Launch :func:`_quantize_kernel` over (pages, KV heads)."""
    hkv, d = x.shape[-2], x.shape[-1]
    if x.dim() == 4:
        n_pages, total = x.shape[0], x.shape[0] * page_size
        xs, qs = (x.stride(0), x.stride(1), x.stride(2)), (out.stride(0), out.stride(1), out.stride(2))
    else:
        total = x.shape[0]
        n_pages = -(-total // page_size)
        xs = (page_size * x.stride(0), x.stride(0), x.stride(1))
        qs = (page_size * out.stride(0), out.stride(0), out.stride(1))
    if token and x.dim() == 4:
        ss = (scale.stride(0), scale.stride(1), scale.stride(2))
    elif token:
        ss = (page_size * scale.stride(0), scale.stride(0), scale.stride(1))
    else:
        ss = (scale.stride(0), 0, scale.stride(1))
    block_d = max(16, next_pow2(d))
    block_t = max(1, min(next_pow2(page_size), 4096 // block_d))
    _quantize_kernel[(n_pages, hkv)](
        x, out, scale, total, d, *xs, *qs, *ss,
        PAGE=page_size, TOKEN=token, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
