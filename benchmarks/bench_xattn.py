"""Benchmark: XAttention sparse prefill (estimate, block-sparse attention, end to end), bf16, batch 1.

Shape: D=128, 32 query / 8 KV heads (Llama-3.1-8B), causal prefill (Sq = Sk), block size 128.

1. ``estimate``: :func:`xattn_estimate` (stages 1-3) and :func:`select_blocks` for S = 8 and 16,
   against dense causal attention (ours, :func:`flash_attn_with_lse`, and SDPA with the cuDNN
   backend) at 32K, 64K, 128K. Goal: estimate <= 15% of our dense time at 128K.
2. ``block_sparse``: :func:`block_sparse_attn_with_lse` at fixed densities 5, 10, 20, 50, 100% of
   the causal blocks at 128K (random blocks per (head, query block), sink and diagonal always in),
   against FlexAttention (``torch.compile(flex_attention)``) given a ``BlockMask`` built from the
   same boolean block mask (``BlockMask.from_kv_blocks``: fully visible kept blocks as full blocks,
   diagonal ones as partial blocks under a causal ``mask_mod``), and against our dense kernel.
   Goals: at 10%, <= 0.13x our dense time and not slower than Flex; at 100%, <= 1.1x dense.
   Compared with Flex (whose BlockMask is prebuilt): ours with a prebuilt BlockIndex
   (``ours_kernel_only_ms``); the index build (``mask_to_indices_ms``) and the call with the bool
   mask (``ours_ms`` = build + kernel) are reported beside it.
3. ``end_to_end``: :func:`xattention_prefill` (threshold 0.9) at 128K against dense causal
   attention, on synthetic inputs with real attention structure
   (:func:`xoffload.testing.synthetic.structured_qkv`: RoPE'd content vectors per KV head, so
   attention is local with a long RoPE tail, plus an attention sink; KV heads range from broad to
   sharp) — random Q/K would have near-uniform attention. Reports the density reached per head,
   the relative error of the output against dense, and the time split.

Times are medians over CUDA-event-timed calls after a warm-up (calls of 100+ ms are timed 3 times,
short ones through ``triton.testing.do_bench``). Every stage is guarded: a failure is recorded in
the JSON and the next stage runs.

``--sweep-bs``: only the block-sparse launch variants (``block_sparse.SWEEP_CONFIGS``: tiles,
stages, index prefetch distance, program order, TMA loads, one loop, warp specialization) at 128K
and 32K, densities 10% and 100%, each with a prebuilt BlockIndex, against our dense kernel and
Flex on the same masks; each variant's output is compared with the default config's; the index
builder (Triton) is timed against the PyTorch one it replaced and checked identical. Kernels are
compiled first in parallel processes; a failing variant is recorded and the sweep goes on; timing
stops after ``--budget-s`` (default 210 s). Writes benchmarks/results/xattn_bs_sweep.json
(``--quick``: 128K only, 12 variants). ``--aot-check`` (no GPU): compile every variant for sm_90.

Run: ``python benchmarks/bench_xattn.py [--quick] [--no-flex]`` prints tables and writes
benchmarks/results/xattn.json (``--quick``: 128K only, S=8 and 16 for the estimate, one end-to-end
threshold). Under pytest: ``pytest benchmarks/bench_xattn.py`` (a 32K version of each stage).
Skips without CUDA.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import HAS_CUDA, bench_ms, env_record, fmt_table, requires_cuda, tflops, time_ms, write_json  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 128
DENSITIES = (0.05, 0.10, 0.20, 0.50, 1.00)


def dense_flops(s):
    return 4.0 * HQ * s * s * D / 2  # causal


def _rand_qkv(s, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, s, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _dense_ours(q, k, v):
    from xoffload.kernels import flash_attn_with_lse

    return lambda: flash_attn_with_lse(q, k, v, causal=True)


def _sdpa_cudnn(q, k, v):
    """SDPA cuDNN backend on [B, H, S, D] copies; GQA via enable_gqa, else repeated K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def call(kk, vv, gqa):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if gqa:
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True)

    try:
        call(kt, vt, True)
        return (lambda: call(kt, vt, True)), "enable_gqa=True"
    except Exception:
        kr = kt.repeat_interleave(HQ // HKV, 1)
        vr = vt.repeat_interleave(HQ // HKV, 1)
        call(kr, vr, False)
        return (lambda: call(kr, vr, False)), "K/V repeated to 32 heads"


# ---------------------------------------------------------------------------------------------
# 1. estimation
# ---------------------------------------------------------------------------------------------

def run_estimate(seqs, strides, reps=3):
    from xoffload.kernels import xattn_estimate
    from xoffload.sparse.select import select_blocks

    out = []
    for s in seqs:
        q, k, v = _rand_qkv(s)
        rec = {"S_tokens": s}
        try:
            rec["dense_ours_ms"] = time_ms(_dense_ours(q, k, v), reps)
        except Exception as e:
            rec["dense_ours_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            fn, note = _sdpa_cudnn(q, k, v)
            rec["dense_cudnn_ms"] = time_ms(fn, reps)
            rec["cudnn_note"] = note
        except Exception as e:
            rec["dense_cudnn_error"] = f"{type(e).__name__}: {e}"[:300]
        for st in strides:
            try:
                scores = xattn_estimate(q, k, stride=st)  # autotunes on first use
                est = time_ms(lambda: xattn_estimate(q, k, stride=st), reps)
                sel = time_ms(lambda: select_blocks(scores, 0.9, sq=s, sk=s), reps)
                r = {"estimate_ms": est, "select_ms": sel,
                     "estimate_tflops": tflops(2.0 * HQ * (s / st) * (s / st) / 2 * st * D, est)}
                for peer in ("dense_ours_ms", "dense_cudnn_ms"):
                    if peer in rec:
                        r[f"estimate_over_{peer[:-3]}"] = est / rec[peer]
                        r[f"estimate_plus_select_over_{peer[:-3]}"] = (est + sel) / rec[peer]
                rec[f"S{st}"] = r
                del scores
            except Exception as e:
                traceback.print_exc()
                rec[f"S{st}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        try:
            mod = sys.modules["xoffload.kernels.xattn"]
            rec["stats_autotune_choice"] = {str(kk): str(vv) for kk, vv in mod._xattn_stats_tuned.cache.items()}
        except Exception:
            pass
        out.append(rec)
        del q, k, v
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# 2. block-sparse attention at fixed densities vs FlexAttention
# ---------------------------------------------------------------------------------------------

def fixed_density_mask(s, density, seed=0):
    """Bool [1, HQ, nb, nb]: sink + diagonal + random causal blocks; kept/visible ~= density."""
    nb = -(-s // BS)
    g = torch.Generator(device="cuda").manual_seed(seed)
    i = torch.arange(nb, device="cuda")
    vis = i[None, :] <= i[:, None]
    forced = vis & ((i[None, :] == 0) | (i[None, :] == i[:, None]))
    n_vis = int(vis.sum())
    n_forced = int(forced.sum())
    p = max(0.0, min(1.0, (density * n_vis - n_forced) / max(n_vis - n_forced, 1)))
    r = torch.rand(1, HQ, nb, nb, device="cuda", generator=g) < p
    return (r & vis) | forced


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(mask, s):
    """FlexAttention BlockMask with exactly the kept blocks of ``mask`` (causal inside).

    Kept blocks strictly below the diagonal are "full" blocks (no mask_mod), diagonal ones
    "partial" (causal mask_mod). Checked against the reference on the CPU with the compiled
    flex_attention (the eager one applies only mask_mod and ignores the block lists).
    """
    from torch.nn.attention.flex_attention import BlockMask

    nb = mask.shape[-1]
    i = torch.arange(nb, device=mask.device)
    full_vis = i[None, :] < i[:, None]  # strictly below the diagonal: every element visible
    m_full = mask & full_vis
    m_part = mask & ~full_vis

    def to_idx(m):
        cnt = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cnt.contiguous(), idx.contiguous()

    kv_num, kv_idx = to_idx(m_part)
    full_num, full_idx = to_idx(m_full)

    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BS, mask_mod=_causal_mod,
                                        seq_lengths=(s, s))
    except TypeError:  # older torch: no seq_lengths
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BS, mask_mod=_causal_mod)


_FLEX = {}


def _flex_call(q, k, v, bm):
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        try:  # new BlockMask contents per density must not exhaust the recompile limit
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        except Exception:
            pass
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    try:
        flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_lse=True)
        return lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_lse=True)
    except TypeError:
        from torch.nn.attention.flex_attention import AuxRequest

        aux = AuxRequest(lse=True)
        flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_aux=aux)
        return lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_aux=aux)


