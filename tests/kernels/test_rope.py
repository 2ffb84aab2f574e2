"""Tests of the fused QKV split + RoPE (+ Qwen3 q/k RMSNorm) kernel (xoffload.kernels.qkv_rope)
against the model's PyTorch code ``apply_rope(rms_norm(q, q_norm) if q_norm else q, cos, sin)`` and
an fp64 reference.

CPU: the Triton code under the interpreter (conftest) and the PyTorch fallback, fp16/fp32, small
shapes. GPU (``-m cuda``): bf16/fp16 at Llama-3.1-8B / Qwen3-8B shapes.
"""
import importlib

import pytest
import torch

from helpers import max_err, out_tol
from xoffload.kernels import cpu_backend, qkv_rope
from xoffload.models.llama import apply_rope, rms_norm

rope_mod = importlib.import_module("xoffload.kernels.rope")
EPS = 1e-6


def _tables(n_max, d, dtype, device, base=10000.0):
    """cos/sin ``[n_max, 1, D]`` in the model dtype, built as LlamaModel.rope_tables does."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(n_max, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :].to(device), emb.sin().to(dtype)[:, None, :].to(device)


def _split(qkv, hq, hkv, d):
    n = qkv.shape[0]
    return (qkv[:, : hq * d].reshape(n, hq, d), qkv[:, hq * d: (hq + hkv) * d].reshape(n, hkv, d),
            qkv[:, (hq + hkv) * d:].reshape(n, hkv, d))


def _model_code(qkv, cos, sin, p0, hq, hkv, d, qn, kn):
    """The PyTorch code of xoffload.models.llama (in the input dtype): the error baseline."""
    n = qkv.shape[0]
    q, k, v = _split(qkv, hq, hkv, d)
    c, s = cos[p0:p0 + n], sin[p0:p0 + n]
    q = apply_rope(rms_norm(q, qn, EPS) if qn is not None else q, c, s)
    k = apply_rope(rms_norm(k, kn, EPS) if kn is not None else k, c, s)
    return q, k, v


def _exact(qkv, cos, sin, p0, hq, hkv, d, qn, kn):
    """fp64, no intermediate rounding (tables as given)."""
    n = qkv.shape[0]
    q, k, _ = (t.double() for t in _split(qkv, hq, hkv, d))
    c = cos.reshape(cos.shape[0], d)[p0:p0 + n].double()[:, None, :]
    s = sin.reshape(sin.shape[0], d)[p0:p0 + n].double()[:, None, :]

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double() if w is not None else x

    def rope(x):
        h = d // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s

    return rope(norm(q, qn)), rope(norm(k, kn))


def _check(outs, qkv, cos, sin, p0, hq, hkv, d, qn, kn, dtype):
    q_out, k_out, v_out = outs
    bq, bk, bv = _model_code(qkv, cos, sin, p0, hq, hkv, d, qn, kn)
    eq, ek = _exact(qkv, cos, sin, p0, hq, hkv, d, qn, kn)
    for name, got, base, ref in (("q", q_out, bq, eq), ("k", k_out, bk, ek)):
        assert got.dtype == dtype
        err = max_err(got, ref)
        tol = out_tol(ref, base, dtype)
        assert err <= tol, f"{name}: error {err:.3g} > tol {tol:.3g}"
    assert torch.equal(v_out, bv), "v must be copied exactly"


def _data(n, hq, hkv, d, dtype, device, seed=0, row_pad=0, norms=False):
    g = torch.Generator().manual_seed(seed)
    w = (hq + 2 * hkv) * d
    qkv = (torch.randn(n, w + row_pad, generator=g) * 2).to(device=device, dtype=dtype)[:, :w]
    qn = kn = None
    if norms:
        qn = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
        kn = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
    return qkv, qn, kn


def _outs(n, hq, hkv, d, dtype, device, strided=False):
    if not strided:
        return (torch.empty(n, hq, d, dtype=dtype, device=device), torch.empty(n, hkv, d, dtype=dtype, device=device),
                torch.empty(n, hkv, d, dtype=dtype, device=device))
    # slices of bigger buffers: token stride and head stride both unusual
    qb = torch.full((n + 3, 2 * hq, d), 9.0, dtype=dtype, device=device)
    kb = torch.full((n + 5, hkv + 1, d), 9.0, dtype=dtype, device=device)
    vb = torch.full((2 * n, hkv, d), 9.0, dtype=dtype, device=device)
    return qb[2:2 + n, ::2], kb[5:, 1:], vb[::2], (qb, kb, vb)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,hq,hkv,d,p0,norms", [
    (1, 4, 2, 64, 0, False),
    (9, 4, 2, 64, 5, True),
    (37, 3, 1, 128, 100, False),
    (6, 2, 2, 80, 11, True),   # head_dim not a power of two (masked halves)
    (5, 6, 3, 64, 2, True),    # 3 heads per program, padded to 4 (masked heads)
])
def test_matches_model_code(device, dtype, n, hq, hkv, d, p0, norms):
    qkv, qn, kn = _data(n, hq, hkv, d, dtype, device, seed=n * d + p0, row_pad=16, norms=norms)
    cos, sin = _tables(p0 + n + 7, d, dtype, device)
    q_out, k_out, v_out, (qb, kb, vb) = _outs(n, hq, hkv, d, dtype, device, strided=True)
    res = qkv_rope(qkv, cos, sin, p0, hq, hkv, d, q_out, k_out, v_out, q_norm=qn, k_norm=kn, eps=EPS)
    assert all(r.data_ptr() == o.data_ptr() for r, o in zip(res, (q_out, k_out, v_out)))
    _check(res, qkv, cos, sin, p0, hq, hkv, d, qn, kn, dtype)
    # nothing written outside the views
    assert bool((qb[:2] == 9).all()) and bool((qb[2:2 + n, 1::2] == 9).all()) and bool((qb[2 + n:] == 9).all())
    assert bool((kb[:5] == 9).all()) and bool((kb[5:, :1] == 9).all())
    assert bool((vb[1::2] == 9).all())


def test_only_k_norm_and_2d_tables_and_tensor_position(device):
    n, hq, hkv, d, p0 = 5, 4, 1, 64, 3
    qkv, _, kn = _data(n, hq, hkv, d, torch.float16, device, seed=4, norms=True)
    cos, sin = _tables(16, d, torch.float16, device)
    outs = _outs(n, hq, hkv, d, torch.float16, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    qkv_rope(qkv, cos[:, 0], sin[:, 0], pos, hq, hkv, d, *outs, k_norm=kn, eps=EPS)
    _check(outs, qkv, cos, sin, p0, hq, hkv, d, None, kn, torch.float16)


def test_per_row_positions_equal_one_row_at_a_time(device):
    """A position tensor of N elements puts row i at position pos[i] (batched decode): each row
    equals that row alone at its position, in the Triton code and the reference."""
    n, hq, hkv, d = 6, 4, 2, 32
    qkv, qn, kn = _data(n, hq, hkv, d, torch.float32, device, seed=21, norms=True)
    cos, sin = _tables(64, d, torch.float32, device)
    pos = torch.tensor([0, 63, 5, 5, 17, 1], dtype=torch.int64, device=device)
    for backend in ("triton", "reference"):
        outs = _outs(n, hq, hkv, d, torch.float32, device)
        ctx = cpu_backend("reference") if backend == "reference" else torch.no_grad()
        with ctx:
            qkv_rope(qkv, cos, sin, pos, hq, hkv, d, *outs, q_norm=qn, k_norm=kn, eps=EPS)
            for i, p in enumerate(pos.tolist()):
                one = _outs(1, hq, hkv, d, torch.float32, device)
                qkv_rope(qkv[i:i + 1], cos, sin, p, hq, hkv, d, *one, q_norm=qn, k_norm=kn, eps=EPS)
                for a, b in zip(outs, one):
                    assert torch.equal(a[i:i + 1], b), (backend, i)
    with pytest.raises(ValueError, match="one per row"):
        qkv_rope(qkv, cos, sin, pos[:3], hq, hkv, d, *_outs(n, hq, hkv, d, torch.float32, device))


def test_arbitrary_tables(device):
    # x * cos + rotate_half(x) * sin holds for any table, not only HF's duplicated halves
    n, hq, hkv, d = 5, 2, 1, 64
    qkv, _, _ = _data(n, hq, hkv, d, torch.float32, device, seed=13)
    g = torch.Generator().manual_seed(14)
    cos = torch.randn(9, 1, d, generator=g).to(device)
    sin = torch.randn(9, 1, d, generator=g).to(device)
    outs = _outs(n, hq, hkv, d, torch.float32, device)
    qkv_rope(qkv, cos, sin, 4, hq, hkv, d, *outs)
    _check(outs, qkv, cos, sin, 4, hq, hkv, d, None, None, torch.float32)


def test_reference_backend_same_semantics(device):
    n, hq, hkv, d = 7, 4, 2, 64
    qkv, qn, kn = _data(n, hq, hkv, d, torch.float16, device, seed=8, norms=True)
    cos, sin = _tables(32, d, torch.float16, device)
    a = qkv_rope(qkv, cos, sin, 20, hq, hkv, d, *_outs(n, hq, hkv, d, torch.float16, device), q_norm=qn, k_norm=kn)
    with cpu_backend("reference"):
        b = qkv_rope(qkv, cos, sin, 20, hq, hkv, d, *_outs(n, hq, hkv, d, torch.float16, device), q_norm=qn, k_norm=kn)
    _check(b, qkv, cos, sin, 20, hq, hkv, d, qn, kn, torch.float16)
    for x, y in zip(a, b):
        assert max_err(x, y) <= torch.finfo(torch.float16).eps * max(1.0, float(y.float().abs().max()))


def test_in_place_into_qkv(device):
    n, hq, hkv, d = 6, 2, 1, 64
    qkv, _, _ = _data(n, hq, hkv, d, torch.float32, device, seed=9)
    keep = qkv.clone()
    cos, sin = _tables(8, d, torch.float32, device)
    q, k, v = _split(qkv, hq, hkv, d)  # views of qkv
    assert q.data_ptr() == qkv.data_ptr()
    qkv_rope(qkv, cos, sin, 2, hq, hkv, d, q, k, v)
    bq, bk, bv = _model_code(keep, cos, sin, 2, hq, hkv, d, None, None)
    tol = 4 * torch.finfo(torch.float32).eps * 4
    assert max_err(q, bq) <= tol and max_err(k, bk) <= tol and torch.equal(v, bv)


def test_zero_tokens(device):
    qkv, _, _ = _data(0, 4, 2, 64, torch.float16, device)
    cos, sin = _tables(4, 64, torch.float16, device)
    outs = _outs(0, 4, 2, 64, torch.float16, device)
    res = qkv_rope(qkv, cos, sin, 4, 4, 2, 64, *outs)  # start == n_max is fine with N = 0
    assert [tuple(r.shape) for r in res] == [(0, 4, 64), (0, 2, 64), (0, 2, 64)]


def test_launch_config():
    assert rope_mod.launch_config(128, 8) == {"G": 8, "BLOCK_T": 4, "BLOCK_G": 8, "HALF": 64, "num_warps": 4}
    assert rope_mod.launch_config(64, 3) == {"G": 3, "BLOCK_T": 16, "BLOCK_G": 4, "HALF": 32, "num_warps": 4}
    assert rope_mod.launch_config(80, 10)["G"] == 5 and rope_mod.launch_config(80, 10)["HALF"] == 64


@pytest.mark.parametrize("config", [{"G": 1, "BLOCK_T": 4}, {"G": 2, "BLOCK_T": 2}, {"G": 4, "BLOCK_T": 8}])
def test_other_launch_configs(device, config):
    n, hq, hkv, d = 7, 8, 4, 64
    qkv, qn, kn = _data(n, hq, hkv, d, torch.float16, device, seed=12, norms=True)
    cos, sin = _tables(16, d, torch.float16, device)
    outs = _outs(n, hq, hkv, d, torch.float16, device)
    rope_mod._launch(qkv, cos, sin, 3, hq, hkv, d, *outs, qn, kn, EPS, config=config)
    _check(outs, qkv, cos, sin, 3, hq, hkv, d, qn, kn, torch.float16)
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        rope_mod._launch(qkv, cos, sin, 3, hq, hkv, d, *outs, qn, kn, EPS, config={"G": 3})


def test_bad_inputs():
    n, hq, hkv, d = 3, 4, 2, 64
    qkv, qn, _ = _data(n, hq, hkv, d, torch.float16, "cpu", norms=True)
    cos, sin = _tables(8, d, torch.float16, "cpu")
    outs = _outs(n, hq, hkv, d, torch.float16, "cpu")

    def call(*args, **kw):
        a = dict(qkv=qkv, cos=cos, sin=sin, positions_start=0, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                 q_out=outs[0], k_out=outs[1], v_out=outs[2])
        a.update(kw)
        return qkv_rope(**a)

    with pytest.raises(ValueError, match=r"qkv has shape \(3, 512\) but num_heads=4, num_kv_heads=1"):
        call(num_kv_heads=1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(num_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        call(head_dim=63)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        call(num_heads=4.0)
    with pytest.raises(ValueError, match=r"positions 6..8 run past the RoPE tables"):
        call(positions_start=6)
    with pytest.raises(ValueError, match="positions_start must be >= 0"):
        call(positions_start=-1)
    with pytest.raises(TypeError, match="integer dtype"):
        call(positions_start=torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"cos must have shape \[n_max, 1, D\]"):
        call(cos=cos[..., :32])
    with pytest.raises(ValueError, match=r"cos has shape \(8, 1, 64\) but sin has \(7, 1, 64\)"):
        call(sin=sin[:7])
    with pytest.raises(ValueError, match=r"k_out has shape \(3, 4, 64\), expected"):
        call(k_out=outs[0])
    with pytest.raises(TypeError, match="v_out has dtype torch.float32"):
        call(v_out=outs[2].float())
    with pytest.raises(ValueError, match=r"q_norm has shape \(32,\)"):
        call(q_norm=qn[:32])
    with pytest.raises(ValueError, match="qkv must have a contiguous last dim"):
        call(qkv=torch.randn(512, 3, dtype=torch.float16).t())
    with pytest.raises(TypeError, match="qkv has dtype torch.int16"):
        call(qkv=qkv.to(torch.int16))
    with pytest.raises(ValueError, match="eps"):
        call(q_norm=qn, eps=float("inf"))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,hq,hkv,d,p0,norms", [
    (1, 32, 8, 128, 131000, False),     # Llama-3.1-8B, one decode token late in a 128K context
    (1000, 32, 8, 128, 4096, False),    # Llama-3.1-8B prefill chunk
    (777, 32, 8, 128, 0, True),         # Qwen3-8B (q/k norm)
    (300, 9, 3, 64, 7000, False),       # SmolLM2-135M
])
def test_cuda_realistic(dtype, n, hq, hkv, d, p0, norms):
    qkv, qn, kn = _data(n, hq, hkv, d, dtype, "cuda", seed=n + d, row_pad=256, norms=norms)
    cos, sin = _tables(p0 + n, d, dtype, "cuda", base=500000.0)
    q_out, k_out, v_out, _ = _outs(n, hq, hkv, d, dtype, "cuda", strided=True)
    res = qkv_rope(qkv, cos, sin, p0, hq, hkv, d, q_out, k_out, v_out, q_norm=qn, k_norm=kn, eps=EPS)
    _check(res, qkv, cos, sin, p0, hq, hkv, d, qn, kn, dtype)
    pos = torch.tensor([p0], dtype=torch.int64, device="cuda")
    res2 = qkv_rope(qkv, cos, sin, pos, hq, hkv, d, *_outs(n, hq, hkv, d, dtype, "cuda"), q_norm=qn, k_norm=kn, eps=EPS)
    for a, b in zip(res, res2):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# flash-attn's rotary embedding (apply_rotary: flash_attn_with_kvcache's rotary_cos / rotary_sin)
# ----------------------------------------------------------------------------------------------
from xoffload.kernels import apply_rotary  # noqa: E402
from xoffload.kernels.rope import apply_rotary_ref  # noqa: E402


def _rotate_half_formula(x, cos, sin, offsets, interleaved, same_position):
    """flash-attn's apply_rotary_emb_torch written out: ``x * cos + rotate_half(x) * sin`` on the
    first R dims with the half tables repeated ((2 d) or interleaved (d 2)), float64."""
    b, s, h, d = x.shape
    r = 2 * cos.shape[1]
    out = x.double().clone()
    for i in range(b):
        for t in range(s):
            p = int(offsets[i]) + (0 if same_position else t)
            c, sn = cos[p].double(), sin[p].double()
            xr = x[i, t, :, :r].double()
            if interleaved:
                cc, ss = c.repeat_interleave(2), sn.repeat_interleave(2)
                rot = torch.stack((-xr[:, 1::2], xr[:, 0::2]), dim=-1).reshape(h, r)
            else:
                cc, ss = torch.cat((c, c)), torch.cat((sn, sn))
                rot = torch.cat((-xr[:, r // 2:], xr[:, : r // 2]), dim=-1)
            out[i, t, :, :r] = xr * cc + rot * ss
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,d,r,same", [(torch.float16, 64, 64, False), (torch.float32, 59, 32, False),
                                            (torch.float16, 40, 16, True)])
def test_apply_rotary_matches_formula(device, interleaved, dtype, d, r, same):
    g = torch.Generator().manual_seed(d + r)
    b, s, h, n = 2, 3, 5, 24
    x = torch.randn(b, s, h + 1, d, generator=g).to(dtype)[:, :, 1:].to(device)  # strided heads
    ang = torch.rand(n, r // 2, generator=g) * 6.283
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    offs = torch.tensor([4, 17], dtype=torch.int32, device=device)
    y = apply_rotary(x, cos, sin, offs, interleaved=interleaved, same_position=same)
    exact = _rotate_half_formula(x.cpu(), cos.cpu(), sin.cpu(), offs.cpu(), interleaved, same)
    # PyTorch in the input dtype (flash-attn's apply_rotary_emb_torch order) sets the tolerance
    base = _rotate_half_formula(x.cpu(), cos.cpu(), sin.cpu(), offs.cpu(), interleaved, same).to(dtype)
    assert max_err(y.cpu(), exact) <= out_tol(exact, base, dtype)
    assert torch.equal(y[..., r:], x[..., r:])  # dims past rotary_dim copied
    assert torch.equal(y.cpu(), apply_rotary_ref(x.cpu(), cos.cpu(), sin.cpu(), offs.cpu(), interleaved=interleaved,
                                                 same_position=same))
    # int offset, in place
    z = x.clone()
    apply_rotary(z, cos, sin, 4, interleaved=interleaved, same_position=same, out=z)
    assert torch.equal(z[0], y[0])


def test_apply_rotary_bad_inputs():
    x = torch.randn(1, 2, 2, 16)
    c = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 18 must be in \[2, head_dim=16\]"):
        apply_rotary(x, torch.randn(8, 9), torch.randn(8, 9), 0)
    with pytest.raises(ValueError, match="rotary_cos has shape .* but rotary_sin has"):
        apply_rotary(x, c, torch.randn(8, 3), 0)
    with pytest.raises(ValueError, match="rotary_cos must have 2 dims"):
        apply_rotary(x, c[None], c[None], 0)
    with pytest.raises(TypeError, match="seqlen_offsets tensor must have an integer dtype"):
        apply_rotary(x, c, c, torch.zeros(1))
    with pytest.raises(ValueError, match=r"seqlen_offsets tensor must have shape \[B\] = \[1\]"):
        apply_rotary(x, c, c, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0"):
        apply_rotary(x, c, c, -1)
    with pytest.raises(ValueError, match="x must have 4 dims"):
        apply_rotary(x[0], c, c, 0)
