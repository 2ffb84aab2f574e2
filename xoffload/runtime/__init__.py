"""Offload runtime: pinned CPU KV pool, GPU layer ring, and the stream-and-event engine.

The runtime moves and tracks ``[tokens, kv_heads, head_dim]`` K/V tensors per layer; it knows
nothing of models. Public pieces:

* :class:`OffloadRuntime` - the runtime's contract: ``add_sequence``, ``seq_len``,
  ``offload_layer`` (prefill, async D2H), ``begin_step`` / ``layer_kv`` / ``end_layer`` /
  ``end_step`` (decode through the ring), ``fetch_blocks`` (sparse), ``free``, ``reset``.
* :class:`CpuKVPool` - layer-major host K/V, pinned with ``cudaHostRegister`` in slabs;
  :func:`reuse_pinned_slabs` keeps closed pools' registered slabs for the next pool of that size.
  :class:`DeviceKVPool` - the same interface with the blocks in device memory
  (``OffloadRuntime(placement="device")``).
* :class:`BlockAllocator` - reference-counted blocks and per-sequence block tables (contiguous
  runs preferred; shared blocks; external references; an evictor hook).
* :class:`PrefixCache` - block-hash prefix reuse over an engine's pool (``match``, ``insert``,
  ``add_sequence``, LRU leaf-first eviction, ``stats``).
* :class:`LayerRing` - N device layer buffers with load/compute events.
* ``sequence`` - the engine's per-sequence / per-step records.
* :func:`gather_blocks` - Triton kernel copying listed blocks out of pinned host memory (UVA).

Contract notes (what a caller of the engine may rely on beyond the method list above):

* ``fetch_blocks(seq, layer, block_ids)``: ``block_ids`` are LOGICAL block indices of the sequence
  (block i = its tokens ``[i*block_size, (i+1)*block_size)``), not physical pool ids; "not owned"
  means outside ``0 .. num_seq_blocks(seq)-1``. Rows past the layer's last token are zero; tokens
  still in the decode buffer (incl. an open step's new token) are included. A CUDA tensor of ids is
  read on the host (a wait on the current stream); pass a list to avoid it.
* ``layer_kv`` requires layers in order 0..L-1, each ended before the next; it accepts
  ``k_new`` of shape ``[1, Hkv, D]`` or ``[Hkv, D]``.
* Also: ``begin_step(seq, prefetch=False)`` + ``append_kv(seq, layer, k_new, v_new)`` for sparse
  decode without whole-layer loads; ``layer_len``, ``block_table``, ``num_seq_blocks``,
  ``num_free_blocks``, ``sequences``, ``host_kv`` (debug/test read-back), ``close``; constructor
  keyword ``gather=`` (use the Triton gather kernel; default on for a pinned CUDA pool).
* Several sequences may be in a decode step at once; each active step holds its own ring
  (N x 2 x max_tokens x Hkv x D elements on the GPU), reused across steps.
* ``offload_layer`` after decode steps (e.g. a second turn) is allowed: the decode buffer is
  flushed to the pool first.
* Sharing: ``add_sequence(prefix_blocks=, prefix_len=)`` starts a sequence on shared
  physical blocks; ``fork(parent, n_tokens)`` shares a parent's first tokens; ``flush(seq)`` moves
  the decode buffer to the pool. Nobody writes into a shared block: the engine copies a shared,
  partly filled block (all layers, K and V) into a fresh one before a sequence's first write into
  it (copy-on-write, on the offload stream on CUDA). ``free`` drops one reference per block.
"""
from .allocator import BlockAllocator, PoolExhaustedError, block_runs
from .offload import OffloadRuntime
from ..kernels.gather import gather_blocks
from .pool import CpuKVPool, DeviceKVPool, PinnedSlabCache, PoolAllocationError, reuse_pinned_slabs
from .prefix_cache import CacheStats, PrefixCache, PrefixMatch, block_hash
from .ring import LayerRing

__all__ = [
    "BlockAllocator",
    "CacheStats",
    "CpuKVPool",
    "DeviceKVPool",
    "LayerRing",
    "OffloadRuntime",
    "PinnedSlabCache",
    "PoolAllocationError",
    "PoolExhaustedError",
    "PrefixCache",
    "PrefixMatch",
    "block_hash",
    "block_runs",
    "gather_blocks",
    "reuse_pinned_slabs",
]
