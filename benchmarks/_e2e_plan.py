"""What ``bench_e2e.py`` runs where and how long it takes, without a GPU: the run's constants, the
configurations and lengths of a sweep, its warm-up requests, the cap part's search for the longest
context served, and the time plan (``bench_e2e.py --plan``) from the figures measured before.

- :func:`all_configs`, :func:`variant_configs`, :func:`config_lengths`, :func:`warm_runs`,
  :func:`warm_layers`: which configuration runs at which length, and what warms it up first;
  :func:`measured_configs`: the configurations of a measured run, those the library no longer
  offers (:data:`RETIRED`) included, for planning that run;
- :func:`longest_served`: the cap search (probe the lower end, fit peak memory against length,
  start where the fit reaches the cap, gallop, bisect to the grid);
- :func:`plan`, :func:`plan_seconds`, :func:`print_plan`: estimated seconds per part, by kind.

The plan's basis (the constants under "the plan" below): one H200, 2026-12-01, commit 9c873dd,
``benchmarks/results/e2e_full.json`` (the default command with ``--time-budget 545``: parts 8b
385.6 s and cap 149.3 s; qwen, smollm2 and stall skipped by the budget) and ``e2e_rest.json``
(``--part qwen,smollm2,stall``: 53.5, 56.6, 9.1 s). Taken from them: every point's TTFT (a fit
a n + b n^2 within 3%), steady decode and first-two-step cost, the transformers peers' TTFT and
decode per length, ``llm_init_s`` (pinning: 0.37 s/GiB, 2.7 GiB/s, where the first plan assumed
10 GiB/s: 54 s of the 8b part went to 9 pools of 16 GiB), the cap searches' probes and limits,
``startup_s``, the stall part. Not broken down in those JSONs, so assumed or fitted (named at each
constant): a pool's release (0.09 s/GiB, fitted to the cap part), a refused probe's cost (its pool
and two layers of prefill), each part's remainder ``other`` (8b 23 s, qwen 5 s, smollm2 38 s: the
model, first-use compilation, host work between requests). With those, ``plan`` of the measured
commands (``--variants --fresh-pools``, 6 transformers tokens, their configurations through
:func:`measured_configs`) gives each measured part's seconds within 0.3%
(tests/benchmarks/test_bench_e2e.py checks 5%). The first plan, 567 s for 660
measured, had pinning at 10 GiB/s, 0.2 s of host work per point (measured: 0.02 s) and no remainder.

Where the 8b part's 386 s went (measured): 51 points 222 s (TTFT 187, nine 128K prefills of
11.2 s each among them; decode 34, of which dense offload at 64K-128K 24), pools 54 s (9 x 16 GiB)
and their release, transformers 47 s (TTFT 37: 24 of it at 128K; decode 10, the offloaded cache's
828 ms steps 4.1 s at 128K) plus the 10.6 s build, warm-up and the remainder. The default run now:
the variants opt-in (``--variants``: 2 LLMs, 4 points of 8b, 2 of qwen and smollm2), one pinned
pool per sweep reused (``reuse_pinned_slabs``; ``--fresh-pools`` for the old way), 3 decode steps
for the transformers offloaded cache (the median step as steady state).
"""
from __future__ import annotations

import os

from _common import fmt_table

CAP_BYTES = 24 * 2**30
N_NEW = 12  # tokens per point: 1 from prefill, 2 warm-up/capture steps, 9 steady steps
WARM_NEW = 3  # warm-up requests: prefill, the eager step, the capture
#: transformers: 1 token from prefill + 5 decode steps on the GPU cache; 3 on the offloaded cache
#: (0.83 s a step at 128K): the median of 3 steps is its steady state (run_hf's
#: decode_steady_ms_per_token), the first plan's 5 bought only wall time
HF_NEW = {"hf_gpu_cache": 6, "hf_offloaded_cache": 4}
PROBE_NEW = 4  # cap probes: prefill, eager step, capture, one replay
CAP_STEP = 16384
CAP_MAX = 524288
PARTS = ("8b", "cap", "qwen", "smollm2", "stall")  # the order they run in
PART_KEYS = {"8b": "8b_part", "cap": "cap_24GiB", "qwen": "qwen3_8b_part", "smollm2": "smollm2_part",
             "stall": "stall"}  # where each part's outcome goes in res["results"]
VARIANTS = ("offload+quest-nocache", "offload+quest-cache2x")
VARIANT_LENGTHS = (32768, 131072)
CAP_TARGETS = {"resident": {"mode": "resident"}, "offload": {"mode": "offload"},
               "offload+quest": {"mode": "offload", "sparse_decode": "quest"}}
