"""Shared input checks and dispatch rules for every kernel in :mod:`xoffload.kernels`.

The check vocabulary (each raises a one-line ``TypeError`` / ``ValueError`` naming the argument and
the offending value, shape or dtype): :func:`check_tensor`, :func:`check_same`, :func:`check_heads`,
:func:`check_qkv` (q/k/v of an attention call), :func:`check_out` (a caller's output buffer),
:func:`has_internal_overlap` / :func:`overlaps` (memory shared by elements of output buffers),
:func:`check_int`, :func:`check_pow2`, :func:`is_int`, :func:`check_eps`, :func:`check_bool`, :func:`check_cu_seqlens`,
and flash-attn's attention options :func:`check_window`, :func:`check_softcap`,
:func:`check_alibi_slopes`. The runtime, the sparse policies and the integrations use the same
functions.

Dispatch rule (DESIGN.md): a CUDA tensor runs the Triton kernel; a CPU tensor runs the PyTorch
reference, unless Triton's interpreter is on (``TRITON_INTERPRET=1`` set before Triton is
imported), in which case the Triton code runs on the CPU.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


_CPU_BACKEND: list = []  # stack set by cpu_backend(); empty = follow TRITON_INTERPRET


def interpreter_on() -> bool:
    """True when CPU tensors run the Triton code under Triton's interpreter.

    That is when ``TRITON_INTERPRET=1`` (set before Triton is imported), unless overridden by
    :func:`cpu_backend`.
    """
    if _CPU_BACKEND:
        return _CPU_BACKEND[-1] == "interpreter"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def cpu_backend(name: str):
    """Choose what CPU tensors run inside the block: ``"reference"`` (PyTorch fp32 reference) or
    ``"interpreter"`` (the Triton code; needs ``TRITON_INTERPRET=1`` before Triton was imported).

    Whole-model runs on the CPU use ``"reference"`` so that they finish in seconds even when the
    test process has the interpreter on. Raises ValueError for another name.
    """
    if name not in ("reference", "interpreter"):
        raise ValueError(f"cpu_backend must be 'reference' or 'interpreter', got {name!r}")
    _CPU_BACKEND.append(name)
    try:
        yield
    finally:
        _CPU_BACKEND.pop()


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for a tensor on ``t``'s device (CUDA, or CPU under the interpreter)."""
    return t.is_cuda or interpreter_on()


