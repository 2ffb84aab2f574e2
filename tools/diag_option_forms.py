"""Diagnostic: the prefill kernel's option forms and launch configs, timed against our plain kernel
in one run, and the sm_90 SASS size of each form's tile loop.

What it compares (bf16, batch 1, the shapes of ``bench_flash_attn.py``: D=128 32/8 heads, D=64 9/3):

- softcap (50.0) and ALiBi at 32K, causal and not, with both masked edges of each query block in
  one loop or in two (``flash_attn._edges_one_loop``);
- a causal sliding window (4096) at 128K: the same two edge forms under several launch configs,
  against our causal call scaled by the window's share of the causal area (the issue's ``<= 1.15x``);
- ``window+softcap`` / ``window+alibi`` (32K): the window with the other option under several
  launch configs, against the window alone.

Each row: ms (median of ``triton.testing.do_bench``), TFLOP/s (``4 * Hq * D`` per visible pair),
and the ratio to the plain kernel's TFLOP/s at its default config in the same run (timed twice:
the spread is the run's noise). The library's defaults are what ``bench_flash_attn.py --suite
options`` times; this script is how they were chosen. It also timed forms since removed
(softcap against a static per-row reference, with and without a hand-pipelined loop; a conditional
rescale; ALiBi's column term through the tensor cores): their records are
``benchmarks/results/option_forms_run{1,2,3}.json``, their code is in git at e2ad721, and
docs/DESIGN.md gives the figures. ``--sass`` prints, for each form, the instruction
count of every loop of the sm_90 SASS (compiled on the spot; no GPU needed: Triton's ptxas and
nvdisasm), the MUFU, HGMMA and spill (LDL/STL) counts among them.

Run: ``python tools/diag_option_forms.py [--parts softcap,alibi,window] [--out FILE]``
(writes ``benchmarks/results/option_forms.json``); ``python tools/diag_option_forms.py --sass``.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import torch  # noqa: E402

from _common import HAS_CUDA, bench_ms, env_record, tflops, write_json  # noqa: E402
from bench_flash_attn import SHAPES, SOFTCAP, WINDOW, alibi_slopes, window_area  # noqa: E402
from bench_flash_attn import _make as _inputs  # noqa: E402  (bf16 [1, S, H, D] q, k, v on the GPU)


@contextlib.contextmanager
def edges(one_loop: bool):
    """Inside the block, the option path walks both masked edges in one loop (or in two) for
    every call, whatever ``flash_attn._edges_one_loop`` would choose."""
    import xoffload.kernels.flash_attn as fa

    old = fa._edges_one_loop
    fa._edges_one_loop = lambda opts: one_loop
    try:
        yield
    finally:
        fa._edges_one_loop = old


def _time(fn, flops, cfg):
    from xoffload.kernels import launch_override

    ctx = launch_override("flash_attn", cfg) if cfg else contextlib.nullcontext()
    try:
        with ctx:
            fn()
            ms = bench_ms(fn)
        return {"cfg": list(cfg) if cfg else "default", "ms": ms, "tflops": tflops(flops, ms)}
    except Exception as e:
        return {"cfg": list(cfg) if cfg else "default", "error": f"{type(e).__name__}: {e}"[:300]}


#: the forms timed per option: name -> module switches of xoffload.kernels.flash_attn, and the
#: launch configs each is timed under (None: the library's default rule)
FORMS = {  # name -> (masked edges in one loop, the launch configs per BLOCK_D; None: the default)
    "softcap": {"two_loops": (False, {64: [None], 128: [None]}), "one_loop": (True, {64: [None], 128: [None]})},
    "alibi": {"two_loops": (False, {64: [None], 128: [None]}),
              "one_loop": (True, {64: [None, (128, 64, 4, 3, True), (64, 64, 4, 3, True)],
                                  128: [None, (128, 64, 4, 2, True), (128, 64, 8, 3, True)]})},
}
WINDOW_FORMS = {
    "two_loops": (False, {64: [(64, 64, 4, 3), (128, 64, 8, 3)], 128: [(64, 64, 4, 3), (128, 64, 8, 3)]}),
    "one_loop": (True, {64: [(64, 64, 4, 3), (128, 64, 8, 3)],
                        128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 2, True), (128, 64, 8, 3, True)]}),
}


def run_score(kind, shape, s, causal):
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _inputs(s, hq, hkv, d)
    fl = 4.0 * hq * d * s * s / (2 if causal else 1)
    rec = {"case": kind, "shape": shape, "S": s, "causal": causal, "rows": []}
    plain = _time(lambda: flash_attn_with_lse(q, k, v, causal=causal), fl, None)
    rec["plain"] = plain
    if kind == "softcap":
        opt = {"softcap": SOFTCAP}
    else:
        opt = {"alibi_slopes": alibi_slopes(hq)}
    ref = None
    for name, (one_loop, cfgs) in FORMS[kind].items():
        with edges(one_loop):
            out, _ = flash_attn_with_lse(q, k, v, causal=causal, **opt)
            ref = out if ref is None else ref
            diff = float((out.float() - ref.float()).abs().max())
            for cfg in cfgs[d]:
                row = _time(lambda: flash_attn_with_lse(q, k, v, causal=causal, **opt), fl, cfg)
                row.update(form=name, max_abs_diff_vs_first_form=diff)
                if plain.get("tflops") and row.get("tflops"):
                    row["ratio_to_plain"] = row["tflops"] / plain["tflops"]
                rec["rows"].append(row)
                print(kind, shape, "causal" if causal else "full", name, row, flush=True)
    again = _time(lambda: flash_attn_with_lse(q, k, v, causal=causal), fl, None)  # the plain kernel again: noise
    rec["plain_again"] = again
    print(kind, shape, "plain", plain.get("tflops"), "again", again.get("tflops"), flush=True)
    return rec


#: a window combined with another option (32K): the launch configs tried, edges in one loop
WINDOW_COMBO_CONFIGS = {64: [None, (64, 64, 4, 3), (128, 64, 4, 3)], 128: [None, (64, 64, 4, 3)]}


def run_window_combo(combo, shape, s):
    """A causal 4096 window with softcap or ALiBi against the same window alone (default config)."""
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _inputs(s, hq, hkv, d)
    fl = 4.0 * hq * d * window_area(s, WINDOW)
    opt = ({"softcap": SOFTCAP} if combo == "softcap" else
           {"alibi_slopes": alibi_slopes(hq)})
    rec = {"case": f"window+{combo}", "shape": shape, "S": s, "window": WINDOW, "rows": []}
    alone = _time(lambda: flash_attn_with_lse(q, k, v, causal=True, window_size=(WINDOW, -1)), fl, None)
    rec["plain"] = alone  # here: the window alone
    for cfg in WINDOW_COMBO_CONFIGS[d]:
        row = _time(lambda: flash_attn_with_lse(q, k, v, causal=True, window_size=(WINDOW, -1), **opt), fl, cfg)
        row["form"] = "one_loop"
        if alone.get("tflops") and row.get("tflops"):
            row["ratio_to_window_alone"] = row["tflops"] / alone["tflops"]
        rec["rows"].append(row)
        print(f"window+{combo}", shape, row, flush=True)
    return rec


def run_window(shape, s):
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _inputs(s, hq, hkv, d)
    area = window_area(s, WINDOW)
    causal_area = s * (s + 1) // 2
    fl_w, fl_c = 4.0 * hq * d * area, 4.0 * hq * d * causal_area
    rec = {"case": "window", "shape": shape, "S": s, "window": WINDOW, "area_ratio": area / causal_area, "rows": []}
    causal = _time(lambda: flash_attn_with_lse(q, k, v, causal=True), fl_c, None)
    rec["plain"] = causal
    for name, (one_loop, cfgs) in WINDOW_FORMS.items():
        with edges(one_loop):
            for cfg in cfgs[d]:
                row = _time(lambda: flash_attn_with_lse(q, k, v, causal=True, window_size=(WINDOW, -1)), fl_w, cfg)
                row["form"] = name
                if causal.get("ms") and row.get("ms"):
                    row["vs_target(<=1.15)"] = row["ms"] / (rec["area_ratio"] * causal["ms"])
                    row["ratio_to_plain"] = row["tflops"] / causal["tflops"]
                rec["rows"].append(row)
                print("window", shape, row, flush=True)
    return rec


# ------------------------------------------------------------------------------------------ SASS
def _attn_consts(d, bm, bn, causal=True, **flags):
    c = dict(D=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, VARLEN=False, IS_FP32=False, HAS_SEQUSED=False,
             PAGED=False, PAGE=16, HAS_LEFT=False, HAS_RIGHT=False, SOFTCAP=False, ALIBI=False, FAST_TANH=True,
             EDGES_ONE_LOOP=False, USE_TMA=False)
    c.update(flags)
    return c


SASS_FORMS = {
    "plain d64 128x64w8": (_attn_consts(64, 128, 64), 8),
    "softcap d64 128x64w8": (_attn_consts(64, 128, 64, SOFTCAP=True), 8),
    "softcap one loop d64 128x64w8": (_attn_consts(64, 128, 64, SOFTCAP=True, EDGES_ONE_LOOP=True), 8),
    "plain d128 128x128w8": (_attn_consts(128, 128, 128), 8),
    "softcap d128 128x128w8": (_attn_consts(128, 128, 128, SOFTCAP=True), 8),
    "plain d64 128x64w4": (_attn_consts(64, 128, 64), 4),
    "alibi d64 128x64w4": (_attn_consts(64, 128, 64, ALIBI=True), 4),
    "alibi one loop d64 128x64w4": (_attn_consts(64, 128, 64, ALIBI=True, EDGES_ONE_LOOP=True), 4),
    "window two loops d64 64x64w4": (_attn_consts(64, 64, 64, HAS_LEFT=True), 4),
    "window one loop d64 64x64w4": (_attn_consts(64, 64, 64, HAS_LEFT=True, EDGES_ONE_LOOP=True), 4),
    "window two loops d64 128x64w8": (_attn_consts(64, 128, 64, HAS_LEFT=True), 8),
    "window one loop d64 128x64w8": (_attn_consts(64, 128, 64, HAS_LEFT=True, EDGES_ONE_LOOP=True), 8),
}


def sm90_sass(fn, signature: dict, consts: dict, attrs: dict, num_warps: int, num_stages: int):
    """Compile the Triton kernel ``fn`` for sm_90 here (Triton's ptxas, no GPU) and disassemble it
    with Triton's nvdisasm: ``(SASS text, the compiled kernel)``. ``signature`` maps every
    parameter to its type or ``"constexpr"``, ``consts`` the constexpr values, ``attrs`` Triton's
    per-argument attributes (e.g. 16-divisibility)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    src = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout, ck


def sass_loops(consts: dict, num_warps: int, num_stages: int = 3) -> list:
    """Compile ``flash_attn._attn_fwd`` for sm_90 (pointers and strides 16-divisible, as at launch)
    and return each loop of its SASS as ``{"instructions", "MUFU", "HGMMA"}``, in code order."""
    from xoffload.kernels.flash_attn import _attn_fwd

    sigp = inspect.signature(_attn_fwd.fn).parameters
    params = list(sigp)
    consts = {**{p: x.default for p, x in sigp.items() if x.default is not inspect.Parameter.empty}, **consts}
    types = {p: "i32" for p in params}
    types.update(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", CU_Q="*i32", CU_K="*i32", BT="*i32",
                 SEQUSED="*i32", ALIBI_SLOPES="*fp32", qk_scale="fp32", cap_in="fp32", cap_out="fp32")
    sig = {p: "constexpr" if p in consts else types[p] for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and (sig[p].startswith("*") or p.startswith("stride_"))}
    text, _ = sm90_sass(_attn_fwd, sig, consts, attrs, num_warps, num_stages)
    from diag_fp8_decode_sass import sass_loops  # one SASS loop parser for the tools

    return [{"instructions": lp["instructions"], "MUFU": lp["ops"].count("MUFU"), "HGMMA": lp["ops"].count("HGMMA"),
             "spill_ops": lp["spill"]} for lp in sass_loops(text)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="softcap,alibi,window",
                    help="comma-separated: softcap, alibi, window, window+softcap, window+alibi")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes of bench_flash_attn.SHAPES (default all)")
    ap.add_argument("--sass", action="store_true", help="print the SASS loop sizes of each form (no GPU needed)")
    ap.add_argument("--out", default="option_forms", help="a name under benchmarks/results or a .json path")
    args = ap.parse_args(argv)
    if args.sass:
        res = {}
        for name, (c, w) in SASS_FORMS.items():
            res[name] = sass_loops(c, w)
            print(f"{name:40s}", " | ".join(f"{x['instructions']} (MUFU {x['MUFU']}, HGMMA {x['HGMMA']}, "
                                             f"LDL/STL {x['spill_ops']})"
                                             for x in res[name]), flush=True)
        if args.out != "option_forms":
            write_json(args.out, {"benchmark": "option_forms_sass", "env": env_record(), "loops": res})
        return 0
    if not HAS_CUDA:
        print("needs a CUDA GPU (or --sass)")
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    records = []
    cases = []
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    for kind in ("softcap", "alibi"):
        if kind in parts:
            cases += [(run_score, (kind, sh, 32768, c)) for sh in shapes for c in (True, False)]
    if "window" in parts:
        cases += [(run_window, (sh, 131072)) for sh in shapes]
    for combo in ("softcap", "alibi"):
        if f"window+{combo}" in parts:
            cases += [(run_window_combo, (combo, sh, 32768)) for sh in shapes]
    for fn, a in cases:
        try:
            records.append(fn(*a))
        except Exception as e:
            traceback.print_exc()
            records.append({"case": fn.__name__, "args": [str(x) for x in a], "error": f"{type(e).__name__}: {e}"[:400]})
        write_json(args.out, {"benchmark": "option_forms", "env": env_record(), "partial": True, "records": records})
        torch.cuda.empty_cache()
    path = write_json(args.out, {"benchmark": "option_forms", "env": env_record(), "records": records})
    print(f"wrote {path}")
    print(json.dumps([{k: r.get(k) for k in ("case", "shape", "causal")} for r in records]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
