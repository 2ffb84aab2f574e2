"""The Triton kernels changed without a GPU at hand compile for the H200 (sm_90): Triton's front end,
its lowering and ptxas run on the CPU for a named target, so an error the interpreter cannot see
(a type that does not unify across a branch, a shape Triton refuses) fails here, in CI, instead of
on the device. Each variant a wrapper launches is compiled: the page-cache lookup one-request
(with / without block table and hit counters) and batched, the fill, the channel score kernel at
the tiles ``bench_quest_score.py --sweep`` times, the top-k with and without per-row counts, the prefill
kernel's option path with softcap (the ``tanh.approx.f32`` inline PTX must pass ptxas) and every ALiBi
tile class, on the H200's tiles, the decode kernels' fp8 variants (paged and contiguous; page and token
scales, a scale per tile or per key row) and the fp8 quantization kernel. Runtime behaviour is tested elsewhere (the
interpreter, and the GPU suite).

The fp8 variants' PTX is also read (``--ptx``): the quantization kernel must divide with IEEE
``div.rn.f32`` (no approximate division or reciprocal, no flush to zero) and cast with
``cvt.rn.satfinite.e4m3x2.f32``, or it stops equalling the torch reference bit for bit on the GPU;
the decode kernels' fp8 tile step must convert codes with ``cvt.rn.f16x2.e4m3x2`` into fp16 MMAs
(no ``cvt.bf16.f16``).

The compile runs in a subprocess without ``TRITON_INTERPRET`` (with it, Triton's own library
functions such as ``tl.max`` are interpreted functions and cannot be compiled).

``test_every_kernel_the_tests_launch_compiles``: the kernel tests of this folder are run once more
with :mod:`launch_capture` (their launches recorded, not run: ~40 s), and for every kernel up to
three of the constexpr combinations they launched (first, middle, last; with fp16 pointers also
the same as bf16, the GPU's dtype) are compiled for sm_90."""
import inspect
import json
import os
import subprocess
import sys

import pytest


def _lookup_types():
    t = {p: "*i32" for p in ("BT", "Tag", "SlotOf", "Clock", "Mark", "Step", "Free", "Table", "Src", "RowSlot",
                             "RowK", "RowC", "RowBase", "CandRow")}
    t.update(Pages="*i64", Hits="*i64")
    t.update({p: "i32" for p in ("K", "C", "NID", "first_page", "block_size", "base", "CS", "KW", "s_ph", "s_th",
                                 "s_cr")})
    return t


def _fill_types():
    t = {p: "*bf16" for p in ("SK", "SV", "DK", "DV")}
    t.update(Src="*i32", Table="*i32", **{p: "i32" for p in ("K", "D", "s_sr", "s_sh", "s_dr", "s_dh", "s_th")})
    return t


def _channel_types():
    t = {p: "*bf16" for p in ("Q", "KMIN", "KMAX", "KL")}
    t.update(CH="*i32", IDX="*i32", NV="*i32", S="*fp32", alpha="fp32")
    t.update({p: "i32" for p in ("N", "GROUP", "D", "R", "s_qr", "s_qh", "s_kh", "s_kn", "s_cr", "s_ch", "s_lh",
                                 "s_lt", "s_ir", "s_sr", "s_sh")})
    return t


def _attn_types(ptr="*bf16"):
    """Types of the prefill kernel's runtime arguments (flash_attn._attn_fwd): tensors of ``ptr``,
    the LSE and slopes fp32, tables int32, scales fp32, every other argument an int32."""
    import inspect

    from xoffload.kernels.flash_attn import _attn_fwd

    t = {p: "i32" for p in inspect.signature(_attn_fwd.fn).parameters}
    t.update(Q=ptr, K=ptr, V=ptr, O=ptr, LSE="*fp32", CU_Q="*i32", CU_K="*i32", BT="*i32", SEQUSED="*i32",
             ALIBI_SLOPES="*fp32", qk_scale="fp32", cap_in="fp32", cap_out="fp32")
    return t


def _attn(d, bm, bn, *, causal=True, fp32=False, **flags):
    """The prefill kernel's constexprs for head dim ``d`` and ``bm x bn`` tiles, option flags set."""
    c = dict(D=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, VARLEN=False, IS_FP32=fp32, HAS_SEQUSED=False,
             PAGED=False, PAGE=16, HAS_LEFT=False, HAS_RIGHT=False, SOFTCAP=False, ALIBI=False, FAST_TANH=not fp32,
             EDGES_ONE_LOOP=False, USE_TMA=False)
    c.update(flags)
    return c


