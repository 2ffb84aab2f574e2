"""xattention_prefill (estimate + select + block-sparse attention), its options beyond the plain
selection (``dense_last_q``: dense trailing query rows), and the policies calling it."""
import pytest
import torch

from helpers import assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import xattn_estimate
from xoffload.kernels.reference import attention_ref, block_sparse_attention_ref
from xoffload.sparse import (DEFAULT_DENSE_LAST_Q, DensePrefill, XAttentionPrefill, xattention_mask,
                             xattention_prefill)
from xoffload.sparse.select import causal_block_visibility, mask_density, select_blocks
from xoffload.sparse.xattention import dense_query_blocks

BS, ST = 16, 4


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
    o, l, d = DensePrefill()(q, k, v)
    _assert_dense(q, k, v, o, l)
    pol = XAttentionPrefill(threshold=1.0, stride=4, block_size=16, dense_fallback_len=0)
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
# dense_last_q: dense trailing query rows
# ---------------------------------------------------------------------------------------------

def _rows_dense(q, k, v, out, lse, r0):
    """Rows r0.. of (out, lse) equal dense causal attention within the dtype tolerance."""
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = sdpa_in_dtype(q, k, v, causal=True)
    err = max_err(out[:, r0:], ref_o[:, r0:])
    tol = out_tol(ref_o[:, r0:], base[:, r0:], q.dtype)
    assert err <= tol, f"dense rows {r0}..: error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse[..., r0:], ref_l[..., r0:])
    return ref_o


def test_default_is_one_block_of_rows(device):
    """Default (None): the last ``block_size`` rows are dense; equal to passing block_size."""
    assert DEFAULT_DENSE_LAST_Q is None and XAttentionPrefill().dense_last_q is None
    q, k, v = _data(1, 100, 100, 2, 1, 16, torch.float16, device, seed=11)
    m_def = xattention_mask(q, k, threshold=0.0, stride=ST, block_size=BS)
    assert torch.equal(m_def, xattention_mask(q, k, threshold=0.0, stride=ST, block_size=BS, dense_last_q=BS))
    assert not torch.equal(m_def, xattention_mask(q, k, threshold=0.0, stride=ST, block_size=BS, dense_last_q=0))
    out, lse, _ = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0)
    _rows_dense(q, k, v, out, lse, 84)  # rows 84..99 sit in blocks 5 and 6


def test_dense_query_blocks():
    # rows 80..99 of 100 sit in blocks 5 and 6 (block 5 = rows 80..95)
    assert dense_query_blocks(100, 20, 16) == 5
    assert dense_query_blocks(100, 21, 16) == 4  # row 79 is in block 4
    assert dense_query_blocks(100, 0, 16) == 7  # none
    assert dense_query_blocks(100, 500, 16) == 0  # all
    assert dense_query_blocks(0, 128, 16) == 0


@pytest.mark.parametrize("hq,hkv", [(2, 1), (3, 3)])
def test_last_rows_are_dense(device, hq, hkv):
    """tau=0 keeps only sink + diagonal elsewhere; the trailing rows still equal dense attention."""
    sq = 100
    q, k, v = _data(1, sq, sq, hq, hkv, 16, torch.float16, device, seed=hq)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0,
                                        dense_last_q=20)
    ref_o = _rows_dense(q, k, v, out, lse, 80)
    # the rows before are really sparse (tau=0): far from dense attention, so the check can fail
    assert max_err(out[:, 32:80], ref_o[:, 32:80]) > 0.05
    assert float(dens.max()) < 1.0
    # without the option the last rows are sparse too
    out0, _, dens0 = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0,
                                        dense_last_q=0)
    assert max_err(out0[:, 80:], ref_o[:, 80:]) > 0.05
    assert (dens0 < dens).all()


