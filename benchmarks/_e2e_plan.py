"""What ``bench_e2e.py`` runs where and how long it takes, without a GPU: the run's constants, the
configurations and lengths of a sweep, its warm-up requests, the cap part's search for the longest
context served, and the time plan (``bench_e2e.py --plan``) from the figures measured before.

- :func:`all_configs`, :func:`config_lengths`, :func:`warm_runs`, :func:`warm_layers`: which
  configuration runs at which length, and what warms it up first;
- :func:`longest_served`: the cap search (probe the lower end, fit peak memory against length,
  start where the fit reaches the cap, gallop, bisect to the grid);
- :func:`plan`, :func:`plan_seconds`, :func:`print_plan`: estimated seconds per part, by kind,
  from PREFILL_S, DECODE_MS, PEAK_GIB and the assumptions named next to them.
"""
from __future__ import annotations

import os

from _common import fmt_table

CAP_BYTES = 24 * 2**30
N_NEW = 12  # tokens per point: 1 from prefill, 2 warm-up/capture steps, 9 steady steps
WARM_NEW = 3  # warm-up requests: prefill, the eager step, the capture
HF_NEW = 6  # transformers: 1 from prefill + 5 decode steps
PROBE_NEW = 4  # cap probes: prefill, eager step, capture, one replay
CAP_STEP = 16384
CAP_MAX = 524288
PARTS = ("8b", "cap", "qwen", "smollm2", "stall")  # the order they run in
PART_KEYS = {"8b": "8b_part", "cap": "cap_24GiB", "qwen": "qwen3_8b_part", "smollm2": "smollm2_part",
             "stall": "stall"}  # where each part's outcome goes in res["results"]
VARIANTS = ("offload+quest-nocache", "offload+quest-prefetch", "offload+quest-cache2x")
VARIANT_LENGTHS = (32768, 131072)
CAP_TARGETS = {"resident": {"mode": "resident"}, "offload": {"mode": "offload"},
               "offload+quest": {"mode": "offload", "sparse_decode": "quest"}}
CAP_RECORD_128K = ("resident", "offload+quest")  # the 128K decode under the cap (README claims)
HF_CACHES = {"hf_gpu_cache": False, "hf_offloaded_cache": True}  # name -> offloading
ALL_ON_GPU = ("resident", "hf_gpu_cache")  # KV of every token on the GPU: (cap - weights) / KV bytes bound


# ------------------------------------------------------------------------------ what runs where
def all_configs(only: str | None = None) -> dict:
    """The library's configurations, plus offload+quest without its GPU page cache, with the
    next-layer prefetch, and with a 116-page cache (2x the 8B shape's pages per step): what each
    buys; the fetch share of the time split. ``only`` (``--configs``; default the env
    ``XOFFLOAD_BENCH_CONFIGS``), comma-separated names: keep those (ValueError naming an unknown one)."""
    from xoffload.engine.modes import configurations
    from xoffload.sparse import QuestDecode

    cfgs = configurations()
    if "offload+quest" in cfgs:
        cfgs["offload+quest-nocache"] = {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=0)}
        cfgs["offload+quest-prefetch"] = {"mode": "offload", "sparse_decode": QuestDecode(prefetch=True)}
        cfgs["offload+quest-cache2x"] = {"mode": "offload", "sparse_decode": QuestDecode(cache_pages=116)}
    only = only or os.environ.get("XOFFLOAD_BENCH_CONFIGS")
    if only:
        names = [x for x in only.split(",") if x]
        unknown = [x for x in names if x not in cfgs]
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(cfgs)}")
        cfgs = {k: v for k, v in cfgs.items() if k in names}
    return cfgs


def config_lengths(name: str, lengths) -> list:
    """The context lengths configuration ``name`` runs at: all of ``lengths``, except the
    page-cache variants (:data:`VARIANTS`, there for the time split): 32K and 128K, or the longest
    length when neither is measured."""
    if name not in VARIANTS:
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
#: Prefill seconds (TTFT) at 32K and 128K tokens, 8B shape; fitted to t(n) = a n + b n^2
#: (projections linear, attention quadratic). ours: e2e.json 8b/resident; hf: model.json
#: hf_gpu_cache (24092 / 11148 tok/s).
PREFILL_S = {"ours": (1.183, 10.955), "hf": (1.360, 11.757)}
#: Steady decode ms/token at 32K and 128K, 8B shape (linear in between and beyond): e2e.json,
#: README "Measured" for today's page-cache settings, model.json for transformers.
DECODE_MS = {"resident": (5.96, 8.89), "resident+quest": (6.15, 6.83), "offload": (89.6, 343.5),
             "offload-uva": (89.1, 340.3), "offload-ring": (82.9, 311.4), "offload+xattn": (89.6, 344.1),
             "offload+quest": (8.13, 9.95), "offload+quest-nocache": (10.85, 11.56),
             "offload+quest-prefetch": (11.04, 12.92), "offload+quest-cache2x": (9.11, 10.49),
             "hf_gpu_cache": (29.9, 73.1), "hf_offloaded_cache": (99.3, 685.3)}
