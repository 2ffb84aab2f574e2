"""Benchmark: page scoring for sparse decode (``xoffload.kernels.quest_score``) against HBM.

One sparse layer's selection reads its candidate pages' summaries: Quest's min and max per page
(``quest_page_scores``; bytes 2 x pages x Hkv x D x 2) and, with exact channels
(``channel_page_scores``), also the ``r`` stored channels of every token (pages x P x Hkv x r x
2). The ceiling is that many bytes at the device-to-device copy bandwidth measured in the same run
(a scorer cannot read less). Times are CUDA-graph replays (the decode step replays its graph;
``do_bench`` around a call of a few microseconds measures the Python checks before the launch:
 first run, eager, read 33.5 us at 128K for a kernel the decode profile shows at
6.1 us), the eager call kept as ``ms_eager``. Peer: the same scores written in PyTorch (the fp32 reference
functions run on the GPU: the nine-op form the kernels replace). Shapes: the Llama-3.1-8B decode
shape (32 query / 8 KV heads, D 128, pages of 32 tokens) at 32K and 128K, and SmolLM2's (9 / 3
heads, D 64) at 8K; r = 8 and 16, alpha 1 (the bound: two dots) and 0.25 (four).

Run: ``python benchmarks/bench_quest_score.py [--quick] [--sweep] [--out PATH]`` (table + JSON into
``benchmarks/results/quest_score.json``), or ``pytest benchmarks/bench_quest_score.py``.
``--sweep``: the channel kernel's tiles (pages per program x warps) at the 8B shape, each checked
against the default tile's scores, recorded under ``sweep``.
Skips cleanly without CUDA.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import HAS_CUDA, bench_graph_ms, bench_ms, bench_parser, env_record, hbm_copy_gbps, hbm_shape_rows, parse_gpu_args, record_extra, run, write_json  # noqa: E402

# (name, context tokens, Hq, Hkv, D, page, exact channels r (0: Quest's bound), alpha)
SHAPES = [
    ("8b_32k_quest", 32768, 32, 8, 128, 32, 0, 1.0),
    ("8b_128k_quest", 131072, 32, 8, 128, 32, 0, 1.0),
    ("8b_128k_ch8_a1", 131072, 32, 8, 128, 32, 8, 1.0),
    ("8b_128k_ch8_a025", 131072, 32, 8, 128, 32, 8, 0.25),
    ("8b_128k_ch16_a025", 131072, 32, 8, 128, 32, 16, 0.25),
    ("8b_32k_ch16_a025", 32768, 32, 8, 128, 32, 16, 0.25),
    ("smollm2_8k_quest", 8192, 9, 3, 64, 32, 0, 1.0),
    ("smollm2_8k_ch16_a025", 8192, 9, 3, 64, 32, 16, 0.25),
]
QUICK = {"8b_128k_quest", "8b_128k_ch8_a025", "8b_128k_ch16_a025"}


def run_case(name, ctx, hq, hkv, d, page, r, alpha, hbm, dtype=torch.bfloat16) -> dict:
    """Time one layer's page scoring at ``ctx`` tokens; bytes, GB/s, the ceiling and the peer."""
    from xoffload.kernels.channel_score import channel_page_scores
    from xoffload.kernels.quest_score import quest_page_scores
    from xoffload.kernels.reference import channel_page_scores_ref, quest_page_scores_ref

    n = ctx // page
    el = torch.tensor([], dtype=dtype).element_size()
    k = torch.randn(hkv, n, page, d, dtype=dtype, device="cuda")
    kmin, kmax = k.amin(2).contiguous(), k.amax(2).contiguous()
    q = torch.randn(hq, d, dtype=dtype, device="cuda")
    out = torch.empty(hkv, n, dtype=torch.float32, device="cuda")
    nbytes = 2 * kmin.numel() * el
    if r:
        ch = torch.stack([torch.randperm(d, device="cuda")[:r] for _ in range(hkv)]).to(torch.int32)
        klab = torch.gather(k.flatten(1, 2), 2, ch.long()[:, None, :].expand(hkv, n * page, r)).contiguous()
        nbytes += klab.numel() * el
        fn = lambda: channel_page_scores(q, kmin, kmax, ch, klab, alpha=alpha, out=out, check=False)  # noqa: E731
        peer = lambda: channel_page_scores_ref(q, kmin, kmax, ch, klab, alpha)  # noqa: E731
    else:
        fn = lambda: quest_page_scores(q, kmin, kmax, out=out)  # noqa: E731
        peer = lambda: quest_page_scores_ref(q, kmin, kmax)  # noqa: E731
    del k
    ms_eager = bench_ms(fn)
    ms = bench_graph_ms(fn) or ms_eager
    pms = bench_graph_ms(peer) or bench_ms(peer)
    gbps = nbytes / ms / 1e6
    row = {"kernel": "channel_page_scores" if r else "quest_page_scores", "name": name, "ctx": ctx, "Hq": hq,
           "Hkv": hkv, "D": d, "page": page, "exact_channels": r, "alpha": alpha, "pages": n, "dtype": "bf16",
           "bytes": nbytes, "ms": ms, "ms_eager": ms_eager, "timing": "cuda graph replay", "GBps": gbps, "frac_of_hbm_copy": gbps / hbm,
           "ceiling_ms": nbytes / (hbm * 1e6),
           "peers": {"torch_reference": {"ms": pms, "speedup_vs_peer": pms / ms}}}
    torch.cuda.empty_cache()
    return row


