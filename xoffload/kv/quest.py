"""``offload``, Quest decode (any ``max_num_seqs``): :class:`OffloadQuestBatchKV` (see
:mod:`.base` for the store interface)."""
from __future__ import annotations

import torch

from ..kernels import merge_attention_states, paged_decode_attn_with_lse
from ..kernels.topk import topk_ids
from ..runtime.allocator import BlockAllocator
from ..sparse.quest import DecodePlan
from .fp8 import Fp8Region, Fp8RowPool
from .page_cache import BatchPageCache
from .staging import PrefillStaging
from .answers import KeptAnswers
from .cached_prompts import CachedPrompts
from .chunk import ChunkedPrefill
from .quest_prefix import QuestPrefill
from .quest_stats import QuestStats
from .base import (SUMMARY_BLOCK, TAIL_BLOCK, BatchKV, RowPool, _Region, _blocks,
                       _join, _pool_memory_limit, _to_device, _top_sum)


class OffloadQuestBatchKV(KeptAnswers, QuestStats, QuestPrefill, ChunkedPrefill, CachedPrompts, BatchKV):
    """``offload`` (or ``resident``) + :class:`~xoffload.sparse.QuestDecode`: the batched Quest store
    (docs/DESIGN.md, "The batched Quest store", says why each choice was made). Over a runtime whose
    pool is on the model's device (``pool_placement="device"``, ``resident``) pages are read in
    place from HBM: no page cache, no dense pool (the dense layers read the pool), no host bytes.

    Where each sequence's KV lives: every layer's prompt KV in the offload runtime's pinned pool
    (``kv_cache_tokens``), copied there layer by layer during prefill; the page summaries (min and
    max of K per page of ``page_size`` tokens and KV head, plus the exact channels' values) of its
    candidate pages, sparse layers only, in one shared GPU summary pool ``[sparse layers, Hkv,
    pages + 1, D]`` (the last page is scratch), reserved in blocks of :data:`SUMMARY_BLOCK` pages;
    per row, in a paged GPU tail pool (blocks of :data:`TAIL_BLOCK`): the prompt's sink and recent
    tokens and every generated token. The policy's dense layers live in a paged GPU dense pool when
    the whole pool for ``max_num_seqs`` sequences fits the memory left after tails, summaries and a
    prefill's headroom (``dense_on_gpu``; :attr:`DENSE_ON_GPU` overrides), else in the pinned pool,
    read in place over PCIe (UVA). Each running sequence holds one of ``max_num_seqs`` page-cache
    slots (:class:`~xoffload.kv.page_cache.BatchPageCache`) with the slots its plan gets
    alone (:meth:`QuestDecode.cache_slots`), cut to the memory left; when a step's pages do not
    fit there is none, unless fewer sequences at once can each have one: then at most
    ``run_limit`` run at a time (down to ``1 /`` :attr:`CACHE_OVER_BATCH` of them;
    ``cache_limited``).

    Prefix caching (``prefix_caching``) as :class:`~.offload.OffloadBatchKV`: the pool
    sequence starts at prefill on the longest cached prefix, the model prefills the rest, the
    prompt goes into the cache after the last layer (the dense layers are then copied to the pool
    too); the staging holds the whole layer, its reused head read back from the pool
    (:mod:`~.quest_prefix`), so summaries, channels, resident tokens and dense rows are
    those of a fresh prefill and the chunk attends to the prefix through ``history``.

    Decode, per layer, for all rows at once (shapes fixed for the store, one CUDA graph per
    batch-size bucket): the new K/V into each row's tail and one paged launch over the tails; for
    a sparse layer one :func:`~xoffload.kernels.quest_score.quest_page_scores_batched` launch (each
    row against its own candidates, ``-inf`` past its count), one
    :func:`~xoffload.kernels.topk.topk_ids` with each row's own count ``k_r`` (the one-request
    store's choice: ties to the lowest ids, ids ascending), then with the caches one batched
    lookup + fill and one paged launch over them, without them one paged launch over the pinned
    pool; for a dense layer one paged launch over each row's candidate pages; the parts merged by
    LSE. With a page cache (``fused_tail``, :attr:`FUSE_TAIL`) a sparse layer's tail rows follow the
    cache's in one row store and the launch reads ``[k_r cached pages | tail pages]`` per row: one
    attention call and no merge, as the one-request store did. FP8 (pool, caches, tail; the
    summaries and GPU dense pool stay 16-bit; no fused tail with page scales): :mod:`.fp8`.
    ``N`` / ``K`` are the most candidate / per-step pages of any prompt up to the longest the
    store was sized for (:meth:`QuestDecode.largest_plan`: a later, shorter request may read
    more); each row keeps its own plan (:meth:`QuestDecode.plan`), so its pages are those of the
    one-request store. Padding rows have length 0 and write into the tail's scratch block.
    """

    capturable = True
    #: None: the dense layers' KV on the GPU when its pool fits (see above); True / False: always / never
    DENSE_ON_GPU: bool | None = None
    #: when no page cache fits for the call's sequences, run down to ``1 / CACHE_OVER_BATCH`` of them
    #: at once so that each gets a cache (``run_limit``; see the class docstring)
    CACHE_OVER_BATCH = 8
    #: with a page cache, the sparse layers' tail shares its row store: one attention call per layer
    FUSE_TAIL = True

    def __init__(self, model, config, shared, seqs, prefix_cache=None):
        super().__init__(model, config, shared, seqs)
        from types import SimpleNamespace

        from ..sparse.page_summaries import PageSummaries

        self.eng = shared
        self.on_device = shared.pool.placement == "device"
        self.fp8 = bool(getattr(shared.pool, "fp8", False))
        # the pool's scale granularity (None: 16-bit): page scales are per Quest page
        self.scales = None if not self.fp8 else ("token" if shared.pool.scale_page == 1 else "page")
        self.block = self.eng.block_size
        self.cache = prefix_cache
        pol = self.policy = config.decode_policy
        self.r, self.alpha = int(pol.exact_channels), float(pol.bound_scale)
        P = self.page = int(pol.page_size)
        if self.block % P:
            raise ValueError(f"QuestDecode.page_size {P} must divide the pool's block size {self.block}")
        if self.scales == "page" and shared.pool.scale_page != P:
            raise ValueError(f"an fp8 pool read by Quest pages of {P} tokens needs a scale per page of {P}, "
                             f"got scale_page={shared.pool.scale_page}")
        L, hkv, d = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        self.sparse = frozenset(pol.sparse_layers(L))
        self.dense = frozenset(range(L)) - self.sparse
        self._sl = {l: i for i, l in enumerate(sorted(self.sparse))}
        self.cap_blocks = self.eng.num_free_blocks  # the pool is this call's
        if prefix_cache is not None:  # cached blocks no live sequence holds give way when needed
            self.cap_blocks += prefix_cache.evictable_blocks()
        self._keys = 0
        plans = [pol.plan(max(s.prompt_len, 1)) for s in seqs]
        # the per-row widths: those of any prompt up to the longest, so that a request admitted
        # later (shorter, but reading more pages or keeping more tokens resident) fits its row
        n_most, k_most, res_most = pol.largest_plan(self.max_prompt)
        self.N, self.K = n_most, (k_most if self.sparse else 0)
        # the GPU memory free for the pools, measured before any of them is allocated
        limit = _pool_memory_limit(model, seqs, config, self.device)
        R = self.buckets[-1]
        # (each as the most a prompt up to its length keeps resident: a later, shorter one may keep more)
        tail_need = [pol.largest_plan(max(s.prompt_len, 1))[2] + self._new(s) for s in seqs] + [1]
        tail_blocks = _top_sum([_blocks(n, TAIL_BLOCK) for n in tail_need], self.max_num_seqs)
        el = torch.empty((), dtype=self.dtype).element_size()
        # (fp8: 1-byte codes and a 4-byte scale per token and KV head)
        self._tail_bytes = 2 * L * (tail_blocks + 1) * TAIL_BLOCK * hkv * ((d + 4) if self.fp8 else d * el)
        # the summary pool, the dense pool and the page caches, sized for the sequences that run at
        # once (S): from the requests and (CUDA) the free memory; see _plan_memory
        sneed = [_blocks(self._summary_pages(p), SUMMARY_BLOCK) for p in plans]
        dneed = [self._prompt_blocks(s) for s in seqs] if self.dense else [0]
        # bytes of a summary block: min, max, channels
        per_sb = self._per_sb = max(1, len(self.sparse)) * hkv * SUMMARY_BLOCK * (2 * d + P * self.r) * el
        per_db = 2 * len(self.dense) * self.block * hkv * d * el
        self._dl = {l: i for i, l in enumerate(sorted(self.dense))}
        self._slot_bytes = sb = BatchPageCache.slot_bytes(len(self.sparse), hkv, d, P, self.dtype, self.scales)
        # the slots a row reading the most pages wants (a later request may read more than these)
        widest = DecodePlan(self.max_prompt, P, 0, 0, 0, num_candidates=self.N, pages_per_step=self.K)
        cmax = self._want_c(widest) if not self.on_device else 0
        S = min(self.max_num_seqs, len(seqs))  # the most that run at once in this call
        mem = self._plan_memory(S, sneed, dneed, per_sb, per_db, sb, cmax, limit)
        self.cache_limited = False
        if cmax and mem["slots"] < self.K and limit is not None:
            # no cache for S sequences: fewer at a time, each with its cache, move far fewer PCIe bytes
            # (8B shape, 32K, budget 2048: ~14 MB per sequence and token cached against ~228 MB
            # uncached), so run the largest S' >= S / CACHE_OVER_BATCH whose caches fit
            for s2 in range(S - 1, max(1, -(-S // self.CACHE_OVER_BATCH)) - 1, -1):
                m2 = self._plan_memory(s2, sneed, dneed, per_sb, per_db, sb, cmax, limit)
                if m2["slots"] >= self.K:
                    mem, S, self.cache_limited = m2, s2, True
                    break
        self.run_limit = S
        self.memory_limited, nsb = mem["memory_limited"], mem["nsb"]
        self.dense_on_gpu = mem["dense_on"]
        self.dpool = None
        if self.dense_on_gpu:
            dcfg = SimpleNamespace(num_layers=len(self.dense), num_kv_heads=hkv, head_dim=d)
            self.dpool = RowPool(dcfg, mem["ndb"], self.block, self.dtype, self.device)
        # per-sequence page caches (kv.page_cache): what the policy gives each plan alone, cut to
        # the memory left after the tails, summaries and dense pool; none when a step's pages do not fit
        # with a cache, the sparse layers' tail rows follow the cache's in one row store ("fused"):
        # one attention call over [cached pages | tail], as the one-request store did
        # a row's tail table: any prompt up to the longest with the most new tokens
        self.pcache, rp = None, _blocks(res_most + max(self.max_new - 1, 0), TAIL_BLOCK)
        self.fused = bool(self.FUSE_TAIL and cmax and mem["slots"] >= self.K) and TAIL_BLOCK % P == 0 \
            and self.scales != "page"  # page-scaled cache rows and token-scaled tail rows: two calls
        if cmax and mem["slots"] >= self.K:
            self.pcache = BatchPageCache(len(self.sparse), hkv, d, S, mem["slots"], max(self.N, 1), self.K, R,
                                        P, pol.reuse_bonus(self.scale), self.dtype, self.device,
                                        tail_rows=(tail_blocks + 1) * TAIL_BLOCK if self.fused else 0,
                                        tail_pages=rp * TAIL_BLOCK // P, scales=self.scales)
        ext = self.pcache.tail_layers(sorted(self.sparse)) if self.fused else None
        tail_cls, region_cls = (Fp8RowPool, Fp8Region) if self.fp8 else (RowPool, _Region)
        self.tail = tail_cls(self.cfg, tail_blocks, TAIL_BLOCK, self.dtype, self.device, external=ext)
        self.region = region_cls(self.tail, R, rp, self.device)
        self.clens = torch.zeros(R, dtype=torch.int32, device=self.device)  # fused: k_r pages + tail tokens
        self.sum_alloc = BlockAllocator(nsb, SUMMARY_BLOCK)
        self.summ_scratch = nsb * SUMMARY_BLOCK  # the scratch page (padding entries of the index)
        self.summ = PageSummaries(max(1, len(self.sparse)), hkv, d, self.summ_scratch + 1, P, self.dtype,
                                  self.device, exact_channels=self.r)
        self.summ.kmin.zero_()
        self.summ.kmax.zero_()
        # row r's exact channels per sparse layer and KV head (each sequence chooses its own at prefill)
        self.chan = torch.zeros(R, max(1, len(self.sparse)), hkv, max(self.r, 1), dtype=torch.int32,
                                device=self.device) if self.r else None
        Nw, Kw = max(self.N, 1), max(self.K, 1)
        self.cand_row = torch.zeros(R, Nw, dtype=torch.int32, device=self.device)  # pool row of candidate j
        self.dcand_row = torch.zeros(R, Nw, dtype=torch.int32, device=self.device) if self.dpool is not None \
            else self.cand_row  # dense pool row of candidate j
        self.sidx = torch.full((R, Nw), self.summ_scratch, dtype=torch.int32, device=self.device)
        self.nvalid = torch.zeros(R, dtype=torch.int32, device=self.device)  # candidates scored
        self.klens = torch.zeros(R, dtype=torch.int32, device=self.device)  # k_r * page tokens (sparse)
        self.dlens = torch.zeros(R, dtype=torch.int32, device=self.device)  # n_r * page tokens (dense)
        self.table = torch.zeros(R, hkv, Kw, dtype=torch.int32, device=self.device)
        self._sel = torch.zeros(R * hkv, Kw, dtype=torch.int32, device=self.device)
        self._krows = torch.zeros(R * hkv, dtype=torch.int32, device=self.device)  # k_r per (row, KV head)
        self.scores = torch.empty(R, hkv, Nw, dtype=torch.float32, device=self.device)
        self._reserved = 0
        self._admitted: dict = {}
        self._stage = PrefillStaging(self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device)
        # K and V of one token and layer, as host bytes per step count them (0: the pool is on the device)
        # (fp8: codes and the scales of a page, per token)
        self._tok_layer_bytes = 0 if self.on_device else (shared.pool.bytes_per_token / L if self.fp8 else
                                                          self.cfg.kv_bytes_per_token(self.dtype) // L)

    def _plan_memory(self, S, sneed, dneed, per_sb, per_db, slot_bytes, cmax, limit) -> dict:
        """The pools' sizes for ``S`` sequences at once (no allocation): ``nsb`` summary blocks
        (``memory_limited``: cut to the free memory), ``ndb`` dense blocks and whether they go on
        the GPU (``dense_on``: they fit, or :attr:`DENSE_ON_GPU`), and the cache ``slots`` per
        sequence that fit after them (``>= pages_per_step``: a cache; fewer: none)."""
        nsb = _top_sum(sneed, S)
        tail = self._tail_bytes
        limited = limit is not None and (limit - tail) // per_sb < nsb
        if limited:
            nsb = max(0, (limit - tail) // per_sb)
        ndb = _top_sum(dneed, S) if self.dense else 0
        left = None if limit is None else limit - tail - nsb * per_sb
        # the dense pool allocates one scratch block more than its table can hold
        fits = left is None or (not limited and left >= (ndb + 1) * per_db)
        dense_on = bool(self.dense) and self.N > 0 and not self.on_device and \
            (fits if self.DENSE_ON_GPU is None else bool(self.DENSE_ON_GPU))
        free = None if limit is None else left - ((ndb + 1) * per_db if dense_on else 0)
        slots = BatchPageCache.slots_that_fit(cmax, S, slot_bytes, free) if cmax else 0
        return {"nsb": nsb, "memory_limited": limited, "ndb": ndb, "dense_on": dense_on, "slots": slots}

    def _exact_decode(self, plan) -> bool:
        """Whether a sequence of ``plan`` decodes as dense attention would (every candidate page read,
        or no page-selecting layer below the top one, whose output feeds no layer's K/V)."""
        return plan.dense or not self.sparse or min(self.sparse) == self.cfg.num_layers - 1

    @staticmethod
    def _new(seq) -> int:
        return max(seq.req.max_new - 1, 0)

    def _summary_pages(self, plan) -> int:
        """Summary pages a sequence with ``plan`` reserves: its candidates when it selects (k > 0)."""
        return plan.num_candidates if (self.sparse and plan.pages_per_step > 0) else 0

    def _prompt_blocks(self, seq) -> int:
        return _blocks(seq.prompt_len, self.block)

    @classmethod
    def open(cls, model, config, shared, seqs, prefix_cache=None, pool_placement="host") -> "OffloadQuestBatchKV":
        """ValueError when ``shared``'s pool is not where the store table says (``pool_placement``)."""
        if shared.pool.placement != pool_placement:
            raise ValueError(f"this store expects a runtime whose pool placement is {pool_placement!r}, "
                             f"got {shared.pool.placement!r}")
        return cls(model, config, shared, seqs, prefix_cache)

    def _needs(self, seq) -> tuple:
        p = self.policy.plan(seq.prompt_len)
        return (self._prompt_blocks(seq), _blocks(p.resident_prompt_tokens + self._new(seq), TAIL_BLOCK),
                _blocks(self._summary_pages(p), SUMMARY_BLOCK))

    def check(self, seq):
        self.check_shape(seq)
        nb, nt, ns = self._needs(seq)
        if self.dpool is not None and self._prompt_blocks(seq) > self.dpool.num_blocks:  # cannot happen: sized from the requests
            raise ValueError(f"prompt {seq.index} needs {self._prompt_blocks(seq) * self.block} tokens of dense-layer "
                             f"KV on the GPU but "
                             f"the dense pool holds {self.dpool.num_blocks * self.block}")
        if nb > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {nb * self.block} tokens of KV in the {self.eng.pool.label} "
                             f"({seq.prompt_len} prompt tokens in blocks of {self.block}) but the pool holds "
                             f"{self.cap_blocks * self.block} tokens (kv_cache_tokens)")
        if nt > self.tail.num_blocks:
            raise ValueError(f"prompt {seq.index} needs {nt * TAIL_BLOCK} tokens of GPU tail (sink, recent and new "
                             f"tokens) but the tail pool holds {self.tail.num_blocks * TAIL_BLOCK}")
        if ns > self.sum_alloc.num_blocks:
            raise ValueError(f"prompt {seq.index} needs {ns * SUMMARY_BLOCK} pages of Quest summaries "
                             f"({ns * self._per_sb} bytes on the GPU) but the summary pool holds "
                             f"{self.sum_alloc.num_blocks * SUMMARY_BLOCK} pages (the GPU memory free for it)")

    def can_admit(self, seq) -> bool:
        nb, nt, ns = self._needs(seq)
        return (len(self._admitted) < self.run_limit and self._reserved + nb <= self.cap_blocks
                and nt <= self.tail.alloc.num_free and ns <= self.sum_alloc.num_free
                and (self.dpool is None or self._prompt_blocks(seq) <= self.dpool.alloc.num_free))

    def admit(self, seq):
        # the GPU pools are keyed by the store's own key; with a prefix cache the pool sequence
        # starts at the prefill (prefill_start), on the blocks of the prompts prefilled before it
        p = self.policy.plan(seq.prompt_len)
        nb, _, ns = self._needs(seq)
        key = self._keys
        self._keys += 1
        sid = self.eng.add_sequence() if self.cache is None else None
        try:
            tail = self.tail.reserve(key, p.resident_prompt_tokens + self._new(seq))
            self.sum_alloc.add(key)
            self.sum_alloc.allocate(key, ns)
            dtab = self.dpool.reserve(key, seq.prompt_len) if self.dpool is not None else ()
            cslot = self.pcache.acquire() if self.pcache is not None else None
        except Exception:
            self.tail.free(key)
            if self.dpool is not None:
                self.dpool.free(key)
            if self.sum_alloc.has(key):
                self.sum_alloc.free(key)
            if sid is not None:
                self.eng.free(sid)
            raise
        self._admitted[key] = seq
        seq.kv = {"key": key, "sid": sid, "start": 0, "plan": p, "tail": tail, "stab": self.sum_alloc.table(key),
                  "dtab": dtab, "events": [], "joined": False, "cslot": cslot,
                  "held": self._reserve(seq, nb)}  # (+ a copy-on-write block where there is room)

    def release(self, seq):
        kv = seq.kv
        if kv is None:
            return
        if self._exact_decode(kv["plan"]):  # else the answer's K/V are not those a prefill computes
            self.keep_answer(seq, kv["plan"].resident_prompt_tokens, kv["held"])  # after sink + recent
        key = kv["key"]
        self._admitted.pop(key, None)
        self._reserved -= kv["held"]
        self.tail.free(key)
        if self.sum_alloc.has(key):
            self.sum_alloc.free(key)
        if self.dpool is not None:
            self.dpool.free(key)
        if self.pcache is not None and kv.get("cslot") is not None:
            self.pcache.release(kv["cslot"])
        if kv["sid"] is not None:
            self.eng.free(kv["sid"])
        seq.kv = None

    def set_batch(self, seqs) -> int:
        rows = self.bucket(len(seqs))
        _join(seqs, self.device)
        self._set_positions(seqs, rows)
        plans = [s.kv["plan"] for s in seqs]
        ttab = self.region.set_rows([s.kv["tail"] for s in seqs], [s.prompt_len - p.resident_prompt_tokens
                                                                   for s, p in zip(seqs, plans)], rows)
        Nw, P, B = self.cand_row.shape[1], self.page, self.block
        cand = torch.zeros(rows, Nw, dtype=torch.int32)
        dcand = torch.zeros(rows, Nw, dtype=torch.int32)
        sidx = torch.full((rows, Nw), self.summ_scratch, dtype=torch.int32)
        nval = torch.zeros(rows, dtype=torch.int32)
        klen = torch.zeros(rows, dtype=torch.int32)
        dlen = torch.zeros(rows, dtype=torch.int32)
        for i, (s, p) in enumerate(zip(seqs, plans)):
            n = p.num_candidates
            if n:
                tok = (torch.arange(n, dtype=torch.int64) + p.first_page) * P
                if self.sparse or self.dpool is None:  # (no pool blocks when every layer is dense on the GPU)
                    bt = torch.tensor(self.eng.block_table(s.kv["sid"]), dtype=torch.int64)
                    cand[i, :n] = (bt[tok // B] * B + tok % B).to(torch.int32)
                if self.dpool is not None:
                    dbt = torch.tensor(s.kv["dtab"], dtype=torch.int64)
                    dcand[i, :n] = (dbt[tok // B] * B + tok % B).to(torch.int32)
                dlen[i] = n * P
            ns = self._summary_pages(p)
            if ns:
                sidx[i, :ns] = self._summary_rows(s.kv["stab"], ns).to(torch.int32)
                nval[i] = ns
                klen[i] = p.pages_per_step * P
        pairs = [(self.cand_row, cand), (self.sidx, sidx), (self.nvalid, nval), (self.klens, klen),
                 (self.dlens, dlen)]
        if self.dpool is not None:
            pairs.append((self.dcand_row, dcand))
        for dst, src in pairs:
            _to_device(dst[:rows], src)
        hkv = self.cfg.num_kv_heads
        _to_device(self._krows[:rows * hkv], (klen // P).repeat_interleave(hkv))
        if self.pcache is not None:
            self.pcache.set_rows([(s.kv["cslot"], p.pages_per_step if self._summary_pages(p) else 0,
                                  min(self._want_c(p), self.pcache.C)) for s, p in zip(seqs, plans)], rows,
                                ttab, TAIL_BLOCK)
        if self.chan is not None:  # device to device, one copy per sequence (outside the graph)
            self.chan[:rows].zero_()
            for i, s in enumerate(seqs):
                if s.kv.get("chan") is not None:
                    self.chan[i].copy_(s.kv["chan"])
        self.n = rows
        return rows

    def begin_step(self):
        self.region.step(self.pos, self.active, self.n)
        if self.fused:
            torch.add(self.klens[:self.n], self.region.lens[:self.n], out=self.clens[:self.n])

    def _pages(self, layer, q4, q):
        """Row r's pool pages of ``layer`` (all candidates, or its top ``k_r``): ``(out, lse)``."""
        n, pool = self.n, self.eng.pool
        kr, vr = (pool.k_rows(layer), pool.v_rows(layer)) if self.dpool is None or layer in self.sparse else \
            (self.dpool.k[self._dl[layer]], self.dpool.v[self._dl[layer]])
        ks = vs = None  # fp8: the scales of kr / vr (the GPU dense pool is 16-bit)
        if self.fp8 and (self.dpool is None or layer in self.sparse):
            ks, vs = pool.k_scale_rows(layer), pool.v_scale_rows(layer)
        if layer in self.dense:
            table, lens = self.dcand_row[:n, None], self.dlens[:n]
        else:
            from ..kernels.channel_score import channel_page_scores_batched
            from ..kernels.quest_score import quest_page_scores_batched

            si = self._sl[layer]
            if self.r:
                sc = channel_page_scores_batched(q.to(self.dtype), self.summ.kmin[si], self.summ.kmax[si],
                                                 self.chan[:n, si], self.summ.klab[si], self.sidx[:n],
                                                 self.nvalid[:n], alpha=self.alpha, out=self.scores[:n])
            else:
                sc = quest_page_scores_batched(q.to(self.dtype), self.summ.kmin[si], self.summ.kmax[si],
                                               self.sidx[:n], self.nvalid[:n], out=self.scores[:n])
            # the one-request selection (topk_ids: ties to the lowest ids, ids ascending), k_r per row,
            # with the page caches' reuse bonus on the pages they hold
            hkv, pc = self.cfg.num_kv_heads, self.pcache
            prefer = pc.prefer(si, n, sc.shape[2]) if pc is not None and pc.bonus else None
            sel = topk_ids(sc.reshape(-1, sc.shape[2]), self.K, out=self._sel[:n * hkv], prefer=prefer,
                           prefer_bonus=pc.bonus if prefer is not None else 0.0,
                           k_rows=self._krows[:n * hkv]).view(n, hkv, self.K)
            if pc is not None:  # look up, copy the misses, read the caches (and the tail: fused)
                kr, vr, table = pc.fetch(si, sel, self.cand_row[:n], kr, vr, n, pool_scales=(ks, vs))
                ks, vs = pc.scales_of(si)
                if self.fused:
                    return paged_decode_attn_with_lse(q4, kr, vr, table, self.clens[:n], page_size=self.page,
                                                      softmax_scale=self.scale, check=False, k_scale=ks, v_scale=vs)
            else:
                self.table[:n].copy_(self.cand_row[:n].gather(1, sel.view(n, -1).long()).view(n, -1, self.K))
                table = self.table[:n]
            lens = self.klens[:n]
        return paged_decode_attn_with_lse(q4, kr, vr, table, lens, page_size=self.page, softmax_scale=self.scale,
                                          check=False, k_scale=ks, v_scale=vs)

    def attend(self, layer, q, k_new, v_new):
        n, q4 = self.n, q[:, None]
        if self.fused and self.K and layer in self.sparse:  # one call over [cached pages | tail]
            self.region.write(layer, k_new, v_new, n)
            return self._pages(layer, q4, q)[0][:, 0]
        o_t, l_t = self.region.attend(layer, q4, k_new, v_new, n, self.scale)
        if (self.N if layer in self.dense else self.K) == 0:  # no row of the call reads a page here
            return o_t[:, 0]
        o_p, l_p = self._pages(layer, q4, q)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        return o[:, 0]

    def close(self):
        for seq in list(self._admitted.values()):
            self.release(seq)
        if self.pcache is not None:
            self.pcache.close()
        self.tail = self.region = self.summ = self.pcache = None
        self._stage.clear()
        self.cand_row = self.dcand_row = self.sidx = self.table = self.scores = self.dpool = None
        super().close()


