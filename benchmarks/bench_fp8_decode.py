"""Benchmark: paged decode over fp8 (e4m3) KV pages against bf16 pages, and fp8 quantization.

Decode (``decode``): ``paged_decode_attn_with_lse`` at the Llama-3.1-8B head shape (Hq 32, Hkv 8,
D 128), bf16 queries, one query token, batch 1 and 8, contexts of 32K and 128K tokens per sequence,
over a device block store ``[num_blocks, page, Hkv, D]`` whose blocks each sequence visits in a
random permutation (shared table ``[B, 1, P]``), pages of 32 tokens (a scale per key row: the page
is shorter than the kernel's 64-key tile) and 256 (a scale per tile). Variants: ``bf16`` pages,
``fp8_page`` (e4m3, fp32 scales per (page, KV head)) and ``fp8_token`` (per (token, KV head)).
Each row: time (``us``), bytes read (K and V codes plus their scales; q, the table, outputs and
split partials ignored), GB/s, its fraction of the HBM copy bandwidth (``hbm_copy_GBps``, bytes read +
written per second of a 2 GiB device copy: the ceiling the other decode benchmarks use), the
fp8/bf16 time ratio of the same shape (``time_over_bf16``; 0.5 would be the byte ratio), and the
largest output difference from the bf16 run on the unquantized values (``max_abs_diff_vs_bf16``:
the format's error on random data, a sanity number).

Quantization (``quant``): ``quantize_kv_fp8`` of one layer's K (bf16, 8 KV heads x D 128) of 128K
tokens as a row store (pages of 32) and a block store (pages of 256), both granularities;
bytes = bf16 read + e4m3 written + fp32 scales written, GB/s and its fraction of the copy
ceiling, and the torch reference's time on the same GPU (``torch_ms``) for scale.

Time: the median of ``triton.testing.do_bench`` (L2 flushed between runs) over CUDA-graph replays
of one call with ``check=False`` (``us``; ``us_eager``: the plain Python call).

``--fp8-configs BN,W,S[,R] ...`` also times the fp8 variants under other tiles of the paged kernel
(BN keys per loop iteration, W warps, S pipeline stages, R an optional register cap per thread,
ptxas' ``maxnreg``), one row each with ``config`` set (the library's default rows have none), so
one run on the GPU compares them with the default (``decode._default_config``: 128 keys, 4 warps,
3 stages for fp8 at D 128).

Run: ``python benchmarks/bench_fp8_decode.py [--quick] [--only decode,quant] [--fp8-configs ...]
[--out PATH]`` (table + JSON into benchmarks/results/fp8_decode.json), or ``pytest
benchmarks/bench_fp8_decode.py`` (pytest-benchmark; numbers in extra_info). Skips cleanly without
CUDA (``--help`` works anywhere).
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
    bench_graph_ms, bench_ms, bench_parser, hbm_copy_gbps, parse_gpu_args, record_extra, run, write_json,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"
DTYPE = torch.bfloat16
HEADS = (32, 8, 128)  # Hq, Hkv, D: Llama-3.1-8B
VARIANTS = ("bf16", "fp8_page", "fp8_token")
PAGES = (32, 256)
BATCHES = (1, 8)
CONTEXTS = (32768, 131072)
QUANT_TOKENS = 131072


def _time(fn):
    """``(us, us_eager, timing)``: CUDA-graph replay when ``fn`` can be captured, else eager."""
    ms_eager = bench_ms(fn)
    ms_graph = bench_graph_ms(fn)
    return (ms_graph if ms_graph is not None else ms_eager) * 1e3, ms_eager * 1e3, (
        "cuda_graph" if ms_graph is not None else "eager")


class BlockStore:
    """A bf16 block store ``[num_blocks, page, Hkv, D]`` for K and V, random values, and its fp8
    copies (page and token scales, made on first use)."""

    def __init__(self, num_blocks, page, hkv, d, seed=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.page = page
        self.k = torch.randn(num_blocks, page, hkv, d, generator=g, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(num_blocks, page, hkv, d, generator=g, device=DEVICE, dtype=DTYPE)
        self._fp8 = {}

    def fp8(self, granularity):
        """``(kq, ks, vq, vs)`` of this store at ``granularity``."""
        from xoffload.kernels import quantize_kv_fp8

        if granularity not in self._fp8:
            kq, ks = quantize_kv_fp8(self.k, granularity=granularity)
            vq, vs = quantize_kv_fp8(self.v, granularity=granularity)
            self._fp8[granularity] = (kq, ks, vq, vs)
        return self._fp8[granularity]

    def close(self):
        self.k = self.v = None
        self._fp8.clear()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _table(b, ctx, page, num_blocks, seed=0):
    """Shared table ``[B, 1, P]``: each sequence's pages at a random permutation of the blocks."""
    g = torch.Generator().manual_seed(seed)
    per = -(-ctx // page)
    rows = [torch.randperm(num_blocks, generator=g)[:per] for _ in range(b)]
    return torch.stack(rows).to(torch.int32).view(b, 1, per).to(DEVICE)


def decode_bytes(variant, b, ctx, hkv, d, page) -> int:
    """Bytes a decode call reads from the store: K and V codes plus their scales."""
    tokens = b * ctx
    if variant == "bf16":
        return 2 * tokens * hkv * d * 2
    scales = tokens * hkv if variant == "fp8_token" else b * -(-ctx // page) * hkv
    return 2 * (tokens * hkv * d + 4 * scales)


def parse_config(text: str) -> dict:
    """``"BN,W,S"`` or ``"BN,W,S,R"`` -> the paged kernel's config dict (``_paged_triton``)."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) not in (3, 4) or min(parts) < 1:
        raise ValueError(f"a config is BLOCK_N,num_warps,num_stages[,maxnreg] of positive ints, got {text!r}")
    cfg = dict(block_n=parts[0], num_warps=parts[1], num_stages=parts[2])
    if len(parts) == 4:
        cfg["maxnreg"] = parts[3]
    return cfg


def _config_name(cfg) -> str:
    return f"{cfg['block_n']}k w{cfg['num_warps']} s{cfg['num_stages']}" + (
        f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else "")


def run_decode_case(b, ctx, page, hbm, heads=HEADS, configs=()) -> list:
    """The three variants at one (batch, context, page) shape, one row each, and the fp8 variants
    again under each of ``configs`` (paged kernel configs, :func:`parse_config`)."""
    from xoffload.kernels import paged_decode_attn_with_lse
    from xoffload.kernels.paged_decode import _paged_triton

    hq, hkv, d = heads
    num_blocks = b * -(-ctx // page)
    st = BlockStore(num_blocks, page, hkv, d)
    table = _table(b, ctx, page, num_blocks)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, 1, hq, d, device=DEVICE, dtype=DTYPE)
    rows, base_us, base_out = [], None, None
    runs = [(v, None) for v in VARIANTS] + [(v, c) for c in configs for v in VARIANTS if v != "bf16"]
    for variant, cfg in runs:
        if variant == "bf16":
            args, kw = (st.k, st.v), {}
        else:
            kq, ks, vq, vs = st.fp8(variant[4:])
            args, kw = (kq, vq), dict(k_scale=ks, v_scale=vs)
        if cfg is None:
            fn = lambda: paged_decode_attn_with_lse(q, *args, table, lens, check=False, **kw)  # noqa: E731
        else:
            fn = lambda: _paged_triton(q, *args, table, lens, page, d ** -0.5, None, cfg, **kw)  # noqa: E731
        out = fn()[0]
        us, us_eager, timing = _time(fn)
        nbytes = decode_bytes(variant, b, ctx, hkv, d, page)
        row = {"case": "decode", "variant": variant, "B": b, "context": ctx, "page": page, "Hq": hq, "Hkv": hkv,
               "D": d, "bytes": nbytes, "us": us, "us_eager": us_eager, "timing": timing,
               "GBps": nbytes / us / 1e3, "hbm_copy_GBps": hbm, "frac_of_hbm_copy": nbytes / us / 1e3 / hbm}
        if cfg is not None:
            row["config"] = _config_name(cfg)
        if variant == "bf16":
            base_us, base_out = us, out
        else:
            row.update(time_over_bf16=us / base_us,
                       max_abs_diff_vs_bf16=float((out.float() - base_out.float()).abs().max()))
        rows.append(row)
    st.close()
    return rows


def run_quant_case(layout, page, granularity, hbm, tokens=QUANT_TOKENS, heads=HEADS) -> dict:
    """``quantize_kv_fp8`` of ``tokens`` tokens of one K tensor (row or block layout)."""
    from xoffload.kernels import quantize_kv_fp8
    from xoffload.kernels.reference import quantize_kv_fp8_ref

    _, hkv, d = heads
    shape = (tokens, hkv, d) if layout == "rows" else (tokens // page, page, hkv, d)
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    q, s = quantize_kv_fp8(x, page_size=page, granularity=granularity)
    fn = lambda: quantize_kv_fp8(x, page_size=page, granularity=granularity, out=q, scale_out=s)  # noqa: E731
    us, us_eager, timing = _time(fn)
    torch_us = bench_ms(lambda: quantize_kv_fp8_ref(x, page_size=page, granularity=granularity)) * 1e3
    qr, sr = quantize_kv_fp8_ref(x, page_size=page, granularity=granularity)
    nbytes = x.numel() * (x.element_size() + 1) + s.numel() * 4
    return {"case": "quant", "layout": layout, "page": page, "granularity": granularity, "tokens": tokens,
            "Hkv": hkv, "D": d, "bytes": nbytes, "us": us, "us_eager": us_eager, "timing": timing,
            "GBps": nbytes / us / 1e3, "hbm_copy_GBps": hbm, "frac_of_hbm_copy": nbytes / us / 1e3 / hbm,
            "torch_us": torch_us, "speedup_over_torch": torch_us / us,
            "equal_to_reference": bool(torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr))}


def quant_cases():
    return [(layout, page, g) for layout, page in (("rows", 32), ("blocks", 256)) for g in ("page", "token")]


# ------------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("b", BATCHES)
def test_bench_fp8_decode_128k(benchmark, b, page):
    rows = benchmark.pedantic(lambda: run_decode_case(b, 131072, page, hbm_copy_gbps()), rounds=1, iterations=1)
    for r in rows:
        record_extra(benchmark, {f"{r['variant']}_{k}": v for k, v in r.items() if k != "variant"})


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout,page,granularity", quant_cases())
def test_bench_fp8_quantize(benchmark, layout, page, granularity):
    row = benchmark.pedantic(lambda: run_quant_case(layout, page, granularity, hbm_copy_gbps()), rounds=1,
                             iterations=1)
    record_extra(benchmark, row)


# ------------------------------------------------------------------------------------- script
def _line(r) -> str:
    if r["case"] == "decode":
        extra = (f"  fp8/bf16 {r['time_over_bf16']:.3f}  max|diff| {r['max_abs_diff_vs_bf16']:.3g}"
                 if "time_over_bf16" in r else "")
        name = r["variant"] + (f" [{r['config']}]" if r.get("config") else "")
        return (f"decode B={r['B']} ctx={r['context']:>6} page={r['page']:>3} {name:<9} "
                f"{r['us']:8.1f} us  {r['bytes'] / 2**20:8.1f} MiB  {r['GBps']:7.1f} GB/s "
                f"({100 * r['frac_of_hbm_copy']:.1f}% of copy){extra}")
    return (f"quant {r['layout']:<6} page={r['page']:>3} {r['granularity']:<5} {r['us']:8.1f} us  "
            f"{r['GBps']:7.1f} GB/s ({100 * r['frac_of_hbm_copy']:.1f}% of copy)  torch {r['torch_us']:.1f} us  "
            f"equal={r['equal_to_reference']}")


def main(argv=None):
    ap = bench_parser(__doc__, "fp8_decode", quick_help="batch 1 at 128K only")
    ap.add_argument("--only", default="decode,quant", help="comma-separated cases: decode, quant")
    ap.add_argument("--fp8-configs", nargs="*", default=[], metavar="BN,W,S[,R]",
                    help="also time the fp8 variants under these paged-kernel configs (keys per tile, warps, "
                         "stages, optional register cap), e.g. 64,4,3 128,4,3,168")
    args = parse_gpu_args(ap, argv)
    if args is None:
        return 0
    try:
        configs = [parse_config(c) for c in args.fp8_configs]
    except ValueError as e:
        ap.error(str(e))
    only = set(args.only.split(","))
    if only - {"decode", "quant"}:
        ap.error(f"--only: unknown case(s) {sorted(only - {'decode', 'quant'})}; choose from decode,quant")
    from xoffload.kernels import check_fp8_supported

    check_fp8_supported("cuda")
    hbm = hbm_copy_gbps()
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s (read + write)", flush=True)
    rows = []
    if "decode" in only:
        for b in ((1,) if args.quick else BATCHES):
            for ctx in ((131072,) if args.quick else CONTEXTS):
                for page in PAGES:
                    for r in run_decode_case(b, ctx, page, hbm, configs=configs):
                        rows.append(r)
                        print(_line(r), flush=True)
    if "quant" in only:
        for layout, page, g in quant_cases():
            r = run_quant_case(layout, page, g, hbm)
            rows.append(r)
            print(_line(r), flush=True)
    res = {"benchmark": "fp8_decode", "heads": {"Hq": HEADS[0], "Hkv": HEADS[1], "D": HEADS[2]},
           "hbm_copy_GBps": hbm, "rows": rows, "cases_run": sorted(only),
           "targets": {"decode": "fp8 time ~0.5x bf16 (half the bytes) at long context; GB/s near bf16's",
                       "quant": "GB/s near the copy ceiling (memory bound); equal_to_reference true"}}
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    run(main)
