"""The option path's ALiBi tile classes, and softcap through it (``xoffload.kernels.flash_attn_opts``).

ALiBi: most tiles add only a per-column term (a per-row shift, removed from the LSE at the end);
tiles straddling the diagonal use the full ``|pos - j|`` form. The cases here put query blocks
across the diagonal with ``Sq != Sk`` (both ways), combine ALiBi with windows, per-batch slopes
(zero and negative ones included), fully masked rows, varlen and pages, under several tile shapes,
and check out and LSE against the fp32 reference (``xoffload.kernels.reference``) with the
in-dtype tolerance rule of ``test_flash_attn_options`` (``check_options``). The Python mirror of
the tile classes is checked by brute force, and against the kernel's jit function.

Softcap (``tanh.approx.f32`` + ``tl.exp2`` on the GPU, the exact tanh formula under the
interpreter and for fp32) against the reference with the same rule, in the interpreter and
(``@pytest.mark.cuda``) on a GPU in bf16 / fp16, alone and with a window and ALiBi; the other
option combinations with softcap are in ``test_flash_attn_options``.
"""
import random

import pytest
import torch
import triton
import triton.language as tl

from helpers import assert_lse_match, max_err
from test_flash_attn_options import _cu, _paged, _rand, _slopes, check_options, check_varlen_options
from xoffload.kernels import flash_attn_with_lse, launch_override
from xoffload.kernels.flash_attn_opts import _diagonal_split, alibi_tile_classes
from xoffload.kernels.reference import attention_ref, window_mask


def _qkv(b, sq, sk, hq, hkv, d, dtype, device, seed, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (_rand((b, sq, hq, d), dtype, device, q_scale, g), _rand((b, sk, hkv, d), dtype, device, 1.0, g),
            _rand((b, sk, hkv, d), dtype, device, 1.0, g))


def _sides(sq, sk, bm, bn, causal=False, window=(-1, -1)):
    """The ALiBi sides the kernel runs on non-empty key ranges of this shape."""
    out = set()
    for m0 in range(0, sq, bm):
        for start, stop, _, side in alibi_tile_classes(m0, bm, bn, sq, sk, causal=causal, window_size=window):
            if stop > start:
                out.add(side)
    return out


# ---------------------------------------------------------------------------------------------
# ALiBi: the tile classes
# ---------------------------------------------------------------------------------------------

_CFGS = [None, (128, 64, 4, 3), (32, 64, 4, 1), (16, 16, 4, 1)]  # None: the interpreter's 64x32


@pytest.mark.parametrize("cfg", _CFGS)
@pytest.mark.parametrize("sq,sk", [(300, 420), (260, 150), (200, 200)])
def test_alibi_noncausal_blocks_straddle_the_diagonal(device, cfg, sq, sk):
    """Non-causal, Sq != Sk (and Sq == Sk): query blocks whose rows lie on both sides of keys, so
    every tile class (left, straddling, right) runs; fp16, GQA."""
    bm, bn = (cfg or (64, 32))[:2]
    assert _sides(sq, sk, bm, bn) == {0, 1, 2}, "the shape must exercise all three tile classes"
    q, k, v = _qkv(1, sq, sk, 4, 2, 64, torch.float16, device, sq + sk)
    slopes = _slopes((4,), device)
    if cfg is None:
        check_options(q, k, v, alibi_slopes=slopes)
    else:
        with launch_override("flash_attn", cfg):
            check_options(q, k, v, alibi_slopes=slopes)


@pytest.mark.parametrize("sq,sk,causal,dtype", [
    (200, 90, False, torch.float16),   # Sq > Sk: the first blocks lie right of every key
    (200, 90, True, torch.float16),    # Sq > Sk causal: rows 0..109 see no key (LSE -inf)
    (40, 230, False, torch.float32),   # Sq < Sk: one block, far right of most keys
    (40, 230, True, torch.float16),
    (97, 161, True, torch.float32),
])
def test_alibi_sq_vs_sk(device, sq, sk, causal, dtype):
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, dtype, device, 3 * sq + sk)
    check_options(q, k, v, causal=causal, alibi_slopes=_slopes((2, 4), device))


