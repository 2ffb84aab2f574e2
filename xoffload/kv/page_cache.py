"""Per-sequence GPU page caches for the batched Quest store (:class:`~xoffload.kv.base.
OffloadQuestBatchKV`): the pages a sequence's sparse layers fetched stay on the GPU, so a page chosen
again costs no PCIe bytes (ShadowKV, Sun et al. 2024: most chosen chunks repeat between steps).

Each sequence of a batched ``generate`` call holds one of ``S = max_num_seqs`` cache slots for as
long as it runs. Per sparse layer, slot ``s`` owns rows ``s * Hkv .. s * Hkv + Hkv - 1`` of one shared
:class:`~xoffload.kernels.page_cache.PageCacheState` and ``C_max`` pages of one shared row store
``[S * C_max * page_size, Hkv, D]``. Per step and layer, for all rows at once: the store's
selection (:func:`~xoffload.kernels.topk.topk_ids` over the ``[rows x Hkv, N]`` scores with each
row's own page count, the one-request store's selection) takes the policy's reuse bonus on the
pages already cached (:meth:`BatchPageCache.prefer`), then one
:func:`~xoffload.kernels.page_cache.page_cache_lookup_batched` launch and one
:func:`~xoffload.kernels.page_cache.page_cache_fill` launch reading the misses over PCIe. Row ``r``
uses the first ``c_r`` slots of its cache, where ``c_r`` is what
:meth:`~xoffload.sparse.QuestDecode.cache_slots` gives its plan alone, cut to what fits in the GPU
memory left for the call (:meth:`BatchPageCache.slots_that_fit`): uncut, a sequence's cache
evolves exactly as in its one-request run, so with a ``reuse_bias`` it selects the same pages.

FP8 pools (``scales="page"`` / ``"token"``): the row stores hold e4m3 codes and each layer has
fp32 scales beside them in the pool's granularity (``k_scale`` / ``v_scale``: ``[rows / P, Hkv]``
per page, ``[rows, Hkv]`` per token); the fill copies a missed page's scales with its codes
(:func:`~xoffload.kernels.page_cache.page_cache_fill_scales`), so a cached page is read with the
scales it was written with. A fused tail needs token scales (the tail's tokens are quantized one
at a time), so with page scales the store keeps its tail apart.
"""
from __future__ import annotations

import torch

from ..kernels.fp8 import FP8_DTYPE
from ..kernels.page_cache import (MAX_SLOTS, PageCacheState, page_cache_fill, page_cache_fill_scales,
                                  page_cache_lookup_batched)

__all__ = ["BatchPageCache"]


