"""Sessions: a conversation whose KV stays stored between turns (:meth:`LLM.session`).

A :class:`Session` keeps the KV of every token it has seen — on the model's device (``resident``)
or in the offload runtime's pinned CPU pool (``offload``) — and each turn prefills only the new
tokens, as a chunk that continues the history:

* the chunk's queries attend to the history (all of it, or the pages a selection chose: *sparse
  history*) and causally to the chunk itself, and the two partial results merge by their LSE
  (:meth:`LlamaModel.prefill` with ``start = history length``); the chunk's K/V join the history
  (offload: copied into the pool as each layer finishes);
* decode then reads the whole history through a :class:`~.kv_paged.PagedKV` built over the stored
  KV (dense, or the LLM's ``sparse_decode`` policy), one CUDA graph per step as in one-shot
  generation;
* the answer's tokens join the history as the first tokens of the next turn's chunk: their K/V are
  computed by that chunk's prefill (as a one-shot run over the concatenated conversation computes
  them), never kept from the decode tail.

Sparse history (``history_budget``): per layer not in ``dense_layers`` and per KV head,
the history pages (``page_size`` tokens) whose Quest bound (Tang et al. 2024: elementwise min/max
of each page's K, kept on the GPU for the whole session; ``q⁺·max + q⁻·min`` maximised over the
chunk's query tokens and the KV head's query-head group; with a decode policy that keeps exact
key channels, ``quest-ch``, the page score of sparse decode instead: exact on those channels, the
scaled bound on the others) is highest, up to ``history_budget``
tokens counting the first page (sink), the last ``recent_pages`` and the partial last page; only
those pages are copied from the pool (offload) — one gather kernel per layer reading pinned memory
over UVA — and attended. A budget at least the history reads every page (equal to dense history).

Pool accounting (offload): a turn makes room for the history it will hold, evicting idle sessions
(:mod:`.eviction`, LRU; never one whose turn is running) when the pool is short; an evicted
session's next turn prefills its whole history again (exactly). A turn that could not fit even
then raises ValueError naming the sizes before changing anything. A first turn that reuses a
cached prefix (``prefix_caching``) reads it whole: reuse never changes the tokens.
"""
from __future__ import annotations

import itertools
import threading

import torch

from ..kernels.checks import check_int
from ..sparse.quest import PageSummaries
from .eviction import make_room, reclaimable_blocks
from .inputs import apply_chat_template, prompt_ids, sampling_list
from .kv_history import ChunkSink, dense_layer_set, history_page_ids
from .kv_paged import PagedKV
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["Session", "HISTORY_PAGE", "history_page_ids"]  # history_page_ids: from .kv_history

#: page size of a session's history summaries when no decode policy fixes one
HISTORY_PAGE = 32
_ids = itertools.count()
_submit_lock = threading.Lock()


