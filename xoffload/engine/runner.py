"""The device side of the step loop: one :class:`StepRunner` per *store epoch* of an
:class:`~.llm_engine.LLMEngine` (from the moment the engine goes busy until it is idle again).

It owns the epoch's batched KV store (:mod:`xoffload.kv`, chosen by :func:`~xoffload.kv.table.batch_store_class`),
its :class:`~.scheduler.Scheduler` and its CUDA graphs, and runs what one engine step does:
admit what fits (:meth:`Scheduler.admit`), prefill the admitted sequences (layerwise, into their
KV) and sample each one's first token; then one decode step for every running sequence (rows
padded to a batch-size bucket, replayed from that bucket's CUDA graph on a GPU,
:class:`~.cuda_graph.BatchGraphs`, a single request being a batch of one), each row sampled
with its own :class:`SamplingParams`
and generator. A sequence leaves the batch as soon as it has ``max_tokens`` tokens (known on the
host by counting) or the host has read a stop id among them (on a GPU read ``EOS_LAG`` steps late,
so the host never waits on the step it just launched); its KV is released and the next admission
fills its place: continuous batching.

Prefill groups (a store with ``batch_prefill``: the resident ones; dense prefill, one device):
the admitted sequences are taken in submission order and each one's tokens to prefill are counted
against the prefix cache as it is then (``store.prefill_tokens``). A sequence with more than
:data:`GROUP_PREFILL_MAX_TOKENS` of them is prefilled alone (the pending group first), so a long
prompt -- a shared document -- is registered before the prompts after it are counted: its
questions then count only their own tokens and join one group. Short ones are collected into a
group prefilled by one ``LlamaModel.prefill_batch`` (the weights read once, one attention launch
per layer), unless adding one would pass ``max_num_batched_tokens`` or it shares a whole block of
uncached prompt with a member (members of one group do not see each other's blocks); then the
group is prefilled first. When a member's allocation evicts cached blocks a later member counted
on, that member is prefilled by itself after the group. The token ids go through pinned memory:
nothing waits on the GPU.

Greedy sequences of a batch give the tokens they give alone (tests/engine/test_batch.py; on the
CPU bit for bit, on a GPU within the rounding of different GEMM shapes); sampled ones draw from
their own generator in the same order as alone.
"""
from __future__ import annotations

from collections import deque

import torch

from .cuda_graph import BatchGraphs
from ..kv.base import _to_device
from ..kv.batch_prefill import GROUP_PREFILL_MAX_TOKENS
from .request import EOS_LAG, Clock
from .sampling import sample
from .scheduler import Scheduler, Sequence

__all__ = ["StepRunner", "BatchTokenLog", "sample_rows", "headroom", "HEADROOM", "GROUP_PREFILL_MAX_TOKENS"]

#: a sequence's decode steps before its steady state (step 1 eager warm-up, step 2 graph capture)
STEADY_FROM = 2


#: a store is sized for prompts this much longer than the longest one waiting when it opens
HEADROOM = 1.25


def headroom(seqs, config):
    """A stand-in request that sizes a store (only its lengths are read): the longest waiting
    prompt times :data:`HEADROOM` (within ``max_model_len``), with the most new tokens asked."""
    from types import SimpleNamespace

    new = max(s.req.max_new for s in seqs)
    p = min(int(max(s.prompt_len for s in seqs) * HEADROOM) + 1, config.max_model_len - new + 1)
    p = max(p, max(s.prompt_len for s in seqs))
    return SimpleNamespace(prompt_len=p, final_len=p + new - 1, req=SimpleNamespace(max_new=new))


def _device_ids(ids: list, device) -> torch.Tensor:
    """int64 ``[len(ids)]`` on ``device`` without a host wait (pinned + asynchronous on CUDA)."""
    out = torch.empty(len(ids), dtype=torch.int64, device=device)
    _to_device(out, torch.tensor(ids, dtype=torch.int64))
    return out


