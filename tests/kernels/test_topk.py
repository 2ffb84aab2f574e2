"""Tests of the exact top-k kernel (topk_ids) against its reference and against torch.topk's value
sets: random rows of several lengths (power of two and not), k = 1 .. N, heavy ties, negative
zero, +-inf and NaN, strided inputs, the out= buffer, bad input; on the GPU inside a CUDA graph and
on rows longer than the register limit (the reference path). Every semantic test runs for each
``bits_per_pass`` (the kernel's bits of the k-th key a reduction pass: 1 the plain bisection, 2-4
multiway), plus adversarial rows (all equal, two values, keys one ulp apart, +-0, NaN of either
sign, +-inf, random bit patterns over the whole key range, many ties) against the reference.

CPU: the Triton code under the interpreter (and the reference under cpu_backend("reference")).
"""
import pytest
import torch

from helpers import HAS_CUDA
from xoffload.kernels import cpu_backend
from xoffload.kernels.reference import topk_ids_ref
from xoffload.kernels.topk import BITS_PER_PASS_CHOICES, DEFAULT_BITS_PER_PASS, MAX_REGISTER_ROW, topk_ids


@pytest.fixture(params=BITS_PER_PASS_CHOICES, ids=lambda b: f"bits{b}")
def bits(request):
    """The kernel's bits of the k-th key resolved per reduction pass (every value: the same result)."""
    return request.param


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
def test_matches_reference_and_torch_topk(device, bits, n):
    g = torch.Generator().manual_seed(n)
    s = torch.randn(3, n, generator=g).to(device)
    for k in sorted({0, 1, min(2, n), n // 3, n // 2, max(n - 1, 0), n}):
        ids = topk_ids(s, k, bits_per_pass=bits)
        _check_topk(s, ids, k)
        assert torch.equal(ids.cpu(), topk_ids_ref(s.cpu(), k))


def test_ties_take_the_lowest_indices(device, bits):
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.0, 3.0]], device=device)
    assert topk_ids(s, 2, bits_per_pass=bits).tolist() == [[1, 2]]
    assert topk_ids(s, 6, bits_per_pass=bits).tolist() == [[1, 2, 3, 4, 5, 7]]
    ones = torch.ones(2, 50, device=device)
    assert topk_ids(ones, 5, bits_per_pass=bits).tolist() == [list(range(5))] * 2  # all tied: the first k


def test_special_values(device, bits):
    nan, inf = float("nan"), float("inf")
    s = torch.tensor([[0.0, -0.0, -inf, inf, 5.0, -5.0, nan, 1e-30]], device=device)
    assert topk_ids(s, 1, bits_per_pass=bits).tolist() == [[6]]  # NaN above every number
    assert topk_ids(s, 2, bits_per_pass=bits).tolist() == [[3, 6]]
    assert topk_ids(s, 4, bits_per_pass=bits).tolist() == [[3, 4, 6, 7]]
    assert topk_ids(s, 5, bits_per_pass=bits).tolist() == [[0, 3, 4, 6, 7]]  # +0.0 above -0.0
    neg_nan = torch.tensor([[1.0, 2.0, 3.0]], device=device)
    neg_nan[0, 0] = -torch.tensor(nan)  # a NaN with the sign bit set
    assert topk_ids(neg_nan, 1, bits_per_pass=bits).tolist() == [[0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scores_and_strided_rows(device, bits, dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 300, generator=g).to(dtype).to(device)
    s = base[:, 7:157]  # rows 300 apart
    ids = topk_ids(s, 37, bits_per_pass=bits)
    _check_topk(s, ids, 37)
    assert torch.equal(ids.cpu(), topk_ids_ref(s.cpu(), 37))


def test_out_buffer_and_reference_backend(device, bits):
    g = torch.Generator().manual_seed(4)
    s = torch.randn(8, 513, generator=g).to(device)
    out = torch.full((8, 40), -7, dtype=torch.int32, device=device)
    assert topk_ids(s, 40, out=out, bits_per_pass=bits) is out
    with cpu_backend("reference"):
        ref = topk_ids(s.cpu(), 40, bits_per_pass=bits)
    assert torch.equal(out.cpu(), ref)


def test_numpy_integer_k(device, bits):
    """k may be any integer check_int accepts (a numpy integer too), as torch.topk's k may."""
    np = pytest.importorskip("numpy")
    s = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)).to(device)
    for k in (np.int64(5), np.int32(40), np.int64(0)):
        assert torch.equal(topk_ids(s, k, bits_per_pass=bits).cpu(), topk_ids_ref(s.cpu(), int(k)))


