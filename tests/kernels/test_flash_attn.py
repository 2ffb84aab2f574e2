"""Tests of flash_attn_with_lse / flash_attn_varlen_with_lse against the fp32 reference.

On a CPU-only machine the Triton kernel runs under Triton's interpreter (fp16/fp32 only); GPU
tests carry ``@pytest.mark.cuda``. Tolerances come from tests/helpers.py: the kernel's error against
the fp32 reference is at most about twice that of PyTorch's SDPA in the input dtype.
"""
import random

import pytest
import torch
import torch.nn.functional as F

from helpers import HAS_CUDA, assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import LaunchConfig, cpu_backend, flash_attn_varlen_with_lse, flash_attn_with_lse, launch_override
from xoffload.kernels.reference import attention_ref, causal_mask, masked_attention_ref, varlen_attention_ref


def _rand(shape, dtype, device, scale=1.0, gen=None):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def _merge_torch(o_a, l_a, o_b, l_b):
    """Merge two partial states ([B,S,H,D] outputs, [B,H,S] LSE) in fp32 with torch."""
    lse = torch.logaddexp(l_a, l_b)
    w_a = torch.nan_to_num(torch.exp(l_a - lse), nan=0.0).transpose(1, 2)[..., None]
    w_b = torch.nan_to_num(torch.exp(l_b - lse), nan=0.0).transpose(1, 2)[..., None]
    return w_a * o_a.float() + w_b * o_b.float(), lse


def check_dense(q, k, v, causal, softmax_scale=None):
    """Run the kernel and compare out / lse against the fp32 reference with the dtype tolerance."""
    b, sq, hq, d = q.shape
    out, lse = flash_attn_with_lse(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.shape == (b, sq, hq, d) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    ref_o, ref_l = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    base = sdpa_in_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert not torch.isnan(out).any(), "NaN in output"
    err, tol = max_err(out, ref_o), out_tol(ref_o, base, q.dtype)
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    empty = torch.isneginf(ref_l)  # rows that see no key: output exactly 0
    if empty.any():
        assert (out.float().transpose(1, 2)[empty] == 0).all()
    return out, lse


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) / GPU: a sample of the cross product
# ---------------------------------------------------------------------------------------------

_SEQS = (0, 1, 7, 64, 113, 257)
_HEADS = ((4, 4), (6, 2), (9, 3), (8, 1))
_DIMS = (64, 80, 96, 128)


def _sample_cases(n, seed=0):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        sq, sk = rng.choice(_SEQS), rng.choice(_SEQS)
        hq, hkv = rng.choice(_HEADS)
        d = rng.choice(_DIMS)
        causal = rng.random() < 0.6
        dtype = torch.float16 if rng.random() < 0.75 else torch.float32
        # keep the interpreter's cost bounded: the biggest shapes run with batch 1 and few heads
        work = sq * max(sk, 1) * hq
        if work > 257 * 257 * 6:
            continue
        b = 2 if work <= 64 * 113 * 9 else 1
        cases.append((b, sq, sk, hq, hkv, d, causal, dtype))
    return cases