#: the prefill option path's softcap and ALiBi tile classes, on the H200 tiles (_gpu_config):
#: name -> (constexprs, launch options)
_ATTN_VARIANTS = {
    **{f"flash_attn softcap d={d}": (_attn(d, 128, bn, SOFTCAP=True), {"num_warps": 8, "num_stages": 3})
       for d, bn in ((128, 128), (64, 64))},
    "flash_attn alibi causal d=64 (left class)": (_attn(64, 128, 64, ALIBI=True, EDGES_ONE_LOOP=True),
                                                  {"num_warps": 4, "num_stages": 3}),
    "flash_attn alibi non-causal d=64 (left, diagonal, right)": (
        _attn(64, 128, 64, causal=False, ALIBI=True, EDGES_ONE_LOOP=True), {"num_warps": 4, "num_stages": 3}),
    "flash_attn alibi non-causal d=128 (left, diagonal, right)": (
        _attn(128, 128, 128, causal=False, ALIBI=True, EDGES_ONE_LOOP=True), {"num_warps": 8, "num_stages": 3}),
    "flash_attn alibi non-causal window d=128": (_attn(128, 128, 64, causal=False, ALIBI=True, HAS_LEFT=True,
                                                       HAS_RIGHT=True, EDGES_ONE_LOOP=True),
                                                 {"num_warps": 8, "num_stages": 3}),
    **{f"flash_attn causal window d={d} (edges in one loop)": (_attn(d, 128, 64, HAS_LEFT=True, EDGES_ONE_LOOP=True),
                                                              {"num_warps": 8, "num_stages": 3}) for d in (64, 128)},
    "flash_attn causal window alibi d=64 (64x64, 4 warps)": (_attn(64, 64, 64, HAS_LEFT=True, ALIBI=True,
                                                                   EDGES_ONE_LOOP=True), {"num_warps": 4, "num_stages": 3}),
    "flash_attn alibi softcap causal window paged d=128": (
        _attn(128, 128, 64, ALIBI=True, SOFTCAP=True, HAS_LEFT=True, PAGED=True, PAGE=16, EDGES_ONE_LOOP=True),
        {"num_warps": 8, "num_stages": 3}),
    **{f"flash_attn TMA {name} d=128 (128x64, 4 warps, 2 stages)": (_attn(128, 128, 64, USE_TMA=True, **fl),
                                                                   {"num_warps": 4, "num_stages": 2})
       for name, fl in (("plain causal", {}), ("plain non-causal varlen", dict(causal=False, VARLEN=True)),
                        ("softcap causal", dict(SOFTCAP=True)),
                        ("causal window", dict(HAS_LEFT=True, EDGES_ONE_LOOP=True)),
                        ("softcap window seqused", dict(SOFTCAP=True, HAS_LEFT=True, HAS_SEQUSED=True,
                                                        EDGES_ONE_LOOP=True)))},
    "flash_attn alibi fp32 non-causal (direct form)": (_attn(128, 32, 16, causal=False, fp32=True, ALIBI=True,
                                                             SOFTCAP=True, EDGES_ONE_LOOP=True),
                                                       {"num_warps": 4, "num_stages": 2}),
}


def _paged_types(kv="*fp8e4nv", q="*bf16"):
    """Types of the paged decode kernel's runtime arguments: q / out of ``q``, the store of ``kv``,
    the fp8 scales fp32, tables int32, scales fp32, every other argument an int32."""
    from xoffload.kernels.paged_decode import _paged_split_kernel

    t = {p: "i32" for p in inspect.signature(_paged_split_kernel.fn).parameters}
    t.update(Q=q, K=kv, V=kv, T="*i32", Lens="*i32", Lpad="*i32", Slopes="*fp32", O=q, L="*fp32", KS="*fp32",
             VS="*fp32", qk_scale="fp32", cap_scale="fp32")
    return t


def _dense_types(q="*bf16"):
    """Types of the contiguous decode kernel's runtime arguments with an fp8 cache."""
    from xoffload.kernels.decode import _decode_split_kernel

    t = {p: "i32" for p in inspect.signature(_decode_split_kernel.fn).parameters}
    t.update(Q=q, K="*fp8e4nv", V="*fp8e4nv", Lens="*i32", Lpad="*i32", Bidx="*i32", Slopes="*fp32", O=q, L="*fp32",
             KS="*fp32", VS="*fp32", qk_scale="fp32", cap_scale="fp32")
    return t


