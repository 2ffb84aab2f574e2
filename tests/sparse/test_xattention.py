"""xattention_prefill (estimate + select + block-sparse attention) and the sparse policies."""
import pytest
import torch

from helpers import assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import xattn_estimate
from xoffload.sparse.select import select_blocks
from xoffload.kernels.reference import attention_ref, block_sparse_attention_ref
from xoffload.sparse import XAttentionPrefill, full, xattention, xattention_mask, xattention_prefill


def _data(b, sq, sk, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


def _assert_dense(q, k, v, out, lse):
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = sdpa_in_dtype(q, k, v, causal=True)
    err, tol = max_err(out, ref_o), out_tol(ref_o, base, q.dtype)
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1), (4, 1), (8, 1)])
def test_tau_one_is_dense(device, hq, hkv):
    q, k, v = _data(1, 90, 90, hq, hkv, 16, torch.float16, device, seed=hq)
    out, lse, dens = xattention_prefill(q, k, v, threshold=1.0, stride=4, block_size=16, dense_fallback_len=0)
    _assert_dense(q, k, v, out, lse)
    assert dens.shape == (hq,) and torch.allclose(dens.cpu(), torch.ones(hq))


def test_sparse_equals_reference_on_its_mask(device):
    q, k, v = _data(2, 80, 112, 4, 2, 16, torch.float16, device, seed=1)
    taus = torch.tensor([0.3, 0.6, 0.9, 1.0], device=device)
    # dense_last_q=0: the plain selection (the dense trailing rows are tested in test_xattention_options.py)
    out, lse, dens = xattention_prefill(q, k, v, threshold=taus, stride=4, block_size=16, dense_fallback_len=0,
                                        dense_last_q=0)
    mask = xattention_mask(q, k, threshold=taus, stride=4, block_size=16, dense_last_q=0)
    scores = xattn_estimate(q, k, stride=4, block_size=16)
    assert torch.equal(mask, select_blocks(scores, taus, sq=80, sk=112, block_size=16))
    ref_o, ref_l = block_sparse_attention_ref(q, k, v, mask, block_size=16, causal=True)
    assert max_err(out, ref_o) <= 4e-3
    assert_lse_match(lse, ref_l)
    assert (dens[:-1] <= dens[1:] + 1e-6).all() and float(dens[-1]) == 1.0  # per-head tau ordering
    assert float(dens.min()) > 0.0


def test_dense_fallback_and_q_start(device):
    q, k, v = _data(1, 40, 100, 2, 1, 16, torch.float16, device, seed=2)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.5, stride=4, block_size=16)  # 100 <= 1024: dense
    _assert_dense(q, k, v, out, lse)
    assert torch.equal(dens.cpu(), torch.ones(2))
    # q_start = 50: keys past position 89 are invisible; same as cutting them off
    o1, l1, _ = xattention_prefill(q, k, v, threshold=0.7, stride=4, block_size=16, q_start=50,
                                   dense_fallback_len=0)
    o2, l2, _ = xattention_prefill(q, k[:, :90], v[:, :90], threshold=0.7, stride=4, block_size=16,
                                   dense_fallback_len=0)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_policies(device):
    q, k, v = _data(1, 48, 48, 2, 1, 16, torch.float16, device, seed=3)
    o, l, d = full()(q, k, v)
    _assert_dense(q, k, v, o, l)
    pol = xattention(threshold=1.0, stride=4, block_size=16, dense_fallback_len=0)
    assert isinstance(pol, XAttentionPrefill)
    o2, l2, d2 = pol(q, k, v)
    _assert_dense(q, k, v, o2, l2)


def test_bad_inputs(device):
    q, k, v = _data(1, 32, 32, 2, 1, 16, torch.float16, device)
    with pytest.raises(ValueError, match="stride"):
        xattention_prefill(q, k, v, stride=3, block_size=16)
    with pytest.raises(ValueError, match="threshold"):
        xattention_prefill(q, k, v, threshold=1.5, block_size=16)
    with pytest.raises(ValueError, match="threshold"):
        xattention_prefill(q, k, v, threshold=torch.tensor([0.5, 0.5, 0.5]), block_size=16)
    with pytest.raises(ValueError, match="q_start"):
        xattention_prefill(q, k, v, q_start=5, block_size=16)
    with pytest.raises(ValueError, match="same shape"):
        xattention_prefill(q, k, v[:, :16], block_size=16)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_gpu_model_call_structured_inputs():
    """The model's call, bf16, on inputs with local + sink structure: sparse, and close to dense."""
    from xoffload.kernels import flash_attn_with_lse
    from xoffload.testing.synthetic import structured_qkv

    q, k, v = structured_qkv(8192, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.9, stride=8)
    d_out, d_lse = flash_attn_with_lse(q, k, v, causal=True)
    assert dens.shape == (8,) and 0.0 < float(dens.mean()) < 0.9
    rel = ((out.float() - d_out.float()).norm() / d_out.float().norm()).item()
    assert rel < 0.35, f"relative error vs dense {rel:.3f} at density {float(dens.mean()):.3f}"
    o1, l1, d1 = xattention_prefill(q, k, v, threshold=1.0, stride=8)
    assert float(d1.min()) == 1.0
    ref_err = max_err(o1, d_out)
    assert ref_err <= 2e-2, ref_err


@pytest.mark.cuda
@pytest.mark.parametrize("n", [2047, 2049])
def test_gpu_lengths_tau_one_dense(n):
    q, k, v = _data(1, n, n, 8, 2, 128, torch.bfloat16, "cuda", seed=n)
    out, lse, dens = xattention_prefill(q, k, v, threshold=1.0, stride=8, dense_fallback_len=0)
    _assert_dense(q, k, v, out, lse)
    out9, lse9, dens9 = xattention_prefill(q, k, v, threshold=0.9, stride=8, dense_fallback_len=0)
    mask = xattention_mask(q, k, threshold=0.9, stride=8)
    ref_o, ref_l = block_sparse_attention_ref(q, k, v, mask, block_size=128, causal=True)
    assert max_err(out9, ref_o) <= 2e-2
    assert_lse_match(lse9, ref_l)
