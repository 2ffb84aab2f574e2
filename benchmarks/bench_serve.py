"""The OpenAI-compatible server under load: conversations and a stream of short requests over HTTP,
and the same conversations through the engine directly.

For each mode (``--modes``) and each K in ``--users`` the server (:func:`xoffload.serve.create_app`
on uvicorn, in this process, on a free port) gets an engine with ``max_num_seqs = K`` and K users,
``--gap-ms`` apart, each holding a ``--turns``-turn conversation over its own ``--doc-tokens``
document (streamed completions of token ids, temperature 0, ``--answer-tokens`` each): the first
turn sends the document and a question, each later turn re-sends the whole history plus a new
question as soon as the previous answer is complete (automatic prefix caching finds the history's
KV). The random-weight model has no tokenizer, so the server streams no text: the answer a
follow-up re-sends is a stand-in of the answer's length (the prefill work of a real follow-up).
Then ``--short-requests`` short requests (``--short-concurrency`` at a time) run against the
largest K's server.

``--offline`` runs the same conversations through an engine of the same options without HTTP
(:func:`offline_conversations`: ``add_request`` / ``step`` on this thread): the same prompts,
stand-in answers included, the same arrival times and turn-taking, the same sampling, the same
host-clock measurements, and reports the HTTP / offline throughput ratio and both paths' prompt
and prefix-cache token counts (equal when the server loses no prefix hit).

Before each path is timed it runs the same load over other tokens (``--no-warmup``: none): every
prompt length, context length and batch size the load reaches has then compiled its kernels and
captured its CUDA graphs. A warm-up of shorter prompts leaves some of that to the timed load, and
what is cached per process to whichever path runs first (e.g. Quest's top-k kernel is compiled per
power of two of the page count: 4K-token prompts do not compile the 32K one).

The load generator runs in a process of its own (``--client process``, default), so the server's
process holds the server and the engine only, as in a deployment: client Python in the server's
process holds the GIL that the engine thread takes back after every operation it launches, and
each hand-back waits up to the interpreter's switch interval while the client runs (CPU: a decode
step of the tiny model 4x slower while another thread runs ``openai``'s request building).
``--client inline`` runs it on this process's main thread instead. Requests go through ``httpx``
with the JSON body built before the clock starts (``--client-lib httpx``, default);
``--client-lib openai`` sends them through ``openai.AsyncOpenAI``, which walks a token-id prompt
element by element in Python before sending (~0.8 s for 32K ids on a loaded CPU core), time that
then counts in the client's TTFT and, inline, blocks the engine thread.

Reported per mode and K: TTFT p50/p99 of first turns and of follow-ups (host clock: request sent to
first streamed token), inter-token latency p50/p99 (gaps between a request's token arrivals),
generated tok/s over the load (wall clock), errors, prompt tokens and the prefix-cache tokens of
the follow-ups; the offline row has the same fields; for the short requests: TTFT, tok/s, errors,
the server process's host RSS and GPU memory (allocated, reserved) at their start and end.

``python benchmarks/bench_serve.py --modes offload+quest,resident --offline`` (GPU, Llama-3.1-8B
shape); ``--tiny`` runs the same code on a CPU with the tiny model in seconds (tests/benchmarks).
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import torch

from _common import HAS_CUDA, bench_parser, run, write_json
from bench_conversations import MODES, _pct, _tokens

#: added to every token seed of the warm-up load (it shares no prefix with the measured one)
WARMUP_SALT = 10**6


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


# ---------------------------------------------------------------------- the load, both paths
def _documents(k: int, a, vocab: int, salt: int) -> tuple:
    """Each user's document and questions (token ids)."""
    docs = [_tokens(a.doc_tokens, vocab, salt + 1 + i) for i in range(k)]
    qs = [[_tokens(a.q_tokens, vocab, salt + 1000 + 10 * i + j) for j in range(a.turns)] for i in range(k)]
    return docs, qs


def _prompt(docs, qs, history: list, i: int, j: int) -> list:
    """User ``i``'s turn ``j``: the document and the first question, or the history and a new one."""
    return (docs[i] + qs[i][0]) if j == 0 else history + qs[i][j]