SWEEP = [(bn, w) for bn in (16, 32, 64) for w in (4, 8)]
SWEEP_SHAPES = ("8b_128k_ch16_a025", "8b_32k_ch16_a025", "smollm2_8k_ch16_a025")


def sweep_case(name, ctx, hq, hkv, d, page, r, alpha, hbm, dtype=torch.bfloat16) -> list:
    """Graph-replay time of the channel score kernel per (pages per program, warps) tile; the
    scores of each tile equal the default tile's (the same fp32 sums per page, in any tile)."""
    from xoffload.kernels import channel_score as cs

    n = ctx // page
    el = torch.tensor([], dtype=dtype).element_size()
    k = torch.randn(hkv, n, page, d, dtype=dtype, device="cuda")
    kmin, kmax = k.amin(2).contiguous(), k.amax(2).contiguous()
    q = torch.randn(hq, d, dtype=dtype, device="cuda")
    ch = torch.stack([torch.randperm(d, device="cuda")[:r] for _ in range(hkv)]).to(torch.int32)
    klab = torch.gather(k.flatten(1, 2), 2, ch.long()[:, None, :].expand(hkv, n * page, r)).contiguous()
    del k
    nbytes = 2 * kmin.numel() * el + klab.numel() * el
    want = torch.empty(hkv, n, dtype=torch.float32, device="cuda")
    cs._launch(q[None], kmin, kmax, ch, klab, None, None, want, r, page, alpha, hq // hkv)
    rows = []
    for bn, w in SWEEP:
        out = torch.empty_like(want)
        fn = lambda: cs._launch(q[None], kmin, kmax, ch, klab, None, None, out, r, page, alpha, hq // hkv,  # noqa: E731
                                block_n=bn, num_warps=w)
        fn()
        same = bool(torch.allclose(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))
        ms = bench_graph_ms(fn) or bench_ms(fn)
        rows.append({"name": name, "block_n": bn, "num_warps": w, "ms": ms, "GBps": nbytes / ms / 1e6,
                     "frac_of_hbm_copy": nbytes / ms / 1e6 / hbm, "same_scores": same,
                     "default": bn == cs.BLOCK_N and w == (4 if bn * page <= 512 else 8)})
    torch.cuda.empty_cache()
    return rows


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bench_quest_score(benchmark, shape):
    row = benchmark.pedantic(lambda: run_case(*shape, hbm_copy_gbps()), rounds=1, iterations=1)
    record_extra(benchmark, row, skip=("peers",))


def main(argv=None):
    ap = bench_parser(__doc__, "quest_score")
    ap.add_argument("--sweep", action="store_true", help="also time the channel kernel's tiles (pages per program x "
                                                         "warps) at the 8B and SmolLM2 shapes")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    print(f"{'shape':>22} {'MB':>7} {'us':>8} {'ceiling us':>10} {'GB/s':>7} {'%copy':>6}  torch (us, ours x faster)")

    def line(shape, r):
        p = r["peers"]["torch_reference"]
        return (f"{shape[0]:>22} {r['bytes'] / 1e6:>7.1f} {1e3 * r['ms']:>8.1f} {1e3 * r['ceiling_ms']:>10.1f} "
                f"{r['GBps']:>7.0f} {100 * r['frac_of_hbm_copy']:>5.1f}%  {1e3 * p['ms']:.1f} "
                f"({p['speedup_vs_peer']:.2f}x)")

    hbm, rows = hbm_shape_rows(SHAPES, run_case, line, QUICK if args.quick else None)
    res = {"benchmark": "quest_score", **env_record(), "hbm_copy_GBps": hbm, "rows": rows,
           "note": "one sparse layer's page scoring; a decode step runs it once per sparse layer"}
    if args.sweep:
        res["sweep"] = []
        for shape in SHAPES:
            if shape[0] in SWEEP_SHAPES:
                for t in sweep_case(*shape, hbm):
                    res["sweep"].append(t)
                    print(f"sweep {t['name']:>22} block_n {t['block_n']:>3} warps {t['num_warps']}: "
                          f"{1e3 * t['ms']:7.1f} us {t['GBps']:6.0f} GB/s {100 * t['frac_of_hbm_copy']:5.1f}%"
                          f"{' (default)' if t['default'] else ''}{'' if t['same_scores'] else ' SCORES DIFFER'}",
                          flush=True)
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
