"""Tests of the fused SwiGLU activation (xoffload.kernels.silu_mul) against the model's PyTorch MLP
code ``F.silu(gu[:, :I]) * gu[:, I:]`` and an fp64 reference.

CPU: the Triton code under the interpreter (conftest) and the PyTorch fallback, fp16/fp32, small
shapes. GPU (``-m cuda``): bf16/fp16 at Llama shapes.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_to_baseline, max_err, out_tol
from xoffload.kernels import cpu_backend, silu_mul

sw_mod = importlib.import_module("xoffload.kernels.swiglu")


def _torch_eager(gu, i):
    return F.silu(gu[:, :i]) * gu[:, i:]


def _exact(gu, i):
    g, u = gu[:, :i].double(), gu[:, i:].double()
    return g * torch.sigmoid(g) * u


def _data(n, i, dtype, device, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, 2 * i + row_pad, generator=g) * 4).to(device=device, dtype=dtype)
    return base[:, : 2 * i]


def _check(a, gu, i, dtype, max_mismatch=0.02):
    assert_close_to_baseline(a, _exact(gu, i), _torch_eager(gu, i), dtype, (gu.shape[0], i), max_mismatch,
                             "F.silu(g) * u")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,i", [(1, 64), (5, 200), (3, 2500)])
def test_matches_torch(device, dtype, n, i):
    gu = _data(n, i, dtype, device, seed=n + i, row_pad=40)
    assert gu.stride(0) != 2 * i
    out_buf = torch.full((n, i + 6), 3.0, dtype=dtype, device=device)
    out = out_buf[:, 2:2 + i]
    a = silu_mul(gu, i, out=out)
    assert a.data_ptr() == out.data_ptr()
    _check(a, gu, i, dtype)
    assert bool((out_buf[:, :2] == 3).all()) and bool((out_buf[:, 2 + i:] == 3).all()), "wrote outside out"


def test_reference_backend_and_alloc(device):
    gu = _data(4, 96, torch.float16, device, seed=1)
    a = silu_mul(gu, 96)
    with cpu_backend("reference"):
        r = silu_mul(gu, 96)
    _check(r, gu, 96, torch.float16)
    assert max_err(a, r) <= torch.finfo(torch.float16).eps * float(r.float().abs().max())


def test_zero_rows_and_inplace_gate(device):
    assert silu_mul(_data(0, 64, torch.float16, device), 64).shape == (0, 64)
    gu = _data(3, 150, torch.float32, device, seed=2)
    want = _torch_eager(gu, 150)
    a = silu_mul(gu, 150, out=gu[:, :150])  # overwrite the gate half in place
    assert max_err(a, want) <= 4 * torch.finfo(torch.float32).eps * float(want.abs().max())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy in the interpreter: exp(1e4) = inf, as intended
def test_extremes(device):
    g = torch.tensor([-1e4, -90.0, -20.0, 0.0, 20.0, 90.0, 6e4, 1.0], dtype=torch.float32)
    gu = torch.cat([g, torch.full_like(g, 2.0)])[None].to(device)
    a = silu_mul(gu, 8)
    assert torch.isfinite(a).all()
    _check(a, gu, 8, torch.float32)


def test_launch_config():
    assert sw_mod.launch_config(14336) == {"BLOCK_I": 2048, "num_warps": 8}
    assert sw_mod.launch_config(100)["BLOCK_I"] == 128


def test_bad_inputs():
    gu = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        silu_mul([1, 2], 1)
    with pytest.raises(TypeError, match="gate_up has dtype torch.int64"):
        silu_mul(gu.long(), 32)
    with pytest.raises(ValueError, match=r"gate_up has shape \(4, 64\) but intermediate=30"):
        silu_mul(gu, 30)
    with pytest.raises(TypeError, match="intermediate must be an int"):
        silu_mul(gu, 32.0)
    with pytest.raises(ValueError, match="intermediate must be >= 1, got"):
        silu_mul(gu[:, :0], 0)
    with pytest.raises(ValueError, match="gate_up must have 2 dims"):
        silu_mul(gu.view(4, 2, 32), 16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_mul(torch.randn(64, 4, dtype=torch.float16).t(), 32)
    with pytest.raises(TypeError, match="out has dtype torch.float32"):
        silu_mul(gu, 32, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match=r"out has shape \(4, 64\)"):
        silu_mul(gu, 32, out=torch.empty(4, 64, dtype=torch.float16))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,i", [(1, 14336), (513, 14336), (300, 1536), (77, 12288)])
def test_cuda_realistic(dtype, n, i):
    gu = _data(n, i, dtype, "cuda", seed=i, row_pad=128)
    a = silu_mul(gu, i)
    _check(a, gu, i, dtype, max_mismatch=0.01)
