"""PrefixCache: reuse of KV blocks across sequences by token prefix (automatic prefix caching).

Each cached **full** block is keyed by a chained hash ``block_hash(parent_hash, its block_size token
ids)`` (the parent being the entry of the block before it; the first block's parent hash is
:data:`ROOT_HASH`), as vLLM's automatic prefix caching does; the entry also keeps its tokens and its
parent entry, so a hash collision is a miss, never a wrong reuse. A registered sequence's partly
filled **last** block is kept too, keyed by (parent entry, its tokens). Every entry holds one
reference on its physical block (:meth:`BlockAllocator.retain`), so the block's KV stays in the pool
after the sequences that wrote it are freed.

``match`` walks full blocks from the first one, then takes, among the cached children (full or
partial) of the last matched block, the one sharing the longest common prefix with the remaining
ids (any length >= 1, since the KV of a token depends only on the tokens up to it). A sequence
started on such a partly used block copies it before writing into it (the engine's copy-on-write).

Eviction (installed as the allocator's evictor): when an allocation finds too few free blocks,
least-recently-used entries are dropped, leaf-first (an entry with cached children is never dropped
before them), and only entries whose block no live sequence holds; a block goes back to the free
list when its last reference goes. If not enough can be freed, nothing is evicted and the
allocation raises PoolExhaustedError naming needed / free / held by sequences / held by the cache.

Typical use (token ids are the caller's; KV must have been written for them)::

    cache = PrefixCache(eng)
    seq, n = cache.add_sequence(prompt_ids[:-1])   # n tokens' KV reused; prefill prompt_ids[n:]
    ... prefill / decode seq ...
    cache.insert(seq, ids_with_kv)                 # register its blocks for later requests
    eng.free(seq)                                  # the cache keeps the blocks it registered
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels.checks import check_int

ROOT_HASH = 0x5EED_0F_F1_0AD  # parent hash of a sequence's first block


def block_hash(parent_hash: int, tokens) -> int:
    """Chained hash of one full block: ``hash((parent_hash, bytes of its int64 token ids))``.
    Stable within a process (bytes hashing is salted per process)."""
    return hash((parent_hash, array("q", tokens).tobytes()))


class PrefixMatch(NamedTuple):
    """Result of :meth:`PrefixCache.match`.

    blocks: physical block ids (token order) holding the first ``n_tokens`` tokens' KV; the last
        one may be partly used (``n_tokens % block_size`` tokens of it), then it is shared
        read-only and copied by the engine before a write.
    n_tokens: tokens whose KV is reused (0 = nothing matched, ``blocks == ()``).
    """
    blocks: tuple
    n_tokens: int


@dataclass
class CacheStats:
    """Counters of a :class:`PrefixCache` (tokens are token counts, not blocks).

    queries: ``match`` calls. hits: tokens found (reused). misses: tokens asked for and not found.
    entries: cached entries now (full + partial blocks). blocks: distinct physical blocks the
    cache holds a reference on now. evictions: entries dropped by eviction so far.
    """
    queries: int = 0
    hits: int = 0
    misses: int = 0
    entries: int = 0
    blocks: int = 0
    evictions: int = 0


class _Entry:
    __slots__ = ("hash", "parent", "tokens", "block", "last_used", "uid", "full")

    def __init__(self, h, parent, tokens, block, full, uid):
        self.hash = h            # chained hash (full blocks); None for a partial block
        self.parent = parent     # parent _Entry (None: first block of a sequence)
        self.tokens = tokens     # array('q') of the block's token ids (< block_size if partial)
        self.block = block       # physical block id (the cache holds one reference on it)
        self.full = full
        self.uid = uid
        self.last_used = 0


def _lcp(a, b) -> int:
    """Length of the common prefix of two arrays (binary search over C-level slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Block-hash prefix cache over one :class:`~xoffload.runtime.OffloadRuntime`'s pool (or any block
    pool with the same small interface: ``block_size``, ``allocator`` (a
    :class:`~xoffload.runtime.BlockAllocator`), ``_closed``, ``kv_in_pool(seq, n, what)`` and,
    for :meth:`add_sequence`, ``add_sequence(prefix_blocks=, prefix_len=)``; the batched resident
    store's GPU pool is one).

    Args:
        engine: the engine whose blocks are cached; the cache installs itself as the engine's
            allocator evictor (one cache per engine; ValueError if it already has one).

    Token ids are a list/tuple of non-negative ints or a 1-D integer tensor (read on the host).
    Raises ValueError once the engine is closed.
    """

    def __init__(self, engine):
        self.engine = engine
        self.block_size = engine.block_size
        self._alloc = engine.allocator
        self._full: dict[int, _Entry] = {}         # chained hash -> full-block entry
        self._kids: dict[object, list[_Entry]] = {}  # parent entry (None = root) -> children
        self._n = 0                                # entries
        self._clock = 0
        self._uid = 0
        self._stats = CacheStats()
        self._alloc.set_evictor(self)

    # ------------------------------------------------------------------ lookups
    def match(self, token_ids) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``: full blocks by chained hash, then the longest
        common prefix with a cached child block of the last match (a partial block or the start
        of a full one). Marks the matched entries used (LRU) and counts hits/misses.

        The returned blocks are not referenced for the caller: pass them to
        ``engine.add_sequence(prefix_blocks=..., prefix_len=...)`` before anything else allocates
        (an allocation may evict them), or use :meth:`add_sequence` which does both.
        To recompute the last prompt token (for its logits), match ``token_ids[:-1]``.

        Raises TypeError/ValueError for ids that are not non-negative integers.
        """
        self._check_open()
        ids = self._tokens(token_ids)
        chain, tail, m = self._walk(ids)
        self._clock += 1
        for e in chain + ([tail] if tail is not None else []):
            e.last_used = self._clock
        n = len(chain) * self.block_size + m
        st = self._stats
        st.queries += 1
        st.hits += n
        st.misses += len(ids) - n
        blocks = tuple(e.block for e in chain) + ((tail.block,) if tail is not None else ())
        return PrefixMatch(blocks, n)

    def peek(self, token_ids) -> int:
        """Tokens of ``token_ids`` that :meth:`match` would find now, without marking entries
        used or counting hits/misses (an estimate for admission: evictions may lower it before
        the match). Raises as :meth:`match`."""
        self._check_open()
        chain, _, m = self._walk(self._tokens(token_ids))
        return len(chain) * self.block_size + m

    def add_sequence(self, token_ids) -> tuple[int, int]:
        """``match(token_ids)`` and start an engine sequence on the matched blocks, at once.
        Returns ``(seq, n_tokens)``: the new sequence already holds the first ``n_tokens``
        tokens' KV in every layer; the caller prefills ``token_ids[n_tokens:]``.
        Raises as :meth:`match` and ``OffloadRuntime.add_sequence``."""
        m = self.match(token_ids)
        return self.engine.add_sequence(prefix_blocks=m.blocks, prefix_len=m.n_tokens), m.n_tokens

    # ------------------------------------------------------------------ updates
    def insert(self, seq: int, token_ids) -> int:
        """Register the blocks of live sequence ``seq`` for its first ``n = min(len(token_ids),
        seq_len(seq))`` tokens (``token_ids`` are its tokens from the start; extra ids without KV,
        e.g. the last sampled token, are ignored). Full blocks become full entries, a partly
        filled last block a partial entry; already cached blocks are only marked used; partial
        entries that the new ones cover are dropped. The cache takes a reference on each new
        entry's block. The sequence's decode buffer is first flushed to the pool when needed.

        Cost: the sequence's last block is now shared, so its next write copies it (copy-on-write);
        inserting just before ``free(seq)`` avoids that copy.

        Returns the number of new entries. Raises ValueError: seq unknown/freed, inside a decode
        step, or with layers of unequal length; TypeError/ValueError for bad ids;
        PoolExhaustedError if the flush needs a copy-on-write block and none is free.
        """
        self._check_open()
        ids = self._tokens(token_ids)
        n = self.engine.kv_in_pool(seq, len(ids), "PrefixCache.insert")
        ids = ids[:n]
        table = self._alloc.table(seq)
        bs = self.block_size
        self._clock += 1
        cur, cur_h, added = None, ROOT_HASH, 0
        for i in range(n // bs):
            toks = ids[i * bs:(i + 1) * bs]
            h = hash((cur_h, toks.tobytes()))
            ex = self._full.get(h)
            if ex is not None:
                if ex.parent is not cur or ex.tokens != toks:
                    return added  # hash collision with another chain: stop registering here
                ex.last_used = self._clock
                cur, cur_h = ex, h
                continue
            e = self._new(h, cur, toks, table[i], True)
            self._full[h] = e
            self._drop_covered(cur, toks)
            self._kids.setdefault(cur, []).append(e)
            added += 1
            cur, cur_h = e, h
        r = n % bs
        if r:
            toks = ids[n - r:n]
            for k in self._kids.get(cur, ()):
                if _lcp(k.tokens, toks) == r:  # an entry already covers these tokens
                    k.last_used = self._clock
                    return added
            self._drop_covered(cur, toks)
            e = self._new(None, cur, toks, table[n // bs], False)
            self._kids.setdefault(cur, []).append(e)
            added += 1
        return added

    def clear(self) -> int:
        """Drop every entry (and the cache's references); returns how many blocks became free.
        Blocks that live sequences still hold stay theirs."""
        self._check_open()
        blocks = [e.block for kids in self._kids.values() for e in kids]
        self._full.clear()
        self._kids.clear()
        self._n = 0
        return self._alloc.release(blocks) if blocks else 0

    # ----------------------------------------------------------------- eviction
    def evictable_blocks(self) -> int:
        """Blocks that evicting could free now (entries whose block no live sequence holds, and
        whose cached descendants are all such)."""
        if self._closed():
            return 0
        return self._plan(None)[1]

    def evict_blocks(self, n: int) -> int:
        """Free at least ``n`` blocks by dropping LRU entries leaf-first, or nothing if that many
        cannot be freed. Returns the blocks freed (0 or >= n). Called by the allocator."""
        check_int("number of blocks", n, 0, type_error=ValueError)
        if n == 0 or self._closed():
            return 0
        plan, freed = self._plan(n)
        if freed < n:
            return 0
        got = 0
        for e in plan:
            self._remove(e)
            got += self._alloc.release([e.block])
            self._stats.evictions += 1
        return got

    # -------------------------------------------------------------------- stats
    def stats(self) -> CacheStats:
        """A snapshot of the counters (see :class:`CacheStats`)."""
        st = self._stats
        blocks = {e.block for kids in self._kids.values() for e in kids}
        return CacheStats(st.queries, st.hits, st.misses, self._n, len(blocks), st.evictions)

    def __len__(self) -> int:
        return self._n

    def entries(self) -> list[tuple[int, int, bool]]:
        """``(block, n_tokens, full)`` of every entry, least recently used first (tests/debug)."""
        es = sorted((e for kids in self._kids.values() for e in kids), key=lambda e: (e.last_used, e.uid))
        return [(e.block, len(e.tokens), e.full) for e in es]

    # ---------------------------------------------------------------- internals
    def _closed(self) -> bool:
        return self.engine._closed

    def _check_open(self):
        if self._closed():
            raise ValueError("the PrefixCache's OffloadRuntime is closed")

    def _tokens(self, token_ids) -> array:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
                raise TypeError(f"token_ids must be integers, got dtype {token_ids.dtype}")
            if token_ids.dim() != 1:
                raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or token_ids is None:
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        try:
            ids = array("q", token_ids)
        except (TypeError, OverflowError) as e:
            raise TypeError(f"token_ids must be a sequence of ints (int64): {e}") from None
        if ids and min(ids) < 0:
            raise ValueError(f"token_ids must be >= 0, got {min(ids)}")
        return ids

    def _walk(self, ids):
        """(full-block entries matched, tail entry or None, tail tokens matched)."""
        bs = self.block_size
        chain, cur, cur_h = [], None, ROOT_HASH
        for i in range(len(ids) // bs):
            toks = ids[i * bs:(i + 1) * bs]
            h = hash((cur_h, toks.tobytes()))
            e = self._full.get(h)
            if e is None or e.parent is not cur or e.tokens != toks:
                break
            chain.append(e)
            cur, cur_h = e, h
        rest = ids[len(chain) * bs:(len(chain) + 1) * bs]
        tail, m = None, 0
        if rest:
            for k in self._kids.get(cur, ()):
                c = _lcp(k.tokens, rest)
                if c > m or (c == m and c and k.last_used > tail.last_used):
                    tail, m = k, c
        return chain, tail, m

    def _new(self, h, parent, toks, block, full) -> _Entry:
        self._alloc.retain([block])
        self._uid += 1
        e = _Entry(h, parent, toks, block, full, self._uid)
        e.last_used = self._clock
        self._n += 1
        return e

    def _drop_covered(self, parent, toks):
        """Drop partial children of ``parent`` whose tokens are a prefix of ``toks``."""
        kids = self._kids.get(parent)
        if not kids:
            return
        gone = [k for k in kids if not k.full and len(k.tokens) <= len(toks) and toks[:len(k.tokens)] == k.tokens]
        for k in gone:
            self._remove(k)
            self._alloc.release([k.block])

    def _remove(self, e):
        kids = self._kids[e.parent]
        kids.remove(e)
        if not kids:
            del self._kids[e.parent]
        if e.full:
            del self._full[e.hash]
        self._kids.pop(e, None)  # has no children (leaf-first), kept for safety
        self._n -= 1

    def _cache_only(self, b) -> bool:
        return self._alloc.refcount(b) == self._alloc.external_refs(b)

    def _plan(self, n):
        """Entries to drop, in order (LRU leaf-first, blocks no live sequence holds), until ``n``
        blocks (None: all that can be) would be freed; returns (entries, blocks freed)."""
        heap, left, ext = [], {}, {}
        for parent, kids in self._kids.items():
            if parent is not None:
                left[parent] = len(kids)
            for e in kids:
                if e not in self._kids and self._cache_only(e.block):
                    heap.append((e.last_used, e.uid, e))
        heapq.heapify(heap)
        plan, freed = [], 0
        while heap and (n is None or freed < n):
            _, _, e = heapq.heappop(heap)
            plan.append(e)
            b = e.block
            r = ext.get(b, self._alloc.external_refs(b)) - 1
            ext[b] = r
            freed += r == 0
            p = e.parent
            if p is not None:
                left[p] -= 1
                if left[p] == 0 and self._cache_only(p.block):
                    heapq.heappush(heap, (p.last_used, p.uid, p))
        return plan, freed
