"""flash-attn's inference options: in flash_attn_func / flash_attn_varlen_func (window_size,
softcap, alibi_slopes, block_table for varlen; bad values), and in flash_attn_with_kvcache: block_table (paged caches),
k/v appended into pages, rotary (both layouts, partial rotary dims), cache_leftpad,
cache_batch_idx, window_size, softcap, alibi_slopes, num_splits, Sq > 1.

The main test is a port of flash-attn's ``tests/test_flash_attn.py::test_flash_attn_kvcache``: its
setup (random caches, paged caches from a random block permutation, rotary tables, left pads,
ALiBi slopes * 0.3, random windows), its reference (``attention_ref`` in fp32 and, for the error
baseline, in the input dtype with the scaling reordered) and its cache check, with this project's
tolerance rule (error <= 2x the PyTorch low-precision error + 2 ulps, tests/helpers.py). The
reference functions are re-written here from flash-attn's definitions. CPU: the interpreter,
fp16/fp32, a selection of the grid; GPU (``-m cuda``): bf16/fp16, a wider selection incl. 128K.
"""
import math
import random

import pytest
import torch

from helpers import assert_lse_match, max_err, out_tol
from xoffload.integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from xoffload.kernels import apply_rotary, cpu_backend
from xoffload.kernels.reference import attention_ref, decode_attention_ref


# ------------------------------------------------------------------ flash-attn's reference, ported
def _alibi_bias(slopes, sq, sk, key_padding_mask=None, causal=False, key_leftpad=None):
    """flash-attn's attn_bias_from_alibi_slopes: ``[B, H, Sq, Sk]`` (causal: ``slope * (j - Sk + 1)``,
    the same softmax as ``-slope * |i + sk - sq - j|``)."""
    b, h = slopes.shape
    sl = slopes[:, :, None, None]
    if causal:
        return torch.arange(-sk + 1, 1, device=slopes.device, dtype=torch.float32) * sl
    row = torch.arange(sq, device=slopes.device)[:, None]
    col = torch.arange(sk, device=slopes.device).expand(b, 1, 1, sk)
    if key_leftpad is not None:
        lp = key_leftpad.view(b, 1, 1, 1)
        col = torch.where(col >= lp, col - lp, 2 ** 32)
    n = sk if key_padding_mask is None else key_padding_mask.sum(-1).view(b, 1, 1, 1)
    return -sl * (row + n - sq - col).abs().float()


def _local_mask(sq, sk, window, key_padding_mask, device, key_leftpad=None):
    """flash-attn's construct_local_mask: True where the key is outside the window."""
    row = torch.arange(sq, device=device)[:, None]
    col = torch.arange(sk, device=device)
    if key_leftpad is not None:
        b = key_leftpad.shape[0]
        lp = key_leftpad.view(b, 1, 1, 1)
        col = col.expand(b, 1, 1, sk)
        col = torch.where(col >= lp, col - lp, 2 ** 32)
    n = sk if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    if window[0] < 0:
        return col > row + n - sq + window[1]
    n_full = torch.full_like(col, sk) if key_padding_mask is None else n
    return (col > torch.minimum(row + n - sq + window[1], n_full)) | (col < row + n - sq - window[0])


def _attention_ref(q, k, v, key_padding_mask=None, attn_bias=None, causal=False, window=(-1, -1), softcap=0.0,
                   upcast=True, reorder_ops=False, key_leftpad=None):
    """flash-attn's attention_ref (q [B, Sq, H, D], k/v [B, Sk, Hk, D]); ``upcast=False,
    reorder_ops=True`` is the low-precision PyTorch baseline."""
    if causal:
        window = (window[0], 0)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    if not reorder_ops:
        s = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    else:
        s = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if key_padding_mask is not None:
        s = s.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    local = None
    if window[0] >= 0 or window[1] >= 0:
        local = _local_mask(sq, sk, window, key_padding_mask, q.device, key_leftpad)
        s = s.masked_fill(local, float("-inf"))
    if attn_bias is not None:
        s = s + attn_bias
    p = torch.softmax(s, dim=-1).to(v.dtype)
    if local is not None:
        p = p.masked_fill(torch.all(local, dim=-1, keepdim=True), 0.0)
    p = torch.nan_to_num(p)
    return torch.einsum("bhts,bshd->bthd", p, v).to(dtype)