class BatchPageCache:
    """The page caches of a batched call's sequences (module docstring).

    Args:
        num_sparse: sparse layers (one state and row store each).
        num_kv_heads, head_dim: ``Hkv``, ``D``.
        num_seqs: ``S``, sequences that may hold a cache at once (``max_num_seqs``).
        slots: ``C_max``, slots per sequence, KV head and layer (``>= pages_per_step``).
        num_ids: ``Nw``, the call's largest candidate-page count (the width of the scores).
        pages_per_step: ``Kw``, the call's largest pages per step.
        rows: the largest padded batch (row vectors' length).
        page_size: tokens per page.
        reuse_bonus: score bonus of a cached page in the scores' units
            (:meth:`~xoffload.sparse.QuestDecode.reuse_bonus`; 0: none).
        dtype, device: of the row stores.
        tail_rows, tail_pages: with ``tail_rows > 0`` each layer's row store has ``tail_rows``
            more rows after the cache's, handed to the store's GPU tail (:meth:`tail_layers`: the
            sink, recent and generated tokens), and the table ``tail_pages`` more entries per
            row: row ``r``'s tail pages follow its ``k_r`` cached pages (:meth:`set_rows`), so one
            paged attention call over ``[cached pages | tail]`` reads both (no second call and no
            LSE merge).
        scales: None (16-bit rows of ``dtype``), or ``"page"`` / ``"token"``: e4m3 rows with fp32
            scales of that granularity (module docstring; ``"page"`` takes no tail).

    Raises ValueError for ``slots < pages_per_step`` or more than
    :data:`~xoffload.kernels.page_cache.MAX_SLOTS`, or a tail with page scales.
    """

    def __init__(self, num_sparse: int, num_kv_heads: int, head_dim: int, num_seqs: int, slots: int, num_ids: int,
                 pages_per_step: int, rows: int, page_size: int, reuse_bonus: float, dtype, device,
                 tail_rows: int = 0, tail_pages: int = 0, scales: str | None = None):
        if not pages_per_step <= slots <= MAX_SLOTS:
            raise ValueError(f"a batch page cache needs pages_per_step ({pages_per_step}) <= slots ({slots}) <= "
                             f"{MAX_SLOTS}")
        S, hkv, P = int(num_seqs), int(num_kv_heads), int(page_size)
        self.S, self.hkv, self.C, self.P, self.K = S, hkv, int(slots), P, int(pages_per_step)
        self.bonus = float(reuse_bonus)
        # slot S: the padding rows' scratch state (they look nothing up)
        self.state = [PageCacheState((S + 1) * hkv, self.C, max(int(num_ids), 1), device) for _ in range(num_sparse)]
        self.tail_base, self.tail_pages = S * self.C * P, int(tail_pages) if tail_rows else 0
        if scales == "page" and tail_rows:
            raise ValueError("a page cache with page scales keeps no tail rows (the tail's tokens have token scales)")
        self.scales = scales
        self.k = torch.zeros(num_sparse, self.tail_base + int(tail_rows), hkv, head_dim,
                             dtype=FP8_DTYPE if scales else dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = self.v_scale = None
        if scales:
            srows = self.k.shape[1] // (P if scales == "page" else 1)
            self.k_scale = torch.ones(num_sparse, srows, hkv, dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)
        self.hits = torch.zeros(S + 1, 2, dtype=torch.int64, device=device)  # per slot: (hits, lookups)
        self.row_slot = torch.full((rows,), S, dtype=torch.int32, device=device)
        self.row_k = torch.zeros(rows, dtype=torch.int32, device=device)
        self.row_c = torch.ones(rows, dtype=torch.int32, device=device)
        self.row_base = torch.zeros(rows, dtype=torch.int32, device=device)
        self.table = torch.zeros(rows, hkv, max(self.K, 1) + self.tail_pages, dtype=torch.int32, device=device)
        self.src = torch.full((rows, hkv, max(self.K, 1)), -1, dtype=torch.int32, device=device)
        self._free = list(range(S))

    @staticmethod
    def slot_bytes(num_sparse: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
                   scales: str | None = None) -> int:
        """GPU bytes of one slot per sequence: K and V of one page, every sparse layer and KV head
        (fp8: codes and scales)."""
        if scales:
            per_page = page_size * head_dim + 4 * (1 if scales == "page" else page_size)
            return 2 * num_sparse * num_kv_heads * per_page
        el = torch.empty((), dtype=dtype).element_size()
        return 2 * num_sparse * num_kv_heads * page_size * head_dim * el

    @staticmethod
    def slots_that_fit(want: int, num_seqs: int, slot_bytes: int, free_bytes: int | None) -> int:
        """``want`` slots per sequence, or fewer so that ``num_seqs`` caches fit in ``free_bytes``
        (None: no limit)."""
        if free_bytes is None or slot_bytes <= 0:
            return want
        return max(0, min(want, free_bytes // (num_seqs * slot_bytes)))

    @property
    def nbytes(self) -> int:
        """GPU bytes of the cache's rows (K and V, fp8 scales included; a tail's rows are the tail's)."""
        n = 2 * self.k.shape[0] * self.tail_base * self.k[0, 0].numel() * self.k.element_size()
        if self.scales:
            n += 2 * self.k.shape[0] * (self.tail_base // (self.P if self.scales == "page" else 1)) * self.hkv * 4
        return n

    def acquire(self) -> int:
        """A free cache slot for a sequence joining the call, emptied (in place: the captured
        graphs' tensors stay valid). Raises RuntimeError when all ``S`` are held (the scheduler
        admits at most ``max_num_seqs``)."""
        if not self._free:
            raise RuntimeError(f"all {self.S} batch page-cache slots are held")
        s = self._free.pop(0)
        rows = slice(s * self.hkv, (s + 1) * self.hkv)
        for st in self.state:
            st.tag[rows] = -1
            st.slot_of[rows] = -1
            st.clock[rows] = 0
            st.mark[rows] = 0
            st.step[rows] = 0
        self.hits[s] = 0
        return s

    def release(self, slot: int) -> None:
        """Give back a sequence's slot (idempotent)."""
        if 0 <= slot < self.S and slot not in self._free:
            self._free.append(slot)
            self._free.sort()

    def tail_layers(self, layers) -> dict:
        """``{layer: (k, v)}``: the tail rows of the row store of each sparse layer (``layers`` in
        the stores' order), for :class:`~xoffload.kv.base.RowPool`'s ``external``; with token
        scales ``(k, v, k_scale, v_scale)``."""
        b = self.tail_base
        if self.scales:
            return {l: (self.k[i, b:], self.v[i, b:], self.k_scale[i, b:], self.v_scale[i, b:])
                    for i, l in enumerate(layers)}
        return {l: (self.k[i, b:], self.v[i, b:]) for i, l in enumerate(layers)}

    def set_rows(self, entries: list, rows: int, tail_table: torch.Tensor | None = None, tail_block: int = 0) -> None:
        """The batch's rows (host work when the batch changes): ``entries[r] = (slot, k_r, c_r)``
        for the running sequences (``c_r >= k_r``; ``k_r = 0``: the row looks nothing up);
        padding rows up to ``rows`` use the scratch slot. With a tail (``tail_rows``):
        ``tail_table`` int32 ``[rows, pages]`` (host), the first tail row of each of a row's tail
        blocks of ``tail_block`` tokens; row r's tail pages go to table entries ``k_r ..``."""
        from .base import _to_device

        if self.tail_pages:
            P, W = self.P, self.table.shape[2]
            j = torch.arange(self.tail_pages) * P
            ent = tail_table[:, j // tail_block] + j % tail_block + self.tail_base
            tab = torch.zeros(rows, W, dtype=torch.int32)
            for r in range(rows):
                k = entries[r][1] if r < len(entries) else 0
                tab[r, k:k + self.tail_pages] = ent[r]
            _to_device(self.table[:rows], tab[:, None, :].expand(rows, self.hkv, W).contiguous())

        S, C, P = self.S, self.C, self.P
        vec = torch.zeros(4, rows, dtype=torch.int32)
        vec[0].fill_(S)
        vec[2].fill_(1)
        for r, (slot, k, c) in enumerate(entries):
            if k and not k <= c <= C:
                raise ValueError(f"row {r}: pages per step {k} must be <= its slots {c} <= {C}")
            vec[:, r] = torch.tensor([slot, k, max(c, 1), slot * C * P], dtype=torch.int32)
        for dst, src in zip((self.row_slot, self.row_k, self.row_c, self.row_base), vec):
            _to_device(dst[:rows], src)

    def prefer(self, si: int, n: int, nw: int) -> torch.Tensor:
        """int32 ``[n x Hkv, nw]``: the cache slot of each candidate page of the first ``n`` rows in
        sparse layer ``si`` (-1: not cached), the ``prefer`` operand of
        :func:`~xoffload.kernels.topk.topk_ids` with :attr:`bonus`."""
        st = self.state[si]
        return st.slot_of.view(self.S + 1, self.hkv, -1)[self.row_slot[:n], :, :nw].reshape(n * self.hkv, nw)

    def fetch(self, si: int, sel: torch.Tensor, cand_row: torch.Tensor, pool_k: torch.Tensor,
              pool_v: torch.Tensor, n: int, pool_scales=None):
        """Look up and fill sparse layer ``si``'s selected pages for the first ``n`` rows.

        ``sel``: int32 ``[n, Hkv, Kw]``, row r's ``k_r`` chosen candidate ids first, ascending;
        ``cand_row``: int32 ``[n, Nw]`` pool row of each candidate page; ``pool_k`` / ``pool_v``:
        the layer's pool row stores (fp8: codes, with ``pool_scales`` their ``(k_scale,
        v_scale)``). Returns ``(k rows, v rows, table [n, Hkv, Kw])`` for
        :func:`~xoffload.kernels.paged_decode_attn_with_lse` (row r reads its first ``k_r`` pages,
        then its tail's when the store has one); fp8 caches read them with :meth:`scales_of`."""
        st, tab = self.state[si], self.table[:n, :, :self.src.shape[2]]
        page_cache_lookup_batched(sel, st, self.row_slot[:n], self.row_k[:n], self.row_c[:n], self.row_base[:n],
                                  cand_row, tab, self.src[:n], page_size=self.P, hits=self.hits)
        if self.scales:  # the codes, then the same pages' scales
            page_cache_fill(pool_k, pool_v, self.k[si], self.v[si], self.src[:n], tab, page_size=self.P)
            page_cache_fill_scales(pool_scales[0], pool_scales[1], self.k_scale[si], self.v_scale[si], self.src[:n],
                                   tab, page_size=self.P, granularity=self.scales)
        else:
            page_cache_fill(pool_k, pool_v, self.k[si], self.v[si], self.src[:n], tab, page_size=self.P)
        return self.k[si], self.v[si], self.table[:n]

    def scales_of(self, si: int) -> tuple:
        """fp8 caches: ``(k_scale, v_scale)`` of sparse layer ``si``'s rows (None, None otherwise)."""
        if not self.scales:
            return None, None
        return self.k_scale[si], self.v_scale[si]

    def counts(self, slot: int) -> tuple:
        """``(hits, lookups)`` of the sequence in ``slot`` so far (reads the device counters)."""
        h, n = (int(x) for x in self.hits[slot].tolist())
        return h, n

    def close(self) -> None:
        self.state = []
        self.k = self.v = self.k_scale = self.v_scale = None

