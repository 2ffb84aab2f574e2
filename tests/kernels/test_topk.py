"""Tests of the exact top-k kernel (topk_ids) against its reference and against torch.topk's value
sets: random rows of several lengths (power of two and not), k = 1 .. N, heavy ties, negative
zero, +-inf and NaN, strided inputs, the out= buffer, bad input; on the GPU inside a CUDA graph and
on rows longer than the register limit (the reference path).

CPU: the Triton code under the interpreter (and the reference under cpu_backend("reference")).
"""
import pytest
import torch

from helpers import HAS_CUDA
from xoffload.kernels import cpu_backend
from xoffload.kernels.reference import topk_ids_ref
from xoffload.kernels.topk import MAX_REGISTER_ROW, topk_ids


def _check_topk(scores, ids, k):
    """ids: k distinct indices per row, ascending, whose scores are the row's k largest (as a multiset)."""
    assert ids.shape == (scores.shape[0], k) and ids.dtype == torch.int32
    for r in range(scores.shape[0]):
        row = ids[r].long().cpu()
        assert torch.all(row[1:] > row[:-1]), "ascending and distinct"
        got = scores[r].float().cpu()[row].sort(descending=True).values
        want = scores[r].float().cpu().topk(k).values
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("n", [1, 7, 16, 100, 1000, 1024, 4096])
def test_matches_reference_and_torch_topk(device, n):
    g = torch.Generator().manual_seed(n)
    s = torch.randn(3, n, generator=g).to(device)
    for k in sorted({0, 1, min(2, n), n // 3, n // 2, max(n - 1, 0), n}):
        ids = topk_ids(s, k)
        _check_topk(s, ids, k)
        assert torch.equal(ids.cpu(), topk_ids_ref(s.cpu(), k))


def test_ties_take_the_lowest_indices(device):
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.0, 3.0]], device=device)
    assert topk_ids(s, 2).tolist() == [[1, 2]]
    assert topk_ids(s, 6).tolist() == [[1, 2, 3, 4, 5, 7]]
    ones = torch.ones(2, 50, device=device)
    assert topk_ids(ones, 5).tolist() == [list(range(5))] * 2  # all tied: the first k


def test_special_values(device):
    nan, inf = float("nan"), float("inf")
    s = torch.tensor([[0.0, -0.0, -inf, inf, 5.0, -5.0, nan, 1e-30]], device=device)
    assert topk_ids(s, 1).tolist() == [[6]]  # NaN above every number
    assert topk_ids(s, 2).tolist() == [[3, 6]]
    assert topk_ids(s, 4).tolist() == [[3, 4, 6, 7]]
    assert topk_ids(s, 5).tolist() == [[0, 3, 4, 6, 7]]  # +0.0 above -0.0
    neg_nan = torch.tensor([[1.0, 2.0, 3.0]], device=device)
    neg_nan[0, 0] = -torch.tensor(nan)  # a NaN with the sign bit set
    assert topk_ids(neg_nan, 1).tolist() == [[0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scores_and_strided_rows(device, dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 300, generator=g).to(dtype).to(device)
    s = base[:, 7:157]  # rows 300 apart
    ids = topk_ids(s, 37)
    _check_topk(s, ids, 37)
    assert torch.equal(ids.cpu(), topk_ids_ref(s.cpu(), 37))


def test_out_buffer_and_reference_backend(device):
    g = torch.Generator().manual_seed(4)
    s = torch.randn(8, 513, generator=g).to(device)
    out = torch.full((8, 40), -7, dtype=torch.int32, device=device)
    assert topk_ids(s, 40, out=out) is out
    with cpu_backend("reference"):
        ref = topk_ids(s.cpu(), 40)
    assert torch.equal(out.cpu(), ref)


def test_numpy_integer_k(device):
    """k may be any integer check_int accepts (a numpy integer too), as torch.topk's k may."""
    np = pytest.importorskip("numpy")
    s = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)).to(device)
    for k in (np.int64(5), np.int32(40), np.int64(0)):
        assert torch.equal(topk_ids(s, k).cpu(), topk_ids_ref(s.cpu(), int(k)))