def _default_needs_order():
    """Whether the current default launch config (bf16, D=128) uses the "sorted" program order,
    whose per-row order is then part of the prebuilt index."""
    from xoffload.kernels.block_sparse import _gpu_config

    return _gpu_config(D, torch.bfloat16).order == "sorted"


def run_block_sparse(s, densities, with_flex=True, reps=3, flex_budget_s=90.0):
    """Block-sparse attention at fixed densities. Fields per density:

    ours_kernel_only_ms: the kernel with a prebuilt :class:`BlockIndex` (the figure compared with
        Flex, whose ``BlockMask`` is also prebuilt); ours_kernel_over_dense / _over_flex,
        ours_kernel_tflops_effective (causal dense FLOPs x density / time).
    mask_to_indices_ms: building that index from the bool mask (block_mask_to_indices).
    ours_ms: the call with the bool mask (index build + kernel, what xattention_prefill pays);
        ours_over_dense, ours_tflops_effective, ours_with_index_build_over_flex.
    """
    from xoffload.kernels import block_sparse_attn_with_lse
    from xoffload.kernels.block_sparse import block_mask_to_indices

    q, k, v = _rand_qkv(s, seed=1)
    res = {"S_tokens": s, "records": []}
    try:
        res["dense_ours_ms"] = time_ms(_dense_ours(q, k, v), reps)
    except Exception as e:
        res["dense_ours_error"] = f"{type(e).__name__}: {e}"[:300]
    t_flex0 = None
    with_order = _default_needs_order()
    for dens in densities:
        mask = fixed_density_mask(s, dens, seed=int(dens * 100))
        nb = mask.shape[-1]
        n_vis = nb * (nb + 1) // 2
        rec = {"target_density": dens, "density": float(mask.sum()) / (HQ * n_vis)}
        try:
            rec["ours_ms"] = time_ms(lambda: block_sparse_attn_with_lse(q, k, v, mask), reps)
            bi = block_mask_to_indices(mask, s, s, with_order=with_order)
            rec["ours_kernel_only_ms"] = time_ms(lambda: block_sparse_attn_with_lse(q, k, v, bi), reps)
            rec["mask_to_indices_ms"] = time_ms(lambda: block_mask_to_indices(mask, s, s, with_order=with_order),
                                                reps)
            rec["ours_tflops_effective"] = tflops(dense_flops(s) * rec["density"], rec["ours_ms"])
            rec["ours_kernel_tflops_effective"] = tflops(dense_flops(s) * rec["density"], rec["ours_kernel_only_ms"])
            if "dense_ours_ms" in res:
                rec["ours_over_dense"] = rec["ours_ms"] / res["dense_ours_ms"]
                rec["ours_kernel_over_dense"] = rec["ours_kernel_only_ms"] / res["dense_ours_ms"]
            del bi
        except Exception as e:
            traceback.print_exc()
            rec["ours_error"] = f"{type(e).__name__}: {e}"[:300]
        if with_flex:
            try:
                if t_flex0 is None:
                    t_flex0 = time.time()
                if time.time() - t_flex0 > flex_budget_s:
                    raise TimeoutError(f"flex skipped: over its {flex_budget_s:.0f} s budget")
                bm = flex_block_mask(mask, s)
                fn = _flex_call(q, k, v, bm)
                rec["flex_ms"] = time_ms(fn, reps)
                fo = fn()
                fo = fo[0] if isinstance(fo, tuple) else fo
                oo, _ = block_sparse_attn_with_lse(q, k, v, mask)
                rec["flex_vs_ours_max_abs_diff"] = float((fo.transpose(1, 2).float() - oo.float()).abs().max())
                del fo, oo
                if "ours_kernel_only_ms" in rec:
                    rec["ours_kernel_over_flex"] = rec["ours_kernel_only_ms"] / rec["flex_ms"]
                if "ours_ms" in rec:
                    rec["ours_with_index_build_over_flex"] = rec["ours_ms"] / rec["flex_ms"]
                if "dense_ours_ms" in res:
                    rec["flex_over_dense_ours"] = rec["flex_ms"] / res["dense_ours_ms"]
            except Exception as e:
                traceback.print_exc()
                rec["flex_error"] = f"{type(e).__name__}: {e}"[:300]
        res["records"].append(rec)
        del mask
    del q, k, v
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# 2b. launch-variant sweep of the block-sparse kernel (--sweep-bs)
# ---------------------------------------------------------------------------------------------

