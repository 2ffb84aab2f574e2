"""Diagnostic: does Triton's warp specialization on Hopper (``tl.range(warp_specialize=True)`` over
on-device TMA descriptors) lift softcap's share of the plain prefill's speed, and how does the
library's kernel do in the tiles such a kernel prefers?

The target asks softcap prefill for >= 0.9x our plain prefill's TFLOP/s. FlashAttention-3 (Shah et
al. 2024) overlaps one warpgroup's softmax with another's products by giving the loads to a
producer warp and syncing through mbarriers; Triton >= 3.5 can build that producer / consumer
split on sm_90 when the loads are TMA descriptors made on the device. This script holds a minimal
forward kernel (:func:`_fwd`: bf16, GQA, batch 1, causal bottom-right or not, optional softcap)
and times, at 32K (``--seq``) for each shape of ``bench_flash_attn.SHAPES`` (``--shapes``), the
parts named by ``--parts``:

- ``library``: the library's plain and softcap calls under its default and several launch configs
  (``launch_override``; a fifth field True: TMA loads);
- ``tma``: this kernel without warp specialization under several configs;
- ``ws``: this kernel with warp specialization (on the device's Triton 3.6: wrong outputs at
  D=128 and an illegal memory access at D=64, which ends the process: run it last, alone).

Each row carries softcap's TFLOP/s over the library's default plain call (the issue's ratio) and
over the same config's plain form, and its output / LSE difference from the library's softcap
call. Records: ``softcap_ws_run1.json`` (tma + ws, written by the script's first version at
6d32b79: the library's calls in ``library_plain`` / ``library_softcap``, rows without ``kernel``;
it stopped at the D=64 crash, so D=64 causal is missing), ``softcap_ws_run2.json`` (library + tma:
the 128x64 / 4-warp / 2-stage TMA tile that the library adopted), ``softcap_ws_s13_d64.json``.

Run: ``python tools/diag_softcap_ws.py [--parts library,tma] [--shapes d128_h32_kv8]
[--out FILE]`` on a GPU; ``python tools/diag_softcap_ws.py --sass`` compiles this kernel's
variants for sm_90 here (no GPU) and prints their SASS size and whether the warps were split into
groups (``setmaxnreg``).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from _common import HAS_CUDA, bench_ms, env_record, tflops, write_json  # noqa: E402
from xoffload.kernels.flash_attn_opts import _tanh  # noqa: E402
from xoffload.kernels.launch import tma_alloc  # noqa: E402
from bench_flash_attn import SHAPES, SOFTCAP  # noqa: E402
from bench_flash_attn import _make as _inputs  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n, diag, qk_scale, cap_in, cap_out,
          MASK: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    k = k_desc.load([start_n, 0])
    s = tl.dot(q, k.T)
    if SOFTCAP:
        s = _tanh(s * cap_in, FAST_TANH) * cap_out
    else:
        s = s * qk_scale
    if MASK:
        s = tl.where((offs_m[:, None] + diag) >= (start_n + offs_n)[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fwd(Q, K, V, O, LSE, qk_scale, cap_in, cap_out, seqlen_q, seqlen_k, HQ: tl.constexpr, HKV: tl.constexpr,
         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
         SOFTCAP: tl.constexpr, WS: tl.constexpr, CAUSAL_FORM: tl.constexpr = 0, FAST_TANH: tl.constexpr = True):
    """One (query block, head) per program; q, k, v, o are [S, H, D] (batch 1), LSE [H, Sq] in
    natural-log units. Causal: bottom-right; the diagonal tiles run in a second, masked loop.
    Sq must be a multiple of BLOCK_M and Sk of BLOCK_N (the diagnostic's shapes)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HQ // HKV)
    q_desc = tl.make_tensor_descriptor(Q + h * D, shape=[seqlen_q, D], strides=[HQ * D, 1],
                                       block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(K + hk * D, shape=[seqlen_k, D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V + hk * D, shape=[seqlen_k, D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK_N, D])
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([m0, 0])
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    diag = seqlen_k - seqlen_q
    if CAUSAL:
        full_hi = ((m0 + diag + 1) // BLOCK_N) * BLOCK_N  # tiles seen whole by every row
        hi = tl.minimum(m0 + BLOCK_M + diag, seqlen_k)
    else:
        full_hi = seqlen_k
        hi = seqlen_k
    if CAUSAL and CAUSAL_FORM == 2:  # one loop, every tile masked
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n, diag, qk_scale,
                                  cap_in, cap_out, True, SOFTCAP, FAST_TANH)
    else:  # full tiles, then the diagonal's
        for start_n in tl.range(0, full_hi, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n, diag, qk_scale,
                                  cap_in, cap_out, False, SOFTCAP, FAST_TANH)
        if CAUSAL:
            for start_n in tl.range(full_hi, hi, BLOCK_N):
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n, diag, qk_scale,
                                      cap_in, cap_out, True, SOFTCAP, FAST_TANH)
    out = acc / l_i[:, None]
    tl.store(LSE + h * seqlen_q + offs_m, (m_i + tl.math.log2(l_i)) / 1.4426950408889634)
    o_ptrs = O + offs_m[:, None] * (HQ * D) + h * D + tl.arange(0, D)[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty))


def ws_attn(q, k, v, causal, softcap, cfg, ws):
    """q [S, Hq, D], k / v [S, Hkv, D] bf16 (fp16 under the interpreter; batch 1; S a multiple of
    BLOCK_M and BLOCK_N) -> (out [S, Hq, D], lse [Hq, S] fp32, natural log).
    ``ws`` with ``causal``: one loop masking every tile (the only causal form Triton 3.6 compiles
    with a specialized loop: two loops, in either order, fail in its warp-specialization pass)."""
    if q.is_cuda:
        triton.set_allocator(tma_alloc)  # the interpreter needs no scratch for descriptors
    s, hq, d = q.shape
    hkv = k.shape[1]
    bm, bn, warps, stages = cfg
    o = torch.empty_like(q)
    lse = torch.empty(hq, s, device=q.device, dtype=torch.float32)
    scale = d ** -0.5
    cap = softcap or 1.0
    _fwd[(s // bm, hq)](q, k, v, o, lse, scale * LOG2E, scale / cap, cap * LOG2E, s, k.shape[0], hq, hkv, d,
                        bm, bn, causal, bool(softcap), ws, 2 if (ws and causal) else 0, q.is_cuda, num_warps=warps,
                        num_stages=stages)
    return o, lse


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim: the library's kernel (None: its default)
#: and this file's TMA kernel without warp specialization
LIB_CONFIGS = {64: [None, (128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3, True),
                    (128, 64, 4, 3, True), (64, 64, 4, 3, True)],
               128: [None, (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 8, 3)]}
TMA_CONFIGS = {64: [(128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
               128: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 8, 3)]}
#: with ``warp_specialize``: 4 warps make Triton 3.6 build 12 on sm_90 (a producer warpgroup and
#: two consumer warpgroups splitting BLOCK_M); with 8 it leaves the loop as it is (same SASS). On
#: the H200 (softcap_ws_run1.json) these gave wrong outputs at D=128 (LSE off by 11-45, NaN) and
#: an illegal memory access at D=64: ``--parts ws`` only, alone
WS_CONFIGS = {64: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (256, 64, 4, 2)],
              128: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (256, 64, 4, 2)]}


