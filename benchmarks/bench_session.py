"""Sessions benchmark: the second turn over a long history, and prefix reuse across requests.

Parts (``--part``, comma-separated; default ``turns,prefix,prefix_batch``):

- ``turns``: random Llama-3.1-8B shape in ``offload`` mode (Quest decode, budget 2048,
  ``prefix_caching=True``), one session: turn one appends a ``--history``-token document (its
  prefill time is the reference: what every question costs without the prefix cache), then a
  64-token question is asked; its turn is a request carrying the whole conversation, the prefix
  cache gives the document's blocks and only the question is prefilled, attending to the document
  read back from the pinned pool (the PCIe floor of reading it once: history bytes / H2D
  bandwidth, measured in the same run). Per turn: time to first token (CUDA events), tokens
  prefilled and reused, the ratio to the first turn's prefill and to the floor. Target: <= 0.05x
  the first turn's prefill.
- ``prefix``: ``prefix_caching=True``, 8 questions of 64 tokens over one ``--doc``-token document
  (each its own ``generate`` request, 16 new tokens, Quest decode): the time of all 8 (sum of each
  request's CUDA-event time) against the time of serving one; the same 8 without prefix caching as
  the peer. Target: 8 in <= 1.3x one.
- ``prefix_batch``: the same target served as an engine would, ``resident`` mode with
  ``max_num_seqs=8``: one batched ``generate`` of the 8 prompts (the first prefills the document,
  the others reuse its blocks and join the running batch, prefilled together as one group:
  ``LlamaModel.prefill_batch``) against one ``generate`` of the first alone, wall time; warmed up
  first on another document of the same length in the same shape (so the compiles are not timed).
  Records the call's timeline (prefills with their group sizes, one entry per prefill call, the
  host's seconds per phase, decode steps, graph buckets).
- ``prefix_batch_profile``: ``prefix_batch``'s reuse call under torch.profiler and cProfile (the
  top operators by CUDA / CPU time and the host's top functions, in ``<out>_prefix_profile.txt``).

Writes ``benchmarks/results/session.json``.
"""
from __future__ import annotations

import argparse

from _common import bench_parser, parse_gpu_args, requires_cuda, run, write_json

import torch

from bench_llm import _prompt, h2d_bandwidth_gbps

PRESET = "llama-3.1-8b"
Q_TOKENS = 64


def _llm(model, max_len, **kw):
    from xoffload import LLM
    from xoffload.sparse import QuestDecode

    return LLM(model, mode="offload", max_model_len=max_len, sparse_decode=QuestDecode(token_budget=2048), **kw)


def part_turns(model, history: int, h2d: float) -> dict:
    from xoffload import SamplingParams

    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = _llm(model, history + 1024, prefix_caching=True)
    # warm-up on a shorter conversation: compiles the kernel variants the long one uses
    with llm.session() as w:
        w.append(_prompt(min(history, 4096), V, 9))
        w.generate(_prompt(Q_TOKENS, V, 8), sp)
    llm.prefix_cache.clear()
    out = {"history_tokens": history, "question_tokens": Q_TOKENS}
    s = llm.session()
    t1 = s.append(_prompt(history, V, 1))
    out["turn1"] = t1
    kv_bytes = history * model.cfg.kv_bytes_per_token(model.dtype)
    out["history_bytes"] = kv_bytes
    out["floor_ms"] = kv_bytes / (h2d * 1e9) * 1e3
    o = s.generate(_prompt(Q_TOKENS, V, 2), sp)
    t2 = {k: o.timings.get(k) for k in ("ttft_ms", "prefill_ms", "chunk_tokens", "history_tokens",
                                        "history_recomputed_tokens")}
    t2["ratio_to_turn1"] = t2["ttft_ms"] / t1["prefill_ms"]
    t2["ratio_to_floor"] = t2["ttft_ms"] / out["floor_ms"]
    t2["target"] = "<= 0.05x turn 1"
    t2["met"] = t2["ratio_to_turn1"] <= 0.05
    out["turn2"] = t2
    s.close()
    llm.close()
    return out