def _dense(kv_fp8, spage, block_n=64):
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=128, DOT_PREC="tf32", HAS_LEFT=False, HAS_RIGHT=False,
                ROW_LEFT=False, SOFTCAP=False, ALIBI=False, LEFTPAD=False, BATCH_IDX=True, KV_FP8=kv_fp8, SPAGE=spage)


def _quant_types():
    from xoffload.kernels.fp8 import _quantize_kernel

    t = {p: "i32" for p in inspect.signature(_quantize_kernel.fn).parameters}
    t.update(X="*bf16", Q="*fp8e4nv", S="*fp32")
    return t


def _paged(page, kv_fp8, token, div, block_n=128, **flags):
    """The paged decode kernel's constexprs on the 8B shape (D 128, group 4) for an fp8 store
    (the fp8 tiles: 128 keys, ``decode._default_config``)."""
    c = dict(PAGE=page, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=128, DOT_PREC="tf32", HAS_LEFT=False, HAS_RIGHT=False,
             ROW_LEFT=False, SOFTCAP=False, ALIBI=False, LEFTPAD=False, KV_FP8=kv_fp8, SCALE_TOKEN=token,
             SCALE_DIV=div)
    c.update(flags)
    return c


#: the fp8 store's variants of the paged decode kernel (what _scale_args launches): name -> constexprs
_PAGED_FP8 = {
    "page scales, a tile per page, row store": _paged(128, 1, False, 128),
    "page scales, a tile per page, block store": _paged(256, 1, False, 1),
    "page scales, an entry per key row": _paged(16, 2, False, 16),
    "page scales, an entry per key row, block store": _paged(32, 2, False, 1),
    "token scales, a tile per page": _paged(256, 2, True, 1),
    "token scales, an entry per key row, softcap window": _paged(32, 2, True, 1, SOFTCAP=True, HAS_LEFT=True),
    "page scales, a tile per page, D 256 (64-key tiles)": _paged(64, 1, False, 1, block_n=64, BLOCK_D=256),
}


def _topk_types():
    return {"S": "*fp32", "Out": "*i32", "Prefer": "*i32", "KR": "*i32", "N": "i32", "K": "i32", "s_sr": "i32",
            "s_or": "i32", "s_pr": "i32", "bonus": "fp32"}


def _gather_types():
    return {"src_k": "*i16", "src_v": "*i16", "dst_k": "*i16", "dst_v": "*i16", "ids_ptr": "*i32",
            "block_elems": "i32"}


#: name -> (module, kernel, types, constexprs[, launch options])
VARIANTS = {
    **{f"lookup batched={b} bt={bt} hits={h}": ("page_cache", "_lookup_kernel", "lookup",
                                               dict(HKV=8, PAGE=32, BLOCK_K=64, BLOCK_C=1024, HAS_BT=bt,
                                                    HAS_HITS=h, BATCHED=b))
       for b, bt, h in ((False, False, False), (False, True, True), (True, False, False), (True, False, True))},
    "fill": ("page_cache", "_fill_kernel", "fill", dict(HKV=8, BLOCK_R=32, BLOCK_D=128)),
    **{f"channel score block_n={bn}": ("channel_score", "_channel_score_kernel", "channel",
                                       dict(P=32, BLOCK_G=16, BLOCK_N=bn, BLOCK_D=128, BLOCK_R=16, HAS_LOWER=True,
                                            HAS_EXACT=True, GATHER=True, DOT_PREC="tf32"))
       for bn in (16, 32, 64)},
    **{f"topk prefer={p} k_rows={kr}": ("topk", "_topk_kernel", "topk", dict(BLOCK_N=1024, HAS_PREFER=p, HAS_KR=kr))
       for p, kr in ((False, False), (True, False), (True, True), (False, True))},
    **{name: ("flash_attn", "_attn_fwd", "attn_fp32" if c["IS_FP32"] else "attn", c, o)
       for name, (c, o) in _ATTN_VARIANTS.items()},
    **{f"paged decode fp8 {name} q={q}": ("paged_decode", "_paged_split_kernel", f"paged_{q}", c,
                                          {"num_warps": 4, "num_stages": 3})
       for name, c in _PAGED_FP8.items() for q in ("bf16", "fp16")},
    **{f"decode fp8 {name} q={q}": ("decode", "_decode_split_kernel", f"dense_{q}", c,
                                    {"num_warps": 4, "num_stages": 3})
       for name, c in (("token scales", _dense(2, 1)), ("page scales, a tile per page", _dense(1, 256)),
                       ("page scales per key", _dense(2, 16)), ("page scales per key, 128-key tiles", _dense(2, 64, 128)))
       for q in ("bf16", "fp16")},
    **{f"quantize fp8 {g}": ("fp8", "_quantize_kernel", "quant", dict(PAGE=32, TOKEN=g == "token", BLOCK_T=32,
                                                                       BLOCK_D=128), {"num_warps": 4})
       for g in ("page", "token")},
    **{f"gather blocks even={e} skip={k}": ("gather", "_gather_blocks_kernel", "gather",
                                            dict(BLOCK=8192, EVEN=e, SKIP=k), {"num_warps": 8})
       for e, k in ((True, False), (True, True), (False, True))},
}