def test_preferred_entries_compete_with_a_bonus(device, bits):
    """prefer >= 0 adds prefer_bonus to an entry's score for the choice (kernel == reference); a
    bonus of 0 changes nothing; a large one takes every preferred entry first."""
    g = torch.Generator().manual_seed(6)
    s = torch.randn(4, 300, generator=g).to(device)
    prefer = torch.full((4, 320), -1, dtype=torch.int32)
    prefer[:, ::7] = 3  # every 7th page "cached"
    prefer = prefer.to(device)
    for bonus in (0.0, 0.5, 100.0):
        ids = topk_ids(s, 20, prefer=prefer, prefer_bonus=bonus, bits_per_pass=bits)
        shifted = s.float() + (prefer[:, :300] >= 0).float() * bonus
        assert torch.equal(ids.cpu(), topk_ids_ref(shifted.cpu(), 20))
        if bonus == 0.0:
            assert torch.equal(ids, topk_ids(s, 20, bits_per_pass=bits))
        if bonus == 100.0:
            assert bool((ids % 7 == 0).all())  # 43 preferred entries per row: all 20 from them
    assert torch.equal(s, s.clone())  # the scores are not modified
    with pytest.raises(ValueError, match="prefer must be int32"):
        topk_ids(s, 3, prefer=prefer[:, :100], bits_per_pass=bits)
    with pytest.raises(ValueError, match="prefer_bonus"):
        topk_ids(s, 3, prefer=prefer, prefer_bonus=float("inf"), bits_per_pass=bits)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_per_row_counts(device, bits, backend):
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
                     k_rows=kr.to(device), bits_per_pass=bits)
        shifted = s + ((prefer >= 0).float() * bonus if pf is not None else 0.0)
        for r, k in enumerate(kr.clamp(0, 12).tolist()):
            assert torch.equal(out[r, :k].cpu(), topk_ids_ref(shifted[r:r + 1], k)[0]), (r, bonus)
            assert bool((out[r, k:] == -5).all()), r
    # rows past the register limit take the device-side reference path (no host read of k_rows)
    long = torch.randint(0, 50, (2, MAX_REGISTER_ROW + 3), generator=g).float().to(device)
    out = torch.full((2, 7), -5, dtype=torch.int32, device=device)
    topk_ids(long, 7, out=out, k_rows=torch.tensor([7, 2], dtype=torch.int32, device=device), bits_per_pass=bits)
    assert torch.equal(out[0].cpu(), topk_ids_ref(long[:1].cpu(), 7)[0])
    assert torch.equal(out[1, :2].cpu(), topk_ids_ref(long[1:].cpu(), 2)[0]) and bool((out[1, 2:] == -5).all())
    with pytest.raises(ValueError, match=r"k_rows must be int32 \[6\]"):
        topk_ids(s.to(device), 3, k_rows=kr[:5].to(device), bits_per_pass=bits)
    with pytest.raises(TypeError, match="k_rows"):
        topk_ids(s.to(device), 3, k_rows=kr.long().to(device), bits_per_pass=bits)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_negative_zero_stays_below_zero_with_a_bonus(device, bits, backend):
    """A preferred-entry bonus leaves the other entries as they are: -0.0 still ranks below +0.0
    (the reference once added 0.0 to every entry, turning -0.0 into +0.0)."""
    import contextlib

    s = torch.tensor([[-0.0, 0.0, 1.0]], device=device)
    pf = torch.tensor([[-1, -1, 0]], dtype=torch.int32, device=device)
    with cpu_backend("reference") if backend == "reference" else contextlib.nullcontext():
        assert topk_ids(s, 2, prefer=pf, prefer_bonus=0.5, bits_per_pass=bits).tolist() == [[1, 2]]
        kr = torch.tensor([2], dtype=torch.int32, device=device)
        assert topk_ids(s, 2, prefer=pf, prefer_bonus=0.5, k_rows=kr, bits_per_pass=bits).tolist() == [[1, 2]]