def part_prefix(model, doc: int, n_q: int = 8) -> dict:
    from xoffload import SamplingParams

    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    d = _prompt(doc, V, 11)
    qs = [_prompt(Q_TOKENS, V, 20 + i) for i in range(n_q)]
    res = {"doc_tokens": doc, "questions": n_q, "question_tokens": Q_TOKENS, "new_tokens": sp.max_tokens}
    for name, kw in (("prefix_caching", {"prefix_caching": True}), ("no_reuse", {})):
        llm = _llm(model, doc + 1024, **kw)
        llm.generate(_prompt(2000, V, 5) + qs[0], sp)  # warm-up (compiles), then forgotten
        if llm.prefix_cache is not None:
            llm.prefix_cache.clear()
        outs = [llm.generate(d + q, sp)[0] for q in qs]
        ms = [o.timings["total_ms"] for o in outs]
        res[name] = {"total_ms": ms, "sum_ms": sum(ms), "one_ms": ms[0],
                     "ratio_all_to_one": sum(ms) / ms[0],
                     "reused_tokens": [o.timings.get("prefix_reused_tokens", 0) for o in outs],
                     "ttft_ms": [o.timings["ttft_ms"] for o in outs],
                     "tokens": [o.token_ids[:4] for o in outs]}
        llm.close()
    pc = res["prefix_caching"]
    pc["target"] = "8 questions <= 1.3x one"
    pc["met"] = pc["ratio_all_to_one"] <= 1.3
    pc["same_tokens_as_no_reuse"] = pc["tokens"] == res["no_reuse"]["tokens"]
    return res


def part_prefix_batch(model, doc: int, n_q: int = 8) -> dict:
    """The prefix target through batched resident generation (module docstring)."""
    import time

    from xoffload import LLM, SamplingParams

    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    d, d_warm = _prompt(doc, V, 11), _prompt(doc, V, 12)
    qs = [_prompt(Q_TOKENS, V, 20 + i) for i in range(n_q)]
    res = {"doc_tokens": doc, "questions": n_q, "question_tokens": Q_TOKENS, "new_tokens": sp.max_tokens,
           "mode": "resident", "max_num_seqs": n_q}
    for name, kw in (("prefix_caching", {"prefix_caching": True}), ("no_reuse", {})):
        llm = LLM(model, mode="resident", max_model_len=doc + 1024, max_num_seqs=n_q, kv_block_size=256, **kw)
        # warm-up on another document of the same length, in the measured call's shape (with prefix
        # caching: the 8 questions, so the reuse path's kernels compile and run at these lengths
        # here, not in the timed call); the pool and its prefix cache are per call
        warm = [d_warm + q for q in (qs if kw else qs[:2])]
        llm.generate(warm, sp)
        t = time.perf_counter()
        one = llm.generate([d + qs[0]], sp)
        one_s = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate([d + q for q in qs], sp)
        all_s = time.perf_counter() - t
        st = llm.batch_stats  # where the batched call's time went: prefills, decode steps, graphs
        # prefills: one entry per prompt ("group": how many were prefilled together, sharing the
        # marks); prefill_groups: one per prefill call; host: the loop's host seconds per phase
        timeline = {k: st.get(k) for k in ("total_ms", "prefill_ms", "decode_ms", "prefills", "prefill_groups",
                                           "graph_buckets", "max_running", "host")}
        timeline["decode_steps"] = (st.get("decode_steps") or [])[:48]
        res[name] = {"one_s": one_s, "all_s": all_s, "ratio_all_to_one": all_s / one_s,
                     "reused_tokens": [o.timings.get("prefix_reused_tokens", 0) for o in outs],
                     "ttft_ms": [o.timings["ttft_ms"] for o in outs], "tokens": [o.token_ids[:4] for o in outs],
                     "first_tokens_of_one": one[0].token_ids[:4], "timeline": timeline}
        llm.close()
        del llm
        torch.cuda.empty_cache()
    pc = res["prefix_caching"]
    pc["target"] = "8 questions <= 1.3x one"
    pc["met"] = pc["ratio_all_to_one"] <= 1.3
    pc["same_first_tokens_as_no_reuse"] = [t[0] for t in pc["tokens"]] == [t[0] for t in res["no_reuse"]["tokens"]]
    return res