@pytest.mark.parametrize("causal,window,sq,sk", [
    (True, (30, -1), 120, 200),
    (False, (25, 40), 150, 260),    # two-sided: masked edges use the full form, the interior splits
    (False, (-1, 10), 130, 100),    # right bound only, Sq > Sk: rows with no key
    (False, (60, -1), 100, 180),    # left bound only
    (False, (0, 50), 90, 90),
    (False, (5, 3), 64, 64),        # a narrow band: no unmasked tiles
])
def test_alibi_window(device, causal, window, sq, sk):
    q, k, v = _qkv(1, sq, sk, 4, 1, 64, torch.float16, device, sq + 7 * sk)
    for cfg in (None, (128, 64, 4, 3), (16, 16, 4, 1)):
        if cfg is None:
            check_options(q, k, v, causal=causal, window_size=window, alibi_slopes=_slopes((4,), device))
        else:
            with launch_override("flash_attn", cfg):
                check_options(q, k, v, causal=causal, window_size=window, alibi_slopes=_slopes((4,), device))


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_per_batch_slopes(device, causal):
    """Slopes ``[B, Hq]``, each row of them different (a zero and a negative slope among them, and
    slope 1, the largest shift): each item equals the call on that item alone with its ``[Hq]``."""
    q, k, v = _qkv(3, 150, 260, 4, 2, 64, torch.float16, device, 40 + causal)
    slopes = torch.tensor([[0.5, 0.0, 1.0, 0.0625], [0.25, -0.03125, 0.125, 1.0], [2.0 ** -8, 0.75, 0.5, 0.0]],
                          device=device)
    out, lse, _, _ = check_options(q, k, v, causal=causal, alibi_slopes=slopes)
    for i in range(3):
        o1, l1 = flash_attn_with_lse(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=causal, alibi_slopes=slopes[i])
        assert torch.equal(out[i:i + 1], o1) and torch.equal(lse[i:i + 1], l1)


def test_alibi_large_slope_lse_within_the_tests_tolerance(device):
    """Causal and not, fp16, slopes 8 and 4 (past ``ALIBI_SHIFT_MAX``: the per-row shift would round
    the LSE past tolerance, 3.1e-5 against 2.2e-5 before the fallback), next to a head under it in
    the same call, and negative slopes as large: out and LSE within the dtype's tolerance."""
    q, k, v = _qkv(1, 70, 20, 3, 3, 40, torch.float16, device, 0)
    for causal in (True, False):
        check_options(q, k, v, causal=causal, alibi_slopes=torch.tensor([8.0, 4.0, 0.25], device=device))
    # negative slopes shift as far: the direct-form check is on |slope| (the adversarial review found
    # LSE errors of 6e-5 / 5e-4 at slopes -8 / -64 against 2.8e-5 allowed, 128-row blocks)
    q, k, v = _qkv(1, 128, 160, 3, 3, 64, torch.float16, device, 1)
    with launch_override("flash_attn", (128, 32, 4, 1)):
        for kw in (dict(causal=True, window_size=(0, -1)), dict(causal=True), dict(causal=False)):
            check_options(q, k, v, alibi_slopes=torch.tensor([-8.0, -64.0, -0.25], device=device), **kw)


def test_alibi_fully_masked_rows(device):
    """Rows that see no key keep out 0 and LSE -inf exactly (the per-row shift is not applied to
    them): Sq > Sk with a right window, and an item with no used key."""
    q, k, v = _qkv(2, 130, 60, 4, 2, 64, torch.float16, device, 41)
    slopes = _slopes((2, 4), device)
    used = torch.tensor([60, 0], dtype=torch.int32, device=device)
    out, lse, _, ref_l = check_options(q, k, v, window_size=(-1, 3), alibi_slopes=slopes, seqused_k=used)
    assert torch.isneginf(ref_l[0, :, :67]).all() and torch.isfinite(ref_l[0, :, 67:]).all()
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    out, lse, _, ref_l = check_options(q, k, v, causal=True, alibi_slopes=slopes)
    assert torch.isneginf(lse[:, :, :70]).all() and torch.isfinite(lse[:, :, 70:]).all()


