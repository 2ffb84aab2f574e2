"""The OpenAI-compatible server under load: conversations and a stream of short requests over HTTP.

For each mode (``--modes``) and each K in ``--users`` the server (:func:`xoffload.serve.create_app`
on uvicorn, in this process, on a free port) gets an engine with ``max_num_seqs = K`` and K users,
``--gap-ms`` apart, each holding a ``--turns``-turn conversation over its own ``--doc-tokens``
document through ``openai.AsyncOpenAI`` (streamed completions of token ids): the first turn sends
the document and a question, each later turn re-sends the whole history plus a new question
(automatic prefix caching finds the history's KV). Before it, K requests over other prompts warm
each path up (kernels compiled, CUDA graphs captured; ``--no-warmup``: none). The documents and questions are
:mod:`bench_conversations`' own, so ``--offline`` runs the same load through the engine directly
(its ``run_load``: no HTTP) and reports the throughput ratio. The random-weight model has no
tokenizer, so the server streams no text: the answer a follow-up re-sends is a stand-in of the
answer's length (the prefill work of a real follow-up). Then ``--short-requests`` short requests
(``--short-concurrency`` at a time) run against the largest K's server.

Reported per mode and K: TTFT p50/p99 of first turns and of follow-ups (client clock: request sent
to first streamed token), inter-token latency p50/p99 (gaps between streamed token chunks),
generated tok/s over the load, errors, the prefix-cache tokens the server reported; for the short
requests: TTFT, tok/s, errors, host RSS and GPU memory (allocated, reserved) at their start and end.
Client, server and engine share this process (and its GIL): the latencies include the client's
own work.

``python benchmarks/bench_serve.py --modes offload+quest,resident --offline`` (GPU, Llama-3.1-8B
shape); ``--tiny`` runs the same code on a CPU with the tiny model in seconds (tests/benchmarks).
"""
from __future__ import annotations

import asyncio
import os
import time

import torch

from _common import HAS_CUDA, bench_parser, run, write_json
from bench_conversations import MODES, _pct, _tokens, run_load


def _rss_bytes() -> int:
    """The process's resident set size now (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _memory() -> dict:
    m = {"host_rss_bytes": _rss_bytes()}
    if HAS_CUDA:
        m.update(gpu_allocated_bytes=int(torch.cuda.memory_allocated()),
                 gpu_reserved_bytes=int(torch.cuda.memory_reserved()))
    return m


async def _turn(client, name: str, ids: list, max_tokens: int) -> dict:
    """One streamed completion; returns its timings (host clock) and usage, or the error."""
    t0 = time.perf_counter()
    stamps, usage = [], None
    try:
        stream = await client.completions.create(model=name, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            elif chunk.choices and chunk.choices[0].finish_reason is None:
                stamps.append(time.perf_counter())
    except Exception as e:  # counted, the load goes on
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if usage is None:
        return {"error": "no usage chunk"}
    return {"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])],
            "tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}


async def conversations(url: str, name: str, k: int, a, vocab: int) -> dict:
    """K users, each a ``a.turns``-turn conversation (module docstring); the load's row."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
    docs = [_tokens(a.doc_tokens, vocab, 1 + i) for i in range(k)]
    qs = [[_tokens(a.q_tokens, vocab, 1000 + 10 * i + j) for j in range(a.turns)] for i in range(k)]
    rows = []

    async def user(i):
        await asyncio.sleep(i * a.gap_ms / 1e3)
        history = []
        for j in range(a.turns):
            ids = (docs[i] + qs[i][0]) if j == 0 else history + qs[i][j]
            r = await _turn(client, name, ids, a.answer_tokens)
            rows.append(dict(r, user=i, turn=j))
            history = ids + _tokens(r.get("tokens") or a.answer_tokens, vocab, 5000 + 10 * i + j)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(k)))
    wall = time.perf_counter() - t0
    await client.close()
    return _summary(rows, wall, users=k)


async def warmup(url: str, name: str, k: int, a, vocab: int) -> None:
    """K requests at once over prompts no measured load shares (kernels compiled, CUDA graphs of the
    batch sizes captured before anything is timed)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
    await asyncio.gather(*(_turn(client, name, p, 4) for p in _warmup_prompts(k, a, vocab)))
    await client.close()


def _warmup_prompts(k: int, a, vocab: int) -> list:
    return [_tokens(min(a.doc_tokens, 4096), vocab, 900 + i) for i in range(k)]


async def short_requests(url: str, name: str, a, vocab: int) -> dict:
    """``a.short_requests`` short completions, ``a.short_concurrency`` at a time; memory before and
    after."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
    before = _memory()
    rows, todo = [], list(range(a.short_requests))

    async def worker():
        while todo:
            i = todo.pop()
            r = await _turn(client, name, _tokens(a.short_prompt_tokens, vocab, 20000 + i), a.short_answer_tokens)
            rows.append(dict(r, user=i, turn=0))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.short_concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return dict(_summary(rows, wall, requests=a.short_requests), memory_start=before, memory_end=_memory())