def _bs_cfg_list(quick):
    from xoffload.kernels.block_sparse import SWEEP_CONFIGS, SWEEP_CONFIGS_QUICK

    return list(SWEEP_CONFIGS_QUICK if quick else SWEEP_CONFIGS)


def aot_compile_bs(cfg, arch=90, d=D, bs=BS, causal=True):
    """Compile one block-sparse variant for sm_<arch> without a GPU (triton.compile on an
    ASTSource with the specialisation of a bf16 run: 16-byte aligned pointers, strides that are
    multiples of 16). Returns shared memory bytes and PTX counts (wgmma, cp.async, TMA loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xoffload.kernels import block_sparse as bsm

    cfg = bsm._as_config(cfg)
    fn = bsm._bs_attn_fwd
    cons = dict(D=d, BLOCK_D=d, BLOCK_M=min(cfg.block_m, bs), BLOCK_N=min(cfg.block_n, bs), BLOCK_SIZE=bs,
                CAUSAL=causal, IS_FP32=False, MASK_BATCH=False, EVEN_K=True, ORDER=bsm._ORDERS[cfg.order],
                PREFETCH=cfg.prefetch, USE_TMA=bool(cfg.tma), ONE_LOOP=bool(cfg.one_loop),
                WARP_SPEC=bool(cfg.warp_spec))
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
        elif n in ("IDX", "NFULL", "NTOT", "ORD"):
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

    from xoffload.kernels import block_sparse as bsm

    fn = bsm._mask_to_idx_kernel
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
            bi = bsm.block_mask_to_indices(mask, s, s, with_order=True)
            if item != "index":
                bsm._CFG_OVERRIDE.append(item)
                try:
                    bsm.block_sparse_attn_with_lse(q, k, k, bi)
                finally:
                    bsm._CFG_OVERRIDE.pop()
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

    Each variant is timed with a prebuilt BlockIndex (incl. the row order the "sorted" variants
    use); its output and LSE are compared with the default config's (max abs diff, and the count
    of entries finite in one and not the other). A variant that fails is recorded and the sweep
    goes on; once ``budget_s`` has passed the remaining variants are recorded as skipped. Kernels
    are first compiled in ``processes`` parallel processes (0: no warm-up).
    """
    import multiprocessing as mp

    from xoffload.kernels import block_sparse as bsm
    from xoffload.kernels.block_sparse import _mask_to_indices_torch, block_mask_to_indices

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
            # index build: the Triton builder, the PyTorch one it replaced, the row order
            try:
                bi = block_mask_to_indices(mask, s, s, block_size=BS)
                old = _mask_to_indices_torch(mask, s, s, BS, True)
                rec["index_identical_to_torch_builder"] = all(torch.equal(a, b) for a, b in
                                                              zip((bi.indices, bi.n_full, bi.n_total), old))
                del old
                rec["index_build_ms"] = time_ms(lambda: block_mask_to_indices(mask, s, s, block_size=BS))
                rec["index_build_torch_ms"] = time_ms(lambda: _mask_to_indices_torch(mask, s, s, BS, True))
                rec["order_build_ms"] = time_ms(lambda: bsm._row_order(bi.n_total, nb))
                bi = block_mask_to_indices(mask, s, s, block_size=BS, with_order=True)
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
                bsm._CFG_OVERRIDE.append(cfg)
                try:
                    o, l = bsm.block_sparse_attn_with_lse(q, k, v, bi, block_size=BS)
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
                finally:
                    bsm._CFG_OVERRIDE.pop()
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
                  f"{rec.get('index_identical_to_torch_builder', '-')}), order {rec.get('order_build_ms', '-')} ms; "
                  f"winner {rec.get('winner')}", flush=True)