def test_alibi_varlen_noncausal_and_paged(device):
    lq, lk = [150, 1, 40, 0, 90], [260, 1, 230, 7, 40]
    g = torch.Generator().manual_seed(42)
    q = _rand((sum(lq), 4, 64), torch.float16, device, gen=g)
    k = _rand((sum(lk), 2, 64), torch.float16, device, gen=g)
    v = _rand((sum(lk), 2, 64), torch.float16, device, gen=g)
    check_varlen_options(q, k, v, _cu(lq, device), _cu(lk, device), max(lq), max(lk),
                         alibi_slopes=_slopes((5, 4), device))
    qp, kp, vp = _qkv(2, 150, 260, 4, 2, 64, torch.float16, device, 43)
    kc, vc, table = _paged(kp, vp, 16, g)
    used = torch.tensor([260, 201], dtype=torch.int32, device=device)
    check_options(qp, kc, vc, alibi_slopes=_slopes((4,), device), block_table=table, seqused_k=used)


def test_alibi_softcap_noncausal_straddle_fp32(device):
    """fp32 inputs keep the direct ``-slope * |pos - j|`` on every tile (no row shift): the same
    straddling shape within fp32's tolerance."""
    q, k, v = _qkv(1, 150, 260, 4, 2, 80, torch.float32, device, 44, q_scale=2.0)
    with launch_override("flash_attn", (32, 64, 4, 1)):
        check_options(q, k, v, softcap=6.0, alibi_slopes=_slopes((4,), device), softmax_scale=0.3)