def _rotary_torch(x, cos, sin, offsets, interleaved):
    """flash-attn's apply_rotary_emb (fp32, rounded once): token t of item b at offsets[b] + t."""
    b, s, h, d = x.shape
    r = 2 * cos.shape[1]
    pos = offsets.long()[:, None] + torch.arange(s, device=x.device)[None]
    c, sn = cos.float()[pos][:, :, None], sin.float()[pos][:, :, None]
    if interleaved:
        c, sn = c.repeat_interleave(2, -1), sn.repeat_interleave(2, -1)
    else:
        c, sn = torch.cat((c, c), -1), torch.cat((sn, sn), -1)
    xr = x[..., :r].float()
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).reshape(xr.shape)
    else:
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    return torch.cat(((xr * c + rot * sn).to(x.dtype), x[..., r:]), dim=-1)


def _block_kvcache(seqlen_k, page, b, hkv, d, device, dtype, gen, dgen):
    """flash-attn's _generate_block_kvcache: 3x the blocks needed, a random permutation split
    over the batch; also the contiguous view of each sequence's first seqlen_k tokens (the large
    tensors drawn on the device by ``dgen``)."""
    nb = math.ceil(seqlen_k / page) * b * 3
    kp = torch.randn(nb, page, hkv, d, generator=dgen, device=device).to(dtype)
    vp = torch.randn(nb, page, hkv, d, generator=dgen, device=device).to(dtype)
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(b, -1).to(device)
    k = kp[table.long().flatten()].view(b, -1, hkv, d)[:, :seqlen_k]
    v = vp[table.long().flatten()].view(b, -1, hkv, d)[:, :seqlen_k]
    return k, v, table, kp, vp, nb


