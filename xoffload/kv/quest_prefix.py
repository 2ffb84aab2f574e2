"""The batched Quest store's prefill sink (:class:`QuestPrefill`, a mixin of
:class:`~xoffload.kv.quest.OffloadQuestBatchKV`) and its prefix reuse
(``prefix_caching``): the prefill of a sequence whose first ``r`` prompt tokens' KV the pinned
pool already holds (blocks of an earlier prompt, found by the
:class:`~xoffload.runtime.PrefixCache`).

The model prefills only the ``T - r`` remaining tokens, but what the Quest store builds from a
prompt at prefill (the page summaries, min/max of K per page and the exact channels, chosen per
sequence from the prompt's whole pages; the resident sink and recent tokens in the GPU tail; the
dense layers' rows in the GPU dense pool) needs every token of the layer. :class:`WholeLayer` hands
the model the tail ``[r, T)`` of a ``[T]`` staging pair per layer and fills its head ``[0, r)``
from the pool (one :meth:`~xoffload.runtime.OffloadRuntime.fetch_blocks` per layer, a layer ahead:
:class:`~.staging.PrefixReader`), so the store's
``done`` sees the whole layer's K/V, as a fresh prefill's, without a concatenation; the same rows
serve the chunk's attention to the reused prefix (:meth:`WholeLayer.history`: every reused token,
dense, as :class:`~xoffload.kv.offload.OffloadBatchKV`'s sink). Only the new rows are copied
to the pool (the reused blocks are already there; a shared, partly filled last block is copied
before the write by the engine).

Prefill-time only: one fetch and one history launch per layer; nothing here runs in a decode step.
"""
from __future__ import annotations

import torch

from ..kernels import flash_attn_with_lse
from ..sparse.page_summaries import choose_channels
from .base import SUMMARY_BLOCK, _StagedSink, _to_device
from .staging import PrefixReader

__all__ = ["WholeLayer", "QuestPrefill"]


class WholeLayer:
    """Staging of one sequence's prefill over a reused prefix of ``start`` tokens (``start >= 0``;
    0: a plain prefill, the model's rows are the whole layer).

    Args:
        eng: the :class:`~xoffload.runtime.OffloadRuntime`; stage: the store's
            :class:`~xoffload.kv.staging.PrefillStaging`; sid: the sequence's pool id;
            start: reused tokens; T: the prompt's tokens; scale: the softmax scale.
    """

    def __init__(self, eng, stage, sid: int, start: int, T: int, scale: float):
        self.eng, self.stage, self.sid = eng, stage, sid
        self.start, self.T, self.scale = int(start), int(T), scale
        self._whole = None
        self.reader = PrefixReader(eng, sid, self.start, eng.num_layers) if self.start else None

    def buffers(self, layer: int, t: int):
        """The model's K/V rows of ``layer`` (``[t, Hkv, D]``, ``t = T - start``): the tail of a
        ``[T]`` staging pair whose head holds the reused prefix, read from the pool."""
        r = self.start
        if r + t != self.T:
            raise ValueError(f"a prompt of {self.T} tokens with {r} reused prefills {self.T - r} tokens, got {t}")
        k, v = self.stage.buffers(self.eng, layer, self.T)
        if r:  # (read one layer ahead)
            kp, vp = self.reader.get(layer)
            k[:r].copy_(kp)
            v[:r].copy_(vp)
            del kp, vp
        self._whole = (layer, k, v)
        return k[r:], v[r:]

    def whole(self, layer: int):
        """``(k, v)`` ``[T, Hkv, D]``: every token of ``layer`` (after the model wrote its rows)."""
        if self._whole is None or self._whole[0] != layer:
            raise ValueError(f"layer {layer}'s rows were not handed out by buffers()")
        return self._whole[1], self._whole[2]

    def history(self, layer: int, q):
        """The chunk's queries ``q [T - start, Hq, D]`` over every reused token of ``layer``
        (non-causal, dense): ``(o [1, T - start, Hq, D], lse)``."""
        k, v = self.whole(layer)
        r = self.start
        return flash_attn_with_lse(q[None], k[None, :r], v[None, :r], causal=False, softmax_scale=self.scale)


class QuestPrefill:
    """The batched Quest store's prefill sink (a mixin of
    :class:`~xoffload.kv.quest.OffloadQuestBatchKV`: its pools, plan and staging)."""

    def _summary_rows(self, stab, n: int) -> torch.Tensor:
        """int64 ``[n]`` (host): summary page of each of a sequence's ``n`` candidates."""
        j = torch.arange(n, dtype=torch.int64)
        bt = torch.tensor(list(stab) or [0], dtype=torch.int64)
        return bt[j // SUMMARY_BLOCK] * SUMMARY_BLOCK + j % SUMMARY_BLOCK

    def sink(self, seq):
        """The prefill sink of ``seq``. Past a reused prefix (``kv["start"]`` tokens, prefix caching)
        the model prefills the rest while :class:`~.quest_prefix.WholeLayer` fills each
        layer's head from the pool, so ``done`` builds the summaries, channels, resident tokens and
        dense rows from the whole layer, as a fresh prefill does; the chunk attends to the prefix
        through ``history``."""
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
            if res and self.fp8:  # quantized per token (the tail's scales)
                self.tail.write_rows(layer, trows[:s0], k[:s0], v[:s0])
                self.tail.write_rows(layer, trows[s0:], k[t0:], v[t0:])
            elif res:  # the resident tokens: sink, then the recent tail
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
                if self.cache is None and not start:  # on the GPU only (a cached prompt's blocks,
                    return  # and those of a prompt prefilled in chunks, hold every layer)
            ev = self.eng.offload_layer(sid, layer, k_new, v_new)
            self._stage.copied(layer, ev)
            events.append(ev)
            if self.cache is not None and layer == last:
                self.cache.insert(sid, seq.req.ids)  # later sequences of this call may share the prompt

        return _StagedSink(wl.buffers, done, wl.history if start else None)