def _class_cases(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sq, sk = rng.choice([1, 7, 64, 100, 257]), rng.choice([1, 33, 64, 200, 513])
        causal = rng.random() < 0.4
        w = (rng.choice([-1, -1, 0, 3, 31, 150]), rng.choice([-1, -1, 0, 5, 40, 300]))
        bm, bn = rng.choice([(64, 32), (32, 64), (16, 16), (128, 64), (128, 128)])
        out.append((sq, sk, causal, w, bm, bn))
    return out


def test_alibi_tile_classes_brute_force():
    """Every key range's bias form holds for every real row of the block that sees the key: side 1
    keys are at or left of the row, side 2 keys at or right of it; unmasked ranges hold only keys
    every row sees; the ranges tile ``[lo, hi)`` in order."""
    for sq, sk, causal, w, bm, bn in _class_cases(150):
        mask = window_mask(sq, sk, w, causal)
        for m0 in range(0, sq, bm):
            ranges = alibi_tile_classes(m0, bm, bn, sq, sk, causal=causal, window_size=w)
            for (_, a1, _, _), (b0, _, _, _) in zip(ranges, ranges[1:]):
                assert a1 == b0, (sq, sk, causal, w, bm, bn, m0, ranges)
            rows = torch.arange(m0, min(m0 + bm, sq))
            pos = rows + sk - sq
            for start, stop, masked, side in ranges:
                keys = torch.arange(start, min(stop, sk))
                if not keys.numel():
                    continue
                seen = mask[rows][:, keys]  # [rows, keys]
                if not masked:
                    assert bool(seen.all()), (sq, sk, causal, w, bm, bn, m0, start, stop)
                if side == 1:
                    assert bool((~seen | (keys[None, :] <= pos[:, None])).all()), (sq, sk, causal, w, m0, start)
                elif side == 2:
                    assert bool((~seen | (keys[None, :] >= pos[:, None])).all()), (sq, sk, causal, w, m0, start)


@triton.jit
def _probe_split(OUT, seqlen_q, seqlen_k, full_lo, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    d_lo, d_hi = _diagonal_split(pid * BLOCK_M, seqlen_q, seqlen_k - seqlen_q, tl.load(full_lo + pid),
                                 tl.load(full_hi + pid), BLOCK_M, BLOCK_N)
    tl.store(OUT + pid * 2, d_lo)
    tl.store(OUT + pid * 2 + 1, d_hi)


def test_diagonal_split_kernel_equals_mirror(device):
    for sq, sk, _, w, bm, bn in _class_cases(24, seed=1):
        w = (w[0], -1 if w[1] == 0 else w[1])  # a right bound of 0 is the causal mask (no split)
        nb = -(-sq // bm)
        cls = [alibi_tile_classes(m * bm, bm, bn, sq, sk, window_size=w) for m in range(nb)]
        full_lo = torch.tensor([c[1][0] for c in cls], dtype=torch.int32, device=device)
        full_hi = torch.tensor([c[3][1] for c in cls], dtype=torch.int32, device=device)
        out = torch.empty(nb * 2, dtype=torch.int32, device=device)
        _probe_split[(nb,)](out, sq, sk, full_lo, full_hi, BLOCK_M=bm, BLOCK_N=bn)
        assert out.view(nb, 2).tolist() == [[c[1][1], c[2][1]] for c in cls], (sq, sk, w, bm, bn)


def test_causal_alibi_uses_only_the_column_form():
    for sq, sk, _, w, bm, bn in _class_cases(40, seed=2):
        assert _sides(sq, sk, bm, bn, causal=True, window=(w[0], -1)) <= {1}


# ---------------------------------------------------------------------------------------------
# softcap
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,dtype,d", [(True, torch.float16, 64), (False, torch.float16, 80),
                                            (True, torch.float32, 64)])
def test_softcap(device, causal, dtype, d):
    q, k, v = _qkv(1, 70, 90, 4, 2, d, dtype, device, 50 + d, q_scale=3.0)
    out, _, _, _ = check_options(q, k, v, causal=causal, softcap=5.0)
    plain, _ = flash_attn_with_lse(q, k, v, causal=causal)
    assert max_err(out, plain) > 1e-2  # the cap changes the answer


# ---------------------------------------------------------------------------------------------
# GPU: softcap with the inline PTX tanh, the ALiBi tile classes; bf16 / fp16
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype,d,causal", [(torch.bfloat16, 128, True), (torch.bfloat16, 64, False),
                                            (torch.float16, 128, False), (torch.float16, 64, True)])
def test_gpu_softcap(dtype, d, causal):
    torch.manual_seed(d + causal)
    b, sq, sk, hq, hkv = 1, 1500, 2000, 8, 2
    q = (torch.randn(b, sq, hq, d, device="cuda") * 2.0).to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    check_options(q, k, v, causal=causal, softcap=30.0)
    check_options(q, k, v, causal=True, softcap=30.0, window_size=(300, -1), alibi_slopes=_slopes((hq,), "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("sq,sk,causal", [(1000, 3000, False), (3000, 1000, False), (2048, 2048, False),
                                          (2048, 2048, True), (700, 1800, True)])
def test_gpu_alibi_tile_classes(dtype, d, sq, sk, causal):
    """Every tile class on the GPU's tiles (_gpu_config: 128x64 / 4 warps at D=64, 128x128 at
    D=128; with the window 64x64 / 4 warps at D=64, 128x64 / 8 warps at D=128), per-batch slopes,
    Sq != Sk both ways; then with a two-sided window."""
    torch.manual_seed(sq + sk + d)
    b, hq, hkv = 2, 8, 2
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    slopes = _slopes((b, hq), "cuda")
    check_options(q, k, v, causal=causal, alibi_slopes=slopes)
    if not causal:
        check_options(q, k, v, window_size=(500, 300), alibi_slopes=slopes)
    ref_o, ref_l = attention_ref(q, k, v, causal=causal, alibi_slopes=slopes)
    _, lse = flash_attn_with_lse(q, k, v, causal=causal, alibi_slopes=slopes)
    assert_lse_match(lse, ref_l)
