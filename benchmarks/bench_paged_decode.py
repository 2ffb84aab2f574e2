"""Benchmark: paged decode attention on device pages, pinned host pages (UVA) and sparse pages.

paged_decode_attn_with_lse on pages in device memory, on pages in pinned host memory read over
PCIe (UVA, zero copy), and with per-KV-head sparse page selection.

Cases (bf16, B=1, one query token):

* (a) ``device``: a 128K-token sequence in pages of 16 / 256 tokens scattered (random permutation)
  over a device pool of 128K rows, shared table ``[1, 1, P]``; against our contiguous
  ``decode_attn_with_lse`` on a ``[1, 128K, Hkv, D]`` cache in the same run (target: paged
  >= 0.95x the contiguous GB/s).
* (b) ``host``: the same with the pool in pinned host memory (``CpuKVPool``, ``cudaHostRegister``)
  read by the kernel through UVA; against the pinned->device copy ceiling measured in the same run
  (one large ``copy_`` of a registered buffer, i.e. one ``cudaMemcpyAsync``). Shapes 32/8 heads
  D=128 (Llama-3.1-8B) and 9/3 heads D=64 (SmolLM2). Also a split-count / tile sweep (PCIe latency
  may want more programs in flight than HBM does).
* (c) ``sparse``: a 2048-token budget per KV head made of 16/32/64-token pages chosen at random
  (distinct, sorted) per KV head over a 128K-row host pool, table ``[1, Hkv, P]`` (Quest-style
  selection); GB/s over PCIe against the same ceiling, plus the same selection on a device pool.

Time: the median of ``triton.testing.do_bench`` (L2 flushed between runs) over CUDA-graph replays
of one call with ``check=False`` (``ms``; ``ms_eager`` is the plain Python call). Bytes counted:
the K and V bytes the attention reads (tokens * Hkv * D * 2 tensors * 2 bytes); the table, q, the
output and the split partials are ignored. Each host case also checks that its output equals the
device-pool output bit for bit (``equal_to_device``).

Run: ``python benchmarks/bench_paged_decode.py [--quick] [--out PATH]`` (table + JSON into
benchmarks/results/paged_decode.json), or ``pytest benchmarks/bench_paged_decode.py``
(pytest-benchmark; numbers in extra_info). Skips cleanly without CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import bench_graph_ms, bench_ms, env_record, record_extra, save_json  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
BF = torch.bfloat16
HEADS = {"d128_32_8": (32, 8, 128), "d64_9_3": (9, 3, 64)}  # Llama-3.1-8B, SmolLM2 shapes
CTX = 131072
BUDGET = 2048


# ------------------------------------------------------------------------------------- inputs
class Store:
    """K/V row stores ``[rows, Hkv, D]`` bf16 on the device or in pinned host memory (the runtime's
    ``CpuKVPool``: registered slabs), filled with random values."""

    def __init__(self, rows, hkv, d, where):
        from xoffload.runtime import CpuKVPool

        self.pool = None
        if where == "device":
            self.k = torch.randn(rows, hkv, d, dtype=BF, device="cuda")
            self.v = torch.randn(rows, hkv, d, dtype=BF, device="cuda")
        else:
            block = 1024
            self.pool = CpuKVPool(1, -(-rows // block), block, hkv, d, BF, pin=True)
            if not self.pool.pinned:
                raise RuntimeError("host pool could not be pinned")
            self.k, self.v = self.pool.k_rows(0), self.pool.v_rows(0)
            for dst in (self.k, self.v):
                for r0 in range(0, dst.shape[0], 16384):  # fill through a small device buffer
                    n = min(16384, dst.shape[0] - r0)
                    dst[r0:r0 + n].copy_(torch.randn(n, hkv, d, dtype=BF, device="cuda"))
            torch.cuda.synchronize()

    def like(self, other):
        """Copy ``other``'s values (same shape) into this store."""
        self.k.copy_(other.k)
        self.v.copy_(other.v)
        torch.cuda.synchronize()
        return self

    def close(self):
        self.k = self.v = None
        if self.pool is not None:
            self.pool.close()
        torch.cuda.empty_cache()


