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

Run: ``python benchmarks/bench_topk.py [--quick] [--sweep] [--out PATH]`` (table + JSON into
``benchmarks/results/topk.json``), or ``pytest benchmarks/bench_topk.py``. Skips cleanly without
CUDA.

``--sweep``: also time ``topk_ids`` at each ``bits_per_pass`` of
:data:`~xoffload.kernels.topk.BITS_PER_PASS_CHOICES` (the kernel's bits of the k-th key a reduction
pass), on every shape plus 8 rows x 1024 / 2048 / 4096 / 8192 at k = 116, each checked to choose the
same ids as the library default; recorded per row under ``bits_per_pass`` (``ms``, ``bits_run``:
the value the kernel ran, rows past 8192 cap it, ``same_ids``) with ``best_bits_per_pass``, and
printed one line per row. A row's ``ms`` stays the library default
(:data:`~xoffload.kernels.topk.DEFAULT_BITS_PER_PASS`).
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
#: rows timed only with --sweep: the shapes the bits_per_pass choice is made on
SWEEP_SHAPES = [(f"8x{n}_k116", 8, n, 116) for n in (1024, 2048, 4096, 8192)]


def sweep_bits(s, k, want) -> dict:
    """Graph-replay time of ``topk_ids(s, k)`` at each allowed ``bits_per_pass``, and whether it chose
    ``want`` (the default's ids: every value must)."""
    from xoffload.kernels.topk import _MAX_BITS_16384, BITS_PER_PASS_CHOICES, topk_ids

    res = {}
    for b in BITS_PER_PASS_CHOICES:
        out = torch.empty_like(want)
        fn = lambda out=out, b=b: topk_ids(s, k, out=out, bits_per_pass=b)  # noqa: E731
        fn()
        same = bool(torch.equal(out, want))
        ms = bench_graph_ms(fn) or bench_ms(fn)
        res[str(b)] = {"ms": ms, "bits_run": min(b, _MAX_BITS_16384) if s.shape[1] > 8192 else b,
                       "same_ids": same}
    return res


def sweep_cell(b: str, t: dict) -> str:
    """One bits_per_pass entry of a row's printed sweep line."""
    ran = "" if t["bits_run"] == int(b) else f" (ran {t['bits_run']})"
    return f"{b}{ran} {1e3 * t['ms']:.2f} us" + ("" if t["same_ids"] else " IDS DIFFER")


def run_case(name, rows, n, k, hbm, sweep=False) -> dict:
    """Time one layer's page choice; the peer, the ceilings, and whether both choose the same set;
    ``sweep``: also each bits_per_pass (:func:`sweep_bits`)."""
    from xoffload.kernels.topk import DEFAULT_BITS_PER_PASS, topk_ids

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
    row = {"kernel": "topk_ids", "name": name, "rows": rows, "N": n, "k": k, "bytes": nbytes,
           "ms": ms, "ms_eager": ms_eager, "timing": "cuda graph replay", "GBps": nbytes / ms / 1e6,
           "hbm_ceiling_ms": nbytes / (hbm * 1e6), "launch_floor_ms": fms, "ratio_to_launch_floor": ms / fms,
           "same_set_as_torch_topk": same, "default_bits_per_pass": DEFAULT_BITS_PER_PASS,
           "peers": {"torch_topk": {"ms": pms, "speedup_vs_peer": pms / ms}}}
    if sweep:
        row["bits_per_pass"] = sweep_bits(s, k, out.clone())
        row["best_bits_per_pass"] = int(min(row["bits_per_pass"], key=lambda b: row["bits_per_pass"][b]["ms"]))
    return row


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bench_topk(benchmark, shape):
    row = benchmark.pedantic(lambda: run_case(*shape, hbm_copy_gbps()), rounds=1, iterations=1)
    assert row["same_set_as_torch_topk"]
    record_extra(benchmark, row, skip=("peers",))


def main(argv=None):
    ap = bench_parser(__doc__, "topk")
    ap.add_argument("--sweep", action="store_true", help="also time each bits_per_pass of the kernel (on every "
                                                         "shape and 8 rows x 1024 .. 8192 at k = 116)")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    print(f"{'shape':>16} {'rows':>5} {'N':>6} {'k':>4} {'us':>7} {'floor us':>8} {'torch us':>8} {'x torch':>7} same")

    def line(shape, r):
        p = r["peers"]["torch_topk"]
        text = (f"{shape[0]:>16} {r['rows']:>5} {r['N']:>6} {r['k']:>4} {1e3 * r['ms']:>7.2f} "
                f"{1e3 * r['launch_floor_ms']:>8.2f} {1e3 * p['ms']:>8.2f} {p['speedup_vs_peer']:>7.2f} "
                f"{r['same_set_as_torch_topk']}")
        if "bits_per_pass" in r:
            text += "\n" + " " * 17 + "bits_per_pass: " + " | ".join(
                sweep_cell(b, t) for b, t in r["bits_per_pass"].items()) + \
                f"  (best {r['best_bits_per_pass']}, default {r['default_bits_per_pass']})"
        return text

    shapes = SHAPES + (SWEEP_SHAPES if args.sweep else [])
    quick = (QUICK | {s[0] for s in SWEEP_SHAPES}) if args.quick else None
    hbm, rows = hbm_shape_rows(shapes, lambda *a: run_case(*a, sweep=args.sweep), line, quick)
    res = {"benchmark": "topk", **env_record(), "hbm_copy_GBps": hbm, "rows": rows,
           "note": "one sparse layer's page choice; a decode step runs it once per sparse layer (30 on the 8B shape)"}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