# ---------------------------------------------------------------------------------------------
# 3. end to end on structured inputs
# ---------------------------------------------------------------------------------------------

SYNTH = dict(peak=(14.0, 26.0), sink=8.0, sink_tokens=4, noise=0.6, head_spread=0.3, theta=500000.0)


def run_end_to_end(s, thresholds=(0.9,), strides=(8,), reps=3):
    from xoffload.kernels import block_sparse_attn_with_lse, flash_attn_with_lse, xattn_estimate
    from xoffload.sparse.select import select_blocks
    from xoffload.sparse.select import mask_density
    from xoffload.sparse import xattention_prefill
    from xoffload.testing.synthetic import structured_qkv

    q, k, v = structured_qkv(s, HQ, HKV, D, dtype=torch.bfloat16, device="cuda", seed=0, **SYNTH)
    res = {"S_tokens": s, "inputs": (
        "synthetic, xoffload.testing.synthetic.structured_qkv(seed=0, " + ", ".join(f"{a}={b}" for a, b in SYNTH.items())
        + "): per KV head a content vector u (norm^2/sqrt(D) = peak, heads spread from broad to sharp), "
          "K_s = RoPE(s)(u + noise), Q_t = RoPE(t)(u + head offset + sink dir + noise): local attention "
          "with a RoPE long-range tail, plus 4 sink tokens every query attends to; V random"), "records": []}
    dense_out, _ = flash_attn_with_lse(q, k, v, causal=True)
    res["dense_ours_ms"] = time_ms(_dense_ours(q, k, v), reps)
    dn = dense_out.float().norm()
    for st in strides:
        for tau in thresholds:
            rec = {"stride": st, "threshold": tau}
            try:
                out, lse, dens = xattention_prefill(q, k, v, threshold=tau, stride=st)
                rec["density_mean"] = float(dens.mean())
                rec["density_per_head"] = [round(float(x), 4) for x in dens]
                rec["rel_err_vs_dense"] = float((out.float() - dense_out.float()).norm() / dn)
                del out, lse
                rec["xattention_prefill_ms"] = time_ms(lambda: xattention_prefill(q, k, v, threshold=tau, stride=st), reps)
                rec["speedup_over_dense_ours"] = res["dense_ours_ms"] / rec["xattention_prefill_ms"]
                scores = xattn_estimate(q, k, stride=st)
                mask = select_blocks(scores, tau, sq=s, sk=s)
                rec["split_ms"] = {
                    "estimate": time_ms(lambda: xattn_estimate(q, k, stride=st), reps),
                    "select": time_ms(lambda: select_blocks(scores, tau, sq=s, sk=s), reps),
                    "block_sparse": time_ms(lambda: block_sparse_attn_with_lse(q, k, v, mask), reps),
                    "density": time_ms(lambda: mask_density(mask, s, s, BS), reps),
                }
                del scores, mask
            except Exception as e:
                traceback.print_exc()
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            res["records"].append(rec)
    del q, k, v, dense_out
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# parallel compile warm-up (fills Triton's on-disk cache from several processes at once)
# ---------------------------------------------------------------------------------------------

