"""flash-attn 2 style API (xoffload.integrations.flash_api): signatures, results against the fp32
references, in-place KV-cache append, return conventions and errors for unsupported options.

CPU runs use the Triton interpreter (conftest) with tiny shapes; ``@pytest.mark.cuda`` tests
repeat the checks in fp16/bf16 on the GPU."""
import inspect

import pytest
import torch

from helpers import assert_lse_match, max_err, out_tol, sdpa_in_dtype
from xoffload.integrations.flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from xoffload.kernels import reference as R

# flash-attn 2.x signatures (flash_attn/flash_attn_interface.py): name -> (param, default) in order
FA2_SIGNATURES = {
    flash_attn_func: [
        ("q", None), ("k", None), ("v", None), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
        ("return_attn_probs", False),
    ],
    flash_attn_varlen_func: [
        ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
        ("max_seqlen_q", None), ("max_seqlen_k", None), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
    ],
    flash_attn_with_kvcache: [
        ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False),
    ],
}
EMPTY = inspect.Parameter.empty


@pytest.mark.parametrize("fn", list(FA2_SIGNATURES), ids=lambda f: f.__name__)
def test_signature_matches_flash_attn(fn):
    params = list(inspect.signature(fn).parameters.values())
    want = FA2_SIGNATURES[fn]
    assert [p.name for p in params] == [n for n, _ in want]
    for p, (name, default) in zip(params, want):
        if p.default is EMPTY:
            assert default is None, name  # required positional in flash-attn too
        else:
            assert p.default == default, (name, p.default, default)
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, name


def _rand(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _check_out(out, ref_out, base, dtype):
    assert out.dtype == dtype
    err = max_err(out, ref_out)
    tol = out_tol(ref_out, base, dtype)
    assert err <= tol, f"output error {err:.3g} > tol {tol:.3g}"


def _dtypes(device):
    return [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float16, torch.float32]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 7, 4, 2, 16), (1, 9, 4, 3, 3, 32)], ids=["sq<sk-gqa", "sq>sk-mha"])
def test_flash_attn_func_matches_reference(device, shape, causal):
    b, sq, sk, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(1)
    for dtype in _dtypes(device):
        q = _rand(b, sq, hq, d, dtype=dtype, device=device, gen=gen)
        k = _rand(b, sk, hkv, d, dtype=dtype, device=device, gen=gen)
        v = _rand(b, sk, hkv, d, dtype=dtype, device=device, gen=gen)
        out = flash_attn_func(q, k, v, causal=causal)
        assert isinstance(out, torch.Tensor) and out.shape == (b, sq, hq, d)
        ref_o, ref_l = R.attention_ref(q, k, v, causal=causal)
        _check_out(out, ref_o, sdpa_in_dtype(q, k, v, causal=causal), dtype)
        out2, lse, probs = flash_attn_func(q, k, v, 0.0, 0.3, causal, return_attn_probs=True)
        assert probs is None
        assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
        ref_o, ref_l = R.attention_ref(q, k, v, causal=causal, softmax_scale=0.3)
        _check_out(out2, ref_o, sdpa_in_dtype(q, k, v, causal=causal, softmax_scale=0.3), dtype)
        assert_lse_match(lse.cpu(), ref_l.cpu())


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_matches_reference(device, causal):
    gen = torch.Generator().manual_seed(2)
    lens_q, lens_k = [3, 1, 6], [5, 4, 6]
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 9, 15], dtype=torch.int32, device=device)
    for dtype in _dtypes(device):
        q = _rand(10, 4, 16, dtype=dtype, device=device, gen=gen)
        k = _rand(15, 2, 16, dtype=dtype, device=device, gen=gen)
        v = _rand(15, 2, 16, dtype=dtype, device=device, gen=gen)
        out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                 return_attn_probs=True)
        assert probs is None and out.shape == (10, 4, 16) and lse.shape == (4, 10)
        ref_o, ref_l = R.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
        base = torch.cat([
            sdpa_in_dtype(q[None, a:b_], k[None, c:d_], v[None, c:d_], causal=causal)[0]
            for a, b_, c, d_ in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
        ])
        _check_out(out, ref_o, base, dtype)
        assert_lse_match(lse.cpu(), ref_l.cpu())
        only = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=causal)
        assert isinstance(only, torch.Tensor) and torch.equal(only, out)


