"""Tests of paged_decode_attn_with_lse against the fp32 reference and against decode_attn_with_lse
on the equivalent contiguous cache.

CPU: the Triton code under the interpreter (fp16/fp32, small shapes). GPU (``-m cuda``): bf16,
long page lists, a store in pinned host memory read through UVA (equal bit for bit to the same
store on the GPU), and CUDA-graph capture with check=False.
"""
import pytest
import torch

from helpers import HAS_CUDA, assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.kernels import cpu_backend, decode_attn_with_lse, paged_decode_attn_with_lse
from xoffload.kernels.reference import decode_attention_ref, paged_decode_attn_ref, paged_rows_ref




def _store(r, hkv, d, dtype, device, scale=1.0, seed=0):
    """K/V row stores [R, Hkv, D] that are slices of larger buffers (only the last dim contiguous)."""
    g = torch.Generator(device=device).manual_seed(seed)
    buf = (torch.randn(r + 5, hkv, 2 * d + 8, generator=g, device=device) * scale).to(dtype)
    return buf[3:r + 3, :, :d], buf[5:r + 5, :, d + 8:]


def _query(b, hq, d, dtype, device, scale=1.0, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(b, 1, hq + 2, d, generator=g, device=device) * scale).to(dtype)[:, :, 1:hq + 1]