def _history(ids: list, answered: int, a, vocab: int, salt: int, i: int, j: int) -> list:
    """The conversation after turn ``j``: its prompt and a stand-in of the answer's length."""
    return ids + _tokens(answered or a.answer_tokens, vocab, salt + 5000 + 10 * i + j)


# ---------------------------------------------------------------------- HTTP clients
class _HttpxClient:
    """Streamed completions through ``httpx``: the JSON body is built before the clock starts and
    the Server-Sent Events are read line by line."""

    def __init__(self, url: str, name: str):
        import httpx

        self.name = name
        self.http = httpx.AsyncClient(base_url=url, timeout=3600.0,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                      headers={"Authorization": "Bearer bench", "Content-Type": "application/json"})

    async def turn(self, ids: list, max_tokens: int) -> dict:
        """One streamed completion: its timings (host clock) and usage, or the error."""
        body = json.dumps({"model": self.name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        stamps, usage = [], None
        t0 = time.perf_counter()
        try:
            async with self.http.stream("POST", "/v1/completions", content=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return {"error": f"HTTP {resp.status_code}: {text[:200]}"}
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return {"error": f"server error: {str(chunk['error'].get('message'))[:200]}"}
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                        stamps.append(time.perf_counter())
        except Exception as e:  # counted, the load goes on
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if usage is None:
            return {"error": "no usage chunk"}
        return _turn_row(t0, stamps, usage["completion_tokens"], usage["prompt_tokens"],
                         (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    async def aclose(self) -> None:
        await self.http.aclose()


class _OpenAIClient:
    """Streamed completions through ``openai.AsyncOpenAI`` (its request building, a Python walk
    over the prompt's ids, counts in the TTFT)."""

    def __init__(self, url: str, name: str):
        import openai

        self.name = name
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)

    async def turn(self, ids: list, max_tokens: int) -> dict:
        """One streamed completion: its timings (host clock) and usage, or the error."""
        t0 = time.perf_counter()
        stamps, usage = [], None
        try:
            stream = await self.client.completions.create(model=self.name, prompt=ids, max_tokens=max_tokens,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                elif chunk.choices and chunk.choices[0].finish_reason is None:
                    stamps.append(time.perf_counter())
        except Exception as e:  # counted, the load goes on
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if usage is None:
            return {"error": "no usage chunk"}
        d = usage.prompt_tokens_details
        return _turn_row(t0, stamps, usage.completion_tokens, usage.prompt_tokens,
                         (d.cached_tokens if d is not None else 0) or 0)

    async def aclose(self) -> None:
        await self.client.close()


CLIENT_LIBS = {"httpx": _HttpxClient, "openai": _OpenAIClient}


def _turn_row(t0: float, stamps: list, tokens: int, prompt_tokens: int, cached: int) -> dict:
    return {"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens, "prompt_tokens": prompt_tokens, "cached_tokens": cached}


async def conversations(url: str, name: str, k: int, a, vocab: int, salt: int = 0) -> dict:
    """K users over HTTP, each a ``a.turns``-turn conversation (module docstring); the load's row."""
    client = CLIENT_LIBS[a.client_lib](url, name)
    docs, qs = _documents(k, a, vocab, salt)
    rows = []

    async def user(i):
        await asyncio.sleep(i * a.gap_ms / 1e3)
        history = []
        for j in range(a.turns):
            ids = _prompt(docs, qs, history, i, j)
            r = await client.turn(ids, a.answer_tokens)
            rows.append(dict(r, user=i, turn=j))
            history = _history(ids, r.get("tokens"), a, vocab, salt, i, j)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(k)))
    wall = time.perf_counter() - t0
    await client.aclose()
    return _summary(rows, wall, users=k)


async def short_requests(url: str, name: str, a, vocab: int) -> dict:
    """``a.short_requests`` short completions, ``a.short_concurrency`` at a time."""
    client = CLIENT_LIBS[a.client_lib](url, name)
    rows, todo = [], list(range(a.short_requests))

    async def worker():
        while todo:
            i = todo.pop()
            r = await client.turn(_tokens(a.short_prompt_tokens, vocab, 20000 + i), a.short_answer_tokens)
            rows.append(dict(r, user=i, turn=0))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.short_concurrency)))
    wall = time.perf_counter() - t0
    await client.aclose()
    return _summary(rows, wall, requests=a.short_requests)


def _client_job(job: str, url: str, name: str, k: int, a, vocab: int, salt: int = 0) -> dict:
    """One load of the HTTP clients (``job``: ``"conversations"`` or ``"short"``), run to the end
    on a fresh event loop; the load's row, with ``client_pid`` (the process it ran in). Runs in the
    load generator's process."""
    if job == "conversations":
        row = asyncio.run(conversations(url, name, k, a, vocab, salt))
    elif job == "short":
        row = asyncio.run(short_requests(url, name, a, vocab))
    else:
        raise ValueError(f"unknown client job {job!r}")
    return dict(row, client_pid=os.getpid())


class LoadGenerator:
    """Where the HTTP clients run: a spawned process of their own (``"process"``: the server's
    process keeps its GIL to itself) or this process's calling thread (``"inline"``). Call it with
    :func:`_client_job`'s arguments; :meth:`close` at the end (also a context manager)."""

    def __init__(self, where: str = "process"):
        if where not in ("process", "inline"):
            raise ValueError(f"where must be 'process' or 'inline', got {where!r}")
        self.where = where
        self._pool = None
        if where == "process":
            import concurrent.futures
            import multiprocessing

            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, *args) -> dict:
        if self._pool is None:
            return _client_job(*args)
        return self._pool.submit(_client_job, *args).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------- the engine directly