#: Peak GPU memory (GiB allocated) at 32K and 128K, 8B shape, no cap: e2e.json, model.json. The
#: plan's guess of where each cap search ends (the run fits its own probes instead).
PEAK_GIB = {"resident": (20.6, 34.1), "offload": (16.7, 19.7), "offload+quest": (17.6, 21.0),
            "hf_gpu_cache": (22.8, 45.7), "hf_offloaded_cache": (18.9, 30.2)}
#: SmolLM2-135M (e2e_smollm2.json, 8K, the slowest of 2K-8K): steady decode ms/token; others 5 ms
SMOLLM2_DECODE_MS = {"offload-ring": 46.3, "hf_gpu_cache": 127.4, "hf_offloaded_cache": 33.8}
SMOLLM2_PREFILL_S = 0.2  # TTFT at 8K: <= 0.19 s (transformers' offloaded cache), ours <= 0.12 s
#: registering + releasing fresh pinned host memory, s/GiB: assumed ~10 GiB/s (a public
#: cudaHostRegister figure is 60 ms per fresh GB; cudaMallocHost is slower). The run records each
#: LLM's construction time in ``llm_init_s`` to check it.
PIN_S_PER_GIB = 0.1
INIT_S = 0.3  # an LLM's construction and close, besides pinning (assumed)
REQUEST_S = 0.1  # host work of one request: prompt ids built and checked, tensors, bookkeeping (assumed)
CAPTURE_S = 0.1  # the capture step beyond a steady step (e2e.json first two steps - 2 x steady: <= 0.13 s)
REFUSE_S = 1.0  # a refused cap probe: its OOM at a large allocation (assumed)
MODEL_S = {"llama-3.1-8b": 5.0, "qwen3-8b": 5.0, "smollm2": 5.0}  # random init / GGUF load (assumed)
HF_BUILD_S = 10.6  # batch_quick_h200.log: [gpu/hf_build] done in 10.6 s (transformers import included)
STALL_S = 10.0  # e2e_stall.json: 40 requests 4.7 s in all, plus warm-up, the 1B model, its LLM
STARTUP_S = 15.0  # imports, env, H2D and HBM measurements (assumed)
COMPILE_S = 30.0  # first-use Triton compilation on a cold cache, whole run (a guess)
SHAPES = {"llama-3.1-8b": (32, 131072, 1.0), "qwen3-8b": (36, 147456, 36 / 32)}  # layers, KV B/token, time scale
WEIGHTS_8B = 16060522496  # bytes (e2e.json models/8b)


def _quad(lo_hi, n: int) -> float:
    """Seconds at ``n`` tokens of a prefill measured at 32K and 128K (``lo_hi``), as a n + b n^2."""
    x = 32768
    t1, t4 = lo_hi
    bx2 = (t4 - 4 * t1) / 12  # t1 = a x + b x^2, t4 = 4 a x + 16 b x^2
    ax = t1 - bx2
    r = n / x
    return ax * r + bx2 * r * r


def _lin(lo_hi, n: int) -> float:
    """A figure measured at 32K and 128K (``lo_hi``), linear in ``n``, at ``n`` (never below a
    fifth of the 32K figure)."""
    a, b = lo_hi
    return max(a / 5, a + (b - a) * (n - 32768) / 98304)


def _decode_key(name: str, kw: dict) -> str:
    """DECODE_MS's row for a configuration (one registered later: its mode's closest row)."""
    if name in DECODE_MS:
        return name
    if kw.get("sparse_decode") is not None:
        return "offload+quest" if is_offload(kw) else "resident+quest"
    return "offload" if is_offload(kw) else "resident"


def pin_s(tokens: int, kv_bytes_per_token: int) -> float:
    """Seconds to pin and release a host pool of ``tokens`` tokens."""
    return tokens * kv_bytes_per_token / 2**30 * PIN_S_PER_GIB


def _plan_point(name, kw, n, n_new, scale=1.0, num_layers_run=None, num_layers=32) -> float:
    """Seconds of one request at context ``n`` (prefill + decode + host work), 8B shape scaled by
    ``scale``, through ``num_layers_run`` of ``num_layers`` layers (a warm-up view)."""
    frac = (num_layers_run or num_layers) / num_layers
    dec = _lin(DECODE_MS[_decode_key(name, kw)], n) * 1e-3
    return REQUEST_S + frac * scale * (_quad(PREFILL_S["ours"], n) + (n_new - 1) * dec) + CAPTURE_S


