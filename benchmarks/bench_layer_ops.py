"""Benchmark: the fused per-token layer ops of prefill (RMSNorm, SwiGLU, QKV split + RoPE) against
the PyTorch eager code of xoffload.models.llama (= HF transformers' eager ops) and the HBM copy
bandwidth.

Shapes: N tokens (default 8192) of Llama-3.1-8B (hidden 4096, intermediate 14336, 32 q / 8 KV heads,
head_dim 128) and Qwen3-8B (intermediate 12288, q/k RMSNorm), bf16; the full run adds SmolLM2-135M
(hidden 576, intermediate 1536, 9 / 3 heads, head_dim 64).

Bytes counted (the minimum each op must move; the eager peer moves more): RMSNorm reads x and
writes y (``2*N*H`` elements, + the weight); SwiGLU reads gate and up and writes the product
(``3*N*I``); QKV + RoPE reads the qkv row and writes q, k, v (``2*N*(Hq+2*Hkv)*D``) and reads the
cos/sin rows (``2*N*D``). GB/s = bytes / median time; ``frac_of_hbm_copy`` divides by the
device-to-device copy bandwidth measured in the same run. ``speedup`` = eager ms / ours ms.
``max_abs_diff_vs_eager``: largest difference to the eager result (rounding only; the RoPE kernel
rounds once where eager rounds after each op).

``--sweep`` also times a few other launch configs of each kernel (reported under ``sweep``; the
library's config is ``ours``), so a config change can be chosen from one run.

Run: ``python benchmarks/bench_layer_ops.py [--quick] [--sweep] [--tokens N] [--out PATH]`` (table +
JSON into benchmarks/results/layer_ops.json, copied under $XOFFLOAD_BENCH_OUT), or ``pytest
benchmarks/bench_layer_ops.py`` (pytest-benchmark). Skips cleanly without CUDA.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import HAS_CUDA, bench_ms, bench_parser, env_record, hbm_copy_gbps, parse_gpu_args, record_extra, run, write_json  # noqa: E402

N_TOKENS = 8192
DEVICE = "cuda"  # a CPU dry run of the code paths sets "cpu" (with TRITON_INTERPRET=1)
EPS = 1e-5
# name -> hidden, intermediate, Hq, Hkv, D, qk_norm
MODELS = {
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, False),
    "qwen3-8b": (4096, 12288, 32, 8, 128, True),
    "smollm2-135m": (576, 1536, 9, 3, 64, False),
}
QUICK_MODELS = ("llama-3.1-8b", "qwen3-8b")

SWEEP = {
    "rms_norm": [{"BLOCK_M": m, "num_warps": w} for m, w in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16))],
    "silu_mul": [{"BLOCK_I": b, "num_warps": w} for b, w in ((512, 2), (1024, 4), (1024, 8), (2048, 4),
                                                             (2048, 8), (4096, 8), (4096, 16))],
    "qkv_rope": [{"G": g, "BLOCK_T": t, "num_warps": w} for g, t, w in ((1, 16, 4), (1, 32, 4), (2, 8, 4), (4, 4, 4),
                                                                      (8, 2, 4), (8, 4, 8), (8, 8, 8), (4, 8, 8))],
}


def _mods():
    import xoffload.kernels as K

    K.rms_norm  # noqa: B018  bind the function name first: the module of the same name would shadow it
    return (importlib.import_module("xoffload.kernels.norm"), importlib.import_module("xoffload.kernels.swiglu"),
            importlib.import_module("xoffload.kernels.rope"))


def _tables(n, d, dtype, base=500000.0):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d))
    freqs = torch.arange(n, device=DEVICE, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _row(kernel, model, n, nbytes, ms, hbm, peer_ms, diff, sweep=None, **shape):
    gbps = nbytes / ms / 1e6
    row = {"kernel": kernel, "model": model, "N": n, **shape, "dtype": "bf16", "bytes": nbytes, "ms": ms,
           "GBps": gbps, "frac_of_hbm_copy": gbps / hbm, "max_abs_diff_vs_eager": diff,
           "peers": {"torch_eager": {"ms": peer_ms, "GBps": nbytes / peer_ms / 1e6,
                                     "frac_of_hbm_copy": nbytes / peer_ms / 1e6 / hbm,
                                     "speedup_vs_peer": peer_ms / ms}}}
    if sweep:
        row["sweep"] = sweep
        best = min(sweep, key=lambda r: r["ms"])
        row["best_sweep"] = best
    return row


def _sweep(launch, configs):
    out = []
    for cfg in configs:
        try:
            out.append({"config": cfg, "ms": bench_ms(lambda: launch(cfg))})
        except Exception as e:  # a config that does not compile / launch is reported, not fatal
            out.append({"config": cfg, "ms": float("inf"), "error": f"{type(e).__name__}: {e}"[:200]})
    return out


def case_rms_norm(model, n, hbm, do_sweep=False, dtype=torch.bfloat16) -> dict:
    from xoffload.kernels import rms_norm
    from xoffload.models.llama import rms_norm as eager

    rn_mod, _, _ = _mods()
    h = MODELS[model][0]
    x = torch.randn(n, h, dtype=dtype, device=DEVICE)
    w = torch.rand(h, dtype=dtype, device=DEVICE) + 0.5
    out = torch.empty_like(x)
    e = 2
    nbytes = 2 * n * h * e + h * e
    ms = bench_ms(lambda: rms_norm(x, w, EPS, out=out))
    pms = bench_ms(lambda: eager(x, w, EPS))
    diff = float((rms_norm(x, w, EPS).float() - eager(x, w, EPS).float()).abs().max())
    sw = _sweep(lambda c: rn_mod._launch(x, w, out, EPS, config=c), SWEEP["rms_norm"]) if do_sweep else None
    row = _row("rms_norm", model, n, nbytes, ms, hbm, pms, diff, sw, H=h, config=rn_mod.launch_config(h))
    return row


def case_silu_mul(model, n, hbm, do_sweep=False, dtype=torch.bfloat16) -> dict:
    from xoffload.kernels import silu_mul

    _, sw_mod, _ = _mods()
    i = MODELS[model][1]
    gu = torch.randn(n, 2 * i, dtype=dtype, device=DEVICE)
    out = torch.empty(n, i, dtype=dtype, device=DEVICE)

    def eager():  # xoffload.models.llama LlamaModel._mlp_residual / HF LlamaMLP
        return F.silu(gu[:, :i]) * gu[:, i:]

    nbytes = 3 * n * i * 2
    ms = bench_ms(lambda: silu_mul(gu, i, out=out))
    pms = bench_ms(eager)
    diff = float((silu_mul(gu, i).float() - eager().float()).abs().max())
    sw = _sweep(lambda c: sw_mod._launch(gu, out, i, config=c), SWEEP["silu_mul"]) if do_sweep else None
    row = _row("silu_mul", model, n, nbytes, ms, hbm, pms, diff, sw, I=i, config=sw_mod.launch_config(i))
    return row


def case_qkv_rope(model, n, hbm, do_sweep=False, dtype=torch.bfloat16) -> dict:
    from xoffload.kernels import qkv_rope
    from xoffload.models.llama import apply_rope, rms_norm

    _, _, rope_mod = _mods()
    _, _, hq, hkv, d, qk_norm = MODELS[model]
    qr, kr = hq * d, hkv * d
    qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE)
    p0 = 1000  # a chunk that does not start at position 0, written into a longer layer buffer
    cos, sin = _tables(p0 + n, d, dtype)
    q_out = torch.empty(n, hq, d, dtype=dtype, device=DEVICE)
    k_buf = torch.empty(p0 + n, hkv, d, dtype=dtype, device=DEVICE)
    v_buf = torch.empty_like(k_buf)
    k_out, v_out = k_buf[p0:], v_buf[p0:]
    qn = (torch.rand(d, dtype=dtype, device=DEVICE) + 0.5) if qk_norm else None
    kn = (torch.rand(d, dtype=dtype, device=DEVICE) + 0.5) if qk_norm else None
    c, s = cos[p0:p0 + n], sin[p0:p0 + n]

    def eager():  # xoffload.models.llama LlamaModel._qkv_chunk after the projection
        q = qkv[:, :qr].view(-1, hq, d)
        k = qkv[:, qr:qr + kr].view(-1, hkv, d)
        q_out.copy_(apply_rope(rms_norm(q, qn, EPS) if qn is not None else q, c, s))
        k_out.copy_(apply_rope(rms_norm(k, kn, EPS) if kn is not None else k, c, s))
        v_out.copy_(qkv[:, qr + kr:].view(-1, hkv, d))

    def ours():
        qkv_rope(qkv, cos, sin, p0, hq, hkv, d, q_out, k_out, v_out, q_norm=qn, k_norm=kn, eps=EPS)

    nbytes = 2 * n * (hq + 2 * hkv) * d * 2 + 2 * n * d * 2
    ms = bench_ms(ours)
    pms = bench_ms(eager)
    eager()
    want = (q_out.clone(), k_out.clone(), v_out.clone())
    ours()
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip((q_out, k_out, v_out), want))
    sw = None
    if do_sweep:
        sw = _sweep(lambda cfg: rope_mod._launch(qkv, cos, sin, p0, hq, hkv, d, q_out, k_out, v_out, qn, kn, EPS,
                                                 config=cfg), [c for c in SWEEP["qkv_rope"] if hkv % c["G"] == 0])
    row = _row("qkv_rope", model, n, nbytes, ms, hbm, pms, diff, sw, Hq=hq, Hkv=hkv, D=d, qk_norm=qk_norm,
               config=rope_mod.launch_config(d, hkv))
    return row


CASES = {"rms_norm": case_rms_norm, "silu_mul": case_silu_mul, "qkv_rope": case_qkv_rope}


def per_layer_summary(rows) -> dict:
    """Per decoder layer and model: 2 RMSNorms + 1 QKV/RoPE + 1 SwiGLU, ours vs eager (ms)."""
    out = {}
    for model in {r["model"] for r in rows}:
        by = {r["kernel"]: r for r in rows if r["model"] == model}
        if set(by) != set(CASES):
            continue
        ours = 2 * by["rms_norm"]["ms"] + by["qkv_rope"]["ms"] + by["silu_mul"]["ms"]
        eager = sum((2 if k == "rms_norm" else 1) * by[k]["peers"]["torch_eager"]["ms"] for k in CASES)
        out[model] = {"N": by["rms_norm"]["N"], "ours_ms": ours, "eager_ms": eager, "saved_ms": eager - ours,
                      "speedup": eager / ours}
    return out


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel,model", [(k, m) for m in QUICK_MODELS for k in CASES
                                          if not (k == "rms_norm" and m == "qwen3-8b")])
def test_bench_layer_ops(benchmark, kernel, model):
    row = benchmark.pedantic(lambda: CASES[kernel](model, N_TOKENS, hbm_copy_gbps()), rounds=1, iterations=1)
    record_extra(benchmark, row, skip=("peers", "config"))


def main(argv=None):
    ap = bench_parser(__doc__, "layer_ops", quick_help="Llama-3.1-8B and Qwen3-8B shapes only")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch configs")
    ap.add_argument("--tokens", type=int, default=N_TOKENS)
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    hbm = hbm_copy_gbps()
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s (read + write); N = {args.tokens} tokens, bf16")
    print(f"{'kernel':>9} {'model':>13} {'MB':>6} {'ms':>7} {'GB/s':>6} {'%copy':>6} {'eager ms':>9} {'x':>5} "
          f"{'maxdiff':>8}  best sweep")
    rows = []
    models = QUICK_MODELS if args.quick else tuple(MODELS)
    for model in models:
        for kernel, fn in CASES.items():
            if kernel == "rms_norm" and model == "qwen3-8b":
                continue  # same hidden size as Llama-3.1-8B
            r = fn(model, args.tokens, hbm, do_sweep=args.sweep)
            torch.cuda.empty_cache()
            rows.append(r)
            p = r["peers"]["torch_eager"]
            best = r.get("best_sweep")
            bs = f"{best['ms']:.4f} {best['config']}" if best else "-"
            print(f"{kernel:>9} {model:>13} {r['bytes'] / 1e6:>6.0f} {r['ms']:>7.4f} {r['GBps']:>6.0f} "
                  f"{100 * r['frac_of_hbm_copy']:>5.1f}% {p['ms']:>9.4f} {p['speedup_vs_peer']:>5.2f} "
                  f"{r['max_abs_diff_vs_eager']:>8.3g}  {bs}", flush=True)
    # Qwen3-8B's RMSNorm has Llama-3.1-8B's shape: reuse it for the per-layer sum
    rows_sum = rows + [dict(r, model="qwen3-8b") for r in rows if r["kernel"] == "rms_norm" and r["model"] == "llama-3.1-8b"]
    summary = per_layer_summary(rows_sum)
    for model, s in summary.items():
        print(f"per layer {model}: ours {s['ours_ms']:.3f} ms, eager {s['eager_ms']:.3f} ms "
              f"({s['speedup']:.2f}x, {s['saved_ms']:.3f} ms saved per layer per {s['N']} tokens)")
    res = {"benchmark": "layer_ops", **env_record(), "hbm_copy_GBps": hbm, "tokens": args.tokens, "rows": rows,
           "per_layer": summary, "target": "each op >= 0.70 of HBM copy bandwidth and faster than eager"}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