def test_bad_input(device, bits):
    s = torch.randn(2, 10, device=device)
    with pytest.raises(ValueError, match="k"):
        topk_ids(s, 11, bits_per_pass=bits)
    with pytest.raises(ValueError, match="k"):
        topk_ids(s, -1, bits_per_pass=bits)
    with pytest.raises(ValueError, match="contiguous last dim"):
        topk_ids(torch.randn(2, 20, device=device)[:, ::2], 1, bits_per_pass=bits)
    with pytest.raises(ValueError, match="scores"):
        topk_ids(s[0], 1, bits_per_pass=bits)
    with pytest.raises(TypeError, match="scores"):
        topk_ids(s.long(), 1, bits_per_pass=bits)
    with pytest.raises(ValueError, match="out must be int32 \\[2, 3\\]"):
        topk_ids(s, 3, out=torch.empty(2, 4, dtype=torch.int32, device=device), bits_per_pass=bits)
    with pytest.raises(TypeError, match="out"):
        topk_ids(s, 3, out=torch.empty(2, 3, dtype=torch.int64, device=device), bits_per_pass=bits)


def test_bits_per_pass_argument(device):
    """None is the module default (1: the plain bisection, until a GPU measurement switches it); a
    value outside BITS_PER_PASS_CHOICES (a float, a bool, a string too) is a ValueError naming it."""
    assert DEFAULT_BITS_PER_PASS == 1 and set(BITS_PER_PASS_CHOICES) >= {1, 2, 4}
    s = torch.randn(2, 30, generator=torch.Generator().manual_seed(8)).to(device)
    assert torch.equal(topk_ids(s, 4), topk_ids(s, 4, bits_per_pass=None))
    np = pytest.importorskip("numpy")
    assert torch.equal(topk_ids(s, 4, bits_per_pass=np.int64(2)).cpu(), topk_ids_ref(s.cpu(), 4))
    for bad in (0, 5, 8, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=f"bits_per_pass .*got {bad!r}"):
            topk_ids(s, 4, bits_per_pass=bad)
    with pytest.raises(ValueError, match="bits_per_pass"):  # checked before anything else, k == 0 too
        topk_ids(s, 0, bits_per_pass=3.5)


