"""Benchmark: host<->device KV transfers of the offload runtime (section 3).

Measured (CUDA events / triton.testing.do_bench, never wall clock):

* ceiling: one plain H2D and one D2H ``copy_`` of a large registered (pinned) buffer.
* whole-layer: prefill offload (``offload_layer``, D2H) of every layer and one decode step's ring
  loads (H2D) through ``OffloadRuntime``; also one raw ``copy_`` per layer.
* scattered block fetches: ``fetch_blocks`` (Triton gather reading pinned memory through UVA) of
  random blocks, block sizes 256/1024/4096, shapes 8x128 (Llama-3.1-8B) and 3x64 (SmolLM2), against
  one ``copy_`` per block and the ceiling; plus a sweep of the gather kernel's tile/warps.
* overlap: a bf16 GEMM loop runs while layers are offloaded and prefetched; slowdown of each.

GB/s counts K and V bytes moved. Run: ``python benchmarks/bench_offload.py [--quick] [--out PATH]``
(table + JSON into benchmarks/results/transfer.json) or under pytest with pytest-benchmark.
Skips cleanly without CUDA.
"""
from __future__ import annotations

import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import HAS_CUDA, bench_parser, env_record, parse_gpu_args, run, write_json  # noqa: E402

BF = torch.bfloat16
SHAPES = {"llama8b_8x128": (8, 128), "smollm2_3x64": (3, 64)}
BLOCK_SIZES = (256, 1024, 4096)


def _bench(fn, quick):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 150,
                                   return_mode="median")


