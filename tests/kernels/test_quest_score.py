"""quest_page_scores (one-kernel Quest page bound with the GQA group maximum) against its fp32
reference and against the true maximum of q·k over each page (the bound must hold).

CPU: the Triton code under the interpreter (fp16/fp32). GPU (``-m cuda``): bf16, long page lists.
"""
import pytest
import torch

from helpers import EPS32
from xoffload.kernels.quest_score import quest_page_scores
from xoffload.kernels.reference import quest_page_scores_ref


def _summaries(hkv, n, p, d, dtype, device, seed=0, adversarial=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, p, d, generator=g)
    if adversarial:  # one huge key per page along a random axis, the rest tiny
        k *= 1e-3
        ax = torch.randint(0, d, (hkv, n), generator=g)
        k[torch.arange(hkv)[:, None], torch.arange(n)[None, :], 0, ax] = 30.0
    k = k.to(dtype)
    return k.to(device), k.amin(2).to(device), k.amax(2).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,n", [(4, 4, 16, 5), (6, 2, 24, 70), (8, 1, 64, 129), (32, 8, 128, 40)])
def test_matches_reference_and_bounds_true_max(dtype, hq, hkv, d, n, device):
    if device == "cpu" and dtype == torch.float16 and d > 64:
        pytest.skip("kept small for the interpreter")
    for adversarial in (False, True):
        k, kmin, kmax = _summaries(hkv, n, 16, d, dtype, device, adversarial=adversarial)
        q = torch.randn(hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
        s = quest_page_scores(q, kmin, kmax)
        ref = quest_page_scores_ref(q, kmin, kmax)
        assert s.dtype == torch.float32 and s.shape == (hkv, n)
        # fp32 accumulation of d exact products (fp16 products are exact in fp32): d ulps of the
        # largest sum of |q_i| |k_i|
        scale = float((q.float().abs() @ torch.maximum(kmax.float().abs(), kmin.float().abs()).amax((0, 1))).max())
        tol = 2 * d * EPS32 * scale
        assert float((s - ref).abs().max()) <= tol
        # the bound: >= q_g . k for every key of the page and every head of the group
        g = hq // hkv
        qk = torch.einsum("hgd,hnpd->hgnp", q.float().view(hkv, g, d), k.float())
        true = qk.amax(3).amax(1)
        assert bool((s >= true - tol).all())


def test_out_and_bad_inputs():
    q = torch.randn(4, 16)
    kmin, kmax = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    out = torch.full((2, 9), 7.0)
    assert quest_page_scores(q, kmin, kmax, out=out) is out
    assert torch.allclose(out, quest_page_scores_ref(q, kmin, kmax), atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        quest_page_scores(torch.randn(3, 16), kmin, kmax)
    with pytest.raises(ValueError, match="one shape"):
        quest_page_scores(q, kmin, kmax[:, :4])
    with pytest.raises(TypeError, match="share a dtype"):
        quest_page_scores(q.half(), kmin, kmax)
    with pytest.raises(ValueError, match="out"):
        quest_page_scores(q, kmin, kmax, out=torch.empty(2, 8))
    assert quest_page_scores(q, kmin[:, :0], kmax[:, :0]).shape == (2, 0)


@pytest.mark.cuda
def test_gpu_bf16_long():
    k, kmin, kmax = _summaries(8, 4096, 32, 128, torch.bfloat16, "cuda")
    q = torch.randn(32, 128, device="cuda").bfloat16()
    s = quest_page_scores(q, kmin, kmax)
    ref = quest_page_scores_ref(q, kmin, kmax)
    assert float((s - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_scores_match_per_row_and_mask_past_count(dtype, device):
    """quest_page_scores_batched: row r over its own pages of a shared pool (gathered by an index,
    int32 and int64) equals quest_page_scores of that row's pages; -inf past each row's count."""
    from xoffload.kernels.quest_score import quest_page_scores_batched
    from xoffload.kernels.reference import quest_page_scores_batched_ref

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, npg, n = 8, 2, 32, 90, 70
    _, kmin, kmax = _summaries(hkv, npg, 16, d, dtype, "cpu", seed=4)
    q = torch.randn(4, hq, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(npg, generator=g)[:n] for _ in range(4)])
    nv = torch.tensor([n, 5, 0, 64], dtype=torch.int32)
    for index in (idx, idx.to(torch.int32)):
        s = quest_page_scores_batched(q.to(device), kmin.to(device), kmax.to(device), index.to(device), nv.to(device))
        assert s.shape == (4, hkv, n) and s.dtype == torch.float32
        ref = quest_page_scores_batched_ref(q, kmin, kmax, index, nv)
        s = s.cpu()
        assert torch.equal(torch.isneginf(s), torch.isneginf(ref))
        for r in range(4):
            m = int(nv[r])
            assert bool(torch.isneginf(s[r, :, m:]).all())
            if m:
                one = quest_page_scores_ref(q[r], kmin[:, idx[r, :m]], kmax[:, idx[r, :m]])
                big = torch.maximum(kmax.float().abs(), kmin.float().abs()).amax((0, 1))
                scale = float((q[r].float().abs() @ big).max())
                assert float((s[r, :, :m] - one).abs().max()) <= 2 * d * EPS32 * scale


def _channel_case(hq, hkv, d, n, p, r, dtype, device, seed=0, adversarial=False):
    k, kmin, kmax = _summaries(hkv, n, p, d, dtype, "cpu", seed=seed, adversarial=adversarial)
    g = torch.Generator().manual_seed(seed + 7)
    ch = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]).to(torch.int32)
    klab = torch.gather(k.flatten(1, 2), 2, ch.long()[:, None, :].expand(hkv, n * p, r)).contiguous()
    q = torch.randn(hq, d, generator=g).to(dtype)
    return [t.to(device) for t in (q, k, kmin, kmax, ch, klab)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,n,p,r", [(9, 3, 64, 5, 32, 8), (8, 2, 32, 37, 16, 1), (4, 4, 16, 3, 64, 15),
                                            (32, 8, 128, 20, 32, 16)])
