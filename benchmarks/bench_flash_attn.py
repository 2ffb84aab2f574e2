"""Benchmark: dense prefill attention (flash_attn_with_lse) against its peers, bf16, batch 1.

(Over 450 lines on purpose: one script per kernel, as every benchmark; its dense suite and its
options suite share the shapes, peers, launch-config sweep and JSON rows.)

Shapes: D=128 with 32 query / 8 KV heads (Llama-3.1-8B) and D=64 with 9 / 3 heads (SmolLM2);
sequence lengths 4K..128K (Sq = Sk), causal and not. Peers in the same run:

- torch SDPA with the FLASH backend and with the CUDNN backend (``torch.nn.attention.sdpa_kernel``),
  on ``[B, H, S, D]`` copies of the inputs, GQA through ``enable_gqa=True`` when the backend takes
  it, else with K/V repeated to Hq heads (the JSON notes which, per peer). SDPA returns no LSE.
- FlexAttention (``torch.nn.attention.flex_attention``, ``torch.compile``d, GQA, with the LSE, a
  causal block mask when causal).
- flash-attn's ``flash_attn_func`` when the package is importable.

FLOPs: ``4 * B * Hq * Sq * Sk * D``, halved when causal. Times: median of
``triton.testing.do_bench`` (CUDA events). Ratios are ours / peer in TFLOP/s (> 1: we are faster).

Run: ``python benchmarks/bench_flash_attn.py [--quick] [--sweep] [--no-flex]`` prints a table and
writes benchmarks/results/attention.json; ``--quick`` runs only 32K causal for both shapes;
``--sweep`` also times each launch configuration in :data:`SWEEP` (recorded in the
JSON; the "ours" row is always the library's default configuration). Under pytest (pytest-benchmark): ``pytest benchmarks/bench_flash_attn.py``
runs the 32K cases and puts the numbers into ``benchmark.extra_info``. Skips without CUDA.

``--suite options`` (or ``all``) times flash-attn's inference options of the same kernel
(benchmarks/results/attention_options.json), each against our plain kernel on the same shape:

- ``window``: causal sliding window (``window_size=(W, -1)``, W = ``--window``, default 4096,
  Mistral / Gemma's local layers) over 32K and 128K prompts, against our causal call (target:
  time <= 1.15 x (window area / causal area) x causal time) and FlexAttention with a causal
  sliding-window block mask (target: ours >= 1.0x). FLOPs: ``4 * Hq * D`` per visible pair.
- ``softcap`` (50.0, Gemma 2) and ``alibi`` (geometric slopes, MPT/BLOOM): TFLOP/s at 32K,
  causal and not, against our plain kernel (target >= 0.9x) and FlexAttention with the same
  ``score_mod``.
- ``paged``: causal 32K with K/V in a shuffled paged cache (pages of 16, 256, 1024 tokens)
  against the contiguous call.

``--quick`` with ``--suite options``: 32K only, D=128 only; ``--sweep`` with it: the window,
softcap and ALiBi calls also run under each launch config of :data:`SWEEP` (``"sweep"`` in each
record; the timed rows stay the library's default). Every ALiBi record names the bias form
(``"alibi_form"``). ``--cases softcap,alibi`` runs only those kinds of case (window, softcap,
alibi, paged).
"""
from __future__ import annotations

import math
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import bench_ms, bench_parser, env_record, fmt_table, parse_gpu_args, requires_cuda, run, tflops, write_json  # noqa: E402

SHAPES = {"d128_h32_kv8": (32, 8, 128), "d64_h9_kv3": (9, 3, 64)}
SEQS = (4096, 8192, 16384, 32768, 65536, 131072)
DTYPE = torch.bfloat16  # the inputs' dtype (a CPU dry run under the interpreter sets fp16)


