"""Prefix caching for batched ``resident`` generation: the prompts of one ``LLM.generate`` call share
the KV blocks of their common leading tokens in the GPU pool of :class:`ResidentBatchKV`.

A sequence's KV lives in blocks of the store's GPU :class:`~xoffload.kv.base.RowPool`. Right
before its prefill (:meth:`ResidentPrefixBatchKV.prefill_start`) its prompt is matched against a
:class:`~xoffload.runtime.PrefixCache` over that pool (chained block hashes, as vLLM's automatic
prefix caching): the matched blocks join its block table with one more reference each, a shared
partly filled last block is copied first (copy-on-write), and only the rest of the prompt is
prefilled, its queries attending to the reused prefix in place (the prefill kernel reading the
pool's blocks through a block table: no copy) merged by LSE with their own causal attention. When its prefill ends, its prompt's blocks
are registered, so the prompts prefilled after it in the same call find them. Cached blocks that
no running sequence holds are evicted (LRU, leaf first) when the pool runs short.

Admission reserves a sequence's whole KV (prompt + new tokens) as without caching: a bound on the
blocks its table will hold (shared ones included; the copy-on-write block takes the shared one's
place, which is not held meanwhile), so the running sequences never hold more blocks than the
pool has, and an allocation can always evict what only the cache holds.
Decode writes the new tokens after the prompt: into the sequence's own blocks, or into rows past
the registered tokens of its prompt's partly filled last block, which no other holder reads (a
sequence sharing that block copies it before writing, and reads only the registered rows).
A sequence that finishes (``stop`` / ``length``) registers its answer too, so a conversation's
next turn in the same epoch prefills only its new tokens.

The cache lives as long as the store's pool (one store epoch: while the engine is busy, e.g. one
``generate`` call, at any ``max_num_seqs``); reuse across epochs is the offload mode's (its pool
persists in the LLM).
"""
from __future__ import annotations

import torch

from ..kernels import flash_attn_with_lse, paged_decode_attn_with_lse
from ..runtime.prefix_cache import PrefixCache
from .base import _blocks, _StagedSink, _to_device
from .resident import ResidentBatchKV

__all__ = ["ResidentPrefixBatchKV", "HISTORY_SPLIT_ROWS"]

#: chunks of at most this many query rows attend to a reused prefix through the split-KV paged
#: decode kernel (the prefill kernel has one program per 128 rows and head: 32 programs for a
#: 64-token question on 32 heads, each walking the whole prefix)
HISTORY_SPLIT_ROWS = 128


class _PoolBlocks:
    """The block-pool interface :class:`~xoffload.runtime.PrefixCache` needs, over a RowPool:
    ``block_size``, ``allocator``, ``_closed``, and ``kv_in_pool``. The store registers a prompt
    (``PrefixCache.insert`` with the prompt's ids) only once its prefill has written every layer,
    so the tokens asked for are written, up to what the sequence's blocks hold."""

    def __init__(self, pool):
        self.block_size = pool.block
        self.allocator = pool.alloc
        self._closed = False

    def kv_in_pool(self, seq: int, n: int, what: str = "kv_in_pool") -> int:
        return min(int(n), len(self.allocator.table(seq)) * self.block_size)


