"""The figures of the batched Quest store (:class:`~xoffload.kv.quest.OffloadQuestBatchKV`): its
choices and pool sizes, host bytes a decode step reads per sequence and the page cache's hit
rate, from the store's plan and its page cache's device counters."""
from __future__ import annotations

from .base import SUMMARY_BLOCK


class QuestStats:
    """Mixin of :class:`~xoffload.kv.quest.OffloadQuestBatchKV`: ``describe``, ``summary_bytes``,
    ``h2d_bytes_per_step`` and ``decode_stats`` (it reads the store's ``policy``, ``pcache``,
    ``sparse`` / ``dense`` layers, ``page``, ``dense_on_gpu`` and ``_tok_layer_bytes``: bytes of
    one token of one layer in the pool, an fp8 pool's codes plus its scales per token)."""

    @property
    def summary_bytes(self) -> int:
        """Bytes of the GPU summary pool."""
        return self.summ.nbytes

    def describe(self) -> dict:
        """The call's choices: ``dense_on_gpu``, ``pool`` (``"host"`` / ``"device"``), ``memory_limited``
        (the summary pool was cut to the free GPU memory), pool sizes (``summary_pages``, bytes of the
        summary / tail / dense pools), ``N`` / ``K`` (the row widths: the most candidate and per-step
        pages of any prompt up to the longest the store was sized for)."""
        return {"store": type(self).__name__, "dense_on_gpu": self.dense_on_gpu, "pool": self.eng.pool.placement,
                "memory_limited": self.memory_limited, "summary_pages": self.sum_alloc.num_blocks * SUMMARY_BLOCK,
                "summary_bytes": self.summ.nbytes, "tail_bytes": self.tail.nbytes,
                "dense_pool_bytes": self.dpool.nbytes if self.dpool is not None else 0,
                "candidate_pages": self.N, "pages_per_step": self.K,
                "cache_slots": self.pcache.C if self.pcache is not None else 0,
                "cache_bytes": self.pcache.nbytes if self.pcache is not None else 0,
                "run_limit": self.run_limit, "cache_limited": self.cache_limited, "fused_tail": self.fused,
                "kv_cache_dtype": "fp8" if self.fp8 else str(self.dtype).replace("torch.", ""),
                "kv_scale_page": self.eng.pool.scale_page, "pool_bytes_per_token": self.eng.pool.bytes_per_token}

    def _cache_counts(self, seq):
        """(hits, lookups) of ``seq``'s page cache, or None without one / before its first step."""
        kv = seq.kv
        if kv is None or self.pcache is None or kv.get("cslot") is None:
            return None
        hits, looks = self.pcache.counts(kv["cslot"])
        return (hits, looks) if looks else None

    def h2d_bytes_per_step(self, seq) -> int:
        """Host bytes one decode step reads for ``seq``: its missed pages (measured by the page
        cache's counters once it has looked up) or its selected pages, plus the dense layers'
        candidates when they are read in place."""
        p = seq.kv["plan"] if seq.kv is not None else self.policy.plan(seq.prompt_len)
        dense = 0 if self.dense_on_gpu else len(self.dense) * p.num_candidates * self.page * self._tok_layer_bytes
        hl = self._cache_counts(seq)
        if hl is None:
            return int(len(self.sparse) * p.pages_per_step * self.page * self._tok_layer_bytes + dense)
        hits, looks = hl  # lookups per step: sparse layers x KV heads x k_r (as the one-request store counts)
        hkv = self.cfg.num_kv_heads
        steps = looks // max(1, len(self.sparse) * hkv * p.pages_per_step)
        page_bytes = self.page * self._tok_layer_bytes // hkv  # K and V of one page of one KV head
        return int((looks - hits) * page_bytes / steps + dense)

    def decode_stats(self, seq) -> dict:
        """With the page cache: ``cache_hit_rate`` (None before a lookup), ``cache_slots`` (this
        sequence's), ``cache_bytes`` (its slot of the epoch's caches)."""
        kv = seq.kv
        want = self._want_c(kv["plan"]) if kv is not None else 0
        if not want or self.pcache is None or kv.get("cslot") is None:  # alone: no cache either (or cut)
            return {}
        hits, looks = self.pcache.counts(kv["cslot"])
        c = min(want, self.pcache.C)
        return {"cache_hit_rate": hits / looks if looks else None, "cache_slots": c, "cache_bytes": self.pcache.nbytes // self.pcache.S}

    def _want_c(self, plan) -> int:
        """Cache slots a sequence with ``plan`` has alone (0: none)."""
        return self.policy.cache_slots(plan, self._slot_bytes) if self.sparse else 0
