"""Benchmark: LSE merge of attention states against the HBM copy bandwidth.

Bytes counted: every input output tensor and LSE read and the merged output and LSE written
(2-way: 2 o + 2 lse read, 1 o + 1 lse written; N-way: N o + N lse read). The ceiling is the
device-to-device copy bandwidth measured in the same run (bytes read + written / time). Peer: the
same merge written in plain PyTorch (eager; fp32 math).

Run: ``python benchmarks/bench_merge.py [--quick] [--out PATH]`` (table + JSON into
benchmarks/results/merge.json), or ``pytest benchmarks/bench_merge.py`` (pytest-benchmark).
Skips cleanly without CUDA.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import HAS_CUDA, bench_ms, bench_parser, env_record, hbm_copy_gbps, hbm_shape_rows, parse_gpu_args, record_extra, run, write_json  # noqa: E402

# (name, N, B, S, H, D): prefill-chunk merges (Llama-3.1-8B / SmolLM2 heads) and decode merges
SHAPES = [
    ("prefill_32k_h32_d128", 2, 1, 32768, 32, 128),
    ("prefill_32k_h9_d64", 2, 1, 32768, 9, 64),
    ("prefill_8k_b4_h32_d128", 2, 4, 8192, 32, 128),
    ("decode_b256_h32_d128", 2, 256, 1, 32, 128),
    ("nway4_8k_h32_d128", 4, 1, 8192, 32, 128),
]
QUICK = {"prefill_32k_h32_d128", "prefill_32k_h9_d64", "nway4_8k_h32_d128", "decode_b256_h32_d128"}


def _torch_merge(oa, la, ob, lb):
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    s = wa + wb
    lse = torch.where(s > 0, m + torch.log(s), torch.full_like(s, float("-inf")))
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    wa = (wa * inv).transpose(-1, -2).unsqueeze(-1)
    wb = (wb * inv).transpose(-1, -2).unsqueeze(-1)
    return (wa * oa.float() + wb * ob.float()).to(oa.dtype), lse


def run_case(name, n, b, s, h, d, hbm, dtype=torch.bfloat16) -> dict:
    from xoffload.kernels import merge_attention_states, merge_attention_states_n

    outs = torch.randn(n, b, s, h, d, dtype=dtype, device="cuda")
    lses = torch.randn(n, b, h, s, dtype=torch.float32, device="cuda") * 4
    o_bytes = b * s * h * d * outs.element_size()
    l_bytes = b * s * h * 4
    nbytes = (n + 1) * (o_bytes + l_bytes)
    if n == 2:
        out = torch.empty_like(outs[0])
        out_lse = torch.empty_like(lses[0])
        fn = lambda: merge_attention_states(outs[0], lses[0], outs[1], lses[1], out=out, out_lse=out_lse)  # noqa: E731
        peer = lambda: _torch_merge(outs[0], lses[0], outs[1], lses[1])  # noqa: E731
    else:
        fn = lambda: merge_attention_states_n(outs, lses)  # noqa: E731
        peer = None
    ms = bench_ms(fn)
    gbps = nbytes / ms / 1e6
    row = {"kernel": "merge", "name": name, "N": n, "B": b, "S": s, "H": h, "D": d, "dtype": "bf16",
           "bytes": nbytes, "ms": ms, "GBps": gbps, "frac_of_hbm_copy": gbps / hbm, "peers": {}}
    if peer is not None:
        pms = bench_ms(peer)
        row["peers"]["torch_eager"] = {"ms": pms, "GBps": nbytes / pms / 1e6, "speedup_vs_peer": pms / ms}
    del outs, lses
    torch.cuda.empty_cache()
    return row




@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bench_merge(benchmark, shape):
    row = benchmark.pedantic(lambda: run_case(*shape, hbm_copy_gbps()), rounds=1, iterations=1)
    record_extra(benchmark, row, skip=("peers",))


def main(argv=None):
    ap = bench_parser(__doc__, "merge")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    print(f"{'shape':>24} {'MB':>7} {'ms':>8} {'GB/s':>7} {'%copy':>6}  torch eager (ms, ours x faster)")

    def line(shape, r):
        p = r["peers"].get("torch_eager")
        ps = f"{p['ms']:.3f} ({p['speedup_vs_peer']:.2f}x)" if p else "-"
        return (f"{shape[0]:>24} {r['bytes'] / 1e6:>7.0f} {r['ms']:>8.3f} {r['GBps']:>7.0f} "
                f"{100 * r['frac_of_hbm_copy']:>5.1f}%  {ps}")

    hbm, rows = hbm_shape_rows(SHAPES, run_case, line, QUICK if args.quick else None)
    res = {"benchmark": "merge", **env_record(), "hbm_copy_GBps": hbm, "rows": rows,
           "target": ">= 0.70 of HBM copy bandwidth"}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
