"""Benchmark: split-KV decode attention (decode_attn_with_lse) against the HBM copy bandwidth.

Time: the median of triton.testing.do_bench (L2 flushed between runs) over CUDA-graph replays of
one call (``ms``: GPU time, what a graph-captured decode step pays); ``ms_eager`` is the same with
the Python call each time (adds host launch overhead, which dominates below ~32K tokens).
Bytes counted: the K and V actually read (B * Sk * Hkv * D * 2 tensors * element size); q, the
output and the split partials are ignored (< 1% at the lengths that matter). The ceiling is the
device-to-device copy bandwidth measured in the same run (bytes read + written / time).
Peers on the same cache: torch SDPA with the FLASH and EFFICIENT backends (enable_gqa), and
FlexAttention (compiled; only with ``--flex``, it takes a while to compile).

Run: ``python benchmarks/bench_decode.py [--quick] [--flex] [--out PATH]`` (table + JSON into
benchmarks/results/decode.json), or ``pytest benchmarks/bench_decode.py`` (pytest-benchmark;
numbers in extra_info). Skips cleanly without CUDA.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HEADS = {"d128_32_8": (32, 8, 128), "d64_9_3": (9, 3, 64)}  # Llama-3.1-8B, SmolLM2 shapes


from _common import HAS_CUDA, bench_graph_ms, bench_ms, bench_parser, env_record, hbm_copy_gbps, parse_gpu_args, record_extra, run, write_json  # noqa: E402


def _inputs(b, sk, hq, hkv, d, dtype=torch.bfloat16):
    q = torch.randn(b, 1, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    return q, k, v, lens


def _sdpa_fn(q, k, v, backend):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def fn():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    fn()  # raises if the backend refuses these inputs
    return fn


_FLEX = {}


def _flex_fn(q, k, v):
    from torch.nn.attention.flex_attention import flex_attention

    if "f" not in _FLEX:
        _FLEX["f"] = torch.compile(flex_attention, dynamic=False)
    f = _FLEX["f"]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def fn():
        return f(qt, kt, vt, enable_gqa=True, return_lse=True)

    fn()
    return fn


def run_case(b, sk, heads, hbm, peers=("flash", "efficient"), flex=False) -> dict:
    from xoffload.kernels import decode_attn_with_lse
    from xoffload.kernels.decode import _sm_count, default_num_splits

    hq, hkv, d = HEADS[heads]
    q, k, v, lens = _inputs(b, sk, hq, hkv, d)
    nbytes = 2 * b * sk * hkv * d * k.element_size()
    fn = lambda: decode_attn_with_lse(q, k, v, lens, check=False)  # noqa: E731
    ms_eager = bench_ms(fn)
    ms_graph = bench_graph_ms(fn)
    ms = ms_graph if ms_graph is not None else ms_eager
    gbps = nbytes / ms / 1e6
    row = {
        "kernel": "decode", "B": b, "Sk": sk, "Hq": hq, "Hkv": hkv, "D": d, "dtype": "bf16",
        "num_splits": default_num_splits(b, hkv, hq // hkv, sk, _sm_count(q.device)),
        "bytes": nbytes, "ms": ms, "ms_eager": ms_eager, "timing": "cuda_graph" if ms_graph else "eager",
        "GBps": gbps, "frac_of_hbm_copy": gbps / hbm, "peers": {},
    }
    names = list(peers) + (["flex"] if flex else [])
    for name in names:
        try:
            fn = _flex_fn(q, k, v) if name == "flex" else _sdpa_fn(q, k, v, name)
            pms_eager = bench_ms(fn)
            pms = bench_graph_ms(fn) if ms_graph is not None else None
            pms = pms if pms is not None else pms_eager
            row["peers"][name] = {"ms": pms, "ms_eager": pms_eager, "GBps": nbytes / pms / 1e6,
                                  "speedup_vs_peer": pms / ms}
        except Exception as e:  # a backend that refuses the shape is recorded, not fatal
            row["peers"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    del q, k, v
    torch.cuda.empty_cache()
    return row


def sweep(b, sk, heads, hbm, splits, configs) -> list:
    """Tile / split-count sweep of the Triton kernel (records what the default should be)."""
    from xoffload.kernels.decode import _decode_triton, _sm_count, default_num_splits

    hq, hkv, d = HEADS[heads]
    q, k, v, lens = _inputs(b, sk, hq, hkv, d)
    nbytes = 2 * b * sk * hkv * d * k.element_size()
    base = default_num_splits(b, hkv, hq // hkv, sk, _sm_count(q.device))
    rows = []
    for ns in splits:
        ns = base if ns == "default" else int(ns)
        for cfg in configs:
            try:
                f = lambda: _decode_triton(q, k, v, lens, d ** -0.5, ns, cfg)  # noqa: E731
                ms = bench_graph_ms(f) or bench_ms(f)
                rows.append({"B": b, "Sk": sk, "heads": heads, "num_splits": ns, **cfg, "ms": ms,
                             "GBps": nbytes / ms / 1e6, "frac_of_hbm_copy": nbytes / ms / 1e6 / hbm})
            except Exception as e:
                rows.append({"num_splits": ns, **cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    del q, k, v
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------- pytest-benchmark


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("sk", [4096, 32768, 131072])
@pytest.mark.parametrize("heads", list(HEADS))
def test_bench_decode(benchmark, b, sk, heads):
    row = benchmark.pedantic(lambda: run_case(b, sk, heads, hbm_copy_gbps()), rounds=1, iterations=1)
    record_extra(benchmark, row, skip=("peers",))


# ------------------------------------------------------------------------------------- script
def main(argv=None):
    ap = bench_parser(__doc__, "decode", quick_help="fewer lengths, short tile sweep")
    ap.add_argument("--flex", action="store_true", help="also FlexAttention (compiles; slow)")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    # SDPA explains at length why a backend refuses GQA inputs; the refusal is recorded in the JSON
    warnings.filterwarnings("ignore", message=r".*(not used because|runtime disabled|same num_heads).*")
    hbm = hbm_copy_gbps()
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s (read + write)")
    lengths = [4096, 32768, 131072] if args.quick else [4096, 16384, 65536, 131072, 262144, 524288]
    rows = []
    hdr = (f"{'heads':>10} {'B':>2} {'Sk':>7} {'splits':>6} {'ms':>8} {'eager':>8} {'GB/s':>7} {'%copy':>6}  "
           f"peers (ms, ours x faster)")
    print(hdr)
    for heads in HEADS:
        for b in (1, 8):
            for sk in lengths:
                r = run_case(b, sk, heads, hbm, flex=args.flex)
                rows.append(r)
                ps = "  ".join(
                    f"{n}: {p['ms']:.3f} ({p['speedup_vs_peer']:.2f}x)" if "ms" in p else f"{n}: n/a"
                    for n, p in r["peers"].items())
                print(f"{heads:>10} {b:>2} {sk:>7} {r['num_splits']:>6} {r['ms']:>8.3f} {r['ms_eager']:>8.3f} "
                      f"{r['GBps']:>7.0f} "
                      f"{100 * r['frac_of_hbm_copy']:>5.1f}%  {ps}", flush=True)
    if args.quick:
        configs = [dict(block_n=64, num_warps=4, num_stages=3), dict(block_n=64, num_warps=4, num_stages=4),
                   dict(block_n=128, num_warps=4, num_stages=2), dict(block_n=32, num_warps=4, num_stages=4)]
        splits = ["default", 33, 66, 256]
    else:
        configs = [dict(block_n=bn, num_warps=w, num_stages=st)
                   for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
        splits = ["default", 16, 33, 66, 132, 256]
    sw = sweep(1, 131072, "d128_32_8", hbm, splits, configs)
    print("sweep at B=1, Sk=128K, 32/8 heads, D=128:")
    for r in sw:
        print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    res = {"benchmark": "decode", **env_record(), "hbm_copy_GBps": hbm, "rows": rows, "sweep_128k": sw,
           "target": "Sk=128K: >= 0.75 of HBM copy bandwidth"}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