def _f32(bits_list):
    """fp32 values of the given int32 bit patterns."""
    return torch.tensor(bits_list, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _adversarial_rows():
    """(name, [R, N] fp32) rows that stress the key arithmetic and the tie rule."""
    g = torch.Generator().manual_seed(11)
    nan, inf = float("nan"), float("inf")
    one_ulp = _f32([0x3F800000 + i % 3 for i in range(40)])  # 1.0 and its next two floats, tied in runs
    neg_ulp = _f32([(0xBF800000 + i % 2) - 2**32 for i in range(33)])  # -1.0 and the next float below
    extremes = _f32([0x00000001, 0x7F7FFFFF, 0x80000001 - 2**32, 0xFF7FFFFF - 2**32, 0x00800000,
                     0x807FFFFF - 2**32, 0x7F800000, 0xFF800000 - 2**32, 0x7FC00000, 0xFFFFFFFF - 2**32,
                     0x00000000, 0x80000000 - 2**32, 0x7F800001, 0xFF800001 - 2**32])  # denormals, max, inf, NaNs, +-0
    neg_nan = torch.full((1, 21), 2.0)
    neg_nan[0, ::4] = -torch.tensor(nan)  # NaNs with the sign bit set: above every number too
    zeros = torch.tensor([[0.0, -0.0] * 9 + [-0.0]])
    rnd_bits = torch.randint(-2**31, 2**31, (3, 150), generator=g, dtype=torch.int64).to(torch.int32)
    return [
        ("all_equal", torch.full((2, 37), 0.5)),
        ("all_neg_inf", torch.full((1, 19), -inf)),
        ("all_nan", torch.full((1, 13), nan)),
        ("two_values", torch.where(torch.rand(2, 77, generator=g) < 0.3, 1.0, -2.0)),
        ("one_ulp_apart", one_ulp[None]),
        ("neg_one_ulp_apart", neg_ulp[None]),
        ("extremes", extremes[None]),
        ("signed_zeros", zeros),
        ("neg_nan", neg_nan),
        ("specials_mixed", torch.tensor([[nan, inf, -inf, 0.0, -0.0, 1.0, -1.0, inf, nan, -inf, 0.0, 1.0] * 3])),
        ("random_bit_patterns", rnd_bits.view(torch.float32)),  # the whole key range, NaNs and infs too
        ("many_ties_fp16", torch.randint(0, 5, (2, 129), generator=g).half()),
    ]


@pytest.mark.parametrize("case", _adversarial_rows(), ids=lambda c: c[0])
def test_adversarial_keys_match_the_reference(device, bits, case):
    _, s = case
    n = s.shape[1]
    for k in sorted({1, n // 3, n - 1}):
        assert torch.equal(topk_ids(s.to(device), k, bits_per_pass=bits).cpu(), topk_ids_ref(s, k)), k
    # per-row counts (0 included: the kernel runs with K = 0 and must take nothing)
    kr = torch.arange(s.shape[0], dtype=torch.int32) * 3 % (n + 1)
    out = torch.full((s.shape[0], n // 2 + 1), -5, dtype=torch.int32, device=device)
    topk_ids(s.to(device), n // 2 + 1, out=out, k_rows=kr.to(device), bits_per_pass=bits)
    for r, k in enumerate(kr.clamp(0, n // 2 + 1).tolist()):
        assert torch.equal(out[r, :k].cpu(), topk_ids_ref(s[r:r + 1], k)[0]), (r, k)
        assert bool((out[r, k:] == -5).all()), r


def test_random_rows_with_many_ties(device, bits):
    """Rows of few distinct values (every k falls in a tie) at a non-power-of-two length with
    prefer: kernel == reference for each bits_per_pass."""
    g = torch.Generator().manual_seed(12)
    s = (torch.randint(0, 8, (3, 1500), generator=g).float() / 4 - 1).to(device)
    prefer = torch.where(torch.rand(3, 1500, generator=g) < 0.2, 0, -1).to(torch.int32).to(device)
    for k in (1, 187, 1499):
        assert torch.equal(topk_ids(s, k, bits_per_pass=bits).cpu(), topk_ids_ref(s.cpu(), k))
        shifted = s.cpu() + (prefer.cpu() >= 0).float() * 0.25
        assert torch.equal(topk_ids(s, k, prefer=prefer, prefer_bonus=0.25, bits_per_pass=bits).cpu(),
                           topk_ids_ref(shifted, k))


def test_rows_past_8192_in_registers(device, bits):
    """A row of 8193 .. MAX_REGISTER_ROW runs the kernel's largest block (bits_per_pass capped at 3
    there): the same ids as the reference."""
    g = torch.Generator().manual_seed(13)
    s = torch.randint(0, 200, (1, 9001), generator=g).float().to(device)
    assert torch.equal(topk_ids(s, 116, bits_per_pass=bits).cpu(), topk_ids_ref(s.cpu(), 116))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_graph_replay_and_long_rows(bits):
    g = torch.Generator().manual_seed(5)
    s = torch.randn(8, 4096, generator=g).cuda()
    out = torch.empty(8, 58, dtype=torch.int32, device="cuda")
    topk_ids(s, 58, out=out, bits_per_pass=bits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_ids(s, 58, out=out, bits_per_pass=bits)
    for seed in range(3):
        s.copy_(torch.randn(8, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_ids_ref(s.cpu(), 58))
    long = torch.randn(2, MAX_REGISTER_ROW + 5, generator=g).cuda()
    ids = topk_ids(long, 100, bits_per_pass=bits)
    _check_topk(long, ids, 100)
    assert torch.equal(ids.cpu(), topk_ids_ref(long.cpu(), 100))
