"""Every configuration no batched store serves (the ring, resident with a decode policy, Quest
decode the batched Quest store does not serve): :class:`SerialBatchKV`, one one-request store
(:mod:`.kv_store`, :mod:`.kv_paged`) per sequence behind the step loop's store interface (see
:mod:`xoffload.kv`)."""
from __future__ import annotations

import torch

from ..kv.base import BatchKV, _blocks


class SerialBatchKV(BatchKV):
    """Any per-request store (:class:`~xoffload.engine.kv_store.KVStore`) in a batch: one store per
    sequence (``for_request``), each its own prefill sink; a decode step runs the model once for
    every row (the weights are read once for the batch) and each sequence's attention through its
    own store, one after another. Eager (not captured). Admission reserves ``final_len`` tokens
    (in blocks of ``kv_block_size``) against the offload runtime's pool when the store shares one,
    else against ``kv_cache_tokens`` (unlimited when not given). At ``max_num_seqs=1`` the runner
    replays each sequence's own CUDA graph when its store is capturable (``per_request_stores``)."""

    #: one one-request store per sequence (the runner's per-sequence graph path serves these)
    per_request_stores = True

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
        # a paged offload store keeps the new tokens in a GPU tail, the ring appends them to the pool
        return _blocks(seq.prompt_len if self._prompt_only else seq.final_len, self.block)

    def check(self, seq):
        n = self._need(seq)
        if self.cap_blocks is not None and n > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {n * self.block} tokens of KV ({seq.prompt_len} prompt + "
                             f"{seq.req.max_new - 1} new) but {self.cap_what} holds {self.cap_blocks * self.block} tokens")

    def can_admit(self, seq) -> bool:
        return self.cap_blocks is None or self._reserved + self._need(seq) <= self.cap_blocks

    def admit(self, seq):
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


