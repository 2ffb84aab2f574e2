"""The KV stores of the step loop: the KV of every running sequence of a store epoch
(:class:`~xoffload.engine.llm_engine.LLMEngine`), and one decode step's attention for all of them.

A store is opened per store epoch (:meth:`BatchKV.open`, its pools sized from the requests
waiting and the engine's headroom) and serves the :class:`~xoffload.engine.scheduler.Scheduler`:

- admission: ``check(seq)`` (ValueError naming the sizes when the sequence alone can never fit),
  ``can_admit(seq)``, ``admit(seq)`` (reserve every token of KV it may hold: prompt + new),
  ``release(seq)``;
- prefill: ``sink(seq)``, the model's prefill sink for that sequence (``buffers`` / ``done``);
  where ``batch_prefill`` (the resident stores), also ``batch_sink(seqs)``, the sink of one
  ``LlamaModel.prefill_batch`` over a group (:mod:`~xoffload.kv.batch_prefill`);
- decode: ``set_batch(seqs) -> rows`` (the running sequences in row order, padded to a batch-size
  bucket: ``rows >= len(seqs)``; host work, only when the batch changes), then per step
  ``begin_step()``, ``attend(layer, q [rows, Hq, D], k_new [rows, Hkv, D], v_new) -> [rows, Hq,
  D]``, ``end_step()``, ``advance()``; ``pos`` is the int64 ``[rows]`` device position of each row
  (the model's RoPE input). Padding rows attend to nothing and write into a scratch block;
- ``capturable``: every step of a batch has the same shapes and reads its positions on the
  device, so one step per bucket may be captured in a CUDA graph (:class:`~.cuda_graph.BatchGraphs`);
- ``h2d_bytes_per_step(seq)``, ``close()``.

Stores (one module each):

- :class:`~.resident.ResidentBatchKV` (``resident``): one paged KV pool on the model's device for all the
  sequences (``[L, blocks * kv_block_size, Hkv, D]`` rows, block tables per sequence); decode is
  one :func:`~xoffload.kernels.paged_decode_attn_with_lse` launch per layer for the whole batch,
  each row with its own length (the split-KV kernel of :mod:`xoffload.kernels.decode` with a page
  table). A slot-per-sequence cache for :func:`~xoffload.kernels.decode_attn_with_lse` would hold
  ``max_model_len`` tokens per slot and need the running sequences packed into the first slots
  for a graph per bucket; the pool holds what each sequence may reach and nothing else.
- :class:`~.offload.OffloadBatchKV` (``offload``, direct or uva decode, no decode policy): prompts in
  the offload engine's pinned CPU pool, read by one paged launch per layer for the batch, from GPU
  staging buffers the layer's blocks were copied into one layer ahead (direct, when they fit) or
  in place over PCIe (a page table of pool blocks per row); generated tokens in a paged GPU tail
  pool (a second launch); the two merged by LSE.
- :class:`~.quest.OffloadQuestBatchKV` (``offload`` + :class:`~xoffload.sparse.QuestDecode`, direct
  decode): prompts in the pinned pool, every admitted sequence's page
  summaries in one shared GPU summary pool, sink + recent + generated tokens in the paged GPU tail
  pool, the dense layers on the GPU when they fit (else read in place), a GPU page cache per
  sequence (:mod:`~xoffload.kv.page_cache`) when it fits; per layer one batched score
  launch, one topk, one cache lookup + fill and one paged launch for the whole batch. Also
  ``resident`` + QuestDecode, over a runtime whose pool is on the model's device
  (:mod:`~xoffload.kv.device_runtime`: no page cache, no dense pool, no host bytes).

The stores serve every ``max_num_seqs``: a single request is a batch of one (buckets
``(1,)``, one CUDA graph per bucket).

The two offload stores (the Quest one in either placement) cache prefixes (``prefix_caching``:
``open(..., prefix_cache=)``, ``takes_prefix_cache``). :func:`~.table.batch_store_class` is the
table that picks the store; :mod:`.protocols` writes the contracts down.
"""
from __future__ import annotations