#: the quantize kernel's other input dtypes (the GPU test quantizes all three), for the PTX checks
VARIANTS.update({f"quantize fp8 {g} x={x}": ("fp8", "_quantize_kernel", f"quant_{x}",
                                             dict(PAGE=32, TOKEN=g == "token", BLOCK_T=32, BLOCK_D=128),
                                             {"num_warps": 4})
                 for x in ("fp16", "fp32") for g in ("page", "token")})

#: substrings counted in the PTX of the fp8 variants (:func:`_ptx_counts`)
PTX_PATTERNS = ("div.rn.f32", "div.full.f32", "div.approx", "rcp.approx", ".ftz", "cvt.rn.satfinite.e4m3x2.f32",
                "cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16", "cvt.rn.bf16", "m16n8k16.row.col.f32.f16.f16.f32",
                "m16n8k16.row.col.f32.bf16.bf16.f32")


def _types() -> dict:
    return {"lookup": _lookup_types(), "fill": _fill_types(), "channel": _channel_types(), "topk": _topk_types(),
            "attn": _attn_types(), "attn_fp32": _attn_types("*fp32"), "paged_bf16": _paged_types(q="*bf16"),
            "paged_fp16": _paged_types(q="*fp16"), "dense_bf16": _dense_types("*bf16"),
            "dense_fp16": _dense_types("*fp16"), "quant": _quant_types(),
            "quant_fp16": dict(_quant_types(), X="*fp16"), "quant_fp32": dict(_quant_types(), X="*fp32"),
            "gather": _gather_types()}


def _variant_spec(name: str, types: dict) -> dict:
    import importlib

    mod, kern, tkey, consts, *opts = VARIANTS[name]
    module = f"xoffload.kernels.{mod}"
    params = inspect.signature(getattr(importlib.import_module(module), kern).fn).parameters
    return {"module": module, "name": kern, "constexprs": consts, "options": opts[0] if opts else {},
            "signature": {p: "constexpr" if p in consts else types[tkey][p] for p in params}}


def _compile_all() -> dict:
    """Compile every named variant for sm_90 (in this process: no interpreter); name -> "ok" / the error."""
    types = _types()
    out = {}
    for name in VARIANTS:
        fails = _compile_specs([_variant_spec(name, types)])
        out[name] = fails[0][1] if fails else "ok"
    return out


def _ptx_counts() -> dict:
    """The fp8 variants' sm_90 PTX: name -> {pattern: occurrences} for :data:`PTX_PATTERNS`."""
    types = _types()
    out = {}
    for name in VARIANTS:
        if "fp8" not in name:
            continue
        ptx = _compile_specs([_variant_spec(name, types)], keep=True)[0].asm["ptx"]
        out[name] = {pat: ptx.count(pat) for pat in PTX_PATTERNS}
    return out


