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
3. ``check`` (``--check``): whole-model checks of the Quest store the engine runs
   (:class:`StoreKV`: ``OffloadQuestBatchKV``, resident over a pool on the model's device and
   offload over the pinned pool): Quest with budget >= T gives dense's tokens; with a small budget,
   each sparse layer's output equals attention over sink + independently recomputed selected pages
   + tail, and the store selects those pages.

Usage: ``PYTHONPATH=$PWD python tools/diag_quest.py [--length 2048] [--steps 12] [--check]``.
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
class StoreKV:
    """One sequence's KV in the store that ``LLMEngine(model, mode=mode, sparse_decode=policy,
    max_num_seqs=1)`` serves it with (:func:`xoffload.kv.table.batch_store_class`: the batched
    Quest store ``OffloadQuestBatchKV``, for ``resident`` over a pool on the model's device, on the
    CPU the CPU; for ``offload`` over the pinned pool), opened for that sequence alone and driven
    through the one-sequence interface :func:`greedy` and :class:`RecordKV` share: the prefill
    sink (``buffers`` / ``done``), then per step ``begin_step(pos)``, ``attend``, ``end_step``.

    Args:
        model: the LlamaModel.
        policy: the decode policy (a :class:`~xoffload.sparse.QuestDecode`).
        ids: the prompt's token ids (the store is sized for them).
        max_new: tokens generated, the prefill's first one included.
        mode: ``"resident"`` or ``"offload"``.
        wrap_store: a function of the engine's store class returning the class to open instead (a
            subclass: :func:`_make_checked`); None: the engine's.
        **options: further :class:`~xoffload.engine.LLMEngine` options (``kv_block_size``: default,
            resident, the multiple of the policy's page size nearest 1024 from below).

    Attributes: ``engine``, ``store``, ``seq``. :meth:`close` releases all three.
    """

    def __init__(self, model, policy, ids, max_new, mode="resident", wrap_store=None, **options):
        from xoffload.engine import LLMEngine, SamplingParams
        from xoffload.engine.request import Request
        from xoffload.engine.scheduler import Sequence

        if mode == "resident" and "kv_block_size" not in options:  # the pool's block: whole pages
            options["kv_block_size"] = policy.page_size * max(1, 1024 // policy.page_size)
        self.engine = e = LLMEngine(model, mode=mode, sparse_decode=policy, max_num_seqs=1,
                                    max_model_len=len(ids) + max_new + 8, **options)
        sp = SamplingParams(max_tokens=max_new, ignore_eos=True)
        self.seq = Sequence(0, Request.make(list(ids), sp, max_model_len=e.config.max_model_len, seed=0, stop_ids=(),
                                            device=model.device))
        cls = e.store_cls if wrap_store is None else wrap_store(e.store_cls)
        self.store = cls.open(model, e.config, e.offload, [self.seq], **e.store_kw)
        self.store.admit(self.seq)
        self._sink = self.store.sink(self.seq)
        self._decoding = False

    def buffers(self, layer, t):
        return self._sink.buffers(layer, t)

    def done(self, layer, k, v):
        self._sink.done(layer, k, v)

    def begin_step(self, pos):
        """A decode step at position ``pos`` (the sequence's next one: ValueError otherwise)."""
        st = self.store
        if not self._decoding:  # the first step: the prefill sampled one token
            self.seq.n_out = 1
            st.set_batch([self.seq])
            self._decoding = True
        if int(st.pos[0]) != pos:
            raise ValueError(f"the store's sequence is at position {int(st.pos[0])}, the step asks for {pos}")
        st.begin_step()

    def attend(self, layer, q, k_new, v_new):
        return self.store.attend(layer, q, k_new, v_new)

    def end_step(self):
        self.store.end_step()
        self.store.advance()

    def close(self):
        self.store.release(self.seq)
        self.store.close()
        self.engine.close()


def _make_checked(base):
    """A subclass of the Quest store ``base`` that, in every layer of a one-sequence batch,
    recomputes the selection and the attention independently (own min/max, per query head h -> KV
    head h // g, explicit token list) and records the largest difference to the store's output
    (``maxdiff``), the selections checked (``sel_checked``: one per sparse layer, step and KV head)
    and those whose pages differ from the recomputed ones (``sel_mismatch``)."""

    class Checked(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.fullk = [[] for _ in range(self.cfg.num_layers)]
            self.fullv = [[] for _ in range(self.cfg.num_layers)]
            self.maxdiff = 0.0
            self.sel_mismatch = self.sel_checked = 0
            self._plan = None

        def sink(self, seq):
            sink = super().sink(seq)
            store_done = sink.done

            def done(layer, k, v):  # the whole prompt's K/V of the layer (no reused prefix here)
                self.fullk[layer] = [k.clone()]
                self.fullv[layer] = [v.clone()]
                store_done(layer, k, v)

            sink.done = done
            return sink

        def set_batch(self, seqs):
            if len(seqs) != 1:
                raise ValueError(f"the checked store checks a batch of one, got {len(seqs)}")
            self._plan = seqs[0].kv["plan"]
            return super().set_batch(seqs)

        def attend(self, layer, q, k_new, v_new):
            o = super().attend(layer, q, k_new, v_new)[0]  # [Hq, D]
            self.fullk[layer].append(k_new[:1].clone())
            self.fullv[layer].append(v_new[:1].clone())
            K, V = torch.cat(self.fullk[layer]), torch.cat(self.fullv[layer])
            p, P, hkv = self._plan, self.page, self.cfg.num_kv_heads
            g, k = q.shape[1] // hkv, p.pages_per_step
            if layer in self.dense or k == 0:
                toks = [torch.arange(K.shape[0])] * hkv
            else:
                f, n = p.first_page, p.num_candidates
                kp = K[:(f + n) * P].unflatten(0, (-1, P))[f:]  # [n, P, Hkv, D]
                mn, mx = kp.amin(1), kp.amax(1)  # [n, Hkv, D]
                chosen = self._sel[:hkv, :k].long() + f  # the store's pages (candidate ids + first page)
                toks = []
                for h in range(hkv):
                    sc = torch.stack([(q[0, j].clamp(min=0) * mx[:, h]).sum(-1) + (q[0, j].clamp(max=0) * mn[:, h]).sum(-1)
                                      for j in range(h * g, (h + 1) * g)]).amax(0)
                    pages = sc.topk(k).indices + f
                    self.sel_mismatch += int(set(chosen[h].tolist()) != set(pages.tolist()))
                    self.sel_checked += 1
                    sel = (pages[:, None] * P + torch.arange(P)).flatten()
                    toks.append(torch.cat([torch.arange(p.sink_len), sel, torch.arange(p.tail_start, K.shape[0])]))
            ref = torch.empty_like(o)
            for j in range(q.shape[1]):
                t = toks[j // g]
                w = torch.softmax((K[t, j // g] @ q[0, j]) * self.scale, 0)
                ref[j] = w @ V[t, j // g]
            self.maxdiff = max(self.maxdiff, float((ref - o).abs().max()))
            return o[None]

    return Checked


def check_model(m, ids, n=8, policies=None, placements=("resident", "offload"), **options) -> list:
    """The whole-model checks (module docstring, 3.) of model ``m`` on prompt ``ids``, ``n`` greedy
    tokens, for each placement and decode policy (default: budget 4T, 512 and 256 with pages of 32,
    512 with pages of 16). Offload runs with ``reuse_bias=1.0``: the page cache's bonus off, so
    that the store's selection is the bare top-k the check recomputes. Returns one row per run:
    ``placement``, ``policy``, ``dense_plan``, ``maxdiff``, ``sel_checked``, ``sel_mismatch``,
    ``tokens``, ``same_as_dense`` and ``dense_tokens`` (greedy through :class:`RecordKV`).
    ``options``: further engine options (``kv_block_size``, ...)."""
    import dataclasses

    T = len(ids)
    if policies is None:
        policies = (QuestDecode(token_budget=4 * T, page_size=32), QuestDecode(token_budget=512, page_size=32),
                    QuestDecode(token_budget=512, page_size=16), QuestDecode(token_budget=256, page_size=32))
    rows = []
    with xoffload.kernels.cpu_backend("reference"), torch.no_grad():
        dense = greedy(m, torch.tensor(ids), RecordKV(m.cfg, T, n, m.scale), n)
        for placement in placements:
            for pol in policies:
                if placement == "offload":
                    pol = dataclasses.replace(pol, reuse_bias=1.0)
                kv = StoreKV(m, pol, ids, n, mode=placement, wrap_store=_make_checked, **options)
                try:
                    toks = greedy(m, torch.tensor(ids), kv, n)
                finally:
                    kv.close()
                rows.append({"placement": placement, "policy": pol, "dense_plan": kv.store._plan.dense,
                             "maxdiff": kv.store.maxdiff, "sel_checked": kv.store.sel_checked,
                             "sel_mismatch": kv.store.sel_mismatch, "tokens": toks,
                             "same_as_dense": toks == dense, "dense_tokens": dense})
    return rows


def check(n=8, length=2048):
    """:func:`check_model` on SmolLM2 and a needle prompt of ``length`` tokens; prints each run."""
    from xoffload.evals.needle import build_prompt, make_number
    m = load()
    number = make_number(random.Random(0))
    ids = list(build_prompt(m.tokenizer, length, 0.5, number).token_ids)
    rows = check_model(m, ids, n)
    print("dense:", repr(m.tokenizer.decode(rows[0]["dense_tokens"])))
    for r in rows:
        pol = r["policy"]
        print(f"{r['placement']} b{pol.token_budget} p{pol.page_size}: dense plan={r['dense_plan']} "
              f"max|o - independent ref|={r['maxdiff']:.2e} selection mismatches={r['sel_mismatch']} "
              f"tokens==dense: {r['same_as_dense']} {m.tokenizer.decode(r['tokens'])!r}")


if __name__ == "__main__" and "--check" in sys.argv:
    check()