def test_mask_and_density_accounting(device):
    sq = sk = 100
    q, k, v = _data(2, sq, sk, 4, 2, 16, torch.float16, device, seed=7)
    taus = torch.tensor([0.0, 0.3, 0.7, 0.9], device=device)
    scores = xattn_estimate(q, k, stride=ST, block_size=BS)
    plain = select_blocks(scores, taus, sq=sq, sk=sk, block_size=BS)
    assert torch.equal(xattention_mask(q, k, threshold=taus, stride=ST, block_size=BS, dense_last_q=0), plain)
    mask = xattention_mask(q, k, threshold=taus, stride=ST, block_size=BS, dense_last_q=30)
    vis = causal_block_visibility(sq, sk, BS, device=device)
    qb0 = dense_query_blocks(sq, 30, BS)
    assert qb0 == 4
    expect = plain.clone()
    expect[:, :, qb0:] = vis[qb0:]
    assert torch.equal(mask, expect)
    assert not (mask & ~vis).any()  # nothing invisible is kept
    out, lse, dens = xattention_prefill(q, k, v, threshold=taus, stride=ST, block_size=BS, dense_fallback_len=0,
                                        dense_last_q=30)
    # density counts the dense rows' blocks: kept / visible per head, batch-averaged
    n_vis = float(vis.sum())
    manual = (expect.sum(dim=(2, 3)).float() / n_vis).mean(0)
    assert torch.allclose(dens.cpu(), manual.cpu(), atol=1e-6)
    assert torch.allclose(dens.cpu(), mask_density(mask, sq, sk, BS).cpu())
    ref_o, ref_l = block_sparse_attention_ref(q, k, v, mask, block_size=BS, causal=True)
    assert max_err(out, ref_o) <= 4e-3
    assert_lse_match(lse, ref_l)


def test_all_rows_dense(device):
    q, k, v = _data(1, 70, 70, 2, 1, 16, torch.float16, device, seed=3)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0,
                                        dense_last_q=70)
    _rows_dense(q, k, v, out, lse, 0)
    assert torch.allclose(dens.cpu(), torch.ones(2))


def test_query_chunk_offset(device):
    """Sq < Sk (a query chunk at the end of a longer sequence): the chunk's last rows are dense."""
    q, k, v = _data(1, 48, 112, 2, 1, 16, torch.float16, device, seed=4)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0,
                                        dense_last_q=16)
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = sdpa_in_dtype(q, k, v, causal=True)
    assert max_err(out[:, 32:], ref_o[:, 32:]) <= out_tol(ref_o[:, 32:], base[:, 32:], q.dtype)
    assert_lse_match(lse[..., 32:], ref_l[..., 32:])
    assert max_err(out[:, :32], ref_o[:, :32]) > 0.05
    # q_start cut: same as passing only the visible keys
    o1, l1, d1 = xattention_prefill(q, k, v, threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0,
                                    dense_last_q=16, q_start=40)
    o2, l2, d2 = xattention_prefill(q, k[:, :88], v[:, :88], threshold=0.0, stride=ST, block_size=BS,
                                    dense_fallback_len=0, dense_last_q=16)
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and torch.equal(d1, d2)


def test_policy_passes_option(device):
    q, k, v = _data(1, 64, 64, 2, 1, 16, torch.float16, device, seed=5)
    pol = XAttentionPrefill(threshold=0.0, stride=ST, block_size=BS, dense_fallback_len=0, dense_last_q=64)
    out, lse, dens = pol(q, k, v)
    _rows_dense(q, k, v, out, lse, 0)


def test_bad_values(device):
    q, k, v = _data(1, 32, 32, 2, 1, 16, torch.float16, device)
    with pytest.raises(ValueError, match="dense_last_q"):
        xattention_prefill(q, k, v, block_size=BS, stride=ST, dense_last_q=-1)
    for bad in (1.5, True, "128"):
        with pytest.raises(TypeError, match="dense_last_q"):
            xattention_prefill(q, k, v, block_size=BS, stride=ST, dense_last_q=bad)
    with pytest.raises(ValueError, match="dense_last_q"):
        xattention_mask(q, k, block_size=BS, stride=ST, dense_last_q=-5)


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


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4096, 4000])
def test_gpu_bf16_last_rows_dense(n):
    """bf16, block 128, S=8, structured inputs: the default dense rows (the query blocks holding the
    last 128 rows) equal dense attention within the bf16 tolerance; the rest is sparse."""
    from xoffload.testing.synthetic import structured_qkv

    q, k, v = structured_qkv(n, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    out, lse, dens = xattention_prefill(q, k, v, threshold=0.9, stride=8, dense_fallback_len=0)
    r0 = dense_query_blocks(n, 128, 128) * 128
    assert r0 == (3968 if n == 4096 else 3840)
    _rows_dense(q, k, v, out, lse, r0)
    assert float(dens.mean()) < 0.9
