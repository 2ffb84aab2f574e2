"""Diagnostic: the sm_90 SASS of the decode kernels' tile loop, 16-bit against fp8 (e4m3) stores,
compiled here (no GPU needed: Triton's front end, ptxas and nvdisasm run on the CPU).

Each variant is the launch that ``benchmarks/bench_fp8_decode.py`` makes on the H200 (8B head shape:
Hq 32, Hkv 8, D 128, one query token, bf16 q): the wrapper is called on CPU tensors of the same
shapes and strides, its kernel launch is captured instead of run, every argument is specialized as
Triton's launcher would (16-divisible integers and pointers, integers equal to 1 as constants) and
the kernel is compiled for ``GPUTarget("cuda", 90, 32)``. For each loop of the SASS (a backward
branch) it prints the instruction count per iteration and the counts of a few classes: tensor-core
MMAs (HMMA), global loads (LDG / LDGSTS), shared-memory loads (LDS / LDSM), conversions (F2F,
F2FP, F2I, I2F, HADD2.F32, PRMT), fp32 multiplies (FMUL) and spills (LDL / STL); an iteration
handles BLOCK_N keys, so ``per key`` (loop instructions x warps / BLOCK_N: warp-instructions per
key) compares tiles of different sizes. ``regs``: registers per thread (cuobjdump), which bound
how many programs share an SM.

Variants: ``paged`` (``paged_decode_attn_with_lse`` over a block store ``[num_blocks, page, Hkv,
D]``, a shared table, as in the benchmark) at pages 32 and 256 for bf16, fp8 page scales and fp8
token scales; ``dense`` (``decode_attn_with_lse`` over a contiguous cache) bf16, fp8 token scales
and fp8 page scales of 256 positions.

Run: ``python tools/diag_fp8_decode_sass.py [--only paged,dense] [--json FILE]``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch  # noqa: E402

HQ, HKV, D = 32, 8, 128
CTX = 4096  # any length: lengths are runtime values, only shapes and strides specialize the kernel


class _Captured(Exception):
    pass


def capture(call, module, kernel_name: str):
    """Run ``call()`` with ``module.use_triton`` forced on and ``module.<kernel_name>`` launches
    recorded instead of run: ``(jit function, args, kwargs)`` of the first launch."""
    mod = __import__(f"xoffload.kernels.{module}", fromlist=["x"])
    fn = getattr(mod, kernel_name)
    got = {}

    def run(*args, grid, warmup, **kwargs):
        got.update(args=args, kwargs=kwargs)
        raise _Captured

    old_use = mod.use_triton
    mod.use_triton = lambda t: True
    fn.run = run
    try:
        call()
    except _Captured:
        pass
    finally:
        mod.use_triton = old_use
        del fn.run
    return fn, got["args"], got["kwargs"]


def compile_sm90(fn, args, kwargs):
    """Compile one captured launch for sm_90 with the launcher's specialization; the kernel."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    params = fn.params
    names = [p.name for p in params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            sig[p.name], consts[(i,)] = "constexpr", v
            continue
        if hasattr(v, "data_ptr") and not isinstance(v, torch.Tensor):  # HostPtr: a pointer of its dtype
            v = torch.empty(0, dtype=v.dtype)
        ty, attr = native_specialize_impl(type(backend), v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)[:2]
        sig[p.name] = ty
        if ty == "constexpr":
            consts[(i,)] = v
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def registers(ck) -> int:
    """Registers per thread of a compiled kernel (cuobjdump's resource usage): with 4 warps a
    program of R registers lets ``65536 // (R * 128)`` programs share an SM."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else -1


def sass_text(ck) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


CLASSES = {
    "HMMA": ("HMMA",), "LDG": ("LDG", "LDGSTS"), "LDS": ("LDS", "LDSM"),
    "cvt": ("F2F", "F2FP", "F2I", "I2F", "HADD2", "PRMT", "I2FP"), "FMUL": ("FMUL",), "spill": ("LDL", "STL"),
}


def sass_loops(text: str) -> list:
    """Each loop of a SASS listing (a backward branch), in code order: its instruction count, its
    opcodes without modifiers (``ops``) and the counts of :data:`CLASSES`."""
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        lm = re.match(r"^\s*(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            ins.append((addr, m.group(2).strip()))
    out = []
    for addr, s in ins:
        b = re.search(r"\bBRA\b.*?\((\.L_x_\d+)\)", s)
        if b and labels.get(b.group(1), addr) < addr:
            body = [x for a, x in ins if labels[b.group(1)] <= a <= addr]
            ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body]
            base = [o.split(".")[0] for o in ops]
            row = {"instructions": len(body), "ops": base}
            for k, names in CLASSES.items():
                row[k] = sum(1 for o in base if o in names)
            out.append(row)
    return out


def _paged_call(page: int, variant: str, qdtype=torch.bfloat16):
    from xoffload.kernels import paged_decode_attn_with_lse
    from xoffload.kernels.reference import quantize_kv_fp8_ref

    n_blocks = CTX // page
    x = torch.randn(n_blocks, page, HKV, D, dtype=qdtype)
    q = torch.randn(1, 1, HQ, D, dtype=qdtype)
    table = torch.arange(n_blocks, dtype=torch.int32).view(1, 1, n_blocks)
    lens = torch.tensor([CTX], dtype=torch.int32)
    if variant in ("bf16", "fp16"):
        kv, kw = (x, x), {}
    else:
        kq, ks = quantize_kv_fp8_ref(x, page_size=page, granularity=variant[4:])
        kv, kw = (kq, kq), dict(k_scale=ks, v_scale=ks)
    return lambda: paged_decode_attn_with_lse(q, *kv, table, lens, check=False, **kw)


def _dense_call(variant: str, spage=None):
    from xoffload.kernels import decode_attn_with_lse

    x = torch.randn(1, CTX, HKV, D, dtype=torch.bfloat16)
    q = torch.randn(1, 1, HQ, D, dtype=torch.bfloat16)
    lens = torch.tensor([CTX], dtype=torch.int32)
    if variant == "bf16":
        return lambda: decode_attn_with_lse(q, x, x, lens, check=False)
    kq = x.to(torch.float8_e4m3fn)
    s = torch.ones(1, CTX // (spage or 1), HKV)
    return lambda: decode_attn_with_lse(q, kq, kq, lens, check=False, k_scale=s, v_scale=s, scale_page_size=spage)


def variants(only) -> dict:
    out = {}
    if "paged" in only:
        for page in (32, 256):
            for v in ("bf16", "fp8_page", "fp8_token"):
                out[f"paged page={page} {v}"] = ("paged_decode", "_paged_split_kernel", _paged_call(page, v))
            if "fp16" in only:
                for v in ("fp16", "fp8_page", "fp8_token"):
                    out[f"paged page={page} {v} q=fp16"] = ("paged_decode", "_paged_split_kernel",
                                                           _paged_call(page, v, torch.float16))
    if "dense" in only:
        for name, v, sp in (("bf16", "bf16", None), ("fp8 token scales", "fp8", None),
                            ("fp8 page scales (256)", "fp8", 256)):
            out[f"dense {name}"] = ("decode", "_decode_split_kernel", _dense_call(v, sp))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="paged,dense",
                    help="comma-separated: paged, dense, fp16 (the paged variants again with an fp16 q)")
    ap.add_argument("--match", default=None, help="only the variants whose name contains this")
    ap.add_argument("--config", default=None,
                    help="block_n,num_warps,num_stages for every variant's launch (default: the library's rule)")
    ap.add_argument("--json", default=None, help="also write the counts to this JSON file")
    args = ap.parse_args(argv)
    res = {}
    if args.config:
        import xoffload.kernels.decode as dec
        import xoffload.kernels.paged_decode as pdec

        tiles = dict(zip(("block_n", "num_warps", "num_stages"), (int(x) for x in args.config.split(","))))
        dec._default_config = pdec._default_config = lambda *a, **k: dict(tiles)
    for name, (mod, kern, call) in variants(set(args.only.split(","))).items():
        if args.match and args.match not in name:
            continue
        fn, a, kw = capture(call, mod, kern)
        consts = {p.name: (dict(zip([q.name for q in fn.params], a)) | kw).get(p.name) for p in fn.params
                  if p.is_constexpr}
        ck = compile_sm90(fn, a, kw)
        loops = [{k: v for k, v in lp.items() if k != "ops"} for lp in sass_loops(sass_text(ck))]
        bn, warps = consts.get("BLOCK_N"), kw.get("num_warps")
        main_loop = max(loops, key=lambda r: r["instructions"]) if loops else {"instructions": 0}
        per_key = main_loop["instructions"] * warps / bn
        res[name] = {"block_n": bn, "num_warps": warps, "kv_fp8": consts.get("KV_FP8"), "registers": registers(ck),
                     "warp_instructions_per_key": per_key, "loops": loops}
        print(f"{name:<28} BLOCK_N={bn:<3} warps={warps} KV_FP8={consts.get('KV_FP8')} regs={res[name]['registers']:<3} "
              f"per key {per_key:5.1f}  tile loop: " + "  ".join(f"{k} {v}" for k, v in main_loop.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