def _random_table(b, ht, n_pages, r, page, seed=2, aligned=False, device="cpu"):
    """int32 [B, ht, P]: random page starts in [0, R - page] (any row, or multiples of page)."""
    g = torch.Generator().manual_seed(seed)
    if aligned:
        t = torch.randint(0, r // page, (b, ht, n_pages), generator=g) * page
    else:
        t = torch.randint(0, r - page + 1, (b, ht, n_pages), generator=g)
    return t.to(torch.int32).to(device)


def _gather(k_pages, v_pages, table, lens, page):
    """The equivalent contiguous caches [B, max(lens), Hkv, D] (zeros past each length)."""
    b = table.shape[0]
    hkv = k_pages.shape[1]
    s = max(max(lens), 1)
    kc = torch.zeros(b, s, hkv, k_pages.shape[2], dtype=k_pages.dtype, device=k_pages.device)
    vc = torch.zeros_like(kc)
    tab = table.cpu()
    for i, n in enumerate(lens):
        for h in range(hkv):
            rows = paged_rows_ref(tab[i, h if tab.shape[1] > 1 else 0], n, page).to(k_pages.device)
            kc[i, :n, h] = k_pages[rows, h]
            vc[i, :n, h] = v_pages[rows, h]
    return kc, vc


def _check(q, k_pages, v_pages, table, lens, page, **kw):
    """Kernel vs the paged reference and vs decode_attn_with_lse on the gathered contiguous cache,
    within the tolerance rule (2x PyTorch-in-dtype error + a few ulps)."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    out, lse = paged_decode_attn_with_lse(q, k_pages, v_pages, table, seqlens, page_size=page, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], 1) and lse.dtype == torch.float32
    ref_o, ref_l = paged_decode_attn_ref(q, k_pages, v_pages, table, seqlens, page_size=page,
                                         softmax_scale=kw.get("softmax_scale"))
    kc, vc = _gather(k_pages, v_pages, table, lens, page)
    kc, vc = kc.to(q.device), vc.to(q.device)
    # the reference itself agrees with the contiguous decode reference: both fp32, summing in their
    # own order, so a few fp32 ulps of the largest output (an absolute 1e-5 failed at |out| ~ 90,
    # 2.3e-5 apart, on torch 2.13's CPU kernels)
    ro2, rl2 = decode_attention_ref(q, kc, vc, seqlens.cpu(), softmax_scale=kw.get("softmax_scale"))
    assert max_err(ref_o, ro2) <= 8 * torch.finfo(torch.float32).eps * max(1.0, float(ref_o.abs().max()))
    assert_lse_match(ref_l, rl2)
    base = torch.cat([sdpa_in_dtype(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n],
                                    softmax_scale=kw.get("softmax_scale")) for i, n in enumerate(lens)])
    tol = out_tol(ref_o, base, q.dtype)
    err = max_err(out, ref_o)
    assert err <= tol, f"out error {err:.3g} > tol {tol:.3g}"
    assert_lse_match(lse, ref_l)
    dec_o, dec_l = decode_attn_with_lse(q, kc, vc, seqlens, softmax_scale=kw.get("softmax_scale"),
                                        num_splits=kw.get("num_splits"))
    assert max_err(out, dec_o) <= tol + max_err(dec_o, ref_o)
    assert_lse_match(lse, dec_l)
    return out, lse


# ------------------------------------------------------------------------------------------ CPU
CASES = [  # (Hq, Hkv, D, dtype, page, shared table, num_splits, lens)
    (4, 4, 64, torch.float16, 16, True, None, [200, 37]),     # group 1, tiles gather 4 pages
    (6, 2, 40, torch.float32, 16, False, 3, [150, 16]),       # group 3, odd D, per-head pages
    (8, 2, 64, torch.float16, 64, False, 2, [190, 64]),       # group 4, one entry per tile
    (9, 3, 96, torch.float16, 32, True, None, [97, 1]),      # group 3, D 96, partial last pages
    (4, 1, 64, torch.float32, 256, False, 2, [300, 255]),     # larger page
    (8, 4, 40, torch.float16, 1024, False, 3, [1500, 3]),     # 1024-token pages
]


@pytest.mark.parametrize("hq,hkv,d,dtype,page,shared,num_splits,lens", CASES)
def test_paged_matches_reference(device, hq, hkv, d, dtype, page, shared, num_splits, lens):
    n_pages = -(-max(lens) // page) + 1  # one unused entry at the end
    r = max(4 * page, 1024)
    kp, vp = _store(r, hkv, d, dtype, device)
    q = _query(2, hq, d, dtype, device)
    table = _random_table(2, 1 if shared else hkv, n_pages, r, page, device=device)
    _check(q, kp, vp, table, lens, page, num_splits=num_splits)


@pytest.mark.parametrize("page", [16, 64])
def test_identity_table_equals_contiguous_decode(device, page):
    """A cache [B, S, Hkv, D] seen as rows + the identity table gives decode_attn_with_lse's answer."""
    b, s, hq, hkv, d = 2, 256, 6, 2, 64
    g = torch.Generator(device=device).manual_seed(3)
    kc = torch.randn(b, s, hkv, d, generator=g, device=device).half()
    vc = torch.randn(b, s, hkv, d, generator=g, device=device).half()
    q = _query(b, hq, d, torch.float16, device)
    per = s // page
    table = (torch.arange(b)[:, None] * s + torch.arange(per)[None, :] * page)[:, None, :].to(torch.int32)
    lens = torch.tensor([256, 77], dtype=torch.int32, device=device)
    out, lse = paged_decode_attn_with_lse(q, kc.reshape(b * s, hkv, d), vc.reshape(b * s, hkv, d),
                                          table.to(device), lens, page_size=page, num_splits=2)
    do, dl = decode_attn_with_lse(q, kc, vc, lens, num_splits=2)
    ro, rl = decode_attention_ref(q, kc, vc, lens.cpu())
    base = torch.cat([sdpa_in_dtype(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n])
                      for i, n in enumerate(lens.tolist())])
    tol = out_tol(ro, base, torch.float16)
    assert max_err(out, ro) <= tol and max_err(do, ro) <= tol
    assert max_err(out, do) <= tol
    assert_lse_match(lse, dl)
    assert_lse_match(lse, rl)


def test_out_of_order_and_duplicated_pages(device):
    """Pages visited backwards, the same page several times, and per-head lists that differ."""
    r, page, hkv, d = 512, 16, 2, 64
    kp, vp = _store(r, hkv, d, torch.float16, device, seed=4)
    q = _query(2, 8, d, torch.float16, device, seed=5)
    t0 = [480, 464, 464, 0, 17, 17, 300, 5]      # head 0: reversed, duplicated, unaligned rows
    t1 = [3, 3, 3, 3, 100, 200, 300, 400]        # head 1: one page four times
    table = torch.tensor([[t0, t1], [t1[::-1], t0[::-1]]], dtype=torch.int32, device=device)
    _check(q, kp, vp, table, [8 * page, 5 * page + 3], page, num_splits=3)


