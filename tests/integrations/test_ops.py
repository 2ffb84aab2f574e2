"""torch.library custom ops (xoffload.integrations.ops): registration and schemas, fake (meta)
implementations, opcheck, torch.compile(fullgraph=True) equal to eager, and on the GPU
(``@pytest.mark.cuda``) Inductor-compiled equal to eager and a CUDA-graph-captured decode step
replayed 100 times equal to eager."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import max_err
from xoffload.integrations import flash_api, ops
from xoffload.kernels import cpu_backend


def _t(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def test_ops_registered_with_schemas():
    for name in ops.OP_NAMES:
        assert hasattr(torch.ops.xoffload, name), name
    sch = torch.ops.xoffload.kvcache_append_.default._schema
    written = [a.name for a in sch.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"] and len(sch.returns) == 0
    assert ops.MUTATING_OPS == ("kvcache_append_",)
    for name in ops.OP_NAMES:  # the functional ops write nothing
        if name in ops.MUTATING_OPS:
            continue
        sch = getattr(torch.ops.xoffload, name).default._schema
        assert all(a.alias_info is None for a in sch.arguments), name
    schema = str(torch.ops.xoffload.flash_attn_with_lse.default._schema)
    assert "bool causal" in schema and "float? softmax_scale" in schema and "-> (Tensor, Tensor)" in schema
    schema = str(torch.ops.xoffload.decode_attn_with_lse.default._schema)
    assert "Tensor cache_seqlens" in schema
    for name in ("decode_attn_with_lse", "paged_decode_attn_with_lse"):
        schema = str(getattr(torch.ops.xoffload, name).default._schema)
        for arg in ("bool causal=False", "window_left=-1", "window_right=-1", "float softcap=0.",
                    "Tensor? alibi_slopes=None", "Tensor? cache_leftpad=None", "num_splits=None"):
            assert arg in schema, (name, arg, schema)
    for name in ("flash_attn_with_lse", "flash_attn_varlen_with_lse"):
        schema = str(getattr(torch.ops.xoffload, name).default._schema)
        for arg in ("window_left=-1", "window_right=-1", "float softcap=0.", "Tensor? alibi_slopes=None",
                    "Tensor? block_table=None", "Tensor? seqused_k=None"):
            assert arg in schema, (name, arg, schema)
    assert "Tensor? cache_batch_idx=None" in str(torch.ops.xoffload.decode_attn_with_lse.default._schema)
    assert "Tensor? block_table=None" in str(torch.ops.xoffload.kvcache_append_.default._schema)


def _op_cases(device="cpu", dtype=torch.float32):
    q = _t(2, 3, 4, 16, dtype=dtype, device=device, seed=1)
    k = _t(2, 5, 2, 16, dtype=dtype, device=device, seed=2)
    v = _t(2, 5, 2, 16, dtype=dtype, device=device, seed=3)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    kc = _t(2, 8, 2, 16, dtype=dtype, device=device, seed=4)
    vc = _t(2, 8, 2, 16, dtype=dtype, device=device, seed=5)
    lens = torch.tensor([3, 8], dtype=torch.int32, device=device)
    lse = _t(2, 4, 3, device=device, seed=6)
    kp = _t(4, 16, 2, 16, dtype=dtype, device=device, seed=11)  # block store [num_blocks, page, Hkv, D]
    vp = _t(4, 16, 2, 16, dtype=dtype, device=device, seed=12)
    table = torch.tensor([[[2, 0]], [[1, 3]]], dtype=torch.int32, device=device)
    pos = torch.tensor([0, 5], dtype=torch.int32, device=device)
    ang = _t(12, 4, device=device, seed=13)
    return {
        "flash_attn_with_lse": (q, k, v, True, None),
        "flash_attn_varlen_with_lse": (q.reshape(6, 4, 16), k.reshape(10, 2, 16), v.reshape(10, 2, 16),
                                       cu_q, cu_k, 4, 7, True, 0.25),
        "decode_attn_with_lse": (q[:, :1], kc, vc, lens, None),
        "paged_decode_attn_with_lse": (q[:, :2], kp, vp, table, torch.tensor([20, 32], dtype=torch.int32,
                                                                              device=device), None, None),
        "rotary_emb": (q, ang.cos().to(dtype), ang.sin().to(dtype), pos, True, False),
        "merge_attention_states": (q, lse, q * 2, lse - 1),
        "kvcache_append_": (kc.clone(), vc.clone(), k[:, :2], v[:, :2], torch.tensor([1, 6], dtype=torch.int32,
                                                                                  device=device), None),
    }


def test_fake_implementations_give_real_shapes():
    cases = _op_cases()
    with cpu_backend("reference"):
        real = {n: getattr(torch.ops.xoffload, n)(*a) for n, a in cases.items() if n != "kvcache_append_"}
    with FakeTensorMode() as mode:
        for name, args in cases.items():
            fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            res = getattr(torch.ops.xoffload, name)(*fargs)
            if name == "kvcache_append_":
                assert res is None
                continue
            res, rr = (res, real[name]) if isinstance(res, tuple) else ((res,), (real[name],))
            for f, r in zip(res, rr):
                assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride(), name


def _option_cases(device="cpu", dtype=torch.float32):
    """The prefill and decode ops with their options set (window, softcap, ALiBi, paged K/V,
    seqused_k, left pad, batch index, Sq > 1)."""
    c = _op_cases(device, dtype)
    fq, fk, fv = c["flash_attn_with_lse"][:3]
    vq, vk, vv, cu_q, cu_k = c["flash_attn_varlen_with_lse"][:5]
    q, kc, vc, lens, _ = c["decode_attn_with_lse"]
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], device=device)
    lp = torch.tensor([1, 2], dtype=torch.int32, device=device)
    bidx = torch.tensor([1, 0], dtype=torch.int32, device=device)
    qq, kp, vp, table, plens, _, _ = c["paged_decode_attn_with_lse"]
    ptab = table[:, 0]  # [B, 2] blocks of 16 tokens
    return [
        ("flash_attn_with_lse", (fq, fk, fv, True, None, 2, -1, 4.0, slopes, None, None)),
        ("flash_attn_with_lse", (fq, kp, vp, False, 0.3, 8, 3, 0.0, slopes[None].expand(2, 4).contiguous(), ptab,
                                 torch.tensor([20, 9], dtype=torch.int32, device=device))),
        ("flash_attn_varlen_with_lse", (vq, vk, vv, cu_q, cu_k, 4, 7, True, None, 1, -1, 2.0, slopes, None, None)),
        ("flash_attn_varlen_with_lse", (vq, kp, vp, cu_q, cu_k, 4, 7, False, None, -1, 2, 0.0, None, ptab, None)),
        ("decode_attn_with_lse", (q, kc, vc, lens, 0.3, True, 3, -1, 5.0, slopes, lp, bidx, 2)),
        ("decode_attn_with_lse", (c["flash_attn_with_lse"][0], kc, vc, lens, None, True, -1, 0, 0.0, slopes[None].expand(2, 4).contiguous(), None, None, None)),
        ("paged_decode_attn_with_lse", (qq, kp, vp, table, plens, 16, None, True, 7, -1, 2.0, slopes, lp, 3)),
        ("paged_decode_attn_with_lse", (qq[:, :1], kp.reshape(64, 2, 16), vp.reshape(64, 2, 16),
                                        table * 16, plens, 16, None)),
        ("kvcache_append_", (kp.clone(), vp.clone(), qq[:, :, :2], qq[:, :, :2], torch.tensor([3, 15], dtype=torch.int32,
                                                                                         device=device), None,
                             table[:, 0])),
    ]


@pytest.mark.parametrize("case", [(n, None) for n in ops.OP_NAMES] + [(n, i) for i, (n, _) in enumerate(_option_cases())],
                         ids=lambda c: c[0] + ("" if c[1] is None else f"-options{c[1]}"))
def test_opcheck(case):
    name, i = case
    args = _op_cases()[name] if i is None else _option_cases()[i][1]
    with cpu_backend("reference"):
        torch.library.opcheck(getattr(torch.ops.xoffload, name).default, args)


@pytest.mark.parametrize("backend", ["reference", "interpreter"])
def test_merge_op_takes_lse_views(backend):
    """The merge op takes LSEs of any strides (transposed [S, H].t() views, slices): it equals the
    kernel on contiguous copies, its fake gives the real shapes and strides, and opcheck passes."""
    s, h, d = 5, 4, 16
    oa = _t(s, h, d, seed=21)
    ob = _t(s, h, d, seed=22)
    la = _t(s, h, seed=23).t()  # [H, S], strides (1, H)
    lb = _t(h, 2 * s, seed=24)[:, ::2]  # [H, S], strides (2S, 2)
    with cpu_backend(backend):
        o, lse = torch.ops.xoffload.merge_attention_states(oa, la, ob, lb)
        ro, rl = ops.merge(oa, la.contiguous(), ob, lb.contiguous())
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    with FakeTensorMode() as mode:
        fo, fl = torch.ops.xoffload.merge_attention_states(*(mode.from_tensor(x) for x in (oa, la, ob, lb)))
    for f, r in ((fo, o), (fl, lse)):
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()
    with cpu_backend("reference"):
        torch.library.opcheck(torch.ops.xoffload.merge_attention_states.default, (oa, la, ob, lb))


def test_kvcache_append_op_mutates_in_place():
    kc = torch.zeros(2, 6, 1, 4)
    vc = torch.zeros(2, 6, 1, 4)
    k = torch.ones(2, 2, 1, 4)
    torch.ops.xoffload.kvcache_append_(kc, vc, k, 2 * k, torch.tensor([0, 3], dtype=torch.int32), None)
    written = kc[..., 0, 0]
    assert written.tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0]]
    assert torch.equal(vc, 2 * kc)
    torch.ops.xoffload.kvcache_append_(kc, vc, 3 * k[:1], 3 * k[:1], torch.tensor([4], dtype=torch.int32),
                                       torch.tensor([1], dtype=torch.int32))
    assert kc[1, :, 0, 0].tolist() == [0, 0, 0, 1, 3, 3]


class TinyDecoder(torch.nn.Module):
    """Toy attention block using the flash-style API: a prefill chunk (dense kernel, causal over a
    cached prefix), a decode step that appends to a static cache (in-place op + decode kernel) and
    an LSE merge of two halves. Everything the custom ops cover, in one graph."""

    def __init__(self, d_model=32, hq=4, hkv=2, d=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.wq = torch.nn.Parameter(torch.randn(d_model, hq * d, generator=g) / d_model ** 0.5, requires_grad=False)
        self.wk = torch.nn.Parameter(torch.randn(d_model, hkv * d, generator=g) / d_model ** 0.5, requires_grad=False)
        self.wv = torch.nn.Parameter(torch.randn(d_model, hkv * d, generator=g) / d_model ** 0.5, requires_grad=False)

    def forward(self, x, x_new, k_cache, v_cache, cache_seqlens):
        b, s, _ = x.shape
        q = (x @ self.wq).view(b, s, self.hq, self.d)
        k = (x @ self.wk).view(b, s, self.hkv, self.d)
        v = (x @ self.wv).view(b, s, self.hkv, self.d)
        prefill = flash_api.flash_attn_func(q, k, v, causal=True)
        # the same attention as an LSE merge of the first / second half of the keys (non-causal rows)
        h = s // 2
        o1, l1, _ = flash_api.flash_attn_func(q, k[:, :h], v[:, :h], return_attn_probs=True)
        o2, l2, _ = flash_api.flash_attn_func(q, k[:, h:], v[:, h:], return_attn_probs=True)
        merged, _ = ops.merge(o1, l1, o2, l2)
        # decode step: append the new token's k/v into the static cache and attend
        qn = (x_new @ self.wq).view(b, 1, self.hq, self.d)
        kn = (x_new @ self.wk).view(b, 1, self.hkv, self.d)
        vn = (x_new @ self.wv).view(b, 1, self.hkv, self.d)
        dec = flash_api.flash_attn_with_kvcache(qn, k_cache, v_cache, kn, vn, cache_seqlens=cache_seqlens)
        return prefill.sum(-1) + merged.sum(-1), dec


def _decoder_inputs(device, dtype=torch.float32):
    x = _t(2, 6, 32, dtype=dtype, device=device, seed=7)
    x_new = _t(2, 1, 32, dtype=dtype, device=device, seed=8)
    kc = _t(2, 16, 2, 8, dtype=dtype, device=device, seed=9)
    vc = _t(2, 16, 2, 8, dtype=dtype, device=device, seed=10)
    lens = torch.tensor([4, 11], dtype=torch.int32, device=device)
    return x, x_new, kc, vc, lens


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_equals_eager_cpu(backend):
    torch._dynamo.reset()
    model = TinyDecoder()
    x, x_new, kc, vc, lens = _decoder_inputs("cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    with torch.no_grad(), cpu_backend("reference"):
        ref = model(x, x_new, kc, vc, lens)
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        out = compiled(x, x_new, kc2, vc2, lens)
    for a, b in zip(out, ref):
        assert max_err(a, b) <= 1e-5
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc), "in-place cache append must happen under compile"


def test_compiled_graph_calls_the_custom_ops():
    """Dynamo captures one graph whose attention nodes are the xoffload ops (kernels opaque)."""
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TinyDecoder()
    x, x_new, kc, vc, lens = _decoder_inputs("cpu")
    with torch.no_grad(), cpu_backend("reference"):
        torch.compile(model, fullgraph=True, backend=record)(x, x_new, kc, vc, lens)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    for name in ("flash_attn_with_lse", "merge_attention_states", "kvcache_append_", "decode_attn_with_lse"):
        assert any(f"xoffload.{name}" in t for t in targets), (name, targets)


def test_prefill_options_compile_fullgraph_equals_eager():
    """flash_attn_func / flash_attn_varlen_func with window, softcap, ALiBi (and a paged varlen
    call) trace into one graph of the prefill ops, equal to eager."""
    torch._dynamo.reset()
    c = _op_cases()
    q, k, v = c["flash_attn_with_lse"][:3]
    vq, _, _, cu_q, cu_k = c["flash_attn_varlen_with_lse"][:5]
    kp, vp, table = c["paged_decode_attn_with_lse"][1], c["paged_decode_attn_with_lse"][2], c["paged_decode_attn_with_lse"][3]
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def f(q, k, v, vq, kp, vp, table, slopes):
        a = flash_api.flash_attn_func(q, k, v, causal=True, window_size=(2, -1), softcap=4.0, alibi_slopes=slopes)
        b = flash_api.flash_attn_varlen_func(vq, kp, vp, cu_q, cu_k, 4, 7, causal=True, window_size=(3, 0),
                                             softcap=2.0, alibi_slopes=slopes, block_table=table[:, 0])
        return a, b

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    args = (q, k, v, vq, kp, vp, table, slopes)
    with torch.no_grad(), cpu_backend("reference"):
        ref = f(*args)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
        torch._dynamo.reset()
        torch.compile(f, fullgraph=True, backend=record)(*args)
    for a, b in zip(out, ref):
        assert max_err(a, b) <= 1e-5
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    for name in ("flash_attn_with_lse", "flash_attn_varlen_with_lse"):
        assert any(f"xoffload.{name}" in t for t in targets), (name, targets)


def test_transformers_attention_compiles_fullgraph():
    """The "xoffload" attention function traces without graph breaks (no-mask path)."""
    pytest.importorskip("transformers")
    import types

    import xoffload.integrations.transformers as xt

    torch._dynamo.reset()
    mod = types.SimpleNamespace(is_causal=True)
    q, k, v = _t(1, 4, 5, 8, seed=1), _t(1, 2, 5, 8, seed=2), _t(1, 2, 5, 8, seed=3)

    def f(q, k, v):
        prefill = xt.xoffload_attention_forward(mod, q, k, v, None)[0]
        decode = xt.xoffload_attention_forward(mod, q[:, :, -1:], k, v, None)[0]
        return prefill, decode

    with torch.no_grad(), cpu_backend("reference"):
        ref = f(q, k, v)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    for a, b in zip(out, ref):
        assert max_err(a, b) <= 1e-5


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inductor_compile_equals_eager_gpu(dtype):
    torch._dynamo.reset()
    model = TinyDecoder().cuda().to(dtype)
    x, x_new, kc, vc, lens = _decoder_inputs("cuda", dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    with torch.no_grad():
        ref = model(x, x_new, kc, vc, lens)
        out = torch.compile(model, fullgraph=True)(x, x_new, kc2, vc2, lens)
    for a, b in zip(out, ref):
        # Inductor fuses the sums (and may pick other GEMM tiles): a few ulps of the largest value
        tol = 8 * torch.finfo(dtype).eps * max(1.0, float(b.float().abs().max()))
        assert max_err(a, b) <= tol
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_graph_decode_step_replayed_100_times(dtype):
    """One decode step (append k/v at cache_seqlens, split-KV attention, cache_seqlens += 1) is
    captured once and replayed 100 times with new inputs; every replay equals the eager step on a
    separate cache, bit for bit (same kernels, same split count: chosen from shapes only)."""
    b, s_max, hq, hkv, d = 3, 4096, 8, 2, 64
    dev = "cuda"
    k_cache = torch.zeros(b, s_max, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    seqlens = torch.tensor([7, 100, 1500], dtype=torch.int32, device=dev)
    k_cache[:, :1500] = _t(b, 1500, hkv, d, dtype=dtype, device=dev, seed=1)
    v_cache[:, :1500] = _t(b, 1500, hkv, d, dtype=dtype, device=dev, seed=2)
    e_k, e_v, e_len = k_cache.clone(), v_cache.clone(), seqlens.clone()

    sq = torch.zeros(b, 1, hq, d, dtype=dtype, device=dev)
    sk = torch.zeros(b, 1, hkv, d, dtype=dtype, device=dev)
    sv = torch.zeros(b, 1, hkv, d, dtype=dtype, device=dev)

    def step(q, k, v, kc, vc, lens):
        out, lse = flash_api.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, return_softmax_lse=True)
        lens.add_(1)
        return out, lse

    with torch.no_grad():
        # warm up (Triton compilation, allocator) on a side stream, as torch.cuda.graphs advises
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            wk, wv, wl = k_cache.clone(), v_cache.clone(), seqlens.clone()
            step(sq, sk, sv, wk, wv, wl)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = step(sq, sk, sv, k_cache, v_cache, seqlens)
        # capture records the work without running it: the cache and lengths are untouched
        assert torch.equal(seqlens, e_len)
        for i in range(100):
            q = _t(b, 1, hq, d, dtype=dtype, device=dev, seed=1000 + i)
            k = _t(b, 1, hkv, d, dtype=dtype, device=dev, seed=2000 + i)
            v = _t(b, 1, hkv, d, dtype=dtype, device=dev, seed=3000 + i)
            sq.copy_(q)
            sk.copy_(k)
            sv.copy_(v)
            graph.replay()
            e_out, e_lse = step(q, k, v, e_k, e_v, e_len)
            assert torch.equal(g_out, e_out), f"replay {i}: output differs"
            assert torch.equal(g_lse, e_lse), f"replay {i}: lse differs"
        torch.cuda.synchronize()
        assert torch.equal(seqlens, e_len) and seqlens.tolist() == [107, 200, 1600]
        assert torch.equal(k_cache, e_k) and torch.equal(v_cache, e_v)
        # and the replayed result is right, not just repeatable: the fp32 reference for the last step
        from xoffload.kernels.reference import decode_attention_ref

        ref_o, ref_l = decode_attention_ref(sq.float(), k_cache.float(), v_cache.float(), seqlens)
        assert max_err(g_out.float(), ref_o) <= 4 * torch.finfo(dtype).eps * max(1.0, float(ref_o.abs().max()))
        assert max_err(g_lse, ref_l) <= 1e-3


@pytest.mark.cuda
def test_decode_op_inside_cuda_graph_via_custom_op():
    """torch.ops.xoffload.decode_attn_with_lse itself is capturable (no host read of the lengths)."""
    dev = "cuda"
    q = _t(2, 1, 4, 64, dtype=torch.float16, device=dev, seed=1)
    kc = _t(2, 512, 2, 64, dtype=torch.float16, device=dev, seed=2)
    vc = _t(2, 512, 2, 64, dtype=torch.float16, device=dev, seed=3)
    lens = torch.tensor([5, 300], dtype=torch.int32, device=dev)
    with torch.no_grad():
        ref = torch.ops.xoffload.decode_attn_with_lse(q, kc, vc, lens, None)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.xoffload.decode_attn_with_lse(q, kc, vc, lens, None)
        lens.copy_(torch.tensor([6, 301], dtype=torch.int32))
        g.replay()
        ref2 = torch.ops.xoffload.decode_attn_with_lse(q, kc, vc, lens, None)
    assert torch.equal(out[0], ref2[0]) and torch.equal(out[1], ref2[1])
    assert not torch.equal(ref[1], ref2[1])  # the replay saw the new lengths


@pytest.mark.parametrize("cu_q,max_q,match", [
    ([0, 2], 4, "cu_seqlens_q\\[-1\\] = 2 must equal the packed length 6"),  # rows 2..5 never written
    # (cu_seqlens_q [0, 7] -- a row past q -- corrupted the heap under the interpreter: not run here)
    ([0, 4, 3, 6], 4, "non-decreasing"),
    ([0, 6], 2, "max_seqlen_q = 2 is smaller than the longest sequence"),  # query blocks never launched
])
def test_varlen_op_still_checks_cu_seqlens(cu_q, max_q, match):
    """The varlen custom op (what torch.compile traces flash_attn_varlen_func into) runs the kernel
    with check=False, which since the batched prefill reads nothing on the host without a block
    table or seqused_k; the op itself must still refuse cu_seqlens / max_seqlen that do not fit
    the tensors (a user's input: silently unwritten rows, or reads and writes past q), eagerly and
    compiled."""
    q, k, v = _t(6, 4, 16), _t(10, 2, 16, seed=1), _t(10, 2, 16, seed=2)
    cq = torch.tensor(cu_q, dtype=torch.int32)
    ck = torch.tensor([0, 10] if len(cu_q) == 2 else [0, 4, 7, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        torch.ops.xoffload.flash_attn_varlen_with_lse(q, k, v, cq, ck, max_q, 10, True, None)

    def f(q, k, v):
        return flash_api.flash_attn_varlen_func(q, k, v, cq, ck, max_q, 10, causal=True)

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=match):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_tma_prefill_in_cuda_graph_and_compiled(softcap):
    """The prefill kernel's TMA path (D=128 bf16: descriptors built inside the kernel in scratch from
    Triton's allocator) captured in a CUDA graph and replayed with new queries equals eager bit for
    bit, and flash_attn_func compiled fullgraph by Inductor equals eager."""
    import xoffload.kernels.flash_attn as fa

    dev, dtype = "cuda", torch.bfloat16
    q = torch.zeros(1, 700, 8, 128, dtype=dtype, device=dev)
    k = _t(1, 900, 2, 128, dtype=dtype, device=dev, seed=21)
    v = _t(1, 900, 2, 128, dtype=dtype, device=dev, seed=22)
    assert fa._gpu_config(128, dtype, tma=fa._tma_possible(q, k, v, fa._PLAIN)).tma  # the path under test

    def f(q, k, v):
        return flash_api.flash_attn_func(q, k, v, causal=True, softcap=softcap, return_attn_probs=True)[:2]

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(q, k, v)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = f(q, k, v)
        for i in range(5):
            q.copy_(_t(1, 700, 8, 128, dtype=dtype, device=dev, seed=100 + i))
            graph.replay()
            e_out, e_lse = f(q, k, v)
            assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse), f"replay {i} differs"
        torch._dynamo.reset()
        c_out, c_lse = torch.compile(f, fullgraph=True)(q, k, v)
        assert torch.equal(c_out, e_out) and torch.equal(c_lse, e_lse)
