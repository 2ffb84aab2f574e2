"""The KV stores of the step loop: the KV of every running sequence of a store epoch
(:class:`~xoffload.engine.llm_engine.LLMEngine`), and one decode step's attention for all of them.

(Over 450 lines on purpose: the four batched stores share one row-pool and position
bookkeeping base class; split apart they would each re-import and re-document it.)

A store is opened per store epoch (:meth:`BatchKV.open`, its pools sized from the requests
waiting and the engine's headroom) and serves the :class:`~xoffload.engine.scheduler.Scheduler`:

- admission: ``check(seq)`` (ValueError naming the sizes when the sequence alone can never fit),
  ``can_admit(seq)``, ``admit(seq)`` (reserve every token of KV it may hold: prompt + new),
  ``release(seq)``;
- prefill: ``sink(seq)``, the model's prefill sink for that sequence (``buffers`` / ``done``);
  where ``batch_prefill`` (the resident stores), also ``batch_sink(seqs)``, the sink of one
  ``LlamaModel.prefill_batch`` over a group (:mod:`~xoffload.engine.kv_batch_prefill`);
- decode: ``set_batch(seqs) -> rows`` (the running sequences in row order, padded to a batch-size
  bucket: ``rows >= len(seqs)``; host work, only when the batch changes), then per step
  ``begin_step()``, ``attend(layer, q [rows, Hq, D], k_new [rows, Hkv, D], v_new) -> [rows, Hq,
  D]``, ``end_step()``, ``advance()``; ``pos`` is the int64 ``[rows]`` device position of each row
  (the model's RoPE input). Padding rows attend to nothing and write into a scratch block;
- ``capturable``: every step of a batch has the same shapes and reads its positions on the
  device, so one step per bucket may be captured in a CUDA graph (:class:`~.cuda_graph.BatchGraphs`);
- ``h2d_bytes_per_step(seq)``, ``close()``.

Stores:

- :class:`ResidentBatchKV` (``resident``): one paged KV pool on the model's device for all the
  sequences (``[L, blocks * kv_block_size, Hkv, D]`` rows, block tables per sequence); decode is
  one :func:`~xoffload.kernels.paged_decode_attn_with_lse` launch per layer for the whole batch,
  each row with its own length (the split-KV kernel of :mod:`xoffload.kernels.decode` with a page
  table). A slot-per-sequence cache for :func:`~xoffload.kernels.decode_attn_with_lse` would hold
  ``max_model_len`` tokens per slot and need the running sequences packed into the first slots
  for a graph per bucket; the pool holds what each sequence may reach and nothing else.
- :class:`OffloadBatchKV` (``offload``, direct decode, no decode policy): prompts in the offload
  engine's pinned CPU pool, read in place over PCIe by one paged launch per layer for the batch
  (a page table of pool blocks per row); generated tokens in a paged GPU tail pool (a second
  launch); the two merged by LSE.
- :class:`OffloadQuestBatchKV` (``offload`` + :class:`~xoffload.sparse.QuestDecode`, direct
  decode, no prefetch asked for): prompts in the pinned pool, every admitted sequence's page
  summaries in one shared GPU summary pool, sink + recent + generated tokens in the paged GPU tail
  pool, the dense layers on the GPU when they fit (else read in place), a GPU page cache per
  sequence (:mod:`~xoffload.engine.kv_batch_cache`) when it fits; per layer one batched score
  launch, one topk, one cache lookup + fill and one paged launch for the whole batch.

The two offload stores cache prefixes (``prefix_caching``: ``open(..., prefix_cache=)``,
``takes_prefix_cache``); the Quest store's prefill over a reused prefix is in
:mod:`~xoffload.engine.kv_batch_quest_prefix`.
- :class:`SerialBatchKV`: every other store (Quest resident, Quest with prefetch, the ring, stores
  registered later):
  one per-request store per sequence, the batch's model step shared (one read of the weights for
  all rows) but attention one sequence at a time, eager.

:func:`batch_store_class` picks one from the LLM's store class and configuration.
"""
from __future__ import annotations

import torch

from ..kernels import flash_attn_with_lse, merge_attention_states, paged_decode_attn_with_lse
from ..kernels.topk import topk_ids
from ..runtime.allocator import BlockAllocator
from ..sparse.quest import choose_channels
from .kv_batch_cache import BatchPageCache
from .kv_store import PrefillStaging, ResidentKV

__all__ = ["BatchKV", "ResidentBatchKV", "OffloadBatchKV", "OffloadQuestBatchKV", "SerialBatchKV", "RowPool",
           "batch_store_class", "batch_buckets", "TAIL_BLOCK", "SUMMARY_BLOCK"]

#: tokens per block of the GPU tail pool of generated tokens (offload): one page per kernel tile
TAIL_BLOCK = 64

#: Quest summary pages per block of the batched Quest store's shared summary pool
SUMMARY_BLOCK = 16


def batch_buckets(max_num_seqs: int) -> tuple:
    """Batch sizes a decode step is padded to (one CUDA graph each): powers of two below
    ``max_num_seqs``, then ``max_num_seqs`` itself; e.g. 6 -> (1, 2, 4, 6), 16 -> (1, 2, 4, 8, 16)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(int(max_num_seqs))
    return tuple(out)


def _blocks(n_tokens: int, block: int) -> int:
    return -(-int(n_tokens) // block)


def _top_sum(values, k: int) -> int:
    return sum(sorted(values, reverse=True)[:k])


def _join(seqs, device) -> None:
    """A sequence's first decode step: the current stream waits (on the GPU) for the copies of its
    prompt into the pool (``seq.kv["events"]``) before anything reads them."""
    cur = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for s in seqs:
        if not s.kv["joined"]:
            if cur is not None:
                for ev in s.kv["events"]:
                    cur.wait_event(ev)
            s.kv["events"], s.kv["joined"] = [], True


def _pool_memory_limit(model, seqs, config, device, group_tokens: int = 0) -> int | None:
    """Bytes of GPU memory a batched store's pools may take (None: no limit, the CPU): the free
    memory under the process's cap less a prefill's headroom for the call's longest prompt (or
    ``group_tokens``, the most a batched prefill of short prompts may hold, when more); with
    tensor parallelism the smallest over the ranks, so every rank sizes the same pools and admits
    the same sequences."""
    T = max([s.prompt_len for s in seqs] + [1, int(group_tokens)])
    limit = _gpu_kv_limit_bytes(device, _prefill_headroom(model, T, config.prefill_chunk))
    tp = getattr(model, "tp", None)
    if tp is not None and limit is not None:
        limit = int(tp.all_reduce_min(torch.tensor([limit], dtype=torch.int64, device=device)))
    return limit


def _to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a small host tensor into ``dst`` without making the host wait for the GPU (through
    pinned memory on CUDA: torch keeps the pinned buffer until the copy has run)."""
    if dst.device.type == "cuda":
        src = src.pin_memory()
        dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)


