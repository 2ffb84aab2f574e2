"""Block allocator and per-sequence block tables for the CPU KV pool.

A block is ``block_size`` consecutive tokens of one sequence, the same block index in every
layer's pool array (``pool.k[layer][block]``). Sequences are keyed by the int id the engine
assigns (never ``id()`` of an object). Allocation prefers contiguous runs of physical blocks, so
that a whole layer of a sequence is usually one large copy.
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

    All operations are all-or-nothing: a failed call leaves every table and the free set as they
    were. ``free(seq)`` returns every block of ``seq`` and drops its table.
    """

    def __init__(self, num_blocks: int, block_size: int | None = None):
        check_int("num_blocks", num_blocks, 0, type_error=ValueError)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free
        self._num_free = num_blocks
        self._tables: dict[int, list[int]] = {}

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

    def snapshot(self):
        """Hashable picture of the whole state (free set and every table), for tests."""
        return bytes(self._free), tuple(sorted((s, tuple(t)) for s, t in self._tables.items()))

    # ---------------------------------------------------------------- mutations
    def add(self, seq: int) -> None:
        """Create an empty table for ``seq``; ValueError if it already has one."""
        check_int("sequence id", seq)
        if seq in self._tables:
            raise ValueError(f"sequence {seq} already has a block table")
        self._tables[seq] = []

    def allocate(self, seq: int, n: int) -> list[int]:
        """Append ``n`` blocks to ``seq``'s table and return their physical ids.

        Prefers the blocks right after the sequence's last block, then the start of a free run
        long enough for the rest (else the longest runs first), so tables stay contiguous.

        Raises:
            PoolExhaustedError: fewer than ``n`` blocks are free (message names needed and free).
            ValueError: ``n < 0`` or unknown sequence.
        """
        table = self._get(seq)
        check_int("number of blocks", n, 0, type_error=ValueError)
        if n > self._num_free:
            toks = f" ({n * self.block_size} tokens)" if self.block_size else ""
            raise PoolExhaustedError(
                f"KV pool exhausted: sequence {seq} needs {n} more block(s){toks} but only "
                f"{self._num_free} of {self.num_blocks} block(s) are free; free finished sequences "
                f"or create the engine with a larger num_blocks"
            )
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
        self._num_free -= n
        table.extend(chosen)
        return chosen

    def free(self, seq: int) -> int:
        """Return every block of ``seq`` and drop its table; returns how many blocks came back."""
        table = self._get(seq)
        for b in table:
            self._free[b] = 1
        self._num_free += len(table)
        del self._tables[seq]
        return len(table)

    def reset(self) -> None:
        """Free every block and drop every table."""
        self._free = bytearray(b"\x01") * self.num_blocks
        self._num_free = self.num_blocks
        self._tables.clear()

    # ---------------------------------------------------------------- internals
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
