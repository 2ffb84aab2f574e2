"""XAttention estimate (three stages) against the fp32 reference written from the definition.

CPU: the Triton kernels run under the interpreter (fp16 / fp32, tiny heads and head dims, small
block sizes 16/32 with strides 4/8). GPU tests (bf16, block 128) carry ``@pytest.mark.cuda``.
"""
import math

import pytest
import torch

from xoffload.kernels import (
    cpu_backend,
    xattn_block_scores,
    xattn_chunk_stats,
    xattn_estimate,
    xattn_merge_stats,
)
from xoffload.kernels.reference import xattn_estimate_ref, xattn_strided_scores_ref
from xoffload.sparse.select import select_blocks

ATOL = 2e-5  # block scores are sums of <= B/S softmax probabilities, fp32 both sides


def _qk(b, sq, sk, hq, hkv, d, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, hq, d, generator=g) * scale).to(dtype).to(device)
    k = (torch.randn(b, sk, hkv, d, generator=g) * scale).to(dtype).to(device)
    return q, k


def _check(q, k, **kw):
    got = xattn_estimate(q, k, **kw)
    kw.pop("chunk_size", None)
    ref = xattn_estimate_ref(q.cpu(), k.cpu(), **kw)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.isfinite(got).all()
    err = (got.cpu() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= ATOL, f"block score error {err:.3g}"
    return got


# ---------------------------------------------------------------------------------------------
# against the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,stride,bs,causal,q_start",
    [
        (1, 100, 100, 2, 1, 16, 4, 16, True, None),   # square causal prefill, ragged last block
        (2, 37, 150, 3, 1, 32, 4, 16, True, None),    # chunk of the last queries, GQA 3
        (1, 64, 64, 4, 1, 16, 8, 32, False, None),    # non-causal, GQA 4
        (1, 50, 200, 2, 2, 16, 4, 32, True, 113),     # explicit, unaligned q_start
        (1, 24, 90, 8, 1, 16, 8, 16, True, None),     # GQA 8, unaligned bottom-right offset
        (1, 40, 30, 2, 1, 16, 4, 16, True, None),     # Sq > Sk: first rows see nothing
    ],
)
def test_estimate_matches_reference(device, b, sq, sk, hq, hkv, d, stride, bs, causal, q_start):
    q, k = _qk(b, sq, sk, hq, hkv, d, torch.float16, device)
    got = _check(q, k, stride=stride, block_size=bs, q_start=q_start, causal=causal)
    # each query block's row sums to its number of strided rows that see some key (<= B/S)
    assert float(got.sum(-1).max()) <= bs // stride + 1e-4


@pytest.mark.parametrize("sq", [1, 127, 129])
def test_lengths(device, sq):
    q, k = _qk(1, sq, sq, 2, 1, 16, torch.float16, device, seed=sq)
    _check(q, k, stride=16, block_size=128)


def test_long_lengths_tiny_heads(device):
    for n in (2047, 2049):
        q, k = _qk(1, n, n, 1, 1, 16, torch.float16, device, seed=n)
        _check(q, k, stride=16, block_size=128)


def test_fp32_inputs_and_x10_no_overflow(device):
    q, k = _qk(1, 70, 70, 2, 1, 32, torch.float32, device)
    _check(q, k, stride=4, block_size=16)
    q10, k10 = _qk(1, 70, 70, 2, 1, 32, torch.float16, device, scale=10.0)  # scores ~ 1e3: fine in fp32
    _check(q10, k10, stride=4, block_size=16)


# ---------------------------------------------------------------------------------------------
# chunked = one-shot; the three stages
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [32, 48, 64])  # 150 keys: 48 and 64 do not divide it
def test_chunked_equals_one_shot(device, chunk):
    q, k = _qk(1, 150, 150, 2, 1, 16, torch.float16, device, seed=3)
    one = xattn_estimate(q, k, stride=4, block_size=16)
    ch = xattn_estimate(q, k, stride=4, block_size=16, chunk_size=chunk)
    assert (one - ch).abs().max().item() <= 1e-6
    m1 = select_blocks(one, 0.9, sq=150, sk=150, block_size=16)
    m2 = select_blocks(ch, 0.9, sq=150, sk=150, block_size=16)
    assert torch.equal(m1, m2)


