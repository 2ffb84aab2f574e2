"""The prefill sink of a group of sequences prefilled together (``LlamaModel.prefill_batch``) into
the GPU pool of a batched resident store (:class:`~xoffload.kv.resident.ResidentBatchKV` and
its prefix-caching subclass :class:`~xoffload.kv.resident_prefix.ResidentPrefixBatchKV`).

The model fills one ``[T, Hkv, D]`` K/V pair per layer for every token of the group (the
store's staging buffers, concatenated in the group's order); :meth:`BatchPrefillSink.done`
scatters them into each sequence's pool rows with one ``index_copy_`` per tensor and layer (the
rows of every member concatenated, copied to the device once when the sink is made). After the
last layer ``on_done`` runs (the prefix store registers every member's prompt there).

History (members with a reused prefix, ``seq.kv["start"] > 0``): the split-KV paged decode kernel
(:func:`~xoffload.kernels.paged_decode_attn_with_lse`, non-causal), one launch for all the
members whose query lengths fall in one power-of-two class -- one launch per layer in the common
case (questions of similar lengths; more classes only when lengths differ by more than 2x, so
padding at most doubles a member's rows): the queries padded to ``[n, Sq, Hq, D]`` (no copy when
every member has a history and ``Sq`` tokens), a ``[n, 1, nb]`` table of each member's prefix
blocks in the pool read in place as a block store, and each member's prefix length. A member
without history is in no launch: its rows come out with lse -inf and merge to its plain causal
result. The split-KV kernel is used whatever the chunk length (the one-sequence sink switches to
the prefill kernel past ``HISTORY_SPLIT_ROWS`` rows; the runner groups only short prefills).
Every tensor the sink needs is built on the host and copied without a host wait (pinned,
asynchronous) when it is made.
"""
from __future__ import annotations

import torch

from ..kernels import paged_decode_attn_with_lse
from .base import _blocks, _to_device

__all__ = ["BatchPrefillSink", "GROUP_PREFILL_MAX_TOKENS"]

#: most tokens a sequence may prefill to join a prefill group (the runner's rule,
#: :mod:`xoffload.engine.runner`). Short prefills are host-bound: on the H200 a 64-token question
#: over a reused 32K document (8B) is ~10 ms of GPU work but took 37-96 ms alone (~600 launches
#: and a host sync). An estimate, not measured: at 512 tokens the GEMMs (~12 ms at ~700 TFLOP/s)
#: outlast the launches (~6 ms), so grouping longer ones gains little. The resident stores size a
#: prefill's memory headroom for a group of ``max_num_seqs`` such prompts (at most
#: ``max_num_batched_tokens``).
GROUP_PREFILL_MAX_TOKENS = 512


class BatchPrefillSink:
    """The sink of ``LlamaModel.prefill_batch`` for ``seqs`` of a resident batched ``store``.

    Args:
        store: a :class:`~xoffload.kv.resident.ResidentBatchKV` (its ``pool``, ``block``,
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
        rows = torch.cat([store.pool.rows(s.kv["table"], s.prompt_len, st) for s, st in zip(seqs, self.starts)])
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
        """Host plan of the history launches, copied to the device once: the members with a
        history in classes of query length (``ceil(log2(len))``, so padding at most doubles a
        member's rows); per class its padded length ``sq`` (the class's longest), the source row
        in ``q`` of each padded query row (padding rows repeat the member's first query: finite,
        never read back), the output row of each (padding rows: the trash row ``T``), the
        ``[n, 1, nb]`` table of the members' prefix blocks and their prefix lengths."""
        T, lens, starts = self.T, self.lens, self.starts
        offs = [sum(lens[:b]) for b in range(len(lens))]
        classes: dict = {}
        for b, st in enumerate(starts):
            if st:
                classes.setdefault((lens[b] - 1).bit_length(), []).append(b)
        self._covered = all(starts)  # every row gets a history result (else rows start at lse -inf)
        plan, parts = [], []
        for members in classes.values():
            n, sq = len(members), max(lens[b] for b in members)
            nb = max(_blocks(starts[b], blk) for b in members)
            src, dst = [], []
            for b in members:
                rows = list(range(offs[b], offs[b] + lens[b]))
                src += rows + [offs[b]] * (sq - lens[b])
                dst += rows + [T] * (sq - lens[b])
            table = torch.zeros(n, nb, dtype=torch.int64)
            for i, b in enumerate(members):
                k = _blocks(starts[b], blk)
                table[i, :k] = torch.tensor(seqs[b].kv["table"][:k], dtype=torch.int64)
            plan.append((n, sq, nb))
            parts += [torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), table.reshape(-1),
                      torch.tensor([starts[b] for b in members], dtype=torch.int64)]
        host = torch.cat(parts)
        dev = torch.empty_like(host, device=self.store.device)
        _to_device(dev, host)
        self._launches, o = [], 0
        for n, sq, nb in plan:
            src, dst = dev[o:o + n * sq], dev[o + n * sq:o + 2 * n * sq]
            o += 2 * n * sq
            table = dev[o:o + n * nb].to(torch.int32).view(n, 1, nb)
            used = dev[o + n * nb:o + n * nb + n].to(torch.int32)
            o += n * nb + n
            self._launches.append((n, sq, src, dst, table, used))
        # one class holding every member, none padded: q is the padded batch itself (no copies)
        self._direct = len(plan) == 1 and plan[0][0] == len(lens) and all(n == plan[0][1] for n in lens)

    def _history(self, layer: int, q: torch.Tensor):
        """The group's queries ``q [T, Hq, D]`` over each member's reused prefix in the pool, one
        split-KV paged launch per length class (one in the common case): ``(o [T, Hq, D], lse fp32
        [Hq, T])`` (possibly strided views); a member without history: lse -inf (o undefined)."""
        st, cfg, T = self.store, self.store.cfg, self.T
        hq, hkv, d = q.shape[1], cfg.num_kv_heads, cfg.head_dim
        k = st.pool.k[layer].view(-1, st.block, hkv, d)
        v = st.pool.v[layer].view(-1, st.block, hkv, d)

        def attend(qp, n, sq, table, used):
            o, lse = paged_decode_attn_with_lse(qp.view(n, sq, hq, d), k, v, table, used, softmax_scale=st.scale,
                                                check=False)
            return o.reshape(n * sq, hq, d), lse.transpose(0, 1).reshape(hq, n * sq)

        if self._direct:
            n, sq, _src, _dst, table, used = self._launches[0]
            return attend(q, n, sq, table, used)
        o_all = q.new_empty(T + 1, hq, d)  # row T: the padding rows' trash
        if self._covered:
            lse_all = torch.empty(hq, T + 1, dtype=torch.float32, device=q.device)
        else:  # the rows of members without history
            lse_all = torch.full((hq, T + 1), float("-inf"), dtype=torch.float32, device=q.device)
        for n, sq, src, dst, table, used in self._launches:
            o, lse = attend(q.index_select(0, src), n, sq, table, used)
            o_all.index_copy_(0, dst, o)
            lse_all.index_copy_(1, dst, lse)
        return o_all[:T], lse_all[:, :T]
