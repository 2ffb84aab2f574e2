"""``LLMEngine``: the one step loop. Requests join with :meth:`~LLMEngine.add_request`, each
:meth:`~LLMEngine.step` admits, prefills and decodes one step for every running request and
returns the outputs that progressed, :meth:`~LLMEngine.abort_request` frees a request's KV at
once. ``LLM.generate`` and sessions (each turn a plain request) are thin clients of this loop
(vLLM's names).

Threads: :meth:`add_request` and :meth:`abort_request` may be called from any thread (they queue
the work under a lock; an abort from the thread that drives the loop, between steps, is applied at
once); one thread at a time runs :meth:`step`, which holds the device.

Store epochs: the KV store (the table in :func:`~xoffload.kv.table.batch_store_class`) is opened when the
engine goes busy, its GPU pools sized for ``max_num_seqs`` requests like the largest one waiting
then with :data:`~.runner.HEADROOM` more prompt (within the free GPU memory: a conversation's
next turn is its last prompt plus the answer and a question), and
closed when the engine is idle again (its pinned host pool and the prefix cache live as long as the
engine). A request that arrives while the store is open and fits it joins the running batch at the
next step; one the store cannot hold waits until the running ones are done, then a store sized
for it opens (the requests behind it that the store holds and that end within the running ones'
steps are backfilled past it: :mod:`.scheduler`). A request that can never fit (the
pinned pool, ``kv_cache_tokens``) is refused by :meth:`add_request`; one the GPU memory cannot
hold ends with ``finish_reason == "error"``.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque

import torch

from ..kernels import cpu_backend
from ..models.llama import LlamaModel
from ..models.loader import load_model, resolve_dtype_device
from .config import EngineConfig
from .inputs import decode, prompt_ids
from ..kv.table import batch_store_class, open_runtime
from .request import Clock, Request, RequestOutput, request_timings
from .runner import StepRunner, headroom
from .sampling import SamplingParams
from .scheduler import FINISHED, Sequence

__all__ = ["LLMEngine"]


class LLMEngine:
    """Continuous-batching engine over one model and one KV layer (see the module docstring).

    Args:
        model: what :func:`~xoffload.models.loader.load_model` accepts (None / ``"smollm2"``, a
            ``.gguf`` path, a HF directory, a preset name, a ModelConfig) or a loaded
            :class:`LlamaModel` (weights shared).
        **options: the fields of :class:`~xoffload.engine.config.EngineConfig`.

    Attributes: ``model``, ``config`` (bound), ``offload`` (the runtime's
    :class:`~xoffload.runtime.OffloadRuntime`: the pinned pool, or a device pool for resident + Quest; else None),
    ``prefix_cache``, ``sessions`` (open sessions by id: :meth:`close` closes them), ``stats``
    (the last store epoch's figures: decode steps, prefills, tok/s, max running, captured graph
    buckets, the store).

    Raises ValueError / TypeError on bad options, FileNotFoundError when the model is missing.
    """

    def __init__(self, model=None, **options):
        cfg = EngineConfig.from_kwargs(**options)
        if cfg.tensor_parallel_size > 1:  # one rank of a tensor-parallel group (torchrun)
            from ..models.parallel import tensor_parallel_model

            m = tensor_parallel_model(model, cfg)
        elif isinstance(model, LlamaModel):
            m = model
        else:
            dt, dev = resolve_dtype_device(cfg.dtype, cfg.device)
            m = load_model(model, dtype=dt, device=dev, seed=cfg.seed)
        self.model, self.tp = m, m.tp
        cfg = cfg.bind(m)
        self.store_cls, self.store_kw = batch_store_class(cfg)
        self.config = cfg = cfg.resolve_chunked_prefill(self.store_cls, m.tp)
        self.offload = open_runtime(m, cfg, self.store_kw)
        self.prefix_cache = None
        if cfg.prefix_caching and self.offload is not None:
            from ..runtime import PrefixCache

            self.prefix_cache = PrefixCache(self.offload)
        self.stop_ids = set(m.cfg.eos_token_ids)
        if m.tokenizer is not None and getattr(m.tokenizer, "eos_token_id", None) is not None:
            self.stop_ids.add(int(m.tokenizer.eos_token_id))
        self.sessions: dict = {}
        self.stats: dict = {}
        self.clock = Clock(m.device)
        self._lock = threading.Lock()  # the inbox and the request table
        self._step_lock = threading.RLock()  # the device: one step at a time
        self._inbox: deque = deque()
        self._requests: dict = {}  # request_id -> Sequence, until its final output is returned
        self._waiting: deque = deque()  # sequences queued while no store is open
        self._finishing: list = []  # finished, tokens not all read yet
        self._outputs: list = []  # outputs for the next step() to return
        self._runner = None
        self._keys = itertools.count()
        self.closed = False
        #: whether :meth:`step` returns the progress of unfinished requests (token ids and text so
        #: far); ``LLM.generate`` turns it off (it reads final outputs only)
        self.stream_outputs = True

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id, prompt, sampling_params: SamplingParams | None = None, *,
                    on_finish=None) -> str:
        """Queue a request; it joins the running batch at a later :meth:`step`.

        Args:
            request_id: its name (str; unique among the unfinished requests).
            prompt: a string (tokenized as it is) or token ids.
            sampling_params: default greedy, 64 tokens.
            on_finish: for clients built on the loop (sessions): ``on_finish(output)`` sees the
                request's final output (called by the thread that steps, before it is returned).
        Returns: ``request_id``.
        Raises:
            ValueError / TypeError: a bad prompt or parameters, a duplicate id, a closed engine, a
            request whose KV can never fit the pinned pool or ``kv_cache_tokens`` (sizes named).
        """
        if self.closed:
            raise ValueError("this engine was closed; create a new one")
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        cfg = self.config
        ids = prompt_ids(self.model, cfg.max_model_len, request_id, prompt)
        req = Request.make(ids, sp, max_model_len=cfg.max_model_len, seed=cfg.seed, stop_ids=self.stop_ids,
                           device=self.model.device)
        self._check_capacity(request_id, req)
        if self._holds(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        seq = Sequence(request_id, req, key=next(self._keys), request_id=request_id)
        seq.on_finish = on_finish
        return self._submit(seq)

    def _submit(self, seq: Sequence) -> str:
        """Queue a built sequence (:meth:`add_request`; :class:`~.llm.LLM` names it by index)."""
        request_id = seq.request_id
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
            self._requests[request_id] = seq
            self._inbox.append(("add", seq))
        return request_id

    def _check_capacity(self, rid, req: Request) -> None:
        """Refuse a request that no store can ever hold: its prompt over the pinned pool (offload),
        its prompt + new tokens over ``kv_cache_tokens`` (resident)."""
        cfg = self.config
        if self.offload is not None:
            B, total = self.offload.block_size, self.offload.allocator.num_blocks
            n = len(req.ids)  # the pool holds prompts; generated tokens live in the stores' GPU tails
            if -(-n // B) > total:
                raise ValueError(f"prompt {rid} needs {-(-n // B) * B} tokens of KV in the {self.offload.pool.label} "
                                 f"({n} prompt tokens in blocks of {B}) but the pool holds {total * B} tokens "
                                 f"(kv_cache_tokens={cfg.kv_cache_tokens})")
        elif cfg.kv_cache_tokens is not None:
            B = int(cfg.kv_block_size)
            if -(-req.final_len // B) > cfg.kv_cache_tokens // B:
                raise ValueError(f"prompt {rid} needs {-(-req.final_len // B) * B} tokens of KV ({len(req.ids)} prompt "
                                 f"+ {req.max_new - 1} new) but the KV pool holds {cfg.kv_cache_tokens // B * B} tokens "
                                 f"(kv_cache_tokens={cfg.kv_cache_tokens})")

    def abort_request(self, request_id) -> None:
        """Abort a request (a str) or several (an iterable): unknown and finished ids are ignored.
        Its KV is freed at once when called between steps from the thread that drives the loop,
        else at the start of the next step; its final output (``finish_reason == "abort"``) comes
        from the next :meth:`step`."""
        if isinstance(request_id, str):
            ids = [request_id]
        elif isinstance(request_id, (list, tuple, set, frozenset)) and all(isinstance(r, str) for r in request_id):
            ids = list(request_id)
        else:
            raise TypeError(f"abort_request takes a request_id (str) or an iterable of them, got {request_id!r}")
        with self._lock:
            self._inbox.extend(("abort", r) for r in ids)
        if self._step_lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self._step_lock.release()

    def has_unfinished_requests(self) -> bool:
        """Whether a request was added whose final output has not been returned yet."""
        with self._lock:
            return bool(self._requests)

    @property
    def num_free_blocks(self) -> int | None:
        """Free KV blocks: the pinned pool's (offload), the open store's GPU pool (resident;
        None while no store is open)."""
        if self.offload is not None:
            return self.offload.num_free_blocks
        pool = getattr(self._runner.store, "pool", None) if self._runner is not None else None
        return pool.alloc.num_free if pool is not None else None

    # ------------------------------------------------------------------ the loop
    def step(self) -> list:
        """One engine step: queued adds and aborts applied, waiting requests admitted and
        prefilled, one decode step for every running request. Returns the
        :class:`RequestOutput` of every request that progressed (its ``token_ids`` are all it
        generated so far as the host has read them; ``finished`` on its last one)."""
        ctx = cpu_backend("reference") if self.model.device.type == "cpu" else contextlib.nullcontext()
        tp = self.tp.guard() if self.tp is not None else contextlib.nullcontext()
        with self._step_lock, ctx, torch.no_grad(), tp:
            self._drain_inbox()
            r = self._runner
            if r is not None and not r.sched.running and r.sched.blocked is not None:
                self._close_epoch()  # the store cannot hold the head: one sized for it
                r = None
            if r is None and self._waiting:
                if self._open_epoch():  # refusals are returned before anything runs
                    return self._take_outputs()
                r = self._runner
            if r is not None:
                try:
                    finished = r.step()
                except BaseException as e:
                    self._fail_epoch(e)
                    self._flush_finishing()  # their final outputs now: a waiting client is not left in a turn
                    raise
                self._finishing.extend(finished)
                self._collect(r)
                if not r.sched.running and not r.sched.waiting:
                    self._close_epoch()
            return self._take_outputs()

    def wait(self, request_id: str) -> RequestOutput:
        """Step until ``request_id`` has finished; returns its final output. Outputs of other
        requests are kept for the next :meth:`step` (whoever calls it). ValueError for an
        unknown id."""
        if not self._holds(request_id):
            raise ValueError(f"unknown request_id {request_id!r}")
        while True:
            with self._step_lock:  # steps and hand-backs of concurrent waiters do not interleave
                outs = self.step()
                final = next((o for o in outs if o.request_id == request_id and o.finished), None)
                self.keep_outputs([o for o in outs if o.request_id != request_id])
                if final is not None:
                    return final
                if not self._holds(request_id):
                    raise RuntimeError(f"request {request_id!r} finished in a step another caller consumed")

    def keep_outputs(self, outs: list) -> None:
        """Hand outputs a caller took from :meth:`step` but does not own back to the next step()
        (e.g. :meth:`wait`, ``LLM.generate``). Only the newest progress output of a request is
        kept (its ``token_ids`` hold all the earlier ones), none once its final output is there."""
        with self._lock:
            merged = outs + self._outputs
            final = {o.request_id for o in merged if o.finished}
            latest = {}
            for i, o in enumerate(merged):
                if not o.finished:
                    latest[o.request_id] = i
            self._outputs = [o for i, o in enumerate(merged)
                             if o.finished or (o.request_id not in final and latest[o.request_id] == i)]

    def _holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests or any(o.request_id == request_id for o in self._outputs)

    def _drain_inbox(self) -> None:
        with self._lock:
            work, self._inbox = list(self._inbox), deque()
        for kind, x in work:
            if kind == "add":
                x.marks["queued"] = self.clock.mark()  # the queue time counts from here
                if self._runner is not None:
                    self._runner.sched.add(x, check=False)
                else:
                    self._waiting.append(x)
            else:
                self._abort(x)

    def _abort(self, rid: str) -> None:
        with self._lock:
            seq = self._requests.get(rid)
        if seq is None or seq.status == FINISHED:
            return
        if seq in self._waiting:
            self._waiting.remove(seq)
            seq.status, seq.finish_reason = FINISHED, "abort"
        elif self._runner is not None:
            self._runner.finish(seq, "abort")
        else:
            return
        self._finishing.append(seq)

    def _collect(self, r: StepRunner) -> None:
        """Outputs of the sequences that progressed: running ones with newly read tokens, and
        finished ones whose tokens have all been read."""
        for s in r.sched.running if self.stream_outputs else ():
            if len(s.tokens) > s.sent and not s.stopped:
                self._outputs.append(self._output(s, final=False))
        left = []
        for s in self._finishing:
            read = s.finish_reason in ("abort", "error") or s.stopped or len(s.tokens) >= s.req.max_new
            end = s.marks.get("end")  # its timings read this event: wait until the GPU has passed it
            if read and (end is None or isinstance(end, float) or end.query()):
                self._finish_output(s)
            else:
                left.append(s)
        self._finishing = left

    def _flush_finishing(self) -> None:
        if self._runner is None:  # idle: every token has been read
            for s in self._finishing:
                self._finish_output(s)
            self._finishing = []

    def _take_outputs(self) -> list:
        self._flush_finishing()
        with self._lock:
            out, self._outputs = self._outputs, []
        return out

    def _finish_output(self, s: Sequence) -> None:
        out = self._output(s, final=True)
        if getattr(s, "on_finish", None) is not None:
            s.on_finish(out)
        with self._lock:
            self._requests.pop(s.request_id, None)
            self._outputs.append(out)

    def _output(self, s: Sequence, final: bool) -> RequestOutput:
        toks = s.tokens[:s.req.max_new]
        s.sent = len(toks)
        if not final:
            return RequestOutput(request_id=s.request_id, prompt_token_ids=s.req.ids, token_ids=list(toks),
                                 text=decode(self.model, toks), finish_reason=None, finished=False,
                                 num_cached_tokens=int(s.reused))
        reason = s.finish_reason
        if reason in ("stop", "length"):
            toks, reason = s.req.finish(toks)
        timings = {}
        if "end" in s.marks and "first" in s.marks and s.error is None:
            timings = request_timings(self.clock, s.marks, s.prompt_len, s.steps, s.densities,
                                      computed_tokens=s.prompt_len - s.reused)
            timings["queue_ms"] = self.clock.ms(s.marks.get("queued", s.marks["t0"]), s.marks["t0"])
            if s.reused:
                timings["prefix_reused_tokens"] = s.reused
            if s.h2d is not None:
                timings["h2d_bytes_per_token"] = int(s.h2d)
            timings.update(s.stats)
        cuda = self.model.device.type == "cuda"
        peak = int(torch.cuda.max_memory_allocated(self.model.device)) if cuda else None
        return RequestOutput(request_id=s.request_id, prompt_token_ids=list(s.req.ids), token_ids=list(toks),
                             text=decode(self.model, toks), finish_reason=reason, finished=True, timings=timings,
                             peak_gpu_memory_bytes=peak, error=s.error,
                             num_cached_tokens=int(timings.get("prefix_reused_tokens", s.reused)))

    # ------------------------------------------------------------------ store epochs
    def _open_epoch(self) -> bool:
        """Open a store sized for the waiting sequences; refuse (error outputs) the ones it can
        never hold. Returns whether any was refused."""
        seqs = list(self._waiting)
        self._waiting.clear()
        try:
            return self._open_store(seqs)
        except BaseException as e:  # the store could not open: these requests end with the error
            for s in seqs:
                if s.status != FINISHED:
                    s.error, s.status, s.finish_reason = e, FINISHED, "error"
                    self._finishing.append(s)
            if isinstance(e, (ValueError, TypeError, MemoryError, RuntimeError)):
                return True
            raise

    def _open_store(self, seqs: list) -> bool:
        if self.model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.model.device)
        kw = dict(self.store_kw)
        if self.prefix_cache is not None and self.store_cls.takes_prefix_cache:
            kw["prefix_cache"] = self.prefix_cache
        sizing = seqs + [headroom(seqs, self.config)] * max(1, self.config.max_num_seqs - len(seqs))
        store = self.store_cls.open(self.model, self.config, self.offload, sizing, **kw)
        r = self._runner = StepRunner(self.model, self.config, store, self.clock)
        self._epoch_start = self.clock.mark()
        self._store_info = store.describe()
        refused = False
        for s in seqs:
            try:
                r.sched.add(s)
            except ValueError as e:
                s.error, s.status, s.finish_reason = e, FINISHED, "error"
                self._finishing.append(s)
                refused = True
        if not r.sched.waiting:
            self._close_epoch()
        return refused

    def _close_epoch(self) -> None:
        r, self._runner = self._runner, None
        r.drain()
        end = self.clock.mark()
        if self.model.device.type == "cuda":
            end.synchronize()
        self._collect(r)
        self.stats = dict(r.summary(self._epoch_start, end), store=dict(self._store_info))
        for s in list(r.sched.waiting):  # blocked: they open the next store
            s.status = "waiting"
            r.sched.waiting.remove(s)
            self._waiting.append(s)
        r.close()

    def _fail_epoch(self, exc: BaseException) -> None:
        """A step raised ``exc``: every request of the epoch ends with it (``error``) and its KV is
        freed; their final outputs come from the next step."""
        r, self._runner = self._runner, None
        held = list(r.sched.running) + list(r.sched.waiting)
        try:
            r.close()
        finally:
            for s in held:
                if s.status != FINISHED:
                    r.sched.finish(s, "error")
                s.error, s.finish_reason = exc, "error"
                self._finishing.append(s)

    def close(self) -> None:
        """Abort every request, close every session, free the store and the runtime's pool (offload,
        resident + Quest batched): an engine with a runtime refuses requests afterwards, one without
        (resident), which shares nothing between stores, keeps serving. Safe to call twice."""
        if self.closed:
            return
        with self._step_lock:
            self._drain_inbox()
            why = RuntimeError("the engine was closed")
            if self._runner is not None:
                self._fail_epoch(why)
            for s in list(self._waiting):
                s.error, s.status, s.finish_reason = why, FINISHED, "error"
                self._finishing.append(s)
            self._waiting.clear()
            self._flush_finishing()  # their final outputs come from the next step()
            for s in list(self.sessions.values()):
                s.close()
            if self.offload is not None:  # what requests share is gone: no more requests
                self.offload.close()
                self.closed = True
