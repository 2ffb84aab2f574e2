"""Tests of the fp8 (e4m3) KV format: quantize_kv_fp8 / dequantize_kv_fp8 against the torch
reference and the format's error bound, and paged_decode_attn_with_lse over fp8 stores against the
fp32 reference run on the dequantized store, and decode_attn_with_lse over fp8 contiguous caches.

Error bound of one element (derived from the format, not fitted): with ``y = x / scale``, e4m3
keeps 3 mantissa bits, so rounding to the nearest value moves a normal ``|y|`` (>= 2^-6) by at
most half an ulp, ``2^(e-4) <= |y| * 2^-4``, and a subnormal one by at most half the spacing
2^-9, i.e. 2^-10. ``y`` itself is an fp32 quotient (relative error <= 2^-24) and ``q * scale`` an
fp32 product (<= 2^-24), so ``|x - q*scale| <= scale * max(|y| * 2^-4, 2^-10) + |x| * 2^-22``.

CPU: the Triton code under the interpreter (which loads and converts e4m3 correctly; the kernel
rounds to e4m3 itself, so it equals the reference bit for bit), fp16 queries, and bf16 queries
(the fp8 tile step takes them as fp16 rows scaled by powers of two, so its dots are fp16 ones,
which the interpreter computes correctly). GPU (``-m cuda``): bf16, the 8B head shape, page and
token scales, row and block stores, a pinned host store read over UVA.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_lse_match, attention_in_dtype, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import cpu_backend, decode_attn_with_lse, paged_decode_attn_with_lse
from xoffload.kernels.fp8 import (
    FP8_DTYPE, check_fp8_supported, dequantize_kv_fp8, fp8_scale_shape, quantize_kv_fp8,
)
from xoffload.kernels.reference import (
    FP8_SCALE_MIN, decode_attention_ref, fp8_scale_from_amax, dequantize_cache_fp8_ref, dequantize_kv_fp8_ref, kvcache_visible_ref, paged_decode_attn_ref, paged_gather_ref,
    quantize_kv_fp8_ref,
)

# every finite non-negative e4m3 value, ascending (codes 0x00..0x7e; 0x7f is NaN)
E4M3 = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).float()


def _bits(q):
    return q.view(torch.uint8)


def _per_elem_scale(scale, shape, page_size, granularity):
    """Each element's scale, broadcastable to ``shape``."""
    one = torch.ones(shape, dtype=torch.float8_e4m3fn, device=scale.device)
    return dequantize_kv_fp8_ref(one, scale, page_size=page_size, granularity=granularity)


def _assert_roundtrip(x, q, scale, page_size, granularity):
    """The format's bound (module docstring) for every element; exact zeros stay zero."""
    s = _per_elem_scale(scale, x.shape, page_size, granularity)
    xf = x.float()
    y = xf / s
    deq = dequantize_kv_fp8(q, scale, torch.float32, page_size=page_size, granularity=granularity)
    bound = s * torch.maximum(y.abs() * 2.0 ** -4, torch.full_like(y, 2.0 ** -10)) + xf.abs() * 2.0 ** -22
    err = (deq - xf).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"
    assert bool((deq[xf == 0] == 0).all())
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()