def _summary(rows: list, wall_s: float, **head) -> dict:
    ok = [r for r in rows if "error" not in r]
    first = [r["ttft_ms"] for r in ok if r["turn"] == 0 and r["ttft_ms"] is not None]
    follow = [r["ttft_ms"] for r in ok if r["turn"] > 0 and r["ttft_ms"] is not None]
    itl = [x for r in ok for x in r["itl_ms"]]
    gen = sum(r["tokens"] for r in ok)
    return dict(head, turns=len(rows), errors=len(rows) - len(ok), error_examples=[r["error"] for r in rows
                                                                                    if "error" in r][:3],
                generated_tokens=gen, wall_s=wall_s, tok_per_s=gen / wall_s if wall_s > 0 else None,
                ttft_first_ms_p50=_pct(first, 50), ttft_first_ms_p99=_pct(first, 99),
                ttft_followup_ms_p50=_pct(follow, 50), ttft_followup_ms_p99=_pct(follow, 99),
                itl_ms_p50=_pct(itl, 50), itl_ms_p99=_pct(itl, 99),
                cached_tokens=sum(r["cached_tokens"] for r in ok if r["turn"] > 0))


def _engine_kw(mode: str, k: int, max_len: int, a) -> dict:
    kw = dict(MODES[mode], max_num_seqs=k, max_model_len=max_len)
    if kw["mode"] == "offload":
        kw["kv_cache_tokens"] = k * (max_len + 1024)
    if not HAS_CUDA:
        kw.update(prefill_attn="sdpa", kv_block_size=64)
    return kw


