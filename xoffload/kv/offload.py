"""``offload``, dense decode (any ``max_num_seqs``): :class:`OffloadBatchKV`, prompts read in
place from the pinned pool, generated tokens in a GPU tail (see :mod:`.base`)."""
from __future__ import annotations

import torch

from ..kernels import flash_attn_with_lse, merge_attention_states, paged_decode_attn_with_lse
from .chunk import ChunkedPrefill
from .staging import PrefillStaging
from .base import (TAIL_BLOCK, BatchKV, RowPool, _CachedPrompts, _Region, _StagedSink, _blocks, _join,
                       _to_device, _top_sum)


class OffloadBatchKV(ChunkedPrefill, _CachedPrompts, BatchKV):
    """``offload`` (direct decode, no decode policy): every prompt's KV in the offload runtime's
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


