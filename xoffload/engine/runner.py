"""Batched generation (``LLM.generate`` with ``max_num_seqs > 1``): the loop that drives the
:class:`~.scheduler.Scheduler`, a batched KV store (:mod:`.kv_batch`), the model and sampling.

Each iteration: admit what fits (:meth:`Scheduler.admit`) and prefill the admitted sequences
(layerwise, into their KV) and sample each one's first token; then one decode step for every running
sequence (rows padded to a batch-size bucket, replayed from that bucket's CUDA graph on a GPU,
:class:`~.cuda_graph.BatchGraphs`), each row sampled with its own :class:`SamplingParams` and
generator. A sequence leaves the batch as soon as it has ``max_tokens`` tokens (known on the host
by counting) or the host has read a stop id among them (on a GPU read ``EOS_LAG`` steps late, as
the one-request loop does, so the host never waits on the step it just launched); its KV is
released and the next admission fills its place. Outputs come back in submission order.

Prefill groups (a store with ``batch_prefill``: the resident ones; dense prefill, one device):
the admitted sequences are taken in submission order and each one's tokens to prefill are
counted against the prefix cache as it is then (``store.prefill_tokens``). A sequence with more
than :data:`GROUP_PREFILL_MAX_TOKENS` of them is prefilled alone (the pending group first), so a
long prompt -- a shared document -- is registered before the prompts after it are counted: its
questions then count only their own tokens and join one group. Short ones are collected into a
group, prefilled together by one ``LlamaModel.prefill_batch`` (the weights read once, one
attention launch per layer for the group), unless adding one would take the group past
``max_num_batched_tokens`` or it shares a whole block of uncached prompt with a member (with
prefix caching: it would reuse that block once the member is registered, and members of one
group do not see each other's blocks); then the group is prefilled first and the sequence
counted again. A group of one takes the one-sequence path. The counts are taken before the
group's blocks are: when a member's allocation evicts cached blocks a later member counted on
(the pool short), that member is counted again once its prefix is matched and, past those
bounds, prefilled by itself after the group. Either way nothing waits on the GPU:
the token ids go through pinned memory.

Greedy sequences of a batch give the tokens they give alone (tests/engine/test_batch.py; on the
CPU bit for bit, on a GPU within the rounding of different GEMM shapes); sampled ones draw from
their own generator in the same order as alone.
"""
from __future__ import annotations

import time
from collections import deque

import torch
from tqdm.auto import tqdm

from .cuda_graph import BatchGraphs
from .kv_batch import _to_device, batch_store_class
from .kv_batch_prefill import GROUP_PREFILL_MAX_TOKENS
from .request import EOS_LAG, Clock, Request, RequestOutput, request_timings
from .sampling import sample
from .scheduler import Scheduler, Sequence

__all__ = ["BatchRunner", "BatchTokenLog", "sample_rows", "GROUP_PREFILL_MAX_TOKENS"]

#: a sequence's decode steps before its steady state (as the one-request loop)
_STEADY_FROM = 2