import torch

from ..kernels import paged_decode_attn_with_lse
from ..runtime.allocator import BlockAllocator

__all__ = ["BatchKV", "RowPool", "batch_buckets", "TAIL_BLOCK", "SUMMARY_BLOCK"]

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
        external: ``{layer: (k, v)}``, row stores ``[(num_blocks + 1) * block, Hkv, D]`` the caller
            supplies for those layers (views into another store's rows, so that one attention call
            reads both: the Quest page cache and its tail); the pool then allocates only the other
            layers, and ``k`` / ``v`` are per-layer lists.
    Raises:
        torch.OutOfMemoryError when the device cannot hold it; ValueError for an external store
        of another shape.
    """

    def __init__(self, cfg, num_blocks: int, block: int, dtype, device, external: dict | None = None):
        self.block, self.num_blocks = int(block), int(num_blocks)
        self.alloc = BlockAllocator(self.num_blocks, self.block)
        shape = ((self.num_blocks + 1) * self.block, cfg.num_kv_heads, cfg.head_dim)
        self.scratch = self.num_blocks * self.block  # first row of the scratch block
        self._bytes = 2 * cfg.num_layers * shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
        if not external:
            self.k = torch.zeros((cfg.num_layers,) + shape, dtype=dtype, device=device)
            self.v = torch.zeros((cfg.num_layers,) + shape, dtype=dtype, device=device)
            return
        for layer, (k, v) in external.items():
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"layer {layer}'s external rows must be {shape}, got {tuple(k.shape)}")
        own = [l for l in range(cfg.num_layers) if l not in external]
        kv = {l: torch.zeros((2,) + shape, dtype=dtype, device=device) for l in own}
        self.k = [external[l][0] if l in external else kv[l][0] for l in range(cfg.num_layers)]
        self.v = [external[l][1] if l in external else kv[l][1] for l in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's rows, K and V of every layer (external layers' included)."""
        return self._bytes

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

    def set_rows(self, tables: list, bases: list, rows: int) -> torch.Tensor:
        """Rows ``0 .. len(tables)-1`` get these block tables and bases; rows up to ``rows`` pad.
        Returns the host page table ``[rows, pages]`` (int32, first row of each block)."""
        tab = torch.full((rows, self.pages), self.pool.scratch, dtype=torch.int32)
        for i, t in enumerate(tables):
            tab[i] = self.pool.page_row(t, self.pages)
        base = torch.zeros(rows, dtype=torch.int64)
        base[:len(bases)] = torch.tensor(bases, dtype=torch.int64)
        _to_device(self.table[:rows, 0], tab)
        _to_device(self.base[:rows], base)
        return tab

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

    def write(self, layer: int, k_new, v_new, n: int):
        """Write the rows' new K/V ``[n, Hkv, D]`` into the region; returns the layer's row stores."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        k.index_copy_(0, self.wrow[:n], k_new)
        v.index_copy_(0, self.wrow[:n], v_new)
        return k, v

    def attend(self, layer: int, q4, k_new, v_new, n: int, scale: float):
        """Write the rows' new K/V and attend over the region: ``(out [n, 1, Hq, D], lse)``."""
        k, v = self.write(layer, k_new, v_new, n)
        return paged_decode_attn_with_lse(q4, k, v, self.table[:n], self.lens[:n], page_size=self.pool.block,
                                          softmax_scale=scale, check=False)


class BatchKV:
    """Base of the batched stores (the interface is in the module docstring).

    Args:
        model: the :class:`~xoffload.models.llama.LlamaModel`.
        config: the LLM's bound :class:`~xoffload.engine.config.EngineConfig`.
        shared: what the LLM's store class shares between requests (the offload runtime, or None).
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

