"""Prefix caching of the batched offload stores (:class:`CachedPrompts`, a mixin of
:class:`~xoffload.kv.offload.OffloadBatchKV` and :class:`~xoffload.kv.quest.OffloadQuestBatchKV`):
where a sequence's pool sequence starts, the blocks its admission reserves for it, and the tokens
its prefill computes. The answer kept after it: :mod:`.answers`."""
from __future__ import annotations

__all__ = ["CachedPrompts"]


class CachedPrompts:
    """Prefix caching of the batched offload stores (a :class:`~xoffload.runtime.PrefixCache` over
    the engine's pool, pinned or on the device, in ``self.cache``, or None): a sequence's pool
    sequence starts at its prefill on the longest cached prefix of its prompt (``kv["sid"]`` None
    until then)."""

    #: the engine passes its prefix cache to :meth:`open` (``prefix_cache=``)
    takes_prefix_cache = True

    def _reserve(self, seq, blocks: int) -> int:
        """Pool blocks ``seq``'s admission reserves (into ``kv["held"]``): its prompt's ``blocks``
        and, with a prefix cache, one more when the pool has room for it: a reused, partly filled
        last block is copied before the sequence writes into it (copy-on-write), the new block
        allocated while the sequence still holds the shared one. Without that room its reuse is
        cut back to whole blocks (``kv["cow"]`` False; :meth:`prefill_start`), so a prompt that
        fits the pool is never refused for the copy."""
        return blocks + int(self.cache is not None and self._reserved + blocks + 1 <= self.cap_blocks)

    def prefill_start(self, seq) -> int:
        """With a prefix cache: start ``seq``'s pool sequence on the longest cached prefix of its
        prompt (now, so that it sees the prompts prefilled before it in this call). With an fp8
        pool of page scales the prefix is cut back to a whole number of scale pages (the page
        after it is written whole, with one scale, from its first token); without a reserved
        copy-on-write block (:meth:`_reserve`), to whole blocks."""
        kv = seq.kv
        if kv["sid"] is None:
            ids = seq.req.ids[:-1]
            n = self._aligned(self.cache.peek(ids))
            if not kv.get("cow", True):
                n -= n % self.block
            if n < len(ids):
                ids = ids[:n]
            kv["sid"], kv["start"] = self.cache.add_sequence(ids)
        return kv["start"]

    def _aligned(self, n: int) -> int:
        """``n`` cut back to a multiple of the pool's fp8 scale page (unchanged for 16-bit pools or
        token scales)."""
        p = self.eng.scale_page if getattr(self.eng, "fp8", False) else 1
        return n - n % p if p > 1 else n

    def prefill_tokens(self, seq) -> int:
        if self.cache is None:
            return seq.prompt_len
        n = self._aligned(self.cache.peek(seq.req.ids[:-1]))
        return seq.prompt_len - (n - n % self.block if seq.kv is not None and not seq.kv.get("cow", True) else n)