def part_prefix_batch_profile(model, doc: int, path: str, n_q: int = 8) -> dict:
    """The prefix-caching call of ``prefix_batch`` (warmed up the same way) under torch.profiler and
    cProfile: the top operators by CUDA and by CPU time and the host's top Python functions, in a
    text file at ``path`` (where the seven short prefills over the reused document spend their time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from xoffload import LLM, SamplingParams

    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    d, d_warm = _prompt(doc, V, 11), _prompt(doc, V, 12)
    qs = [_prompt(Q_TOKENS, V, 20 + i) for i in range(n_q)]
    llm = LLM(model, mode="resident", max_model_len=doc + 1024, max_num_seqs=n_q, kv_block_size=256,
              prefix_caching=True)
    llm.generate([d_warm + q for q in qs], sp)
    pr = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pr.enable()
        llm.generate([d + q for q in qs], sp)
        pr.disable()
    timeline = {k: llm.batch_stats.get(k) for k in ("prefills", "prefill_groups", "host")}
    llm.close()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30) + "\n\n")
        f.write(buf.getvalue())
    return {"doc_tokens": doc, "questions": n_q, "prefills": timeline, "table": path}


#: the parts of ``--part``, in the order they run
PARTS = ("turns", "prefix", "prefix_batch", "prefix_batch_profile")


def _parts(text: str) -> set:
    """``--part``: comma-separated names of :data:`PARTS` (argparse error naming an unknown one)."""
    parts = {p.strip() for p in text.split(",") if p.strip()}
    bad = sorted(parts - set(PARTS))
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(map(repr, bad)) or repr(text)}; "
                                         f"parts: {', '.join(PARTS)}")
    return parts


def main(argv=None):
    ap = bench_parser(__doc__, "session", "history 32K, document 8K")
    ap.add_argument("--part", default="turns,prefix,prefix_batch", type=_parts,
                    help="comma-separated parts: turns, prefix, prefix_batch (the 8 questions in one batched "
                    "resident call), prefix_batch_profile (prefix_batch's reuse call under torch.profiler and "
                    "cProfile)")
    ap.add_argument("--history", type=int, default=131072 - 1024, help="tokens of the first turn's document")
    ap.add_argument("--doc", type=int, default=32768, help="tokens of the prefix part's document")
    a = parse_gpu_args(ap, argv)
    if a is None:
        return 0
    from xoffload.models import random_model

    parts = a.part
    history, doc = (32768 - 1024, 8192) if a.quick else (a.history, a.doc)
    model = random_model(PRESET, dtype=torch.bfloat16, device="cuda", seed=0)
    h2d = h2d_bandwidth_gbps()
    res = {"name": "session", "preset": PRESET, "h2d_GBps": h2d, "results": {}, "errors": {}}
    print(f"H2D {h2d:.1f} GB/s", flush=True)
    prof_path = (a.out[:-5] if a.out.endswith(".json") else a.out) + "_prefix_profile.txt"
    for part, fn in (("turns", lambda: part_turns(model, history, h2d)),
                     ("prefix", lambda: part_prefix(model, doc)),
                     ("prefix_batch", lambda: part_prefix_batch(model, doc)),
                     ("prefix_batch_profile", lambda: part_prefix_batch_profile(
                         model, doc, prof_path))):
        if part not in parts:
            continue
        try:
            res["results"][part] = r = fn()
            print(part, {k: v for k, v in r.items() if k not in ("turn1",)}, flush=True)
        except Exception as e:  # noqa: BLE001 - recorded, the other part still runs
            import traceback

            res["errors"][part] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    print("wrote", write_json(a.out, res))
    return 1 if res["errors"] else 0


@requires_cuda
def test_bench_session(benchmark):
    benchmark.pedantic(lambda: main(["--quick"]), rounds=1, iterations=1)


if __name__ == "__main__":
    run(main)
