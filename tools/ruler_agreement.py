"""Greedy agreement with the reference mode over the first N generated tokens, per task and mode,
from an ``xoffload eval`` result (``ruler.json``).

A sample agrees over N tokens when its first N generated ids equal the reference's (both stop
earlier and are equal up to there: agreement too). Prints, per mode and task, the share of
samples that agree over N tokens and the mean agreeing prefix (tokens before the first difference,
capped at N). With ``--into`` the figures are added to the JSON under ``"agreement_first_n"``.

Usage: ``python tools/ruler_agreement.py OUT/ruler.json [--tokens 64] [--into FILE.json]``.
"""
from __future__ import annotations

import argparse
import json


def prefix_agreement(a: list, b: list, n: int) -> int:
    """Tokens (<= n) before ``a`` and ``b`` first differ; ``n`` (or the shorter length when both
    stopped equal) when they do not."""
    m = min(len(a), len(b), n)
    for i in range(m):
        if a[i] != b[i]:
            return i
    return n if len(a) == len(b) or m == n else m


def agreement(records: list, ref: str, n: int) -> dict:
    """``{mode: {task: {"agree_frac", "mean_prefix", "samples"}}}`` against mode ``ref``."""
    key = lambda r: (r["task"], r["length"], r["index"], r.get("sample"))  # noqa: E731
    refs = {key(r): r for r in records if r["mode"] == ref}
    acc: dict = {}
    for r in records:
        a = refs.get(key(r))
        if r["mode"] == ref or a is None:
            continue
        ids, rids = r["generated_ids"], a["generated_ids"]
        p = prefix_agreement(ids, rids, n)
        full = p == n or (p == len(ids) == len(rids))
        d = acc.setdefault(r["mode"], {}).setdefault(r["task"], {"agree": 0, "prefix": 0, "samples": 0})
        d["agree"] += full
        d["prefix"] += p
        d["samples"] += 1
    return {m: {t: {"agree_frac": d["agree"] / d["samples"], "mean_prefix": d["prefix"] / d["samples"],
                    "samples": d["samples"]} for t, d in ts.items()} for m, ts in acc.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--into", default=None)
    args = ap.parse_args()
    with open(args.result) as fh:
        res = json.load(fh)
    ref = res["modes"][0]
    ag = agreement(res["records"], ref, args.tokens)
    print(f"greedy agreement with {ref} over the first {args.tokens} tokens (share of samples; mean agreeing prefix)")
    for m, ts in ag.items():
        print(f"  {m}: " + ", ".join(f"{t} {100 * d['agree_frac']:.0f}% ({d['mean_prefix']:.1f} tok, n={d['samples']})"
                                     for t, d in ts.items()))
    if args.into:
        with open(args.into) as fh:
            out = json.load(fh)
        out["agreement_first_n"] = {"tokens": args.tokens, "reference": ref, "by_mode": ag}
        with open(args.into, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