# ------------------------------------------------------------------------------ the ported test
def _kvcache_case(device, dtype, seqlen_q, seqlen_k, d, mha_type, page, rotary_fraction, rotary_interleaved,
                  seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, has_leftpad, has_batch_idx, num_splits,
                  softcap=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = 2
    bc = b if not has_batch_idx else b * 2
    nheads = 6
    rotary_dim = math.floor(int(rotary_fraction * d) / 16) * 16
    hkv = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 3)
    window = (-1, -1) if not local else tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist())
    dgen = torch.Generator(device=device).manual_seed(seed)  # the large tensors, drawn where they live
    rn = lambda *s: torch.randn(*s, generator=dgen, device=device).to(dtype)  # noqa: E731
    q = rn(b, seqlen_q, nheads, d)
    if softcap > 0:
        q = q * softcap / 4  # scores large enough for the cap to matter (as flash-attn's tests do)
    seqlen_new = seqlen_q if seqlen_new_eq_seqlen_q else int(torch.randint(1, seqlen_q + 1, (1,), generator=gen))
    k = rn(b, seqlen_new, hkv, d) if new_kv else None
    v = rn(b, seqlen_new, hkv, d) if new_kv else None
    if page is None:
        k_cache, v_cache = rn(bc, seqlen_k, hkv, d), rn(bc, seqlen_k, hkv, d)
        block_table = None
    else:
        k_cache, v_cache, block_table, k_paged, v_paged, nb = _block_kvcache(seqlen_k, page, b, hkv, d, device,
                                                                             dtype, gen, dgen)
    hi = (seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new) + 1) if new_kv else seqlen_k + 1
    cache_seqlens = torch.randint(0 if new_kv else 1, hi, (b,), generator=gen).to(torch.int32).to(device)
    leftpad = None
    if has_leftpad:
        leftpad = torch.tensor([int(torch.randint(0, int(n), (1,), generator=gen)) if int(n) > 0 else 0
                                for n in cache_seqlens.tolist()], dtype=torch.int32, device=device)
    arange = torch.arange(seqlen_k, device=device)[None]
    total = cache_seqlens[:, None] + (seqlen_new if new_kv else 0)
    kpm = arange < total
    if has_leftpad:
        kpm = kpm & (arange >= leftpad[:, None])
    batch_idx = torch.randperm(bc, generator=gen)[:b].to(torch.int32).to(device) if has_batch_idx else None
    slopes = bias = None
    if alibi:
        slopes = (torch.rand(b, nheads, generator=gen) * 0.3).to(device)
        bias = _alibi_bias(slopes, seqlen_q, seqlen_k, kpm, causal=causal, key_leftpad=leftpad)
    cos = sin = None
    q_ro, k_ro = q, k
    if rotary_dim > 0:
        n_ro = seqlen_k if page is None else nb * page
        angle = torch.rand(n_ro, rotary_dim // 2, generator=gen).to(device) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        if causal or local:
            q_ro = _rotary_torch(q, cos, sin, cache_seqlens, rotary_interleaved)
        else:  # every q token at cache_seqlens (flash-attn: "b s h d -> b 1 (s h) d")
            q_ro = _rotary_torch(q.reshape(b, 1, seqlen_q * nheads, d), cos, sin, cache_seqlens,
                                 rotary_interleaved).reshape(b, seqlen_q, nheads, d)
        k_ro = _rotary_torch(k, cos, sin, cache_seqlens, rotary_interleaved)
    k_ref = (k_cache if not has_batch_idx else k_cache[batch_idx.long()]).clone()
    v_ref = (v_cache if not has_batch_idx else v_cache[batch_idx.long()]).clone()
    if new_kv:
        upd = (cache_seqlens[:, None] <= arange) & (arange < cache_seqlens[:, None] + seqlen_new)
        k_ref[upd] = k_ro.reshape(-1, hkv, d)
        v_ref[upd] = v.reshape(-1, hkv, d)
    out, lse = flash_attn_with_kvcache(
        q, k_cache if page is None else k_paged, v_cache if page is None else v_paged, k, v,
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, block_table=block_table, causal=causal, window_size=window,
        rotary_interleaved=rotary_interleaved, alibi_slopes=slopes, num_splits=num_splits, softcap=softcap,
        return_softmax_lse=True,
    )
    out_ref = _attention_ref(q_ro, k_ref, v_ref, kpm, bias, causal=causal, window=window, softcap=softcap,
                             key_leftpad=leftpad)
    out_pt = _attention_ref(q_ro, k_ref, v_ref, kpm, bias, causal=causal, window=window, softcap=softcap,
                            upcast=False, reorder_ops=True, key_leftpad=leftpad)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, nheads, seqlen_q) and lse.dtype == torch.float32
    # fp32: PyTorch's fp32 baseline often has no error at all, so the floor decides; 8 fp32 ulps of
    # the output (~1e-6) stay well under flash-attn's own absolute slack (+1e-5)
    tol = out_tol(out_ref.float(), out_pt, dtype, ulps=8.0 if dtype == torch.float32 else 2.0)
    err = max_err(out, out_ref.float())
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g} (PyTorch {max_err(out_pt, out_ref.float()):.3g})"
    if new_kv:  # the cache holds the (rotated) new keys and the new values at cache_seqlens
        if page is None:
            k_sel = k_cache if not has_batch_idx else k_cache[batch_idx.long()]
            v_sel = v_cache if not has_batch_idx else v_cache[batch_idx.long()]
        else:
            k_sel = k_paged[block_table.long().flatten()].view(b, -1, hkv, d)[:, :seqlen_k]
            v_sel = v_paged[block_table.long().flatten()].view(b, -1, hkv, d)[:, :seqlen_k]
        assert torch.allclose(k_sel.float(), k_ref.float(), rtol=1e-3, atol=1e-3)
        assert torch.equal(v_sel, v_ref)
    # LSE against the fp32 reference (this project's ALiBi LSE convention), on q rotated as the
    # call rotates it
    q_l = q
    if rotary_dim > 0:
        q_l = apply_rotary(q, cos, sin, cache_seqlens, interleaved=rotary_interleaved,
                           same_position=not (causal or local))
    tl_ = total.reshape(-1).to(torch.int32)
    _, ref_l = decode_attention_ref(q_l, k_ref, v_ref, tl_.cpu() if q.is_cuda else tl_, causal=causal,
                                    window_size=window, softcap=softcap, alibi_slopes=slopes, cache_leftpad=leftpad)
    assert_lse_match(lse, ref_l.to(lse.device), 60.0 if alibi else None)


KVCACHE_CASES = [
    # sq, sk, d, mha, page, rot, inter, new_eq, causal, local, alibi, new_kv, leftpad, bidx, splits, softcap, dtype
    (1, 128, 32, "mha", None, 0.0, False, True, False, False, False, False, False, False, 1, 0.0, torch.float16),
    (1, 339, 59, "gqa", None, 0.5, True, True, True, False, False, True, False, False, 0, 0.0, torch.float16),
    (1, 339, 64, "mqa", 256, 1.0, False, True, False, True, False, True, False, False, 0, 0.0, torch.float16),
    (3, 150, 32, "gqa", 16, 0.5, True, False, True, False, True, True, False, False, 0, 0.0, torch.float32),
    (3, 150, 64, "mha", None, 0.0, False, True, True, True, True, True, True, False, 1, 0.0, torch.float16),
    (1, 200, 32, "gqa", None, 1.0, False, True, False, False, False, True, True, True, 0, 0.0, torch.float16),
    (4, 128, 32, "gqa", None, 0.5, False, True, False, False, False, True, False, True, 0, 0.0, torch.float16),
    (2, 100, 40, "mqa", 256, 0.0, False, False, True, False, False, True, False, False, 0, 30.0, torch.float16),
    (1, 97, 64, "gqa", 16, 0.0, False, True, False, True, True, False, False, False, 0, 0.0, torch.float32),
    (5, 64, 32, "mha", 16, 1.0, True, True, True, True, False, True, False, False, 0, 0.0, torch.float16),
    (1, 256, 32, "gqa", 256, 0.5, False, True, False, False, True, True, True, False, 1, 2.0, torch.float16),
    (16, 200, 32, "gqa", None, 0.0, False, True, True, False, False, True, False, False, 0, 0.0, torch.float16),
    (16, 200, 32, "gqa", 256, 0.0, False, False, True, False, False, True, False, False, 0, 0.0, torch.float16),
    (3, 128, 59, "mqa", None, 0.5, True, False, False, True, False, True, False, False, 0, 0.0, torch.float32),
    (1, 128, 32, "mha", None, 0.0, False, True, True, False, True, False, True, False, 0, 0.0, torch.float16),
]


