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
        """Reserve the pool blocks of ``seq``'s admission and return them (the store keeps them in
        ``kv["held"]``): its prompt's ``blocks`` and, with a prefix cache, one more when the pool
        has room for it: a reused, partly filled last block is copied before the sequence writes
        into it (copy-on-write), the new block allocated while the sequence still holds the
        shared one. Without that room its reuse is cut back to whole blocks (:meth:`_reusable`),
        so a prompt that fits the pool is never refused for the copy."""
        held = blocks + int(self.cache is not None and self._reserved + blocks + 1 <= self.cap_blocks)
        self._reserved += held
        return held

    def _reusable(self, seq) -> int:
        """Tokens of ``seq``'s prompt (less its last, recomputed for its logits) the prefix cache
        gives it: the longest cached prefix, cut back to a whole number of scale pages with an
        fp8 pool of page scales (the page after it is written whole, with one scale, from its
        first token), and to whole blocks once admitted without a copy-on-write block."""
        n = self.cache.peek(seq.req.ids[:-1])
        p = self.eng.scale_page if getattr(self.eng, "fp8", False) else 1
        n -= n % p
        if seq.kv is not None and seq.kv["held"] == self._prompt_blocks(seq):
            n -= n % self.block
        return n

    def prefill_start(self, seq) -> int:
        """With a prefix cache: start ``seq``'s pool sequence on its :meth:`_reusable` prefix (now,
        so that it sees the prompts prefilled before it in this call)."""
        kv = seq.kv
        if kv["sid"] is None:
            kv["sid"], kv["start"] = self.cache.add_sequence(seq.req.ids[:self._reusable(seq)])
        return kv["start"]

    def prefill_tokens(self, seq) -> int:
        return seq.prompt_len if self.cache is None else seq.prompt_len - self._reusable(seq)
