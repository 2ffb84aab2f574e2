"""Where Quest decode loses RULER's needles on SmolLM2 (CPU, fp32): one RULER-style sample, dense
vs Quest, teacher-forced on the dense answer. Quest runs through the store the engine serves
``mode="resident"`` with a QuestDecode with (:class:`diag_quest.StoreKV`: the batched Quest store
over a pool on the model's device, here the CPU).

For a sample of ``--task`` at ``--length`` (xoffload.evals.tasks.build), prints:

* the prompt layout: tokens, where the needle's value lies, the plan (sink, tail, candidates, k);
* dense greedy answer, then Quest's answer teacher-forced on the dense tokens: the first step whose
  argmax differs (step 0 is the prefill's, always dense);
* per sparse layer, over the answer steps: the attention mass the dense heads put on the needle's
  value tokens and whether Quest's selection holds the page with most of it ("needle recall"),
  for the scoring variants of :func:`xoffload.sparse.quest.page_scores`.

Usage: ``PYTHONPATH=$PWD python tools/diag_quest_ruler.py --task niah_single_2 --length 4096
--sample 0 [--budget 512] [--page 32] [--steps 10] [--cache REC.pt --record-only]``.

Replay (decode only, from recorded prefills: seconds per variant instead of a 4K prefill each):
``... diag_quest_ruler.py --replay REC.pt[,REC.pt] --variants '[{"token_budget": 512}, {"token_budget":
512, "dense_layers": [0, 1, 8, 15, 18, 19]}]' [--steps 12] [--out FILE.json]`` greedy-decodes each
record under each ``QuestDecode(**variant)`` after the recorded (dense) prefill's K/V and first token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import xoffload  # noqa: E402
from diag_quest import RecordKV, StoreKV, load  # noqa: E402
from xoffload.sparse.quest import QuestDecode, page_scores  # noqa: E402


def value_span(tok, ids, value):
    """Token positions [a, b) of ``value``'s last occurrence before the question (the needle)."""
    best = None
    for cand in (tok.encode(value, add_special_tokens=False), tok.encode(" " + value, add_special_tokens=False)):
        n = len(cand)
        for i in range(len(ids) - n):
            if ids[i:i + n] == cand:
                best = (i, i + n) if best is None or i < best[0] else best
    return best


def teacher_forced(m, ids, kv, toks):
    """argmax of each step's logits when the model is fed ``toks`` (step 0: prefill)."""
    T = len(ids)
    logits = m.prefill(torch.tensor(ids), kv)
    out = [int(logits[-1].argmax())]
    for i in range(len(toks) - 1):
        kv.begin_step(T + i)
        lg = m.decode_step(torch.tensor([toks[i]]), T + i, kv)
        kv.end_step()
        out.append(int(lg[-1].argmax()))
    return out


def replay(m, rec, pol, n):
    """Greedy tokens (``n``, the first being the recorded prefill's) of the resident Quest store
    (:class:`diag_quest.StoreKV`) under ``pol`` whose prompt K/V are the record's (no prefill)."""
    T = rec["T"]
    kv = StoreKV(m, pol, rec["ids"], n)
    try:
        for layer in range(m.cfg.num_layers):
            kb, vb = kv.buffers(layer, T)
            kb.copy_(rec["k"][layer, :T])
            vb.copy_(rec["v"][layer, :T])
            kv.done(layer, kb, vb)
        toks = [rec["dense"][0]]
        for i in range(n - 1):
            kv.begin_step(T + i)
            lg = m.decode_step(torch.tensor([toks[-1]]), T + i, kv)
            kv.end_step()
            toks.append(int(lg[-1].argmax()))
    finally:
        kv.close()
    return toks


