"""Which layers Quest should keep dense on a model: per sparse layer, the attention its min/max page
selection loses over an oracle's (:func:`xoffload.sparse.quest_calibrate.calibrate_dense_layers`), on
calibration prompts recorded by ``tools/diag_quest.py`` (needle prompts of
``xoffload.evals.needle``, not the RULER tasks the policy is evaluated on) or
``tools/diag_quest_ruler.py --cache``.

Usage: ``PYTHONPATH=$PWD python tools/calibrate_quest_layers.py SPEC[,SPEC...] [--budget 512]
[--extra 4] [--out benchmarks/results/quest_layers_smollm2.json]``; a SPEC is a ``.pt`` record or
``needle:LENGTH:SEED:DEPTH`` (recorded now with ``diag_quest.record``, 12 greedy steps, cached in
``/tmp/quest_cal_needle_LENGTH_SEED_DEPTH.pt``). The figures in
``benchmarks/results/quest_layers_smollm2.json`` come from ``needle:2048:0:0.5,needle:4096:1:0.3``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from xoffload.sparse.quest import QuestDecode
from xoffload.sparse.quest_calibrate import calibrate_dense_layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("records", help="comma-separated .pt records (q [S, L, Hq, D], k [L, N, Hkv, D], T, scale)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--extra", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    paths = args.records.split(",")
    recs = []
    for i, p in enumerate(paths):
        if p.startswith("needle:"):
            sys.path.insert(0, os.path.dirname(__file__))
            import diag_quest

            _, length, seed, depth = p.split(":")
            cache = f"/tmp/quest_cal_needle_{length}_{seed}_{depth}.pt"
            if not os.path.exists(cache):
                diag_quest.record(argparse.Namespace(length=int(length), seed=int(seed), depth=float(depth),
                                                     steps=12, cache=cache))
            p = cache
        r = torch.load(p)
        recs.append(dict(q=r["q"], k=r["k"], T=r["T"], scale=r.get("scale")))
    pol = QuestDecode(token_budget=args.budget, page_size=args.page)
    dense, excess = calibrate_dense_layers(recs, pol, args.extra)
    ranked = sorted(excess, key=lambda i: -excess[i])
    print(f"budget {args.budget} page {args.page}, {len(recs)} prompts (T = {[int(r['T']) for r in recs]})")
    print("layers by lost attention over the oracle:", ", ".join(f"L{i}:{excess[i]:.3f}" for i in ranked[:12]))
    print(f"dense_layers with {args.extra} extra: {dense}  (mode suffix /dense={'.'.join(map(str, dense))})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(records=paths, T=[int(r["T"]) for r in recs], budget=args.budget, page=args.page,
                           extra=args.extra, dense_layers=list(dense),
                           excess={str(i): excess[i] for i in ranked}), fh, indent=1)


if __name__ == "__main__":
    main()