def _warm_variants():
    v = []
    for st in (4, 8, 16):
        for causal in (True, False):
            v.append(("stats", st, causal, (128, 64, 8, 3)))
    for st in (8, 16):
        for cfg in ((128, 128, 8, 3), (128, 128, 8, 2)):
            v.append(("stats", st, True, cfg))
    for st in (4, 8, 16):
        v.append(("blocksum", st))
    for causal in (True, False):
        for mb in (1, 2):
            v.append(("bs", causal, mb, torch.bfloat16, 128))
    v.append(("bs", True, 1, torch.float16, 64))
    v.append(("dense",))
    return v


def _warm_one(v):
    """Compile one kernel variant on tiny inputs with the same specialisation as the real runs."""
    import importlib

    try:
        kind = v[0]
        if kind == "stats":
            _, st, causal, cfg = v
            mod = importlib.import_module("xoffload.kernels.xattn")
            q = torch.randn(1, 256, 8, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 256, 2, D, device="cuda", dtype=torch.bfloat16)
            mod._CFG_OVERRIDE.append(cfg)
            try:
                mod.xattn_chunk_stats(q, k, q_start=0, stride=st, causal=causal)
            finally:
                mod._CFG_OVERRIDE.pop()
        elif kind == "blocksum":
            from xoffload.kernels import xattn_chunk_stats, xattn_block_scores

            q = torch.randn(1, 256, 8, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 256, 2, D, device="cuda", dtype=torch.bfloat16)
            stt = xattn_chunk_stats(q, k, q_start=0, stride=v[1])
            xattn_block_scores(stt.block_lse, stt.row_max, stt.row_sum, stride=v[1])
        elif kind == "bs":
            from xoffload.kernels import block_sparse_attn_with_lse

            _, causal, mb, dt, d = v
            q = torch.randn(mb, 256, 8, d, device="cuda", dtype=dt)
            k = torch.randn(mb, 256, 2, d, device="cuda", dtype=dt)
            block_sparse_attn_with_lse(q, k, k, torch.ones(mb, 8, 2, 2, dtype=torch.bool, device="cuda"),
                                       causal=causal)
        elif kind == "dense":
            from xoffload.kernels import flash_attn_with_lse

            q = torch.randn(1, 256, 8, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 256, 2, D, device="cuda", dtype=torch.bfloat16)
            flash_attn_with_lse(q, k, k, causal=True)
        torch.cuda.synchronize()
        return (str(v), "ok")
    except Exception as e:  # the real run reports it
        return (str(v), f"{type(e).__name__}: {e}"[:200])