@pytest.mark.parametrize("alpha", [1.0, 0.25, 0.0])
def test_channel_scores_match_reference_and_bound_at_alpha_one(dtype, hq, hkv, d, n, p, r, alpha, device):
    """channel_page_scores equals its fp32 reference; with alpha = 1 it is still an upper bound of
    q·k over every key of the page (random and adversarial keys) and never above Quest's bound."""
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref

    if device == "cpu" and d > 64 and dtype == torch.float16:
        pytest.skip("kept small for the interpreter")
    for adversarial in (False, True):
        q, k, kmin, kmax, ch, klab = _channel_case(hq, hkv, d, n, p, r, dtype, device, adversarial=adversarial)
        s = channel_page_scores(q, kmin, kmax, ch, klab, alpha=alpha)
        ref = channel_page_scores_ref(q, kmin, kmax, ch, klab, alpha)
        assert s.dtype == torch.float32 and s.shape == (hkv, n)
        # fp32 accumulation of 2d products of exact fp16/fp32 operands (the exact part and the
        # summary part): 4 d ulps of the largest sum of |q_i| |k_i|
        scale = float((q.float().abs() @ torch.maximum(kmax.float().abs(), kmin.float().abs()).amax((0, 1))).max())
        tol = 4 * d * EPS32 * scale
        assert float((s - ref).abs().max()) <= tol
        if alpha == 1.0:
            g = hq // hkv
            true = torch.einsum("hgd,hnpd->hgnp", q.float().view(hkv, g, d), k.float()).amax(3).amax(1)
            assert bool((s >= true - tol).all())
            assert bool((s <= quest_page_scores_ref(q, kmin, kmax) + tol).all())