def _x(shape, dtype, device, seed=0, spread=True):
    """Random values; ``spread`` gives each channel its own magnitude (2^-14 .. 2^4), so pages mix
    large, small and subnormal-after-scaling values."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:
        x = x * torch.logspace(-14, 4, shape[-1], base=2.0)
    return x.to(dtype).to(device)


# ------------------------------------------------------------------------------ quantization
QUANT_CASES = [  # (shape, page_size) : row stores with partial last pages, odd sizes; block stores
    ((70, 3, 40), 16),
    ((61, 2, 64), 7),
    ((5, 1, 24), 48),
    ((4, 32, 2, 64), None),
    ((3, 5, 3, 20), 5),
]


@pytest.mark.parametrize("granularity", ["page", "token"])
@pytest.mark.parametrize("shape,page_size", QUANT_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_roundtrip_and_reference(device, shape, page_size, granularity, dtype):
    x = _x(shape, dtype, device)
    ps = page_size or shape[1]
    q, scale = quantize_kv_fp8(x, page_size=page_size, granularity=granularity)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.device == x.device
    assert scale.dtype == torch.float32 and tuple(scale.shape) == fp8_scale_shape(shape, ps, granularity)
    qr, sr = quantize_kv_fp8_ref(x, page_size=ps, granularity=granularity)
    assert torch.equal(scale, sr)
    assert torch.equal(_bits(q), _bits(qr)), f"{int((_bits(q) != _bits(qr)).sum())} codes differ from the reference"
    _assert_roundtrip(x, q, scale, ps, granularity)
    # the group's absolute maximum maps to +-448 exactly (never past it: saturation)
    qa = q.float().abs()
    if granularity == "token":
        top = qa.amax(-1)
    elif x.dim() == 4:
        top = qa.amax(dim=(1, 3))
    else:
        top = torch.stack([qa[i:i + ps].amax(dim=(0, 2)) for i in range(0, shape[0], ps)])
    assert bool((top == 448).all())


def test_rounding_ties_to_even_and_every_value(device):
    """A page whose maximum is 448 has scale 1: every e4m3 value is kept exactly, midpoints go to
    the even neighbour, points just off a midpoint to the nearer one (normal and subnormal)."""
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    nxt = torch.nextafter(mids, torch.full_like(mids, 1e9))
    prv = torch.nextafter(mids, torch.zeros_like(mids))
    vals = torch.cat([E4M3, mids, nxt, prv])
    x = torch.cat([vals, -vals]).view(-1, 1, 1).to(device)  # one page of one channel
    q, scale = quantize_kv_fp8(x, page_size=x.shape[0], granularity="page")
    assert float(scale) == 1.0
    got = q.float().view(-1).cpu()
    n = E4M3.numel()
    want_mid = torch.where(torch.arange(n - 1) % 2 == 0, E4M3[:-1], E4M3[1:])  # even code = even mantissa
    want = torch.cat([E4M3, want_mid, E4M3[1:], E4M3[:-1]])
    assert torch.equal(got, torch.cat([want, -want]))


def test_zeros_and_tiny_groups(device):
    x = torch.zeros(40, 2, 16, device=device)
    x[20:, 1] = torch.randn(20, 16, device=device)
    x[35, 0, 3] = 1e-37  # amax / 448 is subnormal in fp32: the scale is floored at 2^-126
    for gran in ("page", "token"):
        q, scale = quantize_kv_fp8(x, page_size=16, granularity=gran)
        assert torch.isfinite(scale).all() and bool((scale > 0).all())
        deq = dequantize_kv_fp8(q, scale, torch.float32, page_size=16, granularity=gran)
        assert torch.equal(deq[x == 0], torch.zeros_like(deq[x == 0]))
        assert torch.isfinite(deq).all()
    q, scale = quantize_kv_fp8(x, page_size=16)
    assert scale[0, 0] == 1.0 and scale[0, 1] == 1.0 and scale[2, 0] == FP8_SCALE_MIN
    assert torch.equal(_bits(q[:16]), torch.zeros_like(_bits(q[:16])))


def test_saturation_never_overflows(device):
    """Extreme magnitudes (fp16's and bf16's largest values, fp32 near its top) and many random
    maxima: the quotient x / (amax / 448) may land just above 448; it saturates to 448."""
    for dtype, big in ((torch.float16, 65504.0), (torch.bfloat16, 3.0e38), (torch.float32, 3.4e38)):
        x = (torch.randn(32, 2, 16) * 0.01).to(dtype).to(device)
        x[3, 0, 5] = big
        x[4, 1, 0] = -big
        q, scale = quantize_kv_fp8(x, page_size=16)
        assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
        assert q[3, 0, 5].float() == 448 and q[4, 1, 0].float() == -448
    g = torch.Generator().manual_seed(3)
    amax = torch.exp(torch.randn(512, generator=g) * 20)  # maxima across ~30 binades
    x = torch.zeros(512, 1, 16)
    x[:, 0, 0] = amax
    q, scale = quantize_kv_fp8(x.to(device), page_size=1)
    assert bool((q[:, 0, 0].float() == 448).all())


class _Divisions(TorchDispatchMode):
    """Records the (dividend shape, divisor) of every aten division dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_):
            self.calls.append((tuple(args[0].shape), args[1]))
        return func(*args, **(kwargs or {}))