def run_replays(args):
    m = load()
    tok = m.tokenizer
    out = []
    for path in args.replay.split(","):
        rec = torch.load(path)
        dense = rec["dense"][:args.steps]
        refs = rec.get("outputs", [])
        print(path, "dense", repr(tok.decode(dense)), refs)
        for v in json.loads(args.variants):
            with xoffload.kernels.cpu_backend("reference"), torch.no_grad():
                t = replay(m, rec, QuestDecode(**v), min(args.steps, len(dense)))
            fd = next((i for i, (a, b) in enumerate(zip(dense, t)) if a != b), None)
            txt = tok.decode(t)
            ok = bool(refs) and all(r in txt for r in refs)
            print(f"  {json.dumps(v):70s} answer={ok} first_diff={fd} {txt!r}")
            out.append(dict(record=path, task=rec.get("task"), sample=rec.get("sample"), variant=v, answer_found=ok,
                            first_diff=fd, text=txt, dense=tok.decode(dense)))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group", default="max")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache", default=None, help="save the dense run (ids, K, V, decode queries) to this .pt")
    ap.add_argument("--record-only", action="store_true", help="with --cache: stop after the dense run")
    ap.add_argument("--replay", default=None, help="comma-separated records (--cache) to replay")
    ap.add_argument("--variants", default='[{"token_budget": 512}]', help="JSON list of QuestDecode kwargs")
    args = ap.parse_args()
    if args.replay:
        return run_replays(args)
    from xoffload.evals.tasks import build
    m = load()
    tok = m.tokenizer
    s = build(args.task, tok, args.length, args.sample)
    ids = list(s.token_ids)
    T = len(ids)
    span = value_span(tok, ids, s.outputs[0])
    pol = QuestDecode(token_budget=args.budget, page_size=args.page, recent_tokens=args.recent,
                      group_score=args.group)
    plan = pol.plan(T)
    tail_text = tok.decode(ids[plan.tail_start:])
    print(f"{args.task} L={args.length} sample {args.sample}: T={T} value {s.outputs[0]!r} at tokens {span} "
          f"(page {span[0] // args.page if span else None}); plan: sink {plan.sink_len}, tail [{plan.tail_start}, {T}) "
          f"= {T - plan.tail_start} tokens, {plan.num_candidates} candidates, k={plan.pages_per_step}")
    q_start = ids.index(tok.encode("What", add_special_tokens=False)[0], T - 200)  # the NIAH question
    print(f"question starts at token {q_start} ({T - q_start} tokens before the end); tail text: {tail_text[:120]!r}...")
    n = args.steps
    with xoffload.kernels.cpu_backend("reference"), torch.no_grad():
        rec = RecordKV(m.cfg, T, n, m.scale)
        from diag_quest import greedy
        dense = greedy(m, torch.tensor(ids), rec, n)
        if args.cache:
            torch.save(dict(ids=ids, k=rec.k, v=rec.v, q=torch.stack(rec.q), dense=dense, span=span, T=T,
                            scale=m.scale, hq=m.cfg.num_heads, hkv=m.cfg.num_kv_heads, outputs=s.outputs,
                            task=args.task, length=args.length, sample=args.sample), args.cache)
            if args.record_only:
                print("dense :", repr(tok.decode(dense)))
                return
        print("dense :", repr(tok.decode(dense)))
        kv = StoreKV(m, pol, ids, n)
        try:
            tf = teacher_forced(m, ids, kv, dense)
        finally:
            kv.close()
        kv = StoreKV(m, pol, ids, n)
        try:
            free = greedy(m, torch.tensor(ids), kv, n)
        finally:
            kv.close()
    first_bad = next((i for i, (a, b) in enumerate(zip(dense, tf)) if a != b), None)
    print(f"quest : {tok.decode(free)!r}; teacher-forced argmax == dense per step: "
          f"{[int(a == b) for a, b in zip(dense, tf)]} (first difference at step {first_bad})")
    # per layer needle analysis on the dense run's queries
    q_all = torch.stack(rec.q)  # [steps-1, L, Hq, D]
    K = rec.k
    hq, hkv = m.cfg.num_heads, m.cfg.num_kv_heads
    g = hq // hkv
    P, f, nc, k = args.page, plan.first_page, plan.num_candidates, plan.pages_per_step
    a, b = span
    rows = []
    for li in pol.sparse_layers(m.cfg.num_layers):
        kp = K[li, :(T // P) * P].unflatten(0, (-1, P))
        kmin = kp.amin(1).transpose(0, 1)[:, f:f + nc].contiguous()
        kmax = kp.amax(1).transpose(0, 1)[:, f:f + nc].contiguous()
        mass, hit = [], {"max": 0, "softmax": 0, "oracle": 0}
        cases = 0
        for st in range(q_all.shape[0]):
            q = q_all[st, li]
            Lk = T + st + 1
            lg = torch.einsum("hd,thd->ht", q, K[li, :Lk].repeat_interleave(g, 1)) * m.scale
            p = torch.softmax(lg, -1)
            nm = p[:, a:b].sum(-1).view(hkv, g)  # [Hkv, g]
            mass.append(nm.max().item())
            cand = p[:, f * P:(f + nc) * P].view(hkv, g, nc, P).sum((1, 3))  # [Hkv, nc]
            npage = b // P - f if (b - 1) // P == a // P else None
            w = torch.zeros(hkv, nc)
            for t in range(a, b):
                w[:, t // P - f] += p[:, t].view(hkv, g).sum(1)
            npg = w.argmax(-1)
            sel = {"max": page_scores(q, kmin, kmax, group="max").topk(k, -1).indices,
                   "softmax": page_scores(q, kmin, kmax, group="softmax", scale=m.scale).topk(k, -1).indices,
                   "oracle": cand.topk(k, -1).indices}
            for h in range(hkv):
                if nm[h].max() >= 0.05:
                    cases += 1
                    for name, ix in sel.items():
                        hit[name] += int(bool((ix[h] == npg[h]).any()))
        rows.append(dict(layer=li, needle_mass_max=max(mass), cases=cases,
                         **{f"recall_{k_}": (v / cases if cases else None) for k_, v in hit.items()}))
    print(f"{'layer':>5s} {'max mass':>9s} {'cases':>5s} {'max':>5s} {'softmax':>7s} {'oracle':>6s}")
    for r in rows:
        if r["cases"]:
            print(f"{r['layer']:5d} {r['needle_mass_max']:9.3f} {r['cases']:5d} {r['recall_max']:5.2f} "
                  f"{r['recall_softmax']:7.2f} {r['recall_oracle']:6.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(task=args.task, length=args.length, sample=args.sample, T=T, span=span,
                           plan=plan.__dict__, dense=tok.decode(dense), quest=tok.decode(free),
                           teacher_forced_match=[int(a_ == b_) for a_, b_ in zip(dense, tf)], layers=rows), fh,
                      indent=1)


if __name__ == "__main__":
    main()
