"""Block allocator and per-sequence block tables for the CPU KV pool.

A block is ``block_size`` consecutive tokens of one sequence, the same block index in every
layer's pool array (``pool.k[layer][block]``). Sequences are keyed by the int id the engine
assigns (never ``id()`` of an object). Allocation prefers contiguous runs of physical blocks, so
that a whole layer of a sequence is usually one large copy.

Blocks are reference counted (prefix sharing): a block may sit in several sequences'
tables (``add(seq, shared=...)``) and be held by non-sequence holders such as the prefix cache
(``retain`` / ``release``, counted apart as "external" references). A block is free exactly when
its count is 0. Invariant (checked by :meth:`BlockAllocator.check`): ``refcount(b)`` = number of
tables holding ``b`` + ``external_refs(b)``; ``num_free`` = number of blocks with count 0.

An optional *evictor* (:meth:`BlockAllocator.set_evictor`; the prefix cache installs itself) is
asked to give blocks back when an allocation finds too few free ones.
"""
from __future__ import annotations

from ..kernels.checks import check_int


class PoolExhaustedError(ValueError):
    """The pool has fewer free blocks than a request needs. A ValueError subclass."""


class BlockAllocator:
    """Hands out physical block ids ``0 .. num_blocks-1`` to sequences.

    Args:
        num_blocks: blocks in the pool (per layer).
        block_size: tokens per block; used in error messages only.

    All operations are all-or-nothing: a failed call leaves every table, count and the free set as
    they were (an allocation that needs eviction first checks that enough can be evicted).
    ``free(seq)`` drops ``seq``'s table and one reference per block; a block returns to the free
    list when its count reaches 0.
    """

    def __init__(self, num_blocks: int, block_size: int | None = None):
        check_int("num_blocks", num_blocks, 0, type_error=ValueError)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free
        self._num_free = num_blocks
        self._tables: dict[int, list[int]] = {}
        self._ref = [0] * num_blocks  # table references + external references
        self._ext = [0] * num_blocks  # external (non-sequence) references, e.g. the prefix cache
        self._evictor = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Number of free blocks."""
        return self._num_free

    def has(self, seq: int) -> bool:
        """Whether ``seq`` has a table (was added and not freed)."""
        return seq in self._tables

    def sequences(self) -> list[int]:
        """Ids of the sequences that hold a table."""
        return list(self._tables)

    def table(self, seq: int) -> tuple[int, ...]:
        """Physical block ids of ``seq`` in token order (logical block i -> ``table[i]``).

        Raises ValueError for a sequence without a table.
        """
        return tuple(self._get(seq))

    def owns(self, seq: int, block: int) -> bool:
        """Whether physical block ``block`` belongs to ``seq``."""
        return block in self._get(seq)

    def refcount(self, block: int) -> int:
        """References to physical block ``block`` (tables holding it + external holders)."""
        return self._ref[self._block(block)]

    def external_refs(self, block: int) -> int:
        """External (non-sequence, e.g. prefix cache) references to ``block``."""
        return self._ext[self._block(block)]

    def is_shared(self, block: int) -> bool:
        """Whether ``block`` has more than one holder (then nobody may write into it)."""
        return self._ref[self._block(block)] > 1

    def usage(self) -> dict:
        """Block counts: ``free``, ``seq_held`` (in at least one table), ``external_only`` (held
        only by external holders such as the prefix cache), ``shared`` (count > 1), ``total``."""
        seq_held = ext_only = shared = 0
        for r, e in zip(self._ref, self._ext):
            if r > e:
                seq_held += 1
            elif r:
                ext_only += 1
            if r > 1:
                shared += 1
        return {"free": self._num_free, "seq_held": seq_held, "external_only": ext_only,
                "shared": shared, "total": self.num_blocks}

    def check(self) -> None:
        """Verify the accounting invariants (test helper). Raises AssertionError naming the first
        block whose count, free flag or external count disagrees with the tables."""
        held = [0] * self.num_blocks
        for seq, t in self._tables.items():
            if len(set(t)) != len(t):
                raise AssertionError(f"sequence {seq} holds a block twice: {t}")
            for b in t:
                held[b] += 1
        nfree = 0
        for b in range(self.num_blocks):
            if self._ref[b] != held[b] + self._ext[b]:
                raise AssertionError(f"block {b}: refcount {self._ref[b]} != {held[b]} table(s) + "
                                     f"{self._ext[b]} external")
            if bool(self._free[b]) != (self._ref[b] == 0):
                raise AssertionError(f"block {b}: free flag {self._free[b]} but refcount {self._ref[b]}")
            nfree += self._ref[b] == 0
        if nfree != self._num_free:
            raise AssertionError(f"num_free is {self._num_free} but {nfree} blocks have refcount 0")

    def snapshot(self):
        """Hashable picture of the whole state (free set, counts, every table), for tests."""
        return (bytes(self._free), tuple(self._ref), tuple(self._ext),
                tuple(sorted((s, tuple(t)) for s, t in self._tables.items())))

    # ---------------------------------------------------------------- mutations
    def add(self, seq: int, shared=()) -> None:
        """Create a table for ``seq``, starting with the already allocated blocks ``shared``
        (physical ids in token order; one more reference each). Default: an empty table.

        Raises ValueError if ``seq`` already has a table, or a shared id is out of range, free
        (nobody holds it, so it holds no KV) or repeated; TypeError for a non-int id.
        """
        check_int("sequence id", seq)
        if seq in self._tables:
            raise ValueError(f"sequence {seq} already has a block table")
        blocks = [self._block(b) for b in shared]
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"shared blocks of sequence {seq} repeat a block: {blocks}")
        for b in blocks:
            if self._ref[b] == 0:
                raise ValueError(f"shared block {b} is free (held by no sequence or cache); it holds no KV")
        for b in blocks:
            self._ref[b] += 1
        self._tables[seq] = blocks

    def allocate(self, seq: int, n: int) -> list[int]:
        """Append ``n`` blocks to ``seq``'s table and return their physical ids.

        Prefers the blocks right after the sequence's last block, then the start of a free run
        long enough for the rest (else the longest runs first), so tables stay contiguous.

        When fewer than ``n`` blocks are free, the evictor (if any) is asked for the rest first.

        Raises:
            PoolExhaustedError: fewer than ``n`` blocks are free even after eviction (message
                names needed, free, held by live sequences and held by the cache).
            ValueError: ``n < 0`` or unknown sequence.
        """
        table = self._get(seq)
        check_int("number of blocks", n, 0, type_error=ValueError)
        self.ensure_free(n, seq)
        chosen: list[int] = []
        free = self._free
        pos = table[-1] + 1 if table else None
        while pos is not None and len(chosen) < n and pos < self.num_blocks and free[pos]:
            free[pos] = 0
            chosen.append(pos)
            pos += 1
        while len(chosen) < n:
            start, length = self._pick_run(n - len(chosen))
            take = min(length, n - len(chosen))
            for b in range(start, start + take):
                free[b] = 0
                chosen.append(b)
        for b in chosen:
            self._ref[b] = 1
        self._num_free -= n
        table.extend(chosen)
        return chosen

    def ensure_free(self, n: int, seq=None) -> None:
        """Make at least ``n`` blocks free, evicting through the evictor if needed (all or
        nothing: nothing is evicted unless enough can be). ``seq`` only names the requester in
        the error.

        Raises PoolExhaustedError (a ValueError) naming blocks needed, free, held by live
        sequences, and held only by the cache (and how many of those can be evicted)."""
        if n <= self._num_free:
            return
        ev = self._evictor
        if ev is not None:
            ev.evict_blocks(n - self._num_free)  # frees enough, or nothing
            if n <= self._num_free:
                return
        can = ev.evictable_blocks() if ev is not None else 0
        u = self.usage()
        toks = f" ({n * self.block_size} tokens)" if self.block_size else ""
        who = f"sequence {seq}" if seq is not None else "the request"
        raise PoolExhaustedError(
            f"KV pool exhausted: {who} needs {n} more block(s){toks} but only "
            f"{self._num_free} of {self.num_blocks} block(s) are free ({u['seq_held']} held by live "
            f"sequences, {u['external_only']} held only by the prefix cache, {can} of them evictable); "
            f"free finished sequences, clear the prefix cache, or create the engine with a larger num_blocks"
        )

    def replace_block(self, seq: int, index: int) -> tuple[int, int]:
        """Copy-on-write bookkeeping: put a fresh block at position ``index`` of ``seq``'s table in
        place of the (shared) block there, which loses one reference. The caller copies the data.
        Prefers the block after the previous table entry (contiguity). Returns ``(old, new)``.

        Raises ValueError for an unknown sequence or an index outside its table;
        PoolExhaustedError when no block can be freed (nothing changed then)."""
        table = self._get(seq)
        check_int("table index", index, 0, len(table) - 1, type_error=ValueError)
        self.ensure_free(1, seq)
        old = table[index]
        nxt = table[index - 1] + 1 if index else None
        if nxt is not None and nxt < self.num_blocks and self._free[nxt]:
            new = nxt
        else:
            new = self._pick_run(1)[0]
        self._free[new] = 0
        self._ref[new] = 1
        self._num_free -= 1
        table[index] = new
        self._unref(old)
        return old, new

    def retain(self, blocks) -> None:
        """Add one external reference to each allocated block in ``blocks`` (the prefix cache
        holding KV). Raises ValueError for a free or out-of-range block (nothing changed)."""
        bl = [self._block(b) for b in blocks]
        for b in bl:
            if self._ref[b] == 0:
                raise ValueError(f"cannot retain block {b}: it is free (holds no KV)")
        for b in bl:
            self._ref[b] += 1
            self._ext[b] += 1

    def release(self, blocks) -> int:
        """Drop one external reference from each block in ``blocks``; returns how many became
        free. Raises ValueError for a block without an external reference (nothing changed)."""
        bl = [self._block(b) for b in blocks]
        need: dict[int, int] = {}
        for b in bl:
            need[b] = need.get(b, 0) + 1
        for b, c in need.items():
            if self._ext[b] < c:
                raise ValueError(f"cannot release block {b}: it has {self._ext[b]} external reference(s)")
        freed = 0
        for b in bl:
            self._ext[b] -= 1
            freed += self._unref(b)
        return freed

    def set_evictor(self, evictor) -> None:
        """Install (or with None remove) the object asked for blocks when too few are free: it has
        ``evict_blocks(n) -> int`` (free at least ``n`` blocks by :meth:`release`, or nothing if it
        cannot) and ``evictable_blocks() -> int`` (how many it could free now; for the error
        message). Raises ValueError if another one is installed."""
        if evictor is not None and self._evictor is not None and self._evictor is not evictor:
            raise ValueError("this allocator already has an evictor (one prefix cache per engine)")
        self._evictor = evictor

    def free(self, seq: int) -> int:
        """Drop ``seq``'s table and one reference per block; returns how many blocks became free
        (blocks still held by another sequence or the cache stay allocated)."""
        table = self._get(seq)
        del self._tables[seq]
        return sum(self._unref(b) for b in table)

    def reset(self) -> None:
        """Free every block and drop every table and external reference."""
        self._free = bytearray(b"\x01") * self.num_blocks
        self._num_free = self.num_blocks
        self._tables.clear()
        self._ref = [0] * self.num_blocks
        self._ext = [0] * self.num_blocks

    # ---------------------------------------------------------------- internals
    def _unref(self, b) -> int:
        r = self._ref[b] - 1
        self._ref[b] = r
        if r == 0:
            self._free[b] = 1
            self._num_free += 1
            return 1
        return 0

    def _block(self, b) -> int:
        return check_int("block id", b, 0, self.num_blocks - 1, type_error=ValueError)

    def _get(self, seq):
        try:
            return self._tables[seq]
        except (KeyError, TypeError):
            raise ValueError(f"sequence {seq!r} has no block table (never added, or freed)") from None

    def _pick_run(self, want: int) -> tuple[int, int]:
        """First free run of length >= want, else the longest free run: (start, length)."""
        best = (0, 0)
        free = self._free
        i, n = 0, self.num_blocks
        while i < n:
            if not free[i]:
                nxt = free.find(b"\x01", i)
                if nxt < 0:
                    break
                i = nxt
            j = free.find(b"\x00", i)
            if j < 0:
                j = n
            length = j - i
            if length >= want:
                return i, length
            if length > best[1]:
                best = (i, length)
            i = j
        return best


def block_runs(table, start_tok: int, end_tok: int, block_size: int):
    """Split the token range ``[start_tok, end_tok)`` of a sequence into physically contiguous runs.

    Args:
        table: physical block ids in token order.
    Returns:
        list of ``(phys_tok, tok, n)``: ``n`` tokens starting at the sequence's token ``tok`` live at
        flat pool row ``phys_tok`` (``= block * block_size + offset``) and the rows after it.
    """
    runs = []
    t = start_tok
    while t < end_tok:
        bi, off = divmod(t, block_size)
        phys = table[bi] * block_size + off
        n = min(block_size - off, end_tok - t)
        if runs and runs[-1][0] + runs[-1][2] == phys:
            p, t0, m = runs[-1]
            runs[-1] = (p, t0, m + n)
        else:
            runs.append((phys, t, n))
        t += n
    return runs