def test_empty_sequences(device):
    kp, vp = _store(256, 2, 64, torch.float16, device, seed=6)
    q = _query(3, 6, 64, torch.float16, device, seed=7)
    table = _random_table(3, 2, 4, 256, 16, device=device)
    out, lse = _check(q, kp, vp, table, [0, 50, 0], 16, num_splits=2)
    assert torch.equal(out[0].float().cpu(), torch.zeros(1, 6, 64))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all() and torch.isfinite(lse[1]).all()
    assert not torch.isnan(out).any()


def test_large_values_and_scale(device):
    kp, vp = _store(400, 2, 64, torch.float16, device, scale=30.0, seed=8)
    q = _query(2, 4, 64, torch.float16, device, scale=30.0, seed=9)
    table = _random_table(2, 2, 6, 400, 32, device=device)
    _check(q, kp, vp, table, [180, 33], 32, num_splits=2)
    kp, vp = _store(400, 2, 64, torch.float32, device, seed=10)
    q = _query(2, 4, 64, torch.float32, device, seed=11)
    _check(q, kp, vp, table, [180, 33], 32, softmax_scale=0.3)


def test_check_false_clamps_and_matches(device):
    kp, vp = _store(256, 2, 64, torch.float32, device, seed=12)
    q = _query(2, 4, 64, torch.float32, device, seed=13)
    table = _random_table(2, 2, 4, 256, 16, device=device)
    lens = torch.tensor([64, 20], dtype=torch.int32, device=device)
    o1, l1 = paged_decode_attn_with_lse(q, kp, vp, table, lens, page_size=16, num_splits=2)
    o2, l2 = paged_decode_attn_with_lse(q, kp, vp, table, lens, page_size=16, num_splits=2, check=False)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    # lengths past P*page_size are clamped to it; bad entries to [0, R - page_size]; no crash
    long_lens = torch.tensor([1000, 20], dtype=torch.int32, device=device)
    o3, l3 = paged_decode_attn_with_lse(q, kp, vp, table, long_lens, page_size=16, num_splits=2, check=False)
    assert torch.equal(o3, o1) and torch.equal(l3, l1)
    bad = table.clone()
    bad[0, 0, 0] = 10 ** 6
    bad[1, 1, 0] = -7
    o4, l4 = paged_decode_attn_with_lse(q, kp, vp, bad, lens, page_size=16, num_splits=2, check=False)
    clamped = bad.clamp(0, 256 - 16)
    o5, l5 = paged_decode_attn_with_lse(q, kp, vp, clamped, lens, page_size=16, num_splits=2)
    assert torch.equal(o4, o5) and torch.equal(l4, l5)


def test_unvisited_entries_are_ignored(device):
    """Entries past a sequence's last page may hold anything (e.g. -1 padding), even with check=True."""
    kp, vp = _store(256, 2, 64, torch.float16, device, seed=14)
    q = _query(2, 4, 64, torch.float16, device, seed=15)
    table = _random_table(2, 1, 6, 256, 16, device=device)
    table[0, 0, 3:] = -1  # 40 tokens visit pages 0..2
    table[1, 0, 1:] = 2 ** 31 - 1
    _check(q, kp, vp, table, [40, 16], 16, num_splits=2)


def test_table_views_and_pool_layout(device):
    """A strided table view, an expanded [B, Hkv, P] table (stride 0 over heads), and the CPU
    pool's layer-major layout ([L, blocks, block, Hkv, D] seen as rows of one layer)."""
    from xoffload.runtime import CpuKVPool

    pool = CpuKVPool(2, 8, 64, 2, 64, torch.float16, pin=False)
    for lay in range(2):
        pool.k[lay].copy_(torch.randn(pool.k[lay].shape).half())
        pool.v[lay].copy_(torch.randn(pool.v[lay].shape).half())
    kp, vp = pool.k_rows(1).to(device), pool.v_rows(1).to(device)
    q = _query(2, 6, 64, torch.float16, device, seed=16)
    wide = _random_table(2, 2, 8, kp.shape[0], 32, aligned=True, seed=17, device=device)
    table = wide[:, :, ::2]  # strided view
    assert not table.is_contiguous()
    _check(q, kp, vp, table, [128, 40], 32, num_splits=2)
    shared = wide[:, :1, :4]
    expanded = shared.expand(2, 2, 4)
    a = paged_decode_attn_with_lse(q, kp, vp, expanded, torch.tensor([100, 7], dtype=torch.int32, device=device),
                                   page_size=32, num_splits=2)
    c = paged_decode_attn_with_lse(q, kp, vp, shared, torch.tensor([100, 7], dtype=torch.int32, device=device),
                                   page_size=32, num_splits=2)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    pool.close()