def _scattered_table(n_tokens, page, rows, seed=0):
    """Shared table ``[1, 1, P]``: the sequence's pages at a random permutation of the pool's pages."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(rows // page, generator=g)[: -(-n_tokens // page)]
    return (perm * page).to(torch.int32).view(1, 1, -1).cuda()


def _sparse_table(hkv, budget, page, rows, seed=0):
    """Per-KV-head table ``[1, Hkv, budget/page]``: distinct random pages per head, sorted."""
    g = torch.Generator().manual_seed(seed)
    n = budget // page
    t = torch.stack([torch.sort(torch.randperm(rows // page, generator=g)[:n]).values for _ in range(hkv)])
    return (t * page).to(torch.int32).view(1, hkv, n).cuda()


def _time(fn):
    ms_eager = bench_ms(fn)
    ms_graph = bench_graph_ms(fn)
    return (ms_graph if ms_graph is not None else ms_eager), ms_eager, ("cuda_graph" if ms_graph else "eager")


def h2d_ceiling_gbps(nbytes: int) -> dict:
    """Pinned host -> device copy bandwidth (bytes / time) of one large ``copy_`` of a registered
    buffer (one cudaMemcpyAsync), the ceiling for reading host memory over PCIe."""
    from xoffload.runtime import CpuKVPool

    host = CpuKVPool(1, 1, nbytes // 4, 1, 1, BF, pin=True)  # K and V: 2 x nbytes/2 bytes
    src = host.k[0].view(-1)
    dev = torch.empty_like(src, device="cuda")
    ms = bench_ms(lambda: dev.copy_(src, non_blocking=True), warmup=10, rep=50)
    b = src.numel() * src.element_size()
    del dev
    host.close()
    torch.cuda.empty_cache()
    return {"bytes": b, "ms": ms, "GBps": b / ms / 1e6}


# -------------------------------------------------------------------------------------- cases
def _paged_fn(q, store, table, lens, page, num_splits=None, config=None):
    from xoffload.kernels import paged_decode_attn_with_lse
    from xoffload.kernels.paged_decode import _paged_triton

    if config is None:
        return lambda: paged_decode_attn_with_lse(q, store.k, store.v, table, lens, page_size=page,
                                                  num_splits=num_splits, check=False)
    scale = q.shape[-1] ** -0.5
    return lambda: _paged_triton(q, store.k, store.v, table, lens, page, scale, num_splits, config)


def _default_splits(b, hkv, group, n_pages, page):
    from xoffload.kernels.decode import _sm_count, default_num_splits

    return default_num_splits(b, hkv, group, n_pages * page, _sm_count(torch.device("cuda")))


def case_device(heads, page, dev_store) -> dict:
    """(a) 128K tokens in scattered device pages vs contiguous decode_attn_with_lse."""
    from xoffload.kernels import decode_attn_with_lse

    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    table = _scattered_table(CTX, page, dev_store.k.shape[0])
    nbytes = 2 * CTX * hkv * d * 2
    ms, ms_eager, timing = _time(_paged_fn(q, dev_store, table, lens, page))
    kc = dev_store.k[:CTX].unsqueeze(0)  # a contiguous [1, CTX, Hkv, D] cache of the same size
    vc = dev_store.v[:CTX].unsqueeze(0)
    cms, cms_eager, _ = _time(lambda: decode_attn_with_lse(q, kc, vc, lens, check=False))
    return {"case": "device", "heads": heads, "Hq": hq, "Hkv": hkv, "D": d, "tokens": CTX, "page": page,
            "num_splits": _default_splits(1, hkv, hq // hkv, table.shape[2], page),
            "bytes": nbytes, "ms": ms, "ms_eager": ms_eager, "timing": timing, "GBps": nbytes / ms / 1e6,
            "contiguous_ms": cms, "contiguous_ms_eager": cms_eager, "contiguous_GBps": nbytes / cms / 1e6,
            "frac_of_contiguous": cms / ms, "target": ">= 0.95 of contiguous"}


def case_host(heads, page, host_store, dev_store, ceiling) -> dict:
    """(b) 128K tokens in scattered pages of a pinned host pool, read over UVA."""
    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    table = _scattered_table(CTX, page, host_store.k.shape[0])
    nbytes = 2 * CTX * hkv * d * 2
    fn = _paged_fn(q, host_store, table, lens, page)
    ms, ms_eager, timing = _time(fn)
    oh, lh = fn()
    od, ld = _paged_fn(q, dev_store, table, lens, page)()
    torch.cuda.synchronize()
    return {"case": "host", "heads": heads, "Hq": hq, "Hkv": hkv, "D": d, "tokens": CTX, "page": page,
            "num_splits": _default_splits(1, hkv, hq // hkv, table.shape[2], page),
            "bytes": nbytes, "ms": ms, "ms_eager": ms_eager, "timing": timing, "GBps": nbytes / ms / 1e6,
            "h2d_ceiling_GBps": ceiling, "frac_of_h2d_copy": nbytes / ms / 1e6 / ceiling,
            "equal_to_device": bool(torch.equal(oh, od) and torch.equal(lh, ld))}


def case_sparse(heads, page, host_store, dev_store, ceiling, num_splits=None, config=None) -> dict:
    """(c) per-KV-head selection of BUDGET tokens in pages scattered over a 128K host pool."""
    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([BUDGET], dtype=torch.int32, device="cuda")
    table = _sparse_table(hkv, BUDGET, page, host_store.k.shape[0])
    nbytes = 2 * BUDGET * hkv * d * 2
    fn = _paged_fn(q, host_store, table, lens, page, num_splits, config)
    ms, ms_eager, timing = _time(fn)
    oh, lh = fn()
    dfn = _paged_fn(q, dev_store, table, lens, page, num_splits, config)
    od, ld = dfn()
    torch.cuda.synchronize()
    dms, _, _ = _time(dfn)
    ns = num_splits or _default_splits(1, hkv, hq // hkv, table.shape[2], page)
    return {"case": "sparse", "heads": heads, "Hq": hq, "Hkv": hkv, "D": d, "pool_tokens": host_store.k.shape[0],
            "budget": BUDGET, "page": page, "num_splits": ns, **(config or {}),
            "bytes": nbytes, "ms": ms, "ms_eager": ms_eager, "timing": timing, "GBps": nbytes / ms / 1e6,
            "h2d_ceiling_GBps": ceiling, "frac_of_h2d_copy": nbytes / ms / 1e6 / ceiling,
            "device_pool_ms": dms, "device_pool_GBps": nbytes / dms / 1e6,
            "equal_to_device": bool(torch.equal(oh, od) and torch.equal(lh, ld))}


def sweep_host(heads, page, host_store, ceiling, splits, configs) -> list:
    """Split count x tiles of the host (UVA) case: what the defaults should be for PCIe."""
    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    table = _scattered_table(CTX, page, host_store.k.shape[0])
    nbytes = 2 * CTX * hkv * d * 2
    base = _default_splits(1, hkv, hq // hkv, table.shape[2], page)
    rows = []
    for ns in splits:
        ns = base if ns == "default" else int(ns)
        for cfg in configs:
            try:
                ms = bench_graph_ms(_paged_fn(q, host_store, table, lens, page, ns, cfg))
                ms = ms if ms is not None else bench_ms(_paged_fn(q, host_store, table, lens, page, ns, cfg))
                rows.append({"heads": heads, "page": page, "num_splits": ns, **cfg, "ms": ms,
                             "GBps": nbytes / ms / 1e6, "frac_of_h2d_copy": nbytes / ms / 1e6 / ceiling})
            except Exception as e:  # a config that does not compile is recorded, not fatal
                rows.append({"num_splits": ns, **cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    return rows


# ------------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page", [16, 256])
def test_bench_paged_decode_device(benchmark, page):
    hq, hkv, d = HEADS["d128_32_8"]
    st = Store(CTX, hkv, d, "device")
    row = benchmark.pedantic(lambda: case_device("d128_32_8", page, st), rounds=1, iterations=1)
    record_extra(benchmark, row)
    st.close()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page", [16, 256])
def test_bench_paged_decode_host(benchmark, page):
    hq, hkv, d = HEADS["d128_32_8"]
    dev = Store(CTX, hkv, d, "device")
    host = Store(CTX, hkv, d, "host").like(dev)
    ceiling = h2d_ceiling_gbps(256 << 20)["GBps"]
    row = benchmark.pedantic(lambda: case_host("d128_32_8", page, host, dev, ceiling), rounds=1, iterations=1)
    record_extra(benchmark, row)
    host.close()
    dev.close()


# ------------------------------------------------------------------------------------- script
def _fmt(r, keys):
    return "  ".join(f"{k}={r[k]:.3f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}" for k in keys)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller copy ceiling, shorter sweep")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "paged_decode.json"))
    args = ap.parse_args(argv)
    if not HAS_CUDA:
        print("bench_paged_decode: no CUDA GPU, skipped")
        return 0
    ceil = h2d_ceiling_gbps((256 if args.quick else 1024) << 20)
    c = ceil["GBps"]
    print(f"pinned H2D copy ceiling: {c:.1f} GB/s ({ceil['bytes'] >> 20} MiB in one copy)", flush=True)
    rows, sweeps = [], []
    keys = ["case", "heads", "page", "num_splits", "ms", "GBps"]
    for heads in HEADS:
        hq, hkv, d = HEADS[heads]
        dev = Store(CTX, hkv, d, "device")
        host = Store(CTX, hkv, d, "host").like(dev)
        pages = (16, 256)
        if heads == "d128_32_8":  # (a): device pages vs contiguous decode
            for page in pages:
                r = case_device(heads, page, dev)
                rows.append(r)
                print(_fmt(r, keys + ["contiguous_GBps", "frac_of_contiguous"]), flush=True)
        for page in pages:  # (b): pinned host pages over UVA
            r = case_host(heads, page, host, dev, c)
            rows.append(r)
            print(_fmt(r, keys + ["frac_of_h2d_copy", "equal_to_device"]), flush=True)
        if heads == "d128_32_8":
            for page in (16, 32, 64):  # (c): per-KV-head sparse pages over PCIe
                for ns in ([None] if args.quick else [None, 16, 32]):
                    r = case_sparse(heads, page, host, dev, c, num_splits=ns)
                    rows.append(r)
                    print(_fmt(r, keys + ["frac_of_h2d_copy", "device_pool_GBps", "equal_to_device"]), flush=True)
            if args.quick:
                configs = [dict(block_n=64, num_warps=4, num_stages=3), dict(block_n=128, num_warps=4, num_stages=3),
                           dict(block_n=64, num_warps=8, num_stages=4)]
                splits = ["default", 256]
            else:
                configs = [dict(block_n=bn, num_warps=w, num_stages=st)
                           for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
                splits = ["default", 64, 256, 512]
            for page in pages:
                sw = sweep_host(heads, page, host, c, splits, configs)
                sweeps += sw
                print(f"host sweep, page {page}:")
                for r in sw:
                    print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        host.close()
        dev.close()
    res = {"benchmark": "paged_decode", **env_record(), "h2d_ceiling": ceil, "rows": rows, "host_sweep": sweeps,
           "targets": {"device": ">= 0.95x contiguous decode_attn_with_lse",
                       "host": "GB/s vs the pinned H2D copy ceiling"}}
    print(f"wrote {save_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
