"""flash-attn's inference options in the prefill kernel: ``window_size``, ``softcap``,
``alibi_slopes``, ``block_table`` (paged K/V), ``seqused_k``; alone, combined, with GQA, varlen and
bottom-right causal, against the fp32 reference of each formula (``xoffload.kernels.reference``,
itself checked against loop-level definitions here).

Tolerance rule (flash-attn's, tests/helpers.py): the kernel's error against the fp32 reference is
at most twice that of the same computation done by PyTorch in the input dtype
(``helpers.attention_in_dtype``), plus
a few ulps of the output dtype. On the CPU the Triton code runs under the interpreter (fp16/fp32,
small shapes); ``@pytest.mark.cuda`` tests run bf16 and larger shapes on a GPU.
"""
import contextlib
import math
import random

import pytest
import torch
import triton
import triton.language as tl

from helpers import assert_lse_match, attention_in_dtype, max_err, out_tol
from xoffload.kernels import (
    cpu_backend, flash_attn_varlen_with_lse, flash_attn_with_lse, launch_override, merge_attention_states,
)
from xoffload.kernels.flash_attn import _PLAIN, _normalise_options, _window_tile_bounds, window_tile_bounds
from xoffload.kernels.reference import (
    alibi_bias, attention_ref, masked_attention_ref, paged_kv_ref, varlen_attention_ref, window_mask,
)


def _rand(shape, dtype, device, scale=1.0, gen=None):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def _slopes(shape, device, seed=0):
    """ALiBi-like slopes (geometric, 2^-1 .. 2^-8), fp32, permuted per batch row."""
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
    if len(shape) == 1:
        return base.to(device)
    return torch.stack([base[torch.randperm(h, generator=g)] for _ in range(shape[0])]).to(device)


# ---------------------------------------------------------------------------------------------
# the PyTorch in-dtype baseline (whose error sets the tolerance) and the check of one call
# ---------------------------------------------------------------------------------------------

def _keys(k, v, b, n, block_table, start=0):
    if block_table is not None:
        return paged_kv_ref(k, block_table[b], n), paged_kv_ref(v, block_table[b], n)
    return k[start:start + n], v[start:start + n]


def _seq_base(q, k, v, *, causal, window_size, softcap, slopes, scale):
    sq, sk = q.shape[0], k.shape[0]
    allowed = None
    if causal or tuple(window_size) != (-1, -1):
        allowed = window_mask(sq, sk, window_size, causal, q.device)
    bias = alibi_bias(slopes, sq, sk) if slopes is not None else None
    return attention_in_dtype(q, k, v, allowed, scale, softcap, bias)


