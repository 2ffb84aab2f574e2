"""causal_attention: whole-prompt causal attention without LSE (cuDNN / ours / SDPA), in head groups,
optionally in place. Tolerances from tests/helpers.py (2x PyTorch SDPA's error in the input dtype
against the fp32 reference, plus a few ulps)."""
import pytest
import torch

from helpers import HAS_CUDA, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import causal_attention, causal_attention_backend
from xoffload.kernels.reference import attention_ref



def _qkv(b, s, hq, hkv, d, dtype, device="cpu", sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


def _check(out, q, k, v, scale=None):
    ref, _ = attention_ref(q, k, v, causal=True, softmax_scale=scale)
    base = sdpa_in_dtype(q, k, v, causal=True, softmax_scale=scale)
    err, tol = max_err(out, ref), out_tol(ref, base, q.dtype)
    assert err <= tol, f"error {err:.3g} > tol {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_ours_matches_reference(dtype, hq, hkv):
    q, k, v = _qkv(1, 70, hq, hkv, 32, dtype)
    assert causal_attention_backend(q, k) == "xoffload"  # auto on the CPU
    out = causal_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    _check(out, q, k, v)


def test_groups_and_in_place_equal_one_shot():
    q, k, v = _qkv(2, 50, 8, 4, 16, torch.float32, seed=1)
    one = causal_attention(q, k, v, backend="xoffload")
    grouped = causal_attention(q, k, v, backend="xoffload", max_tmp_bytes=1)  # one KV head per group
    assert torch.equal(one, grouped)
    q2 = q.clone()
    res = causal_attention(q2, k, v, backend="xoffload", out=q2, max_tmp_bytes=2 * 50 * 2 * 16 * 4)
    assert res.data_ptr() == q2.data_ptr()
    assert torch.equal(res, one)
    # strided views (a slice of a wider buffer, as the model's q is) give the same result
    wide = torch.zeros(2, 50, 12, 16)
    wide[:, :, :8] = q
    assert torch.equal(causal_attention(wide[:, :, :8], k, v, backend="xoffload"), one)


def test_bottom_right_when_shorter_query():
    q, k, v = _qkv(1, 20, 4, 2, 16, torch.float32, sk=48, seed=2)
    _check(causal_attention(q, k, v, backend="xoffload"), q, k, v)
    with pytest.raises(ValueError, match="Sq == Sk"):
        causal_attention(q, k, v, backend="sdpa")


def test_sdpa_backend_matches_on_cpu():
    q, k, v = _qkv(1, 40, 4, 2, 16, torch.float32, seed=3)
    _check(causal_attention(q, k, v, backend="sdpa", max_tmp_bytes=1), q, k, v)


def test_bad_inputs():
    q, k, v = _qkv(1, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        causal_attention(q, k, v, backend="flash3")
    with pytest.raises(ValueError, match="out"):
        causal_attention(q, k, v, out=torch.empty(1, 8, 4, 8))
    with pytest.raises(ValueError, match="max_tmp_bytes"):
        causal_attention(q, k, v, max_tmp_bytes=0)
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(q[:, :, :3], k, v)
    with pytest.raises(TypeError):
        causal_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="out has dtype"):
        causal_attention(q, k, v, out=torch.empty(1, 8, 4, 16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="backend 'cudnn' needs CUDA"):  # CPU fp32: cuDNN cannot run
        causal_attention(q, k, v, backend="cudnn")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_cuda_backends_agree(hq, hkv, d):
    q, k, v = _qkv(1, 3000, hq, hkv, d, torch.bfloat16, "cuda", seed=4)
    auto = causal_attention_backend(q, k)
    assert auto in ("cudnn", "xoffload")
    ours = causal_attention(q, k, v, backend="xoffload")
    _check(ours, q, k, v)
    for backend in ("auto", "sdpa") + (("cudnn",) if auto == "cudnn" else ()):
        out = causal_attention(q, k, v, backend=backend)
        _check(out, q, k, v)
    # in place over a strided q (the model's layout), in head groups
    buf = q.clone()
    res = causal_attention(buf, k, v, out=buf, max_tmp_bytes=3000 * (hq // hkv) * d * 2)
    _check(res, q, k, v)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_auto_prefers_cudnn_on_hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN fused attention is the fastest choice on sm_90+")
    q, k, v = _qkv(1, 256, 32, 8, 128, torch.bfloat16, "cuda")
    assert causal_attention_backend(q, k) == "cudnn"
    assert causal_attention_backend(q, k, "xoffload") == "xoffload"
    # Sq != Sk (chunked queries) cannot use cuDNN's top-left mask: ours runs
    q2, k2, v2 = _qkv(1, 64, 32, 8, 128, torch.bfloat16, "cuda", sk=256)
    assert causal_attention_backend(q2, k2) == "xoffload"
    _check(causal_attention(q2, k2, v2), q2, k2, v2)


def test_lazy_names_are_the_functions_in_any_import_order():
    import subprocess
    import sys

    code = ("import xoffload.kernels as K; K.causal_attention_backend; "
            "assert callable(K.causal_attention), K.causal_attention")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