def run_shape(shape, s, causal, parts):
    from xoffload.kernels import flash_attn_with_lse, launch_override

    hq, hkv, d = SHAPES[shape]
    q, k, v = _inputs(s, hq, hkv, d)
    fl = 4.0 * hq * d * s * s / (2 if causal else 1)
    rec = {"shape": shape, "S": s, "causal": causal, "rows": []}

    def timed(fn, cfg=None):
        ctx = launch_override("flash_attn", cfg) if cfg else contextlib.nullcontext()
        try:
            with ctx:
                fn()
                ms = bench_ms(fn)
            return {"ms": ms, "tflops": tflops(fl, ms)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    lib = lambda **kw: flash_attn_with_lse(q, k, v, causal=causal, **kw)  # noqa: E731
    base = timed(lib).get("tflops")
    rec["library_plain_default_tflops"] = base
    ref, ref_lse = lib(softcap=SOFTCAP)
    q3, k3, v3 = q[0], k[0], v[0]
    rows = []
    if "library" in parts:
        rows += [("library", cfg, False) for cfg in LIB_CONFIGS[d]]
    if "tma" in parts:
        rows += [("tma", cfg, False) for cfg in TMA_CONFIGS[d]]
    if "ws" in parts:
        rows += [("tma", cfg, True) for cfg in WS_CONFIGS[d]]
    for kernel, cfg, ws in rows:
        row = {"kernel": kernel, "cfg": list(cfg) if cfg else "default", "warp_specialize": ws}
        if kernel == "library":
            plain = timed(lib, cfg)
            cap = timed(lambda: lib(softcap=SOFTCAP), cfg)
        else:
            plain = timed(lambda: ws_attn(q3, k3, v3, causal, 0.0, cfg, ws))
            cap = timed(lambda: ws_attn(q3, k3, v3, causal, SOFTCAP, cfg, ws))
        row["plain"], row["softcap"] = plain, cap
        if "error" not in cap:
            if kernel == "library":
                with launch_override("flash_attn", cfg) if cfg else contextlib.nullcontext():
                    out, lse = lib(softcap=SOFTCAP)
                out, lse = out[0], lse[0]
            else:
                out, lse = ws_attn(q3, k3, v3, causal, SOFTCAP, cfg, ws)
            row["max_abs_diff_vs_library"] = float((out.float() - ref[0].float()).abs().max())
            row["lse_max_abs_diff"] = float((lse.float() - ref_lse[0].float()).abs().max())
            if base:
                row["softcap_over_library_plain"] = cap["tflops"] / base
            if plain.get("tflops"):
                row["softcap_over_own_plain"] = cap["tflops"] / plain["tflops"]
                if base:
                    row["own_plain_over_library_plain"] = plain["tflops"] / base
        rec["rows"].append(row)
        print(shape, "causal" if causal else "full", row, flush=True)
    rec["library_plain_default_again_tflops"] = timed(lib).get("tflops")
    return rec


def sass(d, cfg, ws, softcap, causal=False, causal_form=0):
    """Compile :func:`_fwd` for sm_90 here; SASS instruction count, and the counts of MUFU,
    HGMMA and SETMAXNREG (present when Triton split the warps into producer / consumer groups)."""
    from diag_option_forms import sm90_sass

    bm, bn, warps, stages = cfg
    params = list(inspect.signature(_fwd.fn).parameters)
    consts = dict(HQ=32, HKV=8, D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, SOFTCAP=softcap, WS=ws,
                  CAUSAL_FORM=causal_form, FAST_TANH=True)
    types = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", qk_scale="fp32", cap_in="fp32",
                 cap_out="fp32", seqlen_q="i32", seqlen_k="i32")
    sig = {p: "constexpr" if p in consts else types[p] for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
    text, ck = sm90_sass(_fwd, sig, consts, attrs, warps, stages)
    ops = [m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", text)]
    return {"instructions": len(ops), "MUFU": ops.count("MUFU"), "HGMMA": ops.count("HGMMA"),
            "SETMAXNREG": sum(o.startswith("USETMAXREG") or o.startswith("SETMAXNREG") for o in ops),
            "num_warps_compiled": ck.metadata.num_warps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 here and print SASS counts")
    ap.add_argument("--seq", type=int, default=32768, help="sequence length (Sq = Sk; default 32768)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes of bench_flash_attn.SHAPES")
    ap.add_argument("--parts", default="library,tma", help="comma-separated: library, tma, ws (warp-specialized; "
                    "wrong results and a crash on Triton 3.6)")
    ap.add_argument("--out", default="softcap_ws", help="a name under benchmarks/results or a .json path")
    args = ap.parse_args(argv)
    if args.sass:
        for d in (64, 128):
            for cfg, ws in [(c, False) for c in TMA_CONFIGS[d]] + [(c, True) for c in WS_CONFIGS[d]]:
                for causal in (False, True):
                    for cap in (False, True):
                        try:
                            r = sass(d, cfg, ws, cap, causal, 2 if (ws and causal) else 0)
                        except Exception as e:
                            r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                        print(d, cfg, "ws" if ws else "--", "causal" if causal else "full", "softcap" if cap else "plain", r,
                              flush=True)
        return 0
    if not HAS_CUDA:
        print("needs a CUDA GPU (or --sass)")
        return 0
    records = []
    for shape in args.shapes.split(","):
        for causal in (False, True):
            try:
                records.append(run_shape(shape, args.seq, causal, args.parts.split(",")))
            except Exception as e:
                traceback.print_exc()
                records.append({"shape": shape, "causal": causal, "error": f"{type(e).__name__}: {e}"[:400]})
            write_json(args.out, {"benchmark": "softcap_ws", "env": env_record(), "partial": True,
                                  "records": records})
            torch.cuda.empty_cache()
    path = write_json(args.out, {"benchmark": "softcap_ws", "env": env_record(), "records": records})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