def test_batch_zero(device):
    q = torch.zeros(0, 1, 4, 64, dtype=torch.float16, device=device)
    kp = torch.zeros(64, 2, 64, dtype=torch.float16, device=device)
    out, lse = paged_decode_attn_with_lse(q, kp, kp, torch.zeros(0, 2, 3, dtype=torch.int32, device=device),
                                          torch.zeros(0, dtype=torch.int32, device=device), page_size=16)
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1)


def test_store_smaller_than_one_page_raises(device):
    """No entry keeps a page inside a store of fewer than page_size rows: check=False's clamp to
    [0, R - page_size] cannot hold, so the shapes are refused whatever ``check`` says."""
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16, device=device)
    kp = torch.zeros(8, 2, 64, dtype=torch.float16, device=device)
    t = torch.zeros(1, 2, 1, dtype=torch.int32, device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    for check in (True, False):
        with pytest.raises(ValueError, match=r"k_pages has 8 rows, fewer than one page \(page_size 16\)"):
            paged_decode_attn_with_lse(q, kp, kp, t, lens, page_size=16, check=check)


def test_reference_backend_cpu():
    kp, vp = _store(300, 2, 64, torch.float32, "cpu", seed=18)
    q = _query(2, 6, 64, torch.float32, "cpu", seed=19)
    table = _random_table(2, 2, 5, 300, 16)
    lens = torch.tensor([70, 16], dtype=torch.int32)
    with cpu_backend("reference"):
        o, l = paged_decode_attn_with_lse(q, kp, vp, table, lens, page_size=16)
    ro, rl = paged_decode_attn_ref(q, kp, vp, table, lens, page_size=16)
    assert max_err(o, ro) < 1e-6
    assert_lse_match(l, rl)


# ------------------------------------------------------------------------------------ bad inputs
def _good():
    q = torch.randn(2, 1, 4, 64).half()
    kp = torch.randn(128, 2, 64).half()
    vp = torch.randn(128, 2, 64).half()
    table = torch.tensor([[[0, 16, 32]], [[64, 80, 96]]], dtype=torch.int32)
    return q, kp, vp, table, torch.tensor([40, 48], dtype=torch.int32)


def test_bad_inputs():
    q, kp, vp, t, lens = _good()
    f = paged_decode_attn_with_lse
    for bad in (8, 24, 100, 0, -16, 16.0, True, None):
        with pytest.raises(ValueError, match=rf"page_size must be a positive multiple of 16.*got {bad!r}"):
            f(q, kp, vp, t, lens, page_size=bad)
    with pytest.raises(TypeError, match="page_table must be int32.*int64"):
        f(q, kp, vp, t.long(), lens, page_size=16)
    with pytest.raises(TypeError, match="page_table must be a torch.Tensor"):
        f(q, kp, vp, [[0]], lens, page_size=16)
    with pytest.raises(ValueError, match=r"page_table must have shape \[B, Hkv, P\].*\(2, 3\)"):
        f(q, kp, vp, t[:, 0], lens, page_size=16)
    with pytest.raises(ValueError, match=r"page_table must have shape.*\(2, 3, 3\)"):
        f(q, kp, vp, t.expand(2, 3, 3), lens, page_size=16)
    with pytest.raises(ValueError, match=r"page_table must have shape.*\(1, 1, 3\)"):
        f(q, kp, vp, t[:1], lens, page_size=16)
    with pytest.raises(ValueError, match="page_table is on meta"):
        f(q, kp, vp, t.to("meta"), lens, page_size=16)
    with pytest.raises(ValueError, match="k_pages head_dim 32 != q head_dim 64"):
        f(q, kp[..., :32], vp[..., :32], t, lens, page_size=16)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k_pages heads \(3\)"):
        f(q, torch.randn(128, 3, 64).half(), torch.randn(128, 3, 64).half(), t, lens, page_size=16)
    with pytest.raises(ValueError, match=r"k_pages must have 3 dims \(\[R, Hkv, D\] row store\) or 4"):
        f(q, kp[None, None], vp[None, None], t, lens, page_size=16)
    with pytest.raises(ValueError, match="v_pages"):
        f(q, kp, vp[:64], t, lens, page_size=16)
    with pytest.raises(TypeError, match="k_pages has dtype torch.float32 but q has torch.float16"):
        f(q, kp.float(), vp.float(), t, lens, page_size=16)
    with pytest.raises(TypeError, match="v_pages has dtype"):
        f(q, kp, vp.float(), t, lens, page_size=16)
    with pytest.raises(ValueError, match="k_pages/v_pages are on meta but q is on cpu"):
        f(q, kp.to("meta"), vp.to("meta"), t, lens, page_size=16)
    kt = torch.randn(128, 64, 2).half().transpose(1, 2)
    with pytest.raises(ValueError, match="k_pages must have a contiguous last dim"):
        f(q, kt, vp, t, lens, page_size=16)
    with pytest.raises(ValueError, match="head_dim must be in"):
        big = torch.randn(128, 2, 288).half()
        f(torch.randn(2, 1, 4, 288).half(), big, big, t, lens, page_size=16)
    with pytest.raises(TypeError, match="seqlens must be int32"):
        f(q, kp, vp, t, lens.long(), page_size=16)
    with pytest.raises(TypeError, match="seqlens must be a torch.Tensor"):
        f(q, kp, vp, t, [40, 48], page_size=16)
    with pytest.raises(ValueError, match=r"seqlens must have shape \[B\] = \[2\]"):
        f(q, kp, vp, t, lens[:1], page_size=16)
    with pytest.raises(ValueError, match="seqlens is on meta"):
        f(q, kp, vp, t, lens.to("meta"), page_size=16)
    with pytest.raises(ValueError, match=r"seqlens must be in \[0, P\*page_size=48\].*max 49"):
        f(q, kp, vp, t, torch.tensor([40, 49], dtype=torch.int32), page_size=16)
    with pytest.raises(ValueError, match=r"seqlens must be in.*min -1"):
        f(q, kp, vp, t, torch.tensor([-1, 2], dtype=torch.int32), page_size=16)
    with pytest.raises(ValueError, match=r"entries of visited pages must be in \[0, R - page_size = 112\].*max 113"):
        t2 = t.clone()
        t2[1, 0, 2] = 113
        f(q, kp, vp, t2, lens, page_size=16)
    with pytest.raises(ValueError, match=r"entries of visited pages.*min -1"):
        t2 = t.clone()
        t2[0, 0, 0] = -1
        f(q, kp, vp, t2, lens, page_size=16)
    with pytest.raises(ValueError, match="softmax_scale"):
        f(q, kp, vp, t, lens, page_size=16, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="num_splits"):
        f(q, kp, vp, t, lens, page_size=16, num_splits=0)
    with pytest.raises(TypeError, match="dtype"):
        f(q.to(torch.int8), kp.to(torch.int8), vp.to(torch.int8), t, lens, page_size=16)


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [  # (Hq, Hkv, D, dtype, page, shared)
    (32, 8, 128, torch.bfloat16, 16, True),
    (32, 8, 128, torch.bfloat16, 256, False),
    (9, 3, 64, torch.bfloat16, 32, False),
    (28, 4, 96, torch.float16, 64, True),
    (40, 8, 256, torch.bfloat16, 1024, False),
    (48, 2, 64, torch.bfloat16, 128, True),
]


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,d,dtype,page,shared", GPU_CASES)
def test_paged_gpu(hq, hkv, d, dtype, page, shared):
    lens = [1, 4097, 20000]
    n_pages = -(-max(lens) // page)
    r = 65536
    kp, vp = _store(r, hkv, d, dtype, "cuda", seed=20)
    q = _query(3, hq, d, dtype, "cuda", seed=21)
    table = _random_table(3, 1 if shared else hkv, n_pages, r, page, aligned=True, device="cuda")
    _check(q, kp, vp, table, lens, page)


def _pinned_like(t):
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)
    return h


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,page,shared", [(torch.bfloat16, 16, False), (torch.bfloat16, 256, True),
                                               (torch.float16, 64, False)])