class ResidentPrefixBatchKV(ResidentBatchKV):
    """:class:`~xoffload.kv.resident.ResidentBatchKV` with prefix caching (module docstring);
    chosen by :func:`~xoffload.kv.table.batch_store_class` for ``mode="resident"``,
    ``prefix_caching=True``, dense decode. A request that reused a prefix carries ``prefix_reused_tokens`` in its timings
    (the key is absent when it reused none, as in offload mode: ``timings.get(..., 0)``);
    ``cow_copies`` counts the copied blocks."""

    def __init__(self, model, config, shared, seqs):
        super().__init__(model, config, shared, seqs)
        self._blocks = _PoolBlocks(self.pool)
        self.cache = PrefixCache(self._blocks)
        self._reserved = 0
        self.cow_copies = 0

    # admission: the whole KV is reserved as a count; blocks are taken at prefill_start
    def can_admit(self, seq) -> bool:
        return self._reserved + _blocks(seq.final_len, self.block) <= self.pool.num_blocks

    def admit(self, seq):
        self._reserved += _blocks(seq.final_len, self.block)
        seq.kv = {"table": None, "start": 0}

    def prefill_tokens(self, seq) -> int:
        return seq.prompt_len - self.cache.peek(seq.req.ids[:-1])

    def prefill_start(self, seq) -> int:
        """Match the prompt (less its last token, recomputed for its logits) against the cache,
        start the sequence's block table on the matched blocks (copying a shared partly filled
        last one), allocate the rest of its KV; returns the reused token count."""
        sid, alloc, B = seq.key, self.pool.alloc, self.block
        m = self.cache.match(seq.req.ids[:-1])
        partial = m.n_tokens % B != 0  # the last matched block is partly used: this sequence writes into it
        alloc.add(sid, m.blocks[:-1] if partial else m.blocks)
        try:
            if partial:  # copy-on-write: a fresh block, filled from the shared one
                # the shared block is not referenced here, so the allocation may evict it (it is
                # then only the cache's); its rows stay intact until a block is written, and the
                # copy below is the next write, stream-ordered (if the allocator hands it back,
                # nothing needs copying)
                old = m.blocks[-1]
                new = alloc.allocate(sid, 1)[0]
                if new != old:
                    self._copy_block(old, new)
            alloc.allocate(sid, _blocks(seq.final_len, B) - len(alloc.table(sid)))
        except Exception:
            alloc.free(sid)
            raise
        seq.kv = {"table": alloc.table(sid), "start": m.n_tokens}
        return m.n_tokens

    def _copy_block(self, old: int, new: int) -> None:
        """Copy-on-write: block ``old``'s rows to ``new`` in every layer (K and V), stream-ordered
        before any write into ``new``."""
        B = self.block
        for t in (self.pool.k, self.pool.v):
            t[:, new * B:(new + 1) * B].copy_(t[:, old * B:(old + 1) * B])
        self.cow_copies += 1

    def release(self, seq):
        if seq.kv is not None:
            self._reserved -= _blocks(seq.final_len, self.block)
            self._keep_answer(seq)
        super().release(seq)

    def _keep_answer(self, seq) -> None:
        """A finished answer (``stop`` / ``length``) is written in the sequence's blocks after its
        prompt: register prompt + answer (the tokens fed to a decode step whose ids the host has
        read) so that the conversation's next turn in this store epoch prefills only what follows."""
        k = min(seq.n_out - 1, len(seq.tokens))
        if self.cache is None or seq.kv.get("table") is None or k <= 0 \
                or getattr(seq, "finish_reason", None) not in ("stop", "length"):
            return
        self.cache.insert(seq.key, list(seq.req.ids) + list(seq.tokens[:k]))

    def sink(self, seq):
        table, T, start = seq.kv["table"], seq.prompt_len, seq.kv["start"]
        rows = torch.empty(T - start, dtype=torch.int64, device=self.device)
        _to_device(rows, self.pool.rows(table, T, start))
        L = self.cfg.num_layers

        def done(layer, k, v):
            self.pool.k[layer].index_copy_(0, rows, k)
            self.pool.v[layer].index_copy_(0, rows, v)
            if layer == L - 1:  # every layer written: later prompts of the call may share it
                self.cache.insert(seq.key, seq.req.ids)

        history = None
        if start:
            nb, B = _blocks(start, self.block), self.block
            bt = torch.empty(1, nb, dtype=torch.int32, device=self.device)
            _to_device(bt[0], torch.tensor(table[:nb], dtype=torch.int32))
            used = torch.full((1,), start, dtype=torch.int32, device=self.device)
            hkv, d = self.cfg.num_kv_heads, self.cfg.head_dim

            def history(layer, q):
                """The chunk's queries ``q [T', Hq, D]`` over the reused prefix, read in the pool: a
                short chunk (a question after a shared document) through the split-KV paged decode
                kernel (its programs split the prefix's keys, so a few query rows still fill the
                GPU), a long one through the prefill kernel."""
                k = self.pool.k[layer].view(-1, B, hkv, d)
                v = self.pool.v[layer].view(-1, B, hkv, d)
                if q.shape[0] <= HISTORY_SPLIT_ROWS:
                    return paged_decode_attn_with_lse(q[None], k, v, bt[:, None], used, softmax_scale=self.scale,
                                                      check=False)
                return flash_attn_with_lse(q[None], k, v, causal=False, softmax_scale=self.scale, block_table=bt,
                                           seqused_k=used, check=False)

        return _StagedSink(self._staging, done, history)

    def batch_sink(self, seqs):
        """The group's sink (:meth:`ResidentBatchKV.batch_sink`; each member's history read in the
        pool by one launch per layer for the group), registering every member's prompt in the
        cache, in the group's order, once the last layer is stored (members of one group do not
        share blocks with each other: the runner flushes a group before a prompt that would reuse
        a block of it)."""
        from .batch_prefill import BatchPrefillSink

        def register():
            for s in seqs:
                self.cache.insert(s.key, s.req.ids)

        return BatchPrefillSink(self, seqs, on_done=register)

    def close(self):
        if self.cache is not None:
            self._blocks._closed = True
        self.cache = None
        super().close()