def _case_id(c):
    sq, sk, d, mha, page, rot, inter, _, causal, local, alibi, new_kv, lp, bidx, splits, cap, dt = c
    tags = [f"q{sq}k{sk}d{d}", mha, f"page{page}" if page else "contig", f"rot{rot}{'i' if inter else ''}"]
    tags += [t for t, on in (("causal", causal), ("local", local), ("alibi", alibi), ("newkv", new_kv),
                             ("leftpad", lp), ("bidx", bidx), ("softcap", cap)) if on]
    return "-".join(tags + [f"splits{splits}", str(dt).split(".")[-1]])


@pytest.mark.parametrize("case", KVCACHE_CASES, ids=_case_id)
def test_flash_attn_kvcache_port(device, case):
    sq, sk, d, mha, page, rot, inter, new_eq, causal, local, alibi, new_kv, lp, bidx, splits, cap, dtype = case
    _kvcache_case(device, dtype, sq, sk, d, mha, page, rot, inter, new_eq, causal, local, alibi, new_kv, lp, bidx,
                  splits, cap, seed=sum(map(int, (sq, sk, d))))


def test_paged_equals_contiguous_cache(device):
    """The same tokens in a paged cache (pages 16) and in a contiguous one give the same answer,
    with an append, rotary, a window and ALiBi; and the paged cache's other blocks are untouched."""
    gen = torch.Generator().manual_seed(11)
    b, hq, hkv, d, page, per = 2, 4, 2, 32, 16, 6
    nb = b * per + 3
    rn = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=torch.float16)  # noqa: E731
    kp, vp = rn(nb, page, hkv, d), rn(nb, page, hkv, d)
    table = torch.randperm(nb, generator=gen)[: b * per].view(b, per).to(torch.int32).to(device)
    kc = kp[table.long().flatten()].view(b, per * page, hkv, d).clone()
    vc = vp[table.long().flatten()].view(b, per * page, hkv, d).clone()
    q, kn, vn = rn(b, 1, hq, d), rn(b, 1, hkv, d), rn(b, 1, hkv, d)
    lens = torch.tensor([70, 16], dtype=torch.int32, device=device)
    ang = torch.rand(per * page, 8, generator=gen).to(device)
    kw = dict(rotary_cos=ang.cos().half(), rotary_sin=ang.sin().half(), cache_seqlens=lens, window_size=(30, -1),
              alibi_slopes=torch.tensor([0.1, 0.2, 0.05, 0.3], device=device), return_softmax_lse=True,
              rotary_interleaved=False)
    untouched = [i for i in range(nb) if i not in table.flatten().tolist()]
    before = kp[untouched].clone()
    o_p, l_p = flash_attn_with_kvcache(q, kp, vp, kn, vn, block_table=table, **kw)
    o_c, l_c = flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert max_err(o_p, o_c.float()) <= 4 * torch.finfo(torch.float16).eps
    assert_lse_match(l_p, l_c, 30.0)
    assert torch.equal(kp[untouched], before)
    assert torch.equal(kp[table.long().flatten()].view(b, per * page, hkv, d), kc)


# ------------------------------------------------------------------ prefill entry points' options
PREFILL_CASES = [
    # b, sq, sk, hq, hkv, d, causal, window, softcap, alibi (None / "h" / "bh"), dtype
    (2, 5, 9, 4, 2, 16, True, (3, -1), 0.0, None, torch.float16),
    (1, 7, 7, 3, 3, 32, False, (2, 1), 0.0, None, torch.float32),
    (2, 6, 11, 4, 2, 16, True, (-1, -1), 5.0, None, torch.float16),
    (2, 6, 11, 4, 1, 16, True, (-1, -1), 0.0, "bh", torch.float16),
    (1, 8, 8, 2, 2, 32, False, (4, 4), 2.0, "h", torch.float32),
    (2, 9, 5, 2, 1, 16, True, (2, 0), 3.0, "h", torch.float16),
]