def _kvcache_reference(q, k_cache, v_cache, lens, rows, causal, scale=None):
    """Per item: dense attention of q[i] over cache row rows[i]'s first lens[i] tokens."""
    outs, lses, bases = [], [], []
    for i, (n, r) in enumerate(zip(lens, rows)):
        o, l = R.attention_ref(q[i : i + 1], k_cache[r : r + 1, :n], v_cache[r : r + 1, :n], causal=causal,
                               softmax_scale=scale)
        outs.append(o)
        lses.append(l)
        bases.append(sdpa_in_dtype(q[i : i + 1], k_cache[r : r + 1, :n], v_cache[r : r + 1, :n], causal=causal,
                                   softmax_scale=scale))
    return torch.cat(outs), torch.cat(lses), torch.cat(bases)


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_appends_in_place_and_attends(device, sq, causal):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    b, s_max, hq, hkv, d, s_new = 3, 16, 4, 2, 16, 2
    k_cache = _rand(b, s_max, hkv, d, dtype=dtype, device=device, gen=gen)
    v_cache = _rand(b, s_max, hkv, d, dtype=dtype, device=device, gen=gen)
    seqlens = torch.tensor([5, 0, 11], dtype=torch.int32, device=device)
    q = _rand(b, sq, hq, d, dtype=dtype, device=device, gen=gen)
    k = _rand(b, s_new, hkv, d, dtype=dtype, device=device, gen=gen)
    v = _rand(b, s_new, hkv, d, dtype=dtype, device=device, gen=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True)
    assert torch.equal(seqlens.cpu(), torch.tensor([5, 0, 11], dtype=torch.int32)), "cache_seqlens must not change"
    # exactly the new positions changed, to exactly k / v
    exp_k, exp_v = k_before.clone(), v_before.clone()
    for i, n in enumerate([5, 0, 11]):
        exp_k[i, n : n + s_new] = k[i]
        exp_v[i, n : n + s_new] = v[i]
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    ref_o, ref_l, base = _kvcache_reference(q, k_cache, v_cache, [7, 2, 13], [0, 1, 2], causal)
    _check_out(out, ref_o, base, dtype)
    assert_lse_match(lse.cpu(), ref_l.cpu())


def test_kvcache_int_seqlens_batch_idx_and_full_cache(device):
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    k_cache = _rand(4, 10, 1, 16, dtype=dtype, device=device, gen=gen)
    v_cache = _rand(4, 10, 1, 16, dtype=dtype, device=device, gen=gen)
    q = _rand(2, 1, 2, 16, dtype=dtype, device=device, gen=gen)
    # int cache_seqlens, no new tokens
    out = flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2], cache_seqlens=6)
    ref_o, _, base = _kvcache_reference(q, k_cache, v_cache, [6, 6], [0, 1], False)
    _check_out(out, ref_o, base, dtype)
    # cache_seqlens None: the whole cache
    out = flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2])
    ref_o, _, base = _kvcache_reference(q, k_cache, v_cache, [10, 10], [0, 1], False)
    _check_out(out, ref_o, base, dtype)
    # cache_batch_idx: item i uses cache row idx[i]; the append goes to that row
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    kn = _rand(2, 1, 1, 16, dtype=dtype, device=device, gen=gen)
    vn = _rand(2, 1, 1, 16, dtype=dtype, device=device, gen=gen)
    before = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=torch.tensor([2, 4], dtype=torch.int32,
                                  device=device), cache_batch_idx=idx)
    assert torch.equal(k_cache[3, 2], kn[0, 0]) and torch.equal(k_cache[1, 4], kn[1, 0])
    changed = (k_cache != before).any(-1).any(-1).nonzero().tolist()
    assert changed == [[1, 4], [3, 2]]
    ref_o, _, base = _kvcache_reference(q, k_cache, v_cache, [3, 5], [3, 1], False)
    _check_out(out, ref_o, base, dtype)