def warm(processes=16):
    """Compile the kernels the tests and this benchmark use, in parallel processes."""
    import multiprocessing as mp

    t = time.time()
    variants = _warm_variants()
    with mp.get_context("spawn").Pool(min(processes, len(variants))) as pool:
        res = pool.map(_warm_one, variants)
    bad = [r for r in res if r[1] != "ok"]
    print(f"warm: {len(variants)} variants in {time.time() - t:.1f} s; failures: {bad}", flush=True)
    return {"seconds": round(time.time() - t, 1), "failures": bad}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def _print_estimate(rows):
    table = []
    for r in rows:
        for key in [x for x in r if x.startswith("S") and x != "S_tokens"]:
            e = r[key]
            table.append({"S_tokens": r["S_tokens"], "stride": key, "dense_ours_ms": r.get("dense_ours_ms", "-"),
                          "dense_cudnn_ms": r.get("dense_cudnn_ms", "-"), "estimate_ms": e.get("estimate_ms", "-"),
                          "select_ms": e.get("select_ms", "-"),
                          "est/ours": e.get("estimate_over_dense_ours", "-"),
                          "est/cudnn": e.get("estimate_over_dense_cudnn", "-")})
    if table:
        print(fmt_table(table, list(table[0].keys())), flush=True)


def _print_bs(res):
    rows = [{"density": r["density"], "kernel_ms": r.get("ours_kernel_only_ms", "-"),
             "index_ms": r.get("mask_to_indices_ms", "-"), "with_index_ms": r.get("ours_ms", "-"),
             "flex_ms": r.get("flex_ms", "-"), "kernel/dense": r.get("ours_kernel_over_dense", "-"),
             "kernel/flex": r.get("ours_kernel_over_flex", "-")}
            for r in res["records"]]
    print(f"block-sparse at {res['S_tokens']} tokens, dense ours {res.get('dense_ours_ms', '-')} ms "
          f"(kernel = prebuilt BlockIndex, as Flex has a prebuilt BlockMask; index = its build time)")
    if rows:
        print(fmt_table(rows, list(rows[0].keys())), flush=True)