def _device_ids(ids: list, device) -> torch.Tensor:
    """int64 ``[len(ids)]`` on ``device`` without a host wait (pinned + asynchronous on CUDA: a
    copy from pageable memory blocks the host until the stream drains)."""
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
    """Sampled tokens of a batch as the host sees them: on a GPU each step's tokens are copied into
    pinned memory behind an event and read ``lag`` steps later (:meth:`poll`); on the CPU at once.
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
            s.tokens.append(v)
            if v in s.req.stop:
                s.stopped = True


class BatchRunner:
    """Runs one batched ``generate`` call for an :class:`~.llm.LLM` (its model, config, store class
    and shared engine). :meth:`run` returns the :class:`RequestOutput` of each prompt, in order, and
    leaves per-call figures in :attr:`stats` (with ``store``: the batched store's
    :meth:`~.kv_batch.BatchKV.describe`)."""

    def __init__(self, llm):
        self.llm, self.m, self.config = llm, llm.model, llm.config
        self.cls, self.kw = batch_store_class(llm._store, llm.config)
        self.stats: dict = {}

    def run(self, prompts: list, sps: list, use_tqdm: bool = False) -> list:
        """Generate for each token-id list of ``prompts`` with the matching :class:`SamplingParams`
        of ``sps``. Raises ValueError (before anything runs) when a prompt alone can never fit the
        KV store; any failure releases every sequence's KV."""
        llm, cfg, m = self.llm, self.config, self.m
        self.stats = {}
        dev = m.device
        cuda = dev.type == "cuda"
        seqs = [Sequence(i, Request.make(ids, sp, max_model_len=cfg.max_model_len, seed=cfg.seed,
                                         stop_ids=llm._stop_ids, device=dev))
                for i, (ids, sp) in enumerate(zip(prompts, sps))]
        clock = Clock(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        start = clock.mark()
        kw = dict(self.kw)
        if getattr(llm, "prefix_cache", None) is not None:  # offload, dense decode: reuse cached prefixes
            kw["prefix_cache"] = llm.prefix_cache
        store = self.cls.open(m, cfg, llm.engine, seqs, **kw)
        graphs = None
        try:
            sched = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens, store)
            for s in seqs:
                sched.add(s)
            graphs = BatchGraphs(m, store, cfg.cuda_graph)
            self._store_info = store.describe()
            self._loop(sched, store, graphs, clock, cuda, use_tqdm, len(seqs))
        finally:
            if graphs is not None:
                graphs.close()
            store.close()
        end = clock.mark()
        if cuda:
            end.synchronize()
        peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else None
        self._summarize(clock, start, end, sched, graphs)
        return [self._output(s, store, clock, start, peak) for s in seqs]

    # ------------------------------------------------------------------ the loop
    def _loop(self, sched, store, graphs, clock, cuda, use_tqdm, total):
        log = BatchTokenLog(cuda)
        lag = EOS_LAG if cuda else 0
        self._steps, self._prefills, self._calls = [], [], 0  # _calls: prefill calls so far (a group is one)
        batch, rows, prev = None, 0, None
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True) if use_tqdm else None
        host = {"prefill_s": 0.0, "prefill_tok": 0, "decode_s": 0.0, "decode_tok": 0}
        try:
            while not sched.done:
                done_before = len(sched.finished)
                t = time.perf_counter()
                for s in self._prefill_admitted(sched.admit(), store, log, clock):
                    host["prefill_tok"] += s.prompt_len - s.reused  # what the prefill computed
                host["prefill_s"] += time.perf_counter() - t
                log.poll(lag)
                self._retire(sched, store, clock)
                running = list(sched.running)
                if running:
                    t = time.perf_counter()
                    if running != batch:  # the batch changed: new rows, inputs from each sequence
                        rows = store.set_batch(running)
                        tokens = torch.cat([s.last_tok for s in running])
                        batch = running
                    else:
                        tokens = prev
                    a = clock.mark()
                    logits = graphs.step(rows, tokens)
                    toks = sample_rows(logits, running)
                    e = clock.mark()
                    self._steps.append((len(running), rows, a, e))
                    for b, s in enumerate(running):
                        s.last_tok = toks[b:b + 1]
                        s.n_out += 1
                        s.steps += 1
                        if s.steps == _STEADY_FROM:  # after its first two steps, as the one-request loop
                            s.marks["steady"] = e
                    log.publish(toks, running)
                    prev = toks
                    log.poll(lag)
                    host["decode_s"] += time.perf_counter() - t
                    host["decode_tok"] += len(running)
                self._retire(sched, store, clock)
                if bar is not None:
                    bar.update(len(sched.finished) - done_before)
                    bar.set_postfix_str(
                        f"Prefill={host['prefill_tok'] / max(host['prefill_s'], 1e-9):.0f}tok/s, "
                        f"Decode={host['decode_tok'] / max(host['decode_s'], 1e-9):.0f}tok/s", refresh=False)
            log.poll(0)
        finally:
            if bar is not None:
                bar.close()
        self._host = host

    def _prefill_admitted(self, admitted: list, store, log: BatchTokenLog, clock: Clock) -> list:
        """Prefill the sequences one :meth:`Scheduler.admit` returned, alone or in groups (module
        docstring); returns them in the order they were prefilled."""
        cfg, done = self.config, []
        if not (getattr(store, "batch_prefill", False) and cfg.policy.dense and self.m.tp is None):
            for s in admitted:
                self._prefill(s, store, log, clock)
                done.append(s)
            return done
        group, tokens = [], 0

        def flush():
            if len(group) == 1:
                self._prefill(group[0], store, log, clock)
            elif group:
                self._prefill_group(list(group), store, log, clock)
            done.extend(group)
            group.clear()

        for s in admitted:
            n = store.prefill_tokens(s)
            if group and (n > GROUP_PREFILL_MAX_TOKENS or tokens + n > cfg.max_num_batched_tokens
                          or self._shares_new_block(s, n, group, store)):
                flush()
                n = store.prefill_tokens(s)  # the group's prompts are registered now
            if n > GROUP_PREFILL_MAX_TOKENS:
                self._prefill(s, store, log, clock)
                done.append(s)
                continue
            if not group:
                tokens = 0
            group.append(s)
            tokens += n
        flush()
        return done

    @staticmethod
    def _shares_new_block(s: Sequence, n: int, group: list, store) -> bool:
        """With a prefix cache: whether ``s`` (``n`` tokens to prefill) would reuse a whole block
        of a group member's prompt that is not cached yet (the first block past what ``s``
        finds cached, its tokens and all before them equal)."""
        if getattr(store, "cache", None) is None:
            return False
        blk = store.block
        a = (s.prompt_len - n) // blk * blk
        e = a + blk
        ids = s.req.ids
        if e > len(ids) - 1:  # the match leaves out the last token (recomputed for its logits)
            return False
        for p in group:
            pid = p.req.ids
            if len(pid) >= e and pid[a:e] == ids[a:e] and pid[:a] == ids[:a]:
                return True
        return False

    def _prefill(self, s: Sequence, store, log: BatchTokenLog, clock: Clock, started: bool = False) -> None:
        """Prefill ``s`` alone into its KV and sample its first token (``started``: its
        :meth:`prefill_start` was taken already, ``s.reused``)."""
        m, cfg = self.m, self.config
        s.marks["t0"] = a = clock.mark()
        s.densities = None if cfg.policy.dense else []
        start = s.reused if started else store.prefill_start(s)  # a reused prefix
        s.reused = start
        ids_t = _device_ids(s.req.ids[start:], m.device)
        logits = m.prefill(ids_t, store.sink(s), chunk=cfg.prefill_chunk, policy=cfg.policy,
                           densities=s.densities, attn_backend=cfg.prefill_attn, start=start)
        s.marks["prefill"] = b = clock.mark()
        tok = sample(logits, s.req.sp, s.req.gen)
        s.marks["first"] = clock.mark()
        s.last_tok, s.n_out = tok, 1
        self._prefills.append((s.prompt_len - start, a, b, 1, self._calls))
        self._calls += 1
        log.publish(tok, [s])

    def _prefill_group(self, group: list, store, log: BatchTokenLog, clock: Clock) -> None:
        """Prefill ``group`` (>= 2 sequences) by one ``LlamaModel.prefill_batch`` into their KV
        (each past its reused prefix) and sample each one's first token with its own parameters
        and generator. The group shares its timeline marks (``t0``, ``prefill``, ``first``); each
        member gets a ``prefills`` entry with the group's size and id."""
        cfg = self.config
        a = clock.mark()
        fit, alone, tokens = [], [], 0
        for s in group:
            s.marks["t0"] = a
            s.densities = None
            s.reused = store.prefill_start(s)  # a reused prefix, in order (blocks taken here)
            # the group was counted against the cache before any of its blocks were taken: a
            # member's allocation may evict cached blocks a later one counted on, which then
            # prefills more; one that no longer fits the group's bounds is prefilled by itself
            n = s.prompt_len - s.reused
            if fit and (n > GROUP_PREFILL_MAX_TOKENS or tokens + n > cfg.max_num_batched_tokens):
                alone.append(s)
            else:
                fit.append(s)
                tokens += n
        if len(fit) == 1:
            self._prefill(fit[0], store, log, clock, started=True)
        else:
            self._prefill_fit(fit, a, store, log, clock)
        for s in alone:
            self._prefill(s, store, log, clock, started=True)

    def _prefill_fit(self, group: list, a, store, log: BatchTokenLog, clock: Clock) -> None:
        """The batched prefill of :meth:`_prefill_group`'s members that fit (each started; ``a``:
        the group's first mark)."""
        m, cfg = self.m, self.config
        sink = store.batch_sink(group)
        ids = [t for s in group for t in s.req.ids[s.reused:]]
        logits = m.prefill_batch(_device_ids(ids, m.device), sink.lens, sink.starts, sink,
                                 chunk=cfg.prefill_chunk, attn_backend=cfg.prefill_attn)
        b = clock.mark()
        toks = sample_rows(logits, group)
        f = clock.mark()
        for i, s in enumerate(group):
            s.marks["prefill"], s.marks["first"] = b, f
            s.last_tok, s.n_out = toks[i:i + 1], 1
            self._prefills.append((sink.lens[i], a, b, len(group), self._calls))
        self._calls += 1
        log.publish(toks, group)

    def _retire(self, sched: Scheduler, store, clock: Clock) -> None:
        """Finish every running sequence that has all its tokens or whose stop id was read (its
        store's figures are read first: the KV goes with it)."""
        for s in list(sched.running):
            if s.done_sampling:
                s.marks["end"] = clock.mark()
                s.h2d, s.stats = store.h2d_bytes_per_step(s), store.decode_stats(s)
                sched.finish(s, "stop" if s.stopped else "length")

    # ------------------------------------------------------------------ results
    def _output(self, s: Sequence, store, clock, start, peak) -> RequestOutput:
        out_ids, reason = s.req.finish(s.tokens[:s.req.max_new])
        t = request_timings(clock, s.marks, s.prompt_len, s.steps, s.densities,
                            computed_tokens=s.prompt_len - getattr(s, "reused", 0))
        t["queue_ms"] = clock.ms(start, s.marks["t0"])
        if getattr(s, "reused", 0):
            t["prefix_reused_tokens"] = s.reused
        if s.h2d is not None:
            t["h2d_bytes_per_token"] = int(s.h2d)
        t.update(s.stats)
        return RequestOutput(prompt_token_ids=list(s.req.ids), token_ids=out_ids, text=self.llm.decode(out_ids),
                             finish_reason=reason, timings=t, peak_gpu_memory_bytes=peak)

    def _summarize(self, clock, start, end, sched, graphs) -> None:
        steps = [{"seqs": n, "rows": r, "ms": clock.ms(a, b)} for n, r, a, b in self._steps]
        pre = [{"tokens": n, "ms": clock.ms(a, b), "group": g} for n, a, b, g, _ in self._prefills]
        groups: dict = {}  # one entry per prefill call (a group's members share its marks)
        for (n, a, b, g, gid), x in zip(self._prefills, pre):
            e = groups.setdefault(gid, {"seqs": g, "tokens": 0, "ms": x["ms"]})
            e["tokens"] += n
        dec_ms = sum(x["ms"] for x in steps)
        dec_tok = sum(x["seqs"] for x in steps)
        self.stats = {
            "total_ms": clock.ms(start, end),
            "decode_steps": steps, "prefills": pre,
            "decode_tokens": dec_tok, "decode_ms": dec_ms,
            "decode_tok_per_s": dec_tok / dec_ms * 1e3 if dec_ms > 0 else None,
            "prefill_groups": list(groups.values()),
            "prefill_tokens": sum(x["tokens"] for x in pre), "prefill_ms": sum(x["ms"] for x in groups.values()),
            "max_running": sched.max_running,
            "graph_buckets": graphs.captured if graphs is not None else [],
            "host": dict(self._host),
            "store": dict(self._store_info),
        }