def test_three_stages_by_hand(device):
    """Stats per chunk (K arriving in pieces), merge, then block scores per chunk = one-shot."""
    q, k = _qk(1, 60, 100, 2, 1, 16, torch.float16, device, seed=5)
    q_start = 40
    chunks = [(0, 32), (32, 64), (64, 100)]
    stats = [xattn_chunk_stats(q, k[:, a:e], q_start=q_start, k_offset=a, stride=4, block_size=16)
             for a, e in chunks]
    assert stats[1].k_block_start == 2 and stats[0].block_lse.shape == (1, 2, 4 * 4, 2)
    m, l = xattn_merge_stats(stats)
    parts = [xattn_block_scores(st.block_lse, m, l, stride=4, block_size=16) for st in stats]
    got = torch.cat(parts, dim=-1)
    ref = xattn_estimate_ref(q.cpu(), k.cpu(), stride=4, block_size=16, q_start=q_start)
    assert (got.cpu() - ref).abs().max().item() <= ATOL


def test_merge_stats_empty_rows_no_nan():
    ninf = float("-inf")
    a = (torch.tensor([[[ninf, 1.0]]]), torch.tensor([[[0.0, 2.0]]]))
    b = (torch.tensor([[[ninf, 3.0]]]), torch.tensor([[[0.0, 1.0]]]))
    m, l = xattn_merge_stats([a, b])
    assert m[0, 0, 0] == ninf and l[0, 0, 0] == 0
    assert abs(float(l[0, 0, 1]) - (2.0 * math.exp(-2.0) + 1.0)) < 1e-6


def test_stats_match_reference_backend(device):
    """The Triton stage 1 equals the PyTorch reference stage 1 (CPU reference backend)."""
    if device != "cpu":
        pytest.skip("compares the interpreter with the CPU reference path")
    q, k = _qk(1, 45, 80, 2, 1, 16, torch.float16, "cpu", seed=9)
    st = xattn_chunk_stats(q, k[:, 32:], q_start=35, k_offset=32, stride=4, block_size=16)
    with cpu_backend("reference"):
        ref = xattn_chunk_stats(q, k[:, 32:], q_start=35, k_offset=32, stride=4, block_size=16)
    for a, r in zip(st[:3], ref[:3]):
        fin = torch.isfinite(r)
        assert torch.equal(fin, torch.isfinite(a))
        assert (a[fin] - r[fin]).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------