def _events_ms(run, reps):
    """Median over reps of CUDA-event time around ``run()`` (which must end on the current stream)."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


# ------------------------------------------------------------------------------- ceiling
def ceiling(quick):
    from xoffload.runtime import CpuKVPool

    nbytes = (256 if quick else 1024) << 20
    host = CpuKVPool(1, 1, nbytes // 4, 1, 1, BF, pin=True)  # K and V: 2 x nbytes/2
    src = host.k[0].view(-1)
    dev = torch.empty_like(src, device="cuda")
    h2d = _bench(lambda: dev.copy_(src, non_blocking=True), quick)
    d2h = _bench(lambda: src.copy_(dev, non_blocking=True), quick)
    b = src.numel() * 2
    del dev
    host.close()
    return {"bytes": b, "h2d_ms": h2d, "h2d_GBps": b / h2d / 1e6, "d2h_ms": d2h, "d2h_GBps": b / d2h / 1e6}


# ----------------------------------------------------------------------------- whole layer
def whole_layer(quick, shape="llama8b_8x128"):
    from xoffload.runtime import OffloadRuntime

    h, d = SHAPES[shape]
    L, T, bs = 4, (32768 if quick else 131072), 1024
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=T + 64, block_size=bs, num_buffers=4,
                      num_blocks=T // bs + 1)
    k = torch.randn(T, h, d, device="cuda").to(BF)
    v = torch.randn(T, h, d, device="cuda").to(BF)
    layer_bytes = 2 * T * h * d * 2
    seqs = []

    def offload_all():
        s = e.add_sequence()
        seqs.append(s)
        for l in range(L):
            e.offload_layer(s, l, k, v)
        torch.cuda.current_stream().wait_stream(e._offload_stream)

    ts = []
    for _ in range(3 if quick else 7):
        while seqs:  # the pool holds one sequence: free the previous one outside the timing
            e.free(seqs.pop())
        ts.append(_events_ms(offload_all, 1))
    d2h = sorted(ts)[len(ts) // 2]
    s = seqs[-1]
    kn = torch.randn(1, h, d, device="cuda").to(BF)

    def step():
        e.begin_step(s)
        for l in range(L):
            e.layer_kv(s, l, kn, kn)
            e.end_layer(s, l)
        e.end_step(s)

    step()  # warm-up (ring allocation)
    h2d = _events_ms(step, 3 if quick else 7)
    buf = torch.empty(T, h, d, device="cuda", dtype=BF)
    src = e.pool.k_rows(0)[:T]
    raw = _bench(lambda: buf.copy_(src, non_blocking=True), quick)
    e.close()
    return {"shape": shape, "layers": L, "tokens": T, "block_size": bs, "layer_bytes": layer_bytes,
            "offload_d2h_ms": d2h, "offload_d2h_GBps": L * layer_bytes / d2h / 1e6,
            "ring_step_h2d_ms": h2d, "ring_step_h2d_GBps": L * layer_bytes / h2d / 1e6,
            "raw_copy_per_layer_K_GBps": T * h * d * 2 / raw / 1e6}


# -------------------------------------------------------------------------- block fetches
def block_fetch(quick, shape, bs, sweep=False):
    from xoffload.runtime import OffloadRuntime, gather_blocks

    h, d = SHAPES[shape]
    blk_bytes = bs * h * d * 2  # one of K or V
    fetch_bytes = (64 if quick else 256) << 20  # K + V per fetch
    n = max(2, fetch_bytes // (2 * blk_bytes))
    nb = n * (2 if quick else 4)
    e = OffloadRuntime(1, h, d, dtype=BF, device="cuda", max_tokens=nb * bs, block_size=bs, num_blocks=nb)
    s = e.add_sequence()
    src = torch.randn(nb * bs, h, d, device="cuda").to(BF)
    e.offload_layer(s, 0, src, src)
    rnd = random.Random(bs + h)
    ids = rnd.sample(range(nb), n)
    moved = 2 * n * blk_bytes
    ms = _bench(lambda: e.fetch_blocks(s, 0, ids), quick)
    got, _ = e.fetch_blocks(s, 0, ids)
    ok = bool(torch.equal(got.view(n, bs, h, d), src.view(nb, bs, h, d)[ids]))
    out_k = torch.empty(n, bs, h, d, device="cuda", dtype=BF)
    out_v = torch.empty_like(out_k)
    pk, pv = e.pool.k[0], e.pool.v[0]

    def per_block():
        for i, b in enumerate(ids):
            out_k[i].copy_(pk[b], non_blocking=True)
            out_v[i].copy_(pv[b], non_blocking=True)

    pb = _bench(per_block, quick)
    row = {"shape": shape, "block_size": bs, "block_bytes": blk_bytes, "blocks": n, "pool_blocks": nb,
           "bytes": moved, "correct": ok, "fetch_blocks_ms": ms, "fetch_blocks_GBps": moved / ms / 1e6,
           "copy_per_block_ms": pb, "copy_per_block_GBps": moved / pb / 1e6}
    if sweep:
        idx = torch.tensor(ids, dtype=torch.int32, device="cuda")
        row["gather_sweep_GBps"] = {}
        for blk, w in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (32768, 16)):
            t = _bench(lambda: gather_blocks(pk, pv, idx, out_k, out_v, block=blk, num_warps=w), quick)
            row["gather_sweep_GBps"][f"block{blk}_w{w}"] = moved / t / 1e6
    e.close()
    return row


# ------------------------------------------------------------------------------- overlap
def overlap(quick, shape="llama8b_8x128"):
    from xoffload.runtime import OffloadRuntime

    h, d = SHAPES[shape]
    L, T, bs = 4, 16384, 1024
    e = OffloadRuntime(L, h, d, dtype=BF, device="cuda", max_tokens=T + 64, block_size=bs, num_buffers=L,
                      num_blocks=2 * (T // bs) + 2)
    k = torch.randn(T, h, d, device="cuda").to(BF)
    kn = torch.randn(1, h, d, device="cuda").to(BF)
    a_seq = e.add_sequence()
    for l in range(L):
        e.offload_layer(a_seq, l, k, k)
    n = 8192
    x = torch.randn(n, n, device="cuda").to(BF)
    y = torch.randn(n, n, device="cuda").to(BF)
    n_gemm = 6 if quick else 12
    reps = 3 if quick else 7

    def gemms():
        for _ in range(n_gemm):
            torch.mm(x, y)

    def finish_step():
        for l in range(L):
            e.layer_kv(a_seq, l, kn, kn)
            e.end_layer(a_seq, l)
        e.end_step(a_seq)

    def transfers(with_gemm):
        """Returns (gemm_ms or None, h2d_ms, d2h_ms), each from the common start event."""
        cur = torch.cuda.current_stream()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        b_seq = e.add_sequence()
        e.begin_step(a_seq)  # prefetch all L layers of a_seq (H2D on the load streams)
        for l in range(L):
            e.offload_layer(b_seq, l, k, k)  # D2H on the offload stream
        h_end = []
        for st in e._rings[0].load_streams():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(st)
            h_end.append(ev)
        d_end = torch.cuda.Event(enable_timing=True)
        d_end.record(e._offload_stream)
        g_ms = None
        if with_gemm:
            g0 = torch.cuda.Event(enable_timing=True)
            g1 = torch.cuda.Event(enable_timing=True)
            g0.record()
            gemms()
            g1.record()
        finish_step()
        cur.wait_stream(e._offload_stream)
        torch.cuda.synchronize()
        if with_gemm:
            g_ms = g0.elapsed_time(g1)
        e.free(b_seq)
        return g_ms, max(start.elapsed_time(ev) for ev in h_end), start.elapsed_time(d_end)

    transfers(True)  # warm-up
    gemm_alone = _events_ms(gemms, reps)
    alone = [transfers(False) for _ in range(reps)]
    both = [transfers(True) for _ in range(reps)]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    h_alone, d_alone = med([r[1] for r in alone]), med([r[2] for r in alone])
    g_both, h_both, d_both = med([r[0] for r in both]), med([r[1] for r in both]), med([r[2] for r in both])
    nbytes = L * 2 * T * h * d * 2
    e.close()
    return {"shape": shape, "layers": L, "tokens": T, "gemm": f"{n_gemm} x bf16 {n}^3",
            "gemm_alone_ms": gemm_alone, "gemm_with_transfers_ms": g_both,
            "gemm_slowdown": g_both / gemm_alone,
            "h2d_alone_GBps": nbytes / h_alone / 1e6, "h2d_with_gemm_GBps": nbytes / h_both / 1e6,
            "h2d_ratio": h_alone / h_both,
            "d2h_alone_GBps": nbytes / d_alone / 1e6, "d2h_with_gemm_GBps": nbytes / d_both / 1e6,
            "d2h_ratio": d_alone / d_both}


def _try(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as ex:  # noqa: BLE001 - record and go on with the other sections
        return {"error": f"{type(ex).__name__}: {ex}"[:500]}


def run_all(quick=False):
    res = {"env": env_record(), "quick": quick}
    res["ceiling"] = _try(ceiling, quick)
    res["whole_layer"] = [_try(whole_layer, quick, s) for s in SHAPES]
    res["block_fetch"] = []
    for shape in SHAPES:
        for bs in BLOCK_SIZES:
            res["block_fetch"].append(_try(block_fetch, quick, shape, bs, sweep=(bs == 1024)))
    ceil_h2d = res["ceiling"].get("h2d_GBps")
    for r in res["block_fetch"]:
        if "error" not in r:
            r["fetch_frac_of_ceiling"] = r["fetch_blocks_GBps"] / ceil_h2d if ceil_h2d else None
            r["speedup_vs_copy_per_block"] = r["copy_per_block_ms"] / r["fetch_blocks_ms"]
    res["overlap"] = _try(overlap, quick)
    return res


def print_table(res):
    errs = [r for r in [res["ceiling"], res["overlap"], *res["whole_layer"], *res["block_fetch"]] if "error" in r]
    for r in errs:
        print("ERROR:", r["error"])
    if errs:
        print(json.dumps(res, indent=1))
        return
    c = res["ceiling"]
    print(f"GPU {res['env']['gpu']}  torch {res['env']['torch']}  triton {res['env']['triton']}")
    print(f"ceiling: H2D {c['h2d_GBps']:.1f} GB/s, D2H {c['d2h_GBps']:.1f} GB/s ({c['bytes'] >> 20} MiB copies)")
    for w in res["whole_layer"]:
        print(f"whole-layer {w['shape']} T={w['tokens']}: offload D2H {w['offload_d2h_GBps']:.1f} GB/s, "
              f"ring step H2D {w['ring_step_h2d_GBps']:.1f} GB/s, raw copy/layer {w['raw_copy_per_layer_K_GBps']:.1f} GB/s")
    print(f"{'shape':<15}{'bs':>6}{'blk KiB':>9}{'n':>6}{'fetch GB/s':>12}{'frac':>7}{'per-block GB/s':>16}{'ok':>5}")
    for r in res["block_fetch"]:
        print(f"{r['shape']:<15}{r['block_size']:>6}{r['block_bytes'] >> 10:>9}{r['blocks']:>6}"
              f"{r['fetch_blocks_GBps']:>12.1f}{r['fetch_frac_of_ceiling']:>7.2f}{r['copy_per_block_GBps']:>16.1f}"
              f"{str(r['correct']):>5}")
        if "gather_sweep_GBps" in r:
            print("   sweep: " + ", ".join(f"{k} {v:.1f}" for k, v in r["gather_sweep_GBps"].items()))
    o = res["overlap"]
    print(f"overlap: GEMM {o['gemm_alone_ms']:.2f} -> {o['gemm_with_transfers_ms']:.2f} ms (x{o['gemm_slowdown']:.3f}); "
          f"H2D {o['h2d_alone_GBps']:.1f} -> {o['h2d_with_gemm_GBps']:.1f} GB/s (x{o['h2d_ratio']:.2f}); "
          f"D2H {o['d2h_alone_GBps']:.1f} -> {o['d2h_with_gemm_GBps']:.1f} GB/s (x{o['d2h_ratio']:.2f})")


try:
    import pytest_benchmark  # noqa: F401

    import pytest

    @pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
    def test_bench_offload(benchmark):
        res = benchmark.pedantic(lambda: run_all(quick=True), rounds=1, iterations=1)
        benchmark.extra_info.update({"ceiling": res["ceiling"], "block_fetch": res["block_fetch"],
                                     "whole_layer": res["whole_layer"], "overlap": res["overlap"]})
except ImportError:
    pass


def main(argv=None):
    ap = bench_parser(__doc__, "transfer")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    res = run_all(quick=args.quick)
    print_table(res)
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