CAP_RECORD_128K = ("resident", "offload+quest")  # the 128K decode under the cap (README claims)
#: Configurations the measured runs (the plan's basis, below) had that the library no longer
#: offers, each with the keyword arguments of the configuration that stands in for it when such a
#: run is planned (:func:`measured_configs`: its warm-up view, LLM and pool cost as the stand-in's;
#: its decode and SmolLM2 figures are its own measured rows, kept in DECODE_MS and SMOLLM2):
#: ``offload-ring`` (dense offload decode through a ring of whole GPU layers, eager: the engine
#: now streams each layer through two GPU buffers inside the step's CUDA graph, ``offload``) and
#: ``offload+quest-prefetch`` (a variant: Quest's next-layer page prefetch, measured slower and
#: removed). Never run by the benchmark.
RETIRED = {"offload-ring": {"mode": "offload"},
           "offload+quest-prefetch": {"mode": "offload", "sparse_decode": "quest"}}
RETIRED_VARIANTS = ("offload+quest-prefetch",)  # ran as a variant: at VARIANT_LENGTHS only
HF_CACHES = {"hf_gpu_cache": False, "hf_offloaded_cache": True}  # name -> offloading
ALL_ON_GPU = ("resident", "hf_gpu_cache")  # KV of every token on the GPU: (cap - weights) / KV bytes bound
WEIGHTS_8B = 16060522496  # bytes (e2e_full.json models/8b)


# ------------------------------------------------------------------------------ what runs where
def variant_configs() -> dict:
    """The diagnostic variants of offload+quest (:data:`VARIANTS`): without its GPU page cache and
    with a 116-page cache (2x the 8B shape's pages per step). Not part of section 2: they feed the
    time split's ``fetch without cache`` and the cache-size study."""
    from xoffload.sparse import QuestDecode

    return {"offload+quest-nocache": {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=0)},
            "offload+quest-cache2x": {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=116)},
            **reuse_configs(), **fp8_configs()}


def fp8_configs() -> dict:
    """Opt-in configurations (run only when ``--configs`` names them, at every length): the fp8
    (e4m3) KV cache (``kv_cache_dtype="fp8"``: codes + fp32 scales in the pinned pool, half the
    PCIe bytes of a decode step) beside the 16-bit rows of the same name without ``-fp8``: page
    scales (one per 64 tokens, or per Quest page) and ``-token`` (one per token)."""
    from xoffload.sparse import QuestDecode

    fp8, tok = {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8", "kv_cache_scale": "token"}
    return {"offload-fp8": {"mode": "offload", **fp8}, "offload-fp8-token": {"mode": "offload", **tok},
            "offload-uva-fp8": {"mode": "offload", "offload_decode": "uva", **fp8},
            "offload+quest-fp8": {"mode": "offload", "sparse_decode": "quest", **fp8},
            "offload+quest-fp8-token": {"mode": "offload", "sparse_decode": "quest", **tok},
            "offload+quest-ch-fp8": {"mode": "offload", "sparse_decode": "quest-ch", **fp8},
            "offload+quest-fp8-nocache": {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=0), **fp8}}


def reuse_configs() -> dict:
    """Opt-in configurations (run only when ``--configs`` names them, at every length): ``quest``
    and ``quest-ch`` without the page cache's reuse bias (``reuse_bias=1.0``; the default is 8,
    :data:`xoffload.sparse.quest.DEFAULT_REUSE_BIAS`),
    the comparison that measured it (an earlier run ran these with the bias as the variant:
    ``offload+quest-reuse2``), and ``quest`` with the bias fixed at 2, 4 and 8 (the sweep that moved
    the default to 8, where ``offload+quest`` was the bias-2 row: ``offload+quest-reuse8`` is now
    the default ``offload+quest`` under a name that stays 8 if the default moves)."""
    import dataclasses

    from xoffload.sparse import QuestDecode
    from xoffload.sparse.policy import decode_policies

    qch = decode_policies()["quest-ch"]()
    return {"offload+quest-noreuse": {"mode": "offload", "sparse_decode": QuestDecode(reuse_bias=1.0)},
            "offload+quest-ch-noreuse": {"mode": "offload", "sparse_decode": dataclasses.replace(qch, reuse_bias=1.0)},
            "offload+quest-reuse2": {"mode": "offload", "sparse_decode": QuestDecode(reuse_bias=2.0)},
            "offload+quest-reuse4": {"mode": "offload", "sparse_decode": QuestDecode(reuse_bias=4.0)},
            "offload+quest-reuse8": {"mode": "offload", "sparse_decode": QuestDecode(reuse_bias=8.0)},
            **channel_configs()}


def channel_configs() -> dict:
    """Opt-in configurations (run only when ``--configs`` names them): Quest with ``R`` exact key
    channels and the bound scaled by 0.25 on the rest, at budgets 512 and 2048
    (``offload+quest-chR@B``), the policies of the real-RULER policy sweep
    (``benchmarks/results/ruler_policy_sweep.json``) at the 8B shape's speed."""
    from xoffload.sparse import QuestDecode

    return {f"offload+quest-ch{r}@{b}": {"mode": "offload", "sparse_decode": QuestDecode(
        token_budget=b, exact_channels=r, bound_scale=0.25)} for r in (16, 32, 64) for b in (512, 2048)}


