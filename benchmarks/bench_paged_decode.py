"""Benchmark: paged decode attention on device pages, pinned host pages (UVA) and sparse pages.

paged_decode_attn_with_lse on pages in device memory, on pages in pinned host memory read over
PCIe (UVA, zero copy), and with per-KV-head sparse page selection; flash-attn's paged layout
(``flash_attn_with_kvcache(block_table=...)``) against our contiguous decode and FlexAttention's
paged decoding; the decode options (window, softcap, ALiBi) against the plain kernel.

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
* (d) ``block``: flash-attn's paged layout: the device pool seen as a block store
  ``[num_blocks, page, Hkv, D]`` (no copy) and a block table ``[1, P]`` of randomly permuted block
  ids, pages of 16 / 256; the kernel's block mode (``kernel_*``) and the user-facing
  ``flash_attn_with_kvcache(block_table=...)`` (``api_*``), both against the contiguous decode
  (target: >= 0.95x its GB/s).
* (e) ``flex``: FlexAttention's paged decoding (``torch.nn.attention.experimental._paged_attention``
  ``PagedAttention`` + compiled ``flex_attention``, physical cache ``[1, Hkv, pages*page, D]``,
  pages randomly permuted) on the same 128K tokens, where it runs (an error is recorded otherwise).
* (f) ``options``: decode at 128K with ``window_size=(4096, -1)`` (cost ~ the window: the keys
  outside it are never read) and with ``softcap=30`` + ALiBi (should cost nothing: memory bound),
  contiguous and paged (256), against the plain kernel.
* (g) ``budget``: sparse decode's GPU-side attention (the offload store's page cache): 2048
  tokens per KV head in scattered 32-token pages of a device row store, per split count (and two
  other tiles without ``--quick``); short lists are latency-bound, so the split rule matters.

Time: the median of ``triton.testing.do_bench`` (L2 flushed between runs) over CUDA-graph replays
of one call with ``check=False`` (``ms``; ``ms_eager`` is the plain Python call; for the api rows
the eager call also validates the lengths and block table on the host). Bytes counted: the K and V
bytes the attention reads (tokens * Hkv * D * 2 tensors * 2 bytes; the window's tokens for a
windowed row); the table, q, the output and the split partials are ignored. Each host case also
checks that its output equals the device-pool output bit for bit (``equal_to_device``).

Run: ``python benchmarks/bench_paged_decode.py [--quick] [--no-flex] [--only CASES] [--out PATH]``
(table + JSON into benchmarks/results/paged_decode.json), or ``pytest
benchmarks/bench_paged_decode.py`` (pytest-benchmark; numbers in extra_info). Skips cleanly
without CUDA (``--help`` works anywhere).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import (  # noqa: E402
    bench_graph_ms, bench_ms, bench_parser, env_record, parse_gpu_args, record_extra, run, save_json,
)

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


def sweep_budget(heads, dev_store, page=32, splits=(None, 4, 8, 16, 24, 32, 48, 64), configs=(None,)) -> list:
    """Sparse decode's GPU-side attention: a ``BUDGET``-token page list per KV head (pages of
    ``page`` scattered over a device row store: the offload store's page cache), CUDA-graph
    replay, per split count x tiles. Short lists are launch- and latency-bound, not
    bandwidth-bound: what the split rule should be for them."""
    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([BUDGET], dtype=torch.int32, device="cuda")
    table = _sparse_table(hkv, BUDGET, page, dev_store.k.shape[0])
    nbytes = 2 * BUDGET * hkv * d * 2
    base = _default_splits(1, hkv, hq // hkv, table.shape[2], page)
    ref = _paged_fn(q, dev_store, table, lens, page, base)()
    rows = []
    for ns in splits:
        for cfg in configs:
            n = base if ns is None else int(ns)
            try:
                fn = _paged_fn(q, dev_store, table, lens, page, n, cfg)
                o, lse = fn()
                ms = bench_graph_ms(fn) or bench_ms(fn)
                rows.append({"case": "budget", "heads": heads, "page": page, "budget": BUDGET, "num_splits": n,
                             "default_splits": ns is None, **(cfg or {}), "ms": ms, "us": ms * 1e3,
                             "GBps": nbytes / ms / 1e6,
                             "max_abs_diff_vs_default": float((o.float() - ref[0].float()).abs().max())})
            except Exception as e:  # a config that does not compile is recorded, not fatal
                rows.append({"case": "budget", "num_splits": n, **(cfg or {}),
                             "error": f"{type(e).__name__}: {str(e)[:160]}"})
    return rows


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


def _block_view(dev_store, page):
    """The device pool ``[rows, Hkv, D]`` seen as flash-attn's block store ``[rows/page, page, Hkv, D]``."""
    rows, hkv, d = dev_store.k.shape
    return dev_store.k.view(rows // page, page, hkv, d), dev_store.v.view(rows // page, page, hkv, d)


def _block_table(n_tokens, page, n_blocks, seed=0):
    """flash-attn's block table ``[1, P]``: the sequence's pages at randomly permuted block ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_blocks, generator=g)[: -(-n_tokens // page)].to(torch.int32).view(1, -1).cuda()


def _contiguous_ms(q, dev_store, lens, **kw):
    from xoffload.kernels import decode_attn_with_lse

    kc = dev_store.k[:CTX].unsqueeze(0)  # a contiguous [1, CTX, Hkv, D] cache of the same size
    vc = dev_store.v[:CTX].unsqueeze(0)
    return _time(lambda: decode_attn_with_lse(q, kc, vc, lens, check=False, **kw))


def case_block(heads, page, dev_store) -> dict:
    """(d) 128K tokens in flash-attn's paged layout (block store + block table) vs contiguous decode."""
    from xoffload.integrations.flash_api import flash_attn_with_kvcache
    from xoffload.kernels import paged_decode_attn_with_lse

    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    kb, vb = _block_view(dev_store, page)
    table = _block_table(CTX, page, kb.shape[0])
    nbytes = 2 * CTX * hkv * d * 2
    kfn = lambda: paged_decode_attn_with_lse(q, kb, vb, table[:, None], lens, check=False)  # noqa: E731
    afn = lambda: flash_attn_with_kvcache(q, kb, vb, cache_seqlens=lens, block_table=table,  # noqa: E731
                                          return_softmax_lse=True)
    kms, kms_eager, ktiming = _time(kfn)
    ams, ams_eager, atiming = _time(afn)
    cms, cms_eager, _ = _contiguous_ms(q, dev_store, lens)
    ok, ol = kfn()
    ao, al = afn()
    torch.cuda.synchronize()
    return {"case": "block", "heads": heads, "Hq": hq, "Hkv": hkv, "D": d, "tokens": CTX, "page": page,
            "num_splits": _default_splits(1, hkv, hq // hkv, table.shape[1], page), "bytes": nbytes,
            "kernel_ms": kms, "kernel_ms_eager": kms_eager, "kernel_timing": ktiming, "kernel_GBps": nbytes / kms / 1e6,
            "api_ms": ams, "api_ms_eager": ams_eager, "api_timing": atiming, "api_GBps": nbytes / ams / 1e6,
            "contiguous_ms": cms, "contiguous_ms_eager": cms_eager, "contiguous_GBps": nbytes / cms / 1e6,
            "kernel_frac_of_contiguous": cms / kms, "api_frac_of_contiguous": cms / ams,
            "api_equal_to_kernel": bool(torch.equal(ao, ok) and torch.equal(al, ol)),
            "target": ">= 0.95 of contiguous"}


_FLEX = {}


def case_flex(heads, page, dev_store) -> dict:
    """(e) FlexAttention's paged decoding of the same 128K tokens (pages randomly permuted)."""
    hq, hkv, d = HEADS[heads]
    row = {"case": "flex", "heads": heads, "Hq": hq, "Hkv": hkv, "D": d, "tokens": CTX, "page": page}
    nbytes = 2 * CTX * hkv * d * 2
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "f" not in _FLEX:
            _FLEX["f"] = torch.compile(flex_attention, dynamic=False)
        flex = _FLEX["f"]
        n_pages = CTX // page
        pa = PagedAttention(n_pages, page, 1, device="cuda")
        g = torch.Generator().manual_seed(0)
        pa.empty_pages = [int(i) for i in torch.randperm(n_pages, generator=g)]  # scattered pages
        pa.reserve(torch.tensor([0], device="cuda"), torch.tensor([CTX], device="cuda"))
        # physical caches [1, Hkv, pages * page, D] holding the pool's tokens at their pages
        kphys = torch.empty(1, hkv, n_pages * page, d, dtype=BF, device="cuda")
        vphys = torch.empty_like(kphys)
        phys = pa.page_table[0, :n_pages].long()  # logical page -> physical page
        src = torch.arange(CTX, device="cuda")
        dst = phys[src // page] * page + src % page
        kphys[0, :, dst] = dev_store.k[:CTX].transpose(0, 1)
        vphys[0, :, dst] = dev_store.v[:CTX].transpose(0, 1)
        q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
        qt = q.transpose(1, 2)  # [1, Hq, 1, D]

        def everything(b, h, q_idx, kv_idx):
            return kv_idx >= 0

        logical = create_block_mask(everything, 1, None, 1, CTX, device="cuda", BLOCK_SIZE=(128, page))
        bm = pa.convert_logical_block_mask(logical, torch.tensor([0], device="cuda"))
        fn = lambda: flex(qt, kphys, vphys, block_mask=bm, enable_gqa=True)  # noqa: E731
        out = fn()
        ms, ms_eager, timing = _time(fn)
        from xoffload.kernels import decode_attn_with_lse

        ours, _ = decode_attn_with_lse(q, dev_store.k[:CTX].unsqueeze(0), dev_store.v[:CTX].unsqueeze(0),
                                       torch.tensor([CTX], dtype=torch.int32, device="cuda"))
        cms, _, _ = _contiguous_ms(q, dev_store, torch.tensor([CTX], dtype=torch.int32, device="cuda"))
        pms, _, _ = _time(_paged_fn(q, dev_store, _scattered_table(CTX, page, dev_store.k.shape[0]),
                                    torch.tensor([CTX], dtype=torch.int32, device="cuda"), page))
        row.update({"ms": ms, "ms_eager": ms_eager, "timing": timing, "GBps": nbytes / ms / 1e6,
                    "ours_paged_ms": pms, "ours_paged_GBps": nbytes / pms / 1e6, "ours_over_flex": ms / pms,
                    "contiguous_GBps": nbytes / cms / 1e6,
                    "max_abs_diff_vs_ours": float((out.transpose(1, 2).float() - ours.float()).abs().max())})
    except Exception as e:  # FlexAttention refusing a page size (or missing) is recorded, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.empty_cache()
    return row


def case_options(heads, dev_store, window=4096) -> list:
    """(f) the decode options at 128K: a window (bytes = the window's tokens) and softcap + ALiBi
    (bytes = all tokens), contiguous and paged (256), against the plain kernel."""
    hq, hkv, d = HEADS[heads]
    q = torch.randn(1, 1, hq, d, dtype=BF, device="cuda")
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    slopes = torch.rand(hq, device="cuda") * 0.3
    per_tok = 2 * hkv * d * 2
    table = _scattered_table(CTX, 256, dev_store.k.shape[0])
    plain_c, _, _ = _contiguous_ms(q, dev_store, lens)
    plain_p, _, _ = _time(_paged_fn(q, dev_store, table, lens, 256))
    rows = []
    variants = [("window", dict(window_size=(window, -1)), (window + 1) * per_tok),
                ("softcap_alibi", dict(softcap=30.0, alibi_slopes=slopes), CTX * per_tok)]
    from xoffload.kernels import paged_decode_attn_with_lse

    for name, kw, nbytes in variants:
        cms, cms_eager, timing = _contiguous_ms(q, dev_store, lens, **kw)
        pms, _, _ = _time(lambda: paged_decode_attn_with_lse(q, dev_store.k, dev_store.v, table, lens, page_size=256,
                                                             check=False, **kw))
        rows.append({"case": "options", "variant": name, "heads": heads, "Hq": hq, "Hkv": hkv, "D": d,
                     "tokens": CTX, "bytes": nbytes, "ms": cms, "ms_eager": cms_eager, "timing": timing,
                     "GBps": nbytes / cms / 1e6, "plain_ms": plain_c, "time_over_plain": cms / plain_c,
                     "paged256_ms": pms, "paged256_GBps": nbytes / pms / 1e6, "paged256_time_over_plain": pms / plain_p,
                     **({"window": window, "window_area_ratio": (window + 1) / CTX} if name == "window" else {})})
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
def test_bench_paged_decode_block_table(benchmark, page):
    hq, hkv, d = HEADS["d128_32_8"]
    st = Store(CTX, hkv, d, "device")
    row = benchmark.pedantic(lambda: case_block("d128_32_8", page, st), rounds=1, iterations=1)
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


CASES = ("device", "block", "flex", "options", "host", "sparse", "sweep", "budget")


def main(argv=None):
    ap = bench_parser(__doc__, "paged_decode", quick_help="smaller copy ceiling, shorter sweeps")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention's paged decoding (compile time)")
    ap.add_argument("--only", default=",".join(CASES),
                    help=f"comma-separated cases to run (default all: {','.join(CASES)})")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    only = set(args.only.split(","))
    bad = only - set(CASES)
    if bad:
        ap.error(f"--only: unknown case(s) {sorted(bad)}; choose from {','.join(CASES)}")
    if args.no_flex:
        only.discard("flex")
    need_host = bool(only & {"host", "sparse", "sweep"})
    ceil = h2d_ceiling_gbps((256 if args.quick else 1024) << 20) if need_host else {"GBps": None}
    c = ceil["GBps"]
    if need_host:
        print(f"pinned H2D copy ceiling: {c:.1f} GB/s ({ceil['bytes'] >> 20} MiB in one copy)", flush=True)
    rows, sweeps = [], []
    keys = ["case", "heads", "page", "num_splits", "ms", "GBps"]
    pages = (16, 256)
    for heads in HEADS:
        hq, hkv, d = HEADS[heads]
        dev = Store(CTX, hkv, d, "device")
        host = Store(CTX, hkv, d, "host").like(dev) if need_host else None
        main_shape = heads == "d128_32_8"
        if main_shape and "device" in only:  # (a): device pages vs contiguous decode
            for page in pages:
                r = case_device(heads, page, dev)
                rows.append(r)
                print(_fmt(r, keys + ["contiguous_GBps", "frac_of_contiguous"]), flush=True)
        if main_shape and "block" in only:  # (d): flash-attn's block table layout
            for page in pages:
                r = case_block(heads, page, dev)
                rows.append(r)
                print(_fmt(r, ["case", "heads", "page", "kernel_GBps", "api_GBps", "contiguous_GBps",
                               "kernel_frac_of_contiguous", "api_frac_of_contiguous", "api_equal_to_kernel"]),
                      flush=True)
        if main_shape and "flex" in only:  # (e): FlexAttention's paged decoding
            for page in pages:
                r = case_flex(heads, page, dev)
                rows.append(r)
                print(_fmt(r, ["case", "heads", "page", "ms", "GBps", "ours_paged_GBps", "ours_over_flex",
                               "max_abs_diff_vs_ours", "error"]), flush=True)
        if main_shape and "options" in only:  # (f): window / softcap / ALiBi
            for r in case_options(heads, dev):
                rows.append(r)
                print(_fmt(r, ["case", "variant", "ms", "GBps", "time_over_plain", "paged256_time_over_plain"]),
                      flush=True)
        if "host" in only:
            for page in pages:  # (b): pinned host pages over UVA
                r = case_host(heads, page, host, dev, c)
                rows.append(r)
                print(_fmt(r, keys + ["frac_of_h2d_copy", "equal_to_device"]), flush=True)
        if main_shape and "sparse" in only:
            for page in (16, 32, 64):  # (c): per-KV-head sparse pages over PCIe
                for ns in ([None] if args.quick else [None, 16, 32]):
                    r = case_sparse(heads, page, host, dev, c, num_splits=ns)
                    rows.append(r)
                    print(_fmt(r, keys + ["frac_of_h2d_copy", "device_pool_GBps", "equal_to_device"]), flush=True)
        if main_shape and "budget" in only:  # (g): the page cache's GPU-side attention, split counts
            configs = [None] if args.quick else [None, dict(block_n=32, num_warps=4, num_stages=3),
                                                 dict(block_n=64, num_warps=2, num_stages=3)]
            for r in sweep_budget(heads, dev, configs=configs):
                rows.append(r)
                print(_fmt(r, ["case", "page", "num_splits", "default_splits", "block_n", "num_warps", "us", "GBps",
                               "max_abs_diff_vs_default", "error"]), flush=True)
        if main_shape and "sweep" in only:
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
        if host is not None:
            host.close()
        dev.close()
    res = {"benchmark": "paged_decode", **env_record(), "h2d_ceiling": ceil, "rows": rows, "host_sweep": sweeps,
           "cases_run": sorted(only),
           "targets": {"device": ">= 0.95x contiguous decode_attn_with_lse",
                       "block": ">= 0.95x contiguous decode_attn_with_lse (flash-attn block_table layout)",
                       "flex": "ours vs FlexAttention paged decoding (ours_over_flex > 1: ours faster)",
                       "options": "window: time ~ window / context of plain; softcap + ALiBi: ~1.0x plain",
                       "host": "GB/s vs the pinned H2D copy ceiling"}}
    print(f"wrote {save_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