def test_channel_scores_without_channels_and_bad_inputs(device):
    """channels=None: the summary part alone (alpha = 1 is Quest's bound); bad inputs raise,
    naming the value."""
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref

    q, k, kmin, kmax, ch, klab = _channel_case(6, 2, 32, 9, 16, 4, torch.float32, device)
    tol = 64 * EPS32 * float(q.abs().sum(-1).max() * kmax.abs().max())
    assert float((channel_page_scores(q, kmin, kmax, None, None) - quest_page_scores_ref(q, kmin, kmax)).abs().max()) <= tol
    s = channel_page_scores(q, kmin, kmax, None, None, alpha=0.5)
    assert float((s - channel_page_scores_ref(q, kmin, kmax, None, None, 0.5)).abs().max()) <= tol
    out = torch.full((2, 9), 3.0, device=device)
    assert channel_page_scores(q, kmin, kmax, ch, klab, out=out) is out
    with pytest.raises(ValueError, match="come together"):
        channel_page_scores(q, kmin, kmax, ch, None)
    with pytest.raises(ValueError, match="alpha"):
        channel_page_scores(q, kmin, kmax, ch, klab, alpha=1.5)
    with pytest.raises(ValueError, match="channels must be"):
        channel_page_scores(q, kmin, kmax, ch[:1], klab)
    with pytest.raises(ValueError, match="klab must be"):
        channel_page_scores(q, kmin, kmax, ch, klab[:, :, :2])
    with pytest.raises(ValueError, match="power of two"):
        channel_page_scores(q, kmin, kmax, ch, klab[:, : 9 * 12])
    with pytest.raises(TypeError, match="klab must have"):
        channel_page_scores(q, kmin, kmax, ch, klab.half())
    assert channel_page_scores(q, kmin[:, :0], kmax[:, :0], ch, klab[:, :0]).shape == (2, 0)
    # the kernel writes a row's pages with stride 1: a strided out is refused, not written wrong
    with pytest.raises(ValueError, match="contiguous last dim"):
        channel_page_scores(q, kmin, kmax, ch, klab, out=torch.empty(2, 18, device=device)[:, ::2])


@pytest.mark.parametrize("block_n,num_warps", [(32, 4), (64, 8)])
def test_channel_score_kernel_other_tiles_match_reference(block_n, num_warps, device):
    """The tile sizes ``bench_quest_score.py --sweep`` times (more pages per program) give the
    reference's scores, one row and batched (rows with other counts, a partial last tile)."""
    from xoffload.kernels import channel_score as cs
    from xoffload.kernels.reference import channel_page_scores_ref

    hq, hkv, d, n, p, r = 8, 2, 32, 70, 16, 4
    q, k, kmin, kmax, ch, klab = _channel_case(hq, hkv, d, n, p, r, torch.float32, device)
    out = torch.full((hkv, n), 7.0, device=device)
    cs._launch(q[None], kmin, kmax, ch, klab, None, None, out, r, p, 0.25, hq // hkv, block_n=block_n,
               num_warps=num_warps)
    ref = channel_page_scores_ref(q, kmin, kmax, ch, klab, 0.25)
    scale = float((q.float().abs() @ torch.maximum(kmax.float().abs(), kmin.float().abs()).amax((0, 1))).max())
    assert float((out - ref).abs().max()) <= 4 * d * EPS32 * scale
    # batched: row 0 scores pages 0..69, row 1 the first 33 of them in reverse (-inf past its count)
    idx = torch.stack([torch.arange(n), torch.arange(n).flip(0)]).to(torch.int32).to(device)
    nv = torch.tensor([n, 33], dtype=torch.int32, device=device)
    qb = torch.stack([q, q.flip(0)])
    outb = torch.empty(2, hkv, n, device=device)
    cs._launch(qb, kmin, kmax, ch[None].expand(2, -1, -1), klab, idx, nv, outb, r, p, 0.25, hq // hkv,
               block_n=block_n, num_warps=num_warps)
    assert float((outb[0] - ref).abs().max()) <= 4 * d * EPS32 * scale
    ref1 = channel_page_scores_ref(q.flip(0), kmin, kmax, ch, klab, 0.25)
    assert float((outb[1, :, :33] - ref1[:, idx[1, :33].long()]).abs().max()) <= 4 * d * EPS32 * scale
    assert bool((outb[1, :, 33:] == float("-inf")).all())


