"""Benchmark: block-sparse attention launch variants (the sweep behind ``block_sparse._gpu_config``).

Each :class:`~xoffload.kernels.LaunchConfig` in :data:`SWEEP_CONFIGS` (tiles, warps, stages, TMA
K/V loads) runs through :func:`~xoffload.kernels.launch_override` at 128K and 32K tokens, densities
10% and 100%, with a prebuilt BlockIndex, against our dense kernel and FlexAttention on the same
masks; each variant's output is compared with the default config's; the index builder (Triton) is
timed against the PyTorch one and checked identical. Kernels are compiled first in parallel
processes; a failing variant is recorded and the sweep goes on; timing stops after ``--budget-s``
(default 210 s). Writes benchmarks/results/xattn_bs_sweep.json (name kept from when this lived in
bench_xattn.py ``--sweep-bs``; ``--quick``: 128K only). ``--aot-check`` (no GPU): compile every
variant for sm_90.

The recorded H200 sweep (xattn_bs_sweep.json, 128K, D=128, 32/8 heads, bf16) chose 128x128 tiles,
KV-head-major program order and TMA loads (30.8 ms at 10%, 279.5 ms at 100%); the variants that
never won (index prefetch distance 2, "rev" and "sorted" program orders, one loop, warp
specialization) were deleted from the kernel.
"""
from __future__ import annotations

import time
import traceback

import torch

from _common import HAS_CUDA, bench_parser, env_record, fmt_table, run, tflops, time_ms, write_json
from bench_xattn import BS, D, HKV, HQ, _dense_ours, _flex_call, _rand_qkv, dense_flops, fixed_density_mask, flex_block_mask
from xoffload.kernels import LaunchConfig, launch_override

# Variants swept (bf16, D = 128, block 128); the first is the default.
SWEEP_CONFIGS = [
    LaunchConfig(128, 128, 8, 3, tma=True),
    LaunchConfig(128, 128, 8, 3),
    LaunchConfig(128, 64, 8, 3),
    LaunchConfig(128, 64, 8, 3, tma=True),
    LaunchConfig(128, 64, 8, 4),
    LaunchConfig(128, 128, 8, 2),
    LaunchConfig(64, 64, 4, 3),
]
SWEEP_CONFIGS_QUICK = SWEEP_CONFIGS[:4]


def _bs_cfg_list(quick):
    return list(SWEEP_CONFIGS_QUICK if quick else SWEEP_CONFIGS)


def aot_compile_bs(cfg, arch=90, d=D, bs=BS, causal=True):
    """Compile one block-sparse variant for sm_<arch> without a GPU (triton.compile on an
    ASTSource with the specialisation of a bf16 run: 16-byte aligned pointers, strides that are
    multiples of 16). Returns shared memory bytes and PTX counts (wgmma, cp.async, TMA loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xoffload.kernels import block_sparse as bsm

    cfg = LaunchConfig(*cfg)
    fn = bsm._bs_attn_fwd
    cons = dict(D=d, BLOCK_D=d, BLOCK_M=min(cfg.block_m, bs), BLOCK_N=min(cfg.block_n, bs), BLOCK_SIZE=bs,
                CAUSAL=causal, IS_FP32=False, MASK_BATCH=False, EVEN_K=True, USE_TMA=bool(cfg.tma))
    nods = set(fn.do_not_specialize)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in cons:
            sig[n] = "constexpr"
            continue
        if n in ("Q", "K", "V", "O"):
            sig[n] = "*bf16"
        elif n == "LSE":
            sig[n] = "*fp32"
        elif n in ("IDX", "NFULL", "NTOT"):
            sig[n] = "*i32"
        elif n == "qk_scale":
            sig[n] = "fp32"
            continue
        else:
            sig[n] = "i32"
        if n in nods or i in nods:
            continue
        attrs[(i,)] = [["tt.divisibility", 16]]
    t = time.time()
    kern = triton.compile(ASTSource(fn, sig, cons, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = kern.asm["ptx"]
    return {"config": cfg.name(), "seconds": round(time.time() - t, 1), "shared_bytes": kern.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async.cg"),
            "tma_loads": ptx.count("cp.async.bulk.tensor")}


def aot_compile_index(arch=90, causal=True, block_k=1024):
    """Compile the mask -> index-list kernel for sm_<arch> without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xoffload.kernels import block_index

    fn = block_index._mask_to_idx_kernel
    cons = dict(BS=BS, CAUSAL=causal, BLOCK_K=block_k)
    types = {"M": "*u8", "IDX": "*i32", "NF": "*i32", "NT": "*i32"}
    sig = {n: "constexpr" if n in cons else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in cons and n not in fn.do_not_specialize and n != "stride_mj"}
    t = time.time()
    kern = triton.compile(ASTSource(fn, sig, cons, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=4, num_stages=1))
    return {"config": f"mask_to_indices BLOCK_K={block_k}", "seconds": round(time.time() - t, 1),
            "shared_bytes": kern.metadata.shared}