def _gpu_kv_limit_bytes(device: torch.device, headroom: int) -> int | None:
    """Bytes a KV pool may take on ``device`` now: the free memory (with what the caching allocator
    holds unused, and under ``torch.cuda.set_per_process_memory_fraction``) less ``headroom``;
    None off CUDA (no limit)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    get_frac = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_frac is not None:
        free = min(free, int(get_frac(device) * total) - torch.cuda.memory_allocated(device))
    return max(0, free - headroom)


def _prefill_headroom(model, prompt_len: int, chunk: int) -> int:
    """Bytes a prefill of ``prompt_len`` tokens needs besides the KV (residual stream, q, the layer's
    K/V staging, one chunk's MLP temporaries, logits), plus 1 GiB for CUDA graphs and the allocator."""
    c = model.cfg
    e = torch.empty((), dtype=model.dtype).element_size()
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_tok = c.hidden_size + c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    ch = min(chunk, prompt_len)
    return e * (prompt_len * per_tok + ch * (3 * c.intermediate_size + qkv + c.hidden_size)) + 4 * c.vocab_size + (1 << 30)


class RowPool:
    """Paged token rows of every layer on one device: K and V ``[L, (num_blocks + 1) * block, Hkv,
    D]``, handed out in blocks of ``block`` tokens through a
    :class:`~xoffload.runtime.BlockAllocator` (the last block is scratch: padding rows of a batch
    write there and no table lists it).

    Args:
        cfg: the model's config; num_blocks: blocks (>= 0); block: tokens per block; dtype, device.
    Raises:
        torch.OutOfMemoryError when the device cannot hold it.
    """

    def __init__(self, cfg, num_blocks: int, block: int, dtype, device):
        self.block, self.num_blocks = int(block), int(num_blocks)
        self.alloc = BlockAllocator(self.num_blocks, self.block)
        shape = (cfg.num_layers, (self.num_blocks + 1) * self.block, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch = self.num_blocks * self.block  # first row of the scratch block

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, sid: int, n_tokens: int) -> tuple:
        """Give sequence ``sid`` blocks for ``n_tokens`` tokens; returns its block table (physical
        ids). PoolExhaustedError (ValueError) when they are not free."""
        self.alloc.add(sid)
        try:
            self.alloc.allocate(sid, _blocks(n_tokens, self.block))
        except Exception:
            self.alloc.free(sid)
            raise
        return self.alloc.table(sid)

    def free(self, sid: int) -> None:
        """Return sequence ``sid``'s blocks (nothing if it holds none)."""
        if self.alloc.has(sid):
            self.alloc.free(sid)

    def rows(self, table, n_tokens: int, start: int = 0) -> torch.Tensor:
        """int64 ``[n_tokens - start]`` (host) row of each token ``start .. n_tokens - 1``."""
        t = torch.arange(start, n_tokens, dtype=torch.int64)
        bt = torch.tensor(table, dtype=torch.int64)
        return bt[t // self.block] * self.block + t % self.block

    def page_row(self, table, n_pages: int) -> torch.Tensor:
        """int32 ``[n_pages]`` page-table row: the first row of each block, then the scratch row."""
        out = torch.full((n_pages,), self.scratch, dtype=torch.int32)
        if table:
            out[:len(table)] = torch.tensor(table, dtype=torch.int32) * self.block
        return out


class _Region:
    """The device state of one paged region of a batch (a :class:`RowPool` seen by every row): page
    table ``[R, 1, P]`` int32, the model position of the region's first token per row (``base``),
    and per step the attended length ``lens`` (int32) and the row ``wrow`` (int64) that receives the
    step's new K/V. :meth:`step` derives them from the rows' positions on the device."""

    def __init__(self, pool: RowPool, rows: int, pages: int, device):
        self.pool, self.pages = pool, max(1, int(pages))
        self.table = torch.full((rows, 1, self.pages), pool.scratch, dtype=torch.int32, device=device)
        self.base = torch.zeros(rows, dtype=torch.int64, device=device)
        self.lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.wrow = torch.full((rows,), pool.scratch, dtype=torch.int64, device=device)

    def set_rows(self, tables: list, bases: list, rows: int) -> None:
        """Rows ``0 .. len(tables)-1`` get these block tables and bases; rows up to ``rows`` pad."""
        tab = torch.full((rows, self.pages), self.pool.scratch, dtype=torch.int32)
        for i, t in enumerate(tables):
            tab[i] = self.pool.page_row(t, self.pages)
        base = torch.zeros(rows, dtype=torch.int64)
        base[:len(bases)] = torch.tensor(bases, dtype=torch.int64)
        _to_device(self.table[:rows, 0], tab)
        _to_device(self.base[:rows], base)

    def step(self, pos: torch.Tensor, active: torch.Tensor, n: int) -> None:
        """Device-only (CUDA-graph safe): for rows ``:n`` at positions ``pos``: lens = pos - base + 1
        (0 for inactive rows), wrow = the row of token ``pos - base`` (scratch for inactive rows)."""
        off = (pos[:n] - self.base[:n]).clamp_(min=0)
        self.lens[:n].copy_((off + 1) * active[:n])
        blk = self.pool.block
        page = (off // blk).clamp_(max=self.pages - 1)
        first = self.table[:n, 0].gather(1, page[:, None])[:, 0].to(torch.int64)
        w = first + off % blk
        self.wrow[:n].copy_(torch.where(active[:n] > 0, w, torch.full_like(w, self.pool.scratch)))

    def attend(self, layer: int, q4, k_new, v_new, n: int, scale: float):
        """Write the rows' new K/V and attend over the region: ``(out [n, 1, Hq, D], lse)``."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        k.index_copy_(0, self.wrow[:n], k_new)
        v.index_copy_(0, self.wrow[:n], v_new)
        return paged_decode_attn_with_lse(q4, k, v, self.table[:n], self.lens[:n], page_size=self.pool.block,
                                          softmax_scale=scale, check=False)


class BatchKV:
    """Base of the batched stores (the interface is in the module docstring).

    Args:
        model: the :class:`~xoffload.models.llama.LlamaModel`.
        config: the LLM's bound :class:`~xoffload.engine.config.EngineConfig`.
        shared: what the LLM's store class shares between requests (the offload engine, or None).
        seqs: every :class:`~xoffload.engine.scheduler.Sequence` of the call (sizes the pools).
    """

    capturable = False
    #: whether :meth:`open` takes the engine's ``prefix_cache=`` (the offload stores that cache prefixes)
    takes_prefix_cache = False

    def __init__(self, model, config, shared, seqs):
        self.m, self.config, self.shared = model, config, shared
        self.cfg, self.dtype, self.device, self.scale = model.cfg, model.dtype, model.device, model.scale
        self.max_num_seqs = int(config.max_num_seqs)
        self.buckets = batch_buckets(self.max_num_seqs)
        R = self.buckets[-1]
        self.pos = torch.zeros(R, dtype=torch.int64, device=self.device)
        self.active = torch.zeros(R, dtype=torch.int64, device=self.device)
        self.n = 0
        self.max_len = max([s.final_len for s in seqs] + [1])
        self.max_prompt = max([s.prompt_len for s in seqs] + [1])
        self.max_new = max([s.req.max_new for s in seqs] + [1])
        self._closed = False

    def check_shape(self, seq) -> None:
        """ValueError when ``seq`` is longer than the store's per-row tables were sized for (its
        prompt, new tokens or whole length over the largest request it was opened for): the
        engine then opens a store sized for it once the running sequences are done."""
        if seq.final_len > self.max_len or seq.prompt_len > self.max_prompt or seq.req.max_new > self.max_new:
            raise ValueError(f"prompt {seq.index} ({seq.prompt_len} prompt + {seq.req.max_new} new tokens) is longer "
                             f"than this store's rows ({self.max_prompt} prompt, {self.max_new} new, {self.max_len} in all)")

    @classmethod
    def open(cls, model, config, shared, seqs) -> "BatchKV":
        """The store of one store epoch of the engine, sized for ``seqs``."""
        return cls(model, config, shared, seqs)

    def bucket(self, n: int) -> int:
        """The padded row count of a batch of ``n`` sequences."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a batch of {n} sequences is more than max_num_seqs={self.max_num_seqs}")

    # admission (see the Scheduler)
    def check(self, seq) -> None:
        raise NotImplementedError

    def can_admit(self, seq) -> bool:
        raise NotImplementedError

    def admit(self, seq) -> None:
        raise NotImplementedError

    def release(self, seq) -> None:
        raise NotImplementedError

    def sink(self, seq):
        raise NotImplementedError

    #: whether :meth:`batch_sink` serves ``LlamaModel.prefill_batch`` (the runner then prefills
    #: short admitted prompts together)
    batch_prefill = False

    def batch_sink(self, seqs):
        """The sink of one ``LlamaModel.prefill_batch`` over ``seqs`` (each past its
        :meth:`prefill_start`), with ``starts`` / ``lens`` (the model's arguments); only where
        ``batch_prefill``."""
        raise NotImplementedError(f"{type(self).__name__} has no batched prefill")

    def prefill_start(self, seq) -> int:
        """Tokens of ``seq``'s prompt whose KV the store already holds (a reused prefix): its
        prefill starts there and its sink attends to them as history. Called once, right before
        its prefill; default 0."""
        return 0

    def prefill_tokens(self, seq) -> int:
        """Tokens ``seq``'s prefill would compute if it started now (what the scheduler's
        ``max_num_batched_tokens`` counts): its prompt less a cached prefix; default the prompt."""
        return seq.prompt_len

    def h2d_bytes_per_step(self, seq) -> int | None:
        """Bytes one decode step reads from host memory for ``seq`` (None: none)."""
        return None

    def decode_stats(self, seq) -> dict:
        """Extra figures of ``seq``'s decode steps for its timings (read before it is released)."""
        return {}

    def describe(self) -> dict:
        """What the store chose for this call (its class, pool sizes in bytes; read before close)."""
        return {"store": type(self).__name__}

    # decode
    def _set_positions(self, seqs, rows: int) -> None:
        pos = torch.zeros(rows, dtype=torch.int64)
        act = torch.zeros(rows, dtype=torch.int64)
        pos[:len(seqs)] = torch.tensor([s.pos for s in seqs], dtype=torch.int64)
        act[:len(seqs)] = 1
        _to_device(self.pos[:rows], pos)
        _to_device(self.active[:rows], act)

    def set_batch(self, seqs) -> int:
        raise NotImplementedError

    def begin_step(self) -> None:
        pass

    def attend(self, layer, q, k_new, v_new):
        raise NotImplementedError

    def end_step(self) -> None:
        pass

    def advance(self) -> None:
        """Every active row's position += 1 on the device (the last op of a captured step)."""
        self.pos[:self.n].add_(self.active[:self.n])

    def close(self) -> None:
        self._closed = True


class _StagedSink:
    """Prefill sink of one sequence: K/V buffers the model fills per layer, handed to ``on_done``;
    with ``history`` (a prefill continuing KV already stored: a reused prefix), also the model's
    ``history(layer, q) -> (o, lse)``."""

    def __init__(self, buffers, on_done, history=None):
        self.buffers, self._done = buffers, on_done
        if history is not None:
            self.history = history

    def done(self, layer, k, v):
        self._done(layer, k, v)


class ResidentBatchKV(BatchKV):
    """``resident``: one paged KV pool on the model's device for every running sequence.

    The pool's block is ``kv_block_size`` tokens (a power of two >= 16, the page of the paged
    kernel). Its size: ``kv_cache_tokens`` when given, else what the ``max_num_seqs`` largest
    requests of the call need; on CUDA at most what fits in the free memory after a prefill's
    headroom (a smaller pool admits fewer sequences at a time). A sequence reserves blocks for its
    prompt and every token it may generate when admitted. Prefill writes straight into its blocks
    when they are one run (the allocator prefers runs), else through a staging buffer copied into
    its rows. Decode: one paged launch per layer for the batch (each row its own page list and
    length).
    """

    capturable = True

    def __init__(self, model, config, shared, seqs):
        super().__init__(model, config, shared, seqs)
        blk = self.block = int(config.kv_block_size)
        need = [_blocks(s.final_len, blk) for s in seqs]
        nb = _top_sum(need, self.max_num_seqs)
        self.cap_tokens = config.kv_cache_tokens
        if self.cap_tokens is not None:
            nb = min(nb, self.cap_tokens // blk)
        per_block = blk * self.cfg.kv_bytes_per_token(self.dtype)
        from .kv_batch_prefill import GROUP_PREFILL_MAX_TOKENS  # (a module that imports this one)

        group = min(int(config.max_num_batched_tokens or 0), self.max_num_seqs * GROUP_PREFILL_MAX_TOKENS)
        limit = _pool_memory_limit(model, seqs, config, self.device, group_tokens=group)
        self.memory_limited = limit is not None and limit // per_block < nb
        if self.memory_limited:
            nb = limit // per_block
        self.pool = RowPool(self.cfg, nb, blk, self.dtype, self.device)
        self.region = _Region(self.pool, self.buckets[-1], _blocks(self.max_len, blk), self.device)
        self._stage = None

    def _limit_text(self) -> str:
        why = (f"kv_cache_tokens={self.cap_tokens}" if self.cap_tokens is not None and not self.memory_limited
               else "the GPU memory free for KV")
        return f"the KV pool holds {self.pool.num_blocks * self.block} tokens ({why})"

    def check(self, seq):
        self.check_shape(seq)
        n = _blocks(seq.final_len, self.block)
        if n > self.pool.num_blocks:
            raise ValueError(f"prompt {seq.index} needs {n * self.block} tokens of KV ({seq.prompt_len} prompt + "
                             f"{seq.req.max_new - 1} new, in blocks of {self.block}) but {self._limit_text()}")

    def can_admit(self, seq) -> bool:
        return _blocks(seq.final_len, self.block) <= self.pool.alloc.num_free

    def admit(self, seq):
        seq.kv = {"table": self.pool.reserve(seq.key, seq.final_len)}

    def release(self, seq):
        self.pool.free(seq.key)
        seq.kv = None

    def sink(self, seq):
        table, T = seq.kv["table"], seq.prompt_len
        run = all(b == table[0] + i for i, b in enumerate(table))
        if run:  # the blocks are consecutive rows: the model writes into the pool itself
            r0 = table[0] * self.block
            return _StagedSink(lambda layer, t: (self.pool.k[layer, r0:r0 + t], self.pool.v[layer, r0:r0 + t]),
                               lambda layer, k, v: None)
        rows = torch.empty(T, dtype=torch.int64, device=self.device)
        _to_device(rows, self.pool.rows(table, T))

        def done(layer, k, v):
            self.pool.k[layer].index_copy_(0, rows, k)
            self.pool.v[layer].index_copy_(0, rows, v)

        return _StagedSink(self._staging, done)

    batch_prefill = True

    def batch_sink(self, seqs):
        """:class:`~xoffload.engine.kv_batch_prefill.BatchPrefillSink`: the group's K/V through the
        staging pair into each member's rows (one ``index_copy_`` per layer for all)."""
        from .kv_batch_prefill import BatchPrefillSink

        return BatchPrefillSink(self, seqs)

    def _staging(self, layer: int, t: int):
        """A prefill's K/V ``[t, Hkv, D]`` staging buffers (one pair, grown to the longest ``t``),
        copied into the sequence's pool rows by its sink's ``done``."""
        shape = (t, self.cfg.num_kv_heads, self.cfg.head_dim)
        if self._stage is None or self._stage[0].shape[0] < t:
            self._stage = (torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device))
        return self._stage[0][:t], self._stage[1][:t]

    def set_batch(self, seqs) -> int:
        rows = self.bucket(len(seqs))
        self._set_positions(seqs, rows)
        self.region.set_rows([s.kv["table"] for s in seqs], [0] * len(seqs), rows)
        self.n = rows
        return rows

    def begin_step(self):
        self.region.step(self.pos, self.active, self.n)

    def attend(self, layer, q, k_new, v_new):
        o, _ = self.region.attend(layer, q[:, None], k_new, v_new, self.n, self.scale)
        return o[:, 0]

    def close(self):
        self.pool = self.region = self._stage = None
        super().close()


class _CachedPrompts:
    """Prefix caching of the batched offload stores (a :class:`~xoffload.runtime.PrefixCache` over
    the engine's pinned pool in ``self.cache``, or None): a sequence's pool sequence starts at its
    prefill on the longest cached prefix of its prompt (``kv["sid"]`` None until then)."""

    #: the engine passes its prefix cache to :meth:`open` (``prefix_cache=``)
    takes_prefix_cache = True

    def prefill_start(self, seq) -> int:
        """With a prefix cache: start ``seq``'s pool sequence on the longest cached prefix of its
        prompt (now, so that it sees the prompts prefilled before it in this call)."""
        kv = seq.kv
        if kv["sid"] is None:
            kv["sid"], kv["start"] = self.cache.add_sequence(seq.req.ids[:-1])
        return kv["start"]

    def prefill_tokens(self, seq) -> int:
        if self.cache is None:
            return seq.prompt_len
        return seq.prompt_len - self.cache.peek(seq.req.ids[:-1])


class OffloadBatchKV(_CachedPrompts, BatchKV):
    """``offload`` (direct decode, no decode policy): every prompt's KV in the offload engine's
    pinned CPU pool, the generated tokens in a paged GPU tail pool (blocks of :data:`TAIL_BLOCK`).

    Admission reserves the prompt's blocks in the engine's pool (``kv_cache_tokens``, default
    ``max_num_seqs * max_model_len``, fixed when the LLM is made) and tail blocks for the tokens it
    may generate (the tail pool is sized per call from the requests). Prefill copies each layer to
    the pool as :class:`~xoffload.engine.kv_paged.OffloadPagedKV` does (two staging buffers,
    alternating). Decode per layer: one paged launch reads every row's prompt pages in place from
    host memory (UVA on CUDA), one reads the rows' tails from the GPU, and the two are merged by
    LSE.
    """

    capturable = True

    def __init__(self, model, config, shared, seqs, prefix_cache=None):
        super().__init__(model, config, shared, seqs)
        self.eng = shared
        self.block = self.eng.block_size
        self.cache = prefix_cache
        self.cap_blocks = self.eng.num_free_blocks  # the pool is this call's (requests run one call at a time)
        if prefix_cache is not None:  # cached blocks no live sequence holds give way when needed
            self.cap_blocks += prefix_cache.evictable_blocks()
        self._keys = 0
        new = [max(s.req.max_new - 1, 0) for s in seqs] + [0]
        self.tail = RowPool(self.cfg, _top_sum([_blocks(n, TAIL_BLOCK) for n in new], self.max_num_seqs), TAIL_BLOCK,
                            self.dtype, self.device)
        R = self.buckets[-1]
        self.region = _Region(self.tail, R, _blocks(max(new), TAIL_BLOCK), self.device)
        self.hpages = max(1, _blocks(max([s.prompt_len for s in seqs] + [1]), self.block))
        self.htable = torch.zeros(R, 1, self.hpages, dtype=torch.int32, device=self.device)
        self.hlens = torch.zeros(R, dtype=torch.int32, device=self.device)
        self._reserved = 0  # pool blocks of the admitted sequences' prompts
        self._admitted: dict = {}
        self._stage = PrefillStaging(self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device)
        self._tok_bytes = self.cfg.kv_bytes_per_token(self.dtype)

    def _prompt_blocks(self, seq) -> int:
        # with a prefix cache, one more: a shared, partly filled last block is copied before the
        # sequence writes into it (copy-on-write), the new block allocated while the old one is held
        return _blocks(seq.prompt_len, self.block) + (1 if self.cache is not None else 0)

    @staticmethod
    def _new(seq) -> int:
        return max(seq.req.max_new - 1, 0)

    def check(self, seq):
        self.check_shape(seq)
        n = self._prompt_blocks(seq)
        if n > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {n * self.block} tokens of KV in the CPU pool ({seq.prompt_len} "
                             f"prompt tokens in blocks of {self.block}) but the pool holds {self.cap_blocks * self.block} "
                             f"tokens (kv_cache_tokens)")

    def can_admit(self, seq) -> bool:
        return (self._reserved + self._prompt_blocks(seq) <= self.cap_blocks
                and _blocks(self._new(seq), TAIL_BLOCK) <= self.tail.alloc.num_free)

    @classmethod
    def open(cls, model, config, shared, seqs, prefix_cache=None) -> "OffloadBatchKV":
        return cls(model, config, shared, seqs, prefix_cache)

    def admit(self, seq):
        # with a prefix cache the engine sequence starts at the prefill (prefill_start): the
        # match then sees the blocks of the sequences prefilled before it in this call
        key = self._keys
        self._keys += 1
        sid = self.eng.add_sequence() if self.cache is None else None
        self._admitted[key] = seq
        self._reserved += self._prompt_blocks(seq)
        seq.kv = {"key": key, "sid": sid, "start": 0, "tail": self.tail.reserve(key, self._new(seq)), "events": [],
                  "joined": False}

    def release(self, seq):
        kv = seq.kv
        if kv is None:
            return
        self._admitted.pop(kv["key"], None)
        self._reserved -= self._prompt_blocks(seq)
        self.tail.free(kv["key"])
        if kv["sid"] is not None:
            self.eng.free(kv["sid"])
        seq.kv = None

    def h2d_bytes_per_step(self, seq) -> int:
        return seq.prompt_len * self._tok_bytes

    def sink(self, seq):
        sid, events = seq.kv["sid"], seq.kv["events"]

        def buffers(layer, t):
            return self._stage.buffers(self.eng, layer, t)

        def done(layer, k, v):
            ev = self.eng.offload_layer(sid, layer, k, v)
            self._stage.copied(layer, ev)
            events.append(ev)
            if self.cache is not None and layer == self.cfg.num_layers - 1:
                self.cache.insert(sid, seq.req.ids)  # later sequences of this call may share the prompt

        start = seq.kv["start"]

        def history(layer, q):
            """The reused prefix of ``layer`` (every block, read from the pool) for the prompt's
            remaining queries ``q [T, Hq, D]``."""
            k, v = self.eng.fetch_blocks(sid, layer, list(range(_blocks(start, self.block))))
            return flash_attn_with_lse(q[None], k[None, :start], v[None, :start], causal=False, softmax_scale=self.scale)

        return _StagedSink(buffers, done, history if start else None)

    def set_batch(self, seqs) -> int:
        rows = self.bucket(len(seqs))
        _join(seqs, self.device)
        self._set_positions(seqs, rows)
        self.region.set_rows([s.kv["tail"] for s in seqs], [s.prompt_len for s in seqs], rows)
        tab = torch.zeros(rows, self.hpages, dtype=torch.int32)
        lens = torch.zeros(rows, dtype=torch.int32)
        for i, s in enumerate(seqs):
            bt = torch.tensor(self.eng.block_table(s.kv["sid"]), dtype=torch.int32)
            tab[i, :bt.numel()] = bt * self.block
            lens[i] = s.prompt_len
        _to_device(self.htable[:rows, 0], tab)
        _to_device(self.hlens[:rows], lens)
        self.n = rows
        return rows

    def begin_step(self):
        self.region.step(self.pos, self.active, self.n)

    def attend(self, layer, q, k_new, v_new):
        n, q4 = self.n, q[:, None]
        o_t, l_t = self.region.attend(layer, q4, k_new, v_new, n, self.scale)
        pool = self.eng.pool
        o_p, l_p = paged_decode_attn_with_lse(q4, pool.k_rows(layer), pool.v_rows(layer), self.htable[:n],
                                              self.hlens[:n], page_size=self.block, softmax_scale=self.scale,
                                              check=False)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        return o[:, 0]

    def close(self):
        for seq in list(self._admitted.values()):
            self.release(seq)
        self.tail = self.region = None
        self._stage.clear()
        super().close()


class OffloadQuestBatchKV(_CachedPrompts, BatchKV):
    """``offload`` + :class:`~xoffload.sparse.QuestDecode` (direct decode): the batched Quest store.

    Where each sequence's KV lives:

    - every layer's prompt KV (the policy's dense layers too) in the offload engine's pinned CPU
      pool (``kv_cache_tokens``), copied there layer by layer during prefill as
      :class:`OffloadBatchKV` does;
    - the page summaries (per page of ``page_size`` tokens and KV head, the min and max of K) of
      every admitted sequence's candidate pages, sparse layers only, in one shared GPU summary pool
      ``[sparse layers, Hkv, pages + 1, D]`` (the last page is scratch), reserved in blocks of
      :data:`SUMMARY_BLOCK` pages at admission and written during the sequence's prefill as
      :meth:`~xoffload.engine.kv_paged.PagedKV.done` writes its own;
    - per row, in a paged GPU tail pool (blocks of :data:`TAIL_BLOCK`, every layer): the prompt's
      sink and recent tokens (the plan's resident tokens) and every generated token.

    The policy's dense layers (whole prompt read every step): on the GPU in a paged dense pool
    (``[dense layers, blocks * block, Hkv, D]``, the pool's block size, reserved per sequence at
    admission, written during prefill; never copied to the pinned pool) *when the whole pool for
    the ``max_num_seqs`` largest prompts fits* in the GPU memory left after the tails, the
    summaries and a prefill's headroom (``dense_on_gpu``); otherwise they stay in the pinned pool
    and are read in place over PCIe (UVA) each step, as :class:`OffloadBatchKV` reads its prompts.
    Why the choice is made by memory, once per call: a dense layer read over PCIe moves its whole
    prompt every step — on the 8B shape at 32K the 2 dense layers move 256 MiB per sequence and
    step against ~240 MiB for the 30 sparse layers at budget 2048, so keeping them on the GPU
    halves the step's PCIe bytes — but they cost 256 MiB of GPU memory per sequence (4 GiB for 16),
    which under a 24 GiB cap competes with the summaries (~128 MiB per sequence) that admission
    needs. Summaries come first (they decide how many sequences run); the dense pool is all or
    nothing (one launch per dense layer reads one store). :attr:`DENSE_ON_GPU` overrides the
    choice (tests, benchmarks).

    The page caches (:class:`~xoffload.engine.kv_batch_cache.BatchPageCache`): each running
    sequence holds one of ``max_num_seqs`` cache slots with the slots its plan gets alone
    (:meth:`QuestDecode.cache_slots`: ``cache_pages``, or ``cache_bytes`` worth, 2 GiB by default),
    cut to the GPU memory left after the tails, the summaries and the dense pool; when fewer than
    a step's pages fit (or ``cache_pages=0``) there is none and every selected page is read in
    place over PCIe every step — unless fewer sequences at once can each have one: then the call
    runs at most ``run_limit`` of them at a time (the largest count, down to ``1 /``
    :attr:`CACHE_OVER_BATCH` of ``min(max_num_seqs, prompts)``, whose pools and caches fit;
    ``cache_limited``), the others waiting for a finished one, because an uncached sequence moves
    ~16x the PCIe bytes of a cached one (8B shape, 32K, budget 2048, reuse bias 8: ~228 against
    ~14 MB per token). Uncut, a sequence's cache evolves as in its one-request run, so
    with a ``reuse_bias`` it selects the same pages; cut, the bias sees a smaller cache. A policy
    with ``prefetch=True`` keeps the per-request stores (:class:`SerialBatchKV`, see
    :func:`batch_store_class`).

    Prefix caching (``prefix_caching``, the engine's :class:`~xoffload.runtime.PrefixCache` over the
    pinned pool), as :class:`OffloadBatchKV` does it: a sequence's pool sequence starts at its
    prefill on the longest cached prefix of its prompt (``cache.add_sequence(ids[:-1])``), the
    model prefills only the rest, and at the last layer's ``done`` the prompt goes into the cache
    (every layer's blocks: with a cache the dense layers are copied to the pool even when they
    live on the GPU, so that later prompts can reuse them); admission counts the cache's evictable
    blocks and reserves one more pool block per sequence (a shared, partly filled last block is
    copied before the write). What the store builds from a prompt at prefill needs the whole
    layer, so for a reused prefix of ``r`` tokens the prefill's staging holds all ``T`` tokens,
    the first ``r`` read back from the pool (:mod:`~xoffload.engine.kv_batch_quest_prefix`): the
    reused pages' summaries, the exact channels (chosen from the whole prompt's keys), the resident
    sink / recent tokens and the GPU dense pool's rows are then those of a fresh prefill, and the
    chunk attends to every reused token (dense) through the sink's ``history``. Only prefill does
    more work; a decode step is the same (the GPU pools are keyed by the store's own key, the pool
    sequence's block table read by :meth:`set_batch`).

    Decode, per layer, for all rows at once (every shape fixed for the call, so one CUDA graph per
    batch-size bucket): the new K/V written to each row's tail, one paged launch over the tails;
    for a sparse layer one :func:`~xoffload.kernels.quest_score.quest_page_scores_batched` launch
    (row r's query against its own candidate pages, ``-inf`` past its count), one
    :func:`~xoffload.kernels.topk.topk_ids` over ``[rows x Hkv, N]`` with each row's own count
    ``k_r`` (the one-request store's selection, ties to the lowest ids, ids ascending), then
    with the page caches one batched lookup + fill and one paged launch over the caches, without
    them one gather turning candidate indices into pool rows (``[rows, Hkv, K]`` page table) and
    one :func:`~xoffload.kernels.paged_decode_attn_with_lse` launch over the pinned pool, with
    ``k_r * page_size`` tokens per row; for a dense layer one paged launch over every candidate
    page of each row (the tokens between sink and recent tail); the two parts merged by LSE.
    ``N`` / ``K`` are the largest candidate / per-step page counts of the call's requests; each
    row has its own plan (:meth:`QuestDecode.plan` of its prompt length), so its selection and
    attention are those of the per-request store (same pages; float sums in another order).
    Padding rows have length 0 everywhere and write into the tail's scratch block.

    GPU memory: the tail pool (what the ``max_num_seqs`` largest requests need) and the summary
    pool (the same, or on CUDA what fits in the free memory after a prefill's headroom: fewer
    sequences are admitted at a time then), the dense pool when it fits, then the page caches
    (``max_num_seqs`` x slots x one page of every sparse layer); nothing scales with the prompt
    length but the summaries (``2 / page_size`` of K's bytes of the sparse layers) and the dense pool.
    """

    capturable = True
    #: None: the dense layers' KV on the GPU when its pool fits (see above); True / False: always / never
    DENSE_ON_GPU: bool | None = None
    #: when no page cache fits for the call's sequences, run down to ``1 / CACHE_OVER_BATCH`` of them
    #: at once so that each gets a cache (``run_limit``; see the class docstring)
    CACHE_OVER_BATCH = 8

    def __init__(self, model, config, shared, seqs, prefix_cache=None):
        super().__init__(model, config, shared, seqs)
        from types import SimpleNamespace

        from ..sparse.quest import PageSummaries

        self.eng = shared
        self.block = self.eng.block_size
        self.cache = prefix_cache
        pol = self.policy = config.decode_policy
        self.r, self.alpha = int(pol.exact_channels), float(pol.bound_scale)
        if not self.r and self.alpha != 1.0:
            raise ValueError(f"OffloadQuestBatchKV scores a bound_scale below 1 only with exact channels; this "
                             f"policy has exact_channels=0, bound_scale={pol.bound_scale} (batch_store_class routes "
                             f"it to SerialBatchKV)")
        P = self.page = int(pol.page_size)
        if self.block % P:
            raise ValueError(f"QuestDecode.page_size {P} must divide the pool's block size {self.block}")
        L, hkv, d = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        self.sparse = frozenset(pol.sparse_layers(L))
        self.dense = frozenset(range(L)) - self.sparse
        self._sl = {l: i for i, l in enumerate(sorted(self.sparse))}
        self.cap_blocks = self.eng.num_free_blocks  # the pool is this call's
        if prefix_cache is not None:  # cached blocks no live sequence holds give way when needed
            self.cap_blocks += prefix_cache.evictable_blocks()
        self._keys = 0
        plans = [pol.plan(max(s.prompt_len, 1)) for s in seqs]
        self.N = max([p.num_candidates for p in plans] + [0])
        self.K = max([p.pages_per_step for p in plans] + [0]) if self.sparse else 0
        # the GPU memory free for the pools, measured before any of them is allocated
        limit = _pool_memory_limit(model, seqs, config, self.device)
        R = self.buckets[-1]
        tail_need = [p.resident_prompt_tokens + self._new(s) for p, s in zip(plans, seqs)] + [1]
        self.tail = RowPool(self.cfg, _top_sum([_blocks(n, TAIL_BLOCK) for n in tail_need], self.max_num_seqs),
                            TAIL_BLOCK, self.dtype, self.device)
        self.region = _Region(self.tail, R, _blocks(max(tail_need), TAIL_BLOCK), self.device)
        # the summary pool, the dense pool and the page caches, sized for the sequences that run at
        # once (S): from the requests and (CUDA) the free memory; see _plan_memory
        sneed = [_blocks(self._summary_pages(p), SUMMARY_BLOCK) for p in plans]
        dneed = [self._prompt_blocks(s) for s in seqs] if self.dense else [0]
        el = torch.empty((), dtype=self.dtype).element_size()
        per_sb = max(1, len(self.sparse)) * hkv * SUMMARY_BLOCK * (2 * d + P * self.r) * el  # min, max, channels
        per_db = 2 * len(self.dense) * self.block * hkv * d * el
        self._dl = {l: i for i, l in enumerate(sorted(self.dense))}
        self._slot_bytes = sb = BatchPageCache.slot_bytes(len(self.sparse), hkv, d, P, self.dtype)
        cmax = max([self._want_c(p) for p in plans] + [0])
        S = min(self.max_num_seqs, len(seqs))  # the most that run at once in this call
        mem = self._plan_memory(S, sneed, dneed, per_sb, per_db, sb, cmax, limit)
        self.cache_limited = False
        if cmax and mem["slots"] < self.K and limit is not None:
            # no cache for S sequences: fewer at a time, each with its cache, move far fewer PCIe bytes
            # (8B shape, 32K, budget 2048: ~14 MB per sequence and token cached against ~228 MB
            # uncached), so run the largest S' >= S / CACHE_OVER_BATCH whose caches fit
            for s2 in range(S - 1, max(1, -(-S // self.CACHE_OVER_BATCH)) - 1, -1):
                m2 = self._plan_memory(s2, sneed, dneed, per_sb, per_db, sb, cmax, limit)
                if m2["slots"] >= self.K:
                    mem, S, self.cache_limited = m2, s2, True
                    break
        self.run_limit = S
        self.memory_limited, nsb = mem["memory_limited"], mem["nsb"]
        self.dense_on_gpu = mem["dense_on"]
        self.dpool = None
        if self.dense_on_gpu:
            dcfg = SimpleNamespace(num_layers=len(self.dense), num_kv_heads=hkv, head_dim=d)
            self.dpool = RowPool(dcfg, mem["ndb"], self.block, self.dtype, self.device)
        # per-sequence page caches (kv_batch_cache): what the policy gives each plan alone, cut to
        # the memory left after the tails, summaries and dense pool; none when a step's pages do not fit
        self.pcache = None
        if cmax and mem["slots"] >= self.K:
            self.pcache = BatchPageCache(len(self.sparse), hkv, d, S, mem["slots"], max(self.N, 1), self.K, R,
                                        P, pol.reuse_bonus(self.scale), self.dtype, self.device)
        self.sum_alloc = BlockAllocator(nsb, SUMMARY_BLOCK)
        self.summ_scratch = nsb * SUMMARY_BLOCK  # the scratch page (padding entries of the index)
        self.summ = PageSummaries(max(1, len(self.sparse)), hkv, d, self.summ_scratch + 1, P, self.dtype,
                                  self.device, exact_channels=self.r)
        self.summ.kmin.zero_()
        self.summ.kmax.zero_()
        # row r's exact channels per sparse layer and KV head (each sequence chooses its own at prefill)
        self.chan = torch.zeros(R, max(1, len(self.sparse)), hkv, max(self.r, 1), dtype=torch.int32,
                                device=self.device) if self.r else None
        Nw, Kw = max(self.N, 1), max(self.K, 1)
        self.cand_row = torch.zeros(R, Nw, dtype=torch.int32, device=self.device)  # pool row of candidate j
        self.dcand_row = torch.zeros(R, Nw, dtype=torch.int32, device=self.device) if self.dpool is not None \
            else self.cand_row  # dense pool row of candidate j
        self.sidx = torch.full((R, Nw), self.summ_scratch, dtype=torch.int32, device=self.device)
        self.nvalid = torch.zeros(R, dtype=torch.int32, device=self.device)  # candidates scored
        self.klens = torch.zeros(R, dtype=torch.int32, device=self.device)  # k_r * page tokens (sparse)
        self.dlens = torch.zeros(R, dtype=torch.int32, device=self.device)  # n_r * page tokens (dense)
        self.table = torch.zeros(R, hkv, Kw, dtype=torch.int32, device=self.device)
        self._sel = torch.zeros(R * hkv, Kw, dtype=torch.int32, device=self.device)
        self._krows = torch.zeros(R * hkv, dtype=torch.int32, device=self.device)  # k_r per (row, KV head)
        self.scores = torch.empty(R, hkv, Nw, dtype=torch.float32, device=self.device)
        self._reserved = 0
        self._admitted: dict = {}
        self._stage = PrefillStaging(self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device)
        self._tok_layer_bytes = self.cfg.kv_bytes_per_token(self.dtype) // L  # K and V, one token, one layer

    def _plan_memory(self, S, sneed, dneed, per_sb, per_db, slot_bytes, cmax, limit) -> dict:
        """The pools' sizes for ``S`` sequences at once (no allocation): ``nsb`` summary blocks
        (``memory_limited``: cut to the free memory), ``ndb`` dense blocks and whether they go on
        the GPU (``dense_on``: they fit, or :attr:`DENSE_ON_GPU`), and the cache ``slots`` per
        sequence that fit after them (``>= pages_per_step``: a cache; fewer: none)."""
        nsb = _top_sum(sneed, S)
        tail = self.tail.nbytes
        limited = limit is not None and (limit - tail) // per_sb < nsb
        if limited:
            nsb = max(0, (limit - tail) // per_sb)
        ndb = _top_sum(dneed, S) if self.dense else 0
        left = None if limit is None else limit - tail - nsb * per_sb
        # the dense pool allocates one scratch block more than its table can hold
        fits = left is None or (not limited and left >= (ndb + 1) * per_db)
        dense_on = bool(self.dense) and self.N > 0 and (fits if self.DENSE_ON_GPU is None else bool(self.DENSE_ON_GPU))
        free = None if limit is None else left - ((ndb + 1) * per_db if dense_on else 0)
        slots = BatchPageCache.slots_that_fit(cmax, S, slot_bytes, free) if cmax else 0
        return {"nsb": nsb, "memory_limited": limited, "ndb": ndb, "dense_on": dense_on, "slots": slots}

    @property
    def summary_bytes(self) -> int:
        """Bytes of the GPU summary pool."""
        return self.summ.nbytes

    def describe(self) -> dict:
        """The call's choices: ``dense_on_gpu``, ``memory_limited`` (the summary pool was cut to the
        free GPU memory), pool sizes (``summary_pages``, bytes of the summary / tail / dense pools),
        ``N`` / ``K`` (padded candidate and per-step page counts)."""
        return {"store": type(self).__name__, "dense_on_gpu": self.dense_on_gpu,
                "memory_limited": self.memory_limited, "summary_pages": self.sum_alloc.num_blocks * SUMMARY_BLOCK,
                "summary_bytes": self.summ.nbytes, "tail_bytes": self.tail.nbytes,
                "dense_pool_bytes": self.dpool.nbytes if self.dpool is not None else 0,
                "candidate_pages": self.N, "pages_per_step": self.K,
                "cache_slots": self.pcache.C if self.pcache is not None else 0,
                "cache_bytes": self.pcache.nbytes if self.pcache is not None else 0,
                "run_limit": self.run_limit, "cache_limited": self.cache_limited}

    @staticmethod
    def _new(seq) -> int:
        return max(seq.req.max_new - 1, 0)

    def _summary_pages(self, plan) -> int:
        """Summary pages a sequence with ``plan`` reserves: its candidates when it selects (k > 0)."""
        return plan.num_candidates if (self.sparse and plan.pages_per_step > 0) else 0

    def _prompt_blocks(self, seq) -> int:
        return _blocks(seq.prompt_len, self.block)

    def _pool_blocks(self, seq) -> int:
        # with a prefix cache, one more: a shared, partly filled last block is copied before the
        # sequence writes into it (copy-on-write), the new block allocated while the old one is held
        return self._prompt_blocks(seq) + (1 if self.cache is not None else 0)

    @classmethod
    def open(cls, model, config, shared, seqs, prefix_cache=None) -> "OffloadQuestBatchKV":
        return cls(model, config, shared, seqs, prefix_cache)

    def _needs(self, seq) -> tuple:
        p = self.policy.plan(seq.prompt_len)
        return (self._pool_blocks(seq), _blocks(p.resident_prompt_tokens + self._new(seq), TAIL_BLOCK),
                _blocks(self._summary_pages(p), SUMMARY_BLOCK))

    def check(self, seq):
        self.check_shape(seq)
        nb, nt, ns = self._needs(seq)
        if self.dpool is not None and self._prompt_blocks(seq) > self.dpool.num_blocks:  # cannot happen: sized from the requests
            raise ValueError(f"prompt {seq.index} needs {self._prompt_blocks(seq) * self.block} tokens of dense-layer "
                             f"KV on the GPU but "
                             f"the dense pool holds {self.dpool.num_blocks * self.block}")
        if nb > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {nb * self.block} tokens of KV in the CPU pool "
                             f"({seq.prompt_len} prompt tokens in blocks of {self.block}) but the pool holds "
                             f"{self.cap_blocks * self.block} tokens (kv_cache_tokens)")
        if nt > self.tail.num_blocks:
            raise ValueError(f"prompt {seq.index} needs {nt * TAIL_BLOCK} tokens of GPU tail (sink, recent and new "
                             f"tokens) but the tail pool holds {self.tail.num_blocks * TAIL_BLOCK}")
        if ns > self.sum_alloc.num_blocks:
            raise ValueError(f"prompt {seq.index} needs {ns * SUMMARY_BLOCK} pages of Quest summaries "
                             f"({ns * self._sum_block_bytes()} bytes on the GPU) but the summary pool holds "
                             f"{self.sum_alloc.num_blocks * SUMMARY_BLOCK} pages (the GPU memory free for it)")

    def _sum_block_bytes(self) -> int:
        return max(1, len(self.sparse)) * self.cfg.num_kv_heads * SUMMARY_BLOCK * \
            (2 * self.cfg.head_dim + self.page * self.r) * self.summ.kmin.element_size()

    def can_admit(self, seq) -> bool:
        nb, nt, ns = self._needs(seq)
        return (len(self._admitted) < self.run_limit and self._reserved + nb <= self.cap_blocks
                and nt <= self.tail.alloc.num_free and ns <= self.sum_alloc.num_free
                and (self.dpool is None or self._prompt_blocks(seq) <= self.dpool.alloc.num_free))

    def admit(self, seq):
        # the GPU pools are keyed by the store's own key; with a prefix cache the pool sequence
        # starts at the prefill (prefill_start), on the blocks of the prompts prefilled before it
        p = self.policy.plan(seq.prompt_len)
        nb, _, ns = self._needs(seq)
        key = self._keys
        self._keys += 1
        sid = self.eng.add_sequence() if self.cache is None else None
        try:
            tail = self.tail.reserve(key, p.resident_prompt_tokens + self._new(seq))
            self.sum_alloc.add(key)
            self.sum_alloc.allocate(key, ns)
            dtab = self.dpool.reserve(key, seq.prompt_len) if self.dpool is not None else ()
            cslot = self.pcache.acquire() if self.pcache is not None else None
        except Exception:
            self.tail.free(key)
            if self.dpool is not None:
                self.dpool.free(key)
            if self.sum_alloc.has(key):
                self.sum_alloc.free(key)
            if sid is not None:
                self.eng.free(sid)
            raise
        self._admitted[key] = seq
        self._reserved += nb
        seq.kv = {"key": key, "sid": sid, "start": 0, "plan": p, "tail": tail, "stab": self.sum_alloc.table(key),
                  "dtab": dtab, "events": [], "joined": False, "cslot": cslot}

    def release(self, seq):
        kv = seq.kv
        if kv is None:
            return
        key = kv["key"]
        self._admitted.pop(key, None)
        self._reserved -= self._pool_blocks(seq)
        self.tail.free(key)
        if self.sum_alloc.has(key):
            self.sum_alloc.free(key)
        if self.dpool is not None:
            self.dpool.free(key)
        if self.pcache is not None and kv.get("cslot") is not None:
            self.pcache.release(kv["cslot"])
        if kv["sid"] is not None:
            self.eng.free(kv["sid"])
        seq.kv = None

    def _cache_counts(self, seq):
        """(hits, lookups) of ``seq``'s page cache, or None without one / before its first step."""
        kv = seq.kv
        if kv is None or self.pcache is None or kv.get("cslot") is None:
            return None
        hits, looks = self.pcache.counts(kv["cslot"])
        return (hits, looks) if looks else None

    def h2d_bytes_per_step(self, seq) -> int:
        p = seq.kv["plan"] if seq.kv is not None else self.policy.plan(seq.prompt_len)
        dense = 0 if self.dense_on_gpu else len(self.dense) * p.num_candidates * self.page * self._tok_layer_bytes
        hl = self._cache_counts(seq)
        if hl is None:
            return len(self.sparse) * p.pages_per_step * self.page * self._tok_layer_bytes + dense
        hits, looks = hl  # lookups per step: sparse layers x KV heads x k_r (as the one-request store counts)
        hkv = self.cfg.num_kv_heads
        steps = looks // max(1, len(self.sparse) * hkv * p.pages_per_step)
        page_bytes = self.page * self._tok_layer_bytes // hkv  # K and V of one page of one KV head
        return int((looks - hits) * page_bytes / steps) + dense

    def decode_stats(self, seq) -> dict:
        """With the page cache, the one-request store's keys: ``cache_hit_rate`` (None before a
        lookup), ``prefetch_share`` (no prefetch in a batch: 0.0 once a page was copied, else
        None), ``cache_slots`` (this sequence's), ``cache_bytes`` (its slot of the call's caches)."""
        kv = seq.kv
        want = self._want_c(kv["plan"]) if kv is not None else 0
        if not want or self.pcache is None or kv.get("cslot") is None:  # alone: no cache either (or cut)
            return {}
        hits, looks = self.pcache.counts(kv["cslot"])
        c = min(want, self.pcache.C)
        return {"cache_hit_rate": hits / looks if looks else None, "prefetch_share": 0.0 if looks > hits else None,
                "cache_slots": c, "cache_bytes": self.pcache.nbytes // self.pcache.S}

    def _want_c(self, plan) -> int:
        """Cache slots a sequence with ``plan`` has alone (0: none)."""
        return self.policy.cache_slots(plan, self._slot_bytes) if self.sparse else 0

    def _summary_rows(self, stab, n: int) -> torch.Tensor:
        """int64 ``[n]`` (host): summary page of each of a sequence's ``n`` candidates."""
        j = torch.arange(n, dtype=torch.int64)
        bt = torch.tensor(list(stab) or [0], dtype=torch.int64)
        return bt[j // SUMMARY_BLOCK] * SUMMARY_BLOCK + j % SUMMARY_BLOCK

    def sink(self, seq):
        """The prefill sink of ``seq``. Past a reused prefix (``kv["start"]`` tokens, prefix caching)
        the model prefills the rest while :class:`~.kv_batch_quest_prefix.WholeLayer` fills each
        layer's head from the pool, so ``done`` builds the summaries, channels, resident tokens and
        dense rows from the whole layer, as a fresh prefill does; the chunk attends to the prefix
        through ``history``."""
        from .kv_batch_quest_prefix import WholeLayer

        kv = seq.kv
        sid, events, p, start = kv["sid"], kv["events"], kv["plan"], kv["start"]
        P, T = self.page, seq.prompt_len
        res = p.resident_prompt_tokens
        trows = torch.empty(res, dtype=torch.int64, device=self.device)
        _to_device(trows, self.tail.rows(kv["tail"], res))
        ns = self._summary_pages(p)
        srows = lrows = None
        if ns:
            srows = torch.empty(ns, dtype=torch.int64, device=self.device)
            _to_device(srows, self._summary_rows(kv["stab"], ns))
            if self.r:  # the channel values of summary page p live in klab rows p * P .. p * P + P - 1
                lrows = (srows[:, None] * P + torch.arange(P, device=self.device)[None, :]).flatten()
                kv["chan"] = torch.zeros(max(1, len(self.sparse)), self.cfg.num_kv_heads, self.r,
                                         dtype=torch.int32, device=self.device)
        f, s0, t0 = p.first_page, p.sink_len, p.tail_start
        drows = None
        if self.dpool is not None:
            drows = torch.empty(T, dtype=torch.int64, device=self.device)
            _to_device(drows, self.dpool.rows(kv["dtab"], T))

        wl = WholeLayer(self.eng, self._stage, sid, start, T, self.scale)
        last = self.cfg.num_layers - 1

        def done(layer, k_new, v_new):
            k, v = wl.whole(layer)  # [T]: the reused prefix (read from the pool), then k_new
            if res:  # the resident tokens: sink, then the recent tail
                tk, tv = self.tail.k[layer], self.tail.v[layer]
                tk.index_copy_(0, trows[:s0], k[:s0])
                tv.index_copy_(0, trows[:s0], v[:s0])
                tk.index_copy_(0, trows[s0:], k[t0:])
                tv.index_copy_(0, trows[s0:], v[t0:])
            if srows is not None and layer in self.sparse:
                kp = k[f * P:(f + ns) * P].unflatten(0, (ns, P))  # [n, P, Hkv, D]
                si = self._sl[layer]
                self.summ.kmin[si].index_copy_(1, srows, kp.amin(1).transpose(0, 1))
                self.summ.kmax[si].index_copy_(1, srows, kp.amax(1).transpose(0, 1))
                if lrows is not None:  # as PagedKV: channels from the prompt's whole pages
                    whole = T // P
                    ch = choose_channels(k[:whole * P].unflatten(0, (whole, P)), self.r)
                    kv["chan"][si] = ch
                    vals = torch.gather(k[f * P:(f + ns) * P].transpose(0, 1), 2,
                                        ch.long()[:, None, :].expand(-1, ns * P, -1))
                    self.summ.klab[si].index_copy_(1, lrows, vals)
            if drows is not None and layer in self.dense:
                di = self._dl[layer]
                self.dpool.k[di].index_copy_(0, drows, k)
                self.dpool.v[di].index_copy_(0, drows, v)
                if self.cache is None:  # on the GPU only (a cached prompt's blocks hold every layer)
                    return
            ev = self.eng.offload_layer(sid, layer, k_new, v_new)
            self._stage.copied(layer, ev)
            events.append(ev)
            if self.cache is not None and layer == last:
                self.cache.insert(sid, seq.req.ids)  # later sequences of this call may share the prompt

        return _StagedSink(wl.buffers, done, wl.history if start else None)

    def set_batch(self, seqs) -> int:
        rows = self.bucket(len(seqs))
        _join(seqs, self.device)
        self._set_positions(seqs, rows)
        plans = [s.kv["plan"] for s in seqs]
        self.region.set_rows([s.kv["tail"] for s in seqs], [s.prompt_len - p.resident_prompt_tokens
                                                            for s, p in zip(seqs, plans)], rows)
        Nw, P, B = self.cand_row.shape[1], self.page, self.block
        cand = torch.zeros(rows, Nw, dtype=torch.int32)
        dcand = torch.zeros(rows, Nw, dtype=torch.int32)
        sidx = torch.full((rows, Nw), self.summ_scratch, dtype=torch.int32)
        nval = torch.zeros(rows, dtype=torch.int32)
        klen = torch.zeros(rows, dtype=torch.int32)
        dlen = torch.zeros(rows, dtype=torch.int32)
        for i, (s, p) in enumerate(zip(seqs, plans)):
            n = p.num_candidates
            if n:
                tok = (torch.arange(n, dtype=torch.int64) + p.first_page) * P
                if self.sparse or self.dpool is None:  # (no pool blocks when every layer is dense on the GPU)
                    bt = torch.tensor(self.eng.block_table(s.kv["sid"]), dtype=torch.int64)
                    cand[i, :n] = (bt[tok // B] * B + tok % B).to(torch.int32)
                if self.dpool is not None:
                    dbt = torch.tensor(s.kv["dtab"], dtype=torch.int64)
                    dcand[i, :n] = (dbt[tok // B] * B + tok % B).to(torch.int32)
                dlen[i] = n * P
            ns = self._summary_pages(p)
            if ns:
                sidx[i, :ns] = self._summary_rows(s.kv["stab"], ns).to(torch.int32)
                nval[i] = ns
                klen[i] = p.pages_per_step * P
        pairs = [(self.cand_row, cand), (self.sidx, sidx), (self.nvalid, nval), (self.klens, klen),
                 (self.dlens, dlen)]
        if self.dpool is not None:
            pairs.append((self.dcand_row, dcand))
        for dst, src in pairs:
            _to_device(dst[:rows], src)
        hkv = self.cfg.num_kv_heads
        _to_device(self._krows[:rows * hkv], (klen // P).repeat_interleave(hkv))
        if self.pcache is not None:
            self.pcache.set_rows([(s.kv["cslot"], p.pages_per_step if self._summary_pages(p) else 0,
                                  min(self._want_c(p), self.pcache.C)) for s, p in zip(seqs, plans)], rows)
        if self.chan is not None:  # device to device, one copy per sequence (outside the graph)
            self.chan[:rows].zero_()
            for i, s in enumerate(seqs):
                if s.kv.get("chan") is not None:
                    self.chan[i].copy_(s.kv["chan"])
        self.n = rows
        return rows

    def begin_step(self):
        self.region.step(self.pos, self.active, self.n)

    def _pages(self, layer, q4, q):
        """Row r's pool pages of ``layer`` (all candidates, or its top ``k_r``): ``(out, lse)``."""
        n, pool = self.n, self.eng.pool
        kr, vr = (pool.k_rows(layer), pool.v_rows(layer)) if self.dpool is None or layer in self.sparse else \
            (self.dpool.k[self._dl[layer]], self.dpool.v[self._dl[layer]])
        if layer in self.dense:
            table, lens = self.dcand_row[:n, None], self.dlens[:n]
        else:
            from ..kernels.channel_score import channel_page_scores_batched
            from ..kernels.quest_score import quest_page_scores_batched

            si = self._sl[layer]
            if self.r:
                sc = channel_page_scores_batched(q.to(self.dtype), self.summ.kmin[si], self.summ.kmax[si],
                                                 self.chan[:n, si], self.summ.klab[si], self.sidx[:n],
                                                 self.nvalid[:n], alpha=self.alpha, out=self.scores[:n])
            else:
                sc = quest_page_scores_batched(q.to(self.dtype), self.summ.kmin[si], self.summ.kmax[si],
                                               self.sidx[:n], self.nvalid[:n], out=self.scores[:n])
            # the one-request selection (topk_ids: ties to the lowest ids, ids ascending), k_r per row,
            # with the page caches' reuse bonus on the pages they hold
            hkv, pc = self.cfg.num_kv_heads, self.pcache
            prefer = pc.prefer(si, n, sc.shape[2]) if pc is not None and pc.bonus else None
            sel = topk_ids(sc.reshape(-1, sc.shape[2]), self.K, out=self._sel[:n * hkv], prefer=prefer,
                           prefer_bonus=pc.bonus if prefer is not None else 0.0,
                           k_rows=self._krows[:n * hkv]).view(n, hkv, self.K)
            if pc is not None:  # look up, copy the misses, read the caches
                kr, vr, table = pc.fetch(si, sel, self.cand_row[:n], kr, vr, n)
            else:
                self.table[:n].copy_(self.cand_row[:n].gather(1, sel.view(n, -1).long()).view(n, -1, self.K))
                table = self.table[:n]
            lens = self.klens[:n]
        return paged_decode_attn_with_lse(q4, kr, vr, table, lens, page_size=self.page, softmax_scale=self.scale,
                                          check=False)

    def attend(self, layer, q, k_new, v_new):
        n, q4 = self.n, q[:, None]
        o_t, l_t = self.region.attend(layer, q4, k_new, v_new, n, self.scale)
        if (self.N if layer in self.dense else self.K) == 0:  # no row of the call reads a page here
            return o_t[:, 0]
        o_p, l_p = self._pages(layer, q4, q)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        return o[:, 0]

    def close(self):
        for seq in list(self._admitted.values()):
            self.release(seq)
        if self.pcache is not None:
            self.pcache.close()
        self.tail = self.region = self.summ = self.pcache = None
        self._stage.clear()
        self.cand_row = self.dcand_row = self.sidx = self.table = self.scores = self.dpool = None
        super().close()


class SerialBatchKV(BatchKV):
    """Any per-request store (:class:`~xoffload.engine.kv_store.KVStore`) in a batch: one store per
    sequence (``for_request``), each its own prefill sink; a decode step runs the model once for
    every row (the weights are read once for the batch) and each sequence's attention through its
    own store, one after another. Eager (not captured). Admission reserves ``final_len`` tokens
    (in blocks of ``kv_block_size``) against the offload engine's pool when the store shares one,
    else against ``kv_cache_tokens`` (unlimited when not given)."""

    def __init__(self, model, config, shared, seqs, store_cls=None):
        super().__init__(model, config, shared, seqs)
        self.store_cls = store_cls
        self.block = int(config.kv_block_size)
        eng = shared if hasattr(shared, "allocator") else None
        from .kv_paged import PagedKV

        self._prompt_only = eng is not None and store_cls is not None and issubclass(store_cls, PagedKV)
        if eng is not None:
            self.cap_blocks, self.cap_what = eng.num_free_blocks, "the CPU pool (kv_cache_tokens)"
        elif config.kv_cache_tokens is not None:
            self.cap_blocks, self.cap_what = config.kv_cache_tokens // self.block, "kv_cache_tokens"
        else:
            self.cap_blocks, self.cap_what = None, ""
        self._reserved = 0
        self._seqs: list = []
        self._admitted: list = []
        self.lookahead = frozenset()

    @classmethod
    def open(cls, model, config, shared, seqs, store_cls=None) -> "SerialBatchKV":
        return cls(model, config, shared, seqs, store_cls)

    def _need(self, seq) -> int:
        # a sequence with its own prefill (a session's turn) holds KV its session reserved; a
        # paged offload store keeps the new tokens in a GPU tail, the ring appends them to the pool
        if seq.prefill_hook is not None:
            return 0
        return _blocks(seq.prompt_len if self._prompt_only else seq.final_len, self.block)

    def check(self, seq):
        n = self._need(seq)
        if self.cap_blocks is not None and n > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {n * self.block} tokens of KV ({seq.prompt_len} prompt + "
                             f"{seq.req.max_new - 1} new) but {self.cap_what} holds {self.cap_blocks * self.block} tokens")

    def can_admit(self, seq) -> bool:
        return self.cap_blocks is None or self._reserved + self._need(seq) <= self.cap_blocks

    def admit(self, seq):
        if seq.prefill_hook is None:  # else the hook sets the sequence's decode store
            seq.kv = self.store_cls.for_request(self.m, self.shared, seq.req, self.config)
        self._reserved += self._need(seq)
        self._admitted.append(seq)

    def release(self, seq):
        if seq in self._admitted:
            self._reserved -= self._need(seq)
            self._admitted.remove(seq)
        kv, seq.kv = seq.kv, None
        if kv is not None:
            kv.close()

    def sink(self, seq):
        return seq.kv

    def h2d_bytes_per_step(self, seq):
        return seq.kv.h2d_bytes_per_step if seq.kv is not None else None

    def decode_stats(self, seq) -> dict:
        return seq.kv.decode_stats() if seq.kv is not None else {}

    def set_batch(self, seqs) -> int:
        self._seqs = list(seqs)
        self._set_positions(seqs, len(seqs))
        self.n = len(seqs)
        # layers whose query estimate some sequence's store wants one layer ahead (its prefetch)
        self.lookahead = frozenset().union(*(getattr(s.kv, "lookahead", frozenset()) for s in self._seqs))
        return self.n

    def prefetch(self, layer, q_est):
        """Hand row b of ``q_est`` ``[rows, Hq, D]`` to the stores that prefetch ``layer``."""
        for b, s in enumerate(self._seqs):
            if layer in getattr(s.kv, "lookahead", ()):
                s.kv.prefetch(layer, q_est[b:b + 1])

    def begin_step(self):
        for s in self._seqs:  # the host knows each position (sampling advances it)
            s.kv.begin_step(s.pos)

    def attend(self, layer, q, k_new, v_new):
        outs = [s.kv.attend(layer, q[b:b + 1], k_new[b:b + 1], v_new[b:b + 1]) for b, s in enumerate(self._seqs)]
        return torch.stack([o.reshape(q.shape[1], q.shape[2]) for o in outs])

    def end_step(self):
        for s in self._seqs:
            s.kv.end_step()

    def close(self):
        for seq in list(self._admitted):
            self.release(seq)
        self._seqs = []
        super().close()


def batch_store_class(config):
    """The store table: ``(batched store class, open keyword arguments)`` that serves ``config``
    (the one place a configuration's store is chosen).

    ======================================  =====================================================
    configuration                           store
    ======================================  =====================================================
    ``max_num_seqs == 1``                   :class:`SerialBatchKV` around the mode's one-request
                                            store (its own CUDA graph per sequence)
    ``resident``, dense decode              :class:`ResidentBatchKV` (with ``prefix_caching``:
                                            :class:`~.kv_batch_prefix.ResidentPrefixBatchKV`)
    ``offload`` direct/uva, dense decode    :class:`OffloadBatchKV`
    ``offload`` direct/uva + QuestDecode    :class:`OffloadQuestBatchKV` (not with ``prefetch``,
                                            nor ``bound_scale < 1`` without exact channels)
    anything else                           :class:`SerialBatchKV` around the one-request store
    ======================================  =====================================================
    """
    from ..sparse.quest import QuestDecode
    from .kv_paged import OffloadPagedKV
    from .kv_store import store_class

    store_cls = store_class(config.mode).variant(config)
    pol = config.decode_policy
    if config.max_num_seqs == 1:
        return SerialBatchKV, {"store_cls": store_cls}
    if store_cls is ResidentKV:
        if config.prefix_caching:
            from .kv_batch_prefix import ResidentPrefixBatchKV

            return ResidentPrefixBatchKV, {}
        return ResidentBatchKV, {}
    if store_cls is OffloadPagedKV and pol is None:
        return OffloadBatchKV, {}
    if store_cls is OffloadPagedKV and isinstance(pol, QuestDecode) and not pol.prefetch \
            and (pol.exact_channels or pol.bound_scale == 1.0):
        return OffloadQuestBatchKV, {}
    return SerialBatchKV, {"store_cls": store_cls}
