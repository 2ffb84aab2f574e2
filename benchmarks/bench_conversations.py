"""Many conversations at once over long documents, their KV on the host: the multi-user workload.

N conversations (``--convs``, e.g. 4, 8, 16) arrive ``--gap-ms`` apart; each asks ``--questions``
questions over a ``--doc-tokens`` document (``--docs own``: each its own document; ``shared``: one
document for all) through the engine loop (:class:`xoffload.LLMEngine`, one step at a time, the
turns of every conversation and their decode steps shared): the first turn sends the document and
a question, each later turn a question, ``--answer-tokens`` generated per turn. A conversation's
next turn is sent when its answer is complete. Modes (``--modes``):

- ``offload+quest``: KV in pinned host memory, Quest sparse decode (the library's default budget),
  prefix caching: a follow-up prefills only its new tokens;
- ``reprefill``: the same without prefix caching (each turn prefills the whole conversation again);
- ``resident``: KV on the GPU (prefix caching within the GPU pool), as many conversations at
  once as the pool holds under the cap.

Every mode runs under a ``--cap-gib`` GPU memory cap (``torch.cuda.set_per_process_memory_fraction``),
on one random-weight model (``--shape``, default the Llama-3.1-8B shape). Reported per mode and N:
after a warm-up load over other tokens (kernel compilation, graph captures):
time to first token (TTFT: the engine's queue + prefill + first sample, CUDA events) p50/p99 of all
turns and of follow-ups, inter-token latency (ITL: the decode step times, each a token for every
running conversation) p50/p99, total generated tok/s (over the whole load, CUDA events), H2D bytes
per generated token, peak GPU memory and the process's peak host RSS. The arrival process runs on
the host clock (the load generator); every measured time is a CUDA-event time.

``python benchmarks/bench_conversations.py --convs 8 --modes offload+quest,resident`` (GPU); on a
CPU ``--shape tiny-llama --doc-tokens 256`` runs the same code (tests/benchmarks).
"""
from __future__ import annotations

import resource
import statistics
import time

import torch

from _common import bench_parser, run, write_json

