"""Batched decode throughput against batch size: ours, transformers and the HBM read bound; offload.

Ours against transformers' batched ``generate`` and the HBM read bound, in the same run; offload +
sparse decode under a 24 GiB cap.

Parts (``--part``, comma-separated; default both):

- ``gpu``: random Llama-3.1-8B shape (bf16), ``--ctx`` tokens per sequence (default 32K, prompt
  ``ctx - new``), batch 1, 2, 4, 8, 16 (``--batches``). Ours: ``LLM(mode="resident",
  max_num_seqs=B)``, every prompt admitted at once, each prefilled alone, then one decode step for
  all B (a CUDA graph per bucket); decode tok/s = B / median step time over the steady steps (the
  first two steps of the bucket, eager warm-up and graph capture, left out). Bound: each step reads
  the weights once and every sequence's KV once, ``(weights + B * ctx * KV bytes per token) / HBM
  copy bandwidth`` (measured here). Peer: transformers ``generate`` (SDPA, cache on the GPU) on
  the same weights with B prompts of the same length, decode time per token from CUDA events a
  logits processor records at every token; a batch it cannot hold is recorded as OOM.
- ``cap``: under a 24 GiB GPU memory cap (``torch.cuda.set_per_process_memory_fraction``), same
  shape and context: ``offload`` with Quest sparse decode (``--budget``, default 2048 tokens) at
  every batch of ``--cap-batches`` (pinned host memory: B * ctx * 128 KiB) through the batched
  Quest store (``OffloadQuestBatchKV``: one summary pool, one selection and one paged launch per
  layer for the batch, CUDA graphs; its choices — dense layers on the GPU or read from the pool,
  summary pool size — are recorded as ``store``), and ``resident`` given ``--cap-resident``
  prompts, whose KV pool is sized to the free memory under the cap (it runs as many at once as
  fit); both decode tok/s and how many sequences ran together. Each batch is guarded (an OOM or
  any other error is recorded and the next runs) and the JSON is rewritten after each one, so a
  run cut short still leaves its finished batches. ``--quick``: cap batches 1 and 16, 16 new
  tokens, resident given 4 prompts (about 2 minutes on an H200 with ``--part cap``).
- ``long`` (not in the default): no cap, ``--long-ctx`` tokens per sequence (128K):
  offload + Quest at batch sizes up to what 80% of host memory holds in the pinned pool, against
  ``resident`` up to what 90% of the free GPU memory holds; the best throughput of each and
  their ratio.

Writes ``benchmarks/results/batch.json`` and ``batch.png`` (throughput against batch size). Needs a
CUDA GPU (``--help`` works anywhere).
"""
from __future__ import annotations

import json
import statistics
import sys

from _common import bench_parser, env_record, fmt_table, hbm_copy_gbps, parse_gpu_args, requires_cuda, run, write_json

import torch

from bench_llm import _free, _prompt, _section, h2d_bandwidth_gbps, hf_from_ours, token_marker

PRESET = "llama-3.1-8b"
CAP_BYTES = 24 * 2**30
#: QuestDecode.reuse_bias of the offload + Quest runs (``--reuse-bias``; None: the library default)
REUSE_BIAS = None
#: QuestDecode.dense_layers of the offload + Quest runs (``--dense-layers``; None: the library default)
DENSE_LAYERS = None
#: QuestDecode.exact_channels of the offload + Quest runs (``--exact-channels``; 0: Quest's bound alone)
EXACT_CHANNELS = 0


def _quest(budget: int):
    """The offload + Quest runs' decode policy: budget ``budget``, :data:`REUSE_BIAS` and
    :data:`DENSE_LAYERS` (None: the library defaults)."""
    from xoffload.sparse import QuestDecode

    kw = {} if DENSE_LAYERS is None else {"dense_layers": DENSE_LAYERS}
    if EXACT_CHANNELS:  # the "quest-ch" preset's scoring (xoffload.sparse.policy)
        kw.update(exact_channels=EXACT_CHANNELS, bound_scale=0.25, fit_channels=True)
    return QuestDecode(token_budget=budget, reuse_bias=REUSE_BIAS, **kw)


