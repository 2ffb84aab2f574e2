"""The prefill sink of a group of sequences prefilled together (``LlamaModel.prefill_batch``) into
the GPU pool of a batched resident store (:class:`~xoffload.engine.kv_batch.ResidentBatchKV` and
its prefix-caching subclass :class:`~xoffload.engine.kv_batch_prefix.ResidentPrefixBatchKV`).

The model fills one ``[T, Hkv, D]`` K/V pair per layer for every token of the group (the
store's staging buffers, concatenated in the group's order); :meth:`BatchPrefillSink.done`
scatters them into each sequence's pool rows with one ``index_copy_`` per tensor and layer (the
rows of every member concatenated, copied to the device once when the sink is made). After the
last layer ``on_done`` runs (the prefix store registers every member's prompt there).

History (members with a reused prefix, ``seq.kv["start"] > 0``): one split-KV paged decode launch
for the whole group (:func:`~xoffload.kernels.paged_decode_attn_with_lse`, non-causal): the
queries padded to ``[B, Sq_max, Hq, D]`` (no copy when every member has ``Sq_max`` tokens), a
``[B, 1, nb_max]`` table of each member's prefix blocks in the pool read in place as a block
store, and each member's prefix length (0 for a member without history: its rows come out with
lse -inf and merge to its plain causal result). The split-KV kernel is used whatever the chunk
length (the one-sequence sink switches to the prefill kernel past ``HISTORY_SPLIT_ROWS`` rows;
the runner groups only short prefills). Every tensor the sink needs is built on the host and
copied without a host wait (pinned, asynchronous) when it is made.
"""
from __future__ import annotations

import torch

from ..kernels import paged_decode_attn_with_lse
from .kv_batch import _blocks, _to_device

__all__ = ["BatchPrefillSink", "GROUP_PREFILL_MAX_TOKENS"]

#: most tokens a sequence may prefill to join a prefill group (the runner's rule,
#: :mod:`xoffload.engine.runner`). Short prefills are host-bound: on the H200 a 64-token question
#: over a reused 32K document (8B) is ~10 ms of GPU work but took 37-96 ms alone (~600 launches
#: and a host sync). An estimate, not measured: at 512 tokens the GEMMs (~12 ms at ~700 TFLOP/s)
#: outlast the launches (~6 ms), so grouping longer ones gains little. The resident stores size a
#: prefill's memory headroom for a group of ``max_num_seqs`` such prompts (at most
#: ``max_num_batched_tokens``).
GROUP_PREFILL_MAX_TOKENS = 512