# Launch configs the --sweep times, keyed on BLOCK_D (16-bit inputs): (block_m, block_n, warps,
# stages). The TMA and warp-specialized variants lost the recorded H200 sweep (attention.json:
# D=128 TMA 128x128 507.8-508.5 TFLOP/s, the same as pointer loads; warp specialization 479)
# and were deleted from the kernel.
SWEEP = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4),
         (64, 64, 4, 4), (64, 128, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3)],
}


def attn_flops(b, hq, sq, sk, d, causal):
    f = 4.0 * b * hq * sq * sk * d
    return f / 2 if causal else f


def _make(s, hq, hkv, d, seed=0):
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, s, hq, d, device=dev, dtype=DTYPE, generator=g)
    k = torch.randn(1, s, hkv, d, device=dev, dtype=DTYPE, generator=g)
    v = torch.randn(1, s, hkv, d, device=dev, dtype=DTYPE, generator=g)
    return q, k, v


_FLEX = {}


def _flex_fn():
    """A compiled flex_attention. Each (shape, mask) recompiles (dynamic=False); dynamo's default
    recompile limit (8) would otherwise make later cases fall back to the unfused eager path."""
    if "fn" not in _FLEX:
        import torch._dynamo

        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex_block_mask(s, window=None):
    """Causal block mask (``window``: causal sliding window, key within ``window`` tokens of the query)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    mod = causal_mod if window is None else window_mod
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return create_block_mask(mod, None, None, s, s, device="cuda", _compile=True)
    except TypeError:
        return create_block_mask(mod, None, None, s, s, device="cuda")


def _flex_runner(qt, kt, vt, bm, score_mod=None, what=""):
    """(callable, note) running compiled flex_attention with its LSE on ``[B, H, S, D]`` inputs."""
    flex = _flex_fn()
    extra = {"score_mod": score_mod} if score_mod is not None else {}
    try:
        flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_lse=True, **extra)
        return ((lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_lse=True, **extra)),
                "torch.compile(flex_attention), return_lse=True, enable_gqa=True" + what)
    except TypeError:  # newer API: return_aux
        from torch.nn.attention.flex_attention import AuxRequest

        aux = AuxRequest(lse=True)
        flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_aux=aux, **extra)
        return ((lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True, return_aux=aux, **extra)),
                "torch.compile(flex_attention), LSE via return_aux, enable_gqa=True" + what)


def peers(q, k, v, causal):
    """name -> (callable, note); a peer that cannot run maps to (None, reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    out = {}

    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(kk, vv, gqa, backend=backend):
            with sdpa_kernel(backend):
                if gqa:
                    return F.scaled_dot_product_attention(qt, kk, vv, is_causal=causal, enable_gqa=True)
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=causal)

        try:
            call(kt, vt, True)
            out[name] = ((lambda call=call: call(kt, vt, True)), "GQA via enable_gqa=True; no LSE")
        except Exception as e_gqa:  # backend without GQA: repeat K/V to Hq heads
            try:
                kr = kt.repeat_interleave(hq // hkv, dim=1)
                vr = vt.repeat_interleave(hq // hkv, dim=1)
                call(kr, vr, False)
                out[name] = ((lambda call=call, kr=kr, vr=vr: call(kr, vr, False)),
                             f"K/V repeated to {hq} heads (enable_gqa failed: {type(e_gqa).__name__}); no LSE")
            except Exception as e:
                out[name] = (None, f"unavailable: {type(e).__name__}: {str(e)[:200]}")

    try:
        bm = _flex_block_mask(q.shape[1]) if causal else None
        out["flex"] = _flex_runner(qt, kt, vt, bm, what=", causal block mask" if causal else "")
    except Exception as e:
        out["flex"] = (None, f"unavailable: {type(e).__name__}: {str(e)[:200]}")

    try:
        from flash_attn import flash_attn_func

        flash_attn_func(q, k, v, causal=causal)
        out["flash_attn"] = ((lambda: flash_attn_func(q, k, v, causal=causal)), "flash_attn_func (native GQA)")
    except Exception as e:
        out["flash_attn"] = (None, f"unavailable: {type(e).__name__}")
    return out


def sweep_configs(fn, d: int, flops: float) -> list:
    """Time ``fn`` under each launch config of :data:`SWEEP` for head dim ``d`` (through
    ``launch_override("flash_attn", cfg)``): ``[{"cfg", "ms", "tflops"} or {"cfg", "error"}]``."""
    from xoffload.kernels import launch_override

    block_d = max(16, 1 << (d - 1).bit_length())
    tried = []
    for cfg in SWEEP.get(block_d, []):
        try:
            with launch_override("flash_attn", cfg):
                fn()
                ms = bench_ms(fn, warmup=10, rep=40)
            tried.append({"cfg": list(cfg), "ms": ms, "tflops": tflops(flops, ms)})
        except Exception as e:
            tried.append({"cfg": list(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return tried


def run_case(shape, s, causal, *, sweep=False, with_flex=True, peers_on=True):
    """Time ours and the peers on one case; returns a dict with per-impl ms / TFLOP/s / ratios."""
    from xoffload.kernels import flash_attn as fa

    hq, hkv, d = SHAPES[shape]
    q, k, v = _make(s, hq, hkv, d)
    fl = attn_flops(1, hq, s, s, d, causal)
    rec = {"shape": shape, "S": s, "causal": causal, "Hq": hq, "Hkv": hkv, "D": d, "dtype": "bf16",
           "flops": fl, "impl": {}}

    def ours():
        return fa.flash_attn_with_lse(q, k, v, causal=causal)

    if sweep:  # timed for information; the "ours" row is always the library's default choice
        rec["sweep"] = sweep_configs(ours, d, fl)
    o, lse = ours()
    ms = bench_ms(ours)
    rec["impl"]["ours"] = {"ms": ms, "tflops": tflops(fl, ms), "config": "library default",
                           "note": "flash_attn_with_lse (returns LSE)"}

    if peers_on:
        ps = peers(q, k, v, causal)
        if not with_flex:
            ps["flex"] = (None, "skipped (--no-flex)")
        for name, (fn, note) in ps.items():
            if fn is None:
                rec["impl"][name] = {"ms": None, "tflops": None, "note": note}
                continue
            try:
                pms = bench_ms(fn)
                rec["impl"][name] = {"ms": pms, "tflops": tflops(fl, pms), "note": note}
            except Exception as e:
                rec["impl"][name] = {"ms": None, "tflops": None, "note": f"failed: {type(e).__name__}: {e}"[:300]}
        # sanity: our output against SDPA FLASH (bf16 noise level)
        if ps.get("sdpa_flash", (None,))[0] is not None:
            ref = ps["sdpa_flash"][0]().transpose(1, 2)
            rec["max_abs_diff_vs_sdpa_flash"] = float((o.float() - ref.float()).abs().max())
        del ps
    ours_t = rec["impl"]["ours"]["tflops"]
    rec["ratios"] = {f"ours/{n}": ours_t / r["tflops"] for n, r in rec["impl"].items()
                     if n != "ours" and r.get("tflops")}
    del q, k, v
    torch.cuda.empty_cache()
    return rec


def _rows(records):
    rows = []
    for r in records:
        row = {"shape": r["shape"], "S": r["S"], "causal": r["causal"]}
        for n, x in r["impl"].items():
            row[n] = x["tflops"] if x.get("tflops") else "-"
        for n, x in r["ratios"].items():
            row[n] = x
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ the options suite
WINDOW = 4096
WINDOW_SEQS = (32768, 131072)
SOFTCAP = 50.0  # Gemma 2's attention logit cap
SCORE_SEQ = 32768  # sequence length of the softcap / ALiBi cases
PAGES = (16, 256, 1024)
DEVICE = "cuda"  # the options suite's device (a CPU dry run under the interpreter sets "cpu")
OPTION_KINDS = ("window", "softcap", "alibi", "paged")


def window_area(s: int, w: int) -> int:
    """Visible (query, key) pairs of a causal window of ``w`` keys back over ``s`` tokens (Sq = Sk)."""
    w = min(w, s - 1)
    return s * (w + 1) - w * (w + 1) // 2


def alibi_slopes(hq: int, device=None):
    """The ALiBi paper's geometric slopes 2^(-8 i / Hq), i = 1..Hq, fp32 [Hq]."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / hq) for i in range(hq)], device=device or DEVICE)


def _time_impls(rec, impls, flops):
    """Time each (name -> (fn, note)) into rec["impl"]; a failing one records its error."""
    for name, (fn, note) in impls.items():
        if fn is None:
            rec["impl"][name] = {"ms": None, "tflops": None, "note": note}
            continue
        try:
            fn()
            ms = bench_ms(fn)
            rec["impl"][name] = {"ms": ms, "tflops": tflops(flops[name], ms), "note": note}
        except Exception as e:
            rec["impl"][name] = {"ms": None, "tflops": None, "note": f"failed: {type(e).__name__}: {e}"[:300]}


def run_window_case(shape, s, window=WINDOW, *, with_flex=True, sweep=False):
    """Causal sliding window vs our causal call and FlexAttention's sliding-window block mask."""
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _make(s, hq, hkv, d)
    area, causal_area = window_area(s, window), s * (s + 1) // 2
    fl_w, fl_c = 4.0 * hq * d * area, 4.0 * hq * d * causal_area
    rec = {"case": "window", "shape": shape, "S": s, "window": window, "causal": True, "Hq": hq, "Hkv": hkv,
           "D": d, "dtype": "bf16", "flops": fl_w, "area_ratio": area / causal_area, "impl": {}}
    impls = {
        "ours_window": ((lambda: flash_attn_with_lse(q, k, v, causal=True, window_size=(window, -1))),
                        f"flash_attn_with_lse(causal=True, window_size=({window}, -1))"),
        "ours_causal": ((lambda: flash_attn_with_lse(q, k, v, causal=True)), "flash_attn_with_lse(causal=True)"),
    }
    if with_flex:
        try:
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            impls["flex_window"] = _flex_runner(qt, kt, vt, _flex_block_mask(s, window),
                                                what=f", causal sliding-window block mask ({window})")
        except Exception as e:
            impls["flex_window"] = (None, f"unavailable: {type(e).__name__}: {str(e)[:200]}")
    _time_impls(rec, impls, {"ours_window": fl_w, "ours_causal": fl_c, "flex_window": fl_w})
    if sweep:
        rec["sweep"] = sweep_configs(impls["ours_window"][0], d, fl_w)
    tw, tc = rec["impl"]["ours_window"]["ms"], rec["impl"]["ours_causal"]["ms"]
    rec["ratios"] = {}
    if tw and tc:
        rec["ratios"]["window_time/causal_time"] = tw / tc
        rec["ratios"]["vs_target(<=1.15)"] = tw / (rec["area_ratio"] * tc)  # 1.0 = proportional to the area
    tf = rec["impl"].get("flex_window", {}).get("ms")
    if tw and tf:
        rec["ratios"]["ours/flex_window"] = tf / tw  # speed ratio, target >= 1.0
        o, _ = flash_attn_with_lse(q, k, v, causal=True, window_size=(window, -1))
        ref = impls["flex_window"][0]()
        ref = ref[0] if isinstance(ref, tuple) else ref
        rec["max_abs_diff_vs_flex"] = float((o.float() - ref.transpose(1, 2).float()).abs().max())
    del q, k, v
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rec


def run_score_case(kind, shape, s, causal, *, with_flex=True, sweep=False):
    """softcap or ALiBi against our plain kernel (same shape, same FLOPs) and FlexAttention's score_mod."""
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _make(s, hq, hkv, d)
    fl = attn_flops(1, hq, s, s, d, causal)
    slopes = alibi_slopes(hq)
    opt = {"softcap": {"softcap": SOFTCAP}, "alibi": {"alibi_slopes": slopes}}[kind]
    rec = {"case": kind, "shape": shape, "S": s, "causal": causal, "Hq": hq, "Hkv": hkv, "D": d,
           "dtype": str(DTYPE).replace("torch.", "").replace("bfloat16", "bf16"), "flops": fl, "impl": {}}
    if kind == "alibi":
        rec["alibi_form"] = ("per-column bias with a per-row shift off the diagonal, |pos - j| on it "
                             "(flash_attn_opts)")
    impls = {
        "ours_plain": ((lambda: flash_attn_with_lse(q, k, v, causal=causal)), "flash_attn_with_lse"),
        f"ours_{kind}": ((lambda: flash_attn_with_lse(q, k, v, causal=causal, **opt)),
                         f"flash_attn_with_lse({', '.join(f'{n}=...' for n in opt)})"),
    }
    if with_flex:
        if kind == "softcap":
            def score_mod(score, b, h, q_idx, kv_idx):
                return SOFTCAP * torch.tanh(score / SOFTCAP)
        else:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx - kv_idx).abs()
        try:
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            bm = _flex_block_mask(s) if causal else None
            impls[f"flex_{kind}"] = _flex_runner(qt, kt, vt, bm, score_mod, what=f", {kind} score_mod")
        except Exception as e:
            impls[f"flex_{kind}"] = (None, f"unavailable: {type(e).__name__}: {str(e)[:200]}")
    _time_impls(rec, impls, {n: fl for n in impls})
    if sweep:
        rec["sweep"] = sweep_configs(impls[f"ours_{kind}"][0], d, fl)
    t = {n: x["ms"] for n, x in rec["impl"].items()}
    rec["ratios"] = {}
    if t.get(f"ours_{kind}") and t.get("ours_plain"):
        rec["ratios"][f"ours_{kind}/ours_plain(>=0.9)"] = t["ours_plain"] / t[f"ours_{kind}"]  # TFLOP/s ratio
    if t.get(f"ours_{kind}") and t.get(f"flex_{kind}"):
        rec["ratios"][f"ours/flex_{kind}"] = t[f"flex_{kind}"] / t[f"ours_{kind}"]
    del q, k, v
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rec


def run_paged_case(shape, s, page):
    """Causal prefill reading K/V through a shuffled block table against the contiguous call."""
    from xoffload.kernels import flash_attn_with_lse

    hq, hkv, d = SHAPES[shape]
    q, k, v = _make(s, hq, hkv, d)
    n = -(-s // page)
    perm = torch.randperm(n, device=DEVICE)
    kc = torch.zeros(n, page, hkv, d, device=DEVICE, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    kp = torch.zeros(n * page, hkv, d, device=DEVICE, dtype=k.dtype)
    kp[:s] = k[0]
    kc[perm] = kp.view(n, page, hkv, d)
    kp[:s] = v[0]
    vc[perm] = kp.view(n, page, hkv, d)
    table = perm.to(torch.int32)[None]
    used = torch.tensor([s], dtype=torch.int32, device=DEVICE)
    fl = attn_flops(1, hq, s, s, d, True)
    rec = {"case": "paged", "shape": shape, "S": s, "page_size": page, "causal": True, "Hq": hq, "Hkv": hkv, "D": d,
           "dtype": "bf16", "flops": fl, "impl": {}}
    impls = {
        "ours_contiguous": ((lambda: flash_attn_with_lse(q, k, v, causal=True)), "flash_attn_with_lse"),
        "ours_paged": ((lambda: flash_attn_with_lse(q, kc, vc, causal=True, block_table=table, seqused_k=used,
                                                    check=False)),
                       f"flash_attn_with_lse(block_table=[1, {n}] shuffled, page {page}, check=False)"),
    }
    _time_impls(rec, impls, {n_: fl for n_ in impls})
    t = {n_: x["ms"] for n_, x in rec["impl"].items()}
    rec["ratios"] = {}
    if t.get("ours_paged") and t.get("ours_contiguous"):
        rec["ratios"]["paged/contiguous"] = t["ours_contiguous"] / t["ours_paged"]
        o1, _ = impls["ours_paged"][0]()
        o0, _ = impls["ours_contiguous"][0]()
        rec["max_abs_diff_vs_contiguous"] = float((o1.float() - o0.float()).abs().max())
    del q, k, v, kc, vc, kp
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rec


def option_cases(quick: bool, window: int, seqs=None, kinds=OPTION_KINDS):
    """(function, args, kwargs) of every case of the options suite (of the ``kinds`` named)."""
    shapes = ["d128_h32_kv8"] if quick else list(SHAPES)
    wseqs = seqs or ((32768,) if quick else WINDOW_SEQS)
    cases = [(run_window_case, (sh, s, window), {}) for sh in shapes for s in wseqs] if "window" in kinds else []
    for kind in ("softcap", "alibi"):
        if kind in kinds:
            causals = (True,) if quick else (True, False)
            cases += [(run_score_case, (kind, sh, SCORE_SEQ, c), {}) for sh in shapes for c in causals]
    if "paged" in kinds:
        cases += [(run_paged_case, ("d128_h32_kv8", 32768, p), {}) for p in PAGES]
    return cases


def _kinds(text: str) -> tuple:
    """``--cases`` value: comma-separated kinds of :data:`OPTION_KINDS`."""
    import argparse

    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in kinds if x not in OPTION_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"unknown case kind {bad[0] if bad else text!r}; "
                                         f"choose from {', '.join(OPTION_KINDS)}")
    return kinds


def _option_rows(records):
    rows = []
    for r in records:
        row = {"case": r["case"], "shape": r["shape"], "S": r["S"], "causal": r["causal"]}
        if "window" in r:
            row["window"] = r["window"]
        if "page_size" in r:
            row["page"] = r["page_size"]
        for n, x in r["impl"].items():
            row[n] = x["tflops"] if x.get("tflops") else "-"
        row.update(r.get("ratios", {}))
        rows.append(row)
    return rows


def main_options(args, no_flex: bool):
    out = args.out
    if os.path.basename(out) == "attention.json":
        out = os.path.join(os.path.dirname(out), "attention_options.json")
    records = []
    seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else None
    for fn, a, kw in option_cases(args.quick, args.window, seqs, getattr(args, "cases", OPTION_KINDS)):
        if fn is not run_paged_case:
            kw = {**kw, "with_flex": not no_flex, "sweep": args.sweep}
        try:
            rec = fn(*a, **kw)
        except Exception as e:
            traceback.print_exc()
            rec = {"case": fn.__name__, "args": list(a), "error": f"{type(e).__name__}: {e}"[:500], "impl": {},
                   "ratios": {}, "shape": a[0] if fn is not run_score_case else a[1], "S": None, "causal": None}
        records.append(rec)
        write_json(out, {"benchmark": "attention_options", "env": env_record(), "partial": True,
                         "flops_rule": "4*Hq*D per visible (query, key) pair", "batch": 1, "records": records})
        rows = _option_rows([rec])
        print(fmt_table(rows, list(rows[0].keys())), flush=True)
        for t in rec.get("sweep", []):
            print("   sweep", t, flush=True)
    path = write_json(out, {"benchmark": "attention_options", "env": env_record(),
                            "flops_rule": "4*Hq*D per visible (query, key) pair", "batch": 1, "records": records})
    print(f"wrote {path}")
    return 0


def main(argv=None):
    ap = bench_parser(__doc__, "attention", quick_help="only 32K causal, both shapes")
    ap.add_argument("--sweep", action="store_true", help="also time every config in SWEEP (recorded in the JSON)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compile time)")
    ap.add_argument("--seqs", type=str, default=None, help="comma-separated sequence lengths (options suite: "
                    "of the window cases)")
    ap.add_argument("--suite", choices=("dense", "options", "all"), default="dense",
                    help="dense: the plain kernel vs its peers (attention.json); options: sliding window, softcap, "
                         "ALiBi, paged K/V (attention_options.json); all: both")
    ap.add_argument("--window", type=int, default=WINDOW, help="sliding window of the options suite's window cases")
    ap.add_argument("--cases", type=_kinds, default=OPTION_KINDS,
                    help=f"options suite: comma-separated kinds of case to run ({', '.join(OPTION_KINDS)}; default all)")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    if args.suite == "options":
        return main_options(args, args.no_flex)
    if args.suite == "all":
        main_options(args, args.no_flex)
    if args.quick:
        cases = [(sh, 32768, True) for sh in SHAPES]
    else:
        seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else SEQS
        cases = [(sh, s, c) for c in (True, False) for sh in SHAPES for s in seqs]
    records = []
    for sh, s, c in cases:
        try:
            rec = run_case(sh, s, c, sweep=args.sweep, with_flex=not args.no_flex)
        except Exception as e:
            traceback.print_exc()
            rec = {"shape": sh, "S": s, "causal": c, "error": f"{type(e).__name__}: {e}"[:500],
                   "impl": {}, "ratios": {}}
        records.append(rec)
        write_json(args.out, {"benchmark": "attention", "env": env_record(), "partial": True,
                               "flops_rule": "4*B*Hq*Sq*Sk*D, halved when causal", "batch": 1,
                               "records": records})
        print(fmt_table(_rows([rec]), list(_rows([rec])[0].keys())), flush=True)
        if "sweep" in rec:
            for t in rec["sweep"]:
                print("   sweep", t, flush=True)
    payload = {"benchmark": "attention", "env": env_record(),
               "flops_rule": "4*B*Hq*Sq*Sk*D, halved when causal", "batch": 1, "records": records}
    path = write_json(args.out, payload)
    rows = _rows([r for r in records if "error" not in r])
    if rows:
        cols = []
        for r in rows:
            cols += [c for c in r if c not in cols]
        print("\nTFLOP/s and ratios (ours / peer)")
        print(fmt_table(rows, cols))
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------ pytest-benchmark
@requires_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bench_flash_attn_32k(benchmark, shape, causal):
    rec = benchmark.pedantic(run_case, args=(shape, 32768, causal), rounds=1, iterations=1)
    benchmark.extra_info.update({
        "shape": shape, "S": 32768, "causal": causal,
        "tflops": {n: x["tflops"] for n, x in rec["impl"].items()},
        "ms": {n: x["ms"] for n, x in rec["impl"].items()},
        "ratios": rec["ratios"],
    })
    assert rec["impl"]["ours"]["tflops"] > 0 and math.isfinite(rec["impl"]["ours"]["tflops"])


@requires_cuda
@pytest.mark.parametrize("case", ["window", "softcap", "alibi", "paged"])
def test_bench_flash_attn_options_32k(benchmark, case):
    shape = "d128_h32_kv8"
    fn, args = {"window": (run_window_case, (shape, 32768)),
                "softcap": (run_score_case, ("softcap", shape, 32768, True)),
                "alibi": (run_score_case, ("alibi", shape, 32768, True)),
                "paged": (run_paged_case, (shape, 32768, 256))}[case]
    rec = benchmark.pedantic(fn, args=args, rounds=1, iterations=1)
    benchmark.extra_info.update({"case": case, "shape": shape, "S": 32768, "ratios": rec["ratios"],
                                 "tflops": {n: x["tflops"] for n, x in rec["impl"].items()}})
    assert all(x["tflops"] for n, x in rec["impl"].items() if n.startswith("ours"))


if __name__ == "__main__":
    run(main)