def offline_conversations(engine, k: int, a, vocab: int, salt: int = 0) -> dict:
    """The conversations of :func:`conversations` through ``engine`` (an
    :class:`~xoffload.engine.LLMEngine` nobody else steps) on this thread, no HTTP: the same
    prompts (stand-in answers included), arrival times, turn-taking (a user's next turn is added as
    soon as its answer's final output is back), sampling (temperature 0, ``a.answer_tokens``) and
    host-clock measurements (TTFT: ``add_request`` to the first output with a token; ITL: gaps
    between a request's outputs with new tokens). Returns the load's row (:func:`_summary`)."""
    from xoffload import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=a.answer_tokens)
    docs, qs = _documents(k, a, vocab, salt)
    turn, due, history, busy = [0] * k, [i * a.gap_ms / 1e3 for i in range(k)], [[] for _ in range(k)], [False] * k
    live, rows = {}, []

    def answered(i, j, ids, n):
        busy[i], turn[i], due[i] = False, j + 1, time.perf_counter() - t0
        history[i] = _history(ids, n, a, vocab, salt, i, j)

    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        for i in range(k):
            if not busy[i] and turn[i] < a.turns and due[i] <= now:
                j = turn[i]
                ids = _prompt(docs, qs, history[i], i, j)
                rid = f"offline-{salt}-{i}-{j}"
                sent = time.perf_counter()
                try:
                    engine.add_request(rid, ids, sp)
                except (ValueError, TypeError) as e:  # what the server answers with a 400
                    rows.append({"error": f"{type(e).__name__}: {str(e)[:200]}", "user": i, "turn": j})
                    answered(i, j, ids, 0)
                    continue
                busy[i] = True
                live[rid] = {"user": i, "turn": j, "ids": ids, "sent": sent, "stamps": [], "n": 0}
        if not engine.has_unfinished_requests():
            nxt = [due[i] for i in range(k) if not busy[i] and turn[i] < a.turns]
            if not nxt:
                break
            time.sleep(max(0.0, min(nxt) - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            r = live.get(o.request_id)
            if r is None:
                continue
            if len(o.token_ids) > r["n"]:
                r["stamps"].append(t)
                r["n"] = len(o.token_ids)
            if not o.finished:
                continue
            del live[o.request_id]
            if o.finish_reason == "error":
                rows.append({"error": f"engine: {type(o.error).__name__}: {str(o.error)[:200]}", "user": r["user"],
                             "turn": r["turn"]})
            else:
                rows.append(dict(_turn_row(r["sent"], r["stamps"], len(o.token_ids), len(r["ids"]),
                                           int(o.num_cached_tokens or 0)), user=r["user"], turn=r["turn"]))
            answered(r["user"], r["turn"], r["ids"], len(o.token_ids))
    wall = time.perf_counter() - t0
    return _summary(rows, wall, users=k)


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
                prompt_tokens=sum(r["prompt_tokens"] for r in ok),
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
                    help="time from a cold start (default: the same load over other tokens first, on each path)")
    ap.add_argument("--client", choices=("process", "inline"), default="process",
                    help="where the load generator runs: a process of its own (default) or this process, "
                         "sharing the server's GIL")
    ap.add_argument("--client-lib", choices=tuple(CLIENT_LIBS), default="httpx",
                    help="httpx with the body built before the clock starts (default) or openai.AsyncOpenAI")
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

    missing = [m for m in ("fastapi", "uvicorn", a.client_lib) if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"needs {', '.join(missing)}: pip install fastapi uvicorn {a.client_lib}")
    from xoffload.serve import create_app
    from xoffload.serve.background import BackgroundServer
    from xoffload import LLMEngine
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
           "client": a.client, "client_lib": a.client_lib, "warmup": not a.no_warmup, "server_pid": os.getpid(),
           "short": {"requests": a.short_requests, "concurrency": a.short_concurrency,
                     "prompt_tokens": a.short_prompt_tokens, "answer_tokens": a.short_answer_tokens},
           "results": {}}
    with LoadGenerator(a.client) as clients:
        for mode in modes:
            for k in users:
                key = f"{mode}/{k}"
                row = {}
                try:
                    app = create_app(LLMEngine(model, **_engine_kw(mode, k, max_len, a)), a.shape, max_queue=None)
                    with BackgroundServer(app, graceful_s=30.0) as srv:
                        if not a.no_warmup:
                            clients("conversations", srv.url, a.shape, k, a, V, WARMUP_SALT)
                        row = clients("conversations", srv.url, a.shape, k, a, V)
                        if k == users[-1] and a.short_requests > 0:
                            before = _memory()
                            row["short"] = dict(clients("short", srv.url, a.shape, k, a, V), memory_start=before,
                                                memory_end=_memory())
                except (RuntimeError, ValueError) as err:  # e.g. out of memory under the cap
                    row = dict(row, status=f"{type(err).__name__}: {str(err)[:300]}")
                if a.offline and "status" not in row:
                    engine = LLMEngine(model, **_engine_kw(mode, k, max_len, a))
                    try:
                        if not a.no_warmup:
                            offline_conversations(engine, k, a, V, WARMUP_SALT)
                        row["offline"] = offline_conversations(engine, k, a, V)
                    finally:
                        engine.close()
                    row["http_over_offline_tok_per_s"] = (row["tok_per_s"] / row["offline"]["tok_per_s"]
                                                          if row.get("tok_per_s") and row["offline"].get("tok_per_s")
                                                          else None)
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


def _load_line(label: str, r: dict) -> str:
    return (f"{label:18s} {_fmt(r['tok_per_s'], '.1f')} tok/s, TTFT first p50/p99 {_fmt(r['ttft_first_ms_p50'])}/"
            f"{_fmt(r['ttft_first_ms_p99'])} ms, follow-up {_fmt(r['ttft_followup_ms_p50'])}/"
            f"{_fmt(r['ttft_followup_ms_p99'])} ms, ITL p50/p99 {_fmt(r['itl_ms_p50'], '.1f')}/"
            f"{_fmt(r['itl_ms_p99'], '.1f')} ms, {r['errors']} errors, prompt/cached tokens "
            f"{r['prompt_tokens']}/{r['cached_tokens']}")


def _line(key: str, r: dict) -> str:
    if "status" in r:
        return f"{key:18s} {r['status']}"
    s = _load_line(key, r)
    if "offline" in r:
        s += "\n" + _load_line("  offline", r["offline"])
    if r.get("http_over_offline_tok_per_s") is not None:
        s += f"\n{'':18s} HTTP/offline tok/s {r['http_over_offline_tok_per_s']:.2f}"
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
