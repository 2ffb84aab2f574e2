"""flash-attn's inference options in the decode kernels (decode_attn_with_lse and
paged_decode_attn_with_lse): several query tokens (Sq > 1), causal, local window, softcap, ALiBi,
left padding, cache batch index, flash-attn's block stores ``[num_blocks, page, Hkv, D]`` and page
sizes that are multiples of 16 but not powers of two.

Each option is checked three ways: the fp32 reference (xoffload.kernels.reference) against a
scalar float64 loop of the option's formula; the kernel against the reference within the tolerance
rule (2x the error of the same computation done by PyTorch in the input dtype, tests/helpers.py);
and the LSE against the reference's. CPU: the Triton code under the interpreter (fp16/fp32, small
shapes). GPU (``-m cuda``): bf16/fp16 at long lengths.
"""
import math

import pytest
import torch

from helpers import assert_lse_match, max_err, out_tol
from xoffload.kernels import cpu_backend, decode_attn_with_lse, paged_decode_attn_with_lse
from xoffload.kernels.decode import decode_options, default_num_splits
from xoffload.kernels.reference import (
    alibi_bias_ref, decode_attention_ref, kvcache_visible_ref, paged_decode_attn_ref, paged_gather_ref,
)


def _rand(*shape, dtype, device, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------ reference
def _formula(q, k, v, n, *, scale, causal, window, softcap, slopes, leftpad):
    """Scalar float64 loop of the options' formulas for one item: q [Sq, Hq, D], k/v [>=n, Hkv, D]."""
    sq, hq, d = q.shape
    g = hq // k.shape[1]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(sq, hq, d, dtype=torch.float64)
    lse = torch.full((hq, sq), -math.inf, dtype=torch.float64)
    for i in range(sq):
        pos = n - sq + i
        for h in range(hq):
            scores = {}
            for j in range(leftpad, n):
                if right >= 0 and j > pos + right:
                    continue
                if left >= 0 and j < pos - left:
                    continue
                s = scale * sum(float(q[i, h, t]) * float(k[j, h // g, t]) for t in range(d))
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s += -float(slopes[h]) * abs(pos - j)
                scores[j] = s
            if not scores:
                continue
            m = max(scores.values())
            z = sum(math.exp(s - m) for s in scores.values())
            lse[h, i] = m + math.log(z)
            for j, s in scores.items():
                out[i, h] += math.exp(s - lse[h, i]) * v[j, h // g].double()
    return out, lse


@pytest.mark.parametrize("opts", [
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi=False, leftpad=0),
    dict(causal=False, window=(2, 1), softcap=0.0, alibi=False, leftpad=1),
    dict(causal=True, window=(3, -1), softcap=1.5, alibi=True, leftpad=0),
    dict(causal=False, window=(-1, 0), softcap=0.7, alibi=True, leftpad=2),
], ids=["causal", "window-leftpad", "causal-window-softcap-alibi", "right-softcap-alibi-leftpad"])
def test_reference_matches_the_formulas(opts):
    """reference.decode_attention_ref / paged_decode_attn_ref equal the scalar formulas."""
    g = torch.Generator().manual_seed(0)
    sq, hq, hkv, d, n = 3, 4, 2, 5, 9
    q = torch.randn(1, sq, hq, d, generator=g)
    k = torch.randn(1, 12, hkv, d, generator=g)
    v = torch.randn(1, 12, hkv, d, generator=g)
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0]) if opts["alibi"] else None
    lens = torch.tensor([n], dtype=torch.int32)
    lp = torch.tensor([opts["leftpad"]], dtype=torch.int32)
    kw = dict(softmax_scale=0.6, causal=opts["causal"], window_size=opts["window"], softcap=opts["softcap"],
              alibi_slopes=slopes, cache_leftpad=lp)
    ro, rl = decode_attention_ref(q, k, v, lens, **kw)
    fo, fl = _formula(q[0], k[0], v[0], n, scale=0.6, causal=opts["causal"], window=opts["window"],
                      softcap=opts["softcap"], slopes=slopes, leftpad=opts["leftpad"])
    assert max_err(ro[0], fo) < 1e-5 and max_err(rl[0], fl) < 1e-5
    assert torch.equal(torch.isneginf(rl[0]), torch.isneginf(fl))
    # the paged reference over a block store holding the same tokens
    kb, vb = k[0, :12].reshape(3, 4, hkv, d), v[0, :12].reshape(3, 4, hkv, d)
    table = torch.tensor([[[0, 1, 2]]], dtype=torch.int32)
    po, pl = paged_decode_attn_ref(q, kb, vb, table, lens, page_size=4, **kw)
    assert max_err(po, ro) < 1e-6 and max_err(pl, rl) < 1e-6


def test_reference_helpers():
    vis = kvcache_visible_ref(2, 6, causal=True, window_size=(2, -1), leftpad=1)
    # rows at positions 4 and 5, keys 2..4 and 3..5
    assert vis.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    b = alibi_bias_ref(torch.tensor([1.0]), 1, 4)
    assert b.tolist() == [[[-3.0, -2.0, -1.0, -0.0]]]


# ------------------------------------------------------------------------------- kernel vs reference
def _pt_in_dtype(q, k, v, lens, *, scale, causal, window, softcap, slopes, leftpad, rows=None):
    """The same attention computed by PyTorch in the inputs' dtype (flash-attn's ``upcast=False,
    reorder_ops=True`` reference): the baseline whose error sets the tolerance."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    for i, n in enumerate(lens):
        r = i if rows is None else rows[i]
        lp = 0 if leftpad is None else int(leftpad[i])
        if n == 0:
            continue
        kk = k[r, :n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, D]
        vv = v[r, :n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        s = q[i].transpose(0, 1) @ (kk * scale).transpose(1, 2)  # [Hq, Sq, n] in dtype
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if slopes is not None:
            sl = slopes if slopes.dim() == 1 else slopes[i]
            s = s + alibi_bias_ref(sl, sq, n).to(s.dtype)
        vis = kvcache_visible_ref(sq, n, causal=causal, window_size=window, leftpad=lp, device=q.device)
        s = s.masked_fill(~vis[None], float("-inf"))
        p = torch.nan_to_num(torch.softmax(s.float(), -1).to(q.dtype))
        out[i] = (p @ vv).transpose(0, 1)
    return out


def _check_kernel(fn, q, args, lens, kw, ref_kw, base_kv, rows=None):
    """Run ``fn(q, *args, seqlens, **kw)`` and check out/LSE against the reference and baseline."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    out, lse = fn(q, *args, seqlens, **kw)
    b, sq, hq, d = q.shape
    assert out.shape == (b, sq, hq, d) and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    ref_o, ref_l = ref_kw["ref"](seqlens)
    kb, vb = base_kv
    base = _pt_in_dtype(q, kb, vb, lens, scale=ref_kw["scale"], causal=kw.get("causal", False),
                        window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                        slopes=kw.get("alibi_slopes"), leftpad=kw.get("cache_leftpad"), rows=rows)
    tol = out_tol(ref_o, base, q.dtype)
    err = max_err(out, ref_o)
    assert err <= tol, f"out error {err:.3g} > tol {tol:.3g}"
    max_score = 40.0 if kw.get("alibi_slopes") is not None else None
    assert_lse_match(lse, ref_l, max_score)
    assert not torch.isnan(out).any()
    return out, lse


DECODE_CASES = [  # (B, Sq, Hq, Hkv, D, dtype, lens, options)
    (2, 1, 4, 2, 64, torch.float16, [200, 20], dict(window_size=(37, -1), num_splits=3)),
    (2, 1, 6, 2, 40, torch.float32, [150, 9], dict(softcap=4.0, num_splits=2)),
    (2, 1, 4, 1, 64, torch.float16, [130, 64], dict(causal=True, alibi="h", num_splits=2)),
    (2, 4, 4, 2, 32, torch.float16, [97, 5], dict(causal=True, alibi="bh", window_size=(9, -1), softcap=5.0,
                                                  num_splits=3)),
    (2, 3, 3, 3, 48, torch.float32, [120, 40], dict(window_size=(5, 2), leftpad=[30, 3], num_splits=2)),
    (2, 1, 4, 2, 64, torch.float16, [150, 70], dict(window_size=(50, 0), leftpad=[33, 70], batch_idx=[2, 0])),
    (2, 2, 8, 2, 64, torch.float16, [100, 1], dict(num_splits=2)),  # several tokens, no option
    (2, 5, 2, 1, 32, torch.float16, [3, 0], dict(causal=True)),  # Sq > n: rows that see nothing
]


@pytest.mark.parametrize("b,sq,hq,hkv,d,dtype,lens,opt", DECODE_CASES)
def test_decode_options_match_reference(device, b, sq, hq, hkv, d, dtype, lens, opt):
    gen = torch.Generator().manual_seed(sum(lens) + d)
    s_max = max(lens) + 11
    bc = 3 if "batch_idx" in opt else b
    scale_in = 3.0 if opt.get("softcap") else 1.0  # scores large enough for the cap to bite
    q = _rand(b, sq, hq + 1, d, dtype=dtype, device=device, gen=gen, scale=scale_in)[:, :, 1:]  # strided
    k = _rand(bc, s_max, hkv, d, dtype=dtype, device=device, gen=gen, scale=scale_in)
    v = _rand(bc, s_max, hkv, d, dtype=dtype, device=device, gen=gen)
    kw = {x: opt[x] for x in ("window_size", "softcap", "causal", "num_splits") if x in opt}
    if "alibi" in opt:
        kw["alibi_slopes"] = (torch.rand(hq, generator=gen) * 0.3 if opt["alibi"] == "h"
                              else torch.rand(b, hq, generator=gen) * 0.3).to(device)
    if "leftpad" in opt:
        kw["cache_leftpad"] = torch.tensor(opt["leftpad"], dtype=torch.int32, device=device)
    rows = None
    if "batch_idx" in opt:
        rows = opt["batch_idx"]
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=device)
    ref_kw = {x: kw[x] for x in kw if x != "num_splits"}
    scale = d ** -0.5
    ref = dict(scale=scale, ref=lambda L: decode_attention_ref(q, k, v, L.cpu() if q.is_cuda else L, **ref_kw))
    out, lse = _check_kernel(decode_attn_with_lse, q, (k, v), lens, kw, ref, (k, v), rows)
    if lens == [3, 0]:
        assert torch.isneginf(lse[1]).all() and not out[1].any()
        assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all()
    # the split count does not change the answer beyond rounding
    o1, l1 = decode_attn_with_lse(q, k, v, torch.tensor(lens, dtype=torch.int32, device=device),
                                  **{**kw, "num_splits": 1})
    assert max_err(o1, out) <= 2 * out_tol(o1.float(), o1, dtype)
    assert_lse_match(l1, lse, 40.0)


def _block_store(nb, page, hkv, d, dtype, device, gen):
    """A block store [nb, page, Hkv, D] that is a strided view (every other block of a larger one)."""
    k = _rand(2 * nb, page, hkv, d, dtype=dtype, device=device, gen=gen)[::2]
    v = _rand(2 * nb, page, hkv, d, dtype=dtype, device=device, gen=gen)[1::2]
    return k, v


PAGED_CASES = [  # (Sq, Hq, Hkv, D, dtype, page, per-head table, lens, options)
    (1, 4, 2, 64, torch.float16, 16, False, [150, 33], dict(window_size=(40, -1), alibi="h", num_splits=3)),
    (3, 4, 2, 40, torch.float32, 48, False, [130, 47], dict(causal=True, softcap=3.0, num_splits=2)),
    (1, 6, 2, 32, torch.float16, 256, True, [300, 255], dict(softcap=2.0, alibi="bh", leftpad=[100, 0],
                                                             num_splits=2)),
    (2, 4, 2, 64, torch.float16, 32, True, [100, 64], dict(window_size=(20, 0), num_splits=2)),
]


@pytest.mark.parametrize("sq,hq,hkv,d,dtype,page,per_head,lens,opt", PAGED_CASES)
def test_paged_options_match_reference(device, sq, hq, hkv, d, dtype, page, per_head, lens, opt):
    """Block store (flash-attn's layout) with the options, against the reference, against the same
    pages seen as a row store (bit-equal: same kernel, same tiles) and against the contiguous
    decode kernel on the gathered cache."""
    gen = torch.Generator().manual_seed(page + d)
    b = 2
    per_seq = -(-max(lens) // page) + 1
    nb = b * (hkv if per_head else 1) * per_seq + 2
    kb, vb = _block_store(nb, page, hkv, d, dtype, device, gen)
    scale_in = 3.0 if opt.get("softcap") else 1.0
    if scale_in != 1.0:
        kb = kb * scale_in
    q = _rand(b, sq, hq, d, dtype=dtype, device=device, gen=gen, scale=scale_in)
    perm = torch.randperm(nb, generator=gen)[: b * (hkv if per_head else 1) * per_seq]
    table = perm.view(b, hkv if per_head else 1, per_seq).to(torch.int32).to(device)
    kw = {x: opt[x] for x in ("window_size", "softcap", "causal", "num_splits") if x in opt}
    if "alibi" in opt:
        kw["alibi_slopes"] = (torch.rand(hq, generator=gen) * 0.3 if opt["alibi"] == "h"
                              else torch.rand(b, hq, generator=gen) * 0.3).to(device)
    if "leftpad" in opt:
        kw["cache_leftpad"] = torch.tensor(opt["leftpad"], dtype=torch.int32, device=device)
    ref_kw = {x: kw[x] for x in kw if x != "num_splits"}
    seq = lambda L: L.cpu() if q.is_cuda else L  # noqa: E731
    ref = dict(scale=d ** -0.5, ref=lambda L: paged_decode_attn_ref(q, kb, vb, table, seq(L), page_size=page, **ref_kw))
    # gathered contiguous caches [B, max(lens), Hkv, D] for the baseline and the contiguous kernel
    kc = torch.zeros(b, max(lens), hkv, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    for i, n in enumerate(lens):
        kc[i, :n], vc[i, :n] = paged_gather_ref(kb, vb, table, i, n, page)
    out, lse = _check_kernel(paged_decode_attn_with_lse, q, (kb, vb, table), lens, kw, ref, (kc, vc))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    # the same pages as a row store [nb * page, Hkv, D] with row entries: the same bits
    kr, vr = kb.contiguous().view(nb * page, hkv, d), vb.contiguous().view(nb * page, hkv, d)
    o2, l2 = paged_decode_attn_with_lse(q, kr, vr, table * page, lens_t, page_size=page, **kw)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    # and the contiguous kernel on the gathered cache
    o3, l3 = decode_attn_with_lse(q, kc, vc, lens_t, **kw)
    assert max_err(o3, out) <= 2 * out_tol(o3.float(), o3, dtype)
    assert_lse_match(l3, lse, 40.0)


def test_keys_outside_the_window_are_not_read(device):
    """NaN in every key/value outside all rows' windows (and before the left pad): never loaded,
    so the output is finite and equals the one on a clean cache (a tile outside the window is not
    visited; the tile the window starts in masks its load below the window)."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, s_max, left = 2, 4, 2, 32, 400, 50
    lens = [333, 120]
    q = _rand(b, 1, hq, d, dtype=torch.float16, device=device, gen=gen)
    k = _rand(b, s_max, hkv, d, dtype=torch.float16, device=device, gen=gen)
    v = _rand(b, s_max, hkv, d, dtype=torch.float16, device=device, gen=gen)
    L = torch.tensor(lens, dtype=torch.int32, device=device)
    clean = decode_attn_with_lse(q, k, v, L, window_size=(left, -1), num_splits=3)
    kn, vn = k.clone(), v.clone()
    for i, n in enumerate(lens):
        kn[i, :n - 1 - left] = float("nan")
        vn[i, :n - 1 - left] = float("nan")
        kn[i, n:] = float("nan")
        vn[i, n:] = float("nan")
    dirty = decode_attn_with_lse(q, kn, vn, L, window_size=(left, -1), num_splits=3)
    assert torch.isfinite(dirty[0]).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    # paged: a block store whose blocks outside the window hold NaN
    page = 16
    kb = k[0, :336].reshape(21, page, hkv, d).clone()
    vb = v[0, :336].reshape(21, page, hkv, d).clone()
    kb.view(-1, hkv, d)[:lens[0] - 1 - left] = float("nan")
    vb.view(-1, hkv, d)[:lens[0] - 1 - left] = float("nan")
    table = torch.arange(21, dtype=torch.int32, device=device).view(1, 1, 21)
    o, l = paged_decode_attn_with_lse(q[:1], kb, vb, table, L[:1], window_size=(left, -1), num_splits=3)
    assert torch.isfinite(o).all()
    assert max_err(o, clean[0][:1]) <= 2 * torch.finfo(torch.float16).eps * 4


def test_split_count_follows_the_window():
    """The default split count sizes the splits by the window's width (shapes only), so a window's
    cost and its number of programs do not grow with the cache."""
    q = torch.zeros(1, 1, 32, 128)
    full = decode_options(q)
    win = decode_options(q, window_size=(4096, -1))
    assert full.span(131072, 1) == 131072 and win.span(131072, 1) == 4097
    assert default_num_splits(1, 8, 4, win.span(131072, 1), 132) == 17
    assert default_num_splits(1, 8, 4, full.span(131072, 1), 132) == 128
    assert decode_options(torch.zeros(1, 3, 4, 8), causal=True).has_right
    assert not decode_options(q, causal=True).has_right  # one token: the right bound cuts nothing


def test_check_false_clamps_leftpad_and_batch_idx(device):
    gen = torch.Generator().manual_seed(7)
    q = _rand(2, 1, 4, 32, dtype=torch.float32, device=device, gen=gen)
    k = _rand(3, 64, 2, 32, dtype=torch.float32, device=device, gen=gen)
    v = _rand(3, 64, 2, 32, dtype=torch.float32, device=device, gen=gen)
    L = torch.tensor([40, 9], dtype=torch.int32, device=device)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    a = decode_attn_with_lse(q, k, v, L, cache_leftpad=t([100, -5]), cache_batch_idx=t([7, -1]), check=False)
    c = decode_attn_with_lse(q, k, v, L, cache_leftpad=t([40, 0]), cache_batch_idx=t([2, 0]))
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert torch.isneginf(a[1][0]).all()  # a left pad at the length: no key


def test_reference_backend_options_cpu():
    """The CPU path without the interpreter runs the reference with the same options."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 2, 4, 16, generator=gen)
    k = torch.randn(2, 30, 2, 16, generator=gen)
    v = torch.randn(2, 30, 2, 16, generator=gen)
    L = torch.tensor([30, 11], dtype=torch.int32)
    kw = dict(causal=True, window_size=(6, -1), softcap=2.0, alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]),
              cache_leftpad=torch.tensor([2, 0], dtype=torch.int32))
    with cpu_backend("reference"):
        o, l = decode_attn_with_lse(q, k, v, L, **kw)
    ro, rl = decode_attention_ref(q, k, v, L, **kw)
    assert max_err(o, ro) < 1e-6 and max_err(l, rl) < 1e-6


# ------------------------------------------------------------------------------------ bad inputs
def test_bad_option_values_raise():
    q = torch.randn(2, 1, 4, 32).half()
    k = torch.randn(2, 40, 2, 32).half()
    L = torch.tensor([10, 40], dtype=torch.int32)
    f = lambda **kw: decode_attn_with_lse(q, k, k, L, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"window_size left must be >= -1 .*got -2"):
        f(window_size=(-2, -1))
    with pytest.raises(ValueError, match=r"window_size right must be >= -1 .*got -5"):
        f(window_size=(3, -5))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        f(window_size=(3,))
    with pytest.raises(TypeError, match=r"window_size\[0\] \(left\) must be an int, got float 1.5"):
        f(window_size=(1.5, 0))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0.*-1.0"):
        f(softcap=-1.0)
    with pytest.raises(ValueError, match="softcap.*nan"):
        f(softcap=float("nan"))
    with pytest.raises(TypeError, match="softcap must be a float, got str"):
        f(softcap="30")
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[Hq\] = \[4\] or \[B, Hq\] = \[2, 4\], got \(5,\)"):
        f(alibi_slopes=torch.ones(5))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape.*got \(3, 4\)"):
        f(alibi_slopes=torch.ones(3, 4))
    with pytest.raises(TypeError, match="alibi_slopes must be fp32.*float16"):
        f(alibi_slopes=torch.ones(4).half())
    with pytest.raises(TypeError, match="causal must be a bool"):
        f(causal="yes")
    with pytest.raises(TypeError, match="cache_leftpad must be int32"):
        f(cache_leftpad=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = 11 must be in \[0, cache_seqlens\[0\] = 10\]"):
        f(cache_leftpad=torch.tensor([11, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 2 is outside \[0, B_cache=2\)"):
        f(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))


def test_bad_paged_values_raise():
    q = torch.randn(2, 1, 4, 32).half()
    kb = torch.randn(4, 16, 2, 32).half()
    t = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int32)
    L = torch.tensor([20, 32], dtype=torch.int32)
    f = paged_decode_attn_with_lse
    with pytest.raises(ValueError, match=r"k_pages has pages of 40 tokens.*multiple of 16"):
        f(q, torch.randn(4, 40, 2, 32).half(), torch.randn(4, 40, 2, 32).half(), t, L)
    with pytest.raises(ValueError, match=r"page_size=32 but the block store k_pages \(4, 16, 2, 32\) has pages of 16"):
        f(q, kb, kb, t, L, page_size=32)
    with pytest.raises(ValueError, match=r"page_size must be a positive multiple of 16.*got 24"):
        f(q, kb.view(64, 2, 32), kb.view(64, 2, 32), t * 16, L, page_size=24)
    with pytest.raises(ValueError, match=r"page_size must be a positive multiple of 16.*got None"):
        f(q, kb.view(64, 2, 32), kb.view(64, 2, 32), t * 16, L)
    bad = t.clone()
    bad[1, 0, 1] = 4  # block 4 of a 4-block store: past the cache
    with pytest.raises(ValueError, match=r"entries of visited pages must be in \[0, num_blocks - 1 = 3\].*max 4"):
        f(q, kb, kb, bad, L)
    bad[1, 0, 1] = -1
    with pytest.raises(ValueError, match=r"entries of visited pages must be in \[0, num_blocks - 1 = 3\].*min -1"):
        f(q, kb, kb, bad, L)
    with pytest.raises(ValueError, match=r"seqlens must be in \[0, P\*page_size=32\].*max 33"):
        f(q, kb, kb, t, torch.tensor([20, 33], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 40 must be in \[0, seqlens\[1\] = 32\]"):
        f(q, kb, kb, t, L, cache_leftpad=torch.tensor([0, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        f(q, kb, kb, t, L, window_size=(-3, 0))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        f(q, kb, kb, t, L, softcap=-2.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape"):
        f(q, kb, kb, t, L, alibi_slopes=torch.ones(2, 2))
    # check=False: a block past the store is clamped to the last block instead of read
    bad[1, 0, 1] = 9
    a = f(q, kb, kb, bad, L, check=False)
    c = f(q, kb, kb, bad.clamp(0, 3), L)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [  # (Sq, Hq, Hkv, D, dtype, page or None, options)
    (1, 32, 8, 128, torch.bfloat16, None, dict(window_size=(4096, -1))),
    (1, 32, 8, 128, torch.bfloat16, 16, dict(window_size=(4096, -1), softcap=30.0)),
    (1, 16, 8, 256, torch.bfloat16, 256, dict(softcap=50.0, alibi="h")),
    (4, 28, 4, 128, torch.float16, 256, dict(causal=True, alibi="bh")),
    (1, 9, 3, 64, torch.bfloat16, None, dict(alibi="bh", leftpad=True)),
    (6, 32, 8, 128, torch.bfloat16, 1024, dict(causal=True, window_size=(1000, -1), softcap=20.0)),
    (3, 12, 2, 96, torch.bfloat16, 48, dict(window_size=(300, 2))),
]


@pytest.mark.cuda
@pytest.mark.parametrize("sq,hq,hkv,d,dtype,page,opt", GPU_CASES)
def test_options_gpu(sq, hq, hkv, d, dtype, page, opt):
    _options_case("cuda", sq, hq, hkv, d, dtype, page, opt, [20000, 3001])


def _options_case(dev, sq, hq, hkv, d, dtype, page, opt, lens):
    gen = torch.Generator().manual_seed(hq + d)
    b = 2
    q = _rand(b, sq, hq, d, dtype=dtype, device=dev, gen=gen)
    kw = {x: opt[x] for x in ("window_size", "softcap", "causal") if x in opt}
    if "alibi" in opt:
        kw["alibi_slopes"] = (torch.rand(hq, generator=gen) * 0.3 if opt["alibi"] == "h"
                              else torch.rand(b, hq, generator=gen) * 0.3).to(dev)
    if opt.get("leftpad"):
        kw["cache_leftpad"] = torch.tensor([1234, 0], dtype=torch.int32, device=dev)
    if page is None:
        k = _rand(b, max(lens) + 7, hkv, d, dtype=dtype, device=dev, gen=gen)
        v = _rand(b, max(lens) + 7, hkv, d, dtype=dtype, device=dev, gen=gen)
        ref = dict(scale=d ** -0.5, ref=lambda L: decode_attention_ref(q, k, v, L.cpu(), **kw))
        _check_kernel(decode_attn_with_lse, q, (k, v), lens, kw, ref, (k, v))
        return
    per_seq = -(-max(lens) // page)
    nb = b * per_seq + 3
    kb, vb = _block_store(nb, page, hkv, d, dtype, dev, gen)
    table = torch.randperm(nb, generator=gen)[: b * per_seq].view(b, 1, per_seq).to(torch.int32).to(dev)
    kc = torch.zeros(b, max(lens), hkv, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    for i, n in enumerate(lens):
        kc[i, :n], vc[i, :n] = paged_gather_ref(kb, vb, table, i, n, page)
    ref = dict(scale=d ** -0.5, ref=lambda L: decode_attention_ref(q, kc, vc, L.cpu(), **kw))
    _check_kernel(paged_decode_attn_with_lse, q, (kb, vb, table), lens, kw, ref, (kc, vc))
