"""``resident``, dense decode (any ``max_num_seqs``): :class:`ResidentBatchKV`, one paged KV pool on
the model's device for every running sequence (see :mod:`.base` for the store interface)."""
from __future__ import annotations

import torch

from .base import BatchKV, RowPool, _Region, _StagedSink, _blocks, _pool_memory_limit, _to_device, _top_sum


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
        from .batch_prefill import GROUP_PREFILL_MAX_TOKENS  # (a module that imports this one)

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
        """:class:`~xoffload.kv.batch_prefill.BatchPrefillSink`: the group's K/V through the
        staging pair into each member's rows (one ``index_copy_`` per layer for all)."""
        from .batch_prefill import BatchPrefillSink

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