def all_configs(only: str | None = None, variants: bool = False) -> dict:
    """The library's configurations (:func:`xoffload.engine.modes.configurations`), plus the
    diagnostic variants (:func:`variant_configs`) with ``variants`` (``--variants``) or when
    ``only`` names one. ``only`` (``--configs``; default the env ``XOFFLOAD_BENCH_CONFIGS``),
    comma-separated names: keep those (ValueError naming an unknown one)."""
    from xoffload.engine.modes import configurations

    cfgs = configurations()
    only = only or os.environ.get("XOFFLOAD_BENCH_CONFIGS")
    names = [x for x in (only or "").split(",") if x]
    if "offload+quest" in cfgs:
        extra = variant_configs()
        cfgs.update({k: v for k, v in extra.items() if (variants and k in VARIANTS) or k in names})
    else:
        extra = {}
    if names:
        unknown = [x for x in names if x not in cfgs]
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(dict.fromkeys([*cfgs, *extra]))}")
        cfgs = {k: v for k, v in cfgs.items() if k in names}
    return cfgs


def measured_configs(names) -> dict:
    """The configurations ``names`` (comma-separated, or a list) of a measured run, for planning
    it: :func:`all_configs` of those the library offers, then each retired one (:data:`RETIRED`)
    as its stand-in's keyword arguments. Never run: only :func:`plan` reads them. ValueError
    naming a name that is neither."""
    names = [x for x in (names.split(",") if isinstance(names, str) else names) if x]
    current = [x for x in names if x not in RETIRED]
    out = all_configs(",".join(current)) if current else {}
    out.update({x: dict(RETIRED[x]) for x in names if x in RETIRED})
    return out


def config_lengths(name: str, lengths) -> list:
    """The context lengths configuration ``name`` runs at: all of ``lengths``, except the
    page-cache variants (:data:`VARIANTS`, there for the time split; a retired one,
    :data:`RETIRED_VARIANTS`, as it ran): 32K and 128K, or the longest length when neither is
    measured."""
    if name not in VARIANTS and name not in RETIRED_VARIANTS:
        return list(lengths)
    return [n for n in lengths if n in VARIANT_LENGTHS] or [max(lengths)]


def warm_runs(configs: dict, lengths, num_layers: int) -> list:
    """The warm-up requests of a sweep, as ``(name, LLM kwargs, view layers, lengths)``: every
    length through a one-layer resident view (the dense prefill's kernels and cuDNN plans at each
    prompt length), then each configuration through its view (:func:`warm_layers`) at its first length
    (its store's kernels), or at each of its lengths with a sparse prefill (its estimate autotunes
    per length). Decode kernels take lengths on the device or unspecialised (DESIGN), so one
    length warms them; the first two decode steps are reported apart anyway."""
    from xoffload.engine.config import EngineConfig

    runs = [("resident", {"mode": "resident"}, 1, list(lengths))]
    for name, kw in configs.items():
        ns = config_lengths(name, lengths)
        sparse_prefill = not EngineConfig.from_kwargs(**kw).policy.dense
        runs.append((name, kw, warm_layers(kw, num_layers), ns if sparse_prefill else ns[:1]))
    return runs


def warm_layers(kw: dict, num_layers: int) -> int:
    """Layers of the view configuration ``kw`` warms up through: the fewest that hold a layer its
    prefill policy makes sparse and a layer its decode policy reads sparsely (1 when dense)."""
    from xoffload.engine.config import EngineConfig

    c = EngineConfig.from_kwargs(**kw)
    pre, dec = c.policy, c.decode_policy
    for k in range(1, num_layers + 1):
        try:
            if (pre.dense or pre.layers(k)) and (dec is None or dec.sparse_layers(k)):
                return k
        except ValueError:  # the policy's dense layers are outside a k-layer model
            continue
    return num_layers


def is_offload(kw: dict) -> bool:
    """Whether the configuration keeps its KV in a pinned host pool (sized by max_model_len)."""
    return kw.get("mode") == "offload"


# ---------------------------------------------------------------------------- the cap search
def all_on_gpu_bound(name, weights_bytes, kv_bytes_per_token, cap=CAP_BYTES):
    """For a store holding every token's KV on the GPU: the most tokens (cap - weights) / KV bytes
    per token could hold; None for the others."""
    return (cap - weights_bytes) // kv_bytes_per_token if name in ALL_ON_GPU else None