# the faults of the public implementation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk,bs,stride", [(200, 1000, 64, 8), (104, 500, 32, 4)])
def test_offset_query_chunk_keeps_diagonal_and_no_future_mass(device, sq, sk, bs, stride):
    """Query chunk at an unaligned offset (q_start = sk - sq not a multiple of the block): each
    query block keeps the key blocks holding its own positions and takes no mass from keys after
    its last position, down to single keys (planting huge future keys changes nothing)."""
    q, k = _qk(1, sq, sk, 2, 1, 16, torch.float16, device, seed=11)
    q_start = sk - sq
    assert q_start % bs
    scores = _check(q, k, stride=stride, block_size=bs)
    nqb, nkb = scores.shape[-2:]
    for i in range(nqb):
        last = q_start + min((i + 1) * bs, sq) - 1
        assert float(scores[0, :, i, last // bs + 1:].abs().max() if last // bs + 1 < nkb else 0) == 0.0
    for tau in (0.0, 0.9):
        mask = select_blocks(scores, tau, sq=sq, sk=sk, block_size=bs).cpu()
        for i in range(nqb):
            first, last = q_start + i * bs, q_start + min((i + 1) * bs, sq) - 1
            assert mask[0, :, i, first // bs].all() and mask[0, :, i, last // bs].all()
            assert mask[0, :, i, 0].all()
            assert not mask[0, :, i, last // bs + 1:].any()
    # keys after query block 0's last position: make them huge; block 0's scores must not move
    last0 = q_start + bs - 1
    k2 = k.clone()
    k2[:, last0 + 1:] = k2[:, last0 + 1:] * 50
    s2 = xattn_estimate(q, k2, stride=stride, block_size=bs)
    assert (s2[0, :, 0] - scores[0, :, 0]).abs().max().item() <= 1e-6


def test_batch_two_equals_each_alone(device):
    q, k = _qk(2, 70, 90, 4, 2, 16, torch.float16, device, seed=13)
    both = xattn_estimate(q, k, stride=4, block_size=16)
    for i in range(2):
        one = xattn_estimate(q[i:i + 1], k[i:i + 1], stride=4, block_size=16)
        assert torch.equal(both[i:i + 1], one)


@pytest.mark.parametrize("hq,hkv", [(3, 1), (4, 1), (8, 2)])
def test_gqa_no_repeat(device, hq, hkv):
    """GQA estimate = estimate with K repeated per query head (the kernel reads KV head h//g)."""
    q, k = _qk(1, 40, 40, hq, hkv, 16, torch.float16, device, seed=hq)
    got = xattn_estimate(q, k, stride=4, block_size=16)
    rep = xattn_estimate(q, k.repeat_interleave(hq // hkv, dim=2), stride=4, block_size=16)
    assert (got - rep).abs().max().item() <= 1e-6


def test_workspace_split_by_heads_same_result(device):
    q, k = _qk(1, 64, 64, 4, 2, 16, torch.float16, device, seed=17)
    a = xattn_estimate(q, k, stride=4, block_size=16)
    b = xattn_estimate(q, k, stride=4, block_size=16, max_workspace_bytes=1)  # one KV head at a time
    assert torch.equal(a, b)


def test_strided_reference_masks_future_terms():
    """The reference itself: in a diagonal cell, only terms with key <= query count."""
    q = torch.ones(8, 1, 4)
    k = torch.ones(8, 1, 4)
    s, vis = xattn_strided_scores_ref(q, k, stride=4, q_start=0, causal=True, softmax_scale=1.0)
    # cell (0, 0): pairs (3,0), (2,1) valid; (1,2), (0,3) future -> 2 terms of 4 each, / S
    assert abs(float(s[0, 0, 0]) - 2 * 4 / 4) < 1e-6
    assert not bool(vis[0, 0, 1])


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------

def test_bad_inputs(device):
    q, k = _qk(1, 32, 32, 2, 1, 16, torch.float16, device)
    with pytest.raises(ValueError, match="stride"):
        xattn_estimate(q, k, stride=3, block_size=16)
    with pytest.raises(ValueError, match="stride"):
        xattn_estimate(q, k, stride=32, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        xattn_estimate(q, k, stride=4, block_size=24)
    with pytest.raises(ValueError, match="chunk_size"):
        xattn_estimate(q, k, stride=4, block_size=16, chunk_size=20)
    with pytest.raises(ValueError, match="k_offset"):
        xattn_chunk_stats(q, k, q_start=0, k_offset=8, stride=4, block_size=16)
    with pytest.raises(ValueError, match="multiple"):
        xattn_estimate(q, k[:, :, :1].expand(1, 32, 3, 16).contiguous()[:, :, :3], stride=4, block_size=16)
    with pytest.raises(TypeError, match="dtype"):
        xattn_estimate(q, k.float(), stride=4, block_size=16)
    with pytest.raises(TypeError, match="q_start"):
        xattn_chunk_stats(q, k, q_start=None, stride=4, block_size=16)
    with pytest.raises(ValueError, match="row_max"):
        st = xattn_chunk_stats(q, k, q_start=0, stride=4, block_size=16)
        xattn_block_scores(st.block_lse, st.row_max[..., :-1], st.row_sum, stride=4, block_size=16)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("stride", [4, 8, 16])
def test_gpu_bf16_block128(stride):
    q, k = _qk(1, 1500, 2100, 8, 2, 128, torch.bfloat16, "cuda", seed=stride)
    _check(q, k, stride=stride, block_size=128)
    _check(q, k, stride=stride, block_size=128, causal=False)


@pytest.mark.cuda
def test_gpu_chunked_offset_x10():
    q, k = _qk(2, 2000, 10000, 4, 1, 128, torch.bfloat16, "cuda", seed=1, scale=3.0)
    one = _check(q, k, stride=8, block_size=128)
    ch = xattn_estimate(q, k, stride=8, block_size=128, chunk_size=1536)
    assert (one - ch).abs().max().item() <= 1e-5
    assert torch.equal(select_blocks(one, 0.9, sq=2000, sk=10000), select_blocks(ch, 0.9, sq=2000, sk=10000))
    q10, k10 = q * 10, k * 10
    s = xattn_estimate(q10, k10, stride=8, block_size=128)
    assert torch.isfinite(s).all()


@pytest.mark.cuda
def test_gpu_long_autotuned_path_matches_short_config():
    """>= 16K tokens takes the autotuned launch; it must agree with the fixed configuration."""
    from xoffload.kernels import LaunchConfig, launch_override

    q, k = _qk(1, 16384, 16384, 2, 1, 128, torch.bfloat16, "cuda", seed=2)
    a = xattn_estimate(q, k, stride=8, block_size=128)
    with launch_override("xattn_stats", LaunchConfig(128, 64, 8, 3)):
        b = xattn_estimate(q, k, stride=8, block_size=128)
    assert (a - b).abs().max().item() <= 1e-5
