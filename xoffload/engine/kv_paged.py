"""KV stores whose decode reads the prompt's KV in place, page by page: ``PagedKV``.

Prefill writes every layer's K/V into a *row store*: the offload runtime's pinned CPU pool
(``offload``) or one device tensor (``resident``). Decode then attends, per layer, to

* the pages it reads in place with :func:`xoffload.kernels.paged_decode_attn_with_lse` — from host
  memory over PCIe (UVA, no staging copy) or from HBM: every page of the prompt (dense decode), or
  with a :class:`xoffload.sparse.QuestDecode` policy the ``k`` best pages per KV head of the
  layer's candidate region, chosen on the device from GPU-resident min/max page summaries;
* a *tail* on the GPU: the sink and the prompt's last tokens (sparse layers), every generated token,
  or, for the policy's dense layers, the whole layer (kept resident so they never cross PCIe);

and merges the two partial results by their LSE. Offload with a decode policy adds a GPU *page
cache* per sparse layer (:mod:`xoffload.kernels.page_cache`, ShadowKV's reuse of the pages that
consecutive steps choose): the step looks its chosen pages up, copies only the misses out of the
pool, and attends in one kernel call over ``[cached pages | tail]``, which share one GPU row store
(no second attention call and no merge). Every step of a request has the same shapes and
reads its position on the device, so a whole decode step is captured in one CUDA graph: there is
no host work per layer (the ring store's per-layer stream and event bookkeeping cost SmolLM2
40 ms/token at 4K against a 1.7 ms PCIe bound).

Bytes over PCIe per token (offload): sparse layers x Hkv x k x page_size x D x 2 (K and V) x
element size; dense decode: the whole prompt's KV of every layer.
"""
from __future__ import annotations

import contextlib

import torch

from ..kernels import decode_attn_with_lse, gather_blocks, merge_attention_states, paged_decode_attn_with_lse
from ..kernels.page_cache import PageCacheState, page_cache_fill, page_cache_lookup
from ..sparse.quest import PageSummaries, QuestDecode, select_page_ids, select_pages
from .kv_store import KVStore, OffloadKV, PrefillStaging, Splits, register_store

__all__ = ["PagedKV", "OffloadPagedKV", "ResidentPagedKV"]