def _parser():
    ap = bench_parser(__doc__, "serve", "K = 8 only, 2 turns, 200 short requests")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama, short documents, a few requests")
    ap.add_argument("--shape", default="llama-3.1-8b", help="random-weight preset (default llama-3.1-8b)")
    ap.add_argument("--users", default="4,8,16", help="concurrent users K, comma-separated (default 4,8,16)")
    ap.add_argument("--doc-tokens", type=int, default=32768, help="tokens of each user's document (default 32768)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    ap.add_argument("--q-tokens", type=int, default=64, help="tokens per question (default 64)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer (default 32)")
    ap.add_argument("--gap-ms", type=float, default=250.0, help="arrival gap between users (default 250)")
    ap.add_argument("--short-requests", type=int, default=1000, help="short requests after the conversations")
    ap.add_argument("--short-concurrency", type=int, default=16, help="short requests in flight at once")
    ap.add_argument("--short-prompt-tokens", type=int, default=128, help="prompt tokens of a short request")
    ap.add_argument("--short-answer-tokens", type=int, default=16, help="answer tokens of a short request")
    ap.add_argument("--modes", default="offload+quest", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--offline", action="store_true", help="also run each load through the engine without HTTP")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time from a cold start (default: K requests over other prompts first, on each path)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (0: none; default 24)")
    return ap


def main(argv=None):
    ap = _parser()
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    try:
        users = [int(x) for x in a.users.split(",")]
        assert users and min(users) >= 1
    except (ValueError, AssertionError):
        ap.error(f"--users must be positive integers, comma-separated, got {a.users!r}")
    if a.tiny:
        a.shape, a.doc_tokens, a.q_tokens, a.answer_tokens, a.gap_ms = "tiny-llama", 160, 8, 3, 5.0
        users, a.turns, a.short_requests, a.short_concurrency, a.short_prompt_tokens, a.short_answer_tokens = \
            [2], 2, 6, 3, 16, 2
    elif a.quick:
        users, a.turns, a.short_requests = [8], 2, 200
    if not HAS_CUDA and not a.tiny:
        print("bench_serve: no CUDA GPU, skipped (use --tiny for the CPU smoke run)")
        return 0
    import importlib.util

    missing = [m for m in ("openai", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"needs {', '.join(missing)}: pip install fastapi uvicorn openai")
    from xoffload.serve import create_app
    from xoffload.serve.background import BackgroundServer
    from xoffload import LLM, LLMEngine, SamplingParams
    from xoffload.models import random_model

    if HAS_CUDA and a.cap_gib > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    model = random_model(a.shape, dtype=torch.bfloat16 if HAS_CUDA else torch.float32,
                         device="cuda" if HAS_CUDA else "cpu", seed=0)
    V = model.cfg.vocab_size
    max_len = a.doc_tokens + a.turns * (a.q_tokens + a.answer_tokens) + 64
    res = {"shape": a.shape, "doc_tokens": a.doc_tokens, "turns": a.turns, "q_tokens": a.q_tokens,
           "answer_tokens": a.answer_tokens, "gap_ms": a.gap_ms, "cap_gib": a.cap_gib, "users": users,
           "short": {"requests": a.short_requests, "concurrency": a.short_concurrency,
                     "prompt_tokens": a.short_prompt_tokens, "answer_tokens": a.short_answer_tokens},
           "results": {}}
    for mode in modes:
        for k in users:
            key = f"{mode}/{k}"
            row = {}
            try:
                app = create_app(LLMEngine(model, **_engine_kw(mode, k, max_len, a)), a.shape, max_queue=None)
                with BackgroundServer(app, graceful_s=30.0) as srv:
                    if not a.no_warmup:
                        asyncio.run(warmup(srv.url, a.shape, k, a, V))
                    row = asyncio.run(conversations(srv.url, a.shape, k, a, V))
                    if k == users[-1] and a.short_requests > 0:
                        row["short"] = asyncio.run(short_requests(srv.url, a.shape, a, V))
            except (RuntimeError, ValueError) as err:  # e.g. out of memory under the cap
                row = dict(row, status=f"{type(err).__name__}: {str(err)[:300]}")
            if a.offline and "status" not in row:
                llm = LLM(model, **_engine_kw(mode, k, max_len, a))
                try:
                    if not a.no_warmup:
                        llm.generate(_warmup_prompts(k, a, V), SamplingParams(max_tokens=4))
                    off = run_load(llm, k, a.doc_tokens, a.turns, a.q_tokens, a.answer_tokens, a.gap_ms / 1e3, False)
                finally:
                    llm.close()
                row["offline"] = {x: off[x] for x in ("tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "followup_ttft_ms_p50",
                                                      "followup_ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")}
                row["http_over_offline_tok_per_s"] = (row["tok_per_s"] / off["tok_per_s"]
                                                      if row.get("tok_per_s") and off.get("tok_per_s") else None)
            if HAS_CUDA:
                torch.cuda.empty_cache()
            res["results"][key] = row
            print(_line(key, row), flush=True)
            write_json(a.out, res)
    path = write_json(a.out, res)
    _plot(res, path.replace(".json", ".png"))
    print(f"wrote {path}")
    return 0


def _fmt(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def _line(key: str, r: dict) -> str:
    if "status" in r:
        return f"{key:18s} {r['status']}"
    s = (f"{key:18s} {_fmt(r['tok_per_s'], '.1f')} tok/s, TTFT first p50/p99 {_fmt(r['ttft_first_ms_p50'])}/"
         f"{_fmt(r['ttft_first_ms_p99'])} ms, follow-up {_fmt(r['ttft_followup_ms_p50'])}/"
         f"{_fmt(r['ttft_followup_ms_p99'])} ms, ITL p50/p99 {_fmt(r['itl_ms_p50'], '.1f')}/"
         f"{_fmt(r['itl_ms_p99'], '.1f')} ms, {r['errors']} errors")
    if r.get("http_over_offline_tok_per_s") is not None:
        s += f", HTTP/offline tok/s {r['http_over_offline_tok_per_s']:.2f}"
    if "short" in r:
        sh = r["short"]
        s += (f"\n{'':18s} {sh['requests']} short: {_fmt(sh['tok_per_s'], '.1f')} tok/s, TTFT p50/p99 "
              f"{_fmt(sh['ttft_first_ms_p50'])}/{_fmt(sh['ttft_first_ms_p99'])} ms, {sh['errors']} errors, RSS "
              f"{sh['memory_start']['host_rss_bytes'] / 2**30:.2f} -> {sh['memory_end']['host_rss_bytes'] / 2**30:.2f} GiB")
    return s


def _plot(res: dict, path: str) -> None:
    """Throughput and follow-up TTFT p99 against K, one line per mode (and its offline run)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for mode in MODES:
        pts = sorted((int(k.split("/")[1]), v) for k, v in res["results"].items()
                     if k.startswith(mode + "/") and v.get("tok_per_s"))
        if not pts:
            continue
        xs = [n for n, _ in pts]
        axes[0].plot(xs, [v["tok_per_s"] for _, v in pts], "o-", label=f"{mode} HTTP")
        axes[1].plot(xs, [(v["ttft_followup_ms_p99"] or 0) / 1e3 for _, v in pts], "o-", label=f"{mode} HTTP")
        if all("offline" in v for _, v in pts):
            axes[0].plot(xs, [v["offline"]["tok_per_s"] for _, v in pts], "s--", label=f"{mode} offline")
    axes[0].set(xlabel="concurrent users K", ylabel="generated tok/s", title="throughput")
    axes[1].set(xlabel="concurrent users K", ylabel="s", title="follow-up TTFT p99")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"xoffload serve: {res['shape']}, {res['doc_tokens']}-token documents, {res['turns']} turns")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def test_bench_serve(benchmark):
    """pytest-benchmark entry: ``--quick`` on a GPU, the ``--tiny`` smoke run on a CPU."""
    import tempfile

    import json

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "serve.json")
        argv = (["--quick"] if HAS_CUDA else ["--tiny"]) + ["--out", out]
        assert benchmark.pedantic(lambda: main(argv), rounds=1, iterations=1) == 0
        with open(out) as f:
            res = json.load(f)
    for key, row in res["results"].items():
        benchmark.extra_info.update({f"{key}/{x}": row.get(x) for x in ("tok_per_s", "ttft_followup_ms_p99",
                                                                        "itl_ms_p99", "errors")})


if __name__ == "__main__":
    run(main)