def test_paged_pinned_host_store_uva(dtype, page, shared):
    """K/V pages in pinned host memory, read by the kernel over PCIe: the same bits as the same
    store on the GPU (same kernel, same tiles, same split count)."""
    r, hq, hkv, d = 32768, 32, 8, 128
    kd, vd = _store(r, hkv, d, dtype, "cuda", seed=22)
    kh = torch.empty(r + 5, hkv, 2 * d + 8, dtype=dtype, pin_memory=True)  # strided views, as on the GPU
    kh[3:r + 3, :, :d].copy_(kd)
    kh[5:r + 5, :, d + 8:].copy_(vd)
    kh_k, kh_v = kh[3:r + 3, :, :d], kh[5:r + 5, :, d + 8:]
    assert kh_k.is_pinned() and not kh_k.is_cuda
    q = _query(2, hq, d, dtype, "cuda", seed=23)
    lens = torch.tensor([12345, 777], dtype=torch.int32, device="cuda")
    n_pages = -(-12345 // page)
    table = _random_table(2, 1 if shared else hkv, n_pages, r, page, aligned=False, device="cuda")
    od, ld = paged_decode_attn_with_lse(q, kd, vd, table, lens, page_size=page)
    oh, lh = paged_decode_attn_with_lse(q, kh_k, kh_v, table, lens, page_size=page)
    torch.cuda.synchronize()
    assert torch.equal(od, oh) and torch.equal(ld, lh)
    ro, rl = paged_decode_attn_ref(q, kh_k, kh_v, table, lens, page_size=page)
    kc, vc = _gather(kd, vd, table, lens.tolist(), page)
    base = torch.cat([sdpa_in_dtype(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n])
                      for i, n in enumerate(lens.tolist())])
    assert max_err(oh, ro) <= out_tol(ro, base, dtype)
    assert_lse_match(lh, rl)