def longest_served(probe, n_min, n_max, step, cap_bytes, known=None, hints=None) -> dict:
    """The longest context on the grid ``n_min, n_min + step, ..., <= n_max`` that ``probe``
    serves, memory use assumed to grow with length. ``probe(n) -> (served, peak_bytes or None)``;
    ``known``: ``{n: (served, peak)}`` already measured under the cap; ``hints``: ``{n:
    peak_bytes}`` measured elsewhere (without the cap), used only to choose where to probe.

    Probes ``n_min`` (the lower end; the next grid length too while fewer than two peaks are
    known), fits peak memory linearly through the two longest points with a peak (probing half the
    predicted length first when all are shorter than that: a fit near the limit), starts at the
    grid length below where the fit reaches ``cap_bytes``, gallops from there (up while served,
    down while refused, the stride doubling) and bisects to ``step``. Returns ``longest_served``
    (0: not even ``n_min``), ``refused`` (the shortest refused length, None when the whole grid
    was served), ``predicted`` (the fit's length, None without one) and ``probed`` (in order)."""
    seen = dict(known or {})  # n -> (served, peak)
    probed = []
    last = n_min + max(0, (n_max - n_min) // step) * step
    end = last + step  # "refused" beyond the grid

    def grid(x):
        return min(last, n_min + max(0, int(x - n_min) // step) * step)

    def ask(n):
        if n not in seen:
            seen[n] = probe(n)
            probed.append(n)
        return seen[n][0]

    def bracket():
        lo = max((n for n, (ok, _) in seen.items() if ok), default=0)
        hi = min((n for n, (ok, _) in seen.items() if not ok and n > lo), default=end)
        return lo, min(hi, end)

    def predict():
        peaks = {**(hints or {}), **{n: p for n, (ok, p) in seen.items() if ok and p is not None}}
        pts = sorted(peaks.items())[-2:]
        if len(pts) < 2:
            return None, max(peaks, default=0)
        (n1, p1), (n2, p2) = pts
        return (end if p2 <= p1 else int(n2 + (cap_bytes - p2) * (n2 - n1) / (p2 - p1))), n2

    def result(pred):
        lo, hi = bracket()
        return {"longest_served": lo, "refused": hi if hi < end else None, "predicted": pred, "probed": probed}

    if not ask(n_min):
        return result(None)
    pred, longest = predict()
    if pred is None and n_min + step <= last and ask(n_min + step):
        pred, longest = predict()
    if pred is not None and grid(pred // 2) > longest and bracket()[1] == end:
        if ask(grid(pred // 2)):
            pred, longest = predict()
    lo, hi = bracket()
    if hi - lo <= step:
        return result(pred)
    guess = min(max(grid(pred) if pred is not None else lo + step, lo + step), hi - step)
    up, k = ask(guess), 1
    while True:  # gallop away from the guess until the limit is bracketed
        lo, hi = bracket()
        n = guess + k * step if up else guess - k * step
        if not lo < n < hi or ask(n) != up:
            break
        k *= 2
    while True:  # bisect
        lo, hi = bracket()
        mid = grid((lo + hi) // 2)
        if hi - lo <= step or not lo < mid < hi:
            break
        ask(mid)
    return result(pred)


# ------------------------------------------------------------------------------------ the plan
# Measured basis (one H200, 2026-12-01, commit 9c873dd; the bench code unchanged since):
# benchmarks/results/e2e_full.json (the default command with --time-budget 545: parts 8b 385.6 s
# and cap 149.3 s ran, startup_s 1.5, elapsed 538.0) and e2e_rest.json (--part qwen,smollm2,stall:
# 53.5, 56.6, 9.1 s, startup_s 1.0, elapsed 121.7). Figures per point are the JSONs' own; what
# they do not break down is named as assumed or fitted next to its constant.
MEASURED_LENGTHS = (8192, 16384, 32768, 65536, 131072)
#: Dense prefill seconds (TTFT) of the 8B shape, t(n) = a n + b n^2 (projections linear, attention
#: quadratic), least squares (relative) through resident's TTFT at 8K-128K and the cap probes'
#: at 48K, 192K and 224K (e2e_full.json): within 3% of each of the eight.
PREFILL_AB = (2.0416e-5, 5.065e-10)
PREFILL_FACTOR = {"offload+xattn": 1.07}  # its sparse prefill: 1.05-1.10x resident's TTFT at 8K-128K
#: Steady decode ms/token of the 8B shape at MEASURED_LENGTHS (None: not run there); piecewise
#: linear in between, linear beyond (e2e_full.json, decode_steady_ms_per_token). The RETIRED
#: configurations' rows are there for planning the measured runs.
DECODE_MS = {
    "offload": (26.09, 47.34, 89.83, 174.46, 344.85),
    "offload-ring": (25.32, 38.98, 77.67, 155.12, 310.37),
    "offload-uva": (26.16, 47.51, 90.69, 175.52, 340.68),
    "offload+xattn": (26.12, 47.53, 89.93, 174.45, 344.09),
    "offload+quest": (6.62, 7.37, 8.43, 9.25, 10.12),
    "offload+quest-ch": (7.03, 8.44, 9.87, 10.77, 12.02),
    "resident": (5.18, 5.57, 6.13, 7.21, 9.12),
    "resident+quest": (6.20, 6.04, 6.44, 6.58, 7.15),
    "resident+quest-ch": (6.12, 6.20, 6.85, 7.60, 8.16),
    "offload+quest-nocache": (None, None, 10.87, None, 11.43),
    "offload+quest-prefetch": (None, None, 9.99, None, 12.29),
    "offload+quest-cache2x": (None, None, 9.18, None, 10.61),
}
#: The first two decode steps (eager, capture) beyond two steady ones, s: mean of
#: decode_first_steps_ms - 2 x steady over each family's points (e2e_full.json: 0.06-0.09 s with
#: Quest's offload store, 0.00-0.15 s dense offload, ~1 ms resident).
FIRST2_S = {"offload sparse": 0.08, "offload": 0.05, "resident": 0.001}
REQUEST_S = 0.02  # host work of a point beyond TTFT and decode: wall_s - ttft - 11 x decode, 51 points: 1.0 s
#: transformers peers, 8B shape, at MEASURED_LENGTHS (e2e_full.json): TTFT s and decode ms per step
#: (the mean of its 5 steps; noisy for the GPU cache)
HF_TTFT_S = {"hf_gpu_cache": (0.328, 0.635, 1.441, 3.755, 11.831),
             "hf_offloaded_cache": (0.474, 0.879, 1.678, 3.878, 12.171)}
HF_DECODE_MS = {"hf_gpu_cache": (102.4, 101.3, 70.0, 119.3, 66.0),
                "hf_offloaded_cache": (37.3, 73.3, 146.6, 421.5, 827.9)}
HF_BUILD_S = 10.6  # batch_quick_h200.log: [gpu/hf_build] done in 10.6 s (the transformers import included)
HF_REQUEST_S = 0.05  # host work of a transformers request beyond TTFT and decode (assumed)
#: An offload LLM's construction: INIT_S + PIN_S_PER_GIB x its pinned pool, least squares through
#: the 27 offload entries of llm_init_s (16.0 GiB pools: 5.3-8.0 s; 4.5 GiB: 1.7-2.2 s; 0.18 GiB:
#: 0.07-0.10 s); a resident one's: 0.0001 s. 0.37 s/GiB is 2.7 GiB/s (fresh pages faulted in,
#: zeroed and registered), not the 10 GiB/s the first plan assumed.
INIT_S = 0.14
PIN_S_PER_GIB = 0.371
#: Unregistering and freeing a pool, s/GiB: not in the JSONs; fitted to the cap part (its time
#: beyond its probes' init, TTFT and decode, with the assumptions below), 128 GiB of pools there.
CLOSE_S_PER_GIB = 0.09
LLM_S = 0.1  # per LLM beyond that: close, gc + empty_cache, the JSON checkpoint (assumed)
REFUSE_LAYERS = 2  # a refused offload probe's OOM: in its prefill's first two layers (assumed: the
#                    layerwise prefill's activations reach full size in layer 0, the D2H overlap
#                    holds a second layer's K/V)
#: Where each cap search ends (e2e_full.json cap_24GiB: longest served); the plan's probes are
#: the search's on targets that serve exactly that. A target without one: where PEAK_GIB's line
#: reaches the cap.
CAP_LIMITS = {"resident": 49152, "offload": 229376, "offload+quest": 196608, "hf_gpu_cache": 16384,
              "hf_offloaded_cache": 49152}
#: Peak GPU memory (GiB allocated) at PEAK_LENGTHS, 8B shape, no cap (e2e_full.json): the cap
#: search's hints when the run has no uncapped points of its own (the run fits its two longest).
PEAK_LENGTHS = (65536, 131072)
PEAK_GIB = {"resident": (25.58, 34.61), "offload": (18.17, 20.26), "offload+quest": (18.82, 21.08),
            "hf_gpu_cache": (31.43, 46.71), "hf_offloaded_cache": (23.68, 31.21)}
#: Qwen3-8B shape against the 8B one at 32K (e2e_rest.json vs e2e_full.json): TTFT 1.04x, decode
#: 1.13x offload / 1.04x resident (1.10x taken); layers, KV bytes per token.
SHAPES = {"llama-3.1-8b": (32, 131072, 1.0, 1.0), "qwen3-8b": (36, 147456, 1.04, 1.10)}
#: SmolLM2-135M per configuration (e2e_rest.json, the mean over 2K-8K): TTFT s, first two steps
#: beyond two steady s, steady decode ms; a configuration without a row: resident's (the RETIRED
#: configurations' rows: for planning the measured runs).
SMOLLM2 = {"offload": (0.040, 0.086, 3.03), "offload-ring": (0.038, 0.0, 35.32), "offload-uva": (0.040, 0.078, 3.48),
           "offload+xattn": (0.108, 0.087, 3.05), "offload+quest": (0.047, 0.081, 1.77),
           "offload+quest-ch": (0.059, 0.083, 1.86), "resident": (0.030, 0.054, 1.15),
           "resident+quest": (0.038, 0.094, 1.80), "resident+quest-ch": (0.049, 0.088, 1.88),
           "offload+quest-nocache": (0.040, 0.095, 2.88), "offload+quest-prefetch": (0.053, 0.145, 2.10),
           "offload+quest-cache2x": (0.038, 0.062, 1.88)}
SMOLLM2_HF = {"hf_gpu_cache": (0.110, 142.0), "hf_offloaded_cache": (0.125, 37.3)}  # TTFT s, decode ms (2K-8K mean)
SMOLLM2_SHAPE = (30, 23040)  # layers, KV bytes per token
#: Each part's time the JSONs do not break down, s, fitted: the part's measured seconds minus all
#: of the above for its measured command (CLOSE_S_PER_GIB from the cap part). Assumed to be the
#: model (random weights on the GPU: ~1 s; the SmolLM2 GGUF: 9.6 s on a 2-core CPU), first-use
#: Triton compilation (64-wide heads first in the smollm2 part; whether the 8b part's machine had
#: a warm Triton cache is not recorded), host work between requests, transformers' first calls;
#: taken as fixed per part (it does not shrink with fewer configurations). The next run's
#: section_s / llm_close_s / probe_s records break it down.
OTHER_S = {"8b": 23.2, "qwen": 5.3, "smollm2": 38.4}
MODEL_S = 1.0  # a random 8B model on the GPU (assumed), when the cap part builds its own
STALL_S = 9.1  # e2e_rest.json part_seconds["stall"] (40 requests: 5.5 s of them)
STARTUP_S = 1.5  # startup_s: env, H2D and HBM measurements (1.5 s, 1.0 s)
REPORT_S = 1.5  # summary, plots, the final JSON: elapsed_s - startup_s - the parts (1.55 s, 1.51 s)


def prefill_s(n: int, name: str = "resident") -> float:
    """Seconds of an 8B-shape prefill of ``n`` tokens by configuration ``name``."""
    a, b = PREFILL_AB
    return PREFILL_FACTOR.get(name, 1.0) * (a * n + b * n * n)


def _interp(values, n: int, xs=MEASURED_LENGTHS) -> float:
    """A figure measured at ``xs`` (None where not), piecewise linear in ``n``, linear beyond the
    ends (never below a fifth of the nearest measured value)."""
    pts = [(x, v) for x, v in zip(xs, values) if v is not None]
    if len(pts) == 1:
        return pts[0][1]
    i = next((i for i in range(1, len(pts) - 1) if n <= pts[i][0]), len(pts) - 1)
    (x0, v0), (x1, v1) = pts[i - 1], pts[i]
    v = v0 + (v1 - v0) * (n - x0) / (x1 - x0)
    return max(v, min(v0, v1) / 5)


def _decode_key(name: str, kw: dict) -> str:
    """DECODE_MS's row for a configuration (one registered later: its mode's closest row)."""
    if name in DECODE_MS:
        return name
    if kw.get("sparse_decode") is not None:
        return "offload+quest" if is_offload(kw) else "resident+quest"
    return "offload" if is_offload(kw) else "resident"


def decode_ms(name: str, kw: dict, n: int) -> float:
    """Steady decode ms/token of configuration ``name`` at context ``n``, 8B shape."""
    return _interp(DECODE_MS[_decode_key(name, kw)], n)


def first2_s(kw: dict) -> float:
    """The first two decode steps' cost beyond two steady ones (:data:`FIRST2_S`)."""
    if not is_offload(kw):
        return FIRST2_S["resident"]
    return FIRST2_S["offload sparse" if kw.get("sparse_decode") is not None else "offload"]


def pool_gib(tokens: int, kv_bytes_per_token: int) -> float:
    return tokens * kv_bytes_per_token / 2**30


def llm_s(kw: dict, tokens: int, kv_bytes_per_token: int, frac: float = 1.0, pools: set | None = None) -> dict:
    """Seconds of an LLM's construction (``init``: its pinned pool) and release (``close``), for
    ``tokens`` tokens of ``kv_bytes_per_token`` (``frac``: the share of layers a view holds).
    ``pools``: the pool sizes registered before in this part (bench_e2e's sweeps reuse their
    slabs, :func:`xoffload.runtime.reuse_pinned_slabs`): a pool of one of them is neither pinned
    nor unregistered (the size is added); None: every pool fresh."""
    if not is_offload(kw):
        return {"init": 0.0, "close": LLM_S}
    g = pool_gib(tokens, kv_bytes_per_token) * frac
    if pools is not None:
        if g in pools:
            return {"init": INIT_S, "close": LLM_S}
        pools.add(g)
        return {"init": INIT_S + PIN_S_PER_GIB * g, "close": LLM_S}  # unregistered at the part's end
    return {"init": INIT_S + PIN_S_PER_GIB * g, "close": LLM_S + CLOSE_S_PER_GIB * g}


def point_s(name, kw, n, n_new, shape="llama-3.1-8b", frac=1.0) -> dict:
    """Seconds of one request at context ``n`` of ``n_new`` tokens: ``prefill`` (TTFT and the
    request's host work) and ``decode``; ``frac``: a view's share of the layers."""
    _, _, ps, ds = SHAPES[shape]
    steps = n_new - 1
    dec = ds * decode_ms(name, kw, n) * 1e-3
    return {"prefill": REQUEST_S + frac * ps * prefill_s(n, name),
            "decode": frac * steps * dec + first2_s(kw) * min(2, steps) / 2}


def hf_point_s(cache: str, n: int, n_new: int) -> float:
    """Seconds of a transformers request at context ``n`` of ``n_new`` tokens, 8B shape (TTFT as
    its measured ratio to ours, interpolated; decode piecewise linear)."""
    ratio = _interp([t / prefill_s(x) for t, x in zip(HF_TTFT_S[cache], MEASURED_LENGTHS)], n)
    return HF_REQUEST_S + ratio * prefill_s(n) + (n_new - 1) * _interp(HF_DECODE_MS[cache], n) * 1e-3


def _add(out: dict, d: dict, prefix: str = "") -> None:
    for k, v in d.items():
        out[prefix + k] = out.get(prefix + k, 0.0) + v


def _plan_sweep(preset, lengths, configs, peers, hf_new, fresh_pools) -> dict:
    """The seconds of :func:`bench_e2e.part_model` by kind: the warm-up views, then per
    configuration one LLM (``init``, ``close``) and a point per length (``prefill``, ``decode``),
    then the transformers peers, plus the part's :data:`OTHER_S`."""
    num_layers, kvt, _, _ = SHAPES[preset]
    part = "8b" if preset == "llama-3.1-8b" else "qwen"
    pools = None if fresh_pools else set()
    out = {"other": OTHER_S[part], "warm-up": 0.0, "init": 0.0, "close": 0.0, "prefill": 0.0, "decode": 0.0,
           "peers": 0.0}
    for name, kw, k, ns in warm_runs(configs, lengths, num_layers):
        frac = k / num_layers
        out["warm-up"] += sum(llm_s(kw, max(ns) + 64, kvt, frac, pools).values()) + sum(
            sum(point_s(name, kw, n, WARM_NEW, preset, frac).values()) for n in ns)
    for name, kw in configs.items():
        ns = config_lengths(name, lengths)
        _add(out, llm_s(kw, max(ns) + 64, kvt, 1.0, pools))
        for n in ns:
            _add(out, point_s(name, kw, n, N_NEW, preset))
    if pools:
        out["close"] += CLOSE_S_PER_GIB * sum(pools)  # the part's end: every size registered, once
    if peers:
        out["peers"] = HF_BUILD_S + hf_point_s("hf_gpu_cache", 4096, hf_new["hf_gpu_cache"]) + sum(
            hf_point_s(c, n, hf_new[c]) for c in HF_CACHES for n in lengths)
    return out


def _plan_smollm2(configs, hf_new, fresh_pools, lengths=(2048, 4096, 8192)) -> dict:
    """Seconds of the SmolLM2 part: tiny prefills; decode, LLMs and the part's :data:`OTHER_S`
    (the GGUF, first-use compilation for its 64-wide heads) dominate."""
    num_layers, kvt = SMOLLM2_SHAPE

    def req(c, kw, n_new, frac=1.0):
        ttft, first2, steady = SMOLLM2.get(c, SMOLLM2["resident"])
        steps = n_new - 1
        return REQUEST_S + frac * (ttft + steps * steady * 1e-3) + first2 * min(2, steps) / 2

    pools = None if fresh_pools else set()
    warm = sum(sum(llm_s(kw, max(ns) + 64, kvt, k / num_layers, pools).values())
               + sum(req(c, kw, WARM_NEW, k / num_layers) for _ in ns) for c, kw, k, ns in warm_runs(configs, lengths, num_layers))
    ours = sum(sum(llm_s(kw, max(config_lengths(c, lengths)) + 64, kvt, 1.0, pools).values())
               + sum(req(c, kw, N_NEW) for _ in config_lengths(c, lengths)) for c, kw in configs.items())
    ours += CLOSE_S_PER_GIB * sum(pools or ())

    def hf(c, n_new):
        ttft, dec = SMOLLM2_HF[c]
        return HF_REQUEST_S + ttft + (n_new - 1) * dec * 1e-3

    peers = hf("hf_gpu_cache", hf_new["hf_gpu_cache"]) + sum(len(lengths) * hf(c, hf_new[c]) for c in HF_CACHES)
    return {"other": OTHER_S["smollm2"], "warm-up": warm, "ours": ours, "peers": peers}


def _plan_search(name: str, cap_max: int, step: int) -> float:
    """Seconds of the cap part's work for target ``name``: its 128K record if it has one, and the
    probes :func:`longest_served` makes on a target serving up to :data:`CAP_LIMITS` (else what
    PEAK_GIB's line keeps under the cap), hinted by PEAK_GIB; each probe
    costed as a request in an LLM of its own, a refused one as its pool and the first
    REFUSE_LAYERS layers of its prefill (resident: refused at construction; transformers: its
    whole prefill, assumed)."""
    num_layers, kvt = SHAPES["llama-3.1-8b"][:2]
    kw = CAP_TARGETS.get(name, {})
    bound = all_on_gpu_bound(name, WEIGHTS_8B, kvt)
    spent = []

    def peak(n):
        return _interp(PEAK_GIB[name], n, PEAK_LENGTHS) * 2**30

    limit = CAP_LIMITS.get(name)

    def probe(n, n_new=PROBE_NEW):
        ok = n <= limit if limit is not None else peak(n) <= CAP_BYTES
        if name in HF_CACHES:
            spent.append(LLM_S + (hf_point_s(name, n, n_new) if ok else HF_REQUEST_S + hf_point_s(name, n, 1)))
        elif ok:
            spent.append(sum(llm_s(kw, n + 64, kvt).values()) + sum(point_s(name, kw, n, n_new).values()))
        elif is_offload(kw):
            spent.append(sum(llm_s(kw, n + 64, kvt).values()) + REFUSE_LAYERS / num_layers * prefill_s(n, name))
        else:
            spent.append(LLM_S)
        return ok, (peak(n) if ok else None)

    known = {131072: probe(131072, N_NEW)} if name in CAP_RECORD_128K else None
    longest_served(lambda n: probe(n) if bound is None or n <= bound else (False, None), step, cap_max, step,
                   CAP_BYTES, known, {n: peak(n) for n in PEAK_LENGTHS})
    return sum(spent)


def _plan_cap(cap_max, step, peers, shared) -> dict:
    """Seconds of the cap part: the model and transformers view (none when ``shared`` from the 8b
    part), then every target's search (:func:`_plan_search`)."""
    out = {"model": 0.0 if shared else MODEL_S + (HF_BUILD_S if peers else 0.0)}
    for name in list(CAP_TARGETS) + (list(HF_CACHES) if peers else []):
        out[name] = _plan_search(name, cap_max, step)
    return out


def hf_steps(hf_new=None) -> dict:
    """transformers' tokens per request by cache: :data:`HF_NEW`, or ``hf_new`` (an int: every
    cache; a dict: those caches)."""
    if hf_new is None:
        return dict(HF_NEW)
    if isinstance(hf_new, int):
        return {c: hf_new for c in HF_CACHES}
    return {**HF_NEW, **hf_new}


def plan(parts, lengths, configs, peers=True, cap_max=CAP_MAX, cap_step=CAP_STEP, hf_new=None,
         fresh_pools=False) -> dict:
    """Estimated seconds per part, by kind: ``{part: {kind: seconds}}``, with ``startup`` first and
    ``report`` last (the basis: the constants above). ``hf_new``: transformers' tokens per request
    (:func:`hf_steps`); ``fresh_pools``: every LLM pins a pool of its own (``--fresh-pools``; the
    measured runs of 2026-12-01 did). CPU only: nothing runs."""
    hf_new = hf_steps(hf_new)
    out = {"startup": {"startup": STARTUP_S}}
    for p in PARTS:
        if p not in parts:
            continue
        if p == "8b":
            out[p] = _plan_sweep("llama-3.1-8b", lengths, configs, peers, hf_new, fresh_pools)
        elif p == "qwen":
            out[p] = _plan_sweep("qwen3-8b", [32768], configs, False, hf_new, fresh_pools)
        elif p == "smollm2":
            out[p] = _plan_smollm2(configs, hf_new, fresh_pools)
        elif p == "cap":
            out[p] = _plan_cap(cap_max, cap_step, peers, shared="8b" in parts)
        elif p == "stall":
            out[p] = {"stall": STALL_S}
    out["report"] = {"report": REPORT_S}
    return out


def plan_seconds(p: dict) -> dict:
    """``{part: total seconds}`` of a :func:`plan`, plus ``"total"``."""
    tot = {k: sum(v.values()) for k, v in p.items()}
    tot["total"] = sum(tot.values())
    return tot


def print_plan(p: dict) -> None:
    """A :func:`plan` as a table: seconds per part and what they are made of."""
    rows = [{"part": k, "seconds": sum(v.values()),
             "what": ", ".join(f"{a} {b:.0f}" for a, b in v.items() if b >= 0.5)} for k, v in p.items()]
    rows.append({"part": "total", "seconds": plan_seconds(p)["total"], "what": ""})
    print(fmt_table(rows, ["part", "seconds", "what"]))
