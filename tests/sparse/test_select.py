"""select_blocks / kv_head_union against the row-by-row reference (reference.select_blocks_ref)."""
import pytest
import torch

from xoffload.sparse.select import kv_head_union, select_blocks
from xoffload.sparse.select import causal_block_visibility, forced_blocks, mask_density
from xoffload.kernels.reference import select_blocks_ref


def _scores(b, h, sq, sk, bs, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = -(-sq // bs), -(-sk // bs)
    return (torch.rand(b, h, nqb, nkb, generator=g) ** 4).to(device)  # skewed, like real scores


@pytest.mark.parametrize(
    "sq,sk,bs,q_start,causal,keep_last,tau",
    [
        (100, 100, 16, None, True, 0, 0.9),
        (37, 150, 16, None, True, 2, 0.5),
        (64, 64, 32, None, False, 0, 0.7),
        (50, 200, 32, 113, True, 0, 0.9),
        (1, 1, 16, None, True, 0, 0.9),
        (300, 300, 16, None, True, 1, 0.95),
        (40, 20, 16, None, True, 0, 0.8),     # Sq > Sk: blocks at negative positions keep nothing
        (2000, 10000, 128, None, True, 0, 0.9),  # the offset case at full scale
    ],
)
def test_matches_reference(device, sq, sk, bs, q_start, causal, keep_last, tau):
    s = _scores(2, 3, sq, sk, bs, seed=sq, device=device)
    got = select_blocks(s, tau, sq=sq, sk=sk, block_size=bs, q_start=q_start, causal=causal, keep_last=keep_last)
    ref = select_blocks_ref(s.cpu(), tau, sq=sq, sk=sk, block_size=bs, q_start=q_start, causal=causal,
                            keep_last=keep_last)
    assert got.dtype == torch.bool and got.device == s.device
    assert torch.equal(got.cpu(), ref)


def test_tau_one_keeps_all_visible_tau_zero_sink_and_diagonal(device):
    sq = sk = 200
    s = _scores(1, 2, sq, sk, 16, seed=1, device=device)
    s[..., 3] = 0.0  # zero-score blocks are still kept at tau = 1
    vis = causal_block_visibility(sq, sk, 16, device=device)
    m1 = select_blocks(s, 1.0, sq=sq, sk=sk, block_size=16)
    assert torch.equal(m1[0, 0], vis) and torch.equal(m1[0, 1], vis)
    m0 = select_blocks(s, 0.0, sq=sq, sk=sk, block_size=16)
    f = forced_blocks(sq, sk, 16, device=device)
    assert torch.equal(m0[0, 0], f)
    nqb = vis.shape[0]
    for i in range(nqb):
        assert set(torch.nonzero(f[i]).flatten().tolist()) == {0, i}


def test_only_visible_blocks_even_with_future_scores(device):
    s = torch.ones(1, 1, 8, 8, device=device)  # mass claimed on future blocks too
    m = select_blocks(s, 0.99, sq=128, sk=128, block_size=16)
    vis = causal_block_visibility(128, 128, 16, device=device)
    assert not (m[0, 0] & ~vis).any()


def test_per_head_threshold(device):
    s = _scores(1, 4, 256, 256, 16, seed=2, device=device)
    taus = torch.tensor([0.0, 0.5, 0.9, 1.0])
    got = select_blocks(s, taus.to(device), sq=256, sk=256, block_size=16)
    for h in range(4):
        one = select_blocks(s[:, h:h + 1], float(taus[h]), sq=256, sk=256, block_size=16)
        assert torch.equal(got[:, h:h + 1], one)
    dens = got.float().sum(dim=(0, 2, 3))
    assert (dens[1:] >= dens[:-1]).all()  # more mass wanted, more blocks


def test_batch_rows_independent(device):
    s = _scores(2, 2, 160, 160, 16, seed=3, device=device)
    both = select_blocks(s, 0.8, sq=160, sk=160, block_size=16)
    for i in range(2):
        assert torch.equal(both[i:i + 1], select_blocks(s[i:i + 1], 0.8, sq=160, sk=160, block_size=16))


def test_kept_mass_reaches_threshold(device):
    s = _scores(1, 2, 320, 320, 16, seed=4, device=device)
    m = select_blocks(s, 0.7, sq=320, sk=320, block_size=16)
    vis = causal_block_visibility(320, 320, 16, device=device)
    kept = (s * m).sum(-1)
    total = (s * vis).sum(-1)
    assert (kept >= 0.7 * total - 1e-5).all()


def test_kv_head_union_and_density(device):
    m = torch.zeros(1, 4, 2, 2, dtype=torch.bool, device=device)
    m[0, 0, 1, 0] = True
    m[0, 3, 1, 1] = True
    u = kv_head_union(m, 2)
    assert u.shape == (1, 2, 2, 2)
    assert u[0, 0].tolist() == [[False, False], [True, False]] and u[0, 1].tolist() == [[False, False], [False, True]]
    d = mask_density(m, 32, 32, 16)
    assert d.shape == (4,) and abs(float(d[0]) - 1 / 3) < 1e-6 and float(d[1]) == 0.0
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_head_union(m, 3)


def test_bad_inputs(device):
    s = _scores(1, 2, 64, 64, 16, device=device)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="threshold"):
            select_blocks(s, bad, sq=64, sk=64, block_size=16)
    with pytest.raises(ValueError, match="threshold"):
        select_blocks(s, torch.tensor([0.5, 1.2]), sq=64, sk=64, block_size=16)
    with pytest.raises(ValueError, match="threshold"):
        select_blocks(s, torch.tensor([0.5, 0.5, 0.5]), sq=64, sk=64, block_size=16)
    with pytest.raises(ValueError, match="does not match"):
        select_blocks(s, 0.9, sq=64, sk=80, block_size=16)
    with pytest.raises(ValueError, match="block_scores"):
        select_blocks(s[0], 0.9, sq=64, sk=64, block_size=16)
    with pytest.raises(ValueError, match="keep_last"):
        select_blocks(s, 0.9, sq=64, sk=64, block_size=16, keep_last=-1)
