"""Tests of merge_attention_states (2-way, N-way, in-place) against exact attention and merge_ref.

CPU: the Triton code under the interpreter and the reference path. GPU (``-m cuda``): bf16/fp16.
"""
import math

import pytest
import torch

from helpers import EPS32, assert_lse_match, max_err
from xoffload.kernels import cpu_backend, merge_attention_states, merge_attention_states_, merge_attention_states_n
from xoffload.kernels.reference import attention_ref, merge_ref

NEG_INF = float("-inf")


def _backends(device):
    # on the CPU exercise both paths (interpreted Triton and the PyTorch reference)
    return ["interpreter", "reference"] if device == "cpu" else [None]


class _maybe_backend:
    def __init__(self, name):
        self.cm = cpu_backend(name) if name else None

    def __enter__(self):
        if self.cm:
            self.cm.__enter__()

    def __exit__(self, *a):
        if self.cm:
            self.cm.__exit__(*a)


def _split_attention(b, sq, hq, hkv, d, sk, cut, device, causal=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(device)
    k = torch.randn(b, sk, hkv, d, generator=g).to(device)
    v = torch.randn(b, sk, hkv, d, generator=g).to(device)
    whole = attention_ref(q, k, v)
    parts = [attention_ref(q, k[:, a:e], v[:, a:e]) for a, e in zip([0] + cut, cut + [sk])]
    return whole, parts


def _ref_merge(outs, lses):
    """merge_ref in the [.., S, H, D] / [.., H, S] layout."""
    o, l = merge_ref(outs, lses.transpose(-1, -2))
    return o, l.transpose(-1, -2)


@pytest.mark.parametrize("d", [64, 80])
def test_split_merged_equals_whole(device, d):
    (fo, fl), [(oa, la), (ob, lb)] = _split_attention(2, 5, 6, 2, d, 50, [20], device)
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states(oa, la, ob, lb)
        assert o.dtype == torch.float32 and l.shape == la.shape
        assert max_err(o, fo) <= 8 * EPS32 * max(1.0, float(fo.abs().max())), be
        assert_lse_match(l, fl)


def test_split_merged_with_flash_attn_kernel(device):
    # partials from the project's own attention kernel, if it is there yet
    try:
        from xoffload.kernels import flash_attn_with_lse
        flash_attn_with_lse.__name__
    except (ImportError, AttributeError):
        pytest.skip("flash_attn_with_lse not available")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 7, 4, 64, generator=g).half().to(device)
    k = torch.randn(1, 64, 2, 64, generator=g).half().to(device)
    v = torch.randn(1, 64, 2, 64, generator=g).half().to(device)
    oa, la = flash_attn_with_lse(q, k[:, :29], v[:, :29])
    ob, lb = flash_attn_with_lse(q, k[:, 29:], v[:, 29:])
    fo, fl = attention_ref(q, k, v)
    o, l = merge_attention_states(oa, la, ob, lb)
    # each partial is rounded to fp16 once (<= 1/2 ulp), then merged in fp32 and rounded again
    tol = 4 * torch.finfo(torch.float16).eps * max(1.0, float(fo.abs().max()))
    assert max_err(o, fo) <= tol
    assert_lse_match(l, fl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_matches_reference_and_dtype(device, dtype):
    g = torch.Generator().manual_seed(2)
    oa = torch.randn(2, 9, 4, 96, generator=g).to(dtype).to(device)
    ob = torch.randn(2, 9, 4, 96, generator=g).to(dtype).to(device)
    la = (torch.randn(2, 4, 9, generator=g) * 5).to(device)
    lb = (torch.randn(2, 4, 9, generator=g) * 5).to(device)
    ro, rl = _ref_merge(torch.stack([oa, ob]), torch.stack([la, lb]))
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states(oa, la, ob, lb)
        assert o.dtype == dtype
        # fp32 math, one rounding to the output dtype
        assert max_err(o, ro) <= 2 * torch.finfo(dtype).eps * max(1.0, float(ro.abs().max())), be
        assert_lse_match(l, rl)


def test_merge_neg_inf_rows(device):
    g = torch.Generator().manual_seed(3)
    oa = torch.randn(1, 4, 3, 64, generator=g).half().to(device)
    ob = torch.randn(1, 4, 3, 64, generator=g).half().to(device)
    la = torch.randn(1, 3, 4, generator=g).to(device)
    lb = torch.randn(1, 3, 4, generator=g).to(device)
    la[0, 0, :] = NEG_INF  # a empty in head 0
    lb[0, 1, :] = NEG_INF  # b empty in head 1
    la[0, 2, 1] = NEG_INF
    lb[0, 2, 1] = NEG_INF  # both empty at (head 2, row 1)
    # garbage where the LSE says "empty" must not leak in
    oa[0, :, 0] = float("nan")
    ob[0, :, 1] = float("inf")
    oa[0, 1, 2] = float("nan")
    ob[0, 1, 2] = float("nan")
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states(oa, la, ob, lb)
        assert not torch.isnan(o).any() and not torch.isnan(l).any(), be
        assert torch.isneginf(l[0, 2, 1]) and float(o[0, 1, 2].abs().max()) == 0.0, be
        # one side empty: the other side comes through exactly
        assert torch.equal(o[0, :, 0], ob[0, :, 0]) and torch.equal(l[0, 0], lb[0, 0]), be
        assert torch.equal(o[0, :, 1], oa[0, :, 1]) and torch.equal(l[0, 1], la[0, 1]), be


def test_merge_n_way_and_layouts(device):
    # dense layout [N, B, S, H, D] with 4 splits of the keys, one of them empty for some rows
    (fo, fl), parts = _split_attention(2, 3, 4, 4, 64, 70, [10, 33, 50], device, seed=4)
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states_n(outs, lses)
        assert max_err(o, fo) <= 16 * EPS32 * max(1.0, float(fo.abs().max())), be
        assert_lse_match(l, fl)
    # varlen layout: o [T, H, D], lse [H, T]; non-contiguous views; fp16 out of fp32 partials
    ov = outs[:, 1]  # [N, S, H, D] with S as "T"
    lv = lses[:, 1]  # [N, H, S]
    big = torch.zeros(4, 3, 4, 80, device=device)
    big[..., 8:72] = ov
    ov_nc = big[..., 8:72]
    lv_nc = lv.transpose(-1, -2).contiguous().transpose(-1, -2)
    out16 = torch.empty(3, 4, 64, dtype=torch.float16, device=device)
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states_n(ov_nc, lv_nc, out=out16)
        assert o is out16
        assert max_err(o, fo[1]) <= 2 * torch.finfo(torch.float16).eps * max(1.0, float(fo.abs().max()))
        assert_lse_match(l, fl[1])
    # N = 0: (0, -inf)
    o, l = merge_attention_states_n(outs[:0], lses[:0])
    assert float(o.abs().max()) == 0.0 and torch.isneginf(l).all()
    # N = 1: identity
    o, l = merge_attention_states_n(outs[:1], lses[:1])
    assert torch.equal(o, outs[0]) and torch.equal(l, lses[0])


@pytest.mark.parametrize("shape", [(2, 300, 3, 16), (2, 1, 300, 32), (1, 70, 5, 200)])
def test_merge_many_rows(device, shape):
    # several row blocks per (batch, head), a partial last block, the S == 1 (decode) geometry,
    # and D > 128 (one D block of 256)
    b, s, h, d = shape
    g = torch.Generator().manual_seed(9)
    outs = torch.randn(3, b, s, h, d, generator=g).half().to(device)
    lses = (torch.randn(3, b, h, s, generator=g) * 3).to(device)
    lses[1, :, :, ::7] = NEG_INF
    lses = torch.cat([lses, lses], -1)[..., :s]  # non-contiguous view: head stride 2*S
    ro, rl = _ref_merge(outs, lses)
    tol = 2 * torch.finfo(torch.float16).eps * max(1.0, float(ro.abs().max()))
    o, l = merge_attention_states_n(outs, lses)
    assert max_err(o, ro) <= tol
    assert_lse_match(l, rl)
    ro2, rl2 = _ref_merge(outs[:2], lses[:2])
    o, l = merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    assert max_err(o, ro2) <= tol
    assert_lse_match(l, rl2)


def test_merge_n_all_empty(device):
    outs = torch.full((3, 1, 2, 2, 16), float("nan"), device=device)
    lses = torch.full((3, 1, 2, 2), NEG_INF, device=device)
    for be in _backends(device):
        with _maybe_backend(be):
            o, l = merge_attention_states_n(outs, lses)
        assert float(o.abs().max()) == 0.0 and torch.isneginf(l).all(), be


def test_merge_in_place_accumulation(device):
    # decode-style layout o [B, 1, H, D], lse [B, H, 1]; accumulate 3 key chunks from (0, -inf)
    (fo, fl), parts = _split_attention(3, 1, 6, 2, 64, 40, [5, 21], device, seed=5)
    for be in _backends(device):
        o_acc = torch.zeros_like(fo)
        l_acc = torch.full_like(fl, NEG_INF)
        with _maybe_backend(be):
            for o_b, l_b in parts:
                r = merge_attention_states_(o_acc, l_acc, o_b, l_b)
                assert r[0] is o_acc and r[1] is l_acc
        assert max_err(o_acc, fo) <= 16 * EPS32 * max(1.0, float(fo.abs().max())), be
        assert_lse_match(l_acc, fl)


def test_merge_out_argument(device):
    (fo, fl), [(oa, la), (ob, lb)] = _split_attention(1, 4, 2, 2, 64, 30, [12], device, seed=6)
    out = torch.empty_like(oa)
    out_lse = torch.empty_like(la)
    o, l = merge_attention_states(oa, la, ob, lb, out=out, out_lse=out_lse)
    assert o is out and l is out_lse
    assert max_err(o, fo) <= 8 * EPS32 * max(1.0, float(fo.abs().max()))


def test_merge_bad_inputs():
    oa = torch.randn(2, 3, 4, 64).half()
    la = torch.randn(2, 4, 3)
    with pytest.raises(TypeError, match="o_b has dtype"):
        merge_attention_states(oa, la, oa.float(), la)
    with pytest.raises(ValueError, match="device"):
        merge_attention_states(oa, la, oa.to("meta"), la.to("meta"))
    with pytest.raises(ValueError, match="lse_b is on"):
        merge_attention_states(oa, la, oa, la.to("meta"))
    with pytest.raises(ValueError, match=r"lse_a has shape \(2, 3, 4\)"):
        merge_attention_states(oa, la.transpose(1, 2), oa, la)
    with pytest.raises(TypeError, match="lse_b must be float32"):
        merge_attention_states(oa, la, oa, la.half())
    nc = torch.randn(2, 3, 64, 4).half().transpose(-1, -2)
    with pytest.raises(ValueError, match="o_b must have a contiguous last dim"):
        merge_attention_states(oa, la, nc, la)
    with pytest.raises(ValueError, match="o_a must have shape"):
        merge_attention_states(oa[0, 0], la[0, 0], oa[0, 0], la[0, 0])
    with pytest.raises(ValueError, match="o_a has shape"):
        merge_attention_states(oa, la, oa[:1], la[:1])
    with pytest.raises(ValueError, match="out has shape"):
        merge_attention_states(oa, la, oa, la, out=oa[:1])
    with pytest.raises(TypeError, match="out_lse has dtype torch.float16, expected torch.float32"):
        merge_attention_states(oa, la, oa, la, out_lse=la.half())
    with pytest.raises(TypeError, match="o_a must be a torch.Tensor"):
        merge_attention_states(None, la, oa, la)
    with pytest.raises(TypeError, match="dtype"):
        merge_attention_states(oa.int(), la, oa.int(), la)
    with pytest.raises(ValueError, match="outs must have shape"):
        merge_attention_states_n(oa[0], la[0])
    with pytest.raises(ValueError, match="lses has shape"):
        merge_attention_states_n(oa[None], la)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_merge_gpu(dtype, d):
    torch.manual_seed(7)
    n, b, s, h = 3, 2, 1000, 32
    outs = torch.randn(n, b, s, h, d, device="cuda").to(dtype)
    lses = torch.randn(n, b, h, s, device="cuda") * 20
    lses[0, :, 3] = NEG_INF
    lses[:, 1, 5, :7] = NEG_INF
    ro, rl = _ref_merge(outs, lses)
    tol = 2 * torch.finfo(dtype).eps * max(1.0, float(ro.abs().max()))
    o, l = merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    ro2, rl2 = _ref_merge(outs[:2], lses[:2])
    assert max_err(o, ro2) <= tol
    assert_lse_match(l, rl2)
    o, l = merge_attention_states_n(outs, lses)
    assert max_err(o, ro) <= tol
    assert_lse_match(l, rl)
    assert not torch.isnan(o).any()
    o_acc, l_acc = outs[0].clone(), lses[0].clone()
    merge_attention_states_(o_acc, l_acc, outs[1], lses[1])
    assert max_err(o_acc, ro2) <= tol


@pytest.mark.parametrize("backend", ["interpreter", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_garbage_lse_gives_nan_not_a_silent_zero(backend, bad):
    """A NaN or +inf LSE is garbage: the merge must show it (NaN output and a non-finite LSE),
    not drop it as an empty state; (-inf, -inf) stays (0, -inf)."""
    oa = torch.ones(1, 2, 3, 8)
    ob = torch.full((1, 2, 3, 8), 2.0)
    la = torch.zeros(1, 3, 2)
    la[0, 1, 0] = bad
    lb = torch.ones(1, 3, 2)
    with cpu_backend(backend):
        o, lse = merge_attention_states(oa, la, ob, lb)
    assert torch.isnan(o[0, 0, 1]).all()
    assert not torch.isfinite(lse[0, 1, 0])
    ok = torch.ones_like(lse, dtype=torch.bool)
    ok[0, 1, 0] = False
    assert torch.isfinite(lse[ok]).all()
    assert torch.isfinite(o[0, 1]).all() and torch.isfinite(o[0, 0, 0]).all()


# ------------------------------------------------------------------- LSEs of any strides
LN2 = math.log(2.0)


def _flashinfer_states(seq_len, heads, d, dtype, device, seed=0):
    """Two states as FlashInfer keeps them: v ``[S, H, D]``, s ``[S, H]`` (fp32, base-2 LSE)."""
    g = torch.Generator().manual_seed(seed)
    va, vb = (torch.randn(seq_len, heads, d, generator=g).to(dtype).to(device) for _ in range(2))
    sa, sb = (torch.randn(seq_len, heads, generator=g).to(device) for _ in range(2))
    return va, sa, vb, sb


def _flashinfer_merge_ref(va, sa, vb, sb):
    """FlashInfer's merge_state in fp32 PyTorch, base 2: (v fp32 ``[S, H, D]``, s ``[S, H]``)."""
    m = torch.maximum(sa, sb)
    wa, wb = torch.exp2(sa - m), torch.exp2(sb - m)
    tot = wa + wb
    v = (wa[..., None] * va.float() + wb[..., None] * vb.float()) / tot[..., None]
    return v, m + torch.log2(tot)


def _check_flashinfer_in_place(seq_len, heads, d, dtype, device):
    """FlashInfer's test_merge_state_in_place as a port runs it: its [S, H] base-2 LSEs converted
    to natural log and handed over as transposed [H, S] views; the caller's tensors are updated."""
    va, sa2, vb, sb2 = _flashinfer_states(seq_len, heads, d, dtype, device)
    ref_v, ref_s2 = _flashinfer_merge_ref(va, sa2, vb, sb2)
    sa, sb = sa2 * LN2, sb2 * LN2
    lse_acc = sa.t()
    r = merge_attention_states_(va, lse_acc, vb, sb.t())
    assert r[0] is va and r[1] is lse_acc
    # fp32 math, one rounding to the output dtype
    assert max_err(va, ref_v) <= 2 * torch.finfo(dtype).eps * max(1.0, float(ref_v.abs().max()))
    assert_lse_match(sa, ref_s2 * LN2)


def test_in_place_merge_takes_transposed_lse(device):
    o = torch.randn(64, 4, 64, dtype=torch.float16).to(device)
    ob = torch.randn_like(o)
    s = torch.randn(64, 4).to(device)
    sb = torch.randn(64, 4).to(device)
    ro, rl = merge_ref(torch.stack([o, ob]), torch.stack([s, sb]))
    for be in _backends(device):
        oc, sc = o.clone(), s.clone()
        with _maybe_backend(be):
            merge_attention_states_(oc, sc.t(), ob, sb.t())
        assert max_err(oc, ro) <= 2 * torch.finfo(torch.float16).eps * max(1.0, float(ro.abs().max())), be
        assert_lse_match(sc, rl)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("seq_len", [1, 64])
def test_flashinfer_merge_state_in_place_fp16(device, seq_len, heads, d):
    for be in _backends(device):
        with _maybe_backend(be):
            _check_flashinfer_in_place(seq_len, heads, d, torch.float16, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [4, 16, 32])
@pytest.mark.parametrize("seq_len", [1, 64, 512])
def test_flashinfer_merge_state_in_place_gpu(seq_len, heads, d, dtype):
    _check_flashinfer_in_place(seq_len, heads, d, dtype, "cuda")


def _lse_layouts(b1, b2, h, s, device):
    """fp32 ``[b1, b2, h, s]`` views of bigger buffers (filled with 123) in several layouts:
    (name, view, buffer). The last one's leading dims cannot be flattened without a copy."""
    t = torch.full((b1, b2, s, h), 123.0, device=device)
    sl = torch.full((b1, b2, h, 2 * s + 1), 123.0, device=device)
    nf = torch.full((h, s, b1, b2 + 1), 123.0, device=device)
    return [
        ("transposed", t.transpose(-1, -2), t),
        ("sliced", sl[..., 1:2 * s + 1:2], sl),
        ("unflattenable", nf[..., :b2].permute(2, 3, 0, 1), nf),
    ]


def _untouched_outside(buf, view):
    """Every element of ``buf`` outside ``view`` still holds the fill value 123."""
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - buf.storage_offset()).fill_(False)
    return bool((buf[mask] == 123.0).all())


@pytest.mark.parametrize("s", [1, 5])
def test_out_lse_of_any_strides(device, s):
    """Output LSEs as transposed, sliced and unflattenable views, out of place (2-way, N-way) and in
    place; input LSEs in the same layouts. The rest of the buffer stays untouched."""
    b1, b2, h, d = 2, 3, 4, 16
    g = torch.Generator().manual_seed(11)
    outs = torch.randn(3, b1, b2, s, h, d, generator=g).half().to(device)
    lses = (torch.randn(3, b1, b2, h, s, generator=g) * 3).to(device)
    lses[1, 0, 1, 2] = NEG_INF
    tol = 2 * torch.finfo(torch.float16).eps
    ro2, rl2 = _ref_merge(outs[:2], lses[:2])
    ro3, rl3 = _ref_merge(outs, lses)
    for be in _backends(device):
        with _maybe_backend(be):
            for name, lv, buf in _lse_layouts(b1, b2, h, s, device):
                o, l = merge_attention_states(outs[0], lses[0], outs[1], lses[1], out_lse=lv)
                assert l is lv and _untouched_outside(buf, lv), (be, name)
                assert max_err(o, ro2) <= tol * max(1.0, float(ro2.abs().max())), (be, name)
                assert_lse_match(lv, rl2)
                o, l = merge_attention_states_n(outs, lses, out_lse=lv)
                assert l is lv and _untouched_outside(buf, lv), (be, name)
                assert max_err(o, ro3) <= tol * max(1.0, float(ro3.abs().max())), (be, name)
                assert_lse_match(lv, rl3)
                # in place, the accumulator's LSE in this layout; the other input's LSE too
                lv.copy_(lses[0])
                lb = {n: v for n, v, _ in _lse_layouts(b1, b2, h, s, device)}[name]
                lb.copy_(lses[1])
                o_acc = outs[0].clone()
                r = merge_attention_states_(o_acc, lv, outs[1], lb)
                assert r[0] is o_acc and r[1] is lv and _untouched_outside(buf, lv), (be, name)
                assert max_err(o_acc, ro2) <= tol * max(1.0, float(ro2.abs().max())), (be, name)
                assert_lse_match(lv, rl2)


def test_out_lse_aliasing_an_input_lse(device):
    """out_lse may be lse_a or lse_b itself (here transposed views), or one of the N-way lses."""
    s, h, d = 6, 3, 32
    g = torch.Generator().manual_seed(12)
    outs = torch.randn(3, s, h, d, generator=g).half().to(device)
    raw = (torch.randn(3, s, h, generator=g) * 2).to(device)  # [N, S, H]
    ro2, rl2 = _ref_merge(outs[:2], raw[:2].transpose(-1, -2))
    ro3, rl3 = _ref_merge(outs, raw.transpose(-1, -2))
    tol = 2 * torch.finfo(torch.float16).eps
    for be in _backends(device):
        with _maybe_backend(be):
            ls = raw.clone().transpose(-1, -2)  # [N, H, S] view
            o, l = merge_attention_states(outs[0], ls[0], outs[1], ls[1], out_lse=ls[1])
            assert max_err(o, ro2) <= tol * max(1.0, float(ro2.abs().max())), be
            assert_lse_match(ls[1], rl2)
            ls = raw.clone().transpose(-1, -2)
            o, l = merge_attention_states_n(outs, ls, out_lse=ls[2])
            assert max_err(o, ro3) <= tol * max(1.0, float(ro3.abs().max())), be
            assert_lse_match(ls[2], rl3)
            # interleaved LSEs of one buffer share no element: accepted
            buf = torch.full((h, s, 3), 123.0, device=device)
            buf[..., 0], buf[..., 1] = raw[0].t(), raw[1].t()
            o, l = merge_attention_states(outs[0], buf[..., 0], outs[1], buf[..., 1], out_lse=buf[..., 2])
            assert_lse_match(buf[..., 2], rl2)
            assert torch.equal(buf[..., 0], raw[0].t()) and torch.equal(buf[..., 1], raw[1].t()), be


def test_out_lse_that_cannot_be_written_raises(device):
    s, h, d = 4, 4, 16
    oa = torch.randn(1, s, h, d).to(device)
    la = torch.randn(1, h, s).to(device)
    lb = torch.randn(1, h, s).to(device)
    for be in _backends(device):
        with _maybe_backend(be):
            # elements that share memory
            with pytest.raises(ValueError, match=r"out_lse with shape \(1, 4, 4\) strides \(4, 0, 1\) has elements "
                                                 r"that share memory; expected one memory location per element"):
                merge_attention_states(oa, la, oa, lb, out_lse=torch.zeros(1, 1, s, device=device).expand(1, h, s))
            with pytest.raises(ValueError, match="share memory"):
                merge_attention_states_(oa.clone(), torch.zeros(s, device=device).expand(1, h, s), oa, lb)
            # lse_a's memory in another layout, shifted by one element, or o's memory
            with pytest.raises(ValueError, match=r"out_lse \(strides \(16, 1, 4\)\) shares memory with lse_a .*"
                                                 r"expected lse_a or lse_b itself"):
                merge_attention_states(oa, la, oa, lb, out_lse=la.transpose(1, 2))
            buf = torch.randn(h * s + 1, device=device)
            with pytest.raises(ValueError, match="shares memory with lse_b"):
                merge_attention_states(oa, la, oa, buf[:-1].view(1, h, s), out_lse=buf[1:].view(1, h, s))
            with pytest.raises(ValueError, match="shares memory with o_a"):
                merge_attention_states(oa, la, oa, lb, out_lse=oa[:, 0, :, :s])
            lses = torch.stack([la, lb])
            with pytest.raises(ValueError, match=r"shares memory with lses\[0\] .* expected lses\[0\] or lses\[1\]"):
                merge_attention_states_n(torch.stack([oa, oa]), lses, out_lse=lses[0].transpose(1, 2))
            # nothing was written
            assert torch.equal(lses, torch.stack([la, lb])), be


def test_overlap_helpers():
    from xoffload.kernels.checks import has_internal_overlap, overlaps
    b = torch.zeros(100)
    assert not has_internal_overlap(b.as_strided((3, 2), (2, 3)))  # distinct, though strides interleave
    assert has_internal_overlap(b.as_strided((3, 2), (1, 2)))  # offset 2 twice
    assert not has_internal_overlap(b.as_strided((1, 4), (0, 1)))  # stride 0 on a dim of size 1
    assert has_internal_overlap(torch.zeros(4, 1).expand(4, 3))
    x = torch.zeros(4, 5, 3)
    assert not overlaps(x[..., 0], x[..., 1]) and not overlaps(x[:2], x[2:])
    assert overlaps(x[..., 0], x[..., 0]) and overlaps(x[..., 0], x[..., :2])
    assert not overlaps(x.half(), x) and not overlaps(x.to("meta"), x.to("meta"))