def _dense_layers(text: str) -> tuple:
    """``--dense-layers``: comma-separated layer indices, or ``none`` (every layer sparse); checked
    by QuestDecode when the command line is read."""
    import argparse

    from xoffload.sparse import QuestDecode

    t = text.strip().lower()
    try:
        layers = () if t == "none" else tuple(int(x) for x in t.split(",") if x.strip())
        return QuestDecode(dense_layers=layers).dense_layers
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _exact_channels(text: str) -> int:
    """``--exact-channels``: a count QuestDecode takes (0 .. 64), checked when the command line is
    read (else the record's QuestDecode raised after the GPU check, a traceback)."""
    import argparse

    from xoffload.sparse import QuestDecode

    try:
        return QuestDecode(exact_channels=int(text)).exact_channels
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _long_batches(text: str) -> tuple:
    """``--long-batches``: comma-separated batch sizes >= 1, or ``max`` (``()``: only the largest
    that fits), checked when the command line is read."""
    import argparse

    t = text.strip()
    if t == "max":
        return ()
    try:
        sizes = tuple(int(x) for x in t.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated batch sizes >= 1 or 'max'")
    return sizes


def _reuse_bias(text: str) -> float:
    """``--reuse-bias``: a value QuestDecode takes (a number >= 1), checked when the command line is
    read (else every offload + Quest run of the part would record the same ValueError)."""
    import argparse

    from xoffload.sparse import QuestDecode

    try:
        return QuestDecode(reuse_bias=float(text)).reuse_bias
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _steady(stats: dict, batch: int) -> dict:
    """Decode figures of a batched generate from ``LLM.batch_stats``: steps that ran ``batch``
    sequences, less the first two of their bucket (warm-up, capture)."""
    steps = [s for s in stats["decode_steps"] if s["seqs"] == batch]
    steady = steps[2:] if len(steps) > 4 else steps
    ms = statistics.median(s["ms"] for s in steady) if steady else None
    return {"batch": batch, "steps": len(steps), "step_ms": ms,
            "tok_per_s": batch / ms * 1e3 if ms else None,
            "first_steps_ms": [s["ms"] for s in steps[:2]],
            "overall_decode_tok_per_s": stats["decode_tok_per_s"], "max_running": stats["max_running"],
            "graph_buckets": stats["graph_buckets"],
            "prefill_tok_per_s": stats["prefill_tokens"] / stats["prefill_ms"] * 1e3 if stats["prefill_ms"] else None}


def run_ours(model, batch, ctx, new, **kw) -> dict:
    """One batched generate of ``batch`` prompts of ``ctx - new`` tokens, ``new`` tokens each (batch 1
    too goes through the batched engine: ``max_num_seqs >= 2``, one row)."""
    from xoffload import LLM, SamplingParams

    llm = LLM(model, max_model_len=ctx + 64, max_num_seqs=max(batch, 2), max_num_batched_tokens=batch * ctx, **kw)
    try:
        prompts = [_prompt(ctx - new, model.cfg.vocab_size, seed=i) for i in range(batch)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        rec = _steady(llm.batch_stats, llm.batch_stats["max_running"])
        rec["peak_gpu_memory_bytes"] = outs[0].peak_gpu_memory_bytes
        rec["token_ids"] = [o.token_ids[:8] for o in outs[:2]]
        rec["h2d_bytes_per_token"] = outs[0].timings.get("h2d_bytes_per_token")
        rec["store"] = llm.batch_stats.get("store")
        return rec
    finally:
        llm.close()
        del llm
        _free()


def run_hf_batch(hf, batch, ctx, new) -> dict:
    """transformers ``generate`` of ``batch`` prompts at once (greedy, ``new`` tokens each)."""
    from transformers import LogitsProcessorList

    events = []
    ids = torch.tensor([_prompt(ctx - new, hf.config.vocab_size, seed=i) for i in range(batch)], device="cuda")
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([token_marker(events)]))
    except torch.cuda.OutOfMemoryError as e:
        return {"batch": batch, "status": "OOM", "error": str(e).splitlines()[0][:200]}
    finally:
        del ids
    events[-1].synchronize()
    gaps = [events[i].elapsed_time(events[i + 1]) for i in range(2, len(events) - 1)]
    ms = statistics.median(gaps) if gaps else None
    rec = {"batch": batch, "step_ms": ms, "tok_per_s": batch / ms * 1e3 if ms else None,
           "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated()),
           "token_ids": out[:2, -new:][:, :8].tolist()}
    del out
    _free()
    return rec


def part_gpu(res, model, batches, ctx, new, peers):
    kvt = model.cfg.kv_bytes_per_token(model.dtype)
    weights = model.w.nbytes()
    hbm = res["hbm_GBps"]
    ours, hf_rows = {}, {}
    for b in batches:
        r = _section(res, f"gpu/ours/b{b}", lambda b=b: run_ours(model, b, ctx, new, mode="resident"))
        if r:
            r["read_bound_ms"] = (weights + b * ctx * kvt) / (hbm * 1e9) * 1e3
            r["step_over_bound"] = r["step_ms"] / r["read_bound_ms"] if r.get("step_ms") else None
            ours[b] = r
            print(f"ours b={b}: {r['tok_per_s']:.0f} tok/s, step {r['step_ms']:.2f} ms = "
                  f"{r['step_over_bound']:.2f}x the read bound", flush=True)
    if peers:
        hf = _section(res, "gpu/hf_build", lambda: hf_from_ours(model))
        if hf is not None:
            res["results"]["gpu/hf_build"] = "ok"
            try:
                for b in batches:
                    r = _section(res, f"gpu/hf/b{b}", lambda b=b: run_hf_batch(hf, b, ctx, new))
                    if r:
                        hf_rows[b] = r
                        print(f"hf b={b}: {r.get('tok_per_s') or r.get('status')}", flush=True)
            finally:
                del hf
                _free()
    both = [b for b in batches if b in ours and (hf_rows.get(b) or {}).get("tok_per_s")]
    t = {}
    if both:
        b = max(both)
        t["largest_batch_both_fit"] = b
        t["ours_over_hf_at_it"] = ours[b]["tok_per_s"] / hf_rows[b]["tok_per_s"]
    if batches and max(batches) in ours:
        t[f"b{max(batches)}_step_over_read_bound"] = ours[max(batches)]["step_over_bound"]
    return {"ours": ours, "hf": hf_rows, "targets": t, "weights_bytes": weights, "kv_bytes_per_token": kvt}


def _cap_targets(out) -> dict:
    ok = {b: r for b, r in out["offload_quest"].items() if r.get("tok_per_s")}
    best_q = max([r["tok_per_s"] for r in ok.values()] or [0])
    g = (out["resident"] or {}).get("tok_per_s")
    return {"offload_quest_best_tok_per_s": best_q, "resident_under_cap_tok_per_s": g,
            "offload_quest_over_resident": best_q / g if g else None,
            "most_offload_quest_seqs": max([r.get("max_running") or b for b, r in ok.items()] or [0])}


def part_cap(res, model, batches, ctx, new, budget, resident_prompts, save=lambda: None):
    """The cap part (module docstring); ``save()`` is called after every batch (partial JSON)."""
    import time
    import traceback

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
    out = {"cap_bytes": CAP_BYTES, "budget": budget, "offload_quest": {}, "resident": None}
    res["results"]["cap_part"] = out  # filled in as batches finish (the JSON written after each)

    def guarded(what, fn):
        t = time.perf_counter()
        print(f"cap {what}: running ...", flush=True)
        try:
            r = fn()
        except torch.cuda.OutOfMemoryError as e:
            r = {"status": "OOM", "error": str(e).splitlines()[0][:200]}
        except Exception as e:  # record it and go on with the next batch
            r = {"status": "error", "error": f"{type(e).__name__}: {e}"[:300],
                 "traceback": traceback.format_exc()[-2000:]}
        _free()
        r["wall_s"] = time.perf_counter() - t
        print(f"cap {what}: {r.get('tok_per_s') or r.get('status')} tok/s, {r.get('max_running')} at once, "
              f"{r['wall_s']:.0f} s, store {r.get('store')}", flush=True)
        return r

    try:
        for b in batches:
            out["offload_quest"][b] = guarded(f"offload+quest b={b}", lambda b=b: run_ours(
                model, b, ctx, new, mode="offload", sparse_decode=_quest(budget),
                kv_cache_tokens=b * (ctx + 64)))
            out["targets"] = _cap_targets(out)
            save()
        out["resident"] = guarded(f"resident (given {resident_prompts})",
                                  lambda: run_ours(model, resident_prompts, ctx, new, mode="resident"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    out["targets"] = _cap_targets(out)
    save()
    return out


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    g = res["results"].get("gpu_part") or {}
    ours, hf = g.get("ours") or {}, g.get("hf") or {}
    if ours:
        xs = sorted(ours)
        ax.plot(xs, [ours[b]["tok_per_s"] for b in xs], "o-", label="xoffload resident (batched, CUDA graphs)")
        ax.plot(xs, [b / ours[b]["read_bound_ms"] * 1e3 for b in xs], "k--", label="read bound (weights + KV) / HBM")
    xs = sorted(b for b in hf if hf[b].get("tok_per_s"))
    if xs:
        ax.plot(xs, [hf[b]["tok_per_s"] for b in xs], "s-", label="transformers generate (SDPA)")
    c = res["results"].get("cap_part") or {}
    q = {b: r for b, r in (c.get("offload_quest") or {}).items() if r.get("tok_per_s")}
    if q:
        xs = sorted(q)
        ax.plot(xs, [q[b]["tok_per_s"] for b in xs], "^-", label=f"offload + Quest {c.get('budget')}, 24 GiB cap")
    r = c.get("resident") or {}
    if r.get("tok_per_s"):
        ax.axhline(r["tok_per_s"], color="gray", ls=":", label=f"resident under the cap ({r.get('max_running')} at once)")
    ax.set_yscale("log")
    env = res["env"]
    return _finish(fig, ax, f"{PRESET} shape, {res['ctx'] // 1024}K context, {env.get('gpu')}, "
                   f"{env.get('commit', '')[:7]} {env.get('date', '')[:10]}", path)


def _finish(fig, ax, title: str, path: str) -> str:
    """The axes, title, grid and legend both throughput figures share; saved to ``path``."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoded together")
    ax.set_ylabel("decode tok/s (all sequences)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_cap(series: dict, path: str) -> str:
    """Throughput against sequences of recorded cap parts, one line per label: ``series`` maps a
    label (e.g. ``"reuse bias 8"``) to result JSONs of this benchmark whose ``cap_part`` rows are
    merged (a later file's batch replaces an earlier one's); the resident row under the cap (the
    first file's that has one) and 3x it (target) as horizontal lines. Runs without a
    GPU (``--replot-cap``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    resident, meta = None, None
    for label, files in series.items():
        rows = {}
        for f in files:
            with open(f) as fh:
                res = json.load(fh)
            c = res["results"].get("cap_part") or {}
            meta = meta or (res.get("env") or {}, res.get("ctx"), c.get("budget"))
            rows.update({int(b): r for b, r in (c.get("offload_quest") or {}).items() if r.get("tok_per_s")})
            if resident is None and (c.get("resident") or {}).get("tok_per_s"):
                resident = c["resident"]["tok_per_s"]
        xs = sorted(rows)
        ax.plot(xs, [rows[b]["tok_per_s"] for b in xs], "o-", label=f"offload + Quest, {label}")
    if resident:
        ax.axhline(resident, color="gray", ls=":", label=f"resident under the cap ({resident:.0f} tok/s)")
        ax.axhline(3 * resident, color="k", ls="--", lw=0.8, label="3x resident (target)")
    env, ctx, budget = meta or ({}, None, None)
    return _finish(fig, ax, f"{PRESET} shape, {(ctx or 0) // 1024}K contexts, budget {budget}, 24 GiB cap, "
                   f"{env.get('gpu', '')} {env.get('date', '')[:10]}", path)


def _replot_series(specs) -> dict:
    """``--replot-cap LABEL=FILE[+FILE...]`` values as {label: [files]} (ValueError naming a bad one)."""
    out = {}
    for spec in specs:
        label, sep, files = spec.partition("=")
        if not sep or not label or not files:
            raise ValueError(f"--replot-cap takes LABEL=FILE[+FILE...], got {spec!r}")
        out[label] = files.split("+")
    return out


def _host_bytes() -> int:
    """Total host memory in bytes (``/proc/meminfo``; 0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def part_long(res, model, ctx, new, budget, batches=None, save=lambda: None):
    """No cap, ``ctx`` tokens per sequence (128K by default): offload + Quest at batch sizes up to
    what host memory allows for the pinned pool (80% of RAM), against ``resident`` at batch sizes
    up to what GPU memory allows; each batch size guarded (OOM and any other error recorded).
    ``batches``: the sizes below the caps to run besides the caps themselves (None: 1, 2, 4, 8, 16;
    ``()``: the caps only)."""
    kv = ctx * model.cfg.kv_bytes_per_token(model.dtype)
    host_max = max(1, int(0.8 * _host_bytes()) // kv)
    free, _total = torch.cuda.mem_get_info()
    gpu_max = max(1, int(0.9 * free) // kv)
    out = {"ctx": ctx, "budget": budget, "kv_bytes_per_seq": kv, "host_max_seqs": host_max,
           "gpu_max_seqs": gpu_max, "offload_quest": {}, "resident": {}}
    res["results"]["long_part"] = out  # partial results reach the JSON written after each size

    def sizes(cap):
        return sorted({b for b in ([1, 2, 4, 8, 16] if batches is None else batches) if b <= cap} | {cap})

    for name, cap, kw in (("offload_quest", host_max,
                           {"mode": "offload", "sparse_decode": _quest(budget)}),
                          ("resident", gpu_max, {"mode": "resident"})):
        for b in sizes(cap):
            print(f"long {name} b={b}: running ...", flush=True)
            try:
                extra = {"kv_cache_tokens": b * (ctx + 64)} if kw["mode"] == "offload" else {}
                r = run_ours(model, b, ctx, new, **kw, **extra)
            except torch.cuda.OutOfMemoryError as e:
                _free()
                r = {"status": "OOM", "error": str(e).splitlines()[0][:200]}
            except Exception as e:  # noqa: BLE001 - recorded, the next size still runs
                _free()
                r = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:200]}"}
            out[name][b] = r
            print(f"long {name} b={b}: {r.get('tok_per_s') or r.get('status')}", flush=True)
            save()
    best = {n: max([r["tok_per_s"] for r in out[n].values() if r.get("tok_per_s")] or [0])
            for n in ("offload_quest", "resident")}
    out["best_tok_per_s"] = best
    out["offload_quest_over_resident"] = best["offload_quest"] / best["resident"] if best["resident"] else None
    return out


def main(argv=None):
    ap = bench_parser(__doc__, "batch", "batches 1, 4, 16 and 16 new tokens")
    ap.add_argument("--part", default="gpu,cap", help="comma-separated parts: gpu, cap, long (no cap, "
                    "--long-ctx tokens: the largest batches host memory (offload + Quest) and GPU memory "
                    "(resident) allow)")
    ap.add_argument("--long-ctx", type=int, default=131072, help="tokens per sequence of the long part")
    ap.add_argument("--ctx", type=int, default=32768, help="tokens per sequence (prompt + new)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--batches", default="1,2,4,8,16", help="batch sizes of the gpu part")
    ap.add_argument("--cap-batches", default="1,4,8,16", help="batch sizes of offload + Quest under the cap")
    ap.add_argument("--budget", type=int, default=2048, help="Quest token budget of the cap part")
    ap.add_argument("--reuse-bias", type=_reuse_bias, default=None,
                    help="QuestDecode.reuse_bias of the offload + Quest runs, a number >= 1 (default: the "
                    "library's; the record's reuse_factor is the value in use)")
    ap.add_argument("--dense-layers", type=_dense_layers, default=None,
                    help="QuestDecode.dense_layers of the offload + Quest runs: comma-separated layers or 'none' "
                    "(every layer sparse; default: the library's)")
    ap.add_argument("--exact-channels", type=_exact_channels, default=0,
                    help="offload + Quest runs score pages with this many exact key channels, as the 'quest-ch' "
                    "preset (16; bound_scale 0.25, fitted channels); 0: Quest's min/max bound alone")
    ap.add_argument("--long-batches", type=_long_batches, default=None,
                    help="batch sizes of the long part besides the largest that fit (comma-separated; 'max': "
                    "only the largest; default 1,2,4,8,16)")
    ap.add_argument("--cap-resident", type=int, default=None,
                    help="prompts given to resident under the cap (default: the largest cap batch; 4 with --quick)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--replot-cap", action="append", default=None, metavar="LABEL=FILE[+FILE...]",
                    help="no run: plot the cap parts of recorded JSONs, one line per label, into --out's .png "
                    "(repeatable)")
    if argv is None:
        argv = sys.argv[1:]
    pre = ap.parse_args(argv)
    if pre.replot_cap:
        try:
            series = _replot_series(pre.replot_cap)
        except ValueError as e:
            ap.error(str(e))
        base = pre.out[:-5] if pre.out.endswith(".json") else pre.out
        print(f"wrote {plot_cap(series, base + '.png')}")
        return 0
    a = parse_gpu_args(ap, argv)
    if a is None:
        return 0
    global REUSE_BIAS, DENSE_LAYERS, EXACT_CHANNELS
    REUSE_BIAS, DENSE_LAYERS, EXACT_CHANNELS = a.reuse_bias, a.dense_layers, int(a.exact_channels)
    long_batches = a.long_batches  # None: the default sizes; (): only the largest that fits
    from xoffload.models import random_model

    parts = set(a.part.split(","))
    batches = [1, 4, 16] if a.quick else [int(x) for x in a.batches.split(",")]
    cap_batches = [1, 16] if a.quick else [int(x) for x in a.cap_batches.split(",")]
    new = 16 if a.quick else a.new
    from xoffload.sparse import QuestDecode

    # reuse_bias None is the library default, which changed (2, then 8): record its value
    res = {"name": "batch", "preset": PRESET, "ctx": a.ctx, "new": new, "reuse_bias": a.reuse_bias,
           "reuse_factor": QuestDecode(reuse_bias=a.reuse_bias).reuse_factor,
           "dense_layers": list(_quest(a.budget).dense_layers), "exact_channels": EXACT_CHANNELS, "results": {}, "errors": {}, "tracebacks": {},
           "env": env_record(), "hbm_GBps": hbm_copy_gbps(), "h2d_GBps": h2d_bandwidth_gbps()}
    print(f"HBM copy {res['hbm_GBps']:.0f} GB/s, H2D {res['h2d_GBps']:.1f} GB/s", flush=True)
    model = random_model(PRESET, dtype=torch.bfloat16, device="cuda", seed=0)
    try:
        if "gpu" in parts:
            _section(res, "gpu_part", lambda: part_gpu(res, model, batches, a.ctx, new, not a.no_peers))
        if "cap" in parts:
            n_res = a.cap_resident or (4 if a.quick else max(cap_batches))
            _section(res, "cap_part", lambda: part_cap(res, model, cap_batches, a.ctx, new, a.budget, n_res,
                                                       save=lambda: write_json(a.out, res)))
        if "long" in parts:
            _section(res, "long_part", lambda: part_long(res, model, a.long_ctx, new, a.budget, long_batches,
                                                         save=lambda: write_json(a.out, res)))
    finally:
        model = None
        _free()
    rows = []
    for part in ("gpu_part", "cap_part", "long_part"):
        p = res["results"].get(part) or {}
        for name in ("ours", "hf", "offload_quest", "resident"):
            recs = p.get(name) or {}
            if "batch" in recs:  # one record (the cap part's resident), not {batch: record}
                recs = {recs["batch"]: recs}
            for b, r in recs.items():
                rows.append({"what": f"{part}/{name}", "batch": b, "tok/s": r.get("tok_per_s") or float("nan"),
                             "step_ms": r.get("step_ms") or float("nan"),
                             "x_bound": r.get("step_over_bound") or float("nan"),
                             "peak_GiB": (r.get("peak_gpu_memory_bytes") or 0) / 2**30, "status": r.get("status", "")})
        if p.get("targets"):
            print(part, p["targets"])
    print(fmt_table(rows, ["what", "batch", "tok/s", "step_ms", "x_bound", "peak_GiB", "status"]))
    base = a.out[:-5] if a.out.endswith(".json") else a.out
    res["plot"] = plot(res, base + ".png")
    print("wrote", write_json(a.out, res), res["plot"])
    if res["errors"]:
        print("errors:", res["errors"])
    return 1 if res["errors"] else 0


@requires_cuda
def test_bench_batch(benchmark):
    benchmark.pedantic(lambda: main(["--quick", "--no-peers", "--ctx", "8192"]), rounds=1, iterations=1)


if __name__ == "__main__":
    run(main)