class HostPtr:
    """Pointer argument for a Triton kernel standing for a host tensor in pinned (page-locked or
    ``cudaHostRegister``-ed) memory: exposes the tensor's ``data_ptr()`` and a ``dtype`` (default the
    tensor's). Triton's launcher maps the host pointer to its device alias
    (``cuPointerGetAttribute``), so the kernel reads host memory over PCIe (UVA, zero copy).
    Strides are passed separately; the tensor must stay alive while the kernel runs."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, t: torch.Tensor, dtype: torch.dtype | None = None):
        self._ptr = t.data_ptr()
        self.dtype = dtype or t.dtype

    def data_ptr(self) -> int:
        return self._ptr


_LIBCUDA: list = []


def _libcuda():
    if not _LIBCUDA:
        import ctypes

        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]
            lib.cuPointerGetAttribute.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


def device_can_read_host(t: torch.Tensor) -> bool:
    """Whether a GPU kernel can address the host tensor ``t``'s elements through UVA: its first
    and last element have a device alias (``cuPointerGetAttribute(DEVICE_POINTER)``, the query
    Triton's launcher makes), i.e. the memory is pinned (``pin_memory=True``) or registered
    (``cudaHostRegister``). ``Tensor.is_pinned()`` asks about the storage's start instead, which
    for a view into a registered slab (the runtime's pool) may lie outside the registered range.
    Falls back to ``t.is_pinned()`` when the driver library cannot be loaded or the query fails
    for another reason than an unknown address."""
    if t.numel() == 0:
        return True
    lib = _libcuda()
    if lib is None:
        return bool(t.is_pinned())
    import ctypes

    last = t.data_ptr() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
    out = ctypes.c_ulonglong(0)
    for ptr in (t.data_ptr(), last + t.element_size() - 1):
        rc = lib.cuPointerGetAttribute(ctypes.byref(out), 2, ptr)  # 2: CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        if rc == 1:  # CUDA_ERROR_INVALID_VALUE: the driver does not know this host address
            return False
        if rc != 0:  # e.g. no current context on this thread: ask torch instead
            return bool(t.is_pinned())
    return True


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """``softmax_scale`` or ``1/sqrt(head_dim)``; raises ValueError on a non-finite or non-positive value."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return s


def check_tensor(name: str, t, ndim: int | None = None, dtypes=SUPPORTED_DTYPES) -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor of ``ndim`` dims, a supported dtype and a contiguous last dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim (stride 1), got shape {tuple(t.shape)} strides {tuple(t.stride())}"
        )


def check_same(names_tensors, what: str = "dtype and device") -> None:
    """Raise TypeError if tensors differ in dtype, ValueError if they differ in device."""
    (n0, t0), *rest = names_tensors
    for n, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {n0} has {t0.dtype}; all must match")
        if t.device != t0.device:
            raise ValueError(f"{n} is on {t.device} but {n0} is on {t0.device}; all must be on one device")


def check_heads(hq: int, hkv: int, d: int, q_name="q", k_name="k") -> None:
    """Raise ValueError for GQA ratio or head_dim problems."""
    if hkv <= 0 or hq <= 0:
        raise ValueError(f"head counts must be positive: {q_name} has {hq} heads, {k_name} has {hkv}")
    if hq % hkv != 0:
        raise ValueError(f"{q_name} heads ({hq}) must be a multiple of {k_name} heads ({hkv}) (GQA)")
    if d <= 0 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {d}")


def check_lengths(name: str, t, batch: int, device) -> None:
    """Check per-sequence lengths: an int32 tensor of shape ``[batch]`` on ``device`` (values are not
    read: no host sync). Raises TypeError (not a tensor, not int32) or ValueError (shape, device)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(t.shape)}")
    if t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int | None, device, values: bool = True) -> None:
    """Validate an int32 ``cu_seqlens`` of length B+1: starts at 0, non-decreasing, ends at ``total``
    (``total=None``: any end, e.g. key lengths of a paged cache).

    Reads the values on the host (a device->host copy that synchronises); ``values=False`` checks
    only the type, shape and device (nothing is read: the values are then the caller's guarantee).
    """
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch+1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the inputs are on {device}")
    if not values:
        return
    c = cu.cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(c[0])}")
    if c.numel() > 1 and bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {c.tolist()[:16]}")
    if total is not None and int(c[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(c[-1])} must equal the packed length {total}")


#: the layout of the 4-D inputs of the attention kernels (q, k, v, KV caches)
FLASH_LAYOUT = "[batch, seqlen, heads, head_dim] (flash-attn layout)"


def _qkv_problem(qs, ks, vs, names, where, same_batch) -> str | None:
    """The first shape problem of q, k, v shapes ``qs``, ``ks``, ``vs`` (``vs`` None: no v), or None."""
    qn, kn, vn = names
    if vs is not None and ks != vs:
        return f"{kn} and {vn} must have the same shape{where}, got {kn} {ks} and {vn} {vs}"
    if same_batch and qs[0] != ks[0]:
        return f"{qn} and {kn} must have the same batch size: {qn} {qs}, {kn} {ks}"
    if qs[-1] != ks[-1]:
        return f"{qn} and {kn} must have the same head_dim: {qn} {qs}, {kn} {ks}{where}"
    hq, hkv, d = qs[-2], ks[-2], qs[-1]
    if hkv <= 0 or hq <= 0:
        return f"head counts must be positive: {qn} has {hq} heads, {kn} has {hkv}"
    if hq % hkv != 0:
        return f"{qn} heads ({hq}) must be a multiple of {kn} heads ({hkv}) (GQA)"
    if d <= 0 or d > MAX_HEAD_DIM:
        return f"head_dim must be in [1, {MAX_HEAD_DIM}], got {d}"
    return None


def _transposed_names(shapes, names, where, same_batch) -> list:
    """Which of the 4-D tensors, read as ``[B, H, S, D]`` (dims 1 and 2 swapped), make the shape
    check pass: the cheapest choices (k and v swapped together count as one), each a list of names;
    ``[]`` when no choice does."""
    import itertools

    present = [i for i, sh in enumerate(shapes) if sh is not None]
    found, best = [], None
    for r in range(1, len(present) + 1):
        for pick in itertools.combinations(present, r):
            cost = len(pick) - (1 if 1 in pick and 2 in pick else 0)
            sw = [sh if i not in pick else (sh[0], sh[2], sh[1], sh[3]) for i, sh in enumerate(shapes)]
            if _qkv_problem(*sw, names, where, same_batch) is None and (best is None or cost <= best):
                found, best = ([] if best is not None and cost < best else found) + [[names[i] for i in pick]], cost
    return found


def check_qkv(q, k, v, ndim: int, layout: str = "", *, same_batch: bool = False,
              names=("q", "k", "v")) -> None:
    """Check the q, k, v of an attention call: tensors of ``ndim`` dims, a supported dtype, contiguous
    last dim, one dtype and device, k and v of one shape, q's head_dim equal to k's and a valid GQA
    ratio (heads are dim -2, head_dim dim -1); with ``same_batch`` also q's dim 0 equal to k's.
    ``v`` may be None (a q/k-only call). ``layout`` (e.g. ``"[B, S, H, D]"``) and ``names`` (the
    arguments' names) appear in the errors. Raises TypeError / ValueError.

    4-D inputs are :data:`FLASH_LAYOUT` ``[batch, seqlen, heads, head_dim]``, not PyTorch SDPA's
    ``[batch, heads, seqlen, head_dim]``. A ``[B, H, S, D]`` tensor is caught when its shape then
    disagrees with the others' (GQA ratio, k/v shapes), and the error names it and says to pass
    ``.transpose(1, 2)``; when every tensor is transposed and the lengths happen to agree as head
    counts (e.g. ``Sq == Sk``), the shapes are valid and nothing can tell."""
    qn, kn, vn = names
    named = [(qn, q), (kn, k)] + ([(vn, v)] if v is not None else [])
    for name, t in named:
        check_tensor(name, t, ndim)
    check_same(named)
    where = f" ({layout})" if layout else ""
    shapes = [tuple(q.shape), tuple(k.shape), None if v is None else tuple(v.shape)]
    problem = _qkv_problem(*shapes, names, where, same_batch)
    if problem is None:
        return
    if ndim == 4:
        problem += f"; expected {FLASH_LAYOUT}"
        options = [" and ".join(o) for o in _transposed_names(shapes, names, where, same_batch)]
        if options:
            if len(options) > 1:
                who, verb = f"either {', or '.join(options)},", "looks"
            else:
                who, verb = options[0], "look" if " and " in options[0] else "looks"
            problem += (f"; {who} {verb} like [B, H, S, D] (swapping its dims 1 and 2 makes the shapes agree): "
                        f"pass .transpose(1, 2)")
    raise ValueError(problem)


def check_out(name: str, out, shape, dtype, device) -> None:
    """Check a caller-provided output buffer: a tensor of exactly ``shape``, ``dtype`` (None: any
    supported dtype) and ``device`` with a contiguous last dim (other strides are honoured).
    Raises TypeError (not a tensor, wrong dtype) or ValueError (shape, device, last-dim stride)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if dtype is None:
        check_tensor(name, out, dtypes=SUPPORTED_DTYPES)
    elif out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.device != torch.device(device):
        raise ValueError(f"{name} is on {out.device}, expected {device}")
    if out.dim() > 0 and out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tuple(out.stride())}")


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Offsets (in elements, from ``t.data_ptr()``) of every element of ``t``: int64 on the CPU,
    computed from the shape and strides (no data read, no device sync)."""
    off = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return off.reshape(-1)


def _byte_span(t: torch.Tensor) -> tuple:
    """``[first, last)`` byte addresses that ``t``'s elements can touch (``t`` non-empty)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def has_internal_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (e.g. an ``expand``-ed view, a stride of 0).

    Exact: a cheap stride test proves most layouts distinct; the rest are checked element by element
    from the strides (host-side arithmetic on ``t.numel()`` offsets, no data read)."""
    if t.numel() <= 1:
        return False
    extent = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st <= extent:
            break
        extent += (n - 1) * st
    else:
        return False
    offs = _element_offsets(t)
    return offs.unique().numel() != offs.numel()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when an element of ``a`` and an element of ``b`` share memory.

    Exact for tensors of one dtype whose starts are a whole number of elements apart (element by
    element, from the strides, when their byte spans intersect); otherwise any intersection of the
    byte spans counts. Meta tensors and different devices never overlap."""
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    es = a.element_size()
    diff = b.data_ptr() - a.data_ptr()
    if a.dtype != b.dtype or diff % es:
        return True
    return bool(torch.isin(_element_offsets(b) + diff // es, _element_offsets(a)).any())


def check_eps(eps) -> float:
    """``eps`` checked to be a finite real >= 0 (not a bool). Raises ValueError otherwise."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return eps


#: the largest finite fp32 value
FP32_MAX = float(torch.finfo(torch.float32).max)


def fits_fp32(x: float) -> bool:
    """True when the finite float ``x`` stays finite in fp32 (``|x| <= FP32_MAX``)."""
    return math.isfinite(x) and abs(x) <= FP32_MAX


def is_int(x) -> bool:
    """True for a Python or numpy integer (never a bool)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, np.integer)


def check_int(name: str, x, lo: int | None = None, hi: int | None = None, *, type_error=TypeError) -> int:
    """``x`` as an int, checked to be an integer (not a bool) in ``[lo, hi]`` (either bound optional).
    Raises ``type_error`` (TypeError unless the caller's contract says otherwise) for a
    non-integer, ValueError out of range."""
    if not is_int(x):
        raise type_error(f"{name} must be an int, got {type(x).__name__} {x!r}")
    x = int(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        if hi is None:
            raise ValueError(f"{name} must be >= {lo}, got {x}")
        if lo is None:
            raise ValueError(f"{name} must be <= {hi}, got {x}")
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {x}")
    return x


def check_pow2(name: str, x, lo: int = 1) -> int:
    """``x`` checked to be an int power of two >= ``lo``. Raises TypeError / ValueError."""
    if not is_int(x):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < lo or x & (x - 1):
        raise ValueError(f"{name} must be a power of two >= {lo}, got {x}")
    return int(x)


def check_bool(name: str, x) -> bool:
    """``x`` checked to be a bool. Raises TypeError otherwise."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return x


# ----------------------------------------------------------------------------------------------
# attention options shared by the kernels (flash-attn semantics): local window, soft-capping, ALiBi
# ----------------------------------------------------------------------------------------------
def _as_int(name: str, x) -> int:
    """``x`` as an int: a Python/numpy int or an integer tensor of one element (flash-attn's own
    tests pass ``torch.randint(...)`` windows). Raises TypeError otherwise."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not (x.dtype.is_floating_point or x.dtype.is_complex
                                                               or x.dtype == torch.bool):
        return int(x)
    if not is_int(x):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    return int(x)


def check_window(window_size) -> tuple:
    """``window_size = (left, right)`` of a local (sliding-window) attention, flash-attn's
    convention: query at position ``i`` sees key ``j`` iff ``i - left <= j <= i + right`` (positions
    bottom-right aligned), ``-1`` = no limit on that side. Returns ``(left, right)`` as ints.
    Raises TypeError (not a pair of ints) or ValueError (a value < -1)."""
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.tolist() if window_size.dim() == 1 else window_size
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    left = _as_int("window_size[0] (left)", window_size[0])
    right = _as_int("window_size[1] (right)", window_size[1])
    for side, v in (("left", left), ("right", right)):
        if v < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1: no limit), got {v} in window_size={tuple(window_size)}")
    return left, right


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0 = off, > 0 caps the scaled scores as ``softcap * tanh(s / softcap)``.
    Raises TypeError (not a real number) or ValueError (negative, NaN or infinite)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        try:
            import numpy as np
            ok = isinstance(softcap, np.floating) or isinstance(softcap, np.integer)
        except ImportError:  # pragma: no cover
            ok = False
        if not ok:
            raise TypeError(f"softcap must be a float, got {type(softcap).__name__} {softcap!r}")
    s = float(softcap)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    return s


def check_alibi_slopes(alibi_slopes, batch: int, heads: int, device):
    """ALiBi slopes as flash-attn takes them: fp32 ``[Hq]`` or ``[B, Hq]`` on ``device``, last dim
    contiguous (or None). Query head h of item b adds ``-slope[b, h] * |i - j|`` to the scaled
    score of key j (query at position i, bottom-right aligned). Returns the tensor viewed as
    ``[B or 1, Hq]`` (None stays None). Raises TypeError (not a tensor, not fp32) or ValueError
    (shape, device, non-finite values are not checked: no host read)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be fp32 (as in flash-attn), got {alibi_slopes.dtype}")
    shape = tuple(alibi_slopes.shape)
    if shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape [Hq] = [{heads}] or [B, Hq] = [{batch}, {heads}], got {shape}")
    if alibi_slopes.device != torch.device(device):
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if alibi_slopes.shape[-1] > 1 and alibi_slopes.stride(-1) != 1:
        raise ValueError(f"alibi_slopes must have a contiguous last dim, got strides {tuple(alibi_slopes.stride())}")
    return alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None]
