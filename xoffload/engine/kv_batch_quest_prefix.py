"""Prefix reuse in the batched Quest store (:class:`~xoffload.engine.kv_batch.OffloadQuestBatchKV`
with ``prefix_caching``): the prefill of a sequence whose first ``r`` prompt tokens' KV the pinned
pool already holds (blocks of an earlier prompt, found by the
:class:`~xoffload.runtime.PrefixCache`).

The model prefills only the ``T - r`` remaining tokens, but what the Quest store builds from a
prompt at prefill (the page summaries, min/max of K per page and the exact channels, chosen per
sequence from the prompt's whole pages; the resident sink and recent tokens in the GPU tail; the
dense layers' rows in the GPU dense pool) needs every token of the layer. :class:`WholeLayer` hands
the model the tail ``[r, T)`` of a ``[T]`` staging pair per layer and fills its head ``[0, r)``
from the pool (one :meth:`~xoffload.runtime.OffloadEngine.fetch_blocks` per layer), so the store's
``done`` sees the whole layer's K/V, as a fresh prefill's, without a concatenation; the same rows
serve the chunk's attention to the reused prefix (:meth:`WholeLayer.history`: every reused token,
dense, as :class:`~xoffload.engine.kv_batch.OffloadBatchKV`'s sink). Only the new rows are copied
to the pool (the reused blocks are already there; a shared, partly filled last block is copied
before the write by the engine).

Prefill-time only: one fetch and one history launch per layer; nothing here runs in a decode step.
"""
from __future__ import annotations

from ..kernels import flash_attn_with_lse

__all__ = ["WholeLayer"]


class WholeLayer:
    """Staging of one sequence's prefill over a reused prefix of ``start`` tokens (``start >= 0``;
    0: a plain prefill, the model's rows are the whole layer).

    Args:
        eng: the :class:`~xoffload.runtime.OffloadEngine`; stage: the store's
            :class:`~xoffload.engine.kv_store.PrefillStaging`; sid: the sequence's pool id;
            start: reused tokens; T: the prompt's tokens; scale: the softmax scale.
    """

    def __init__(self, eng, stage, sid: int, start: int, T: int, scale: float):
        self.eng, self.stage, self.sid = eng, stage, sid
        self.start, self.T, self.scale = int(start), int(T), scale
        self._whole = None

    def buffers(self, layer: int, t: int):
        """The model's K/V rows of ``layer`` (``[t, Hkv, D]``, ``t = T - start``): the tail of a
        ``[T]`` staging pair whose head holds the reused prefix, read from the pool."""
        r = self.start
        if r + t != self.T:
            raise ValueError(f"a prompt of {self.T} tokens with {r} reused prefills {self.T - r} tokens, got {t}")
        k, v = self.stage.buffers(self.eng, layer, self.T)
        if r:
            blk = self.eng.block_size
            kp, vp = self.eng.fetch_blocks(self.sid, layer, list(range(-(-r // blk))))
            k[:r].copy_(kp[:r])
            v[:r].copy_(vp[:r])
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