# Fixed cases that must be there whatever the sample draws: Sq > Sk under causal (empty rows),
# empty sequences, every GQA ratio and head dim at least once.
_FIXED = [
    (1, 113, 7, 6, 2, 64, True, torch.float16),     # Sq > Sk: rows 0..105 see nothing
    (2, 64, 1, 8, 1, 80, True, torch.float32),      # Sk = 1
    (1, 257, 64, 9, 3, 96, True, torch.float16),    # Sq > Sk, several query blocks
    (1, 64, 257, 4, 4, 128, True, torch.float16),   # chunked prefill: Sq < Sk
    (2, 7, 113, 9, 3, 80, False, torch.float16),
    (1, 0, 64, 4, 4, 64, True, torch.float16),      # Sq = 0
    (2, 7, 0, 6, 2, 64, False, torch.float16),      # Sk = 0: out 0, lse -inf
    (1, 113, 113, 8, 1, 96, False, torch.float32),
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,dtype", _FIXED + _sample_cases(20))
def test_dense_matches_reference(device, b, sq, sk, hq, hkv, d, causal, dtype):
    g = torch.Generator().manual_seed(sq * 1000 + sk * 7 + hq + d)
    q = _rand((b, sq, hq, d), dtype, device, gen=g)
    k = _rand((b, sk, hkv, d), dtype, device, gen=g)
    v = _rand((b, sk, hkv, d), dtype, device, gen=g)
    check_dense(q, k, v, causal)


def test_sq_greater_than_sk_empty_rows(device):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key: out 0, lse -inf."""
    q = _rand((1, 40, 4, 64), torch.float16, device)
    k = _rand((1, 9, 2, 64), torch.float16, device)
    v = _rand((1, 9, 2, 64), torch.float16, device)
    out, lse = check_dense(q, k, v, True)
    assert torch.isneginf(lse[:, :, :31]).all() and torch.isfinite(lse[:, :, 31:]).all()
    assert (out[:, :31] == 0).all()


def test_fused_qkv_views_and_strides(device):
    """Views into a fused QKV buffer and a batch-transposed layout (only the last dim contiguous)."""
    b, s, hq, hkv, d = 2, 70, 6, 2, 64
    qkv = _rand((b, s, hq + 2 * hkv, d), torch.float16, device)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    assert not q.is_contiguous() and not k.is_contiguous()
    check_dense(q, k, v, True)
    # [S, B, H, D] storage seen as [B, S, H, D]
    q2 = _rand((s, b, hq, d), torch.float16, device).transpose(0, 1)
    k2 = _rand((s + 9, b, hkv, d), torch.float16, device).transpose(0, 1)
    v2 = _rand((b, hkv, s + 9, d), torch.float16, device).transpose(1, 2)
    check_dense(q2, k2, v2, False)


def test_softmax_scale(device):
    q = _rand((1, 33, 4, 64), torch.float32, device)
    k = _rand((1, 50, 4, 64), torch.float32, device)
    v = _rand((1, 50, 4, 64), torch.float32, device)
    check_dense(q, k, v, True, softmax_scale=0.37)


@pytest.mark.parametrize("cfg", [(32, 64, 4, 1), (16, 16, 4, 1), (64, 64, 4, 1)])
def test_other_block_shapes(device, cfg):
    """BLOCK_M < BLOCK_N, tiny blocks and square ones (D=80 < BLOCK_D: masked columns): the causal
    diagonal split and the loads must not depend on the tiling."""
    q = _rand((1, 100, 4, 80), torch.float16, device)
    k = _rand((1, 131, 2, 80), torch.float16, device)
    v = _rand((1, 131, 2, 80), torch.float16, device)
    with launch_override("flash_attn", cfg):
        check_dense(q, k, v, True)


@pytest.mark.parametrize("case", ["padded_causal_gqa_d80", "varlen", "unaligned_d20", "fp32", "keys_broadcast"])
def test_tma_loads(device, case, monkeypatch):
    """Q / K / V through tensor descriptors (``LaunchConfig.tma``): TMA zero-fills the rows past
    each sequence and the columns past D that the pointer loads mask, so the result matches the
    reference, and under the interpreter equals the pointer loads in the same tiles bit for bit.
    Tensors TMA cannot take (a head stride of 40 bytes, D=20 contiguous; fp32; keys broadcast along
    the sequence, row stride 0) fall back to pointer loads."""
    import xoffload.kernels.flash_attn as fa

    taken = []
    real = fa._tma_possible
    monkeypatch.setattr(fa, "_tma_possible", lambda *a: taken.append(real(*a)) or taken[-1])
    torch.manual_seed(3)
    ptr, tma = LaunchConfig(32, 16, 4, 1), LaunchConfig(32, 16, 4, 1, tma=True)
    if case == "varlen":
        lens_q, lens_k = [5, 40, 0, 33], [9, 37, 12, 50]
        cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
        q = _rand((sum(lens_q), 6, 64), torch.float16, device)
        k = _rand((sum(lens_k), 2, 64), torch.float16, device)
        v = _rand((sum(lens_k), 2, 64), torch.float16, device)
        outs = []
        for cfg in (ptr, tma):
            with launch_override("flash_attn", cfg):
                outs.append(flash_attn_varlen_with_lse(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True))
        with launch_override("flash_attn", tma):  # against the reference, with the dtype's tolerance
            _check_varlen(lens_q, lens_k, 6, 2, 64, True, torch.float16, device)
    else:
        b, sq, sk, hq, hkv, d, dt = {"padded_causal_gqa_d80": (2, 50, 71, 6, 2, 80, torch.float16),
                                     "unaligned_d20": (1, 40, 45, 2, 1, 20, torch.float16),
                                     "fp32": (1, 33, 47, 4, 2, 64, torch.float32),
                                     "keys_broadcast": (1, 30, 40, 4, 2, 64, torch.float16)}[case]
        q = _rand((b, sq, hq, d), dt, device)
        k = _rand((b, sk, hkv, d), dt, device)
        v = _rand((b, sk, hkv, d), dt, device)
        if case == "keys_broadcast":
            k = k[:, :1].expand(b, sk, hkv, d)
        outs = []
        for cfg in (ptr, tma):
            with launch_override("flash_attn", cfg):
                outs.append(check_dense(q, k, v, True))
    assert taken and all(taken) == (case not in ("unaligned_d20", "fp32", "keys_broadcast"))  # descriptors used iff possible
    if device == "cpu":
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_tma_needs_a_gpu_with_tma(monkeypatch):
    """Before sm_90 Triton lowers descriptors to pointer loads, in tiles that spill: such a GPU
    gets neither the descriptors nor the TMA tiles (_gpu_config without tma)."""
    import types

    import xoffload.kernels.flash_attn as fa

    seen = []
    monkeypatch.setattr(fa, "_has_tma", lambda idx: seen.append(idx) or False)
    t = types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=True, device=torch.device("cuda", 1),
                              numel=lambda: 64)
    assert not fa._tma_possible(t, t, t, fa._PLAIN) and seen == [1]
    assert fa._gpu_config(128, torch.bfloat16, tma=False) == LaunchConfig(128, 128, 8, 3)
    assert fa._gpu_config(128, torch.bfloat16, tma=True) == LaunchConfig(128, 64, 4, 2, tma=True)


def test_split_k_merge_equals_whole(device):
    """Attention over keys [0, p) (non-causal: every query row sees them) merged by LSE with causal
    attention over keys [p, Sk) equals causal attention over all keys (chunked prefill)."""
    b, sq, sk, hq, hkv, d = 1, 50, 120, 6, 2, 64
    q = _rand((b, sq, hq, d), torch.float32, device)
    k = _rand((b, sk, hkv, d), torch.float32, device)
    v = _rand((b, sk, hkv, d), torch.float32, device)
    p = 53  # <= sk - sq, so the prefix is fully visible to every row
    o_a, l_a = flash_attn_with_lse(q, k[:, :p], v[:, :p], causal=False)
    o_b, l_b = flash_attn_with_lse(q, k[:, p:], v[:, p:], causal=True)
    o_m, l_m = _merge_torch(o_a, l_a, o_b, l_b)
    o_w, l_w = flash_attn_with_lse(q, k, v, causal=True)
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    assert max_err(o_m, o_w) <= 1e-5 and max_err(o_m, ref_o) <= 1e-5
    assert max_err(l_m, l_w) <= 1e-5
    assert_lse_match(l_m, ref_l)
    # a split of a non-causal problem into two arbitrary halves
    o_a, l_a = flash_attn_with_lse(q, k[:, :17], v[:, :17])
    o_b, l_b = flash_attn_with_lse(q, k[:, 17:], v[:, 17:])
    o_m, l_m = _merge_torch(o_a, l_a, o_b, l_b)
    ref_o, ref_l = attention_ref(q, k, v)
    assert max_err(o_m, ref_o) <= 1e-5
    assert_lse_match(l_m, ref_l)


def _check_varlen(lens_q, lens_k, hq, hkv, d, causal, dtype, device):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    tq, tk = sum(lens_q), sum(lens_k)
    q = _rand((tq, hq, d), dtype, device)
    k = _rand((tk, hkv, d), dtype, device)
    v = _rand((tk, hkv, d), dtype, device)
    out, lse = flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, tq)
    ref_o, ref_l = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    tol = 0.0
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        base = sdpa_in_dtype(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal=causal)[0]
        tol = max(tol, out_tol(ref_o[qs:qe], base, dtype))
    err = max_err(out, ref_o)
    assert err <= tol, f"varlen output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(device, causal):
    # includes an empty query sequence, an empty key sequence and Sq_b > Sk_b
    _check_varlen([1, 50, 113, 0, 20], [1, 50, 130, 5, 0], 6, 2, 64, causal, torch.float16, device)


def test_varlen_gqa_fp32(device):
    _check_varlen([7, 64, 1], [80, 64, 33], 9, 3, 96, True, torch.float32, device)


def test_varlen_unchecked_reads_nothing_on_the_host(device, monkeypatch):
    """check=False (unpaged, no seqused_k): the same result as a checked call, and neither the
    cu_seqlens nor the max_seqlen host checks run (no device->host read: a batched prefill's hot
    loop); the dtype/shape checks still do."""
    from xoffload.kernels import checks, flash_attn as fa

    lens = [1, 17, 64, 5]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    q = _rand((sum(lens), 4, 32), torch.float32, device)
    k = _rand((sum(lens), 2, 32), torch.float32, device)
    v = _rand((sum(lens), 2, 32), torch.float32, device)
    want = flash_attn_varlen_with_lse(q, k, v, cu, cu, 64, 64, causal=True)

    def no_host_read(*a, **kw):
        raise AssertionError("host read")

    reads = []

    def cu_check(name, cu, total, dev, values=True):
        reads.append(values)
        return checks.check_cu_seqlens(name, cu, total, dev, values=values)

    monkeypatch.setattr(fa, "_check_max_seqlen", no_host_read)
    monkeypatch.setattr(fa, "check_cu_seqlens", cu_check)
    got = flash_attn_varlen_with_lse(q, k, v, cu, cu, 64, 64, causal=True, check=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and reads == [False, False]
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_attn_varlen_with_lse(q, k, v, cu.long(), cu, 64, 64, check=False)
    with pytest.raises(AssertionError, match="host read"):  # checked calls still read
        flash_attn_varlen_with_lse(q, k, v, cu, cu, 64, 64)


def test_reference_backend_matches_dtype_contract():
    """The CPU reference path (no interpreter) returns q's dtype and fp32 LSE, like the kernel."""
    q = torch.randn(1, 9, 4, 64, dtype=torch.float16)
    k = torch.randn(1, 5, 2, 64, dtype=torch.float16)
    with cpu_backend("reference"):
        out, lse = flash_attn_with_lse(q, k, k, causal=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and lse.shape == (1, 4, 9)
    assert torch.isneginf(lse[0, :, :4]).all() and (out[0, :4] == 0).all()


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------

def _qkv(b=1, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=torch.float16):
    return (torch.zeros(b, sq, hq, d, dtype=dtype), torch.zeros(b, sk, hkv, d, dtype=dtype),
            torch.zeros(b, sk, hkv, d, dtype=dtype))


@pytest.mark.parametrize("mutate,exc,pattern", [
    (lambda q, k, v: (q, k.float(), v), TypeError, r"k has dtype torch.float32 but q"),
    (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, r"q has dtype torch.int32"),
    (lambda q, k, v: ([1.0], k, v), TypeError, r"q must be a torch.Tensor"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, r"k is on meta"),
    (lambda q, k, v: (torch.zeros(1, 8, 4, 128, dtype=q.dtype)[..., ::2], k, v), ValueError,
     r"q must have a contiguous last dim.*\(1, 8, 4, 64\)"),
    (lambda q, k, v: (q, torch.zeros(1, 8, 3, 64, dtype=q.dtype), torch.zeros(1, 8, 3, 64, dtype=q.dtype)),
     ValueError, r"q heads \(4\) must be a multiple of k heads \(3\)"),
    (lambda q, k, v: (torch.zeros(1, 8, 4, 288, dtype=q.dtype), torch.zeros(1, 8, 2, 288, dtype=q.dtype),
                      torch.zeros(1, 8, 2, 288, dtype=q.dtype)), ValueError, r"head_dim must be in \[1, 256\], got 288"),
    (lambda q, k, v: (q, k, torch.zeros(1, 9, 2, 64, dtype=q.dtype)), ValueError,
     r"k and v must have the same shape.*\(1, 8, 2, 64\).*\(1, 9, 2, 64\)"),
    (lambda q, k, v: (q, torch.zeros(1, 8, 2, 32, dtype=q.dtype), torch.zeros(1, 8, 2, 32, dtype=q.dtype)),
     ValueError, r"same head_dim: q \(1, 8, 4, 64\), k \(1, 8, 2, 32\)"),
    (lambda q, k, v: (q, torch.zeros(2, 8, 2, 64, dtype=q.dtype), torch.zeros(2, 8, 2, 64, dtype=q.dtype)),
     ValueError, r"same batch size: q \(1, 8, 4, 64\), k \(2, 8, 2, 64\)"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dims, got shape \(8, 4, 64\)"),
])
def test_bad_inputs(mutate, exc, pattern):
    q, k, v = mutate(*_qkv())
    with pytest.raises(exc, match=pattern):
        flash_attn_with_lse(q, k, v)


def test_bad_flags():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_with_lse(q, k, v, causal=1)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_with_lse(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_with_lse(q, k, v, softmax_scale=float("nan"))


def test_bad_varlen_inputs():
    q = torch.zeros(10, 4, 64, dtype=torch.float16)
    k = torch.zeros(12, 2, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    f = flash_attn_varlen_with_lse
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        f(q, k, k, cu_q.long(), cu_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        f(q, k, k, cu_q, torch.tensor([0, 8, 5, 12], dtype=torch.int32), 6, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 9 must equal the packed length 10"):
        f(q, k, k, torch.tensor([0, 4, 9], dtype=torch.int32), cu_k, 6, 7)
    with pytest.raises(ValueError, match=r"cu_seqlens_q \(3,\) and cu_seqlens_k \(4,\)"):
        f(q, k, k, cu_q, torch.tensor([0, 5, 6, 12], dtype=torch.int32), 6, 7)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 5 is smaller than the longest sequence"):
        f(q, k, k, cu_q, cu_k, 5, 7)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        f(q, k, k, cu_q, cu_k, 6, 7.0)
    with pytest.raises(ValueError, match=r"q must have 3 dims"):
        f(q[None], k, k, cu_q, cu_k, 6, 7)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        f(q, k, k[:11], cu_q, cu_k, 6, 7)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

def _sampled_check(q, k, v, causal, rows, b=0):
    """Oracle for long sequences: fp32 reference and input-dtype SDPA on a sample of query rows."""
    sq, sk = q.shape[1], k.shape[1]
    out, lse = flash_attn_with_lse(q, k, v, causal=causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    rows = torch.as_tensor(sorted(set(int(r) for r in rows if 0 <= r < sq)), device=q.device)
    allowed = None
    if causal:
        allowed = torch.arange(sk, device=q.device)[None, :] <= (rows[:, None] + sk - sq)
    hq, hkv = q.shape[2], k.shape[2]
    for h0 in range(0, hkv, max(1, hkv // 2)):  # a few KV groups, not all, to bound memory
        hs = slice(h0 * (hq // hkv), (h0 + 1) * (hq // hkv))
        qs, ks, vs = q[b, rows][:, hs], k[b, :, h0:h0 + 1], v[b, :, h0:h0 + 1]
        ref_o, ref_l = masked_attention_ref(qs, ks, vs, None if allowed is None else allowed[None])
        g = hq // hkv
        qt = qs.transpose(0, 1)[None]
        kt = ks.transpose(0, 1)[None].expand(1, g, sk, ks.shape[-1])
        vt = vs.transpose(0, 1)[None].expand(1, g, sk, vs.shape[-1])
        base = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed)[0].transpose(0, 1)
        got_o = out[b, rows][:, hs]
        err, tol = max_err(got_o, ref_o), out_tol(ref_o, torch.nan_to_num(base), q.dtype)
        assert err <= tol, f"rows sample: output error {err:.3g} > tol {tol:.3g}"
        assert_lse_match(lse[b, hs][:, rows], ref_l)
    return out, lse


_GPU_CASES = [
    # dtype, B, Sq, Sk, Hq, Hkv, D, causal
    (torch.bfloat16, 1, 4096, 4096, 32, 8, 128, True),
    (torch.float16, 2, 1000, 1000, 28, 4, 128, False),
    (torch.bfloat16, 1, 2048, 2048, 48, 2, 64, True),
    (torch.bfloat16, 1, 1500, 4000, 40, 8, 128, True),
    (torch.float16, 1, 3001, 3001, 9, 3, 64, True),
    (torch.bfloat16, 2, 777, 777, 9, 3, 80, False),
    (torch.bfloat16, 1, 1111, 1111, 8, 2, 96, True),
    (torch.bfloat16, 1, 2000, 2000, 8, 2, 256, True),
    (torch.float16, 1, 513, 300, 8, 4, 256, True),
    (torch.float32, 1, 700, 900, 6, 2, 128, True),
    (torch.float32, 1, 300, 300, 4, 1, 256, False),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,b,sq,sk,hq,hkv,d,causal", _GPU_CASES)
def test_gpu_dense(dtype, b, sq, sk, hq, hkv, d, causal):
    torch.manual_seed(0)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    check_dense(q, k, v, causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,hq,hkv,d", [(torch.bfloat16, 32, 8, 128), (torch.float16, 9, 3, 64),
                                             (torch.bfloat16, 28, 4, 80)])
def test_gpu_32k(dtype, hq, hkv, d):
    torch.manual_seed(1)
    s = 32768
    q = torch.randn(1, s, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(1, s, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(1, s, hkv, d, device="cuda", dtype=dtype)
    rows = [0, 1, 127, 128, 4097, 16384, s - 129, s - 2, s - 1] + torch.randint(0, s, (23,)).tolist()
    _sampled_check(q, k, v, True, rows)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_inputs_x100(dtype):
    """Inputs scaled by 100: scores ~1e4; fp32 accumulation must neither overflow nor lose the max."""
    torch.manual_seed(2)
    q = torch.randn(1, 1024, 8, 128, device="cuda").mul(100).to(dtype)
    k = torch.randn(1, 1024, 2, 128, device="cuda").mul(100).to(dtype)
    v = torch.randn(1, 1024, 2, 128, device="cuda").mul(100).to(dtype)
    out, lse = flash_attn_with_lse(q, k, v, causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = sdpa_in_dtype(q, k, v, causal=True)
    assert torch.isfinite(base).all()
    tol = out_tol(ref_o, base, dtype)
    assert max_err(out, ref_o) <= tol
    assert_lse_match(lse, ref_l, max_abs_score=float(ref_l.abs().max()))


@pytest.mark.cuda
def test_gpu_many_heads_grid():
    """B * Hq = 4096 programs per query block."""
    torch.manual_seed(3)
    q = torch.randn(128, 100, 32, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(128, 100, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(128, 100, 8, 64, device="cuda", dtype=torch.bfloat16)
    check_dense(q, k, v, True)


@pytest.mark.cuda
def test_gpu_varlen():
    _check_varlen([1, 3000, 70, 0, 4097], [1, 3000, 900, 10, 5000], 32, 8, 128, True, torch.bfloat16, "cuda")
    _check_varlen([513, 2], [600, 2], 9, 3, 64, False, torch.float16, "cuda")


@pytest.mark.cuda
def test_gpu_kv_over_2pow31_elements():
    """K/V of 2 x 1.1M tokens x 8 heads x 128 (> 2^31 elements each): offsets must be int64. A
    planted needle near the end of batch item 1 must dominate its rows' output."""
    b, sk, hkv, d, hq, sq = 2, 1_100_000, 8, 128, 8, 16
    assert b * sk * hkv * d > 2**31
    torch.manual_seed(4)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    pos = sk - 100  # visible to every row (row i sees keys j <= i + sk - sq)
    k[1, pos] = q[1, 0].float().mul(3.0).to(torch.bfloat16)  # needle key for query 0 of each head
    v[1, pos] = 7.0
    out, lse = flash_attn_with_lse(q, k, v, causal=True)  # Sq << Sk: every row sees almost all keys
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for bi in range(b):
        for h in (0, 5):
            ref_o, ref_l = masked_attention_ref(q[bi, :, h:h + 1], k[bi, :, h:h + 1], v[bi, :, h:h + 1],
                                                causal_mask(sq, sk, "cuda")[None])
            tol = 4 * torch.finfo(torch.bfloat16).eps * max(1.0, float(ref_o.abs().max()))
            assert max_err(out[bi, :, h:h + 1], ref_o) <= tol
            assert_lse_match(lse[bi, h:h + 1], ref_l)
    assert float(out[1, 0, 0].float().mean()) > 6.0  # the needle dominates


@pytest.mark.cuda
def test_gpu_131072_tokens():
    torch.manual_seed(5)
    s = 131072
    q = torch.randn(1, s, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, s, 2, 64, device="cuda", dtype=torch.bfloat16)
    rows = [0, 1, 65535, 65536, 100000, s - 1] + torch.randint(0, s, (10,)).tolist()
    _sampled_check(q, k, v, True, rows)


_GPU_CONFIGS = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4),
         (128, 64, 4, 2, True)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 64, 4, 2, True),
          (128, 64, 8, 3, True)],
}


@pytest.mark.cuda
@pytest.mark.parametrize("d,cfg", [(d, c) for d in (64, 128) for c in _GPU_CONFIGS[d]])
def test_gpu_candidate_configs(d, cfg):
    """Every launch configuration the benchmark sweeps (BLOCK_N 64/128, 2-4 stages): varlen with
    empty sequences and Sq_b > Sk_b, and fused-QKV strided views."""
    with launch_override("flash_attn", cfg):
        _check_varlen([1, 300, 0, 130, 77], [1, 280, 17, 0, 300], 8, 2, d, True, torch.bfloat16, "cuda")
        qkv = torch.randn(2, 333, 12, d, device="cuda", dtype=torch.bfloat16)
        check_dense(qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:], True)
        check_dense(qkv[:, :100, :8], qkv[:, :, 8:10], qkv[:, :, 10:], False)


def test_varlen_strided_cu_seqlens_views(device):
    """cu_seqlens given as strided views read the views' values (not the underlying storage)."""
    torch.manual_seed(0)
    cq = torch.tensor([0, 9, 3, 9, 8, 9], dtype=torch.int32, device=device)[::2]
    ck = torch.tensor([0, 9, 2, 9, 6, 9], dtype=torch.int32, device=device)[::2]
    q = torch.randn(8, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(6, 1, 16, device=device, dtype=torch.float16)
    v = torch.randn(6, 1, 16, device=device, dtype=torch.float16)
    o, lse = flash_attn_varlen_with_lse(q, k, v, cq, ck, 5, 4, causal=True)
    o2, lse2 = flash_attn_varlen_with_lse(q, k, v, cq.contiguous(), ck.contiguous(), 5, 4, causal=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert not torch.isnan(o).any()