def test_preferred_entries_compete_with_a_bonus(device):
    """prefer >= 0 adds prefer_bonus to an entry's score for the choice (kernel == reference); a
    bonus of 0 changes nothing; a large one takes every preferred entry first."""
    g = torch.Generator().manual_seed(6)
    s = torch.randn(4, 300, generator=g).to(device)
    prefer = torch.full((4, 320), -1, dtype=torch.int32)
    prefer[:, ::7] = 3  # every 7th page "cached"
    prefer = prefer.to(device)
    for bonus in (0.0, 0.5, 100.0):
        ids = topk_ids(s, 20, prefer=prefer, prefer_bonus=bonus)
        shifted = s.float() + (prefer[:, :300] >= 0).float() * bonus
        assert torch.equal(ids.cpu(), topk_ids_ref(shifted.cpu(), 20))
        if bonus == 0.0:
            assert torch.equal(ids, topk_ids(s, 20))
        if bonus == 100.0:
            assert bool((ids % 7 == 0).all())  # 43 preferred entries per row: all 20 from them
    assert torch.equal(s, s.clone())  # the scores are not modified
    with pytest.raises(ValueError, match="prefer must be int32"):
        topk_ids(s, 3, prefer=prefer[:, :100])
    with pytest.raises(ValueError, match="prefer_bonus"):
        topk_ids(s, 3, prefer=prefer, prefer_bonus=float("inf"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_per_row_counts(device, backend):
    """k_rows: row r takes its own min(k_rows[r], k) largest (ties, a preferred-entry bonus, 0 and
    counts past k) into its first entries, the rest of its out row untouched; the same as one
    topk_ids per row."""
    import contextlib

    g = torch.Generator().manual_seed(9)
    s = torch.randint(0, 6, (6, 90), generator=g).float()  # heavy ties
    prefer = torch.full((6, 90), -1, dtype=torch.int32)
    prefer[:, ::5] = 1
    kr = torch.tensor([12, 11, 0, 12, 3, 40], dtype=torch.int32)
    ctx = (lambda: cpu_backend("reference")) if backend == "reference" else contextlib.nullcontext
    for pf, bonus in ((None, 0.0), (prefer, 1.5)):
        out = torch.full((6, 12), -5, dtype=torch.int32, device=device)
        with ctx():
            topk_ids(s.to(device), 12, out=out, prefer=None if pf is None else pf.to(device), prefer_bonus=bonus,
                     k_rows=kr.to(device))
        shifted = s + ((prefer >= 0).float() * bonus if pf is not None else 0.0)
        for r, k in enumerate(kr.clamp(0, 12).tolist()):
            assert torch.equal(out[r, :k].cpu(), topk_ids_ref(shifted[r:r + 1], k)[0]), (r, bonus)
            assert bool((out[r, k:] == -5).all()), r
    # rows past the register limit take the device-side reference path (no host read of k_rows)
    long = torch.randint(0, 50, (2, MAX_REGISTER_ROW + 3), generator=g).float().to(device)
    out = torch.full((2, 7), -5, dtype=torch.int32, device=device)
    topk_ids(long, 7, out=out, k_rows=torch.tensor([7, 2], dtype=torch.int32, device=device))
    assert torch.equal(out[0].cpu(), topk_ids_ref(long[:1].cpu(), 7)[0])
    assert torch.equal(out[1, :2].cpu(), topk_ids_ref(long[1:].cpu(), 2)[0]) and bool((out[1, 2:] == -5).all())
    with pytest.raises(ValueError, match=r"k_rows must be int32 \[6\]"):
        topk_ids(s.to(device), 3, k_rows=kr[:5].to(device))
    with pytest.raises(TypeError, match="k_rows"):
        topk_ids(s.to(device), 3, k_rows=kr.long().to(device))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_bonus_past_fp32_is_refused_not_turned_into_nan(device, backend):
    """The bonus is added in fp32: a Python float that is finite but past fp32's range (1e39, e.g.
    ``QuestDecode.reuse_bonus`` of a tiny softmax scale) would be +inf there, and a preferred
    ``-inf`` score (a padded page of the batched store) + inf is NaN, which ranks above every
    number: the masked page would be chosen first. Refused like a non-finite bonus; the largest
    fp32 bonus still works (no NaN: -inf + finite stays -inf)."""
    import contextlib

    s = torch.tensor([[float("-inf"), 1.0, 2.0, 3.0]], device=device)
    pf = torch.tensor([[0, -1, -1, -1]], dtype=torch.int32, device=device)
    big = float(torch.finfo(torch.float32).max)
    with cpu_backend("reference") if backend == "reference" else contextlib.nullcontext():
        for bonus in (1e39, -1e39):
            with pytest.raises(ValueError, match="prefer_bonus"):
                topk_ids(s, 2, prefer=pf, prefer_bonus=bonus)
        assert topk_ids(s, 2, prefer=pf, prefer_bonus=big).tolist() == [[2, 3]]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_negative_zero_stays_below_zero_with_a_bonus(device, backend):
    """A preferred-entry bonus leaves the other entries as they are: -0.0 still ranks below +0.0
    (the reference once added 0.0 to every entry, turning -0.0 into +0.0)."""
    import contextlib

    s = torch.tensor([[-0.0, 0.0, 1.0]], device=device)
    pf = torch.tensor([[-1, -1, 0]], dtype=torch.int32, device=device)
    with cpu_backend("reference") if backend == "reference" else contextlib.nullcontext():
        assert topk_ids(s, 2, prefer=pf, prefer_bonus=0.5).tolist() == [[1, 2]]
        kr = torch.tensor([2], dtype=torch.int32, device=device)
        assert topk_ids(s, 2, prefer=pf, prefer_bonus=0.5, k_rows=kr).tolist() == [[1, 2]]


def test_bad_input(device):
    s = torch.randn(2, 10, device=device)
    with pytest.raises(ValueError, match="k"):
        topk_ids(s, 11)
    with pytest.raises(ValueError, match="k"):
        topk_ids(s, -1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        topk_ids(torch.randn(2, 20, device=device)[:, ::2], 1)
    with pytest.raises(ValueError, match="scores"):
        topk_ids(s[0], 1)
    with pytest.raises(TypeError, match="scores"):
        topk_ids(s.long(), 1)
    with pytest.raises(ValueError, match="out must be int32 \\[2, 3\\]"):
        topk_ids(s, 3, out=torch.empty(2, 4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="out"):
        topk_ids(s, 3, out=torch.empty(2, 3, dtype=torch.int64, device=device))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_graph_replay_and_long_rows():
    g = torch.Generator().manual_seed(5)
    s = torch.randn(8, 4096, generator=g).cuda()
    out = torch.empty(8, 58, dtype=torch.int32, device="cuda")
    topk_ids(s, 58, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_ids(s, 58, out=out)
    for seed in range(3):
        s.copy_(torch.randn(8, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_ids_ref(s.cpu(), 58))
    long = torch.randn(2, MAX_REGISTER_ROW + 5, generator=g).cuda()
    ids = topk_ids(long, 100)
    _check_topk(long, ids, 100)
    assert torch.equal(ids.cpu(), topk_ids_ref(long.cpu(), 100))