def _select(specs: list) -> list:
    """Up to three constexpr combinations per kernel of ``specs`` (first, middle, last in sorted
    order), each fp16-pointer one also as bf16; only the library's kernels."""
    by = {}
    for s in specs:
        if s["module"].startswith("xoffload."):
            by.setdefault((s["module"], s["name"]), {})[json.dumps(s, sort_keys=True)] = s
    out = []
    for _, d in sorted(by.items()):
        keys = sorted(d)
        for k in dict.fromkeys([keys[0], keys[len(keys) // 2], keys[-1]]):
            s = d[k]
            out.append(s)
            if any(t == "*fp16" for t in s["signature"].values()):
                out.append(dict(s, signature={a: "*bf16" if t == "*fp16" else t for a, t in s["signature"].items()}))
    return out


def _compile_specs(specs: list, keep: bool = False) -> list:
    """Compile each spec for sm_90; the failures as ``(module.name, error)`` (``keep``: the
    compiled kernels instead, errors raised)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fails, kept = [], []
    for s in specs:
        fn = getattr(importlib.import_module(s["module"]), s["name"])
        params = list(inspect.signature(fn.fn).parameters)
        src = ASTSource(fn=fn, signature=s["signature"],
                        constexprs={(params.index(k),): v for k, v in s["constexprs"].items()})
        if keep:
            kept.append(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"]))
            continue
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"])
        except Exception as e:  # reported, with the spec
            fails.append((f"{s['module']}.{s['name']}", f"{type(e).__name__}: {str(e)[:800]} | {json.dumps(s)[:600]}"))
    return kept if keep else fails


def _run_self(*args) -> dict:
    """This file run as a script without the interpreter (``args`` select the mode); its JSON."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        if "ptxas" in p.stderr.lower() and "not found" in p.stderr.lower():
            pytest.skip("no ptxas in this Triton install")
        raise AssertionError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    return _run_self()


@pytest.fixture(scope="module")
def fp8_ptx():
    return _run_self("--ptx")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_sm90(compiled, name):
    assert compiled[name] == "ok", compiled[name]


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("quantize fp8")])
def test_quantize_ptx_rounds_exactly(fp8_ptx, name):
    """The quantization kernel equals the torch reference bit for bit only if its two divisions
    (``amax / 448``, ``x / scale``) are IEEE round-to-nearest: ``div.rn.f32``, never the
    approximate ``div.full`` / ``div.approx`` / ``rcp.approx`` and never flushing subnormals
    (``.ftz``); its stores cast exact e4m3 values with the saturating round-to-nearest
    ``cvt.rn.satfinite.e4m3x2.f32``. (The kernel's one contracted ``fma.rn.f32``, ``a * 2^k - f``,
    has an exact product, so it rounds as the separate multiply and subtract.)"""
    c = fp8_ptx[name]
    assert c["div.rn.f32"] > 0, c
    assert c["div.full.f32"] == c["div.approx"] == c["rcp.approx"] == c[".ftz"] == 0, c
    assert c["cvt.rn.satfinite.e4m3x2.f32"] > 0, c


@pytest.mark.parametrize("name", [n for n in VARIANTS if "decode fp8" in n])
def test_fp8_decode_ptx_converts_codes_to_fp16(fp8_ptx, name):
    """The fp8 tile step converts two e4m3 codes per ``cvt.rn.f16x2.e4m3x2`` and feeds fp16
    tensor-core MMAs whatever q's dtype: no per-element fp16 -> bf16 conversion of the codes (two
    ``cvt.bf16.f16`` per pair, the slow conversion pipe) and no bf16 MMA."""
    c = fp8_ptx[name]
    assert c["cvt.rn.f16x2.e4m3x2"] > 0, c
    assert c["cvt.bf16.f16"] == 0 and c["m16n8k16.row.col.f32.bf16.bf16.f32"] == 0, c
    assert c["m16n8k16.row.col.f32.f16.f16.f32"] > 0, c


def test_every_kernel_the_tests_launch_compiles(compiled, tmp_path):
    if os.environ.get("XOFFLOAD_CAPTURE"):  # inside the capture run itself (never recurse)
        pytest.skip("inside the launch capture")
    here = os.path.dirname(os.path.abspath(__file__))
    cap = tmp_path / "launches.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", XOFFLOAD_CAPTURE=str(cap),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    # the tests' own assertions fail (nothing ran): only the launches are kept
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch_capture", here,
                    f"--ignore={os.path.join(here, 'test_compile_sm90.py')}"],
                   env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(here)))
    specs = [json.loads(x) for x in cap.read_text().splitlines()]
    chosen = _select(specs)
    kernels = {(s["module"], s["name"]) for s in chosen}
    assert len(kernels) >= 20, sorted(kernels)  # every kernel file's kernels are launched by its tests
    sel = tmp_path / "chosen.json"
    sel.write_text(json.dumps(chosen))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, __file__, str(sel)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    fails = json.loads(p.stdout.strip().splitlines()[-1])
    assert not fails, "\n".join(f"{n}: {e}" for n, e in fails)


if __name__ == "__main__":
    if sys.argv[1:] == ["--ptx"]:  # the fp8 variants' PTX counts (fp8_ptx)
        print(json.dumps(_ptx_counts()))
    elif len(sys.argv) > 1:  # compile the specs of a file (test_every_kernel_the_tests_launch_compiles)
        print(json.dumps(_compile_specs(json.loads(open(sys.argv[1]).read()))))
    else:
        print(json.dumps(_compile_all()))
