"""Diagnosis of Quest sparse decode accuracy on SmolLM2 (CPU, fp32, reference kernels).

1. ``record``: one needle prompt (~2K tokens, depth 0.5), greedy dense decode with a KV store that
   keeps the full K/V and records every layer's post-RoPE decode query ``q [Hq, D]`` (as ``attend``
   receives it). Saved to ``--cache`` (a .pt) so the analysis can be rerun quickly.
2. ``analyse``: per sparse layer, step and KV head: the true attention mass per page (sum over the
   group's query heads, softmax over all tokens), the pages each scoring variant selects for the
   plan of ``QuestDecode(token_budget=B, page_size=P).plan(T)``, and
   - captured: fraction of the candidate-region attention mass (outside sink + recent) that falls
     in the selected pages (mean over the group's query heads), variant vs oracle top-k;
   - lost: the attention mass (of the whole softmax) that falls in unselected pages;
   - needle recall: over (layer, KV head, step) whose heads put >= 5% of their mass on the needle
     span ("retrieval heads"), how often the page holding the most needle mass is selected.
3. ``check``: whole-model PagedKV checks: Quest with budget >= T equals dense; with a small budget,
   each sparse layer's output equals attention over sink + independently recomputed selected pages
   + tail.

Usage: ``PYTHONPATH=$PWD python tools/diag_quest.py [--length 2048] [--steps 12]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

import xoffload
from xoffload.kernels.reference import attention_ref
from xoffload.sparse.quest import QuestDecode, page_scores, select_pages


class RecordKV:
    """Dense KV store that keeps everything and records the decode queries."""

    def __init__(self, cfg, T, n, scale):
        self.k = torch.zeros(cfg.num_layers, T + n, cfg.num_kv_heads, cfg.head_dim)
        self.v = torch.zeros_like(self.k)
        self.scale = scale
        self.q = []  # per step: [L, Hq, D]
        self.pos = T

    def buffers(self, layer, t):
        return self.k[layer, :t], self.v[layer, :t]

    def done(self, layer, k, v):
        pass

    def begin_step(self, pos=None):
        self.pos = pos
        self.q.append(torch.zeros(self.k.shape[0], 0, 0))
        self._q = []

    def attend(self, layer, q, k_new, v_new):
        self._q.append(q[0].clone().float())
        self.k[layer, self.pos] = k_new[0]
        self.v[layer, self.pos] = v_new[0]
        L = self.pos + 1
        o = attention_ref(q[None], self.k[layer, :L][None], self.v[layer, :L][None], causal=False,
                          softmax_scale=self.scale)[0]
        return o[0, 0]

    def end_step(self):
        self.q[-1] = torch.stack(self._q)


def greedy(m, ids, kv, n):
    logits = m.prefill(ids, kv)
    toks = [int(logits[-1].argmax())]
    T = ids.shape[0]
    for i in range(n - 1):
        kv.begin_step(T + i)
        lg = m.decode_step(torch.tensor([toks[-1]]), T + i, kv)
        kv.end_step()
        toks.append(int(lg[-1].argmax()))
    return toks


def load():
    from xoffload.models import find_smollm2_gguf, load_model
    return load_model(find_smollm2_gguf(), dtype=torch.float32, device="cpu")


def needle_span(tok, ids, number):
    """Token positions [a, b) of the needle sentence's digits (first occurrence of the number)."""
    num_ids = tok.encode(number, add_special_tokens=False)
    for cand in (num_ids, tok.encode(" " + number, add_special_tokens=False)):
        n = len(cand)
        for i in range(len(ids) - n):
            if ids[i:i + n] == cand:
                return i, i + n
    raise RuntimeError("needle digits not found in the prompt")


def record(args):
    from xoffload.evals.needle import build_prompt, make_number
    m = load()
    tok = m.tokenizer
    number = make_number(random.Random(args.seed))
    p = build_prompt(tok, args.length, args.depth, number)
    ids = list(p.token_ids)
    a, b = needle_span(tok, ids, number)
    T = len(ids)
    kv = RecordKV(m.cfg, T, args.steps, m.scale)
    with xoffload.kernels.cpu_backend("reference"), torch.no_grad():
        toks = greedy(m, torch.tensor(ids), kv, args.steps)
    text = tok.decode(toks)
    print(f"T={T} needle digits at [{a},{b}) number={number} answer={text!r}")
    # decode steps: step i has its q at position T + i (the token toks[i] is fed); recorded K covers
    # positions < T + steps - 1
    n_dec = len(kv.q)
    torch.save(dict(q=torch.stack(kv.q), k=kv.k[:, :T + n_dec], v=kv.v[:, :T + n_dec], T=T, span=(a, b),
                    number=number, answer=text, toks=toks, scale=m.scale, hq=m.cfg.num_heads,
                    hkv=m.cfg.num_kv_heads, L=m.cfg.num_layers), args.cache)