class Session:
    """A conversation with one :class:`~.llm_engine.LLMEngine` whose KV stays stored between turns.

    Made by :meth:`LLM.session`. Each turn is one request of the engine loop whose prefill is the
    session's own (the chunk against the stored history); one turn at a time per session; turns
    may be submitted from several threads (:meth:`submit`), the loop serves them in order. Works
    in ``resident`` and ``offload`` mode (``offload_decode`` ``"direct"``/``"uva"``), with the
    engine's decode policy (``sparse_decode``) and prefill policy (``sparse``, applied within each
    chunk).

    Args:
        engine: the engine (``max_num_seqs=1``; above, :class:`~.session_prefix.PrefixSession`).
        history_budget: None (each chunk attends to the whole history: *dense history*) or the
            tokens of history each sparse layer's chunk attends to per KV head (*sparse history*:
            a multiple of ``page_size``, at least two pages; the sink, the recent pages and the
            partial last page are read even when they pass it).
        dense_layers: layers that always read the whole history: an int N (the first N) or layer
            indices (default: the decode policy's dense layers, else layers 0 and 1, Quest's choice).
        recent_pages: history pages before the chunk always read by a sparse layer (default 4).

    Attributes: ``tokens`` (every token of the conversation so far: stored history + the last
    answer), ``history_len`` (tokens whose K/V are stored), ``turns``, ``closed``, ``queued`` (a
    turn is queued or running), ``busy`` (its turn is running: its KV is never evicted then),
    ``last_used`` (LRU order).

    Raises:
        ValueError: a ``ring`` offload store, ``max_num_seqs > 1``, ``tensor_parallel_size > 1``, a bad
            ``history_budget`` / ``dense_layers`` / ``recent_pages``, a closed engine.
    """

    def __init__(self, engine, *, history_budget: int | None = None, dense_layers=None,
                 recent_pages: int = 4, batched: bool = False):
        from .kv_store import store_class

        if engine.closed:
            raise ValueError("this LLM was closed; create a new one")
        cfg = engine.config
        if cfg.max_num_seqs != 1 and not batched:
            raise ValueError(f"a Session holds its KV itself and needs max_num_seqs=1, got {cfg.max_num_seqs}: "
                             f"use LLM.session(), which gives a PrefixSession there")
        if cfg.tensor_parallel_size != 1:
            raise ValueError(f"sessions run on one device; tensor_parallel_size={cfg.tensor_parallel_size} "
                             f"is not supported for them yet")
        store = store_class(cfg.mode).variant(cfg)
        if not issubclass(store, PagedKV) and cfg.mode != "resident":
            raise ValueError(f"sessions read the pool page by page; offload_decode={cfg.offload_decode!r} "
                             f"(the ring) is not supported: use 'direct' or 'uva'")
        self.e, self.m = engine, engine.model
        self.cfg, self.device, self.dtype, self.scale = self.m.cfg, self.m.device, self.m.dtype, self.m.scale
        self.cuda = self.device.type == "cuda"
        self.policy = cfg.decode_policy
        self.page = self.policy.page_size if self.policy is not None else HISTORY_PAGE
        self._summ = None
        L = self.cfg.num_layers
        if isinstance(recent_pages, bool) or not isinstance(recent_pages, int) or recent_pages < 0:
            raise ValueError(f"recent_pages must be an int >= 0, got {recent_pages!r}")
        self.history_budget = history_budget
        dense_layers = dense_layer_set(dense_layers, self.policy, L)
        self.dense_layers, self.recent_pages = dense_layers, recent_pages
        self.offload = engine.offload  # None in resident mode
        self.id = next(_ids)
        self.seq = None
        self._rows = None
        self._partial = [None] * L  # offload: K of the history's partial last page, per layer
        self._write_ev = [None] * L
        self._stored: list = []  # tokens whose K/V are stored
        self._pending: list = []  # the last answer's tokens (K/V not stored yet)
        self.turns = 0
        self.closed = False
        self.busy = False  # its turn is running (its KV in use)
        self.queued = False  # a turn is queued or running
        self.last_used = 0
        self._messages: list = []
        engine.sessions[self.id] = self

    # ------------------------------------------------------------------ public
    @property
    def history_budget(self) -> int | None:
        """Sparse-history budget in tokens per KV head and sparse layer (None: dense history);
        may be changed between turns. Raises ValueError unless None or a positive multiple of
        ``page_size`` of at least two pages."""
        return self._history_budget

    @history_budget.setter
    def history_budget(self, value) -> None:
        if value is not None:
            value = check_int("history_budget", value, 1, type_error=ValueError)
            if value % self.page or value < 2 * self.page:
                raise ValueError(f"history_budget must be a multiple of page_size={self.page} and at least 2 pages "
                                 f"({2 * self.page} tokens), got {value}")
        self._history_budget = value

    @property
    def tokens(self) -> list:
        return self._stored + self._pending

    def generate(self, prompt, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One turn: append ``prompt`` (a string, tokenized as it is, or token ids) to the
        conversation and answer it. Returns a :class:`RequestOutput` whose ``prompt_token_ids`` are
        this turn's new tokens (the last answer's tokens first, then ``prompt``) and whose timings
        add ``history_tokens`` (tokens read from the stored history), ``chunk_tokens`` and
        ``history_h2d_bytes`` (bytes the chunk's prefill copied from the pool).
        Raises ValueError / TypeError for a bad prompt or parameters, a conversation that would
        pass ``max_model_len``, a closed session, or (offload) a pool too small even after evicting
        idle sessions; the session is unchanged then and keeps serving."""
        return self._wait(self.submit(prompt, sampling_params))

    def append(self, prompt) -> dict:
        """Add ``prompt`` (a string, tokenized as it is, or token ids) to the conversation without
        answering: its K/V are computed against the history and stored (e.g. a document loaded
        once, asked about in later turns). Returns the chunk's timings (``prefill_ms``,
        ``chunk_tokens``, ``history_tokens``, ``history_h2d_bytes``). Same errors as
        :meth:`generate`."""
        state: dict = {}
        self._wait(self.submit(prompt, None, _answer=False, _state=state))
        return state["result"]

    def chat(self, message: str, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn through the tokenizer's chat template: the user ``message`` (a string) is
        added to the conversation's messages, the template renders them all, and the tokens past
        the stored history are this turn's chunk; the answer's text joins the messages as the
        assistant's. If the template renders the earlier conversation differently from what is
        stored (some templates rewrite earlier turns), the history is prefilled again from the
        rendering. Raises ValueError without a chat template, and as :meth:`generate`."""
        self._check_open()
        if not isinstance(message, str) or not message:
            raise ValueError(f"message must be a non-empty string, got {message!r}")
        if self.queued:
            raise ValueError(f"session {self.id} is in a turn; one turn at a time")
        msgs = self._messages + [{"role": "user", "content": message}]
        full = apply_chat_template(self.m, msgs, add_generation_prompt=True)
        n = self.history_len
        if full[:n] == self._stored:
            chunk = full[n:]
        else:
            self._drop_kv()
            chunk = full
        if not chunk:
            raise ValueError("the chat template added no tokens for this message")
        out = self._wait(self.submit(chunk, sampling_params, _chunk=True))
        self._messages = msgs + [{"role": "assistant", "content": out.text or ""}]
        return out

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, request_id: str | None = None,
               close_after: bool = False, _answer: bool = True, _chunk: bool = False, _state=None) -> str:
        """Queue one turn (``prompt`` answered, as :meth:`generate`) in the engine loop without
        waiting; returns its request id (the engine's :meth:`~.llm_engine.LLMEngine.step` returns
        its outputs; ``close_after``: the session closes when the turn ends). Raises as
        :meth:`generate`, and ValueError while a turn of this session is queued or running."""
        self._check_open()
        e = self.e
        ids = prompt_ids(self.m, e.config.max_model_len, 0, prompt)
        chunk = ids if _chunk else self._pending + ids
        sp = sampling_list(sampling_params, 1)[0] if _answer else SamplingParams(max_tokens=1)
        n, T = self.history_len, len(chunk)
        if n + T > e.config.max_model_len:
            raise ValueError(f"the conversation would hold {n + T} tokens ({n} stored + {T} new), more than "
                             f"max_model_len={e.config.max_model_len}")
        state = {} if _state is None else _state
        state.update(known=n, reused=0, answer=_answer, close=close_after)
        return self._queue_turn(request_id, self._stored + chunk, sp, state,
                                prefill_hook=lambda seq: self._prefill(seq, state))

    def _queue_turn(self, request_id, tokens: list, sp, state: dict, **hooks) -> str:
        """Add the turn's request (one turn at a time: ValueError while one is queued)."""
        rid = request_id or f"session-{self.id}-{next(_ids)}"
        with _submit_lock:
            if self.queued:
                raise ValueError(f"session {self.id} is in a turn; one turn at a time")
            self.queued = True
        try:
            self.e.add_request(rid, tokens, sp, on_finish=lambda out: self._finished(out, state), **hooks)
        except BaseException:
            self.queued = False
            raise
        return rid

    def close(self) -> None:
        """Free the session's KV (pool blocks or device rows) and summaries. Safe to call twice."""
        if self.closed:
            return
        cache = self.e.prefix_cache
        if cache is not None and self.seq is not None and self.history_len and not self.offload._closed:
            cache.insert(self.seq, self._stored)  # later requests may reuse the conversation's blocks
        self._drop_kv()
        self.closed = True
        self.e.sessions.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # closes the session
        self.close()

    # ------------------------------------------------------------------ a turn
    def _check_open(self):
        if self.closed or self.e.closed:
            raise ValueError("this session was closed" if self.closed else "this session's LLM was closed")

    def _wait(self, rid: str) -> RequestOutput:
        out = self.e.wait(rid)
        if out.error is not None:
            raise out.error
        return out

    def _history_sparse_layers(self, n: int) -> frozenset:
        if self.history_budget is None or n // self.page * self.page <= self.history_budget:
            return frozenset()
        return frozenset(range(self.cfg.num_layers)) - frozenset(self.dense_layers)

    def _prefill(self, seq, state: dict):
        """The turn's prefill (the engine loop calls it): reuse a cached prefix on a first turn,
        reserve the pool room, prefill the chunk against the history (the conversation past what
        is stored: evicted while the turn waited, all of it); sets the sequence's decode store.
        Returns the chunk's last logits. On failure the session is as before."""
        self.busy = True  # from here on its KV is in use: never evicted
        n = self.history_len
        chunk = seq.req.ids[n:]
        state["before"] = (list(self._stored), list(self._pending))
        try:
            if self.seq is None and n == 0 and self.e.prefix_cache is not None:
                r = state["reused"] = self._reuse_prefix(chunk)
                n, chunk = r, chunk[r:]
            self._reserve(n + len(chunk), seq.req.max_new)
            # a reused prefix is read whole: reuse never changes the tokens
            sink = ChunkSink(self, n, len(chunk), dense=state["reused"] > 0)
            ids_t = torch.tensor(chunk, dtype=torch.int64).to(self.device)
            cfg = self.e.config
            try:
                logits = self.m.prefill(ids_t, sink, chunk=cfg.prefill_chunk, policy=cfg.policy,
                                        densities=seq.densities, attn_backend=cfg.prefill_attn, start=n)
            finally:
                self._stored = self._stored + list(chunk)  # half written on failure: dropped below
        except BaseException:
            before = state["before"]
            if self.history_len == 0 and self.seq is not None and self.offload is not None:
                self.offload.free(self.seq)  # a refused first turn: the next asks the cache again
                self.seq = None
            if state["reused"] or self._stored != before[0]:
                self._drop_kv()  # the stored KV changed: the next turn prefills the conversation again
                self._stored, self._pending = [], before[0] + before[1]
            raise
        state.update(n=n, T=len(chunk), sink=sink)
        if state["answer"]:
            seq.kv = self._decode_store(seq.req, sink.events)
        return logits

    def _finished(self, out: RequestOutput, state: dict) -> None:
        """The turn's final output (the engine loop calls it): the answer joins the conversation;
        its timings name the chunk and the history it read."""
        try:
            sink = state.get("sink")
            if sink is None:  # never prefilled (refused, aborted while waiting)
                return
            self._pending = list(out.token_ids) if state["answer"] else []
            t = out.timings
            extra = dict(history_tokens=state["n"], chunk_tokens=state["T"], history_h2d_bytes=int(sink.h2d_bytes),
                         history_sparse_layers=len(sink.sparse_layers))
            if t:
                t.pop("prefix_reused_tokens", None)
                t["prompt_tokens"] = state["T"]
                t["prefill_tok_per_s"] = state["T"] / t["prefill_ms"] * 1e3 if t["prefill_ms"] > 0 else float("inf")
                t.update(extra)
                if state["reused"]:
                    t["prefix_reused_tokens"] = state["reused"]
            out.prompt_token_ids = list(out.prompt_token_ids[state["known"]:])
            if state["answer"]:
                self.turns += 1
            else:
                state["result"] = dict(prefill_ms=t.get("prefill_ms"), chunk_tokens=state["T"],
                                       history_tokens=state["n"], history_h2d_bytes=int(sink.h2d_bytes),
                                       history_sparse_layers=len(sink.sparse_layers))
        finally:
            self.busy = self.queued = False
            self.last_used = next(_ids)
            if state["close"]:
                self.close()

    def _reuse_prefix(self, chunk: list) -> int:
        """First turn with the engine's prefix cache: start the pool sequence on the cached blocks
        of the longest cached prefix of ``chunk`` (its last token is always prefilled, for the
        logits); their summaries, when needed, are computed from the pool. Returns the tokens
        reused."""
        eng = self.offload
        self.seq, r = self.e.prefix_cache.add_sequence(chunk[:-1])
        if r:
            self._stored = list(chunk[:r])
            self._reserve(r, 1)  # allocates the summaries (no new blocks: they are held)
            B = eng.block_size
            for layer in range(self.cfg.num_layers):
                k, _ = eng.fetch_blocks(self.seq, layer, list(range(-(-r // B))))
                self._summarize(layer, 0, k[:r])
        return r

    def _decode_store(self, req, events):
        cfg, n = self.cfg, self.history_len
        max_new = req.final_len - n
        kw = dict(prompt_len=n, max_new=max_new, policy=self.policy, summaries=self._summ if self.policy else None)
        if self.offload is None:
            kv = PagedKV(cfg, self.dtype, self.device, self.scale, rows=self._rows, **kw)
        else:
            kv = PagedKV(cfg, self.dtype, self.device, self.scale, engine=self.offload, seq=self.seq,
                         owns_seq=False, stage_dense=self.e.config.offload_decode != "uva", **kw)
        kv.load_from_store(events)
        return kv

    # ------------------------------------------------------------------ storage
    @property
    def history_len(self) -> int:
        """Tokens whose K/V are stored."""
        return len(self._stored)

    def _reserve(self, total: int, max_new: int) -> None:
        """Room for ``total`` stored tokens (+ the decode's tail), before anything is written."""
        cfg = self.cfg
        L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if self._summ is None:  # always kept (2 / page_size of K's bytes): decode policy and sparse history read them
            pages = -(-self.e.config.max_model_len // self.page)
            self._summ = PageSummaries(L, hkv, d, pages, self.page, self.dtype, self.device,
                                       exact_channels=self.policy.exact_channels if self.policy else 0)
        if self.offload is None:
            quantum = max(256, self.page)
            need = -(-total // quantum) * quantum
            have = 0 if self._rows is None else self._rows[0].shape[1]
            if need > have:
                cap = min(max(need, 2 * have), -(-self.e.config.max_model_len // quantum) * quantum)
                cap = max(cap, need)
                k = torch.empty(L, cap, hkv, d, dtype=self.dtype, device=self.device)
                v = torch.empty_like(k)
                if self._rows is not None and self.history_len:
                    k[:, :self.history_len].copy_(self._rows[0][:, :self.history_len])
                    v[:, :self.history_len].copy_(self._rows[1][:, :self.history_len])
                self._rows = (k, v)
            return
        eng = self.offload
        B = eng.block_size
        table = eng.block_table(self.seq) if self.seq is not None else ()
        need = -(-total // B) - len(table)
        if table and self.history_len % B and eng.allocator.is_shared(table[-1]):
            need += 1  # the shared, partly filled last block is copied before it is written
        idle = reclaimable_blocks(self.e, keep=self)
        if need > eng.num_free_blocks + idle:
            raise ValueError(f"the session needs {need} more pool blocks of {B} tokens ({total} tokens in all) but "
                             f"the pool has {eng.num_free_blocks} free of {eng.allocator.num_blocks} "
                             f"(kv_cache_tokens) and idle sessions and cached prefixes hold {idle} more that could "
                             f"be freed; close sessions or raise kv_cache_tokens")
        if need > eng.num_free_blocks:
            make_room(self.e, need, keep=self)
        if self.seq is None:
            self.seq = eng.add_sequence()

    def _summarize(self, layer: int, n: int, k: torch.Tensor) -> None:
        """Page min/max of the chunk's K (positions ``n ..``), merged with the history's partial
        last page."""
        if self._summ is None:
            return
        P = self.page
        p0, r = divmod(n, P)
        if r:
            prev = self._rows[0][layer, p0 * P:n] if self.offload is None else self._partial[layer]
            k = torch.cat([prev, k])
        written = self._summ.write(layer, k, first_page=p0)
        if self.offload is not None:
            self._partial[layer] = k[written * P:].clone()

    def _drop_kv(self) -> None:
        """Forget the stored KV (the tokens stay: the next turn prefills them again)."""
        if self.offload is not None and self.seq is not None and not self.offload._closed:
            self.offload.free(self.seq)
        self.seq = None
        self._rows = None
        self._summ = None
        L = self.cfg.num_layers
        self._partial, self._write_ev = [None] * L, [None] * L
        self._pending = self._stored + self._pending
        self._stored = []

    def blocks_held(self) -> int:
        """Pool blocks this session's stored KV holds, shared ones included (0 in resident mode or
        once evicted)."""
        if self.offload is None or self.seq is None or self.offload._closed:
            return 0
        return self.offload.num_seq_blocks(self.seq)

    def evict(self) -> int:
        """Drop this idle session's KV to free its pool blocks (its next turn prefills the whole
        conversation again). Returns the blocks freed. Raises ValueError during a turn."""
        if self.busy:
            raise ValueError(f"session {self.id} is in use and cannot be evicted")
        freed = self.blocks_held()
        self._drop_kv()
        return freed
