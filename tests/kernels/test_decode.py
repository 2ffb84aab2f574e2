"""Tests of decode_attn_with_lse (split-KV decode) against the fp32 reference.

CPU: the Triton code under the interpreter (fp16/fp32). GPU (``-m cuda``): bf16/fp16, D up to 256,
128K-token caches and a cache with more than 2^31 elements.
"""
import pytest
import torch

from helpers import HAS_CUDA, assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import cpu_backend, decode_attn_with_lse
from xoffload.kernels.decode import default_num_splits
from xoffload.kernels.reference import decode_attention_ref



def _make(b, s_max, hq, hkv, d, dtype, device, scale=1.0, seed=0):
    """q [B,1,Hq,D] and K/V caches [B,S_max,Hkv,D] that are slices of larger buffers (non-contiguous)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(b, 1, hq + 2, d, generator=g, device=device) * scale).to(dtype)[:, :, 1:hq + 1]
    buf = (torch.randn(b, s_max + 5, hkv, 2 * d + 8, generator=g, device=device) * scale).to(dtype)
    k = buf[:, 3:s_max + 3, :, :d]
    v = buf[:, 5:s_max + 5, :, d + 8:]
    return q, k, v


def _baseline(q, k, v, lens):
    """PyTorch SDPA in the input dtype, per sequence (sets the tolerance)."""
    outs = [sdpa_in_dtype(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]) for i, n in enumerate(lens)]
    return torch.cat(outs)


def _check(q, k, v, lens, **kw):
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    out, lse = decode_attn_with_lse(q, k, v, seqlens, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], 1) and lse.dtype == torch.float32
    ref_o, ref_l = decode_attention_ref(q, k, v, seqlens.cpu() if q.is_cuda else seqlens)
    base = _baseline(q, k, v, lens)
    err = max_err(out, ref_o)
    tol = out_tol(ref_o, base, q.dtype)
    assert err <= tol, f"out error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    return out, lse


# ------------------------------------------------------------------------------------------ CPU
CASES = [  # (Hq, Hkv, D, dtype, num_splits)
    (4, 4, 64, torch.float16, None),
    (6, 2, 80, torch.float32, 3),
    (9, 3, 96, torch.float16, None),
    (8, 1, 128, torch.float16, 2),
    (9, 3, 64, torch.float32, 1),
    (6, 2, 128, torch.float16, 7),
    (4, 4, 80, torch.float32, None),
    (72, 1, 64, torch.float16, 2),  # group of 72 > 64 rows: two M blocks per KV head
]


@pytest.mark.parametrize("hq,hkv,d,dtype,num_splits", CASES)
def test_decode_matches_reference(device, hq, hkv, d, dtype, num_splits):
    q, k, v = _make(3, 300, hq, hkv, d, dtype, device)
    _check(q, k, v, [1, 37, 300], num_splits=num_splits)


def test_decode_empty_sequence(device):
    q, k, v = _make(3, 64, 6, 2, 64, torch.float16, device, seed=1)
    out, lse = _check(q, k, v, [0, 64, 0], num_splits=2)
    assert torch.equal(out[0].float().cpu(), torch.zeros_like(out[0].float().cpu()))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all()
    assert not torch.isnan(out).any()


def test_decode_large_values(device):
    # x30 inputs: scores in the thousands; exp must not overflow in the fp16 path
    q, k, v = _make(2, 130, 4, 2, 64, torch.float16, device, scale=30.0, seed=2)
    _check(q, k, v, [130, 77], num_splits=3)


def test_decode_softmax_scale_and_check_false(device):
    q, k, v = _make(2, 100, 4, 4, 64, torch.float32, device, seed=3)
    lens = torch.tensor([100, 9], dtype=torch.int32, device=device)
    o1, l1 = decode_attn_with_lse(q, k, v, lens, softmax_scale=0.3, num_splits=2)
    o2, l2 = decode_attn_with_lse(q, k, v, lens, softmax_scale=0.3, num_splits=2, check=False)
    ro, rl = decode_attention_ref(q, k, v, lens.cpu(), softmax_scale=0.3)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert max_err(o1, ro) < 1e-5
    assert_lse_match(l1, rl)
    # check=False: lengths are clamped to [0, S_max] instead of reading outside the cache
    o3, l3 = decode_attn_with_lse(q, k, v, torch.tensor([1000, 9], dtype=torch.int32, device=device),
                                  softmax_scale=0.3, num_splits=2, check=False)
    assert torch.equal(o3, o1) and torch.equal(l3, l1)


def test_decode_batch_zero(device):
    q = torch.zeros(0, 1, 4, 64, dtype=torch.float16, device=device)
    k = torch.zeros(0, 10, 2, 64, dtype=torch.float16, device=device)
    out, lse = decode_attn_with_lse(q, k, k, torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1)


def test_decode_reference_backend_cpu():
    # the CPU path without the interpreter gives the same answer
    q, k, v = _make(2, 50, 6, 2, 64, torch.float32, "cpu", seed=4)
    lens = torch.tensor([50, 13], dtype=torch.int32)
    with cpu_backend("reference"):
        o, l = decode_attn_with_lse(q, k, v, lens)
    ro, rl = decode_attention_ref(q, k, v, lens)
    assert max_err(o, ro) < 1e-6
    assert_lse_match(l, rl)


def test_default_num_splits_fills_gpu():
    # depends on shapes only; B=1, Hkv=8 at 128K fills 132 SMs with >= 4 programs each
    n = default_num_splits(1, 8, 4, 131072, 132)
    assert n * 8 >= 4 * 132 and n <= 128
    assert default_num_splits(1, 8, 4, 100, 132) == 1
    assert default_num_splits(64, 8, 4, 131072, 132) >= 1


# ------------------------------------------------------------------------------------ bad inputs
def _good(dtype=torch.float16):
    q = torch.randn(2, 1, 4, 64).to(dtype)
    k = torch.randn(2, 16, 2, 64).to(dtype)
    v = torch.randn(2, 16, 2, 64).to(dtype)
    return q, k, v, torch.tensor([3, 16], dtype=torch.int32)


def test_bad_inputs():
    q, k, v, lens = _good()
    with pytest.raises(TypeError, match="k_cache"):
        decode_attn_with_lse(q, k.to(torch.float32), v, lens)
    with pytest.raises(TypeError, match="q"):
        decode_attn_with_lse([1, 2], k, v, lens)
    with pytest.raises(ValueError, match="device"):
        decode_attn_with_lse(q, k.to("meta"), v, lens)
    kt = torch.randn(2, 16, 2, 64).half().transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="k_cache.*contiguous last dim"):
        decode_attn_with_lse(q, kt, v, lens)
    with pytest.raises(ValueError, match=r"multiple"):
        decode_attn_with_lse(torch.randn(2, 1, 6, 64).half(), torch.randn(2, 16, 4, 64).half(),
                             torch.randn(2, 16, 4, 64).half(), lens)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.randn(2, 16, 2, 288).half()
        decode_attn_with_lse(torch.randn(2, 1, 4, 288).half(), big, big, lens)
    with pytest.raises(ValueError, match="v_cache"):
        decode_attn_with_lse(q, k, v[:, :8], lens)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        decode_attn_with_lse(q[:, 0], k, v, lens)
    with pytest.raises(ValueError, match="k_cache batch.*cache_batch_idx"):
        decode_attn_with_lse(q[:1], k, v, lens[:1])
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        decode_attn_with_lse(q, k, v, lens.long())
    with pytest.raises(TypeError, match="cache_seqlens"):
        decode_attn_with_lse(q, k, v, [3, 16])
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \[B\]"):
        decode_attn_with_lse(q, k, v, lens[:1])
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, S_max=16\]"):
        decode_attn_with_lse(q, k, v, torch.tensor([3, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens must be in"):
        decode_attn_with_lse(q, k, v, torch.tensor([-1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="softmax_scale"):
        decode_attn_with_lse(q, k, v, lens, softmax_scale=0.0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attn_with_lse(q, k, v, lens, num_splits=0)
    with pytest.raises(TypeError, match="dtype"):
        decode_attn_with_lse(q.to(torch.int8), k.to(torch.int8), v.to(torch.int8), lens)


# ------------------------------------------------------------------------------------------ GPU
def _chunked_ref(q, k, v, n, chunk=1 << 16):
    """fp32 decode reference for one sequence without repeating K/V per query head (fits huge caches).

    q [Hq, D], k/v [S, Hkv, D]; returns (out [Hq, D], lse [Hq])."""
    hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.float().view(hkv, g, d) / d ** 0.5
    outs, lses = [], []
    for s0 in range(0, n, chunk):
        kf = k[s0:min(n, s0 + chunk)].float().permute(1, 2, 0)  # [Hkv, D, c]
        vf = v[s0:min(n, s0 + chunk)].float().permute(1, 0, 2)  # [Hkv, c, D]
        s = torch.bmm(qf, kf)  # [Hkv, g, c]
        l = torch.logsumexp(s, -1)
        outs.append(torch.bmm(torch.exp(s - l[..., None]), vf).reshape(hq, d))
        lses.append(l.reshape(hq))
    l = torch.stack(lses)
    lse = torch.logsumexp(l, 0)
    w = torch.exp(l - lse)
    return (w[..., None] * torch.stack(outs)).sum(0), lse


GPU_CASES = [  # (Hq, Hkv, D, dtype)
    (32, 8, 128, torch.bfloat16),
    (28, 4, 96, torch.float16),
    (48, 2, 64, torch.bfloat16),
    (40, 8, 256, torch.bfloat16),
    (9, 3, 80, torch.float16),
    (32, 8, 256, torch.float16),
    (9, 3, 64, torch.bfloat16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,d,dtype", GPU_CASES)
def test_decode_gpu(hq, hkv, d, dtype):
    q, k, v = _make(3, 32768 + 64, hq, hkv, d, dtype, "cuda", seed=5)
    _check(q, k, v, [1, 4097, 32768 + 64])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_gpu_scaled(dtype):
    q, k, v = _make(2, 8192, 32, 8, 128, dtype, "cuda", scale=10.0, seed=6)
    _check(q, k, v, [8192, 3000])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu_128k(dtype):
    q, k, v = _make(2, 131072, 32, 8, 128, dtype, "cuda", seed=7)
    _check(q, k, v, [131072, 100003])


@pytest.mark.cuda
def test_decode_gpu_cache_over_2g_elements():
    # K has 1 * (2^21 + 256) * 8 * 128 > 2^31 elements (4 GiB in bf16); the last keys matter
    s = (1 << 21) + 256
    torch.manual_seed(8)
    k = torch.randn(1, s, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, s, 8, 128, dtype=torch.bfloat16, device="cuda")
    k[0, -200:] *= 4.0  # the tail (past 2^31 elements) dominates the softmax
    assert k.numel() > 2 ** 31
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    for n in (s, s - 100):
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        out, lse = decode_attn_with_lse(q, k, v, lens)
        ro, rl = _chunked_ref(q[0, 0], k[0], v[0], n)
        err = max_err(out[0, 0], ro)
        tol = out_tol(ro, ro.to(torch.bfloat16), torch.bfloat16, ulps=4.0)
        assert err <= tol, f"out error {err:.3g} > tol {tol:.3g}"
        assert_lse_match(lse[0, :, 0], rl)


def test_strided_cache_seqlens_view(device):
    """cache_seqlens given as a strided view (every other element) reads the view's values."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(2, 40, 1, 16, device=device, dtype=torch.float16)
    v = torch.randn(2, 40, 1, 16, device=device, dtype=torch.float16)
    lens = torch.tensor([33, 0, 7, 0], dtype=torch.int32, device=device)[::2]
    a, la = decode_attn_with_lse(q, k, v, lens)
    b, lb = decode_attn_with_lse(q, k, v, lens.contiguous())
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert torch.isfinite(la).all()