class PagedKV(KVStore):
    """One request's KV: prompt pages read in place (all, or Quest-selected), plus a GPU tail.

    Args:
        cfg: the model's :class:`~xoffload.models.config.ModelConfig`.
        dtype, device: the model's.
        scale: softmax scale.
        prompt_len: ``T``, prompt tokens (the prefill length).
        max_new: most decode steps of the request (tail capacity for generated tokens).
        policy: None (read every page: dense decode) or a :class:`QuestDecode`.
        engine, seq: the :class:`xoffload.runtime.OffloadRuntime` and its sequence id when the
            prompt's KV lives in the pinned pool (``offload``); None: a device row store
            (``resident``; the Quest setting, saving HBM reads instead of PCIe bytes).
        stage_dense: offload dense decode (no policy) only — True (default): each layer's pool
            blocks are copied (one gather kernel reading the pinned pool over UVA) into one of two
            GPU buffers on a copy stream while the layer before computes, inside the step's CUDA
            graph, and attention reads the buffer; False: the attention kernel reads the pages in
            place over PCIe (UVA), serialised with the layer's compute.

    Attributes:
        capturable: True (a decode step may be captured in a CUDA graph).
        h2d_bytes_per_step: bytes each decode step reads from host memory (0 when resident); with
            the page cache, the mean over the steps run so far (reads the device counters).
        summary_bytes: bytes of the page summaries on the GPU (0 without a policy).
        cache_slots: page-cache slots per KV head and sparse layer (0: no cache).
        cache_bytes: bytes of the page caches on the GPU.
        plan: the policy's :class:`~xoffload.sparse.quest.DecodePlan` (None without one).
    """

    capturable = True

    def __init__(self, cfg, dtype, device, scale: float, *, prompt_len: int, max_new: int,
                 policy: QuestDecode | None = None, engine=None, seq: int | None = None,
                 stage_dense: bool = True):
        self.cfg, self.dtype, self.device, self.scale = cfg, dtype, torch.device(device), scale
        self.T, self.policy, self.eng, self.seq = int(prompt_len), policy, engine, seq
        self.capacity = self.T + max_new
        L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        T = self.T
        if policy is None:
            self.plan, sparse = None, ()
            self.page = engine.block_size if engine is not None else 256
        else:
            self.plan, sparse = policy.plan(T), policy.sparse_layers(L)
            self.page = policy.page_size
            if engine is not None and engine.block_size % self.page:
                raise ValueError(f"QuestDecode.page_size {self.page} must divide the pool's block size "
                                 f"{engine.block_size}")
        self.sparse = frozenset(sparse) if policy is not None else frozenset()
        self.dense = frozenset(range(L)) - self.sparse if policy is not None else frozenset()
        self._rows = None  # the row store of the prompt (resident); offload: the engine's pool
        if engine is None:  # whole pages: the kernel reads a page's rows [entry, entry + page)
            R = -(-T // self.page) * self.page
            self._rows = (torch.zeros(L, R, hkv, d, dtype=dtype, device=self.device),
                          torch.zeros(L, R, hkv, d, dtype=dtype, device=self.device))
        # tails: [resident prompt tokens | generated tokens], per layer
        p = self.plan
        head = p.resident_prompt_tokens if p is not None else 0
        self._tail_prompt = [T if l in self.dense else head for l in range(L)]
        el = torch.tensor([], dtype=dtype).element_size()
        slot_bytes = 2 * len(self.sparse) * hkv * (policy.page_size if policy is not None else 0) * d * el
        C = policy.cache_slots(p, slot_bytes) if (p is not None and engine is not None and self.sparse) else 0
        self.cache_slots = C
        # QuestDecode.reuse_bias: a cached page's score bonus, ln(beta) in logit units (0: off)
        self._reuse_bonus = policy.reuse_bonus(scale) if C else 0.0
        self._tk = [torch.empty(n + max_new, hkv, d, dtype=dtype, device=self.device) for n in self._tail_prompt]
        self._tv = [torch.empty_like(t) for t in self._tk]
        # sparse layers with the page cache: [tail | C slots] in one store (one attention call),
        # allocated at the first decode step (after prefill's buffers are gone: a lower peak)
        self._cached = frozenset(self.sparse) if C else frozenset()
        self._ck, self._cv = {}, {}
        self.cache_bytes = sum(2 * (self._tail_prompt[l] + max_new + C * self.page) * hkv * d * el
                               for l in self._cached)
        # dense offload decode through two staging buffers filled on a copy stream
        self.staged = bool(stage_dense) and engine is not None and policy is None and T > 0
        if self.staged:  # whole pool blocks [nb, block, Hkv, D] (the gather copies blocks)
            nb, B = -(-T // engine.block_size), engine.block_size
            self._sbuf = [(torch.empty(nb, B, hkv, d, dtype=dtype, device=self.device),
                           torch.empty(nb, B, hkv, d, dtype=dtype, device=self.device)) for _ in range(2)]
            self._slen = torch.full((1,), T, dtype=torch.int32, device=self.device)
            cuda = self.device.type == "cuda"
            self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
            self._copied = [torch.cuda.Event() for _ in range(L)] if cuda else []
            self._freed = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=self.device)
        bases = sorted(set(self._tail_prompt))
        self._base_ix = {b: i for i, b in enumerate(bases)}
        self._bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self._widx = torch.zeros(len(bases), dtype=torch.int64, device=self.device)  # tail row of the new token
        self._wlen = torch.zeros(len(bases), dtype=torch.int32, device=self.device)  # tail length incl. it
        splits = Splits(cfg, self.device)
        self._nsplit_tail = {b: splits(b + max_new) for b in bases}
        # pages read in place
        self.summaries = None
        self._stage = PrefillStaging(hkv, d, dtype, self.device)
        self._events = []
        self._ready = False
        k = p.pages_per_step if p is not None else -(-T // self.page)
        self._k = k
        self._table = torch.zeros(1, hkv if p is not None else 1, max(k, 1), dtype=torch.int32, device=self.device)
        self._page_lens = torch.full((1,), k * self.page if p is not None else T, dtype=torch.int32,
                                     device=self.device)
        self._nsplit_pages = splits(max(k * self.page, 1))
        if p is not None and p.num_candidates > 0 and k > 0:
            self.summaries = PageSummaries(L, hkv, d, max(1, T // self.page), self.page, dtype, self.device,
                                           exact_channels=policy.exact_channels)
        self._pev = {}
        if C:
            tail_cap = head + max_new
            self._cbase = tail_cap  # first row of slot 0
            n_tail = -(-tail_cap // self.page)
            self._ctab = torch.zeros(1, hkv, k + n_tail, dtype=torch.int32, device=self.device)
            self._ctab[0, :, k:] = torch.arange(0, n_tail * self.page, self.page, dtype=torch.int32,
                                                device=self.device)
            self._clen = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._csrc = torch.zeros(hkv, k, dtype=torch.int32, device=self.device)
            self._cstate = {l: PageCacheState(hkv, C, p.num_candidates, self.device) for l in self.sparse}
            self._hits = torch.zeros(2, dtype=torch.int64, device=self.device)  # (hits, lookups)
            self._nsplit_cache = splits(k * self.page + tail_cap)
            if policy.prefetch and not p.dense:  # next layer's likely pages, copied on a copy stream
                self.lookahead = frozenset(l for l in self._cached if l - 1 >= 0)
                self._ptab = torch.zeros(hkv, k, dtype=torch.int32, device=self.device)
                self._psrc = torch.zeros(hkv, k, dtype=torch.int32, device=self.device)
                self._phits = torch.zeros(2, dtype=torch.int64, device=self.device)
                cuda = self.device.type == "cuda"
                self._pstream = torch.cuda.Stream(self.device) if cuda else None
                self._pev = {l: torch.cuda.Event() for l in self.lookahead} if cuda else {}
                self._pkeep = []  # estimates read by the copy stream, kept until the step ends
        self._bt = None
        read_layers = self.sparse if p is not None else range(L)
        tok_bytes = cfg.kv_bytes_per_token(dtype) // L  # K and V of one token in one layer
        paged_tokens = (k * self.page if p is not None else T) * len(tuple(read_layers))
        self._h2d_max = paged_tokens * tok_bytes if engine is not None else 0
        self._page_bytes = self.page * tok_bytes // hkv  # K and V of one page of one KV head
        if self.staged:  # whole blocks cross PCIe
            self._h2d_max = self._sbuf[0][0].shape[0] * engine.block_size * tok_bytes * L
        self.summary_bytes = self.summaries.nbytes if self.summaries is not None else 0

    def _counts(self):
        """(exact hits, exact lookups, prefetch misses) so far (reads the device counters)."""
        hits, looks = (int(x) for x in self._hits.tolist())
        pmiss = 0
        if self.lookahead:
            ph, pl = (int(x) for x in self._phits.tolist())
            pmiss = pl - ph
        return hits, looks, pmiss

    @property
    def h2d_bytes_per_step(self) -> int:
        if not self.cache_slots:
            return self._h2d_max
        hits, looks, pmiss = self._counts()
        steps = looks // max(1, self._k * self.cfg.num_kv_heads * len(self.sparse))
        return int((looks - hits + pmiss) * self._page_bytes / steps) if steps else self._h2d_max

    def decode_stats(self) -> dict:
        """Page-cache figures of the steps run so far (empty without a cache): ``cache_hit_rate``
        (exact selections found in the cache / looked up, counting what the prefetch brought),
        ``prefetch_share`` (pages copied by the prefetch / all pages copied), ``cache_slots``,
        ``cache_bytes``."""
        if not self.cache_slots:
            return {}
        hits, looks, pmiss = self._counts()
        moved = looks - hits + pmiss
        return {"cache_hit_rate": hits / looks if looks else None,
                "prefetch_share": pmiss / moved if moved else None,
                "cache_slots": self.cache_slots, "cache_bytes": self.cache_bytes}

    # ------------------------------------------------------------------ prefill sink
    def buffers(self, layer: int, T: int):
        """``[T, Hkv, D]`` K/V buffers for layer ``layer``'s prompt tokens."""
        if T != self.T:
            raise ValueError(f"PagedKV was built for a {self.T}-token prompt, prefill has {T}")
        if self.eng is None:
            return self._rows[0][layer, :T], self._rows[1][layer, :T]
        return self._stage.buffers(self.eng, layer, T)

    def done(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s prompt K/V are written: fill its tail, its summaries, and (offload)
        start the copy into the pool."""
        p, n0 = self.plan, self._tail_prompt[layer]
        if layer in self.dense:
            self._tk[layer][:n0].copy_(k)
            self._tv[layer][:n0].copy_(v)
        elif p is not None:
            s, t0 = p.sink_len, p.tail_start
            self._tk[layer][:s].copy_(k[:s])
            self._tv[layer][:s].copy_(v[:s])
            self._tk[layer][s:n0].copy_(k[t0:])
            self._tv[layer][s:n0].copy_(v[t0:])
            if self.summaries is not None:
                self.summaries.write(layer, k)
        if self.eng is not None and layer not in self.dense:
            ev = self.eng.offload_layer(self.seq, layer, k, v)
            self._stage.copied(layer, ev)
            self._events.append(ev)
        if layer == self.cfg.num_layers - 1:
            self._stage.clear()

    # ------------------------------------------------------------------ decode
    def _first_step(self):
        """Before the first decode step: the compute stream waits (on the GPU) for every prompt
        copy into the pool, and the block table of the pages is fixed."""
        if self.device.type == "cuda":
            cur = torch.cuda.current_stream(self.device)
            for ev in self._events:
                cur.wait_event(ev)
        self._events = []
        for l in self._cached:  # the cache stores take over the tails (their rows so far)
            n = self._tk[l].shape[0]
            ck = torch.empty(n + self.cache_slots * self.page, *self._tk[l].shape[1:], dtype=self.dtype,
                             device=self.device)
            cv = torch.empty_like(ck)
            ck[:n].copy_(self._tk[l])
            cv[:n].copy_(self._tv[l])
            self._ck[l], self._cv[l] = ck, cv
            self._tk[l], self._tv[l] = ck[:n], cv[:n]
        if self.eng is not None:
            B = self.eng.block_size
            bt = torch.tensor(self.eng.block_table(self.seq), dtype=torch.int32)
            self._bt = bt.to(self.device)
            self._block = B
            if self.plan is None:  # dense decode: one shared list of the prompt's pool blocks
                self._table[0, 0, : bt.numel()].copy_((bt.long() * B).to(torch.int32))
        else:
            self._block = self.page  # rows are token indices (no block table)
            if self.plan is None:
                self._table[0, 0] = torch.arange(0, self._k * self.page, self.page, dtype=torch.int32,
                                                 device=self.device)
        self._ready = True

    def begin_step(self, pos: int | None = None) -> None:
        """Start a step at host position ``pos`` (None: the device position, the CUDA-graph path)."""
        if not self._ready:
            self._first_step()
        if pos is not None:
            self.pos_t.fill_(pos)
        if self.lookahead:
            self._pkeep.clear()
        torch.add(self._bases, self.pos_t, out=self._widx)  # tail row of the new token: base + pos - T
        self._widx.sub_(self.T)
        self._wlen.copy_(self._widx)
        self._wlen.add_(1)
        if self.cache_slots:  # [k pages | tail]: the sparse layers' base is the resident head
            b = self._base_ix[self.plan.resident_prompt_tokens]
            torch.add(self._wlen[b:b + 1], self._k * self.page, out=self._clen)
        if self.staged:  # layers 0 and 1 start copying now; layer l+2 once layer l is done
            cs = self._copy_stream
            if cs is not None:
                cs.wait_stream(torch.cuda.current_stream(self.device))
            for layer in range(min(2, self.cfg.num_layers)):
                self._stage_layer(layer)

    def _stage_layer(self, layer: int) -> None:
        """Copy layer ``layer``'s prompt blocks from the pool into staging buffer ``layer % 2`` (on
        the copy stream, after the buffer's last reader; recorded in ``_copied[layer]``): one
        :func:`~xoffload.kernels.gather_blocks` launch per step and layer, reading the pinned pool
        over UVA (``cudaMemcpyAsync`` from registered memory cannot be captured by torch)."""
        kb, vb = self._sbuf[layer & 1]
        cs = self._copy_stream
        ctx = torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext()
        with ctx:
            gather_blocks(self.eng.pool.k[layer], self.eng.pool.v[layer], self._bt[:kb.shape[0]], kb, vb)
            if cs is not None:
                self._copied[layer].record(cs)

    def _store(self, layer):
        if self.eng is None:
            return self._rows[0][layer], self._rows[1][layer]
        return self.eng.pool.k_rows(layer), self.eng.pool.v_rows(layer)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Append the step's K/V to the layer's tail and attend (q ``[1, Hq, D]``) over the pages
        read in place plus the tail; returns ``[Hq, D]``."""
        b = self._base_ix[self._tail_prompt[layer]]
        idx = self._widx[b:b + 1]
        self._tk[layer].index_copy_(0, idx, k_new)
        self._tv[layer].index_copy_(0, idx, v_new)
        q4 = q[None]
        if layer in self._cached:
            return self._attend_cached(layer, q, q4)
        o_t, l_t = decode_attn_with_lse(q4, self._tk[layer][None], self._tv[layer][None], self._wlen[b:b + 1],
                                        softmax_scale=self.scale, num_splits=self._nsplit_tail[self._tail_prompt[layer]],
                                        check=False)
        if layer in self.dense or self._k == 0:
            return o_t[0, 0]
        if self.staged:
            return self._attend_staged(layer, q4, o_t, l_t)
        kr, vr = self._store(layer)
        if self.plan is not None:
            p = self.plan
            f, n = p.first_page, p.num_candidates
            s = self.summaries.scores(layer, q[0], f, n, self.policy, self.scale)
            select_pages(s, self._k, f, self.page, self._bt, self._block, out=self._table)
        o_p, l_p = paged_decode_attn_with_lse(q4, kr, vr, self._table, self._page_lens, page_size=self.page,
                                              softmax_scale=self.scale, num_splits=self._nsplit_pages, check=False)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        return o[0, 0]

    def _attend_staged(self, layer, q4, o_t, l_t) -> torch.Tensor:
        """Dense offload decode over the staging buffer of ``layer`` (waits for its copy), then
        frees the buffer for layer ``layer + 2``."""
        cuda = self._copy_stream is not None
        cur = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:
            cur.wait_event(self._copied[layer])
        kb, vb = (t.flatten(0, 1) for t in self._sbuf[layer & 1])
        o_p, l_p = decode_attn_with_lse(q4, kb[None], vb[None], self._slen, softmax_scale=self.scale,
                                        num_splits=self._nsplit_pages, check=False)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        if layer + 2 < self.cfg.num_layers:
            if cuda:
                self._freed[layer & 1].record(cur)
                self._copy_stream.wait_event(self._freed[layer & 1])
            self._stage_layer(layer + 2)
        return o[0, 0]

    def _fetch(self, layer: int, q: torch.Tensor, table, src, hits) -> None:
        """Select layer ``layer``'s pages for ``q`` ``[Hq, D]``, look them up in its cache (cache
        rows into ``table``), copy the misses from the pool."""
        p = self.plan
        f, n = p.first_page, p.num_candidates
        s = self.summaries.scores(layer, q, f, n, self.policy, self.scale)
        st = self._cstate[layer]
        ids = select_page_ids(s, self._k, prefer=st.slot_of if self._reuse_bonus else None,
                              prefer_bonus=self._reuse_bonus)
        page_cache_lookup(ids, st, table, src, first_page=f, page_size=self.page,
                          base=self._cbase, block_table=self._bt, block_size=self._block, hits=hits)
        kr, vr = self._store(layer)
        page_cache_fill(kr, vr, self._ck[layer], self._cv[layer], src, table, page_size=self.page)

    def prefetch(self, layer: int, q_est: torch.Tensor) -> None:
        """During layer ``layer - 1``: copy the pages that ``q_est`` ``[1, Hq, D]`` (layer
        ``layer``'s query estimated from layer ``layer - 1``'s input) selects into layer
        ``layer``'s cache, on the copy stream; :meth:`attend` of ``layer`` waits for it."""
        if layer not in self.lookahead:
            raise ValueError(f"layer {layer} is not a prefetching layer of this store ({sorted(self.lookahead)})")
        cs = self._pstream
        if cs is None:
            self._fetch(layer, q_est[0], self._ptab, self._psrc, self._phits)
            return
        self._pkeep.append(q_est)
        cs.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(cs):
            self._fetch(layer, q_est[0], self._ptab, self._psrc, self._phits)
            self._pev[layer].record(cs)

    def _attend_cached(self, layer: int, q: torch.Tensor, q4: torch.Tensor) -> torch.Tensor:
        """Sparse layer with the page cache: (after this layer's prefetch) select, look up, copy
        the misses, one attention call over ``[chosen pages | tail]``."""
        if layer in self._pev:
            torch.cuda.current_stream(self.device).wait_event(self._pev[layer])
        table = self._ctab[0, :, :self._k]
        self._fetch(layer, q[0], table, self._csrc, self._hits)
        ck, cv = self._ck[layer], self._cv[layer]
        o, _ = paged_decode_attn_with_lse(q4, ck, cv, self._ctab, self._clen, page_size=self.page,
                                          softmax_scale=self.scale, num_splits=self._nsplit_cache, check=False)
        return o[0, 0]

    def end_step(self) -> None:
        pass

    def advance(self) -> None:
        """Device position += 1 (the last op of a captured step)."""
        self.pos_t.add_(1)

    def close(self) -> None:
        """Free the request's tails, summaries, row store and (offload) its pool sequence."""
        self._tk = self._tv = []
        self._ck, self._cv = {}, {}
        self._sbuf = []
        self._rows = self.summaries = None
        self._stage.clear()
        if self.eng is not None and self.seq is not None:
            seq, self.seq = self.seq, None
            self.eng.free(seq)

    @classmethod
    def _make(cls, model, req, config, engine=None, seq=None) -> "PagedKV":
        T = len(req.ids)
        return cls(model.cfg, model.dtype, model.device, model.scale, prompt_len=T, max_new=req.final_len - T,
                   policy=config.decode_policy, engine=engine, seq=seq, stage_dense=config.offload_decode != "uva")


class ResidentPagedKV(PagedKV):
    """``mode="resident"`` with a decode policy: the prompt's KV in one device row store, each
    step reads the chosen pages from HBM (Quest's setting: fewer HBM reads, not less memory)."""

    mode = "resident"

    @classmethod
    def for_request(cls, model, shared, req, config) -> "ResidentPagedKV":
        return cls._make(model, req, config)


@register_store("offload")
class OffloadPagedKV(PagedKV):
    """``mode="offload"``: layerwise prefill copies each layer's K/V into the engine's pinned CPU
    pool; decode reads the prompt's pages (all, or the decode policy's choice) in place over PCIe,
    one CUDA graph per step. ``offload_decode="ring"`` selects :class:`OffloadKV` instead;
    ``"uva"`` reads a dense decode's pages in place instead of staging them (``stage_dense``)."""

    open_shared = OffloadKV.open_shared

    @classmethod
    def variant(cls, config) -> type:
        return OffloadKV if config.offload_decode == "ring" else cls

    @classmethod
    def for_request(cls, model, shared, req, config) -> "OffloadPagedKV":
        return cls._make(model, req, config, engine=shared, seq=shared.add_sequence())
