"""GPU page cache for sparse decode over offloaded KV: look up the selected pages, assign cache slots
to the misses, and copy only the misses out of pinned host memory.

(Over 450 lines on purpose: the cache's state, its lookup kernel — one request and a batch, one
kernel with a constexpr — with the reference of each, and the fill all read one state layout.)

Sparse decode (Quest, Tang et al. 2024) picks ``K`` pages per KV head and step; consecutive steps
pick mostly the same pages (ShadowKV, Sun et al. 2024, reports ~60% reuse and caches recently
fetched chunks on the GPU). Each KV head of a layer has ``C >= K`` cache slots of ``page_size``
token rows in a GPU row store ``[R, Hkv, D]`` (slot ``s`` of head ``h`` is rows
``base + s*page_size ..`` in column ``h``), and three small int32 state tensors:

* ``tag`` ``[Hkv, C]``: page id held by each slot (-1: empty);
* ``slot_of`` ``[Hkv, n_ids]``: slot holding each page id (-1: not cached);
* ``clock`` ``[Hkv]``: the replacement hand;

and the lookup's scratch (``mark`` ``[Hkv, C]``, ``step`` ``[Hkv]``, ``free`` ``[Hkv, C]``: see
:class:`PageCacheState`).

:func:`page_cache_lookup` (one program per KV head, no host work: CUDA-graph safe) marks the hits,
gives each miss the next slot after the hand that no hit of this step holds (CLOCK replacement
with this step's hits as the reference bits: a page chosen every step is never evicted), updates
the state, and writes the cache page table (for :func:`xoffload.kernels.paged_decode_attn_with_lse`
over the cache) and the pool row to copy for each miss. :func:`page_cache_fill` then copies the
missed pages into their slots, reading pinned host memory directly over PCIe (UVA).

:func:`page_cache_lookup_batched` does the lookup for every row of a decode batch in one launch
(each sequence with its own state rows, slots and base in one shared state); the fill takes the
batch's ``[n, Hkv, K]`` lists as they are.

On CPU tensors both run PyTorch references unless Triton's interpreter is on.

(Over 450 lines on purpose: the one-request and batched lookups share one kernel and one
per-head reference, so that a sequence's cache evolves identically in both.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import HostPtr, check_int, check_pow2, check_tensor, device_can_read_host, next_pow2, use_triton

__all__ = ["MAX_SLOTS", "PageCacheState", "page_cache_fill", "page_cache_fill_scales", "page_cache_lookup",
           "page_cache_lookup_batched"]


class PageCacheState:
    """The replacement state of one layer's page cache (see the module docstring).

    Args:
        num_kv_heads: ``Hkv``.
        num_slots: ``C``, slots per KV head (at most :data:`MAX_SLOTS`).
        num_ids: page ids per KV head (``0 <= id < num_ids``).
        device: where the state lives (the cache's device).

    Attributes: ``tag`` int32 ``[Hkv, C]``, ``slot_of`` int32 ``[Hkv, num_ids]``, ``clock`` int32
    ``[Hkv]``; the lookup kernel's scratch: ``mark`` int32 ``[Hkv, C]`` (the step at which a hit
    last held each slot), ``step`` int32 ``[Hkv]`` (lookups so far) and ``free`` int32 ``[Hkv, C]``.
    :meth:`reset` empties the cache (a new request).
    Raises ValueError for a count below 1 or more than :data:`MAX_SLOTS` slots.
    """

    def __init__(self, num_kv_heads: int, num_slots: int, num_ids: int, device):
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("num_slots", num_slots, 1, MAX_SLOTS)
        check_int("num_ids", num_ids, 1)
        self.tag = torch.full((num_kv_heads, num_slots), -1, dtype=torch.int32, device=device)
        self.slot_of = torch.full((num_kv_heads, num_ids), -1, dtype=torch.int32, device=device)
        self.clock = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)
        self.mark = torch.zeros(num_kv_heads, num_slots, dtype=torch.int32, device=device)
        self.step = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)
        self.free = torch.zeros(num_kv_heads, num_slots, dtype=torch.int32, device=device)

    @property
    def num_slots(self) -> int:
        """Cache slots per KV head (``C``)."""
        return self.tag.shape[1]

    def reset(self) -> None:
        """Empty the cache (every slot free, clocks at 0) in place: the tensors a captured CUDA
        graph holds stay valid."""
        self.tag.fill_(-1)
        self.slot_of.fill_(-1)
        self.clock.zero_()
        self.mark.zero_()
        self.step.zero_()


#: most cache slots per KV head (the lookup holds a head's slots in one program's registers)
MAX_SLOTS = 16384


# ----------------------------------------------------------------------------------------------
# lookup
# ----------------------------------------------------------------------------------------------
# per-request integers are not specialised: no new compiled variant per prompt length (and K == 1
# stays a tensor, not a constexpr)
@triton.jit(do_not_specialize=["K", "C", "NID", "first_page", "block_size", "base", "CS", "KW"])
def _lookup_kernel(Pages, BT, Tag, SlotOf, Clock, Mark, Step, Free, Table, Src, Hits,
                   RowSlot, RowK, RowC, RowBase, CandRow,
                   K, C, NID, first_page, block_size, base, CS, KW,
                   s_ph, s_th, s_cr,
                   HKV: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                   HAS_BT: tl.constexpr, HAS_HITS: tl.constexpr, BATCHED: tl.constexpr):
    """One program per KV head ``h`` (``BATCHED``: per batch row ``r`` and KV head ``h``, the row's
    count, slots, base and state rows read from the ``Row*`` vectors): hits, CLOCK victims for the
    misses, state update, outputs. O(K + C) work: the hits stamp their slots in ``Mark`` with this
    lookup's step, the slots no hit holds are listed in replacement order in ``Free``, and the r-th
    miss takes ``Free[r]``. ``CS`` / ``NID``: the state's row strides; ``C``: the slots in use."""
    if BATCHED:
        r = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(RowSlot + r)
        K = tl.load(RowK + r)
        C = tl.load(RowC + r)
        base = tl.load(RowBase + r)
        st = seq * HKV + h  # the state row of (sequence slot, head)
        o = r * HKV + h  # the output row
    else:
        h = tl.program_id(0)
        st = h
        o = h
    kk = tl.arange(0, BLOCK_K)
    mk = kk < K
    cc = tl.arange(0, BLOCK_C)
    mc = cc < C
    pg = tl.load(Pages + o * s_ph + kk, mask=mk, other=0).to(tl.int32)
    pg = tl.minimum(tl.maximum(pg, 0), NID - 1)
    sl = tl.load(SlotOf + st * NID + pg, mask=mk, other=-1)
    hit = mk & (sl >= 0)
    miss = mk & (sl < 0)
    stamp = tl.load(Step + st) + 1
    tl.store(Step + st, stamp)
    tl.store(Mark + st * CS + sl, tl.full([BLOCK_K], 0, tl.int32) + stamp, mask=hit)
    hand = tl.load(Clock + st)
    tl.debug_barrier()
    rc = (cc + hand) % C  # slots in replacement order, starting at the hand
    held = tl.load(Mark + st * CS + rc, mask=mc, other=0) == stamp
    elig = mc & (held == 0)
    csum = tl.cumsum(elig.to(tl.int32), axis=0)  # eligible slots up to and including each position
    nmiss = tl.sum(miss.to(tl.int32), axis=0)
    tl.store(Free + st * CS + csum - 1, rc, mask=elig & (csum <= nmiss))
    last = tl.sum(tl.where(elig & (csum == nmiss), cc, 0), axis=0)
    rank = tl.cumsum(miss.to(tl.int32), axis=0)  # 1-based rank of each miss
    tl.debug_barrier()
    vic = tl.load(Free + st * CS + rank - 1, mask=miss, other=0)
    old = tl.load(Tag + st * CS + vic, mask=miss, other=-1)
    tl.debug_barrier()
    tl.store(SlotOf + st * NID + old, tl.full([BLOCK_K], -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(Tag + st * CS + vic, pg, mask=miss)
    tl.store(SlotOf + st * NID + pg, vic, mask=miss)
    tl.store(Clock + st, tl.where(nmiss > 0, (hand + last + 1) % C, hand))
    slot = tl.where(hit, sl, vic)
    tl.store(Table + o * s_th + kk, base + slot * PAGE, mask=mk)
    if BATCHED:  # the row's candidate -> pool row map
        row = tl.load(CandRow + r * s_cr + pg, mask=mk, other=0)
    else:
        tok = (pg + first_page) * PAGE
        if HAS_BT:
            row = tl.load(BT + tok // block_size, mask=mk, other=0) * block_size + tok % block_size
        else:
            row = tok
    # every entry up to KW: -1 for a hit and (batched) past the row's count, so the fill skips them
    tl.store(Src + o * KW + kk, tl.where(hit | (kk >= K), -1, row), mask=kk < KW)
    if HAS_HITS:
        if BATCHED:
            hp = Hits + seq * 2  # per sequence slot: (hits, lookups)
        else:
            hp = Hits
        tl.atomic_add(hp, tl.sum(hit.to(tl.int64), axis=0))
        tl.atomic_add(hp + 1, K.to(tl.int64))


def _lookup_head(st, i: int, pages: torch.Tensor, C: int):
    """Reference of one KV head's lookup on state row ``i`` using its first ``C`` slots (the
    kernel's replacement rule); updates the state, returns (slot per page, hit mask, clamped ids)."""
    nid = st.slot_of.shape[1]
    pg = pages.long().clamp(0, nid - 1)
    sl = st.slot_of[i, pg].long()
    hit = sl >= 0
    hand = int(st.clock[i])
    held = set(sl[hit].tolist())
    order = [(hand + j) % C for j in range(C)]
    free = [s for s in order if s not in held]
    vic = torch.zeros(pg.numel(), dtype=torch.long)
    j_miss = (~hit).nonzero().flatten().tolist()
    for r, j in enumerate(j_miss):
        s = free[r]
        vic[j] = s
        old = int(st.tag[i, s])
        if old >= 0:
            st.slot_of[i, old] = -1
    for j in j_miss:
        st.tag[i, vic[j]] = int(pg[j])
        st.slot_of[i, pg[j]] = int(vic[j])
    if j_miss:
        st.clock[i] = (order.index(free[len(j_miss) - 1]) + hand + 1) % C
    return torch.where(hit, sl, vic), hit, pg


def _lookup_ref(pages, bt, st, table, src, hits, first_page, page_size, block_size, base):
    """PyTorch reference of the lookup kernel (same replacement rule)."""
    hkv, k = pages.shape
    n_hits = 0
    for h in range(hkv):
        slot, hit, pg = _lookup_head(st, h, pages[h], st.num_slots)
        n_hits += int(hit.sum())
        table[h].copy_((base + slot * page_size).to(table.dtype))
        tok = (pg + first_page) * page_size
        row = tok if bt is None else bt.long()[tok // block_size] * block_size + tok % block_size
        src[h].copy_(torch.where(hit, torch.full_like(row, -1), row).to(src.dtype))
    if hits is not None:
        hits[0] += n_hits
        hits[1] += hkv * k


def _lookup_batched_ref(pages, st, row_slot, row_k, row_c, row_base, cand_row, table, src, hits, page_size):
    """PyTorch reference of the batched lookup (:func:`_lookup_head` per row and KV head)."""
    n, hkv, kw = pages.shape
    src.fill_(-1)
    for r in range(n):
        s, k, C, base = int(row_slot[r]), int(row_k[r]), int(row_c[r]), int(row_base[r])
        if k == 0:
            continue
        for h in range(hkv):
            slot, hit, pg = _lookup_head(st, s * hkv + h, pages[r, h, :k], C)
            table[r, h, :k] = (base + slot * page_size).to(table.dtype)
            row = cand_row[r].long()[pg]
            src[r, h, :k] = torch.where(hit, torch.full_like(row, -1), row).to(src.dtype)
            if hits is not None:
                hits[s, 0] += int(hit.sum())
                hits[s, 1] += k


def page_cache_lookup(pages: torch.Tensor, state: PageCacheState, table: torch.Tensor, src: torch.Tensor, *,
                      first_page: int, page_size: int, base: int = 0, block_table: torch.Tensor | None = None,
                      block_size: int = 0, hits: torch.Tensor | None = None) -> None:
    """Look up this step's selected pages in a layer's GPU page cache and assign slots to the misses.

    Args:
        pages: int32/int64 ``[Hkv, K]`` selected page ids per KV head, distinct within a row and
            in ``[0, state.slot_of.shape[1])``, e.g. the indices of ``topk`` over the candidate
            pages. Not checked on the device: ids outside are clamped (memory safety only), and a
            repeated id (or two that clamp to one) may take two slots and leave ``tag`` /
            ``slot_of`` out of step — a wasted slot, never wrong data (a page not found is
            copied again).
        state: the layer's :class:`PageCacheState` (``C >= K`` slots), updated in place.
        table: int32 view ``[Hkv, K]`` (last dim contiguous) written with the cache row of the
            first token of each page (``base + slot * page_size``): the page table of the attention
            over the cache.
        src: int32 ``[Hkv, K]`` contiguous, written with the pool row of each missed page's first
            token and -1 for a hit (what :func:`page_cache_fill` copies).
        first_page: page id 0's logical page in the sequence (token ``(id + first_page) * page_size``).
        page_size: tokens per page (power of two >= 16).
        base: first cache row of slot 0 (rows below it hold something else, e.g. a resident tail).
        block_table: int32 ``[n_blocks]`` physical pool block of each logical block of the
            sequence (pool rows ``block * block_size + offset``), or None: rows are token indices.
        block_size: tokens per pool block (a multiple of ``page_size``) when ``block_table`` is given.
        hits: optional int64 ``[2]`` counters: ``hits[0]`` += the hits, ``hits[1]`` += the
            lookups (``Hkv * K``).

    Runs on the current stream, no host synchronisation (CUDA-graph safe).
    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices, ``C < K``, a block size that is
            not a multiple of the page size.
    """
    check_tensor("pages", pages, 2, dtypes=(torch.int32, torch.int64))
    hkv, k = pages.shape
    C, nid = state.num_slots, state.slot_of.shape[1]
    if state.tag.shape[0] != hkv:
        raise ValueError(f"pages has {hkv} KV heads but the cache state has {state.tag.shape[0]}")
    if k > C:
        raise ValueError(f"{k} pages per KV head do not fit a cache of {C} slots (need num_slots >= K)")
    check_tensor("table", table, 2, dtypes=(torch.int32,))
    check_tensor("src", src, 2, dtypes=(torch.int32,))
    for n, t in (("table", table), ("src", src)):
        if tuple(t.shape) != (hkv, k):
            raise ValueError(f"{n} must be [{hkv}, {k}], got {tuple(t.shape)}")
        if t.device != pages.device:
            raise ValueError(f"{n} is on {t.device}, pages on {pages.device}")
    if table.stride(1) != 1 or not src.is_contiguous():
        raise ValueError("table must have a contiguous last dim and src must be contiguous")
    if pages.stride(1) != 1:
        pages = pages.contiguous()
    page_size = check_pow2("page_size", page_size, 16)
    first_page = check_int("first_page", first_page, 0)
    base = check_int("base", base, 0)
    if block_table is not None:
        check_tensor("block_table", block_table, 1, dtypes=(torch.int32,))
        block_size = check_int("block_size", block_size, 1)
        if block_size % page_size:
            raise ValueError(f"block_size {block_size} must be a multiple of page_size {page_size}")
    if hits is not None:
        check_tensor("hits", hits, 1, dtypes=(torch.int64,))
        if hits.numel() != 2:
            raise ValueError(f"hits must be int64 [2] (hits, lookups), got shape {tuple(hits.shape)}")
    if k == 0:
        return
    if not use_triton(pages):
        _lookup_ref(pages, block_table, state, table, src, hits, first_page, page_size, block_size, base)
        return
    block_c = max(16, next_pow2(C))
    _lookup_kernel[(hkv,)](
        pages, block_table if block_table is not None else src, state.tag, state.slot_of, state.clock,
        state.mark, state.step, state.free, table, src, hits if hits is not None else src,
        src, src, src, src, src,
        k, C, nid, first_page, max(block_size, 1), base, C, k, pages.stride(0), table.stride(0), 0,
        HKV=hkv, PAGE=page_size, BLOCK_K=max(16, next_pow2(k)), BLOCK_C=block_c,
        HAS_BT=block_table is not None, HAS_HITS=hits is not None, BATCHED=False,
        num_warps=4 if block_c <= 2048 else 8,
    )


def page_cache_lookup_batched(pages: torch.Tensor, state: PageCacheState, row_slot: torch.Tensor,
                              row_k: torch.Tensor, row_c: torch.Tensor, row_base: torch.Tensor,
                              cand_row: torch.Tensor, table: torch.Tensor, src: torch.Tensor, *, page_size: int,
                              hits: torch.Tensor | None = None) -> None:
    """:func:`page_cache_lookup` for every row of a decode batch in one launch: each row is a
    sequence with its own cache (state rows, slots, base) in one layer's shared state and row store.

    Sequence slot ``s`` owns state rows ``s * Hkv .. s * Hkv + Hkv - 1`` of ``state`` (a
    :class:`PageCacheState` of ``S * Hkv`` rows and ``C_max`` slots); row ``r`` looks up its first
    ``row_k[r]`` pages in the first ``row_c[r]`` slots of slot ``row_slot[r]``'s rows, with the
    same replacement rule as the one-request lookup (so a sequence's cache evolves as it would
    alone with ``C = row_c[r]``).

    Args:
        pages: int32/int64 ``[n, Hkv, Kw]`` (last dim contiguous): row r's selected candidate ids
            per KV head in its first ``row_k[r]`` entries, distinct (ascending, to match the
            one-request lookup's slot order); the rest are ignored.
        state: the layer's shared state, ``S * Hkv`` rows.
        row_slot: int32 ``[n]`` sequence slot of each row (rows of one step: distinct slots, but
            rows with ``row_k == 0`` — padding — may share one).
        row_k: int32 ``[n]`` pages per KV head of each row (``<= Kw``; 0: the row looks nothing up).
        row_c: int32 ``[n]`` slots in use per KV head, ``row_k[r] <= row_c[r] <= C_max``.
        row_base: int32 ``[n]`` cache row of slot 0 of each row's sequence.
        cand_row: int32 ``[n, Nw]`` (last dim contiguous) pool row of the first token of each
            candidate page (what a miss copies from).
        table: int32 ``[n, Hkv, Kw]`` (last dim contiguous) written with ``row_base + slot *
            page_size`` for the first ``row_k[r]`` entries (the rest are left as they were).
        src: int32 ``[n, Hkv, Kw]`` contiguous, written with the pool row of each miss and -1 for
            a hit and past ``row_k[r]`` (what :func:`page_cache_fill` copies).
        page_size: tokens per page (power of two >= 16).
        hits: optional int64 ``[S, 2]``: per sequence slot, ``+= (hits, lookups)``.

    The per-row counts are not checked on the device (a host check would synchronise); out-of-range
    ids are clamped as in :func:`page_cache_lookup`. Runs on the current stream, CUDA-graph safe.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices, ``Kw > C_max``, state rows that
            are not a multiple of ``Hkv``.
    """
    check_tensor("pages", pages, 3, dtypes=(torch.int32, torch.int64))
    n, hkv, kw = pages.shape
    rows, cmax = state.tag.shape
    if rows % hkv:
        raise ValueError(f"the cache state has {rows} rows, not a multiple of the {hkv} KV heads of pages")
    if kw > cmax:
        raise ValueError(f"{kw} pages per KV head do not fit a cache of {cmax} slots (need num_slots >= Kw)")
    for name, t in (("row_slot", row_slot), ("row_k", row_k), ("row_c", row_c), ("row_base", row_base)):
        check_tensor(name, t, 1, dtypes=(torch.int32,))
        if t.shape[0] != n:
            raise ValueError(f"{name} must be [{n}] (one entry per row), got {tuple(t.shape)}")
    check_tensor("cand_row", cand_row, 2, dtypes=(torch.int32,))
    if cand_row.shape[0] != n or cand_row.stride(1) != 1:
        raise ValueError(f"cand_row must be [{n}, Nw] with a contiguous last dim, got {tuple(cand_row.shape)}")
    for name, t in (("table", table), ("src", src)):
        check_tensor(name, t, 3, dtypes=(torch.int32,))
        if tuple(t.shape) != (n, hkv, kw):
            raise ValueError(f"{name} must be [{n}, {hkv}, {kw}], got {tuple(t.shape)}")
    if table.stride(2) != 1 or table.stride(0) != hkv * table.stride(1):
        raise ValueError(f"table must have a contiguous last dim and rows of Hkv times its head stride, got strides "
                         f"{tuple(table.stride())}")
    if not src.is_contiguous():
        raise ValueError(f"src must be contiguous, got strides {tuple(src.stride())}")
    for name, t in (("state", state.tag), ("row_slot", row_slot), ("row_k", row_k), ("row_c", row_c),
                    ("row_base", row_base), ("cand_row", cand_row), ("table", table), ("src", src)):
        if t.device != pages.device:
            raise ValueError(f"{name} is on {t.device}, pages on {pages.device}")
    page_size = check_pow2("page_size", page_size, 16)
    if hits is not None:
        check_tensor("hits", hits, 2, dtypes=(torch.int64,))
        if hits.device != pages.device:
            raise ValueError(f"hits is on {hits.device}, pages on {pages.device}")
        if tuple(hits.shape) != (rows // hkv, 2):
            raise ValueError(f"hits must be int64 [{rows // hkv}, 2] (per sequence slot), got {tuple(hits.shape)}")
    if n == 0 or kw == 0:
        return
    if pages.stride(2) != 1 or pages.stride(0) != hkv * pages.stride(1):
        pages = pages.contiguous()
    if not use_triton(pages):
        _lookup_batched_ref(pages, state, row_slot, row_k, row_c, row_base, cand_row, table, src, hits, page_size)
        return
    block_c = max(16, next_pow2(cmax))
    _lookup_kernel[(n, hkv)](
        pages, src, state.tag, state.slot_of, state.clock, state.mark, state.step, state.free, table, src,
        hits if hits is not None else src, row_slot, row_k, row_c, row_base, cand_row,
        kw, cmax, state.slot_of.shape[1], 0, 1, 0, cmax, kw, pages.stride(1), table.stride(1), cand_row.stride(0),
        HKV=hkv, PAGE=page_size, BLOCK_K=max(16, next_pow2(kw)), BLOCK_C=block_c,
        HAS_BT=False, HAS_HITS=hits is not None, BATCHED=True, num_warps=4 if block_c <= 2048 else 8,
    )


# ----------------------------------------------------------------------------------------------
# fill
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["K"])
def _fill_kernel(SK, SV, DK, DV, Src, Table, K, D,
                 s_sr, s_sh, s_dr, s_dh, s_th,
                 HKV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, j, chunk): rows ``chunk*BLOCK_R ..`` of missed page j of list row i (KV head
    ``i % HKV``; a batch's rows are ``[row, head]`` flattened)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    c = tl.program_id(2)
    h = i % HKV
    s = tl.load(Src + i * K + j)
    if s >= 0:
        d = tl.load(Table + i * s_th + j).to(tl.int64)
        r = c * BLOCK_R + tl.arange(0, BLOCK_R)
        od = tl.arange(0, BLOCK_D)
        m = od[None, :] < D
        so = (s.to(tl.int64) + r)[:, None] * s_sr + h * s_sh + od[None, :]
        do = (d + r)[:, None] * s_dr + h * s_dh + od[None, :]
        tl.store(DK + do, tl.load(SK + so, mask=m), mask=m)
        tl.store(DV + do, tl.load(SV + so, mask=m), mask=m)


def page_cache_fill(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                    src: torch.Tensor, table: torch.Tensor, *, page_size: int) -> None:
    """Copy the missed pages that :func:`page_cache_lookup` listed into their cache slots.

    Args:
        src_k, src_v: row stores ``[R, Hkv, D]`` of one layer (the pool: pinned host memory read
            over PCIe by the GPU kernel, or device memory); last dim contiguous. fp16/bf16/fp32,
            or ``float8_e4m3fn`` codes (their scales: :func:`page_cache_fill_scales`).
        dst_k, dst_v: the cache row stores ``[R_c, Hkv, D]`` on the GPU (same dtype, Hkv, D).
        src: int32 ``[Hkv, K]``: pool row of each page to copy, -1 to skip (a hit); or ``[n, Hkv,
            K]`` for a batch (:func:`page_cache_lookup_batched`), contiguous.
        table: int32 ``[Hkv, K]`` / ``[n, Hkv, K]`` (last dim contiguous, rows of ``Hkv`` times
            its head stride): cache row of each page.
        page_size: tokens per page.

    Rows are not range-checked on the device (the lookup wrote them). Runs on the current stream.
    Raises TypeError / ValueError for mismatched shapes, dtypes or devices, and for a host source
    that is not pinned.
    """
    for n, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        check_tensor(n, t, 3, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn))
        if t.stride(2) != 1:
            raise ValueError(f"{n} must have a contiguous last dim, got strides {tuple(t.stride())}")
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape or src_k.shape[1:] != dst_k.shape[1:]:
        raise ValueError(f"row stores do not match: src {tuple(src_k.shape)}/{tuple(src_v.shape)}, "
                         f"dst {tuple(dst_k.shape)}/{tuple(dst_v.shape)}")
    if len({src_k.dtype, src_v.dtype, dst_k.dtype, dst_v.dtype}) != 1:
        raise TypeError(f"row stores must share one dtype, got {src_k.dtype}, {src_v.dtype}, {dst_k.dtype}, {dst_v.dtype}")
    check_tensor("src", src, 3 if isinstance(src, torch.Tensor) and src.dim() == 3 else 2, dtypes=(torch.int32,))
    check_tensor("table", table, 3 if src.dim() == 3 else 2, dtypes=(torch.int32,))
    if src.dim() == 3:  # a batch: [n, Hkv, K] -> [n * Hkv, K]
        if tuple(table.shape) != tuple(src.shape):
            raise ValueError(f"batched src {tuple(src.shape)} and table {tuple(table.shape)} must have one shape")
        if not src.is_contiguous():
            raise ValueError(f"batched src must be contiguous, got strides {tuple(src.stride())}")
        if table.stride(0) != table.shape[1] * table.stride(1):
            raise ValueError(f"batched table rows must be Hkv times its head stride, got strides {tuple(table.stride())}")
        if src.shape[1] != dst_k.shape[1]:
            raise ValueError(f"src {tuple(src.shape)} and table {tuple(table.shape)} must be [n, Hkv={dst_k.shape[1]}, K]")
        src, table = src.flatten(0, 1), table.flatten(0, 1)
    hkv = dst_k.shape[1]
    nr, k = src.shape
    if tuple(table.shape) != (nr, k) or nr % hkv:
        raise ValueError(f"src {tuple(src.shape)} and table {tuple(table.shape)} must be [Hkv={hkv}, K] "
                         f"(or [n, Hkv, K])")
    page_size = check_pow2("page_size", page_size, 16)
    host = dst_k.is_cuda and not src_k.is_cuda
    if host:
        for n, t in (("src_k", src_k), ("src_v", src_v)):
            if not device_can_read_host(t):
                raise ValueError(f"{n} is a host tensor that is not pinned; the GPU reads host memory only through UVA")
    elif src_k.device != dst_k.device:
        raise ValueError(f"src_k is on {src_k.device}, dst_k on {dst_k.device}")
    if k == 0:
        return
    if dst_k.dtype == torch.float8_e4m3fn:  # e4m3 codes move as bytes
        src_k, src_v, dst_k, dst_v = (t.view(torch.uint8) for t in (src_k, src_v, dst_k, dst_v))
    if not use_triton(dst_k):  # one indexed copy of every missed row (no per-page loop)
        miss = (src >= 0).to(dst_k.device)
        r = torch.arange(page_size, device=dst_k.device)
        rows_s = (src.to(dst_k.device).long()[..., None] + r)[miss]  # [misses, P]
        rows_d = (table.to(dst_k.device).long()[..., None] + r)[miss]
        heads = (torch.arange(nr, device=dst_k.device) % hkv)[:, None, None].expand(nr, k, page_size)[miss]
        dst_k[rows_d, heads] = src_k[rows_s.to(src_k.device), heads.to(src_k.device)].to(dst_k.device)
        dst_v[rows_d, heads] = src_v[rows_s.to(src_v.device), heads.to(src_v.device)].to(dst_v.device)
        return
    d = dst_k.shape[2]
    block_r = min(next_pow2(page_size), max(1, 8192 // next_pow2(d)))
    sk = HostPtr(src_k) if host else src_k
    sv = HostPtr(src_v) if host else src_v
    grid = (nr, k, triton.cdiv(page_size, block_r))
    _fill_kernel[grid](sk, sv, dst_k, dst_v, src, table, k, d,
                       src_k.stride(0), src_k.stride(1), dst_k.stride(0), dst_k.stride(1), table.stride(0),
                       HKV=hkv, BLOCK_R=block_r, BLOCK_D=next_pow2(d), num_warps=4)


@triton.jit(do_not_specialize=["K"])
def _fill_scales_kernel(SK, SV, DK, DV, Src, Table, K, s_sr, s_dr, s_th,
                        HKV: tl.constexpr, DIV: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j): the scales of missed page j of list row i (KV head ``i % HKV``): ``ROWS``
    scale rows from ``src // DIV`` to ``table // DIV`` (page scales: DIV = P, ROWS = 1; token
    scales: DIV = 1, ROWS = P)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    h = i % HKV
    s = tl.load(Src + i * K + j)
    if s >= 0:
        d = tl.load(Table + i * s_th + j).to(tl.int64)
        r = tl.arange(0, BLOCK)
        m = r < ROWS
        so = (s.to(tl.int64) // DIV + r) * s_sr + h
        do = (d // DIV + r) * s_dr + h
        tl.store(DK + do, tl.load(SK + so, mask=m), mask=m)
        tl.store(DV + do, tl.load(SV + so, mask=m), mask=m)


def page_cache_fill_scales(src_ks: torch.Tensor, src_vs: torch.Tensor, dst_ks: torch.Tensor, dst_vs: torch.Tensor,
                           src: torch.Tensor, table: torch.Tensor, *, page_size: int, granularity: str) -> None:
    """The fp32 scales of the pages :func:`page_cache_fill` copies (fp8 row stores): call it with
    the same ``src`` / ``table`` so that each copied page's scales land beside its codes.

    Args:
        src_ks, src_vs: the pool's scales of one layer, contiguous fp32: ``[R / page_size, Hkv]``
            (``granularity="page"``: a scale per page and KV head) or ``[R, Hkv]`` (``"token"``);
            pinned host memory (read over UVA) or device memory.
        dst_ks, dst_vs: the cache's scales in the same granularity, contiguous fp32 on the GPU
            (or the CPU).
        src, table: as :func:`page_cache_fill` (rows of the codes: multiples of ``page_size``).
        page_size: tokens per page; granularity: ``"page"`` or ``"token"``.

    Raises TypeError / ValueError for non-fp32 or non-contiguous scales, mismatched heads, a bad
    granularity, or a host source that is not pinned.
    """
    if granularity not in ("page", "token"):
        raise ValueError(f"granularity must be 'page' or 'token', got {granularity!r}")
    for n, t in (("src_ks", src_ks), ("src_vs", src_vs), ("dst_ks", dst_ks), ("dst_vs", dst_vs)):
        check_tensor(n, t, 2, dtypes=(torch.float32,))
        if not t.is_contiguous():
            raise ValueError(f"{n} must be contiguous, got strides {tuple(t.stride())}")
    hkv = dst_ks.shape[1]
    if src_ks.shape[1] != hkv or src_vs.shape != src_ks.shape or dst_vs.shape != dst_ks.shape:
        raise ValueError(f"scale stores do not match: src {tuple(src_ks.shape)}/{tuple(src_vs.shape)}, "
                         f"dst {tuple(dst_ks.shape)}/{tuple(dst_vs.shape)}")
    if src.dim() == 3:
        src, table = src.flatten(0, 1), table.flatten(0, 1)
    nr, k = src.shape
    page_size = check_int("page_size", page_size, 1)
    div, rows = (page_size, 1) if granularity == "page" else (1, page_size)
    host = dst_ks.is_cuda and not src_ks.is_cuda
    if host:
        for n, t in (("src_ks", src_ks), ("src_vs", src_vs)):
            if not device_can_read_host(t):
                raise ValueError(f"{n} is a host tensor that is not pinned; the GPU reads host memory only through UVA")
    if k == 0 or nr == 0:
        return
    if not use_triton(dst_ks):
        dev = dst_ks.device
        miss = (src >= 0).to(dev)
        r = torch.arange(rows, device=dev)
        rows_s = (src.to(dev).long().clamp(min=0) // div)[..., None] + r
        rows_d = (table.to(dev).long() // div)[..., None] + r
        heads = (torch.arange(nr, device=dev) % hkv)[:, None, None].expand(nr, k, rows)
        rows_s, rows_d, heads = rows_s[miss], rows_d[miss], heads[miss]
        dst_ks[rows_d, heads] = src_ks[rows_s.to(src_ks.device), heads.to(src_ks.device)].to(dev)
        dst_vs[rows_d, heads] = src_vs[rows_s.to(src_vs.device), heads.to(src_vs.device)].to(dev)
        return
    sk = HostPtr(src_ks) if host else src_ks
    sv = HostPtr(src_vs) if host else src_vs
    _fill_scales_kernel[(nr, k)](sk, sv, dst_ks, dst_vs, src, table, k, src_ks.stride(0), dst_ks.stride(0),
                                 table.stride(0), HKV=hkv, DIV=div, ROWS=rows, BLOCK=next_pow2(rows), num_warps=1)
