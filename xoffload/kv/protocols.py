"""The contracts of the KV layer, written once.

A *store* is what the engine's step loop talks to about KV: one object per store epoch (the
stretch of steps while the engine is busy) that holds the KV of every running sequence, whether
the engine runs one sequence (``max_num_seqs=1``: a batch of one) or many. It plays four roles,
each a :class:`typing.Protocol` below:

- :class:`Admission`: the ledger of one epoch (what may run, whose blocks are reserved);
- :class:`PrefillSink`: where one sequence's prefill writes its K/V, layer by layer;
- :class:`DecodeStore`: one decode step's attention for every running row;
- :class:`BlockLedger`: how KV blocks are allocated, shared and freed underneath (the runtime's
  :class:`~xoffload.runtime.BlockAllocator` and :class:`~xoffload.runtime.PrefixCache`).

:class:`KVStore` is all of them; every class the store table
(:func:`~xoffload.kv.table.batch_store_class`) returns satisfies it (``tests/kv/test_protocols.py``
checks each one). :data:`PLACEMENTS` says where each part of a sequence's KV lives.

Shapes use ``T`` prompt (or chunk) tokens, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head dim,
``R`` rows of a decode step (the running sequences padded to a batch-size bucket, ``R >= n``).
K/V are in the model's dtype on the model's device unless said otherwise; token counts are ints.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["PrefillSink", "HistorySink", "DecodeStore", "Admission", "BlockLedger", "KVStore", "PLACEMENTS",
           "protocol_members"]


@runtime_checkable
class PrefillSink(Protocol):
    """Where the model's layerwise prefill of one sequence puts its K/V
    (:meth:`~xoffload.models.llama.LlamaModel.prefill`).

    Per layer ``l``, in order ``0 .. L-1``: the model calls ``buffers(l, T)`` and writes the
    prompt's K/V (after RoPE) into the returned tensors, attends with them, then calls
    ``done(l, k, v)``. From ``done`` on, the sink owns the data: it may start an asynchronous copy
    out of ``k``/``v`` (D2H to the pinned pool) and must order any reuse of those buffers after
    that copy on the GPU (never by blocking the host). The model never reads a buffer after
    ``done``.
    """

    def buffers(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)``, each ``[T, Hkv, D]``, for the model to fill with layer ``layer``'s K/V."""
        ...

    def done(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s K/V (the tensors :meth:`buffers` gave) are written and attended."""
        ...


@runtime_checkable
class HistorySink(PrefillSink, Protocol):
    """A prefill sink whose sequence continues KV the store already holds (a reused prefix, an
    earlier chunk of a chunked prefill): the prompt's queries at positions ``start .. start+T-1``
    attend causally to themselves (the model) and to the ``start`` stored tokens (``history``);
    the model merges the two by their log-sum-exp."""

    def history(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` ``[T, Hq, D]`` over layer ``layer``'s stored history (non-causal:
        every stored token precedes every query): ``(out [1, T, Hq, D], lse [1, Hq, T] fp32)``;
        a query row that sees no key has LSE ``-inf``."""
        ...


@runtime_checkable
class DecodeStore(Protocol):
    """One decode step's attention for every running sequence (one row each).

    Host side, only when the running set changes: ``set_batch(seqs) -> R``. Then per step:
    ``begin_step()``; for each layer ``attend(layer, q, k_new, v_new)``; ``end_step()``;
    ``advance()``. Everything from ``begin_step`` to ``advance`` reads positions and lengths on the
    device and has the same shapes every step of a batch: where ``capturable`` is True the engine
    captures one step per batch-size bucket in a CUDA graph and replays it. Padding rows
    (``n .. R-1``) attend to nothing, write into scratch and never touch a real row's KV.

    Attributes:
        pos: int64 ``[R]`` device tensor, each row's position (the RoPE input; the number of
            tokens whose KV the row holds before this step's token).
        capturable: whether a step may be captured in a CUDA graph.
    """

    pos: torch.Tensor
    capturable: bool

    def set_batch(self, seqs: list) -> int:
        """Make ``seqs`` (running sequences, in row order) the rows of the next steps; returns
        ``R``, the padded row count (a batch-size bucket, ``R >= len(seqs)``)."""
        ...

    def begin_step(self) -> None:
        """Device-side setup of a step (lengths, write rows); no host read."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Append each row's new token (``k_new``, ``v_new``: ``[R, Hkv, D]``) to layer ``layer``
        and attend ``q`` ``[R, Hq, D]`` over every token the row reads (all of them for dense
        decode; the pages the decode policy chooses for sparse decode, plus the recent and
        generated tokens): ``out [R, Hq, D]``, fp32 accumulation, partial results merged by LSE."""
        ...

    def end_step(self) -> None:
        """Device-side bookkeeping after the last layer."""
        ...

    def advance(self) -> None:
        """Every active row's position += 1, on the device (the last op of a captured step)."""
        ...


@runtime_checkable
class Admission(Protocol):
    """The ledger of one store epoch, as the :class:`~xoffload.engine.scheduler.Scheduler` uses it.

    A sequence's whole KV (prompt + every token it may generate) is reserved when it is admitted,
    so nothing running is ever preempted or evicted; only blocks no running sequence holds (cached
    prefixes) give way under pressure, least recently used first. ``release`` returns every block
    at once (finish, abort or error).
    """

    def check(self, seq) -> None:
        """Raise ValueError, naming the sizes, when ``seq`` alone can never fit this store."""
        ...

    def can_admit(self, seq) -> bool:
        """Whether ``seq`` fits now, next to the sequences admitted."""
        ...

    def admit(self, seq) -> None:
        """Reserve ``seq``'s KV (sets ``seq.kv``, the store's record of it)."""
        ...

    def release(self, seq) -> None:
        """Free everything ``seq`` holds (idempotent); shared prefix blocks stay cached. A store
        that caches prefixes first registers a finished (``seq.finish_reason`` ``stop`` /
        ``length``) answer's KV with its prompt (:mod:`~xoffload.kv.answers`)."""
        ...

    def prefill_start(self, seq) -> int:
        """Tokens of ``seq``'s prompt whose KV the store already holds (a reused prefix); its
        prefill starts there. Called once, right before the prefill."""
        ...

    def prefill_tokens(self, seq) -> int:
        """Tokens ``seq``'s prefill would compute if it started now (what the token budget
        ``max_num_batched_tokens`` counts)."""
        ...


@runtime_checkable
class BlockLedger(Protocol):
    """Blocks of ``block_size`` tokens of every layer, as the runtime's allocator hands them out.

    - Allocation: ``add(seq)`` opens a block table, ``allocate(seq, n)`` appends ``n`` blocks;
      PoolExhaustedError (a ValueError) when they are not free, after asking the evictor (the
      prefix cache) to give back blocks only it holds.
    - Sharing: a block may sit in several tables (a cached prefix); ``refcount(block)`` counts the
      tables plus the prefix cache's hold (``retain``/``release``). A shared block is never written:
      a sequence about to write into a shared, partly used last block gets a fresh copy first
      (copy-on-write, ``replace_block``). Prefix blocks are found by chained hashes of their
      tokens (:class:`~xoffload.runtime.PrefixCache`: a block's hash covers every token before it).
    - Freeing: ``free(seq)`` drops the table; a block returns to the free list when its count
      reaches 0.
    """

    block_size: int

    @property
    def num_free(self) -> int:
        """Blocks no table and no cache holds."""
        ...

    def add(self, seq: int, shared=()) -> None:
        ...

    def allocate(self, seq: int, n: int) -> list:
        ...

    def table(self, seq: int) -> tuple:
        ...

    def refcount(self, block: int) -> int:
        ...

    def free(self, seq: int) -> int:
        ...


@runtime_checkable
class KVStore(Admission, DecodeStore, Protocol):
    """A store: :class:`Admission` + :class:`DecodeStore` + a prefill sink per sequence.

    Made per store epoch by ``cls.open(model, config, shared, seqs, **table_kwargs)`` (``shared``:
    the engine's :class:`~xoffload.runtime.OffloadRuntime` or None; ``seqs``: the waiting
    sequences that size its GPU pools), closed by :meth:`close` when the engine goes idle.
    """

    max_num_seqs: int

    def sink(self, seq) -> PrefillSink:
        """``seq``'s prefill sink (a :class:`HistorySink` when ``prefill_start(seq) > 0``)."""
        ...

    def h2d_bytes_per_step(self, seq) -> int | None:
        """Bytes one decode step reads from host memory for ``seq`` (None: none)."""
        ...

    def decode_stats(self, seq) -> dict:
        """Figures of ``seq``'s decode steps for its timings (cache hit rate, ...)."""
        ...

    def describe(self) -> dict:
        """What the store chose for this epoch (class, pool sizes in bytes, ...)."""
        ...

    def close(self) -> None:
        """Free every pool of the epoch (idempotent)."""
        ...


#: Where each part of a sequence's KV lives, per store (keys: the parts; values: the place).
#: "gpu pool": paged rows in HBM; "host pool": the runtime's pinned pool (read over PCIe, in
#: place or copied); "gpu tail": a paged HBM pool of generated tokens (+ a sparse store's sink
#: and recent prompt tokens); "summaries": Quest's per-page min/max (+ exact channels) in HBM;
#: "page cache": HBM slots holding host pages read by earlier steps.
PLACEMENTS: dict[str, dict[str, str]] = {
    "ResidentBatchKV": {"prompt": "gpu pool", "generated": "gpu pool"},
    "ResidentPrefixBatchKV": {"prompt": "gpu pool (shared prefix blocks)", "generated": "gpu pool"},
    "OffloadBatchKV": {"prompt": "host pool", "generated": "gpu tail"},
    "OffloadQuestBatchKV": {"prompt": "host pool", "sink + recent + generated": "gpu tail",
                            "summaries": "gpu", "dense layers": "gpu pool when it fits, else host pool",
                            "chosen pages": "page cache (gpu) or read from the host pool"},
}


def protocol_members(proto: type) -> set[str]:
    """Names of the methods and attributes ``proto`` (one of the protocols here) requires."""
    names: set[str] = set()
    for base in proto.__mro__:
        if base in (Protocol, object, Any) or not getattr(base, "_is_protocol", False):
            continue
        names |= {n for n in vars(base) if not n.startswith("_")}
        names |= set(getattr(base, "__annotations__", {}))
    return names
