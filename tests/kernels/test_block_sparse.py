"""block_sparse_attn_with_lse against the fp32 reference (reference.block_sparse_attention_ref).

CPU: Triton interpreter, fp16/fp32, small block sizes. GPU (bf16, block 128): ``@pytest.mark.cuda``.
Tolerances from tests/helpers.py: twice PyTorch's error in the input dtype under the same mask.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_lse_match, max_err, out_tol, rand_block_mask as _rand_mask
from xoffload.kernels import LaunchConfig, block_mask_to_indices, block_sparse_attn_with_lse, launch_override
from xoffload.kernels.reference import attention_ref, block_sparse_attention_ref, causal_mask


def _data(b, sq, sk, hq, hkv, d, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, hq, d, generator=g) * scale).to(dtype).to(device)
    k = (torch.randn(b, sk, hkv, d, generator=g) * scale).to(dtype).to(device)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


def _allowed(mask, hq, sq, sk, bs, causal):
    """Element mask [B, Hq, Sq, Sk] for the PyTorch in-dtype baseline."""
    m = mask.bool()
    if m.shape[1] != hq:
        m = m.repeat_interleave(hq // m.shape[1], dim=1)
    a = m.repeat_interleave(bs, 2)[:, :, :sq].repeat_interleave(bs, 3)[:, :, :, :sk]
    if causal:
        a = a & causal_mask(sq, sk, mask.device)
    return a


def _baseline(q, k, v, allowed):
    """The same masked attention by PyTorch in the input dtype (sets the tolerance)."""
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(hq // hkv, 1)
    vt = vt.repeat_interleave(hq // hkv, 1)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed.expand(q.shape[0], hq, -1, -1))
    o = torch.nan_to_num(o.transpose(1, 2))
    empty = ~allowed.expand(q.shape[0], hq, -1, -1).any(-1)  # [B, Hq, Sq]
    return o.masked_fill(empty.transpose(1, 2)[..., None], 0.0)


def check(q, k, v, mask, bs, causal, block_index=False):
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    arg = block_mask_to_indices(mask, sq, sk, block_size=bs, causal=causal) if block_index else mask
    out, lse = block_sparse_attn_with_lse(q, k, v, arg, block_size=bs, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    full_mask = mask.expand(b, *mask.shape[1:])
    ref_o, ref_l = block_sparse_attention_ref(q, k, v, full_mask, block_size=bs, causal=causal)
    base = _baseline(q, k, v, _allowed(full_mask, hq, sq, sk, bs, causal))
    err, tol = max_err(out, ref_o), out_tol(ref_o, base, q.dtype)
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    empty = torch.isneginf(ref_l)
    if empty.any():
        assert (out.float().transpose(1, 2)[empty] == 0).all()
    return out, lse


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,bs,causal,mask_heads,density",
    [
        (1, 100, 100, 2, 1, 16, 16, True, "q", 0.5),
        (2, 37, 150, 4, 2, 32, 32, True, "kv", 0.4),
        (1, 64, 64, 2, 2, 24, 16, False, "q", 0.6),   # non-causal, head_dim not a power of two
        (1, 70, 40, 3, 1, 16, 16, True, "q", 0.7),    # Sq > Sk: leading rows see nothing
        (2, 1, 70, 2, 1, 16, 16, True, "kv", 1.0),    # one query row
        (1, 50, 90, 8, 1, 16, 16, True, "kv", 0.5),   # GQA 8
        (1, 48, 48, 3, 3, 16, 16, True, "q", 0.5),    # GQA 1
    ],
)
def test_matches_reference(device, b, sq, sk, hq, hkv, d, bs, causal, mask_heads, density):
    q, k, v = _data(b, sq, sk, hq, hkv, d, torch.float16, device, seed=sq + sk)
    h = hq if mask_heads == "q" else hkv
    mask = _rand_mask(b, h, sq, sk, bs, density, seed=sq, device=device)
    check(q, k, v, mask, bs, causal)


def test_block_index_input_and_batch_broadcast(device):
    q, k, v = _data(2, 60, 80, 4, 1, 16, torch.float16, device, seed=1)
    mask = _rand_mask(1, 4, 60, 80, 16, 0.5, seed=2, device=device)
    o1, l1 = check(q, k, v, mask, 16, True, block_index=True)
    o2, l2 = block_sparse_attn_with_lse(q, k, v, mask, block_size=16, causal=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_full_mask_is_dense(device):
    q, k, v = _data(1, 90, 90, 4, 2, 32, torch.float16, device, seed=4)
    mask = torch.ones(1, 4, 6, 6, dtype=torch.bool, device=device)
    out, lse = block_sparse_attn_with_lse(q, k, v, mask, block_size=16, causal=True)
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = _baseline(q, k, v, causal_mask(90, 90, q.device)[None, None])
    assert max_err(out, ref_o) <= out_tol(ref_o, base, q.dtype)
    assert_lse_match(lse, ref_l)


def test_empty_mask_rows_zero_and_neg_inf(device):
    q, k, v = _data(1, 40, 40, 2, 1, 16, torch.float16, device)
    mask = torch.zeros(1, 2, 3, 3, dtype=torch.bool, device=device)
    mask[:, 0, 1, 0] = True  # head 0, query block 1 keeps block 0; everything else empty
    out, lse = block_sparse_attn_with_lse(q, k, v, mask, block_size=16, causal=True)
    assert torch.isneginf(lse[0, 1]).all() and (out[0, :, 1] == 0).all()
    assert torch.isfinite(lse[0, 0, 16:32]).all() and torch.isneginf(lse[0, 0, :16]).all()
    check(q, k, v, mask, 16, True)


def test_fp32_and_strided_views(device):
    q, k, v = _data(1, 40, 56, 4, 2, 16, torch.float32, device, seed=7)
    big = torch.randn(1, 56, 2, 3, 16, device=device)  # K and V live in an interleaved buffer
    k, v = big[:, :, :, 0], big[:, :, :, 1]
    qv = torch.randn(1, 40, 4, 32, device=device)[..., :16]
    mask = _rand_mask(1, 4, 40, 56, 16, 0.6, seed=3, device=device)
    check(qv, k, v, mask, 16, True)


def test_bad_inputs(device):
    q, k, v = _data(1, 32, 32, 2, 1, 16, torch.float16, device)
    good = torch.ones(1, 2, 2, 2, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attn_with_lse(q, k, v, good[:, :, :1], block_size=16)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attn_with_lse(q, k, v, torch.ones(1, 3, 2, 2, dtype=torch.bool, device=device), block_size=16)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attn_with_lse(q, k, v, torch.ones(2, 2, 2, 2, dtype=torch.bool, device=device), block_size=16)
    with pytest.raises(TypeError, match="bool"):
        block_sparse_attn_with_lse(q, k, v, good.float(), block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attn_with_lse(q, k, v, good, block_size=24)
    with pytest.raises(ValueError, match="BlockIndex"):
        bi = block_mask_to_indices(good, 32, 32, block_size=16, causal=True)
        block_sparse_attn_with_lse(q, k, v, bi, block_size=16, causal=False)
    with pytest.raises(ValueError, match="multiple"):
        block_sparse_attn_with_lse(q, k[:, :, :1].expand(1, 32, 3, 16)[:, :, :3].contiguous(),
                                   v[:, :, :1].expand(1, 32, 3, 16).contiguous(), good, block_size=16)


# ---------------------------------------------------------------------------------------------
# launch variants (LaunchConfig through launch_override): each equals the reference; TMA loads do
# not change the arithmetic, so they equal the pointer loads with the same tiles bit for bit
# ---------------------------------------------------------------------------------------------

_VARIANTS = [
    LaunchConfig(32, 16, 4, 1),
    LaunchConfig(16, 16, 4, 1),   # two query tiles per mask block
    LaunchConfig(32, 16, 4, 1, tma=True),
    LaunchConfig(32, 32, 4, 1, tma=True),   # BLOCK_N = block size (SUB = 1)
]


def _run_cfg(cfg, *args, **kw):
    with launch_override("block_sparse", cfg):
        return block_sparse_attn_with_lse(*args, **kw)


_VARIANT_CASES = {
    # ragged, GQA 2, one mask broadcast over the batch, causal, fp16
    "ragged-gqa2-bcast": (2, 70, 90, 4, 2, 1, "q", True, torch.float16),
    # per-item masks shared by a KV head's query heads, non-causal, fp32
    "kvmask-noncausal-fp32": (2, 50, 64, 6, 2, 2, "kv", False, torch.float32),
}
_CASE_CACHE: dict = {}


def _variant_case(name, device, block_m, block_n):
    """Inputs, reference, tolerance and the plain-loop output for (case, tiles), computed once."""
    key = (name, device, block_m, block_n)
    if key not in _CASE_CACHE:
        b, sq, sk, hq, hkv, mask_b, mask_heads, causal, dtype = _VARIANT_CASES[name]
        bs = 32
        q, k, v = _data(b, sq, sk, hq, hkv, 16, dtype, device, seed=sq)
        mask = _rand_mask(mask_b, hq if mask_heads == "q" else hkv, sq, sk, bs, 0.6, seed=sk, device=device)
        mask[..., 0] = True
        full = mask.expand(b, *mask.shape[1:])
        ref_o, ref_l = block_sparse_attention_ref(q, k, v, full, block_size=bs, causal=causal)
        tol = out_tol(ref_o, _baseline(q, k, v, _allowed(full, hq, sq, sk, bs, causal)), q.dtype)
        base = _run_cfg(LaunchConfig(block_m, block_n, 4, 1), q, k, v, mask, block_size=bs, causal=causal)
        _CASE_CACHE[key] = (q, k, v, mask, bs, causal, ref_o, ref_l, tol, base)
    return _CASE_CACHE[key]


@pytest.mark.parametrize("cfg", _VARIANTS, ids=lambda c: c.name())
@pytest.mark.parametrize("case", list(_VARIANT_CASES))
def test_variants_match_reference(device, cfg, case):
    q, k, v, mask, bs, causal, ref_o, ref_l, tol, (o0, l0) = _variant_case(case, device, cfg.block_m, cfg.block_n)
    o1, l1 = _run_cfg(cfg, q, k, v, mask, block_size=bs, causal=causal)
    err = max_err(o1, ref_o)
    assert err <= tol, f"{cfg.name()}: output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(l1, ref_l)
    assert torch.equal(o1, o0) and torch.equal(l1, l0), f"{cfg.name()} differs from the plain loop"


def test_prebuilt_index_equals_mask(device):
    q, k, v = _data(1, 96, 96, 4, 1, 16, torch.float16, device, seed=11)
    mask = _rand_mask(1, 1, 96, 96, 16, 0.5, seed=5, device=device)
    cfg = LaunchConfig(16, 16, 4, 1)
    bi = block_mask_to_indices(mask, 96, 96, block_size=16, causal=True)
    o1, l1 = _run_cfg(cfg, q, k, v, bi, block_size=16, causal=True)
    o2, l2 = _run_cfg(cfg, q, k, v, mask, block_size=16, causal=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_bad_config(device):
    q, k, v = _data(1, 32, 32, 2, 1, 16, torch.float16, device)
    mask = torch.ones(1, 2, 2, 2, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="unknown kernel"):
        with launch_override("block_sparce", LaunchConfig(16, 16, 4, 1)):
            pass
    with pytest.raises(ValueError, match="bad config"):
        _run_cfg((16, 16), q, k, v, mask, block_size=16)
    with pytest.raises(ValueError, match="positive ints"):
        _run_cfg(LaunchConfig(16, 0, 4, 1), q, k, v, mask, block_size=16)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bf16_random_masks(causal):
    q, k, v = _data(2, 1000, 1300, 8, 2, 128, torch.bfloat16, "cuda", seed=5)
    for h, dens in ((8, 0.3), (2, 0.6)):
        check(q, k, v, _rand_mask(2, h, 1000, 1300, 128, dens, seed=h, device="cuda"), 128, causal)


@pytest.mark.cuda
def test_gpu_full_mask_equals_dense_kernel():
    from xoffload.kernels import flash_attn_with_lse

    q, k, v = _data(1, 3000, 3000, 8, 2, 128, torch.bfloat16, "cuda", seed=6)
    nb = -(-3000 // 128)
    out, lse = block_sparse_attn_with_lse(q, k, v, torch.ones(1, 8, nb, nb, dtype=torch.bool, device="cuda"))
    d_out, d_lse = flash_attn_with_lse(q, k, v, causal=True)
    ref_o, ref_l = attention_ref(q, k, v, causal=True)
    base = _baseline(q, k, v, causal_mask(3000, 3000, "cuda")[None, None])
    assert max_err(out, ref_o) <= out_tol(ref_o, base, q.dtype)
    assert max_err(out, d_out) <= out_tol(ref_o, base, q.dtype)
    assert_lse_match(lse, ref_l)


@pytest.mark.cuda
def test_gpu_fp16_d64_and_x10():
    q, k, v = _data(1, 777, 2000, 6, 3, 64, torch.float16, "cuda", seed=8, scale=3.0)
    check(q, k, v, _rand_mask(1, 6, 777, 2000, 128, 0.5, seed=1, device="cuda"), 128, True)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [
    LaunchConfig(128, 128, 8, 3, tma=True),
    LaunchConfig(128, 128, 8, 3),
    LaunchConfig(128, 64, 8, 3),
    LaunchConfig(128, 64, 8, 3, tma=True),
], ids=lambda c: c.name())
def test_gpu_bf16_variants(cfg):
    # ragged lengths (masked loads / TMA zero fill), Sq < Sk, GQA 4, per-KV-head masks
    q, k, v = _data(1, 1000, 1300, 8, 2, 128, torch.bfloat16, "cuda", seed=9)
    mask = _rand_mask(1, 2, 1000, 1300, 128, 0.5, seed=4, device="cuda")
    with launch_override("block_sparse", cfg):
        check(q, k, v, mask, 128, True)