@pytest.mark.cuda
def test_gpu_channel_scores_bf16_long():
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref

    q, k, kmin, kmax, ch, klab = _channel_case(32, 8, 128, 1024, 32, 8, torch.bfloat16, "cuda")
    for alpha in (1.0, 0.25):
        s = channel_page_scores(q, kmin, kmax, ch, klab, alpha=alpha)
        ref = channel_page_scores_ref(q, kmin, kmax, ch, klab, alpha)
        # bf16 operands, fp32 accumulation (tf32 is not used for bf16 dots): a few fp32 ulps of
        # the score scale
        assert float((s - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("hq,hkv,d,n,p,r", [(4, 4, 80, 17, 16, 1), (16, 1, 96, 3, 16, 64), (8, 8, 48, 1, 16, 47),
                                            (2, 1, 48, 5, 256, 8), (16, 1, 16, 2, 256, 15), (3, 3, 96, 33, 32, 7)])
def test_channel_scores_odd_shapes_and_pagedkv_slices(hq, hkv, d, n, p, r, device):
    """Found by adversarial testing (these held): head dims that are not powers of two, r = 1 and
    r = D - 1, pages of 256, one page, page counts off the kernel's 16-page block, groups of 16 and
    of 1; klab, kmin and kmax as strided slices of a PageSummaries layer, one layer's candidate
    pages (``klab[layer, :, f*P:(f+n)*P]``) — all equal the fp32 reference."""
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref

    q, k, kmin, kmax, ch, klab = _channel_case(hq, hkv, d, n, p, r, torch.float32, device)
    f, L = 3, 2  # the pages sit at 3.. of layer 1 of a larger store
    big_l = torch.zeros(L, hkv, (f + n + 2) * p, r, device=device)
    big_l[1, :, f * p:(f + n) * p] = klab
    big_m = torch.zeros(L, hkv, f + n + 2, d, device=device)
    big_x = torch.zeros_like(big_m)
    big_m[1, :, f:f + n], big_x[1, :, f:f + n] = kmin, kmax
    sl, sm, sx = big_l[1, :, f * p:(f + n) * p], big_m[1, :, f:f + n], big_x[1, :, f:f + n]
    assert hkv == 1 or not sl.is_contiguous()
    scale = float((q.float().abs() @ torch.maximum(kmax.float().abs(), kmin.float().abs()).amax((0, 1))).max())
    for alpha in (1.0, 0.25):
        s = channel_page_scores(q, sm, sx, ch, sl, alpha=alpha)
        assert float((s - channel_page_scores_ref(q, kmin, kmax, ch, klab, alpha)).abs().max()) <= 4 * d * EPS32 * scale


def test_channel_values_checked_on_the_host_or_clamped(device):
    """Found by adversarial testing: a channel index outside [0, D) made the kernel read q outside
    its row (past the tensor for the last head) and a repeated one silently broke the bound. Now
    check=True (the default) refuses both, naming them; check=False (the decode step: no host
    read) clamps entries into [0, D) in the kernel and in the reference alike; alpha must be a
    real number."""
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref

    q, k, kmin, kmax, ch, klab = _channel_case(8, 2, 32, 20, 16, 4, torch.float32, device)
    tol = 4 * 32 * EPS32 * float(q.abs().sum(-1).max() * kmax.abs().max())
    cases = {"repeat a channel": (0, 1, int(ch[0, 0])), "max 32": (1, 2, 32), "min -1": (0, 3, -1),
             f"max {2 ** 40}": (1, 0, 2 ** 40)}
    for msg, (h, j, v) in cases.items():
        bad = ch.long().clone()
        bad[h, j] = v
        with pytest.raises(ValueError, match=msg):
            channel_page_scores(q, kmin, kmax, bad, klab)
        for alpha in (1.0, 0.25):
            s = channel_page_scores(q, kmin, kmax, bad, klab, alpha=alpha, check=False)
            ref = channel_page_scores_ref(q, kmin, kmax, bad, klab, alpha)
            assert bool(torch.isfinite(s).all()) and float((s - ref).abs().max()) <= tol
    for a, exc in ((True, TypeError), (None, TypeError), ("0.5", TypeError), (float("nan"), ValueError),
                   (-0.5, ValueError)):
        with pytest.raises(exc, match="alpha"):
            channel_page_scores(q, kmin, kmax, ch, klab, alpha=a)
