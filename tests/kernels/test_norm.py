"""Tests of the fused RMSNorm kernel (xoffload.kernels.norm) against the model's PyTorch
rms_norm (HF Llama semantics) and an fp64 reference.

CPU: the Triton code under the interpreter (conftest) and the PyTorch fallback, fp16/fp32, small
shapes. GPU (``-m cuda``): bf16/fp16 at Llama shapes.
"""
import importlib

import pytest
import torch

from helpers import assert_close_to_baseline, max_err, out_tol
from xoffload.kernels import cpu_backend, rms_norm  # the function (lazy name map)
from xoffload.models.llama import rms_norm as llama_rms_norm

# the kernel module (xoffload/kernels/norm.py)
rn_mod = importlib.import_module("xoffload.kernels.norm")


def _exact(x, w, eps):
    """fp64 RMSNorm with no intermediate rounding (the error yardstick)."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _data(n, h, dtype, device, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, h + row_pad, generator=g) * 3).to(device=device, dtype=dtype)
    x = base[:, :h]  # strided rows when row_pad > 0
    w = (torch.rand(h, generator=g) * 2 - 0.5).to(device=device, dtype=dtype)
    return x, w


def _check(y, x, w, eps, dtype, max_mismatch=0.02):
    # PyTorch in the input dtype is the error baseline; equal except where the fp32 statistics differ
    assert_close_to_baseline(y, _exact(x, w, eps), llama_rms_norm(x, w, eps), dtype, x.shape, max_mismatch,
                             "llama.rms_norm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,h", [(1, 64), (13, 300), (5, 1000)])
def test_matches_llama_rms_norm(device, dtype, n, h):
    x, w = _data(n, h, dtype, device, seed=n + h, row_pad=24)
    assert x.stride(0) != h  # strided rows
    out_buf = torch.full((n, h + 8), 7.0, dtype=dtype, device=device)
    out = out_buf[:, 4:4 + h]
    y = rms_norm(x, w, 1e-5, out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, x, w, 1e-5, dtype)
    assert bool((out_buf[:, :4] == 7).all()) and bool((out_buf[:, 4 + h:] == 7).all()), "wrote outside out"


def test_reference_backend_same_semantics(device):
    x, w = _data(9, 200, torch.float16, device, seed=3)
    y_k = rms_norm(x, w, 1e-6)
    with cpu_backend("reference"):
        y_r = rms_norm(x, w, 1e-6)
    _check(y_r, x, w, 1e-6, torch.float16)
    assert max_err(y_k, y_r) <= torch.finfo(torch.float16).eps * float(y_r.float().abs().max())


def test_zero_rows_and_inplace(device):
    x, w = _data(0, 128, torch.float16, device)
    y = rms_norm(x, w, 1e-6)
    assert y.shape == (0, 128)
    x, w = _data(3, 128, torch.float32, device, seed=5)
    want = llama_rms_norm(x, w, 1e-6)
    y = rms_norm(x, w, 1e-6, out=x)  # in place
    assert y.data_ptr() == x.data_ptr()
    assert max_err(y, want) <= 4 * torch.finfo(torch.float32).eps * float(want.abs().max())


def test_extreme_rows(device):
    # a zero row (rsqrt(eps)) and a large-magnitude row
    x = torch.zeros(3, 96, dtype=torch.float16)
    x[1] = 6e4 * torch.linspace(-1, 1, 96)
    x[2] = 1e-3
    x = x.to(device)
    w = torch.ones(96, dtype=torch.float16, device=device)
    y = rms_norm(x, w, 1e-6)
    assert torch.isfinite(y.float()).all()
    _check(y, x, w, 1e-6, torch.float16)
    assert bool((y[0] == 0).all())


def test_chunked_long_row_path(device):
    # the two-pass loop used for rows longer than MAX_FUSED_H, forced on a short row
    if device == "cpu" and not rn_mod.use_triton(torch.empty(0)):
        pytest.skip("Triton path not available")
    x, w = _data(5, 300, torch.float16, device, seed=11, row_pad=3)
    out = torch.empty(5, 300, dtype=torch.float16, device=device)
    rn_mod._launch(x, w, out, 1e-5, config={"SINGLE": False, "BLOCK_H": 64, "BLOCK_M": 2, "num_warps": 4})
    _check(out, x, w, 1e-5, torch.float16)


def test_launch_config():
    c = rn_mod.launch_config(4096)
    assert c["SINGLE"] and c["BLOCK_H"] == 4096 and c["BLOCK_M"] == 1
    c = rn_mod.launch_config(576)
    assert c["SINGLE"] and c["BLOCK_H"] == 1024 and c["BLOCK_M"] == 4
    assert not rn_mod.launch_config(rn_mod.MAX_FUSED_H + 1)["SINGLE"]


def test_bad_inputs():
    x = torch.randn(4, 32, dtype=torch.float16)
    w = torch.ones(32, dtype=torch.float16)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm(x.numpy(), w, 1e-6)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        rms_norm(x.int(), w, 1e-6)
    with pytest.raises(ValueError, match=r"x must have 2 dims, got shape \(4, 2, 16\)"):
        rms_norm(x.view(4, 2, 16), w, 1e-6)
    with pytest.raises(ValueError, match=r"weight has shape \(31,\)"):
        rms_norm(x, w[:31], 1e-6)
    with pytest.raises(ValueError, match="x must have a contiguous last dim"):
        rms_norm(torch.randn(32, 4, dtype=torch.float16).t(), w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, float("nan"))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(TypeError, match="out has dtype torch.float32"):
        rms_norm(x, w, 1e-6, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match=r"out has shape \(4, 16\)"):
        rms_norm(x, w, 1e-6, out=torch.empty(4, 16, dtype=torch.float16))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h", [(1, 4096), (1000, 4096), (257, 8192), (33, 576), (7, 20000)])
def test_cuda_realistic(dtype, n, h):
    x, w = _data(n, h, dtype, "cuda", seed=h, row_pad=64)
    y = rms_norm(x, w, 1e-5)
    _check(y, x, w, 1e-5, dtype, max_mismatch=0.01)