def _aot_one(cfg):
    try:
        if cfg == "index":
            return aot_compile_index()
        return aot_compile_bs(cfg)
    except Exception as e:
        return {"config": str(cfg), "error": f"{type(e).__name__}: {e}"[:300]}


def aot_check(quick=False, processes=2):
    """AOT-compile every sweep variant for sm_90 (CPU only); prints one line per variant."""
    import multiprocessing as mp

    cfgs = ["index"] + _bs_cfg_list(quick)
    with mp.get_context("spawn").Pool(min(processes, len(cfgs))) as pool:
        res = pool.map(_aot_one, cfgs)
    for r in res:
        print(r, flush=True)
    return res


def _sweep_warm_one(item):
    """Compile one block-sparse variant (or the index builder / dense kernel) on tiny CUDA inputs
    with the specialisation of the sweep's runs."""
    from xoffload.kernels import block_sparse as bsm

    try:
        s = 256
        q = torch.randn(1, s, 8, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, s, 2, D, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(1, 8, s // BS, s // BS, dtype=torch.bool, device="cuda")
        if item == "dense":
            from xoffload.kernels import flash_attn_with_lse

            flash_attn_with_lse(q, k, k, causal=True)
        else:
            bi = bsm.block_mask_to_indices(mask, s, s)
            if item != "index":
                with launch_override("block_sparse", item):
                    bsm.block_sparse_attn_with_lse(q, k, k, bi)
        torch.cuda.synchronize()
        return (str(item), "ok")
    except Exception as e:
        return (str(item), f"{type(e).__name__}: {e}"[:300])


def _diff(a, b):
    fin = torch.isfinite(b)
    d = (a.float() - b.float()).abs()
    bad = int((torch.isfinite(a) != fin).sum())
    return (float(d[fin].max()) if bool(fin.any()) else 0.0), bad


def run_bs_sweep(seqs, densities=(0.10, 1.00), quick=False, with_flex=True, budget_s=210.0, processes=16,
                 configs=None):
    """Time every block-sparse launch variant (SWEEP_CONFIGS) at each length and density on the
    same masks, with our dense kernel and FlexAttention as peers.

    Each variant is timed with a prebuilt BlockIndex; its output and LSE are compared with the default config's (max abs diff, and the count
    of entries finite in one and not the other). A variant that fails is recorded and the sweep
    goes on; once ``budget_s`` has passed the remaining variants are recorded as skipped. Kernels
    are first compiled in ``processes`` parallel processes (0: no warm-up).
    """
    import multiprocessing as mp

    from xoffload.kernels import block_sparse as bsm
    from xoffload.kernels.block_index import block_mask_to_indices, mask_to_indices_torch

    t0 = time.time()
    default = bsm._gpu_config(D, torch.bfloat16)
    cfgs = [default] + [c for c in (configs or _bs_cfg_list(quick)) if c != default]  # the reference first
    items = ["dense", "index"] + cfgs
    warm_res = []
    if processes > 0:
        with mp.get_context("spawn").Pool(min(processes, len(items))) as pool:
            warm_res = pool.map(_sweep_warm_one, items)
    out = {"configs": [c.name() for c in cfgs], "default": default.name(),
           "warm": {"seconds": round(time.time() - t0, 1), "failures": [r for r in warm_res if r[1] != "ok"]},
           "runs": []}
    print(f"sweep: compiled {len(items)} kernels in {time.time() - t0:.1f} s; failures: {out['warm']['failures']}",
          flush=True)
    for s in seqs:
        q, k, v = _rand_qkv(s, seed=1)
        run = {"S_tokens": s, "records": []}
        try:
            run["dense_ours_ms"] = time_ms(_dense_ours(q, k, v))
            run["dense_ours_tflops"] = tflops(dense_flops(s), run["dense_ours_ms"])
        except Exception as e:
            run["dense_ours_error"] = f"{type(e).__name__}: {e}"[:300]
        for dens in densities:
            mask = fixed_density_mask(s, dens, seed=int(dens * 100))
            nb = mask.shape[-1]
            rec = {"target_density": dens, "density": float(mask.sum()) / (HQ * nb * (nb + 1) // 2), "variants": []}
            flops = dense_flops(s) * rec["density"]
            # index build: the Triton builder and the PyTorch one it replaced
            try:
                bi = block_mask_to_indices(mask, s, s, block_size=BS)
                old = mask_to_indices_torch(mask, s, s, BS, True)
                rec["index_identical_to_torch_builder"] = all(torch.equal(a, b) for a, b in
                                                              zip((bi.indices, bi.n_full, bi.n_total), old))
                del old
                rec["index_build_ms"] = time_ms(lambda: block_mask_to_indices(mask, s, s, block_size=BS))
                rec["index_build_torch_ms"] = time_ms(lambda: mask_to_indices_torch(mask, s, s, BS, True))
            except Exception as e:
                traceback.print_exc()
                rec["index_error"] = f"{type(e).__name__}: {e}"[:300]
                run["records"].append(rec)
                continue
            ref = None
            for cfg in cfgs:
                vr = {"config": cfg.name()}
                if time.time() - t0 > budget_s:
                    vr["skipped"] = f"sweep time budget of {budget_s:.0f} s reached"
                    rec["variants"].append(vr)
                    continue
                try:
                    with launch_override("block_sparse", cfg):
                        o, l = bsm.block_sparse_attn_with_lse(q, k, v, bi, block_size=BS)
                    with launch_override("block_sparse", cfg):
                        vr["ms"] = time_ms(lambda: bsm.block_sparse_attn_with_lse(q, k, v, bi, block_size=BS))
                    vr["tflops_effective"] = tflops(flops, vr["ms"])
                    if "dense_ours_ms" in run:
                        vr["over_dense"] = vr["ms"] / run["dense_ours_ms"]
                    if ref is None and cfg == default:
                        ref = (o, l)
                    if ref is not None:
                        vr["out_max_abs_diff_vs_default"], nf_o = _diff(o, ref[0])
                        vr["lse_max_abs_diff_vs_default"], nf_l = _diff(l, ref[1])
                        vr["finite_mismatch"] = nf_o + nf_l
                        vr["matches_default"] = (vr["out_max_abs_diff_vs_default"] <= 1.6e-2
                                                 and vr["lse_max_abs_diff_vs_default"] <= 1e-3 and nf_o + nf_l == 0)
                    del o, l
                except Exception as e:
                    traceback.print_exc()
                    vr["error"] = f"{type(e).__name__}: {e}"[:300]
                rec["variants"].append(vr)
                print(f"  S={s} density={rec['density']:.3f} {cfg.name():28s} "
                      f"{vr.get('ms', vr.get('error', vr.get('skipped')))}", flush=True)
            if with_flex and time.time() - t0 < budget_s + 30:
                try:
                    fn = _flex_call(q, k, v, flex_block_mask(mask, s))
                    rec["flex_ms"] = time_ms(fn)
                    if ref is not None:
                        fo = fn()
                        fo = fo[0] if isinstance(fo, tuple) else fo
                        rec["flex_out_max_abs_diff_vs_default"] = _diff(fo.transpose(1, 2), ref[0])[0]
                        del fo
                except Exception as e:
                    traceback.print_exc()
                    rec["flex_error"] = f"{type(e).__name__}: {e}"[:300]
            elif with_flex:
                rec["flex_error"] = "skipped: sweep time budget"
            ok = [vr for vr in rec["variants"] if "ms" in vr and vr.get("matches_default", False)]
            for vr in ok:
                if "flex_ms" in rec:
                    vr["over_flex"] = vr["ms"] / rec["flex_ms"]
            if ok:
                best = min(ok, key=lambda vr: vr["ms"])
                base = next((vr for vr in ok if vr["config"] == default.name()), None)
                rec["winner"] = {"config": best["config"], "ms": best["ms"],
                                 "over_dense": best.get("over_dense"), "over_flex": best.get("over_flex"),
                                 "speedup_over_default": (base["ms"] / best["ms"]) if base else None}
            run["records"].append(rec)
            del ref, bi, mask
            torch.cuda.empty_cache()
        out["runs"].append(run)
        del q, k, v
        torch.cuda.empty_cache()
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _print_sweep(res):
    for run in res["runs"]:
        print(f"block-sparse variants at {run['S_tokens']} tokens; dense ours {run.get('dense_ours_ms', '-')} ms")
        recs = run["records"]
        rows = {}
        for rec in recs:
            tag = f"{round(rec['target_density'] * 100)}%"
            for vr in rec["variants"]:
                r = rows.setdefault(vr["config"], {"config": vr["config"]})
                r[f"{tag}_ms"] = vr.get("ms", "err" if "error" in vr else "skip")
                r[f"{tag}/dense"] = vr.get("over_dense", "-")
                r[f"{tag}/flex"] = vr.get("over_flex", "-")
                r[f"{tag}_diff"] = vr.get("out_max_abs_diff_vs_default", "-")
        if rows:
            cols = list(next(iter(rows.values())).keys())
            print(fmt_table(list(rows.values()), cols), flush=True)
        for rec in recs:
            print(f"  density {rec['density']:.3f}: flex {rec.get('flex_ms', rec.get('flex_error', '-'))} ms; "
                  f"index build {rec.get('index_build_ms', '-')} ms (torch builder "
                  f"{rec.get('index_build_torch_ms', '-')} ms, identical: "
                  f"{rec.get('index_identical_to_torch_builder', '-')}); "
                  f"winner {rec.get('winner')}", flush=True)


def sweep_main(args):
    """The launch-variant sweep, JSON to benchmarks/results/xattn_bs_sweep.json."""
    seqs = [131072] if args.quick else [131072, 32768]
    payload = {"benchmark": "xattn_bs_sweep", "env": env_record(),
               "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "batch": 1, "block_size": BS, "dtype": "bfloat16",
                         "causal": True, "mask": "fixed_density_mask: sink + diagonal + random causal blocks per "
                                                 "(query head, query block)"},
               "timing": "median of CUDA-event-timed calls after a warm-up (do_bench for calls < 20 ms); ours with "
                         "a prebuilt BlockIndex, Flex with a prebuilt BlockMask",
               "quick": args.quick}
    t0 = time.time()
    try:
        payload["sweep"] = run_bs_sweep(seqs, quick=args.quick, with_flex=not args.no_flex, budget_s=args.budget_s)
    except Exception as e:
        traceback.print_exc()
        payload["sweep"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    payload["total_seconds"] = round(time.time() - t0, 1)
    path = write_json(args.out, payload)
    if "runs" in payload["sweep"]:
        _print_sweep(payload["sweep"])
    print(f"wrote {path} ({payload['total_seconds']} s)")
    return 0


def main(argv=None):
    ap = bench_parser(__doc__, "xattn_bs_sweep", quick_help="128K only, 4 variants")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compile time)")
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop timing variants after this")
    ap.add_argument("--aot-check", action="store_true",
                    help="no GPU needed: compile every sweep variant for sm_90 and print shared memory / PTX counts")
    args = ap.parse_args(argv)
    if args.aot_check:
        res = aot_check(quick=args.quick)
        return 1 if any("error" in r for r in res) else 0
    if not HAS_CUDA:
        print("bench_block_sparse: no CUDA device, skipped")
        return 0
    return sweep_main(args)


if __name__ == "__main__":
    run(main)