def sample_rows(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """int64 ``[n]`` tokens for the first ``n = len(seqs)`` rows of fp32 ``logits [rows, V]``: one
    argmax for every greedy row, :func:`~.sampling.sample` with the sequence's own parameters and
    generator for each other row (on the device, no host read)."""
    n = len(seqs)
    out = logits[:n].argmax(-1)
    for b, s in enumerate(seqs):
        if s.req.sp.temperature > 0:
            out[b:b + 1] = sample(logits[b:b + 1], s.req.sp, s.req.gen)
    return out


class BatchTokenLog:
    """Sampled tokens as the host sees them: on a GPU each step's tokens are copied into pinned
    memory behind an event and read ``lag`` steps later (:meth:`poll`); on the CPU at once.
    Reading appends to each sequence's ``tokens`` and sets ``stopped`` on a stop id."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.q: deque = deque()

    def publish(self, toks: torch.Tensor, seqs: list) -> None:
        """``toks`` int64 ``[len(seqs)]`` on the device: row i is ``seqs[i]``'s new token."""
        if not self.cuda:
            self._deliver(toks.tolist(), seqs)
            return
        host = torch.empty(toks.shape[0], dtype=torch.int64, pin_memory=True)
        host.copy_(toks, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.q.append((ev, host, list(seqs)))

    def poll(self, lag: int) -> None:
        """Read every published step but the last ``lag`` (waiting on their events only)."""
        while len(self.q) > lag:
            ev, host, seqs = self.q.popleft()
            ev.synchronize()
            self._deliver(host.tolist(), seqs)

    @staticmethod
    def _deliver(vals: list, seqs: list) -> None:
        for s, v in zip(seqs, vals):
            if s.stopped:
                continue
            s.tokens.append(v)
            if v in s.req.stop:
                s.stopped = True


class StepRunner:
    """One store epoch of an engine: its batched store, scheduler, graphs and token log.

    Args:
        model: the :class:`~xoffload.models.llama.LlamaModel`.
        config: the engine's bound :class:`~.config.EngineConfig`.
        store: the epoch's opened batched store (:class:`~xoffload.kv.base.BatchKV`).
        clock: the engine's :class:`~.request.Clock`.

    Attributes: ``sched`` (the :class:`Scheduler`), ``steps`` (per decode step: sequences, rows,
    start and end marks), ``prefills`` (per prefill: tokens, marks, group size, call id).
    """

    def __init__(self, model, config, store, clock: Clock):
        self.m, self.config, self.store, self.clock = model, config, store, clock
        self.cuda = model.device.type == "cuda"
        # chunked prefill (kv.chunk): admission is not held to a token count, each step's
        # prefill work is (_prefill_chunked)
        self.chunked = bool(config.enable_chunked_prefill) and getattr(store, "chunked_prefill", False)
        self.sched = Scheduler(config.max_num_seqs, config.max_num_batched_tokens if not self.chunked else 1 << 62,
                               store)
        self.filling: list = []  # admitted, prefill not finished (chunked prefill)
        self.graphs = BatchGraphs(model, store, config.cuda_graph)
        self.log = BatchTokenLog(self.cuda)
        self.lag = EOS_LAG if self.cuda else 0
        self.steps, self.prefills, self.calls = [], [], 0
        self._batch, self._rows, self._prev = None, 0, None
        self._failed: list = []

    # ------------------------------------------------------------------ one engine step
    def step(self) -> list:
        """Admit, prefill, decode one step; returns the sequences that finished in it (their KV
        released). A sequence whose prefill raised is finished with ``error`` set."""
        sched = self.sched
        if self.chunked:
            short = min(GROUP_PREFILL_MAX_TOKENS, self.config.max_num_batched_tokens)
            self.filling += sched.admit(short, any(self._left(s) > short for s in self.filling))
            self._prefill_chunked()
        else:
            self._prefill_admitted(sched.admit())
        for s in sched.take_failed():  # their admission raised: they end alone
            self._fail(s, s.error, finished=True)
        self.log.poll(self.lag)
        done, self._failed = self._failed + self._retire(), []
        running = [s for s in sched.running if s.n_out]  # those whose prefill is done
        if running:
            self._decode(running)
        self.log.poll(self.lag if sched.running else 0)
        return done + self._retire()

    def drain(self) -> None:
        """Read every token published so far (the host waits on their events)."""
        self.log.poll(0)

    def _decode(self, running: list) -> None:
        clock = self.clock
        if running != self._batch:  # the batch changed: new rows, inputs from each sequence
            self._rows = self.store.set_batch(running)
            tokens = torch.cat([s.last_tok for s in running])
            self._batch = running
        else:
            tokens = self._prev
        rows = self._rows
        a = clock.mark()
        logits = self.graphs.step(rows, tokens)
        toks = sample_rows(logits, running)
        e = clock.mark()
        self.steps.append((len(running), rows, a, e))
        for b, s in enumerate(running):
            s.last_tok = toks[b:b + 1]
            s.n_out += 1
            s.steps += 1
            if s.steps == STEADY_FROM:
                s.marks["steady"] = e
        self.log.publish(toks, running)
        self._prev = toks

    def _retire(self) -> list:
        """Finish every running sequence that has all its tokens or whose stop id was read (its
        store's figures are read first: the KV goes with it)."""
        out = []
        for s in list(self.sched.running):
            if s.done_sampling:
                s.marks["end"] = self.clock.mark()
                s.h2d, s.stats = self.store.h2d_bytes_per_step(s), self.store.decode_stats(s)
                self.finish(s, "stop" if s.stopped else "length")
                out.append(s)
        return out

    def finish(self, s: Sequence, reason: str) -> None:
        """``s`` leaves (``reason``: ``stop``, ``length``, ``abort`` or ``error``): its KV
        are released at once; a waiting one is just dropped."""
        if "first" in s.marks:  # an abort after its prefill: its timings end here
            s.marks.setdefault("end", self.clock.mark())
        self.sched.finish(s, reason)
        if s in self.filling:
            self.filling.remove(s)
        if self._batch is not None and s in self._batch:
            self._batch = None

    # ------------------------------------------------------------------ prefill
    def _prefill_admitted(self, admitted: list) -> None:
        """Prefill what :meth:`Scheduler.admit` returned, alone or in groups (module docstring)."""
        store, cfg = self.store, self.config
        if not (store.batch_prefill and cfg.policy.dense and self.m.tp is None):
            for s in admitted:
                self._prefill_guarded(s)
            return
        group, tokens = [], 0

        def flush():
            if len(group) == 1:
                self._prefill_guarded(group[0])
            elif group:
                self._prefill_group(list(group))
            group.clear()

        for s in admitted:
            n = store.prefill_tokens(s)
            if group and (n > GROUP_PREFILL_MAX_TOKENS or tokens + n > cfg.max_num_batched_tokens
                          or self._shares_new_block(s, n, group)):
                flush()
                n = store.prefill_tokens(s)  # the group's prompts are registered now
            if n > GROUP_PREFILL_MAX_TOKENS:
                self._prefill_guarded(s)
                continue
            if not group:
                tokens = 0
            group.append(s)
            tokens += n
        flush()

    def _shares_new_block(self, s: Sequence, n: int, group: list) -> bool:
        """With a prefix cache: whether ``s`` (``n`` tokens to prefill) would reuse a whole block
        of a group member's prompt that is not cached yet."""
        store = self.store
        if getattr(store, "cache", None) is None:
            return False
        blk = store.block
        a = (s.prompt_len - n) // blk * blk
        e = a + blk
        ids = s.req.ids
        if e > len(ids) - 1:  # the match leaves out the last token (recomputed for its logits)
            return False
        return any(len(p.req.ids) >= e and p.req.ids[a:e] == ids[a:e] and p.req.ids[:a] == ids[:a] for p in group)

    def _prefill_guarded(self, s: Sequence, started: bool = False) -> None:
        """:meth:`_prefill`; a ValueError / TypeError / MemoryError from it (bad input found late,
        a pool allocation that failed) finishes only ``s``, with ``error`` set."""
        try:
            self._prefill(s, started)
        except (ValueError, TypeError, MemoryError) as e:
            self._fail(s, e)

    def _fail(self, s: Sequence, e: BaseException, finished: bool = False) -> None:
        """Finish ``s``, whose prefill (or, ``finished`` by the scheduler, admission) raised ``e``,
        with ``error`` set."""
        s.error = e
        s.marks.setdefault("t0", self.clock.mark())
        s.marks.setdefault("prefill", self.clock.mark())
        s.marks.setdefault("first", s.marks["prefill"])
        s.marks["end"] = s.marks["first"]
        if not finished:
            self.finish(s, "error")
        self._failed.append(s)

    def _prefill(self, s: Sequence, started: bool = False) -> None:
        """Prefill ``s`` alone into its KV and sample its first token (``started``: its
        :meth:`prefill_start` was taken already, ``s.reused``)."""
        m, cfg, clock = self.m, self.config, self.clock
        a = clock.mark()
        s.marks.setdefault("t0", a)  # a prompt prefilled in chunks started at its first chunk
        s.densities = None if cfg.policy.dense else []
        if not started:
            s.reused = self.store.prefill_start(s)  # a reused prefix
        start = s.reused if s.filled is None else s.filled
        if start != s.reused:  # the last chunk: the pool holds the chunks before it
            s.kv["start"] = start
        ids_t = _device_ids(s.req.ids[start:], m.device)
        logits = m.prefill(ids_t, self.store.sink(s), chunk=cfg.prefill_chunk, policy=cfg.policy,
                           densities=s.densities, attn_backend=cfg.prefill_attn, start=start)
        s.marks["prefill"] = b = clock.mark()
        tok = sample(logits, s.req.sp, s.req.gen)
        s.marks["first"] = clock.mark()
        s.last_tok, s.n_out = tok, 1
        self.prefills.append((s.prompt_len - start, a, b, 1, self.calls))
        self.calls += 1
        self.log.publish(tok, [s])

    def _prefill_chunked(self) -> None:
        """One step's prefill work with chunked prefill (:mod:`..kv.chunk`): every admitted
        sequence with at most :data:`GROUP_PREFILL_MAX_TOKENS` (and ``max_num_batched_tokens``)
        tokens left to prefill (a question, a follow-up turn) is prefilled whole, then the longer ones, oldest first, get at most
        ``max_num_batched_tokens`` tokens between them: a chunk, or the last part of a prompt
        (which samples its first token). A sequence whose prefill raised is finished with
        ``error`` set."""
        budget = self.config.max_num_batched_tokens
        short = min(GROUP_PREFILL_MAX_TOKENS, budget)
        for s in [s for s in self.filling if self._left(s) <= short]:
            self.filling.remove(s)
            self._prefill_guarded(s, started=s.filled is not None)
        for s in list(self.filling):
            if budget <= 0:
                break
            left = self._left(s)
            if left <= budget:
                self.filling.remove(s)
                self._prefill_guarded(s, started=s.filled is not None)
            else:
                try:
                    self._prefill_chunk(s, budget)
                except (ValueError, TypeError, MemoryError) as e:
                    self._fail(s, e)
            budget -= left

    def _left(self, s: Sequence) -> int:
        """Prompt tokens ``s`` has still to prefill (before its first chunk: less a cached prefix)."""
        return self.store.prefill_tokens(s) if s.filled is None else s.prompt_len - s.filled

    def _prefill_chunk(self, s: Sequence, n: int) -> None:
        """Prefill the next ``n`` prompt tokens of ``s`` into its KV (not its last part: no token
        is sampled)."""
        m, cfg, clock = self.m, self.config, self.clock
        a = clock.mark()
        s.marks.setdefault("t0", a)
        if s.filled is None:
            s.reused = s.filled = self.store.prefill_start(s)
        start, end = s.filled, s.filled + n
        page = cfg.kv_scale_page  # an fp8 pool's page scale is written once, with its whole page
        if page > 1:
            end -= end % page
            if end <= start:
                return
        sink = self.store.chunk_sink(s, start, end)
        m.prefill(_device_ids(s.req.ids[start:end], m.device), sink, chunk=cfg.prefill_chunk, policy=cfg.policy,
                  attn_backend=cfg.prefill_attn, start=start)
        s.filled = end
        self.prefills.append((n, a, clock.mark(), 1, self.calls))
        self.calls += 1

    def _prefill_group(self, group: list) -> None:
        """Prefill ``group`` (>= 2 sequences) by one ``LlamaModel.prefill_batch`` into their KV
        (each past its reused prefix) and sample each one's first token."""
        cfg, store, clock = self.config, self.store, self.clock
        a = clock.mark()
        fit, alone, tokens = [], [], 0
        for s in group:
            s.marks["t0"] = a
            s.densities = None
            s.reused = store.prefill_start(s)  # a reused prefix, in order (blocks taken here)
            n = s.prompt_len - s.reused
            if fit and (n > GROUP_PREFILL_MAX_TOKENS or tokens + n > cfg.max_num_batched_tokens):
                alone.append(s)
            else:
                fit.append(s)
                tokens += n
        if len(fit) == 1:
            self._prefill_guarded(fit[0], started=True)
        else:
            sink = store.batch_sink(fit)
            ids = [t for s in fit for t in s.req.ids[s.reused:]]
            logits = self.m.prefill_batch(_device_ids(ids, self.m.device), sink.lens, sink.starts, sink,
                                          chunk=cfg.prefill_chunk, attn_backend=cfg.prefill_attn)
            b = clock.mark()
            toks = sample_rows(logits, fit)
            f = clock.mark()
            for i, s in enumerate(fit):
                s.marks["prefill"], s.marks["first"] = b, f
                s.last_tok, s.n_out = toks[i:i + 1], 1
                self.prefills.append((sink.lens[i], a, b, len(fit), self.calls))
            self.calls += 1
            self.log.publish(toks, fit)
        for s in alone:
            self._prefill_guarded(s, started=True)

    # ------------------------------------------------------------------ figures
    def summary(self, start, end) -> dict:
        """The epoch's figures: per decode step its sequences, padded rows and ms; per prefill its
        tokens and ms; decode tok/s; the most sequences that ran at once; the captured buckets."""
        clock = self.clock
        steps = [{"seqs": n, "rows": r, "ms": clock.ms(a, b)} for n, r, a, b in self.steps]
        pre = [{"tokens": n, "ms": clock.ms(a, b), "group": g} for n, a, b, g, _ in self.prefills]
        groups: dict = {}  # one entry per prefill call (a group's members share its marks)
        for (n, a, b, g, gid), x in zip(self.prefills, pre):
            e = groups.setdefault(gid, {"seqs": g, "tokens": 0, "ms": x["ms"]})
            e["tokens"] += n
        dec_ms = sum(x["ms"] for x in steps)
        dec_tok = sum(x["seqs"] for x in steps)
        return {
            "total_ms": clock.ms(start, end),
            "decode_steps": steps, "prefills": pre,
            "decode_tokens": dec_tok, "decode_ms": dec_ms,
            "decode_tok_per_s": dec_tok / dec_ms * 1e3 if dec_ms > 0 else None,
            "prefill_groups": list(groups.values()),
            "prefill_tokens": sum(x["tokens"] for x in pre), "prefill_ms": sum(x["ms"] for x in groups.values()),
            "max_running": self.sched.max_running,
            "graph_buckets": self.graphs.captured,
        }

    def close(self) -> None:
        """Release every sequence still held, the graphs and the store."""
        for s in list(self.sched.running):
            self.finish(s, "abort")
        self.graphs.close()
        self.store.close()