def _prefill_inputs(case, device):
    b, sq, sk, hq, hkv, d, causal, window, cap, alibi, dtype = case
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    rn = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rn(b, sq, hq, d), rn(b, sk, hkv, d), rn(b, sk, hkv, d)
    if cap > 0:
        q = q * cap / 2  # scores large enough for the cap to matter
    slopes = None
    if alibi:
        slopes = (torch.rand(b, hq, generator=gen) * 0.3).to(device)
        if alibi == "h":
            slopes = slopes[0].contiguous()
    return q, k, v, slopes


def _check_prefill(out, lse, q, k, v, slopes, causal, window, cap):
    """Output against flash-attn's attention_ref (fp32; error baseline: the same in q's dtype) and
    LSE against the reference of our formula (ALiBi LSE convention of flash_attn.py)."""
    b, sq, hq = q.shape[:3]
    sk = k.shape[1]
    bias = None
    if slopes is not None:
        bias = _alibi_bias(slopes if slopes.dim() == 2 else slopes.expand(b, hq), sq, sk, causal=causal)
    out_ref = _attention_ref(q, k, v, None, bias, causal=causal, window=window, softcap=cap)
    out_pt = _attention_ref(q, k, v, None, bias, causal=causal, window=window, softcap=cap, upcast=False,
                            reorder_ops=True)
    tol = out_tol(out_ref.float(), out_pt, q.dtype, ulps=8.0 if q.dtype == torch.float32 else 2.0)
    err = max_err(out, out_ref.float())
    assert out.dtype == q.dtype and err <= tol, f"output error {err:.3g} > tol {tol:.3g}"
    _, ref_l = attention_ref(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
    assert_lse_match(lse, ref_l.to(lse.device), 30.0 if slopes is not None else None)


def _prefill_id(c):
    b, sq, sk, hq, hkv, d, causal, window, cap, alibi, dtype = c
    tags = [f"b{b}q{sq}k{sk}h{hq}-{hkv}d{d}", "causal" if causal else "full"]
    tags += [f"win{window[0]}_{window[1]}"] if window != (-1, -1) else []
    tags += [f"softcap{cap}"] if cap else []
    tags += [f"alibi_{alibi}"] if alibi else []
    return "-".join(tags + [str(dtype).split(".")[-1]])


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_flash_attn_func_options(device, case):
    """flash_attn_func runs window_size / softcap / alibi_slopes in the prefill kernel."""
    causal, window, cap = case[6], case[7], case[8]
    q, k, v, slopes = _prefill_inputs(case, device)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes,
                                      return_attn_probs=True)
    assert probs is None and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    _check_prefill(out, lse, q, k, v, slopes, causal, window, cap)


