"""Benchmark: exact top-k page ids per row (``xoffload.kernels.topk.topk_ids``), sparse decode's
page choice, against ``torch.topk`` and the launch floor.

One sparse layer of a decode step picks ``k`` pages per KV head out of its candidate pages: rows
= KV heads (x sequences in a batch), N = context / page size. Shapes: the Llama-3.1-8B decode
shape (8 KV heads, 32-token pages, budget 2048: k = 59) at 32K, 128K and 512K contexts (N =
1017, 4089, 16377 for a prompt of context - 64 tokens; the last is near the register limit), a
batch of 16 sequences at 32K (128 rows), and SmolLM2's 3 KV heads at 8K (k = 11 at budget 512). Times are CUDA-graph replays (the decode step
replays its graph). Peer: ``torch.topk(sorted=False)``, as the selection used before. Ceiling: the
scores' bytes at the HBM copy bandwidth measured in the same run, and the launch floor (a graph of
one ``fill_`` of the output: what any one-kernel selection costs at least).

Run: ``python benchmarks/bench_topk.py [--quick] [--out PATH]`` (table + JSON into
``benchmarks/results/topk.json``), or ``pytest benchmarks/bench_topk.py``. Skips cleanly without
CUDA.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (HAS_CUDA, bench_graph_ms, bench_ms, bench_parser, env_record, hbm_copy_gbps, hbm_shape_rows,  # noqa: E402
                     parse_gpu_args, record_extra, run, write_json)

# (name, rows, N candidate pages, k)
SHAPES = [
    ("8b_32k", 8, 1017, 59),
    ("8b_128k", 8, 4089, 59),
    ("8b_512k", 8, 16377, 59),
    ("8b_32k_batch16", 128, 1017, 59),
    ("smollm2_8k", 3, 249, 11),
]
QUICK = {"8b_32k", "8b_128k"}


def run_case(name, rows, n, k, hbm) -> dict:
    """Time one layer's page choice; the peer, the ceilings, and whether both choose the same set."""
    from xoffload.kernels.topk import topk_ids

    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(rows, n, device="cuda", generator=g)
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    fn = lambda: topk_ids(s, k, out=out)  # noqa: E731
    peer = lambda: s.topk(k, dim=-1, sorted=False)  # noqa: E731
    floor = lambda: out.fill_(0)  # noqa: E731
    ms_eager = bench_ms(fn)
    ms = bench_graph_ms(fn) or ms_eager
    pms = bench_graph_ms(peer) or bench_ms(peer)
    fms = bench_graph_ms(floor) or bench_ms(floor)
    topk_ids(s, k, out=out)
    same = bool(torch.equal(out.long().sort(-1).values, peer().indices.sort(-1).values))
    nbytes = s.numel() * 4
    return {"kernel": "topk_ids", "name": name, "rows": rows, "N": n, "k": k, "bytes": nbytes,
            "ms": ms, "ms_eager": ms_eager, "timing": "cuda graph replay", "GBps": nbytes / ms / 1e6,
            "hbm_ceiling_ms": nbytes / (hbm * 1e6), "launch_floor_ms": fms, "ratio_to_launch_floor": ms / fms,
            "same_set_as_torch_topk": same,
            "peers": {"torch_topk": {"ms": pms, "speedup_vs_peer": pms / ms}}}


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bench_topk(benchmark, shape):
    row = benchmark.pedantic(lambda: run_case(*shape, hbm_copy_gbps()), rounds=1, iterations=1)
    assert row["same_set_as_torch_topk"]
    record_extra(benchmark, row, skip=("peers",))


def main(argv=None):
    ap = bench_parser(__doc__, "topk")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    print(f"{'shape':>16} {'rows':>5} {'N':>6} {'k':>4} {'us':>7} {'floor us':>8} {'torch us':>8} {'x torch':>7} same")

    def line(shape, r):
        p = r["peers"]["torch_topk"]
        return (f"{shape[0]:>16} {r['rows']:>5} {r['N']:>6} {r['k']:>4} {1e3 * r['ms']:>7.2f} "
                f"{1e3 * r['launch_floor_ms']:>8.2f} {1e3 * p['ms']:>8.2f} {p['speedup_vs_peer']:>7.2f} "
                f"{r['same_set_as_torch_topk']}")

    hbm, rows = hbm_shape_rows(SHAPES, run_case, line, QUICK if args.quick else None)
    res = {"benchmark": "topk", **env_record(), "hbm_copy_GBps": hbm, "rows": rows,
           "note": "one sparse layer's page choice; a decode step runs it once per sparse layer (30 on the 8B shape)"}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