TARGET_TTFT_P99_S = 0.3
TARGET_SPEEDUP = 3.0


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _tokens(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def run_load(llm, n: int, doc_tokens: int, questions: int, q_tokens: int, answer_tokens: int, gap_s: float,
             shared: bool, salt: int = 0) -> dict:
    """One load through ``llm``'s engine (module docstring); returns the mode's row. ``salt``
    changes every token (a warm-up load shares no prefix with the measured one)."""
    from xoffload import SamplingParams

    e, V = llm.engine, llm.cfg.vocab_size
    sp = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    docs = [_tokens(doc_tokens, V, salt + (0 if shared else 1 + i)) for i in range(n)]
    qs = [[_tokens(q_tokens, V, salt + 1000 + 10 * i + k) for k in range(questions)] for i in range(n)]
    sessions = [llm.session() for _ in range(n)]
    turn, due, owner = [0] * n, [i * gap_s for i in range(n)], {}
    rows, steps, epochs = [], [], set()
    cuda = llm.device.type == "cuda"
    start = e.clock.mark()
    t0 = time.perf_counter()
    while any(t < questions for t in turn) or e.has_unfinished_requests():
        now = time.perf_counter() - t0
        for i in range(n):
            if turn[i] < questions and not sessions[i].queued and due[i] is not None and due[i] <= now:
                msg = (docs[i] + qs[i][0]) if turn[i] == 0 else qs[i][turn[i]]
                owner[sessions[i].submit(msg, sp)] = (i, turn[i])
                turn[i] += 1
                due[i] = None
        if not e.has_unfinished_requests():
            nxt = min((d for d in due if d is not None), default=None)
            if nxt is not None:
                time.sleep(max(0.0, nxt - (time.perf_counter() - t0)))
            continue
        for o in e.step():
            if not o.finished:
                continue
            i, k = owner[o.request_id]
            if getattr(o, "error", None) is not None:  # a refused or failed turn ends the load, loudly
                raise RuntimeError(f"conversation {i} turn {k} ended with {o.finish_reason}: {o.error}")
            t = o.timings
            rows.append({"conv": i, "turn": k, "ttft_ms": t.get("queue_ms", 0.0) + t["ttft_ms"],
                         "chunk_tokens": t.get("chunk_tokens"), "history_tokens": t.get("history_tokens"),
                         "tokens": len(o.token_ids), "h2d_bytes_per_token": t.get("h2d_bytes_per_token")})
            due[i] = time.perf_counter() - t0
        if id(e.stats) not in epochs and e.stats:
            epochs.add(id(e.stats))
            steps.extend(s["ms"] for s in e.stats["decode_steps"][2:])
    end = e.clock.mark()
    if cuda:
        end.synchronize()
    for s in sessions:
        s.close()
    total_ms = e.clock.ms(start, end)
    follow = [r["ttft_ms"] for r in rows if r["turn"] > 0]
    gen = sum(r["tokens"] for r in rows)
    h2d = [r["h2d_bytes_per_token"] for r in rows if r["h2d_bytes_per_token"] is not None]
    return {
        "convs": n, "turns": len(rows), "generated_tokens": gen, "total_ms": total_ms,
        "tok_per_s": gen / total_ms * 1e3 if total_ms > 0 else None,
        "ttft_ms_p50": _pct([r["ttft_ms"] for r in rows], 50), "ttft_ms_p99": _pct([r["ttft_ms"] for r in rows], 99),
        "followup_ttft_ms_p50": _pct(follow, 50), "followup_ttft_ms_p99": _pct(follow, 99),
        "itl_ms_p50": _pct(steps, 50), "itl_ms_p99": _pct(steps, 99),
        "h2d_bytes_per_token": statistics.mean(h2d) if h2d else None,
        "followup_chunk_tokens_mean": statistics.mean([r["chunk_tokens"] for r in rows if r["turn"] > 0] or [0]),
        "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
        "host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "requests": rows,
    }


MODES = {
    "offload+quest": dict(mode="offload", sparse_decode="quest", prefix_caching=True),
    "reprefill": dict(mode="offload", sparse_decode="quest", prefix_caching=False),
    "resident": dict(mode="resident", prefix_caching=True),
}


def main(argv=None):
    ap = bench_parser(__doc__, "conversations", "N = 8 only, 2 questions")
    ap.add_argument("--shape", default="llama-3.1-8b", help="random-weight preset")
    ap.add_argument("--convs", default="4,8,16", help="conversation counts N")
    ap.add_argument("--doc-tokens", type=int, default=32768)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--q-tokens", type=int, default=64, help="tokens per question")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=250.0, help="arrival gap between conversations")
    ap.add_argument("--docs", choices=("own", "shared"), default="own")
    ap.add_argument("--modes", default="offload+quest,reprefill,resident")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (0: none)")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="offload modes: chunked prefill with this many tokens per step (default / 0: off)")
    a = ap.parse_args(argv)
    from xoffload import LLM
    from xoffload.models import random_model

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    convs = [8] if a.quick else [int(x) for x in a.convs.split(",")]
    questions = 2 if a.quick else a.questions
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    if cuda and a.cap_gib > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    model = random_model(a.shape, dtype=torch.bfloat16 if cuda else torch.float32, device=dev, seed=0)
    max_len = a.doc_tokens + questions * (a.q_tokens + a.answer_tokens) + 64
    res = {"shape": a.shape, "doc_tokens": a.doc_tokens, "questions": questions, "q_tokens": a.q_tokens,
           "answer_tokens": a.answer_tokens, "gap_ms": a.gap_ms, "docs": a.docs, "cap_gib": a.cap_gib,
           "chunk_tokens": a.chunk_tokens, "results": {}}
    for n in convs:
        for mode in modes:
            kw = dict(MODES[mode], max_num_seqs=n, max_model_len=max_len)
            if kw["mode"] == "offload":
                kw["kv_cache_tokens"] = n * (max_len + 1024)
                if a.chunk_tokens == 0:
                    kw["enable_chunked_prefill"] = False
                elif a.chunk_tokens:
                    kw.update(enable_chunked_prefill=True, max_num_batched_tokens=a.chunk_tokens)
            if not cuda:
                kw.update(prefill_attn="sdpa", kv_block_size=64)
            llm = LLM(model, **kw)
            try:
                # warm-up (kernel compilation, first graph captures): two conversations over a
                # document of a few chunks, sharing no token with the measured load
                run_load(llm, min(n, 2), min(a.doc_tokens, 3 * (a.chunk_tokens or 4096) + 100), 2, a.q_tokens,
                         a.answer_tokens, 0.0, a.docs == "shared", salt=10**6)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                row = run_load(llm, n, a.doc_tokens, questions, a.q_tokens, a.answer_tokens, a.gap_ms / 1e3,
                               a.docs == "shared")
            except (RuntimeError, ValueError) as err:  # e.g. out of memory under the cap
                row = {"convs": n, "status": f"{type(err).__name__}: {str(err)[:300]}"}
            finally:
                llm.close()
                del llm
                if cuda:
                    torch.cuda.empty_cache()
            res["results"][f"{mode}/{n}"] = row
            print(f"{mode:14s} N={n:2d}: " + (row.get("status") or
                  f"{row['tok_per_s']:.1f} tok/s, follow-up TTFT p50/p99 {row['followup_ttft_ms_p50']:.0f}/"
                  f"{row['followup_ttft_ms_p99']:.0f} ms, ITL p50/p99 {row['itl_ms_p50']:.1f}/{row['itl_ms_p99']:.1f} ms"),
                  flush=True)
            write_json(a.out, res)
    q = {n: res["results"].get(f"offload+quest/{n}", {}) for n in convs}
    r = {n: res["results"].get(f"resident/{n}", {}) for n in convs}
    res["targets"] = {str(n): {
        "followup_ttft_p99_s": (q[n].get("followup_ttft_ms_p99") or 0) / 1e3 if q[n].get("followup_ttft_ms_p99") else None,
        "followup_ttft_p99_target_s": TARGET_TTFT_P99_S,
        "speedup_vs_resident": (q[n]["tok_per_s"] / r[n]["tok_per_s"]) if q[n].get("tok_per_s") and r[n].get("tok_per_s") else None,
        "speedup_target": TARGET_SPEEDUP} for n in convs}
    path = write_json(a.out, res)
    _plot(res, path.replace(".json", ".png"))
    print(f"wrote {path}")
    return 0


def _plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for mode in MODES:
        pts = [(v["convs"], v) for k, v in res["results"].items() if k.startswith(mode + "/") and "tok_per_s" in v]
        if not pts:
            continue
        xs = [n for n, _ in pts]
        axes[0].plot(xs, [v["tok_per_s"] for _, v in pts], "o-", label=mode)
        axes[1].plot(xs, [v["followup_ttft_ms_p99"] / 1e3 for _, v in pts], "o-", label=mode)
    axes[0].set(xlabel="conversations", ylabel="generated tok/s", title="throughput")
    axes[1].set(xlabel="conversations", ylabel="s", title="follow-up TTFT p99")
    axes[1].axhline(TARGET_TTFT_P99_S, color="gray", ls=":")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['shape']}, {res['doc_tokens']}-token documents, {res['cap_gib']} GiB cap")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    run(main)