@pytest.mark.parametrize("case", PREFILL_CASES[::2], ids=_prefill_id)
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged16"])
def test_flash_attn_varlen_func_options(device, case, paged):
    """flash_attn_varlen_func: the same options per sequence (lengths differ), k/v packed or in
    pages of 16 through block_table; each sequence equals flash_attn_func on it alone."""
    b, sq, sk, hq, hkv, d, causal, window, cap, alibi, dtype = case
    q, k, v, slopes = _prefill_inputs(case, device)
    lq, lk = [sq] + [max(1, sq - 2)] * (b - 1), [sk] + [max(1, sk - 3)] * (b - 1)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)  # noqa
    cu_q, cu_k = cu(lq), cu(lk)
    qp = torch.cat([q[i, sq - lq[i]:] for i in range(b)])
    kp = torch.cat([k[i, sk - lk[i]:] for i in range(b)])
    vp = torch.cat([v[i, sk - lk[i]:] for i in range(b)])
    kw = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes, return_attn_probs=True)
    if paged:
        page, per = 16, -(-sk // 16)
        gen = torch.Generator().manual_seed(3)
        nb = b * per + 2
        table = torch.randperm(nb, generator=gen)[: b * per].view(b, per).to(torch.int32).to(device)
        kc = torch.zeros(nb, page, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        for i in range(b):
            rows = torch.arange(lk[i], device=device)
            blk, off = table[i].long()[rows // page], rows % page
            kc[blk, off] = k[i, sk - lk[i]:]
            vc[blk, off] = v[i, sk - lk[i]:]
        out, lse, _ = flash_attn_varlen_func(qp, kc, vc, cu_q, cu_k, max(lq), max(lk), block_table=table, **kw)
    else:
        out, lse, _ = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max(lq), max(lk), **kw)
    assert out.shape == qp.shape and lse.shape == (hq, qp.shape[0])
    for i in range(b):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[i : i + 1])
        _check_prefill(out[None, a:e], lse[None, :, a:e], q[i : i + 1, sq - lq[i]:], k[i : i + 1, sk - lk[i]:],
                       v[i : i + 1, sk - lk[i]:], sl, causal, window, cap)


def test_prefill_bad_option_values_raise():
    """One-line errors naming the value, from flash_attn_func and flash_attn_varlen_func."""
    q = torch.randn(2, 3, 4, 16).half()
    k = torch.randn(2, 5, 2, 16).half()
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 10], dtype=torch.int32)
    fs = [lambda **kw: flash_attn_func(q, k, k, **kw),
          lambda **kw: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), cu_q, cu_k, 3, 5,
                                              **kw)]
    for f in fs:
        with pytest.raises(ValueError, match=r"window_size left must be >= -1 .*got -2"):
            f(window_size=(-2, 0))
        with pytest.raises(ValueError, match=r"window_size right must be >= -1 .*got -5"):
            f(window_size=(3, -5))
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            f(window_size=(1, 2, 3))
        with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0.*-1.0"):
            f(softcap=-1.0)
        with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[Hq\] = \[4\] or \[B, Hq\] = \[2, 4\]"):
            f(alibi_slopes=torch.ones(2))
        with pytest.raises(TypeError, match="alibi_slopes must be float32"):
            f(alibi_slopes=torch.ones(4, dtype=torch.float64))
        with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
            f(dropout_p=0.1)
    kc = torch.randn(4, 16, 2, 16).half()
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    pf = lambda kc, table: flash_attn_varlen_func(q.flatten(0, 1), kc, kc, cu_q, cu_k, 3, 5,  # noqa: E731
                                                  block_table=table)
    assert pf(kc, table).shape == (6, 4, 16)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 4 points past the cache"):
        pf(kc, torch.tensor([[0], [4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        pf(torch.randn(4, 40, 2, 16).half(), table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        pf(kc, table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \[B, max_pages_per_seq\]"):
        pf(kc, table[:1])


# ------------------------------------------------------------------------------------ bad inputs
def _paged_inputs():
    q = torch.randn(2, 1, 4, 32).half()
    kp = torch.randn(6, 16, 2, 32).half()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, kp, kp.clone(), table


def test_paged_block_table_bounds():
    """Port of flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: lengths (plus the new
    keys) past what the block table addresses raise; exactly at capacity works."""
    q = torch.randn(1, 1, 1, 64).half()
    kp = torch.randn(4, 16, 1, 64).half()
    table = torch.zeros(1, 1, dtype=torch.int32)
    kn = torch.randn(1, 1, 1, 64).half()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 16 .*plus seqlen_new = 1, at most the block table's "
                                         r"capacity max_blocks \* page_size = 16"):
        flash_attn_with_kvcache(q, kp, kp.clone(), kn, kn, cache_seqlens=torch.tensor([16], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 17 .*capacity max_blocks \* page_size = 16"):
        flash_attn_with_kvcache(q, kp, kp.clone(), cache_seqlens=torch.tensor([17], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens=17 is outside \[0, seqlen_cache=16\]"):
        flash_attn_with_kvcache(q, kp, kp.clone(), cache_seqlens=17, block_table=table)
    out = flash_attn_with_kvcache(q, kp, kp.clone(), cache_seqlens=torch.tensor([16], dtype=torch.int32),
                                  block_table=table)
    assert out.shape == (1, 1, 1, 64) and not out.isnan().any()


def test_bad_options_raise_before_writing():
    q, kp, vp, table = _paged_inputs()
    kn = torch.randn(2, 1, 2, 32).half()
    lens = torch.tensor([5, 20], dtype=torch.int32)
    before = kp.clone()
    f = lambda **kw: flash_attn_with_kvcache(q, kp, vp, kn, kn, cache_seqlens=lens, block_table=table, **kw)  # noqa
    bad = table.clone()
    bad[1, 1] = 6  # past the 6-block cache
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 6 points outside the paged cache \(num_blocks = 6"):
        flash_attn_with_kvcache(q, kp, vp, kn, kn, cache_seqlens=lens, block_table=bad)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 points outside"):
        flash_attn_with_kvcache(q, kp, vp, kn, kn, cache_seqlens=lens, block_table=bad)
    with pytest.raises(ValueError, match=r"page_size 40; it must be a positive multiple of 16"):
        kp40 = torch.randn(6, 40, 2, 32).half()
        flash_attn_with_kvcache(q, kp40, kp40, cache_seqlens=lens, block_table=table)
    with pytest.raises(TypeError, match="block_table must be an int32 tensor"):
        flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \[batch=2, max_blocks\]"):
        flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table[:1])
    with pytest.raises(ValueError, match="does not take cache_batch_idx"):
        f(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"window_size left must be >= -1 .*got -2"):
        f(window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0.*-1.0"):
        f(softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[Hq\] = \[4\] or \[B, Hq\] = \[2, 4\], got \(2,\)"):
        f(alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match="alibi_slopes must be fp32"):
        f(alibi_slopes=torch.ones(4, dtype=torch.float64))
    c = torch.randn(32, 8).half()
    with pytest.raises(ValueError, match="pass both rotary_cos and rotary_sin"):
        f(rotary_cos=c)
    with pytest.raises(ValueError, match="the tables must cover the cache"):
        f(rotary_cos=c[:20], rotary_sin=c[:20])
    with pytest.raises(ValueError, match=r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 40 must be in \[2, head_dim=32\]"):
        f(rotary_cos=torch.randn(32, 20).half(), rotary_sin=torch.randn(32, 20).half())
    with pytest.raises(ValueError, match="k and v must be given"):
        flash_attn_with_kvcache(q, kp, vp, rotary_cos=c, rotary_sin=c, cache_seqlens=lens, block_table=table)
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = 7 must be in \[0, 6\]"):
        f(cache_leftpad=torch.tensor([7, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        f(num_splits=-1)
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        f(rotary_interleaved="yes")
    assert torch.equal(kp, before), "a refused call must not write the cache"


# ------------------------------------------------------------------------------- compile / graphs
class PagedStep(torch.nn.Module):
    """One decode step of a model with a paged cache: rotary + append into pages + windowed,
    soft-capped ALiBi attention over the pages, all through flash_attn_with_kvcache."""

    def forward(self, q, k, v, kp, vp, table, lens, cos, sin, slopes, leftpad):
        return flash_attn_with_kvcache(q, kp, vp, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                       cache_leftpad=leftpad, block_table=table, causal=True, window_size=(20, -1),
                                       softcap=3.0, alibi_slopes=slopes, return_softmax_lse=True)


def _step_inputs(device, dtype=torch.float32, b=2, hq=4, hkv=2, d=16, page=16, per=4, seed=0, lens=(37, 5),
                 leftpad=(3, 0)):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    nb = b * per + 1
    kp, vp = rn(nb, page, hkv, d), rn(nb, page, hkv, d)
    table = torch.randperm(nb, generator=gen)[: b * per].view(b, per).to(torch.int32).to(device)
    ang = torch.rand(per * page, d // 4, generator=gen).to(device)
    return (rn(b, 1, hq, d), rn(b, 1, hkv, d), rn(b, 1, hkv, d), kp, vp, table,
            torch.tensor(lens, dtype=torch.int32, device=device), ang.cos().to(dtype), ang.sin().to(dtype),
            torch.linspace(0.05, 0.4, hq, device=device), torch.tensor(leftpad, dtype=torch.int32, device=device))


def test_paged_step_compiles_fullgraph_and_calls_the_ops():
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    args = _step_inputs("cpu")
    args2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad(), cpu_backend("reference"):
        ref = PagedStep()(*args)
        out = torch.compile(PagedStep(), fullgraph=True, backend=record)(*args2)
    for a, b in zip(out, ref):
        assert max_err(a, b) <= 1e-5
    assert torch.equal(args2[3], args[3]) and torch.equal(args2[4], args[4]), "append into pages under compile"
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    for name in ("rotary_emb", "kvcache_append_", "paged_decode_attn_with_lse"):
        assert any(f"xoffload.{name}" in t for t in targets), (name, targets)


def test_paged_step_aot_eager_equals_eager():
    torch._dynamo.reset()
    args = _step_inputs("cpu", seed=1)
    args2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad(), cpu_backend("reference"):
        ref = PagedStep()(*args)
        out = torch.compile(PagedStep(), fullgraph=True, backend="aot_eager")(*args2)
    for a, b in zip(out, ref):
        assert max_err(a, b) <= 1e-5
    assert torch.equal(args2[3], args[3])


# ------------------------------------------------------------------------------------------ GPU
def _gpu_cases():
    """A deterministic selection of flash-attn's kvcache grid: each (seqlen_q, seqlen_k) pair with
    each cache layout (contiguous, pages of 16 and 256), the other options drawn per case."""
    pairs = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
             (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
    rng = random.Random(0)
    cases = []
    for sq, sk in pairs:
        for page in (None, 16, 256):
            new_kv = rng.random() < 0.7 and not sq > sk
            rot = rng.choice([0.0, 0.5, 1.0]) if new_kv else 0.0
            cases.append((sq, sk, rng.choice([32, 59, 64, 80, 128, 256]), rng.choice(["mha", "mqa", "gqa"]), page,
                          rot, rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.4,
                          rng.random() < 0.4, new_kv, rng.random() < 0.3, page is None and rng.random() < 0.3,
                          rng.choice([0, 1]), rng.choice([0.0, 0.0, 30.0])))
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: _case_id(c + (torch.bfloat16,)))
def test_flash_attn_kvcache_port_gpu(case, dtype):
    sq, sk, d, mha, page, rot, inter, new_eq, causal, local, alibi, new_kv, lp, bidx, splits, cap = case
    _kvcache_case("cuda", dtype, sq, sk, d, mha, page, rot, inter, new_eq, causal, local, alibi, new_kv, lp, bidx,
                  splits, cap, seed=sq + sk + d)


@pytest.mark.cuda
@pytest.mark.parametrize("page", [16, 256])
def test_race_condition_gpu(page):
    """flash-attn's race-condition test for the decode path: ten calls give the same bits."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, sk = 4, 32, 8, 128, 20000
    per = -(-sk // page)
    kp = torch.randn(b * per, page, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    vp = torch.randn(b * per, page, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    table = torch.randperm(b * per, generator=gen).view(b, per).to(torch.int32).cuda()
    q = torch.randn(b, 1, hq, d, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.tensor([20000, 1, 777, 12345], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens, block_table=table, window_size=(4096, -1), softcap=30.0, return_softmax_lse=True)
    o0, l0 = flash_attn_with_kvcache(q, kp, vp, **kw)
    for _ in range(10):
        o, l = flash_attn_with_kvcache(q, kp, vp, **kw)
        assert torch.equal(o, o0) and torch.equal(l, l0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_paged_rotary_step_replayed(dtype):
    """A paged decode step (rotary on q and k, append into pages, windowed soft-capped ALiBi
    attention, lengths += 1) captured once and replayed 30 times equals the eager step bit for bit."""
    args = _step_inputs("cuda", dtype, b=3, hq=32, hkv=8, d=128, page=16, per=80, seed=5, lens=(37, 5, 900),
                        leftpad=(3, 0, 100))
    q, k, v, kp, vp, table, lens, cos, sin, slopes, lp = args
    e_kp, e_vp, e_lens = kp.clone(), vp.clone(), lens.clone()
    sq_, sk_, sv_ = q.clone(), k.clone(), v.clone()
    step = PagedStep()

    def run(qq, kk, vv, kpp, vpp, ll):
        out = step(qq, kk, vv, kpp, vpp, table, ll, cos, sin, slopes, lp)
        ll.add_(1)
        return out

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(sq_, sk_, sv_, kp.clone(), vp.clone(), lens.clone())
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_out, g_lse = run(sq_, sk_, sv_, kp, vp, lens)
        gen = torch.Generator().manual_seed(6)
        for i in range(30):
            qi = torch.randn(q.shape, generator=gen).to("cuda", dtype)
            ki = torch.randn(k.shape, generator=gen).to("cuda", dtype)
            vi = torch.randn(v.shape, generator=gen).to("cuda", dtype)
            sq_.copy_(qi)
            sk_.copy_(ki)
            sv_.copy_(vi)
            g.replay()
            e_out, e_lse = run(qi, ki, vi, e_kp, e_vp, e_lens)
            assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse), f"replay {i}"
        torch.cuda.synchronize()
        assert torch.equal(kp, e_kp) and torch.equal(lens, e_lens)


@pytest.mark.cuda
def test_paged_decode_op_inside_cuda_graph():
    """torch.ops.xoffload.paged_decode_attn_with_lse itself is capturable (no host read)."""
    args = _step_inputs("cuda", torch.float16, seed=7)
    q, _, _, kp, vp, table, lens, *_ = args
    t3 = table[:, None, :]
    with torch.no_grad():
        torch.ops.xoffload.paged_decode_attn_with_lse(q, kp, vp, t3, lens, None, None, True, 20, -1, 3.0)  # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.xoffload.paged_decode_attn_with_lse(q, kp, vp, t3, lens, None, None, True, 20, -1, 3.0)
        lens.add_(9)
        g.replay()
        ref = torch.ops.xoffload.paged_decode_attn_with_lse(q, kp, vp, t3, lens, None, None, True, 20, -1, 3.0)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