def _rows(table, a: int, b: int, blk: int) -> torch.Tensor:
    """int64 ``[b - a]`` (host): the pool row of each token ``a .. b-1`` of a sequence with block table ``table``."""
    t = torch.arange(a, b, dtype=torch.int64)
    return torch.tensor(table, dtype=torch.int64)[t // blk] * blk + t % blk


class BatchPrefillSink:
    """The sink of ``LlamaModel.prefill_batch`` for ``seqs`` of a resident batched ``store``.

    Args:
        store: a :class:`~xoffload.engine.kv_batch.ResidentBatchKV` (its ``pool``, ``block``,
            ``_staging``, ``cfg``, ``scale``, ``device``).
        seqs: the group's sequences, each admitted with its block table (``seq.kv["table"]``)
            and, when it reuses a prefix, ``seq.kv["start"]`` (its :meth:`prefill_start`; 0 or
            absent: none).
        on_done: None or a callable run once the last layer's K/V are stored.

    Attributes:
        starts, lens: per member, its first prefilled position and the tokens it prefills (``T =
            sum(lens)``), in the group's order (``prefill_batch``'s arguments).
    Raises:
        ValueError: an empty group, or a member with nothing to prefill.
    """

    def __init__(self, store, seqs, on_done=None):
        if not seqs:
            raise ValueError("a batched prefill needs at least one sequence")
        self.store, self.on_done = store, on_done
        blk = store.block
        self.starts = [int(s.kv.get("start", 0)) for s in seqs]
        self.lens = [s.prompt_len - st for s, st in zip(seqs, self.starts)]
        if min(self.lens) < 1:
            raise ValueError(f"every member of a batched prefill needs a token to prefill, got lens {self.lens}")
        self.T = sum(self.lens)
        self._L = store.cfg.num_layers
        rows = torch.cat([_rows(s.kv["table"], st, s.prompt_len, blk) for s, st in zip(seqs, self.starts)])
        self._rows = torch.empty(self.T, dtype=torch.int64, device=store.device)
        _to_device(self._rows, rows)
        if any(self.starts):
            self._history_setup(seqs, blk)
            self.history = self._history

    def buffers(self, layer: int, t: int):
        """K/V ``[t, Hkv, D]`` (``t`` = the group's tokens) to fill: the store's staging pair."""
        return self.store._staging(layer, t)

    def done(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``layer``'s K/V ``[T, Hkv, D]`` in every member's pool rows (one
        ``index_copy_`` each); after the last layer, ``on_done()``."""
        pool = self.store.pool
        pool.k[layer].index_copy_(0, self._rows, k)
        pool.v[layer].index_copy_(0, self._rows, v)
        if layer == self._L - 1 and self.on_done is not None:
            self.on_done()

    # ------------------------------------------------------------------ history
    def _history_setup(self, seqs, blk: int) -> None:
        B, sq = len(seqs), max(self.lens)
        nb = max(1, max(_blocks(st, blk) for st in self.starts))
        meta = torch.zeros(B * nb + B, dtype=torch.int32)  # [B, nb] block ids, then [B] prefix lengths
        for b, (s, st) in enumerate(zip(seqs, self.starts)):
            n = _blocks(st, blk)
            if n:
                meta[b * nb:b * nb + n] = torch.tensor(s.kv["table"][:n], dtype=torch.int32)
        meta[B * nb:] = torch.tensor(self.starts, dtype=torch.int32)
        dev = torch.empty_like(meta, device=self.store.device)
        _to_device(dev, meta)
        self._table, self._used = dev[:B * nb].view(B, 1, nb), dev[B * nb:]
        self._B, self._sq = B, sq
        self._pad = None
        if any(n != sq for n in self.lens):  # token t of member b -> row b * sq + t of the padded queries
            pad = torch.cat([torch.arange(b * sq, b * sq + n, dtype=torch.int64) for b, n in enumerate(self.lens)])
            self._pad = torch.empty(self.T, dtype=torch.int64, device=self.store.device)
            _to_device(self._pad, pad)

    def _history(self, layer: int, q: torch.Tensor):
        """The group's queries ``q [T, Hq, D]`` over each member's reused prefix in the pool (one
        paged launch): ``(o [T, Hq, D], lse fp32 [Hq, T])``; a member without one: o 0, lse -inf."""
        st, cfg = self.store, self.store.cfg
        B, sq, T = self._B, self._sq, self.T
        hq, hkv, d = q.shape[1], cfg.num_kv_heads, cfg.head_dim
        if self._pad is None:
            qp = q.view(B, sq, hq, d)
        else:  # padding rows are zeros: they attend like any row and are never read back
            qp = q.new_zeros(B * sq, hq, d).index_copy_(0, self._pad, q).view(B, sq, hq, d)
        k = st.pool.k[layer].view(-1, st.block, hkv, d)
        v = st.pool.v[layer].view(-1, st.block, hkv, d)
        o, lse = paged_decode_attn_with_lse(qp, k, v, self._table, self._used, softmax_scale=st.scale, check=False)
        o = o.reshape(B * sq, hq, d)
        lse = lse.transpose(0, 1).reshape(hq, B * sq)
        if self._pad is not None:
            o, lse = o.index_select(0, self._pad), lse.index_select(1, self._pad)
        return o, lse