def sweep_main(args):
    """--sweep-bs: the launch-variant sweep alone, JSON to benchmarks/results/xattn_bs_sweep.json."""
    seqs = [131072] if args.quick else [131072, 32768]
    payload = {"benchmark": "xattn_bs_sweep", "env": env_record(),
               "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "batch": 1, "block_size": BS, "dtype": "bfloat16",
                         "causal": True, "mask": "fixed_density_mask: sink + diagonal + random causal blocks per "
                                                 "(query head, query block)"},
               "timing": "median of CUDA-event-timed calls after a warm-up (do_bench for calls < 20 ms); ours with "
                         "a prebuilt BlockIndex (and row order), Flex with a prebuilt BlockMask",
               "quick": args.quick}
    t0 = time.time()
    try:
        payload["sweep"] = run_bs_sweep(seqs, quick=args.quick, with_flex=not args.no_flex, budget_s=args.budget_s)
    except Exception as e:
        traceback.print_exc()
        payload["sweep"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    payload["total_seconds"] = round(time.time() - t0, 1)
    path = write_json("xattn_bs_sweep", payload)
    if "runs" in payload["sweep"]:
        _print_sweep(payload["sweep"])
    print(f"wrote {path} ({payload['total_seconds']} s)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128K only; S=8,16; one end-to-end threshold")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compile time)")
    ap.add_argument("--name", default="xattn")
    ap.add_argument("--warm-only", action="store_true", help="only compile the kernels (parallel processes)")
    ap.add_argument("--sweep-bs", action="store_true",
                    help="only the block-sparse launch-variant sweep (128K and 32K; --quick: 128K, fewer variants) "
                         "-> benchmarks/results/xattn_bs_sweep.json")
    ap.add_argument("--budget-s", type=float, default=210.0, help="--sweep-bs: stop timing variants after this")
    ap.add_argument("--aot-check", action="store_true",
                    help="no GPU needed: compile every sweep variant for sm_90 and print shared memory / PTX counts")
    args = ap.parse_args(argv)
    if args.aot_check:
        res = aot_check(quick=args.quick)
        return 1 if any("error" in r for r in res) else 0
    if not HAS_CUDA:
        print("bench_xattn: no CUDA device, skipped")
        return 0
    if args.warm_only:
        warm()
        return 0
    if args.sweep_bs:
        return sweep_main(args)
    s_main = 131072
    payload = {"benchmark": "xattn", "env": env_record(), "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "batch": 1,
               "block_size": BS, "dtype": "bfloat16", "causal": True},
               "goals": {"estimate_over_dense_128k": "<= 0.15", "block_sparse_10pct_over_dense": "<= 0.13",
                         "block_sparse_10pct_vs_flex": "ours_kernel_only_ms (prebuilt BlockIndex) <= flex_ms "
                                                       "(prebuilt BlockMask)",
                         "block_sparse_100pct_over_dense": "<= 1.1"},
               "timing": "median of CUDA-event-timed calls after a warm-up (do_bench for calls < 20 ms)",
               "quick": args.quick, "partial": True}
    t0 = time.time()
    stages = [
        ("block_sparse", lambda: run_block_sparse(s_main, DENSITIES, with_flex=False)),
        ("estimate", lambda: run_estimate([s_main] if args.quick else [32768, 65536, s_main], (8, 16))),
        ("end_to_end", lambda: run_end_to_end(s_main, thresholds=(0.9,) if args.quick else (0.8, 0.9, 0.95),
                                              strides=(8,) if args.quick else (8, 16))),
    ]
    if not args.no_flex:
        stages.append(("flex", lambda: run_block_sparse(s_main, (0.10, 1.00) if args.quick else DENSITIES,
                                                        with_flex=True)))
    for name, fn in stages:
        t = time.time()
        try:
            payload[name] = fn()
        except Exception as e:
            traceback.print_exc()
            payload[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        payload.setdefault("stage_seconds", {})[name] = round(time.time() - t, 1)
        write_json(args.name, payload)
        print(f"== {name} ({time.time() - t:.1f} s)", flush=True)
        if name == "estimate" and isinstance(payload[name], list):
            _print_estimate(payload[name])
        elif name in ("block_sparse", "flex") and "records" in payload[name]:
            _print_bs(payload[name])
        else:
            print(payload[name], flush=True)
    payload["partial"] = False
    payload["total_seconds"] = round(time.time() - t0, 1)
    path = write_json(args.name, payload)
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------ pytest-benchmark
@requires_cuda
def test_bench_xattn_estimate_32k(benchmark):
    rec = benchmark.pedantic(run_estimate, args=([32768], (8,)), rounds=1, iterations=1)[0]
    benchmark.extra_info.update(rec)
    assert rec["S8"].get("estimate_ms", 0) > 0


@requires_cuda
def test_bench_xattn_block_sparse_32k(benchmark):
    res = benchmark.pedantic(run_block_sparse, args=(32768, (0.1, 1.0)), kwargs={"with_flex": False},
                             rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    assert all("ours_ms" in r for r in res["records"])


@requires_cuda
def test_bench_xattn_end_to_end_32k(benchmark):
    res = benchmark.pedantic(run_end_to_end, args=(32768,), rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    assert all(math.isfinite(r.get("speedup_over_dense_ours", float("nan"))) for r in res["records"])


if __name__ == "__main__":
    sys.exit(main())