def test_reference_scale_is_an_elementwise_division(device):
    """``amax / 448`` correctly rounded on every device: the reference divides by a tensor of
    amax's shape (PyTorch's CUDA kernel turns a division by a Python number into a product with
    its rounded reciprocal, one ulp off for about half of all maxima); the scale equals the fp64
    quotient rounded once to fp32 (exact: 53 >= 2 * 24 + 2 bits)."""
    g = torch.Generator().manual_seed(5)
    amax = torch.exp(torch.randn(4096, generator=g) * 20).float()
    with _Divisions() as rec:
        s = fp8_scale_from_amax(amax.to(device))
    assert rec.calls and all(isinstance(d, torch.Tensor) and tuple(d.shape) == shp for shp, d in rec.calls), \
        [(shp, type(d).__name__, getattr(d, "shape", None)) for shp, d in rec.calls]
    want = (amax.double() / 448).float().clamp_min(FP8_SCALE_MIN)
    assert torch.equal(s.cpu(), want)
    # what a division by the number would give on the GPU: differs for many maxima
    assert int(((amax * (torch.tensor(1.0) / 448)).clamp_min(FP8_SCALE_MIN) != want).sum()) > 100


def test_out_buffers_and_empty(device):
    x = _x((48, 2, 32), torch.float16, device, seed=4)
    out = torch.empty(48, 2, 64, dtype=FP8_DTYPE, device=device)[:, :, 16:48]  # strided view
    sc = torch.empty(2, 3, dtype=torch.float32, device=device).t()  # [3, 2], transposed strides
    q, s = quantize_kv_fp8(x, page_size=16, out=out, scale_out=sc)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == sc.data_ptr()
    qr, sr = quantize_kv_fp8_ref(x, page_size=16)
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)
    q, s = quantize_kv_fp8(x[:0], page_size=16)
    assert q.shape == (0, 2, 32) and s.shape == (0, 2)