@pytest.mark.cuda
def test_paged_unpinned_host_store_raises():
    q = torch.randn(1, 1, 4, 64, dtype=torch.float16, device="cuda")
    kp = torch.randn(256, 2, 64).half()  # plain (pageable) host memory
    table = torch.zeros(1, 1, 2, dtype=torch.int32, device="cuda")
    lens = torch.tensor([20], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="k_pages is a host tensor that is not pinned"):
        paged_decode_attn_with_lse(q, kp, kp, table, lens, page_size=16)
    with pytest.raises(ValueError, match="k_pages/v_pages are on cuda.*but q is on cpu"):
        paged_decode_attn_with_lse(q.cpu(), kp.cuda(), kp.cuda(), table.cpu(), lens.cpu(), page_size=16)


@pytest.mark.cuda
def test_paged_registered_pool_uva_and_graph():
    """The runtime's pool (cudaHostRegister'ed slabs) read over UVA inside a captured CUDA graph
    (check=False); replay after the lengths and the table change gives the eager answer."""
    from xoffload.runtime import CpuKVPool

    pool = CpuKVPool(1, 64, 1024, 8, 128, torch.bfloat16, pin=True)
    assert pool.pinned
    pool.k[0].copy_(torch.randn(pool.k[0].shape).to(torch.bfloat16))
    pool.v[0].copy_(torch.randn(pool.v[0].shape).to(torch.bfloat16))
    kh, vh = pool.k_rows(0), pool.v_rows(0)  # views into registered slabs (is_pinned() may say False)
    r = kh.shape[0]
    q = _query(1, 32, 128, torch.bfloat16, "cuda", seed=24)
    page = 64
    table = _random_table(1, 8, 512, r, page, aligned=True, device="cuda")
    lens = torch.tensor([20000], dtype=torch.int32, device="cuda")
    fn = lambda: paged_decode_attn_with_lse(q, kh, vh, table, lens, page_size=page, check=False)  # noqa: E731
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og, lg = fn()
    table.copy_(_random_table(1, 8, 512, r, page, aligned=True, seed=25, device="cuda"))
    lens.fill_(32000)
    g.replay()
    oe, le = fn()
    torch.cuda.synchronize()
    assert torch.equal(og, oe) and torch.equal(lg, le)
    ro, rl = paged_decode_attn_ref(q, kh, vh, table, lens, page_size=page)
    assert max_err(oe, ro) <= 2e-2
    assert_lse_match(le, rl)
    del g
    pool.close()