# ---------------------------------------------------------------------------------------- scoring variants
def _groups(q, hkv):
    hq, d = q.shape
    return q.view(hkv, hq // hkv, d)


def s_quest(q, kmin, kmax, kmean, mu, scale, dtype=None):
    if dtype is not None:
        return page_scores(q.to(dtype), kmin.to(dtype), kmax.to(dtype))
    return page_scores(q, kmin, kmax)


def _bound_per_head(q, kmin, kmax):
    qg = _groups(q, kmin.shape[0])
    return torch.bmm(qg.clamp(min=0), kmax.transpose(1, 2)) + torch.bmm(qg.clamp(max=0), kmin.transpose(1, 2))


def s_quest_sum(q, kmin, kmax, kmean, mu, scale):
    return _bound_per_head(q, kmin, kmax).sum(1)


def s_quest_centered(q, kmin, kmax, kmean, mu, scale):
    # bound on k - mu (mu: per KV head, per channel mean of the prompt's keys), max over the group
    qg = _groups(q, kmin.shape[0])
    return (_bound_per_head(q, kmin - mu[:, None], kmax - mu[:, None])).amax(1)


def _softmax_sum(per_head, scale):
    return torch.softmax(per_head * scale, dim=-1).sum(1)


def s_quest_softmax(q, kmin, kmax, kmean, mu, scale):
    return _softmax_sum(_bound_per_head(q, kmin, kmax), scale)


def s_mean(q, kmin, kmax, kmean, mu, scale):
    qg = _groups(q, kmin.shape[0])
    return _softmax_sum(torch.bmm(qg, kmean.transpose(1, 2)), scale)


def s_mean_max(q, kmin, kmax, kmean, mu, scale):
    qg = _groups(q, kmin.shape[0])
    return torch.bmm(qg, kmean.transpose(1, 2)).amax(1)


def s_combo(q, kmin, kmax, kmean, mu, scale):
    # half way between the mean key's score and the bound, softmax over pages per head, summed
    qg = _groups(q, kmin.shape[0])
    mean = torch.bmm(qg, kmean.transpose(1, 2))
    return _softmax_sum(0.5 * (mean + _bound_per_head(q, kmin, kmax)), scale)


def s_combo_max(q, kmin, kmax, kmean, mu, scale):
    # Quest max-bound and mean-key softmax ranks combined: union-ish by summed normalised scores
    a = torch.softmax(_bound_per_head(q, kmin, kmax) * scale, -1).sum(1)
    b = _softmax_sum(torch.bmm(_groups(q, kmin.shape[0]), kmean.transpose(1, 2)), scale)
    return a + b


VARIANTS = {
    "quest(max)": s_quest,
    "quest_bf16": lambda *a: s_quest(*a, dtype=torch.bfloat16),
    "quest_sum": s_quest_sum,
    "quest_softmax_sum": s_quest_softmax,
    "quest_centered": s_quest_centered,
    "mean_softmax_sum": s_mean,
    "mean_max": s_mean_max,
    "combo_half": s_combo,
    "combo_sum": s_combo_max,
}


def analyse(rec, budget, page, sink=32, recent=128, dense_layers=(0, 1), needle_thr=0.05):
    q_all, K, T, scale = rec["q"], rec["k"], rec["T"], rec["scale"]
    hq, hkv, L = rec["hq"], rec["hkv"], rec["L"]
    g = hq // hkv
    a, b = rec["span"]
    pol = QuestDecode(token_budget=budget, page_size=page, sink_tokens=sink, recent_tokens=recent,
                      dense_layers=dense_layers)
    plan = pol.plan(T)
    f, n, k = plan.first_page, plan.num_candidates, plan.pages_per_step
    steps = q_all.shape[0]
    res = {v: dict(cap=[], lost=[], hits=0, tot=0) for v in list(VARIANTS) + ["oracle"]}
    per_layer = {}
    for li in pol.sparse_layers(L):
        Kl = K[li, :T]  # prompt keys [T, Hkv, D]
        kp = Kl[: (T // page) * page].unflatten(0, (-1, page))  # [np, P, Hkv, D]
        kmin = kp.amin(1).transpose(0, 1)[:, f:f + n].contiguous()
        kmax = kp.amax(1).transpose(0, 1)[:, f:f + n].contiguous()
        kmean = kp.mean(1).transpose(0, 1)[:, f:f + n].contiguous()
        mu = Kl.mean(0)  # [Hkv, D]
        for s in range(steps):
            q = q_all[s, li]  # [Hq, D]
            Lk = T + s + 1
            Kall = K[li, :Lk]  # includes the current token
            logits = torch.einsum("hd,thd->ht", q, Kall.repeat_interleave(g, 1)) * scale  # [Hq, Lk]
            p = torch.softmax(logits, -1)  # [Hq, Lk]
            cand = p[:, f * page:(f + n) * page].view(hq, n, page).sum(-1)  # [Hq, n]
            cand_tot = cand.sum(-1)  # [Hq]
            cg = cand.view(hkv, g, n)
            needle = p[:, a:b].sum(-1).view(hkv, g)  # mass on the needle digits
            # page with the most needle mass (by token position)
            tokp = torch.arange(a, b) // page - f
            w = p[:, a:b].view(hkv, g, -1).sum(1)  # [Hkv, b-a]
            npage = torch.zeros(hkv, n).index_add_(1, tokp.clamp(0, n - 1), w).argmax(-1)  # [Hkv]
            sel = {}
            for name, fn in VARIANTS.items():
                sc = fn(q, kmin, kmax, kmean, mu, scale)
                rows = select_pages(sc.float(), k, f, page, None, page)[0]  # [Hkv, k] token rows
                sel[name] = (rows.long() // page - f)
            sel["oracle"] = cg.sum(1).topk(k, -1).indices
            for name, idx in sel.items():
                mask = torch.zeros(hkv, n, dtype=torch.bool).scatter_(1, idx, True)
                got = (cg * mask[:, None]).sum(-1)  # [Hkv, g]
                r = res[name]
                r["cap"].append((got / cand_tot.view(hkv, g).clamp_min(1e-12)).mean().item())
                r["lost"].append((cand_tot.view(hkv, g) - got).mean().item())
                for h in range(hkv):
                    if needle[h].max() >= needle_thr:
                        r["tot"] += 1
                        r["hits"] += int(mask[h, npage[h]].item())
                per_layer.setdefault((li, name), []).append((got / cand_tot.view(hkv, g).clamp_min(1e-12)).mean().item())
    out = {}
    for name, r in res.items():
        out[name] = dict(captured=sum(r["cap"]) / len(r["cap"]), lost=sum(r["lost"]) / len(r["lost"]),
                         needle_recall=(r["hits"] / r["tot"]) if r["tot"] else None, needle_cases=r["tot"])
    return plan, out, per_layer


def needle_heads(rec, thr=0.05):
    """(layer, q head) -> max over steps of attention mass on the needle digits."""
    q_all, K, T, scale = rec["q"], rec["k"], rec["T"], rec["scale"]
    hq, hkv = rec["hq"], rec["hkv"]
    g = hq // hkv
    a, b = rec["span"]
    out = {}
    for li in range(rec["L"]):
        for s in range(q_all.shape[0]):
            Kall = K[li, :T + s + 1].repeat_interleave(g, 1)
            p = torch.softmax(torch.einsum("hd,thd->ht", q_all[s, li], Kall) * scale, -1)
            nm = p[:, a:b].sum(-1)
            for h in range(hq):
                out[(li, h)] = max(out.get((li, h), 0.0), nm[h].item())
    return {k: v for k, v in out.items() if v >= thr}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cache", default="/tmp/diag_quest_rec.pt")
    ap.add_argument("--rerecord", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rerecord or not os.path.exists(args.cache):
        record(args)
    rec = torch.load(args.cache)
    print(f"T={rec['T']} span={rec['span']} answer={rec['answer']!r}")
    nh = needle_heads(rec)
    print("needle (retrieval) heads, max mass on the digits >= 5%:",
          ", ".join(f"L{l}h{h}:{v:.2f}" for (l, h), v in sorted(nh.items(), key=lambda x: -x[1])[:25]))
    report = {"T": rec["T"], "span": rec["span"], "answer": rec["answer"], "configs": {}}
    for budget, page in ((512, 32), (512, 16), (1024, 32), (256, 32)):
        plan, out, per_layer = analyse(rec, budget, page)
        key = f"b{budget}_p{page}"
        print(f"\n== budget {budget} page {page}: candidates {plan.num_candidates} pages, k={plan.pages_per_step} "
              f"(sink {plan.sink_len}, tail from {plan.tail_start})")
        print(f"{'variant':20s} {'captured':>9s} {'lost':>7s} {'needle recall':>14s}")
        for name, r in out.items():
            nr = "-" if r["needle_recall"] is None else f"{r['needle_recall']:.3f} ({r['needle_cases']})"
            print(f"{name:20s} {r['captured']:9.3f} {r['lost']:7.3f} {nr:>14s}")
        report["configs"][key] = out
        if (budget, page) == (512, 32):
            worst = sorted(((sum(v) / len(v), l) for (l, nme), v in per_layer.items() if nme == "quest(max)"))
            print("quest(max) captured per layer (worst 8):", ", ".join(f"L{l}:{c:.2f}" for c, l in worst[:8]))
            report["per_layer_b512_p32"] = {f"{nme}@L{l}": sum(v) / len(v) for (l, nme), v in per_layer.items()
                                            if nme in ("quest(max)", "oracle", "mean_softmax_sum")}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__" and "--check" not in sys.argv:
    main()


# ---------------------------------------------------------------------------------------- whole-model checks
def _make_checked(base):
    """A PagedKV subclass that, in every sparse layer, recomputes the selection and the attention
    independently (own min/max, per query head h -> KV head h // g, explicit token list) and records
    the largest difference to PagedKV's output."""

    class Checked(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.fullk = [[] for _ in range(self.cfg.num_layers)]
            self.fullv = [[] for _ in range(self.cfg.num_layers)]
            self.maxdiff = 0.0
            self.sel_mismatch = 0

        def done(self, layer, k, v):
            self.fullk[layer] = [k.clone()]
            self.fullv[layer] = [v.clone()]
            super().done(layer, k, v)

        def attend(self, layer, q, k_new, v_new):
            o = super().attend(layer, q, k_new, v_new)
            self.fullk[layer].append(k_new.clone())
            self.fullv[layer].append(v_new.clone())
            K, V = torch.cat(self.fullk[layer]), torch.cat(self.fullv[layer])
            p, P, g, T = self.plan, self.page, self.group, self.T
            if layer in self.dense or self._k == 0:
                toks = [torch.arange(K.shape[0])] * self.cfg.num_kv_heads
            else:
                f, n = p.first_page, p.num_candidates
                kp = K[:(f + n) * P].unflatten(0, (-1, P))[f:]  # [n, P, Hkv, D]
                mn, mx = kp.amin(1), kp.amax(1)  # [n, Hkv, D]
                toks = []
                for h in range(self.cfg.num_kv_heads):
                    sc = torch.stack([(q[0, j].clamp(min=0) * mx[:, h]).sum(-1) + (q[0, j].clamp(max=0) * mn[:, h]).sum(-1)
                                      for j in range(h * g, (h + 1) * g)]).amax(0)
                    pages = sc.topk(self._k).indices + f
                    got = set((self._table[0, h].long() // P).tolist())
                    self.sel_mismatch += int(got != set(pages.tolist()))
                    sel = (pages[:, None] * P + torch.arange(P)).flatten()
                    toks.append(torch.cat([torch.arange(p.sink_len), sel, torch.arange(p.tail_start, K.shape[0])]))
            ref = torch.empty_like(o)
            for j in range(q.shape[1]):
                t = toks[j // g]
                w = torch.softmax((K[t, j // g] @ q[0, j]) * self.scale, 0)
                ref[j] = w @ V[t, j // g]
            self.maxdiff = max(self.maxdiff, float((ref - o).abs().max()))
            return o

    return Checked


def check(n=8, length=2048):
    from xoffload.engine.kv_paged import PagedKV
    from xoffload.evals.needle import build_prompt, make_number
    from xoffload.runtime import OffloadRuntime
    m = load()
    cfg = m.cfg
    number = make_number(random.Random(0))
    ids = list(build_prompt(m.tokenizer, length, 0.5, number).token_ids)
    T = len(ids)
    Checked = _make_checked(PagedKV)
    with xoffload.kernels.cpu_backend("reference"), torch.no_grad():
        dense = greedy(m, torch.tensor(ids), RecordKV(cfg, T, n, m.scale), n)
        print("dense:", repr(m.tokenizer.decode(dense)))
        for placement in ("resident", "offload"):
            for pol in (QuestDecode(token_budget=4 * T, page_size=32), QuestDecode(token_budget=512, page_size=32),
                        QuestDecode(token_budget=512, page_size=16), QuestDecode(token_budget=256, page_size=32)):
                eng = seq = None
                if placement == "offload":
                    eng = OffloadRuntime(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32,
                                        device="cpu", max_tokens=T + 64, block_size=64)
                    seq = eng.add_sequence()
                kv = Checked(cfg, torch.float32, torch.device("cpu"), m.scale, prompt_len=T, max_new=n, policy=pol,
                             engine=eng, seq=seq)
                toks = greedy(m, torch.tensor(ids), kv, n)
                print(f"{placement} b{pol.token_budget} p{pol.page_size}: dense plan={kv.plan.dense} "
                      f"max|o - independent ref|={kv.maxdiff:.2e} selection mismatches={kv.sel_mismatch} "
                      f"tokens==dense: {toks == dense} {m.tokenizer.decode(toks)!r}")
                kv.close()
                if eng is not None:
                    eng.close()


if __name__ == "__main__" and "--check" in sys.argv:
    check()