def test_quantize_bad_inputs():
    x = torch.randn(32, 2, 16)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        quantize_kv_fp8(x.int(), page_size=16)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_kv_fp8(x.numpy(), page_size=16)
    with pytest.raises(ValueError, match=r"x must be \[T, Hkv, D\]"):
        quantize_kv_fp8(x[0], page_size=16)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        quantize_kv_fp8(x)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        quantize_kv_fp8(x, page_size=0)
    with pytest.raises(ValueError, match="page_size=8 but x"):
        quantize_kv_fp8(x.view(2, 16, 2, 16), page_size=8)
    with pytest.raises(ValueError, match="granularity must be 'page' or 'token', got 'head'"):
        quantize_kv_fp8(x, page_size=16, granularity="head")
    with pytest.raises(ValueError, match="contiguous last dim"):
        quantize_kv_fp8(x.transpose(1, 2), page_size=16)
    with pytest.raises(TypeError, match="out has dtype torch.float16"):
        quantize_kv_fp8(x, page_size=16, out=torch.empty(32, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        quantize_kv_fp8(x, page_size=16, out=torch.empty(32, 2, 8, dtype=FP8_DTYPE))
    with pytest.raises(ValueError, match=r"scale_out has shape \(2, 3\), expected \(2, 2\)"):
        quantize_kv_fp8(x, page_size=16, scale_out=torch.empty(2, 3))
    with pytest.raises(TypeError, match="scale_out must be fp32"):
        quantize_kv_fp8(x, page_size=16, scale_out=torch.empty(2, 2, dtype=torch.float16))
    q, s = quantize_kv_fp8(x, page_size=16)
    with pytest.raises(ValueError, match=r"scale has shape \(2, 2\), expected \(4, 2\)"):
        dequantize_kv_fp8(q, s, page_size=8)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        dequantize_kv_fp8(x, s, page_size=16)
    with pytest.raises(TypeError, match="dtype must be fp16, bf16 or fp32"):
        dequantize_kv_fp8(q, s, torch.int8, page_size=16)


def test_check_fp8_supported(monkeypatch):
    check_fp8_supported("cpu")
    import xoffload.kernels.fp8 as fp8

    monkeypatch.setattr(fp8, "_SUPPORTED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9.*cuda:0 \(NVIDIA A100-SXM4-80GB\) has 8.0"):
        check_fp8_supported("cuda:0")
    monkeypatch.setattr(fp8, "_SUPPORTED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    check_fp8_supported("cuda:0")


# --------------------------------------------------------------------------- paged decode
def _fp8_store(shape, granularity, page, device, seed, spread=False):
    x = _x(shape, torch.float32, device, seed=seed, spread=spread)
    return quantize_kv_fp8(x, page_size=page, granularity=granularity)


def _check_decode(q, kq, ks, vq, vs, table, lens, page, granularity, **kw):
    """Kernel over the fp8 store vs the fp32 reference over the dequantized store, within the
    tolerance rule of the 16-bit kernels (2x PyTorch's error in q's dtype + 2 ulps of it)."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    out, lse = paged_decode_attn_with_lse(q, kq, vq, table, seqlens, page_size=page, k_scale=ks, v_scale=vs, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    kd = dequantize_kv_fp8(kq, ks, torch.float32, page_size=page, granularity=granularity)
    vd = dequantize_kv_fp8(vq, vs, torch.float32, page_size=page, granularity=granularity)
    opts = {k: v for k, v in kw.items() if k in ("causal", "window_size", "softcap", "softmax_scale")}
    ref_o, ref_l = paged_decode_attn_ref(q, kd, vd, table, seqlens, page_size=page, **opts)
    # the baseline: PyTorch in q's dtype over the dequantized K/V rounded to it
    scale = kw.get("softmax_scale") or q.shape[-1] ** -0.5
    base = []
    for i, n in enumerate(lens):
        kc, vc = paged_gather_ref(kd, vd, table, i, n, page)
        allowed = kvcache_visible_ref(q.shape[1], n, causal=kw.get("causal", False),
                                      window_size=kw.get("window_size", (-1, -1)), device=q.device)
        base.append(attention_in_dtype(q[i], kc.to(q.dtype), vc.to(q.dtype), allowed[None], scale,
                                       softcap=kw.get("softcap", 0.0))[None])
    tol = out_tol(ref_o, torch.cat(base), q.dtype)
    err = max_err(out, ref_o)
    assert err <= tol, f"out error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    return out, lse


DECODE_CASES = [  # (Hq, Hkv, D, page, blocked, shared table, num_splits, lens)
    (8, 2, 64, 16, False, False, 3, [150, 0, 37]),   # GQA 4, a scale per key row (16 < BLOCK_N)
    (8, 2, 64, 64, False, True, 2, [190, 64, 1]),    # two pages per tile (BLOCK_N 128): per key row
    (6, 3, 40, 32, True, True, None, [97, 0, 200]),  # block store, odd D
    (4, 1, 64, 128, True, False, 2, [255, 129, 3]),  # block store, one page per tile: one scale per tile
]


@pytest.mark.parametrize("granularity", ["page", "token"])
@pytest.mark.parametrize("hq,hkv,d,page,blocked,shared,num_splits,lens", DECODE_CASES)
def test_fp8_paged_decode_matches_reference(device, granularity, hq, hkv, d, page, blocked, shared, num_splits, lens):
    n_pages = -(-max(lens) // page) + 1
    n_store = n_pages + 3
    g = torch.Generator().manual_seed(7)
    if blocked:
        shape = (n_store, page, hkv, d)
        entries = [torch.randperm(n_store, generator=g)[:n_pages] for _ in range(len(lens) * (1 if shared else hkv))]
    else:
        shape = (n_store * page, hkv, d)
        entries = [torch.randperm(n_store, generator=g)[:n_pages] * page
                   for _ in range(len(lens) * (1 if shared else hkv))]
    table = torch.stack(entries).view(len(lens), 1 if shared else hkv, n_pages).to(torch.int32).to(device)
    kq, ks = _fp8_store(shape, granularity, page, device, seed=1, spread=True)
    vq, vs = _fp8_store(shape, granularity, page, device, seed=2)
    q = _x((len(lens), 1, hq, d), torch.float16, device, seed=3, spread=False)
    out, lse = _check_decode(q, kq, ks, vq, vs, table, lens, page, granularity, num_splits=num_splits)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i].float().cpu(), torch.zeros(out[i].shape)) and torch.isneginf(lse[i]).all()
    # check=False (no host reads) gives the same answer; the CPU reference path (dequantize, then
    # the fp32 reference) agrees within the same tolerance
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    o2, l2 = paged_decode_attn_with_lse(q, kq, vq, table, seqlens, page_size=page, k_scale=ks, v_scale=vs,
                                        num_splits=num_splits, check=False)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    if device == "cpu":
        with cpu_backend("reference"):
            o3, l3 = paged_decode_attn_with_lse(q, kq, vq, table, seqlens, page_size=page, k_scale=ks, v_scale=vs)
        assert max_err(out, o3) <= 4 * torch.finfo(q.dtype).eps * max(1.0, float(o3.abs().max()))
        assert_lse_match(lse, l3)


@pytest.mark.parametrize("granularity", ["page", "token"])
def test_fp8_paged_decode_bf16_query(device, granularity):
    """A bf16 q: each row enters the fp16 dot scaled by its own power of two, so rows whose
    magnitudes differ by 2^+-100 (one head of a GQA group huge, one tiny) keep their precision
    (without the scaling the huge row would overflow fp16 and the tiny one vanish)."""
    page, hq, hkv, d = 128, 8, 2, 64
    kq, ks = _fp8_store((6 * page, hkv, d), granularity, page, device, seed=8, spread=True)
    vq, vs = _fp8_store((6 * page, hkv, d), granularity, page, device, seed=9)
    q = _x((2, 1, hq, d), torch.float32, device, seed=10, spread=False)
    q[:, :, 1] *= 2.0 ** 100
    q[:, :, 2] *= 2.0 ** -100
    q[1, :, 5] *= 2.0 ** 60
    table = (torch.tensor([[[3, 0, 5, 1]], [[2, 4, 1, 0]]]) * page).to(torch.int32).to(device)
    _check_decode(q.to(torch.bfloat16), kq, ks, vq, vs, table, [500, 300], page, granularity, num_splits=2)


def test_fp8_paged_decode_options(device):
    """Several query tokens, causal, a window and softcap: the K scale applies before the cap."""
    page, hkv, d = 16, 2, 32
    kq, ks = _fp8_store((12 * page, hkv, d), "token", page, device, seed=5, spread=True)
    vq, vs = _fp8_store((12 * page, hkv, d), "token", page, device, seed=6)
    q = _x((2, 3, 4, d), torch.float16, device, seed=7, spread=False) * 3
    table = (torch.arange(10)[None, None, :] * page).expand(2, 1, 10).to(torch.int32).contiguous().to(device)
    _check_decode(q, kq, ks, vq, vs, table, [150, 40], page, "token", causal=True, window_size=(50, 0),
                  softcap=5.0, num_splits=2)


def test_fp8_paged_decode_errors(device):
    page, hkv, d = 16, 2, 32
    k = torch.randn(4 * page, hkv, d, device=device)
    kq, ks = quantize_kv_fp8(k, page_size=page)
    _, kst = quantize_kv_fp8(k, page_size=page, granularity="token")
    q = torch.randn(1, 1, 4, d, device=device).half()
    table = torch.tensor([[[0, 16]]], dtype=torch.int32, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)

    def call(kp=kq, vp=kq, qq=q, tab=table, **kw):
        return paged_decode_attn_with_lse(qq, kp, vp, tab, lens, page_size=page, **kw)

    with pytest.raises(ValueError, match="k_scale .* is required"):
        call()
    with pytest.raises(ValueError, match="v_scale .* is required"):
        call(k_scale=ks)
    with pytest.raises(ValueError, match="k_scale is given but k_pages/v_pages are torch.float16"):
        call(kp=k.half(), vp=k.half(), k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match=r"v_scale has shape \(4, 3\), expected \(4, 2\)"):
        call(k_scale=ks, v_scale=torch.ones(4, 3, device=device))
    with pytest.raises(ValueError, match=r"v_scale has shape \(64, 2\), expected \(4, 2\)"):
        call(k_scale=ks, v_scale=kst)  # one granularity for both
    with pytest.raises(TypeError, match="k_scale must be fp32"):
        call(k_scale=ks.double(), v_scale=ks)
    with pytest.raises(TypeError, match="k_scale must be a torch.Tensor"):
        call(k_scale=1.0, v_scale=ks)
    with pytest.raises(TypeError, match="q has dtype torch.float32; float8_e4m3fn k_pages/v_pages need"):
        call(qq=q.float(), k_scale=ks, v_scale=ks)
    with pytest.raises(TypeError, match="v_pages has dtype torch.float16 but k_pages has torch.float8_e4m3fn"):
        call(vp=k.half(), k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="entry 3 of a visited page is not a multiple of page_size 16"):
        call(tab=torch.tensor([[[0, 3]]], dtype=torch.int32, device=device), k_scale=ks, v_scale=ks)
    call(tab=torch.tensor([[[0, 3]]], dtype=torch.int32, device=device), k_scale=kst, v_scale=kst)  # token: any row


# ----------------------------------------------------------------------- contiguous decode
def _fp8_cache(b, s, hkv, d, spage, device, seed):
    """An e4m3 cache ``[B, S, Hkv, D]`` with token scales (spage None) or page scales of spage
    positions: each sequence row quantized as a row store (pages of spage, the last partial)."""
    x = _x((b, s, hkv, d), torch.float32, device, seed=seed, spread=True)
    qs, ss = zip(*[quantize_kv_fp8(x[i], page_size=spage or 1, granularity="page" if spage else "token")
                   for i in range(b)])
    return torch.stack(qs), torch.stack(ss)


@pytest.mark.parametrize("spage", [None, 16, 64, 100])
def test_fp8_contiguous_decode_matches_reference(device, spage):
    b, s, hq, hkv, d = 3, 300, 8, 2, 32
    kq, ks = _fp8_cache(b, s, hkv, d, spage, device, seed=41)
    vq, vs = _fp8_cache(b, s, hkv, d, spage, device, seed=42)
    q = _x((b, 2, hq, d), torch.float16, device, seed=43, spread=False)
    lens = torch.tensor([300, 0, 77], dtype=torch.int32, device=device)
    kw = dict(k_scale=ks, v_scale=vs, scale_page_size=spage, causal=True, num_splits=3)
    out, lse = decode_attn_with_lse(q, kq, vq, lens, **kw)
    kd, vd = dequantize_cache_fp8_ref(kq, ks, spage or 1), dequantize_cache_fp8_ref(vq, vs, spage or 1)
    ref_o, ref_l = decode_attention_ref(q, kd, vd, lens, causal=True)
    base = [attention_in_dtype(q[i], kd[i, :n].to(q.dtype), vd[i, :n].to(q.dtype),
                               kvcache_visible_ref(2, n, causal=True, device=device)[None], d ** -0.5)[None]
            for i, n in enumerate(lens.tolist())]
    tol = out_tol(ref_o, torch.cat(base), q.dtype)
    assert max_err(out, ref_o) <= tol
    assert_lse_match(lse, ref_l)
    assert torch.isneginf(lse[1]).all() and not out.isnan().any()
    o2, l2 = decode_attn_with_lse(q, kq, vq, lens, check=False, **kw)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    # cache_batch_idx reads other rows (and their scales)
    bi = torch.tensor([2, 0, 0], dtype=torch.int32, device=device)
    o3, l3 = decode_attn_with_lse(q, kq, vq, lens, cache_batch_idx=bi, **kw)
    r3, rl3 = decode_attention_ref(q, kd, vd, lens, causal=True, cache_batch_idx=bi)
    assert max_err(o3, r3) <= out_tol(r3, r3.to(q.dtype), q.dtype, ulps=4)
    assert_lse_match(l3, rl3)
    if device == "cpu":
        with cpu_backend("reference"):
            o4, l4 = decode_attn_with_lse(q, kq, vq, lens, **kw)
        assert max_err(out, o4) <= 4 * torch.finfo(q.dtype).eps * max(1.0, float(o4.abs().max()))
        assert_lse_match(lse, l4)


def test_fp8_contiguous_decode_bf16_query(device):
    """The contiguous kernel with a bf16 q (rows of very different magnitudes) and softcap."""
    b, s, hq, hkv, d = 2, 200, 8, 2, 32
    kq, ks = _fp8_cache(b, s, hkv, d, 64, device, seed=45)
    vq, vs = _fp8_cache(b, s, hkv, d, 64, device, seed=46)
    q = _x((b, 1, hq, d), torch.float32, device, seed=47, spread=False)
    q[:, :, 3] *= 2.0 ** 40
    q[:, :, 4] *= 2.0 ** -40
    q = q.to(torch.bfloat16)
    lens = torch.tensor([200, 77], dtype=torch.int32, device=device)
    kd, vd = dequantize_cache_fp8_ref(kq, ks, 64), dequantize_cache_fp8_ref(vq, vs, 64)
    for softcap in (0.0, 30.0):
        out, lse = decode_attn_with_lse(q, kq, vq, lens, k_scale=ks, v_scale=vs, scale_page_size=64, softcap=softcap)
        ref_o, ref_l = decode_attention_ref(q, kd, vd, lens, softcap=softcap)
        base = [attention_in_dtype(q[i], kd[i, :n].to(q.dtype), vd[i, :n].to(q.dtype),
                                   kvcache_visible_ref(1, n, device=device)[None], d ** -0.5, softcap=softcap)[None]
                for i, n in enumerate(lens.tolist())]
        assert max_err(out, ref_o) <= out_tol(ref_o, torch.cat(base), q.dtype)
        assert_lse_match(lse, ref_l)


def test_fp8_contiguous_decode_errors(device):
    kq, ks = _fp8_cache(2, 64, 2, 32, None, device, seed=44)
    _, kp = _fp8_cache(2, 64, 2, 32, 16, device, seed=44)
    q = torch.randn(2, 1, 4, 32, device=device).half()
    lens = torch.tensor([64, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_cache/v_cache are float8_e4m3fn: k_scale .* is required"):
        decode_attn_with_lse(q, kq, kq, lens)
    with pytest.raises(ValueError, match="k_scale is given but k_cache/v_cache are torch.float16"):
        decode_attn_with_lse(q, kq.half(), kq.half(), lens, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="scale_page_size=16 is given but k_cache/v_cache are torch.float16"):
        decode_attn_with_lse(q, kq.half(), kq.half(), lens, scale_page_size=16)
    with pytest.raises(ValueError, match=r"k_scale has shape \(2, 64, 2\), expected \(2, 4, 2\)"):
        decode_attn_with_lse(q, kq, kq, lens, k_scale=ks, v_scale=kp, scale_page_size=16)
    with pytest.raises(ValueError, match=r"v_scale has shape \(2, 4, 2\), expected \(2, 64, 2\)"):
        decode_attn_with_lse(q, kq, kq, lens, k_scale=ks, v_scale=kp)
    with pytest.raises(ValueError, match="scale_page_size must be a positive int"):
        decode_attn_with_lse(q, kq, kq, lens, k_scale=kp, v_scale=kp, scale_page_size=0)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        decode_attn_with_lse(q.float(), kq, kq, lens, k_scale=ks, v_scale=ks)
    with pytest.raises(TypeError, match="v_cache has dtype torch.float16; supported: torch.float8_e4m3fn"):
        decode_attn_with_lse(q, kq, kq.half(), lens, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="q and k_cache must have the same head_dim"):
        decode_attn_with_lse(q[..., :16], kq, kq, lens, k_scale=ks, v_scale=ks)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_gpu_quantize_equals_reference(dtype, granularity):
    for shape, page in (((100_000, 8, 128), 32), ((300, 256, 8, 128), None), ((1001, 3, 80), 48)):
        x = _x(shape, dtype, "cuda", seed=11)
        ps = page or shape[1]
        q, s = quantize_kv_fp8(x, page_size=page, granularity=granularity)
        qr, sr = quantize_kv_fp8_ref(x, page_size=ps, granularity=granularity)
        assert torch.equal(s, sr)
        assert torch.equal(_bits(q), _bits(qr))
        _assert_roundtrip(x, q, s, ps, granularity)


@pytest.mark.cuda
@pytest.mark.parametrize("granularity", ["page", "token"])
@pytest.mark.parametrize("page,blocked", [(16, False), (32, False), (256, False), (16, True), (256, True)])
def test_gpu_fp8_decode_8b_shape(granularity, page, blocked):
    """bf16 q, Hq 32 / Hkv 8 / D 128, 8K-token page lists (a shared and a per-head table)."""
    hq, hkv, d, n = 32, 8, 128, 8192
    rows = 4 * n
    g = torch.Generator().manual_seed(21)
    shape = (rows // page, page, hkv, d) if blocked else (rows, hkv, d)
    kq, ks = _fp8_store(shape, granularity, page, "cuda", seed=22, spread=True)
    vq, vs = _fp8_store(shape, granularity, page, "cuda", seed=23)
    for shared in (True, False):
        ht = 1 if shared else hkv
        perm = torch.stack([torch.randperm(rows // page, generator=g)[:n // page] for _ in range(3 * ht)])
        table = (perm if blocked else perm * page).view(3, ht, -1).to(torch.int32).cuda()
        q = _x((3, 1, hq, d), torch.bfloat16, "cuda", seed=24, spread=False)
        _check_decode(q, kq, ks, vq, vs, table, [n, 5000, 0], page, granularity)


@pytest.mark.cuda
@pytest.mark.parametrize("spage", [None, 32, 256])
def test_gpu_fp8_contiguous_decode_8b_shape(spage):
    """bf16 q, Hq 32 / Hkv 8 / D 128, caches of 8K positions; the paged kernel over the same cache
    seen as a block store agrees (token scales: same scales, so within the output tolerance)."""
    b, s, hq, hkv, d = 3, 8192, 32, 8, 128
    kq, ks = _fp8_cache(b, s, hkv, d, spage, "cuda", seed=51)
    vq, vs = _fp8_cache(b, s, hkv, d, spage, "cuda", seed=52)
    q = _x((b, 1, hq, d), torch.bfloat16, "cuda", seed=53, spread=False)
    lens = torch.tensor([8192, 5000, 0], dtype=torch.int32, device="cuda")
    out, lse = decode_attn_with_lse(q, kq, vq, lens, k_scale=ks, v_scale=vs, scale_page_size=spage)
    kd, vd = dequantize_cache_fp8_ref(kq, ks, spage or 1), dequantize_cache_fp8_ref(vq, vs, spage or 1)
    ref_o, ref_l = decode_attention_ref(q, kd, vd, lens)
    base = torch.cat([sdpa_in_dtype(q[i:i + 1], kd[i:i + 1, :n].to(q.dtype), vd[i:i + 1, :n].to(q.dtype))
                      for i, n in enumerate(lens.tolist())])
    assert max_err(out, ref_o) <= out_tol(ref_o, base, q.dtype)
    assert_lse_match(lse, ref_l)


@pytest.mark.cuda
@pytest.mark.parametrize("granularity", ["page", "token"])
def test_gpu_fp8_host_store_equals_device(granularity):
    """fp8 pages and their scales in pinned host memory, read over UVA: equal bit for bit to the
    same store on the GPU."""
    page, hkv, d, rows = 32, 8, 128, 16384
    kq, ks = _fp8_store((rows, hkv, d), granularity, page, "cuda", seed=31, spread=True)
    vq, vs = _fp8_store((rows, hkv, d), granularity, page, "cuda", seed=32)
    host = [t.cpu().pin_memory() for t in (kq, ks, vq, vs)]
    q = _x((2, 1, 32, d), torch.bfloat16, "cuda", seed=33, spread=False)
    g = torch.Generator().manual_seed(34)
    table = (torch.randperm(rows // page, generator=g)[:300] * page).view(1, 1, 300).expand(2, 1, 300)
    table = table.to(torch.int32).contiguous().cuda()
    lens = torch.tensor([300 * page, 1234], dtype=torch.int32, device="cuda")
    od, ld = paged_decode_attn_with_lse(q, kq, vq, table, lens, page_size=page, k_scale=ks, v_scale=vs)
    oh, lh = paged_decode_attn_with_lse(q, host[0], host[2], table, lens, page_size=page, k_scale=host[1],
                                        v_scale=host[3])
    torch.cuda.synchronize()
    assert torch.equal(od, oh) and torch.equal(ld, lh)