def _plan_sweep(preset, lengths, configs, peers) -> dict:
    """The seconds of :func:`part_model` by kind (its structure: warm-up views, then per
    configuration one LLM and a point per length, then the peers)."""
    num_layers, kvt, scale = SHAPES[preset]
    out = {"model": MODEL_S[preset], "warm-up": 0.0, "pin+init": 0.0, "prefill": 0.0, "decode": 0.0, "peers": 0.0}
    for name, kw, k, ns in warm_runs(configs, lengths, num_layers):
        pool = pin_s(max(ns) + 64, kvt) * k / num_layers if is_offload(kw) else 0.0
        out["warm-up"] += INIT_S + pool + sum(_plan_point(name, kw, n, WARM_NEW, scale, k, num_layers) for n in ns)
    for name, kw in configs.items():
        ns = config_lengths(name, lengths)
        out["pin+init"] += INIT_S + (pin_s(max(ns) + 64, kvt) if is_offload(kw) else 0.0)
        for n in ns:
            out["prefill"] += scale * _quad(PREFILL_S["ours"], n) + REQUEST_S
            out["decode"] += scale * (N_NEW - 1) * _lin(DECODE_MS[_decode_key(name, kw)], n) * 1e-3 + CAPTURE_S
    if peers:
        out["peers"] = HF_BUILD_S + _quad(PREFILL_S["hf"], 4096) + sum(
            _quad(PREFILL_S["hf"], n) + (HF_NEW - 1) * _lin(DECODE_MS[c], n) * 1e-3 + REQUEST_S
            for c in HF_CACHES for n in lengths)
    return out


def _plan_smollm2(configs) -> dict:
    """Seconds of the SmolLM2 part: tiny prefills; decode and host work per point dominate."""
    def req(c, n_new):
        return REQUEST_S + SMOLLM2_PREFILL_S + CAPTURE_S + (n_new - 1) * SMOLLM2_DECODE_MS.get(c, 5.0) * 1e-3

    lengths = (2048, 4096, 8192)
    warm = sum(INIT_S + len(ns) * req(c, WARM_NEW) for c, _, _, ns in warm_runs(configs, lengths, 30))
    ours = warm + sum(INIT_S + sum(req(c, N_NEW) for _ in config_lengths(c, lengths)) for c in configs)
    hf = 2.0 + sum(len(lengths) * req(c, HF_NEW) for c in HF_CACHES)
    return {"model": MODEL_S["smollm2"], "ours": ours, "peers": hf}


def _plan_search(name: str, cap_max: int, step: int) -> float:
    """Seconds of the cap part's work for target ``name``: its 128K record if it has one, and the
    probes :func:`longest_served` makes when the target serves what PEAK_GIB's straight line
    (through 32K and 128K) keeps under the cap; each probe costed as a request."""
    kvt = SHAPES["llama-3.1-8b"][1]
    kw = CAP_TARGETS.get(name, {})
    bound = all_on_gpu_bound(name, WEIGHTS_8B, kvt)
    spent = []

    def peak(n):
        return _lin(PEAK_GIB[name], n) * 2**30

    def probe(n, n_new=PROBE_NEW):
        pool = pin_s(n + 64, kvt) if is_offload(kw) else 0.0
        if peak(n) > CAP_BYTES:
            spent.append(REFUSE_S + pool)
            return False, None
        if name in HF_CACHES:
            spent.append(_quad(PREFILL_S["hf"], n) + (n_new - 1) * _lin(DECODE_MS[name], n) * 1e-3 + REQUEST_S)
        else:
            spent.append(INIT_S + pool + _plan_point(name, kw, n, n_new))
        return True, peak(n)

    known = {131072: probe(131072, N_NEW)} if name in CAP_RECORD_128K else None
    longest_served(lambda n: probe(n) if bound is None or n <= bound else (False, None), step, cap_max, step,
                   CAP_BYTES, known, {n: peak(n) for n in (32768, 131072)})
    return sum(spent)


def _plan_cap(cap_max, step, peers, shared) -> dict:
    """Seconds of the cap part: the model and transformers view (none when ``shared`` from the 8b
    part), then every target's search (:func:`_plan_search`)."""
    out = {"model": 0.0 if shared else MODEL_S["llama-3.1-8b"] + (HF_BUILD_S if peers else 0.0)}
    for name in list(CAP_TARGETS) + (list(HF_CACHES) if peers else []):
        out[name] = _plan_search(name, cap_max, step)
    return out


def plan(parts, lengths, configs, peers=True, cap_max=CAP_MAX, cap_step=CAP_STEP) -> dict:
    """Estimated seconds per part, by kind: ``{part: {kind: seconds}}``, with ``startup`` and
    ``compile`` first (see the module docstring for the basis). CPU only: nothing runs."""
    out = {"startup": {"startup": STARTUP_S}, "compile": {"compile": COMPILE_S}}
    for p in PARTS:
        if p not in parts:
            continue
        if p == "8b":
            out[p] = _plan_sweep("llama-3.1-8b", lengths, configs, peers)
        elif p == "qwen":
            out[p] = _plan_sweep("qwen3-8b", [32768], configs, False)
        elif p == "smollm2":
            out[p] = _plan_smollm2(configs)
        elif p == "cap":
            out[p] = _plan_cap(cap_max, cap_step, peers, shared="8b" in parts)
        elif p == "stall":
            out[p] = {"stall": STALL_S}
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