def test_unsupported_options_are_named():
    """The prefill entry points refuse dropout (inference only), named; their other options run
    (tests/integrations/test_flash_api_options.py)."""
    q = torch.randn(1, 2, 2, 8, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        cu = torch.tensor([0, 2], dtype=torch.int32)
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 2, 2, dropout_p=0.1)


def test_supported_table_turns_options_on_per_entry_point(monkeypatch):
    """One entry of _SUPPORTED turns an option on for one entry point (the others still refuse)."""
    from xoffload.integrations import flash_api

    assert {"window_size", "softcap", "alibi_slopes"} <= flash_api._SUPPORTED["flash_attn_func"]
    assert "block_table" in flash_api._SUPPORTED["flash_attn_varlen_func"]
    assert "dropout_p" not in set().union(*flash_api._SUPPORTED.values())
    monkeypatch.setitem(flash_api._SUPPORTED, "flash_attn_func", frozenset({"softcap"}))
    monkeypatch.setitem(flash_api._SUPPORTED, "flash_attn_varlen_func", frozenset())
    flash_api._unsupported("flash_attn_func", dropout_p=0.0, softcap=30.0)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_api._unsupported("flash_attn_varlen_func", softcap=30.0)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_api._unsupported("flash_attn_func", window_size=(3, 0))


def test_bad_dtype_layout_and_shapes():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match="int32|dtype"):
        flash_attn_func(q.to(torch.int32), q.to(torch.int32), q.to(torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q, q.float(), q.float())
    strided = torch.randn(1, 4, 2, 16, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        flash_attn_func(strided, q, q)
    with pytest.raises(ValueError, match="heads"):
        flash_attn_func(torch.randn(1, 4, 3, 8, dtype=torch.float16), q, q)
    k_cache = torch.zeros(1, 6, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, q[:, :1], q[:, :1])  # append needs cache_seqlens
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, cache_seqlens=torch.tensor([1]))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, cache_seqlens=7)
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, k=q[:, :1], cache_seqlens=1)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        flash_attn_with_kvcache(q[:, :1], k_cache.float(), k_cache.float(), cache_seqlens=1)
    with pytest.raises(ValueError, match="k has shape"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, k=q[:, :1, :1], v=q[:, :1, :1], cache_seqlens=1)
    with pytest.raises(ValueError, match="batch"):
        flash_attn_with_kvcache(torch.randn(2, 1, 2, 8, dtype=torch.float16), k_cache, k_cache, cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_seqlens"):  # Sq > 1 path reads and checks lengths
        flash_attn_with_kvcache(q[:, :2], k_cache, k_cache, q[:, :2], q[:, :2],
                                cache_seqlens=torch.tensor([5], dtype=torch.int32))


def test_requires_grad_is_rejected():
    q = torch.randn(1, 2, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="forward-only"):
        flash_attn_func(q, q, q)
    with torch.no_grad():
        out = flash_attn_func(q, q, q)
    assert not out.requires_grad


def test_top_level_lazy_names():
    import xoffload.integrations as integ

    assert integ.flash_attn_func is flash_attn_func
    assert integ.flash_attn_varlen_func is flash_attn_varlen_func
    assert integ.flash_attn_with_kvcache is flash_attn_with_kvcache


def test_adversarial_inputs_raise():
    """Found by trying to break the API: a string ``causal`` (truthy) and a negative cache length
    (would wrap to the cache's last slot) must raise, and the cache must be left untouched."""
    q = torch.randn(2, 3, 2, 8)
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q, q[:, :, :1], q[:, :, :1], causal="False")
    kc = torch.zeros(2, 6, 1, 8)
    vc = torch.zeros(2, 6, 1, 8)
    kn = torch.ones(2, 1, 1, 8)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(torch.randn(2, 1, 2, 8), kc, vc, kn, kn,
                                cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32))
    assert not kc.any() and not vc.any()
    from xoffload.integrations.ops import kvcache_append

    with pytest.raises(IndexError):
        kvcache_append(kc, vc, kn, kn, torch.tensor([-1, 0], dtype=torch.int32))
    assert not kc[0].any()