def check_options(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  block_table=None, seqused_k=None, softmax_scale=None):
    """Run the padded kernel with options; compare out / lse with the fp32 reference under the
    in-dtype tolerance; rows that see no key must give exactly 0 and -inf."""
    kw = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              block_table=block_table, seqused_k=seqused_k, softmax_scale=softmax_scale)
    b, sq, hq, d = q.shape
    out, lse = flash_attn_with_lse(q, k, v, **kw)
    assert out.shape == (b, sq, hq, d) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    ref_o, ref_l = attention_ref(q, k, v, **kw)
    scale = softmax_scale or 1.0 / math.sqrt(d)
    sk = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[1]
    lens = seqused_k.tolist() if seqused_k is not None else [sk] * b
    tol = 0.0
    for i in range(b):
        ki, vi = _keys(k if block_table is not None else k[i], v if block_table is not None else v[i],
                       i, lens[i], block_table)
        slopes = None if alibi_slopes is None else (alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes)
        base = _seq_base(q[i], ki, vi, causal=causal, window_size=window_size, softcap=softcap, slopes=slopes,
                         scale=scale)
        tol = max(tol, out_tol(ref_o[i], base, q.dtype))
    assert not torch.isnan(out).any(), "NaN in output"
    err = max_err(out, ref_o)
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    empty = torch.isneginf(ref_l)
    if empty.any():
        assert (out.float().transpose(1, 2)[empty.to(out.device)] == 0).all()
    return out, lse, ref_o, ref_l


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def check_varlen_options(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    out, lse = flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    ref_o, ref_l = varlen_attention_ref(q, k, v, cu_q, cu_k, **kw)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    bt, used, al = kw.get("block_table"), kw.get("seqused_k"), kw.get("alibi_slopes")
    scale = kw.get("softmax_scale") or 1.0 / math.sqrt(q.shape[-1])
    tol = 0.0
    for i in range(len(cq) - 1):
        n = ck[i + 1] - ck[i] if used is None else int(used[i])
        ki, vi = _keys(k, v, i, n, bt, start=ck[i])
        slopes = None if al is None else (al[i] if al.dim() == 2 else al)
        base = _seq_base(q[cq[i]:cq[i + 1]], ki, vi, causal=kw.get("causal", False),
                         window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                         slopes=slopes, scale=scale)
        tol = max(tol, out_tol(ref_o[cq[i]:cq[i + 1]], base, q.dtype))
    err = max_err(out, ref_o)
    assert err <= tol, f"varlen output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    assert not torch.isnan(out).any()
    return out, lse


def _paged(k, v, page_size, gen, extra_pages=3):
    """Scatter padded k/v ``[B, Sk, Hkv, D]`` into a shuffled paged cache; returns (k_cache, v_cache,
    block_table) with ``ceil(Sk / page_size) + 1`` table entries per sequence (the last unused)."""
    b, sk, hkv, d = k.shape
    per = -(-sk // page_size) + 1
    n = b * per + extra_pages
    kc = torch.randn(n, page_size, hkv, d, generator=gen).to(k.dtype).to(k.device)  # garbage in unused rows
    vc = torch.randn(n, page_size, hkv, d, generator=gen).to(k.dtype).to(k.device)
    table = torch.randperm(n, generator=gen)[: b * per].view(b, per).to(torch.int32)
    for i in range(b):
        for t0 in range(0, sk, page_size):
            t1 = min(t0 + page_size, sk)
            kc[int(table[i, t0 // page_size]), : t1 - t0] = k[i, t0:t1]
            vc[int(table[i, t0 // page_size]), : t1 - t0] = v[i, t0:t1]
    return kc, vc, table.to(k.device)


# ---------------------------------------------------------------------------------------------
# the references against loop-level definitions of each formula
# ---------------------------------------------------------------------------------------------

def test_reference_formulas():
    sq, sk = 5, 9
    for (left, right), causal in [((2, 1), False), ((-1, 3), False), ((1, -1), True), ((0, 0), False),
                                  ((3, 5), True)]:
        m = window_mask(sq, sk, (left, right), causal)
        r = 0 if causal else right
        for i in range(sq):
            for j in range(sk):
                pos = i + sk - sq
                want = (left < 0 or j >= pos - left) and (r < 0 or j <= pos + r)
                assert bool(m[i, j]) == want, (left, right, causal, i, j)
    slopes = torch.tensor([0.5, 0.125])
    bias = alibi_bias(slopes, sq, sk)
    for h in range(2):
        for i in range(sq):
            for j in range(sk):
                assert float(bias[h, i, j]) == -float(slopes[h]) * abs(i + sk - sq - j)
    cache = torch.arange(4 * 16 * 1 * 2, dtype=torch.float32).view(4, 16, 1, 2)
    row = torch.tensor([2, 0, 3])
    got = paged_kv_ref(cache, row, 35)
    for t in range(35):
        assert torch.equal(got[t], cache[int(row[t // 16]), t % 16])
    # softcap and bias enter the scores before the mask and the softmax
    q, k, v = torch.randn(3, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    o, l = masked_attention_ref(q, k, v, None, 0.5, softcap=2.0, bias=bias[:, :3, :4])
    s = torch.einsum("qhd,khd->hqk", q, k.expand(4, 2, 8)) * 0.5
    s = 2.0 * torch.tanh(s / 2.0) + bias[:, :3, :4]
    assert torch.allclose(l, torch.logsumexp(s, -1), atol=1e-6)
    assert torch.allclose(o, torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.expand(4, 2, 8)), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# each option alone
# ---------------------------------------------------------------------------------------------

_WINDOW_CASES = [
    # b, sq, sk, hq, hkv, d, causal, window, dtype
    (1, 70, 70, 4, 2, 64, True, (16, -1), torch.float16),     # Mistral-style causal sliding window
    (2, 33, 100, 6, 2, 80, False, (20, 5), torch.float16),    # both sides, Sq < Sk, D=80 padded
    (1, 100, 40, 4, 1, 64, False, (-1, 7), torch.float16),    # Sq > Sk: rows 0..52 see no key
    (1, 64, 130, 4, 4, 64, False, (0, 0), torch.float32),     # the diagonal only
    (1, 50, 50, 4, 2, 64, True, (200, -1), torch.float16),    # window wider than Sk: plain causal
    (1, 97, 161, 8, 2, 96, True, (40, 3), torch.float16),     # causal forces right = 0
    (1, 40, 200, 4, 2, 64, False, (5, -1), torch.float16),    # left bound only
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,window,dtype", _WINDOW_CASES)
def test_window(device, b, sq, sk, hq, hkv, d, causal, window, dtype):
    g = torch.Generator().manual_seed(sq + sk + d)
    q, k, v = (_rand((b, s, h, d), dtype, device, gen=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    check_options(q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("cfg", [None, (16, 16, 4, 1), (64, 16, 4, 1), (32, 64, 4, 1)])
@pytest.mark.parametrize("sq,sk,causal,window,alibi,paged", [
    (150, 260, True, (40, -1), False, False),    # left edge and diagonal both masked, interior between
    (150, 260, True, (3, -1), False, False),     # a window narrower than a tile: no interior
    (200, 90, False, (-1, 7), False, False),     # Sq > Sk, right bound only: rows with no key
    (130, 200, False, (30, 20), True, False),    # both bounds, ALiBi's tile classes between the edges
    (97, 161, True, (-1, -1), True, False),      # causal ALiBi: the diagonal edge only
    (120, 250, True, (60, -1), False, True),     # pages of 16 through the block table
])
def test_masked_edges_in_one_loop_equal_two_loops(device, monkeypatch, cfg, sq, sk, causal, window, alibi, paged):
    """Both masked edges of a query block walked in one loop (windows, ALiBi: the default) and in
    two (the masked left edge first, the right edge last): within rounding of each other (only the
    order of the online softmax's tiles differs) and each within the reference's tolerance."""
    import xoffload.kernels.flash_attn as fa

    g = torch.Generator().manual_seed(sq + sk)
    q = _rand((2, sq, 4, 64), torch.float16, device, gen=g)
    k, v = (_rand((2, sk, 2, 64), torch.float16, device, gen=g) for _ in range(2))
    kw = dict(causal=causal, window_size=window, alibi_slopes=_slopes((4,), device) if alibi else None)
    if paged:
        k, v, table = _paged(k, v, 16, g)
        kw.update(block_table=table, seqused_k=torch.tensor([sk, sk - 29], dtype=torch.int32, device=device))
    outs = []
    for one_loop in (True, False):
        monkeypatch.setattr(fa, "_edges_one_loop", lambda opts, _v=one_loop: _v)
        with (launch_override("flash_attn", cfg) if cfg else contextlib.nullcontext()):
            outs.append(check_options(q, k, v, **kw)[:2])
    (o1, l1), (o2, l2) = outs
    assert max_err(o1, o2) <= 4 * torch.finfo(torch.float16).eps * max(1.0, float(o2.float().abs().max()))
    assert_lse_match(l1, l2.cpu())


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,cap,dtype", [
    (1, 70, 90, 4, 2, 64, False, 5.0, torch.float16),
    (2, 50, 50, 6, 3, 80, True, 30.0, torch.float16),
    (1, 33, 70, 4, 4, 64, True, 2.0, torch.float32),
])
def test_softcap(device, b, sq, sk, hq, hkv, d, causal, cap, dtype):
    """Inputs scaled by 3 so that many scores are capped (|s| up to ~30)."""
    g = torch.Generator().manual_seed(int(cap))
    q = _rand((b, sq, hq, d), dtype, device, 3.0, g)
    k = _rand((b, sk, hkv, d), dtype, device, 1.0, g)
    v = _rand((b, sk, hkv, d), dtype, device, 1.0, g)
    out, lse, _, _ = check_options(q, k, v, causal=causal, softcap=cap)
    plain, plain_lse = flash_attn_with_lse(q, k, v, causal=causal)
    assert max_err(out, plain) > 1e-2  # the cap changes the answer


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,per_batch,dtype", [
    (1, 64, 100, 4, 2, 64, True, False, torch.float16),
    (2, 40, 70, 6, 2, 80, False, True, torch.float16),
    (1, 90, 50, 4, 1, 64, True, False, torch.float32),   # Sq > Sk
])
def test_alibi(device, b, sq, sk, hq, hkv, d, causal, per_batch, dtype):
    g = torch.Generator().manual_seed(sq)
    q, k, v = (_rand((b, s, h, d), dtype, device, gen=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    slopes = _slopes((b, hq) if per_batch else (hq,), device)
    check_options(q, k, v, causal=causal, alibi_slopes=slopes)


def test_seqused_k(device):
    """Padded K with fewer used keys per item (0 included): bottom-right aligned to the used length."""
    g = torch.Generator().manual_seed(3)
    q = _rand((3, 20, 4, 64), torch.float16, device, gen=g)
    k = _rand((3, 90, 2, 64), torch.float16, device, gen=g)
    v = _rand((3, 90, 2, 64), torch.float16, device, gen=g)
    used = torch.tensor([90, 37, 0], dtype=torch.int32, device=device)
    check_options(q, k, v, causal=True, seqused_k=used)
    out, lse, _, _ = check_options(q, k, v, seqused_k=used, window_size=(8, 2))
    # item 1 equals the call on its first 37 keys alone
    o1, l1 = flash_attn_with_lse(q[1:2], k[1:2, :37], v[1:2, :37], window_size=(8, 2))
    assert max_err(out[1:2], o1) <= 1e-3 and max_err(lse[1:2], l1) <= 1e-5
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.parametrize("page,sq,sk,causal,window", [
    (16, 40, 100, True, (-1, -1)),      # pages smaller than a tile: one table entry per key
    (256, 24, 300, False, (-1, -1)),    # a tile inside one page: one entry per tile
    (48, 30, 130, True, (20, -1)),      # a multiple of 16 that is no power of two
    (1024, 16, 1100, True, (64, -1)),   # the runtime pool's block size
])
def test_paged(device, page, sq, sk, causal, window):
    g = torch.Generator().manual_seed(page)
    q = _rand((2, sq, 4, 64), torch.float16, device, gen=g)
    k = _rand((2, sk, 2, 64), torch.float16, device, gen=g)
    v = _rand((2, sk, 2, 64), torch.float16, device, gen=g)
    kc, vc, table = _paged(k, v, page, g)
    used = torch.tensor([sk, sk - 29], dtype=torch.int32, device=device)
    out, lse, _, _ = check_options(q, kc, vc, causal=causal, window_size=window, block_table=table, seqused_k=used)
    # the same keys as a contiguous call
    o0, l0 = flash_attn_with_lse(q[:1], k[:1], v[:1], causal=causal, window_size=window)
    assert max_err(out[:1], o0) <= 1e-3 and max_err(lse[:1], l0) <= 1e-5


def test_paged_without_seqused_uses_whole_table(device):
    """No seqused_k: every sequence has max_pages_per_seq * page_size keys (flash-attn's rule)."""
    g = torch.Generator().manual_seed(5)
    q = _rand((2, 10, 2, 32), torch.float16, device, gen=g)
    kc = _rand((5, 16, 1, 32), torch.float16, device, gen=g)
    vc = _rand((5, 16, 1, 32), torch.float16, device, gen=g)
    table = torch.tensor([[4, 0, 2], [1, 3, 4]], dtype=torch.int32, device=device)
    check_options(q, kc, vc, causal=True, block_table=table)


# ---------------------------------------------------------------------------------------------
# combinations
# ---------------------------------------------------------------------------------------------

def test_window_causal_softcap_alibi_gqa(device):
    g = torch.Generator().manual_seed(11)
    q = _rand((2, 77, 9, 64), torch.float16, device, 2.0, g)
    k = _rand((2, 145, 3, 64), torch.float16, device, 1.0, g)
    v = _rand((2, 145, 3, 64), torch.float16, device, 1.0, g)
    check_options(q, k, v, causal=True, window_size=(50, -1), softcap=10.0, alibi_slopes=_slopes((2, 9), device))


def test_softcap_alibi_noncausal_window_fp32(device):
    g = torch.Generator().manual_seed(12)
    q = _rand((1, 45, 4, 80), torch.float32, device, 2.0, g)
    k = _rand((1, 61, 2, 80), torch.float32, device, 1.0, g)
    v = _rand((1, 61, 2, 80), torch.float32, device, 1.0, g)
    check_options(q, k, v, window_size=(13, 9), softcap=4.0, alibi_slopes=_slopes((4,), device),
                  softmax_scale=0.2)


def test_paged_window_softcap_alibi(device):
    g = torch.Generator().manual_seed(13)
    q = _rand((2, 50, 6, 64), torch.float16, device, gen=g)
    k = _rand((2, 170, 2, 64), torch.float16, device, gen=g)
    v = _rand((2, 170, 2, 64), torch.float16, device, gen=g)
    kc, vc, table = _paged(k, v, 16, g)
    used = torch.tensor([170, 81], dtype=torch.int32, device=device)
    check_options(q, kc, vc, causal=True, window_size=(33, -1), softcap=8.0, alibi_slopes=_slopes((6,), device),
                  block_table=table, seqused_k=used)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_window_softcap_alibi(device, causal):
    # an empty query sequence, an empty key sequence, Sq_b > Sk_b
    lq, lk = [1, 50, 70, 0, 20], [1, 50, 130, 5, 0]
    g = torch.Generator().manual_seed(14)
    q = _rand((sum(lq), 6, 64), torch.float16, device, 2.0, g)
    k = _rand((sum(lk), 2, 64), torch.float16, device, 1.0, g)
    v = _rand((sum(lk), 2, 64), torch.float16, device, 1.0, g)
    check_varlen_options(q, k, v, _cu(lq, device), _cu(lk, device), max(lq), max(lk), causal=causal,
                         window_size=(17, 4), softcap=6.0, alibi_slopes=_slopes((5, 6), device))


def test_varlen_paged_seqused(device):
    lq, lk = [1, 40, 70, 3], [1, 50, 130, 5]
    g = torch.Generator().manual_seed(15)
    q = _rand((sum(lq), 4, 64), torch.float16, device, gen=g)
    per = -(-max(lk) // 32) + 1
    kc = _rand((4 * per, 32, 2, 64), torch.float16, device, gen=g)
    vc = _rand((4 * per, 32, 2, 64), torch.float16, device, gen=g)
    table = torch.randperm(4 * per, generator=g).view(4, per).to(torch.int32).to(device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    check_varlen_options(q, kc, vc, cu_q, cu_k, max(lq), max(lk), causal=True, block_table=table)
    used = torch.tensor([1, 20, 100, 0], dtype=torch.int32, device=device)
    check_varlen_options(q, kc, vc, cu_q, cu_k, max(lq), max(lk), causal=True, block_table=table,
                         seqused_k=used, window_size=(24, -1), alibi_slopes=_slopes((4,), device))


@pytest.mark.parametrize("cfg", [(32, 64, 4, 1), (16, 16, 4, 1), (64, 64, 4, 3), (128, 64, 4, 3)])
def test_options_other_block_shapes(device, cfg):
    """BLOCK_M < BLOCK_N and tiny tiles: the window's edge and interior loops, one table entry per
    key (pages of 16 < BLOCK_N = 64) and one per tile (BLOCK_N = 16); and GPU option tiles (64x64
    for a window with ALiBi at D <= 64, 128x64 for ALiBi at D <= 64: _gpu_config), which the
    interpreter's 64x32 default never runs."""
    g = torch.Generator().manual_seed(cfg[1])
    q = _rand((1, 50, 4, 80), torch.float16, device, 2.0, g)
    k = _rand((1, 111, 2, 80), torch.float16, device, 1.0, g)
    v = _rand((1, 111, 2, 80), torch.float16, device, 1.0, g)
    kc, vc, table = _paged(k, v, 16, g)
    used = torch.tensor([111], dtype=torch.int32, device=device)
    with launch_override("flash_attn", cfg):
        check_options(q, kc, vc, causal=True, window_size=(37, -1), softcap=7.0, alibi_slopes=_slopes((4,), device),
                      block_table=table, seqused_k=used)
        check_options(q, k, v, window_size=(9, 21))


def test_cpu_reference_path_takes_the_options():
    """Without the interpreter CPU tensors run the fp32 reference with the same options (and the
    same answer as the kernel within tolerance)."""
    g = torch.Generator().manual_seed(16)
    q = _rand((2, 30, 4, 64), torch.float16, "cpu", 2.0, g)
    k = _rand((2, 70, 2, 64), torch.float16, "cpu", 1.0, g)
    v = _rand((2, 70, 2, 64), torch.float16, "cpu", 1.0, g)
    kc, vc, table = _paged(k, v, 16, g)
    kw = dict(causal=True, window_size=(20, -1), softcap=5.0, alibi_slopes=_slopes((4,), "cpu"),
              block_table=table, seqused_k=torch.tensor([70, 45], dtype=torch.int32))
    with cpu_backend("reference"):
        ro, rl = flash_attn_with_lse(q, kc, vc, **kw)
    want_o, want_l = attention_ref(q, kc, vc, **kw)
    assert ro.dtype == torch.float16 and torch.equal(ro, want_o.half()) and torch.equal(rl, want_l)
    lens = [1, 29, 0]
    cu = _cu(lens, "cpu")
    with cpu_backend("reference"):
        vo, vl = flash_attn_varlen_with_lse(q[0], k[0, :30], v[0, :30], cu, cu, 29, 29, window_size=(5, 5),
                                            softcap=3.0)
    want_o, want_l = varlen_attention_ref(q[0], k[0, :30], v[0, :30], cu, cu, window_size=(5, 5), softcap=3.0)
    assert torch.equal(vo, want_o.half()) and torch.equal(vl, want_l)


# ---------------------------------------------------------------------------------------------
# merge compatibility: partial states over disjoint key sets merge into the whole
# ---------------------------------------------------------------------------------------------

def _assert_merged(o_a, l_a, o_b, l_b, o_w, l_w):
    o_m, l_m = merge_attention_states(o_a, l_a, o_b, l_b)
    assert max_err(o_m, o_w) <= 2e-5, max_err(o_m, o_w)
    assert_lse_match(l_m, l_w)


def test_merge_softcap_two_halves(device):
    """Softcap (position-free) over any split of the keys: the two halves merge into the whole."""
    g = torch.Generator().manual_seed(20)
    q = _rand((1, 40, 6, 64), torch.float32, device, 3.0, g)
    k = _rand((1, 96, 2, 64), torch.float32, device, 1.0, g)
    v = _rand((1, 96, 2, 64), torch.float32, device, 1.0, g)
    o_w, l_w = flash_attn_with_lse(q, k, v, softcap=5.0)
    o_a, l_a = flash_attn_with_lse(q, k[:, :48], v[:, :48], softcap=5.0)
    o_b, l_b = flash_attn_with_lse(q, k[:, 48:], v[:, 48:], softcap=5.0)
    _assert_merged(o_a, l_a, o_b, l_b, o_w, l_w)
    ref_o, ref_l = attention_ref(q, k, v, softcap=5.0)
    assert max_err(o_w, ref_o) <= 2e-5
    assert_lse_match(l_w, ref_l)


def test_merge_chunked_prefill_window_softcap(device):
    """Causal sliding window: the last Sq tokens attend to a cached prefix and to themselves. The
    prefix call uses the window shifted by Sq (it sees its Sk - Sq keys with Sq fewer rows of
    offset): left - Sq on the left, Sq on the right; merged with the causal call on the chunk's own
    keys it gives the whole windowed call."""
    g = torch.Generator().manual_seed(21)
    sq, sk, left = 32, 100, 45
    q = _rand((1, sq, 4, 64), torch.float32, device, 2.0, g)
    k = _rand((1, sk, 2, 64), torch.float32, device, 1.0, g)
    v = _rand((1, sk, 2, 64), torch.float32, device, 1.0, g)
    p = sk - sq
    o_w, l_w = flash_attn_with_lse(q, k, v, causal=True, window_size=(left, -1), softcap=6.0)
    o_a, l_a = flash_attn_with_lse(q, k[:, :p], v[:, :p], window_size=(left - sq, sq), softcap=6.0)
    o_b, l_b = flash_attn_with_lse(q, k[:, p:], v[:, p:], causal=True, window_size=(left, -1), softcap=6.0)
    _assert_merged(o_a, l_a, o_b, l_b, o_w, l_w)


@pytest.mark.parametrize("paged", [False, True])
def test_merge_split_keys_alibi_window_softcap(device, paged):
    """ALiBi and windows depend on positions, which bottom-right alignment ties to each call's key
    count: keys [p, Sk) with every query row keep the whole call's relative positions, keys
    [0, p) keep them for the first Sq - (Sk - p) rows (dropping c rows from the end of q moves the
    remaining rows c positions right). For those rows the two halves merge into the whole call
    (non-causal two-sided window, so both halves carry weight). Paged: the halves are two slices
    of one block table."""
    g = torch.Generator().manual_seed(22)
    sq, sk, p = 60, 90, 64
    c = sk - p
    kw = dict(window_size=(40, 25), softcap=5.0, alibi_slopes=_slopes((4,), device))
    q = _rand((1, sq, 4, 64), torch.float32, device, 2.0, g)
    k = _rand((1, sk, 2, 64), torch.float32, device, 1.0, g)
    v = _rand((1, sk, 2, 64), torch.float32, device, 1.0, g)
    o_w, l_w = flash_attn_with_lse(q, k, v, **kw)
    if paged:
        page = 16
        kc, vc, table = _paged(k, v, page, g)
        used = lambda n: torch.tensor([n], dtype=torch.int32, device=device)  # noqa: E731
        o_a, l_a = flash_attn_with_lse(q[:, :sq - c], kc, vc, block_table=table[:, :p // page], seqused_k=used(p),
                                       **kw)
        o_b, l_b = flash_attn_with_lse(q, kc, vc, block_table=table[:, p // page:], seqused_k=used(sk - p), **kw)
    else:
        o_a, l_a = flash_attn_with_lse(q[:, :sq - c], k[:, :p], v[:, :p], **kw)
        o_b, l_b = flash_attn_with_lse(q, k[:, p:], v[:, p:], **kw)
    o_b, l_b = o_b[:, :sq - c], l_b[:, :, :sq - c]
    assert torch.isfinite(l_a).all() and torch.isfinite(l_b).any()  # both halves carry weight
    _assert_merged(o_a, l_a, o_b, l_b, o_w[:, :sq - c], l_w[:, :, :sq - c])


# ---------------------------------------------------------------------------------------------
# window tile skipping: the kernel's loop bounds
# ---------------------------------------------------------------------------------------------

@triton.jit
def _probe_bounds(OUT, seqlen_q, seqlen_k, win_left, win_right, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = _window_tile_bounds(pid * BLOCK_M, seqlen_q, seqlen_k, seqlen_k - seqlen_q,
                                                   win_left, win_right, CAUSAL, HAS_LEFT, HAS_RIGHT,
                                                   BLOCK_M, BLOCK_N)
    tl.store(OUT + pid * 4 + 0, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


def _bounds_cases(n, seed=0):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        sq, sk = rng.choice([1, 7, 64, 100, 257]), rng.choice([0, 1, 33, 64, 200, 513])
        causal = rng.random() < 0.5
        w = (rng.choice([-1, 0, 3, 31, 64, 150, 1000]), rng.choice([-1, 0, 5, 40, 300]))
        bm, bn = rng.choice([(64, 32), (32, 64), (16, 16), (128, 64)])
        cases.append((sq, sk, causal, w, bm, bn))
    return cases


def test_window_tile_bounds_cover_exactly_the_window():
    """Brute force over random shapes: the visited span holds every visible key of the block, the
    unmasked tiles only keys every (real) row sees, and the span exceeds the block's window by
    less than a tile on each side."""
    for sq, sk, causal, w, bm, bn in _bounds_cases(120):
        mask = window_mask(sq, sk, w, causal)
        for m0 in range(0, sq, bm):
            lo, full_lo, full_hi, hi = window_tile_bounds(m0, bm, bn, sq, sk, causal=causal, window_size=w)
            rows = mask[m0:m0 + bm]
            seen = rows.any(0).nonzero().flatten()
            assert lo % bn == 0 and (full_lo % bn == 0 or full_lo == hi) and (full_hi % bn == 0 or full_hi == full_lo)
            assert lo <= full_lo <= full_hi <= max(hi, full_hi) and full_hi <= sk
            if seen.numel():
                assert lo <= int(seen[0]) and int(seen[-1]) + 1 == hi, (sq, sk, causal, w, bm, bn, m0)
                assert int(seen[0]) - lo < bn + bm  # at most one tile before the block's window
            assert bool(rows[:, full_lo:full_hi].all()), (sq, sk, causal, w, bm, bn, m0)


def test_window_tile_bounds_python_mirror_equals_kernel(device):
    """The Python helper and the kernel's jit function give the same bounds."""
    for sq, sk, causal, w, bm, bn in _bounds_cases(24, seed=1):
        o = _normalise_options(causal, w, 0.0, None, None, None, batch=1, hq=1, device="cpu", max_q=sq, max_k=sk)
        flags = o.flags()
        nb = -(-sq // bm)
        out = torch.empty(nb * 4, dtype=torch.int32, device=device)
        _probe_bounds[(nb,)](out, sq, sk, max(o.left, 0), max(o.right, 0), CAUSAL=o.causal,
                             HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"], BLOCK_M=bm, BLOCK_N=bn)
        got = out.view(nb, 4).tolist()
        want = [list(window_tile_bounds(m * bm, bm, bn, sq, sk, causal=causal, window_size=w)) for m in range(nb)]
        assert got == want, (sq, sk, causal, w, bm, bn)


@pytest.mark.parametrize("tiles", ["plain", "window", "tma"])
def test_window_cost_proportional_to_width(tiles):
    """Keys visited by a 4096-token causal window over 128K tokens with the H200 tiles of D=128
    bf16 (_gpu_config: with pointer loads 128x128 for a plain call, 128x64 for a window; with TMA
    128x64 for both, the tiles it runs in): the window's area plus less than one query block and
    two key tiles per block."""
    from xoffload.kernels.flash_attn import _gpu_config

    cfg = _gpu_config(128, torch.bfloat16, window=tiles != "plain", tma=tiles == "tma")
    s, w, bm, bn = 131072, 4096, cfg.block_m, cfg.block_n
    visited = sum(window_tile_bounds(m0, bm, bn, s, s, causal=True, window_size=(w, 0))[3]
                  - window_tile_bounds(m0, bm, bn, s, s, causal=True, window_size=(w, 0))[0]
                  for m0 in range(0, s, bm))
    causal = sum(window_tile_bounds(m0, bm, bn, s, s, causal=True)[3] for m0 in range(0, s, bm))
    area = s * (w + 1) - w * (w + 1) // 2
    causal_area = s * (s + 1) // 2
    assert visited * bm <= area + s * (bm + 2 * bn)
    ratio = (visited / causal) / (area / causal_area)
    assert ratio < 1.1, ratio  # tiles scheduled / ideal ratio of a causal window to full causal


def test_plain_call_has_no_option_flags():
    """Defaults (and options that change nothing) take the plain kernel: every option flag off."""
    assert not any(_PLAIN.flags().values())
    o = _normalise_options(False, (-1, -1), 0.0, None, None, None, batch=1, hq=1, device="cpu", max_q=9, max_k=9)
    assert o.plain and not any(o.flags().values())
    o = _normalise_options(False, (-1, 0), 0.0, None, None, None, batch=1, hq=1, device="cpu", max_q=9, max_k=9)
    assert o.causal and not any(o.flags().values())  # (-1, 0) is the causal mask
    o = _normalise_options(True, (8, 5), 0.0, None, None, None, batch=1, hq=1, device="cpu", max_q=9, max_k=9)
    assert (o.left, o.right) == (-1, 0) and o.plain  # left >= Sk - 1 reaches every key; causal sets right 0
    o = _normalise_options(True, (7, -1), 0.0, None, None, None, batch=1, hq=1, device="cpu", max_q=9, max_k=9)
    assert o.left == 7 and o.flags()["HAS_LEFT"] and not o.plain


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------

def _qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=32, dtype=torch.float16):
    return (torch.zeros(b, sq, hq, d, dtype=dtype), torch.zeros(b, sk, hkv, d, dtype=dtype),
            torch.zeros(b, sk, hkv, d, dtype=dtype))


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size left must be >= -1 .*got -2"),
    (dict(window_size=(4, -3)), ValueError, r"window_size right must be >= -1 .*got -3"),
    (dict(window_size=4), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(1.5, 0)), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0.*-1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite float"),
    (dict(softcap=True), TypeError, r"softcap must be a float"),
    (dict(alibi_slopes=torch.ones(3)), ValueError,
     r"alibi_slopes must have shape \[Hq\] = \[4\] or \[B, Hq\] = \[2, 4\], got \(3,\)"),
    (dict(alibi_slopes=torch.ones(4, 2)), ValueError, r"alibi_slopes must have shape .*got \(4, 2\)"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError,
     r"alibi_slopes must be float32, got torch.float16"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, r"alibi_slopes is on meta"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be a torch.Tensor"),
    (dict(seqused_k=torch.tensor([8, 9], dtype=torch.int32)), ValueError, r"seqused_k\[1\] = 9 must be in \[0, 8\]"),
    (dict(seqused_k=torch.tensor([8, -1], dtype=torch.int32)), ValueError, r"seqused_k\[1\] = -1"),
    (dict(seqused_k=torch.tensor([8, 8])), TypeError, r"seqused_k must be int32, got torch.int64"),
    (dict(seqused_k=torch.tensor([8], dtype=torch.int32)), ValueError, r"seqused_k must have shape \[B\] = \[2\]"),
    (dict(check=1), TypeError, r"check must be a bool"),
])
def test_bad_options(kw, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        flash_attn_with_lse(q, k, v, **kw)


def _paged_qkv(num_pages=4, page=16, hkv=2, d=32, b=2, sq=8):
    return (torch.zeros(b, sq, 4, d, dtype=torch.float16), torch.zeros(num_pages, page, hkv, d, dtype=torch.float16),
            torch.zeros(num_pages, page, hkv, d, dtype=torch.float16))


@pytest.mark.parametrize("make,exc,pattern", [
    (lambda: (*_paged_qkv(), torch.tensor([[0, 1], [2, 3]])), TypeError, r"block_table must be int32, got torch.int64"),
    (lambda: (*_paged_qkv(), torch.tensor([0, 1], dtype=torch.int32)), ValueError,
     r"block_table must have shape \[B, max_pages_per_seq\] = \[2, P\], got \(2,\)"),
    (lambda: (*_paged_qkv(), torch.zeros(3, 2, dtype=torch.int32)), ValueError, r"got \(3, 2\)"),
    (lambda: (*_paged_qkv(page=24), torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     r"page size \(k.shape\[1\]\) must be a multiple of 16, got 24"),
    (lambda: (*_paged_qkv(page=8), torch.zeros(2, 2, dtype=torch.int32)), ValueError, r"multiple of 16, got 8"),
    (lambda: (*_paged_qkv(), torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)), ValueError,
     r"block_table\[1, 1\] = 4 points past the cache.*\[0, 4\)"),
    (lambda: (*_paged_qkv(), torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)), ValueError,
     r"block_table\[0, 1\] = -1 points past the cache"),
    (lambda: (*_paged_qkv(), [[0, 1], [2, 3]]), TypeError, r"block_table must be a torch.Tensor"),
    (lambda: (torch.zeros(2, 8, 4, 32, dtype=torch.float16), torch.zeros(4, 16, 32, dtype=torch.float16),
              torch.zeros(4, 16, 32, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     r"k must have 4 dims"),
    (lambda: (torch.zeros(2, 8, 4, 32, dtype=torch.float16), torch.zeros(4, 16, 2, 32, dtype=torch.float16),
              torch.zeros(4, 16, 2, 16, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     r"k and v must have the same shape \(\[num_pages, page_size, Hkv, D\]\)"),
    (lambda: (torch.zeros(2, 8, 4, 32, dtype=torch.float16), torch.zeros(0, 16, 2, 32, dtype=torch.float16),
              torch.zeros(0, 16, 2, 32, dtype=torch.float16), torch.zeros(2, 0, dtype=torch.int32)), ValueError,
     r"k has no pages"),
])
def test_bad_paged_inputs(make, exc, pattern):
    q, k, v, table = make()
    with pytest.raises(exc, match=pattern):
        flash_attn_with_lse(q, k, v, block_table=table)


def test_block_table_checks_only_pages_holding_keys():
    """Entries past a sequence's last page are never read: garbage there is fine. With
    check=False nothing is read on the host and the kernel clamps a bad entry into the cache."""
    q, k, v = _paged_qkv()
    table = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)
    used = torch.tensor([20, 16], dtype=torch.int32)
    flash_attn_with_lse(q, k, v, block_table=table, seqused_k=used)  # page 1 of item 1 holds no key
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 99"):
        flash_attn_with_lse(q, k, v, block_table=table, seqused_k=torch.tensor([20, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 33 must be in \[0, 32\]"):
        flash_attn_with_lse(q, k, v, block_table=table, seqused_k=torch.tensor([33, 1], dtype=torch.int32))


def test_check_false_clamps_like_the_reference(device):
    g = torch.Generator().manual_seed(30)
    q = _rand((2, 12, 4, 32), torch.float16, device, gen=g)
    kc = _rand((4, 16, 2, 32), torch.float16, device, gen=g)
    vc = _rand((4, 16, 2, 32), torch.float16, device, gen=g)
    table = torch.tensor([[0, 7], [2, -5]], dtype=torch.int32, device=device)
    used = torch.tensor([40, 30], dtype=torch.int32, device=device)  # 40 > 32 keys: clamped to 32
    out, lse = flash_attn_with_lse(q, kc, vc, causal=True, block_table=table, seqused_k=used, check=False)
    ref_o, ref_l = attention_ref(q, kc, vc, causal=True, block_table=table.clamp(0, 3),
                                 seqused_k=used.clamp(0, 32))
    assert max_err(out, ref_o) <= 2e-3
    assert_lse_match(lse, ref_l)


def test_bad_varlen_options():
    q = torch.zeros(10, 4, 32, dtype=torch.float16)
    kc = torch.zeros(4, 16, 2, 32, dtype=torch.float16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32)  # lengths 20, 30: paged, not tied to k's shape
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    f = flash_attn_varlen_with_lse
    f(q, kc, kc, cu_q, cu_k, 6, 30, block_table=table, window_size=(3, 3))
    with pytest.raises(ValueError, match=r"sequence 1 has 40 keys \(cu_seqlens_k\) but block_table holds 2 pages"):
        f(q, kc, kc, cu_q, torch.tensor([0, 20, 60], dtype=torch.int32), 6, 40, block_table=table)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 31 must be in \[0, 30\]"):
        f(q, kc, kc, cu_q, cu_k, 6, 30, block_table=table, seqused_k=torch.tensor([20, 31], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 9 points past the cache"):
        f(q, kc, kc, cu_q, cu_k, 6, 30, block_table=torch.tensor([[0, 1], [9, 3]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape .*\[B, Hq\] = \[2, 4\]"):
        f(q, kc, kc, cu_q, cu_k, 6, 30, block_table=table, alibi_slopes=torch.ones(3, 4))
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        f(q, q[:, :2], q[:, :2], cu_q, cu_q, 6, 6, window_size=(-5, -1))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        f(q, q[:, :2], q[:, :2], cu_q, cu_q, 6, 6, softcap=-0.5)


# ---------------------------------------------------------------------------------------------
# TMA loads on the option path (LaunchConfig.tma): descriptors per sequence and head, so TMA
# zero-fills what the pointer loads mask; unused keys past seqused_k are never read
# ---------------------------------------------------------------------------------------------

_TMA_CASES = {
    "softcap_causal_gqa": dict(causal=True, softcap=5.0),
    "window_both_sides": dict(window_size=(13, 6)),
    "alibi_noncausal": dict(alibi=True),
    "alibi_window_softcap_causal": dict(causal=True, alibi=True, softcap=8.0, window_size=(20, -1)),
    "seqused_nan_tail": dict(causal=True, softcap=5.0, seqused=True),
    "varlen_window_softcap": dict(varlen=True, softcap=5.0, window_size=(17, 3)),
}


@pytest.mark.parametrize("case", list(_TMA_CASES))
def test_tma_loads_on_the_option_path(device, case):
    """Each option with Q / K / V through tensor descriptors matches the reference with the dtype's
    tolerance and, under the interpreter, the pointer loads in the same tiles bit for bit. With
    ``seqused_k`` the keys past it hold NaN: a descriptor bounded at the used length never reads
    them (a NaN there would reach the output through 0 * NaN)."""
    g = torch.Generator().manual_seed(11)
    opts = dict(_TMA_CASES[case])
    varlen, seqused = opts.pop("varlen", False), opts.pop("seqused", False)
    ptr, tma = (32, 16, 4, 1), (32, 16, 4, 1, True)
    if varlen:
        lens_q, lens_k = [7, 0, 40, 21], [30, 5, 44, 21]
        cq, ck = _cu(lens_q, device), _cu(lens_k, device)
        q = _rand((sum(lens_q), 6, 64), torch.float16, device, gen=g)
        k = _rand((sum(lens_k), 2, 64), torch.float16, device, gen=g)
        v = _rand((sum(lens_k), 2, 64), torch.float16, device, gen=g)
        outs = []
        for cfg in (ptr, tma):
            with launch_override("flash_attn", cfg):
                outs.append(check_varlen_options(q, k, v, cq, ck, max(lens_q), max(lens_k), **opts))
    else:
        b, sq, sk, hq, hkv, d = 2, 45, 70, 6, 2, 64
        q = _rand((b, sq, hq, d), torch.float16, device, gen=g)
        k = _rand((b, sk, hkv, d), torch.float16, device, gen=g)
        v = _rand((b, sk, hkv, d), torch.float16, device, gen=g)
        if opts.pop("alibi", False):
            opts["alibi_slopes"] = _slopes((b, hq), device)
        if seqused:
            used = [70, 29]
            opts["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=device)
            for i, n in enumerate(used):
                k[i, n:] = float("nan")
                v[i, n:] = float("nan")
        outs = []
        for cfg in (ptr, tma):
            with launch_override("flash_attn", cfg):
                outs.append(check_options(q, k, v, **opts)[:2])
    if device == "cpu":
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ---------------------------------------------------------------------------------------------
# GPU (bf16, larger shapes)
# ---------------------------------------------------------------------------------------------

_GPU_OPTION_CASES = [
    # dtype, b, sq, sk, hq, hkv, d, options
    (torch.bfloat16, 1, 2048, 2048, 16, 4, 128, dict(causal=True, window_size=(512, -1))),
    (torch.float16, 2, 1000, 1500, 8, 2, 128, dict(causal=True, window_size=(300, -1))),
    (torch.bfloat16, 1, 1111, 1111, 8, 2, 80, dict(window_size=(200, 57))),
    (torch.bfloat16, 1, 777, 777, 9, 3, 64, dict(causal=True, window_size=(129, -1))),
    (torch.bfloat16, 1, 513, 700, 8, 4, 256, dict(causal=True, window_size=(100, -1))),
    (torch.bfloat16, 1, 2000, 2000, 8, 2, 128, dict(causal=True, softcap=30.0)),
    (torch.float16, 1, 1500, 1500, 8, 2, 128, dict(softcap=50.0)),
    (torch.bfloat16, 1, 1024, 1024, 9, 3, 64, dict(causal=True, softcap=20.0)),
    (torch.bfloat16, 1, 2048, 2048, 8, 2, 128, dict(causal=True, alibi=True)),
    (torch.bfloat16, 2, 1000, 1000, 9, 3, 64, dict(alibi=True)),
    (torch.float16, 1, 700, 1800, 8, 8, 128, dict(causal=True, alibi=True, softcap=30.0, window_size=(600, -1))),
    (torch.float32, 1, 600, 800, 6, 2, 128, dict(causal=True, alibi=True, softcap=10.0, window_size=(200, -1))),
    (torch.float32, 1, 300, 300, 4, 1, 256, dict(window_size=(40, 40), softcap=5.0)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,b,sq,sk,hq,hkv,d,opts", _GPU_OPTION_CASES)
def test_gpu_options(dtype, b, sq, sk, hq, hkv, d, opts):
    torch.manual_seed(0)
    opts = dict(opts)
    scale_in = 2.0 if opts.get("softcap") else 1.0
    q = (torch.randn(b, sq, hq, d, device="cuda") * scale_in).to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = _slopes((b, hq), "cuda")
    check_options(q, k, v, **opts)


@pytest.mark.cuda
@pytest.mark.parametrize("page", [16, 64, 256, 1024])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_gpu_paged(page, dtype, d):
    g = torch.Generator().manual_seed(page)
    b, sq, sk, hq, hkv = 2, 700, 3000, 16, 4
    q = _rand((b, sq, hq, d), dtype, "cuda", gen=g)
    k = _rand((b, sk, hkv, d), dtype, "cuda", gen=g)
    v = _rand((b, sk, hkv, d), dtype, "cuda", gen=g)
    kc, vc, table = _paged(k, v, page, g)
    used = torch.tensor([sk, 2111], dtype=torch.int32, device="cuda")
    check_options(q, kc, vc, causal=True, block_table=table, seqused_k=used)
    check_options(q, kc, vc, causal=True, block_table=table, seqused_k=used, window_size=(1000, -1),
                  softcap=30.0, alibi_slopes=_slopes((hq,), "cuda"))
    out, lse = flash_attn_with_lse(q[:1], kc, vc, causal=True, block_table=table[:1], seqused_k=used[:1])
    o0, l0 = flash_attn_with_lse(q[:1], k[:1], v[:1], causal=True)  # the same keys, contiguous
    assert max_err(out, o0) <= 2 * torch.finfo(dtype).eps * 4 and max_err(lse, l0) <= 1e-4


@pytest.mark.cuda
def test_gpu_varlen_paged_window():
    g = torch.Generator().manual_seed(7)
    lq, lk = [1, 1000, 70, 0, 513], [1, 3000, 900, 10, 513]
    q = _rand((sum(lq), 32, 128), torch.bfloat16, "cuda", gen=g)
    per = -(-max(lk) // 256) + 1
    kc = _rand((5 * per, 256, 8, 128), torch.bfloat16, "cuda", gen=g)
    vc = _rand((5 * per, 256, 8, 128), torch.bfloat16, "cuda", gen=g)
    table = torch.randperm(5 * per, generator=g).view(5, per).to(torch.int32).cuda()
    check_varlen_options(q, kc, vc, _cu(lq, "cuda"), _cu(lk, "cuda"), max(lq), max(lk), causal=True,
                         block_table=table, window_size=(400, -1), softcap=30.0,
                         alibi_slopes=_slopes((5, 32), "cuda"))
    k = _rand((sum(lk), 8, 128), torch.bfloat16, "cuda", gen=g)
    v = _rand((sum(lk), 8, 128), torch.bfloat16, "cuda", gen=g)
    check_varlen_options(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), max(lq), max(lk), window_size=(128, 64))


@pytest.mark.cuda
def test_gpu_32k_sliding_window_sampled_rows():
    """A 4096-token causal window over 32K tokens (Mistral's shape), checked on a sample of rows
    against the fp32 formula and the bf16 PyTorch baseline."""
    torch.manual_seed(1)
    s, hq, hkv, d, w = 32768, 8, 2, 128, 4096
    q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    slopes = _slopes((hq,), "cuda")
    out, lse = flash_attn_with_lse(q, k, v, causal=True, window_size=(w, -1), alibi_slopes=slopes, softcap=30.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    rows = torch.tensor(sorted({0, 1, 127, 4095, 4096, 4097, 16384, s - 129, s - 1}
                               | set(torch.randint(0, s, (16,)).tolist())), device="cuda")
    j = torch.arange(s, device="cuda")[None, :]
    allowed = (j <= rows[:, None]) & (j >= rows[:, None] - w)
    bias = -slopes[:, None, None] * (rows[:, None] - j).abs().float()[None]  # rows are positions (Sq == Sk)
    scale = 1.0 / math.sqrt(d)
    ref_o, ref_l = masked_attention_ref(q[0, rows], k[0], v[0], allowed[None], softcap=30.0, bias=bias)
    base = attention_in_dtype(q[0, rows], k[0], v[0], allowed[None], scale, 30.0, bias)
    err, tol = max_err(out[0, rows], ref_o), out_tol(ref_o, base, torch.bfloat16)
    assert err <= tol, f"sampled rows: output error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse[0][:, rows], ref_l)


@pytest.mark.cuda
def test_gpu_window_skips_tiles():
    """A 4096-token causal window over 32K tokens does ~23% of causal attention's work; its time
    must show it (loose bound: under half of the causal time; the benchmark measures the ratio)."""
    from triton.testing import do_bench

    torch.manual_seed(2)
    s = 32768
    q = torch.randn(1, s, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16)
    t_causal = do_bench(lambda: flash_attn_with_lse(q, k, v, causal=True), return_mode="median")
    t_window = do_bench(lambda: flash_attn_with_lse(q, k, v, causal=True, window_size=(4096, -1)),
                        return_mode="median")
    assert t_window < 0.5 * t_causal, (t_window, t_causal)
