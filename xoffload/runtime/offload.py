"""OffloadRuntime: a sequence's KV lives in the host pool (or, ``placement="device"``, a pool in
device memory); layers stream through a GPU ring.

(Over 450 lines on purpose: one class whose methods share one set of stream/event ordering rules,
stated below and per method; splitting it would scatter them.)

Lifecycle of one sequence (DESIGN.md, Runtime; the contract notes are in :mod:`xoffload.runtime`)::

    seq = eng.add_sequence()
    for each prefill chunk, for each layer l:  eng.offload_layer(seq, l, k, v)     # async D2H
    for each decode step:
        eng.begin_step(seq)                    # prefetch layers 0..N-1 into the ring
        for l in range(num_layers):
            k, v = eng.layer_kv(seq, l, k_new, v_new)   # all tokens of layer l incl. the new one
            ... attention on the current stream ...
            eng.end_layer(seq, l)              # compute-done; ring refills; full block -> pool
        eng.end_step(seq)
    eng.free(seq)

Ordering is by CUDA events only (no device-wide synchronize):

* prefill D2H: the offload stream waits on an event recorded on the caller's current stream, then
  copies; the source tensors are kept alive until the copy's event completes.
* ring loads: a slot's load stream waits on the slot's compute-done event and on the layer's last
  pool-write event (prefill offload or decode flush) before copying.
* ``layer_kv``: the caller's current stream waits on the slot's load-done event and on the layer's
  last decode-buffer flush (the flush reads the decode buffer that the new token overwrites).
* ``end_layer``: compute-done recorded on the current stream; a full decode block is flushed D2H on
  the offload stream after an event on the current stream.
* ``free``: the offload stream (the only pool writer) waits on events of the current stream and the
  ring load streams, so reused blocks are not overwritten while a read is in flight.
* sharing (``add_sequence(prefix_blocks=...)``, ``fork``, the prefix cache): the new sequence's
  ``write_ev`` of every layer is an event recorded on the offload stream at its creation, so its
  reads wait for every pool write already queued into the shared blocks.
* copy-on-write (a shared, partly filled block about to be written): a fresh block is allocated and
  the shared one copied into it, all layers, K and V, on the offload stream (so after that block's
  pending writes; through a device bounce buffer, as a host-to-host torch copy is not stream
  ordered); the writer's ``write_ev`` of every layer becomes the copy's event. It runs in
  ``offload_layer``, ``flush`` and ``begin_step`` (never in ``end_layer``, which cannot fail).

FP8 pools (``kv_dtype=torch.float8_e4m3fn``, ``scale_page=P``): K/V are handed in (and read back
by :meth:`fetch_blocks` / :meth:`host_kv`) in ``dtype``; :meth:`offload_layer` quantizes them on
the caller's stream (:func:`~xoffload.kernels.fp8.quantize_kv_fp8`, a scale per ``P`` tokens and
KV head, ``P = 1``: per token) and copies codes and scales into the pool; a write starts on a
scale-page boundary (``P > 1``), so a page's scale is computed once, from all of the page's tokens
that one write brings, and never changes the codes already stored. Reads dequantize
(:func:`~xoffload.kernels.fp8.dequantize_kv_fp8`). Copy-on-write copies the scales with the codes.
The ring decode path (``begin_step``) reads 16-bit pools only.

Host mode (``device="cpu"``): the same code with host tensors; copies are synchronous and the
streams/events are no-ops.
"""
from __future__ import annotations

import math

import torch

from .streams import Pending, Sync
from .allocator import BlockAllocator, block_runs
from ..kernels.checks import check_int
from ..kernels.fp8 import FP8_DTYPE, check_fp8_supported, dequantize_kv_fp8, quantize_kv_fp8
from ..kernels.gather import gather_blocks
from .pool import CpuKVPool, DeviceKVPool
from .ring import LayerRing
from .sequence import SeqState, StepState

_MIN_COPY_BYTES = 1 << 20  # below this per run, a whole-layer load uses the gather kernel


class OffloadRuntime:
    """KV offload runtime for ``num_layers`` layers of ``[tokens, num_kv_heads, head_dim]`` K and V.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        dtype: K/V dtype (every tensor handed in must have it).
        device: ``"cuda"`` (or ``"cuda:i"``/torch.device) for the GPU path; ``"cpu"`` for host mode
            (synchronous copies, same bookkeeping).
        max_tokens: most tokens one sequence may hold (size of each ring buffer).
        block_size: tokens per pool block.
        num_buffers: ring buffers N (>= 1); layers l..l+N-1 are in flight while l computes.
        num_blocks: pool blocks per layer; None => ``ceil(max_tokens / block_size)``.
        pin: register the pool memory with CUDA (CUDA device only).
        gather: use the Triton gather kernel for scattered reads of the pool (default: when the
            device is CUDA and the pool is pinned or on the device).
        placement: where the pool's blocks live: ``"host"`` (default, :class:`CpuKVPool`) or
            ``"device"`` (:class:`~.pool.DeviceKVPool` on ``device``: prefill's copies and the
            reads are device to device; every method and ordering rule stays the same).
        kv_dtype: what the pool stores: None (``dtype``) or ``torch.float8_e4m3fn`` (e4m3 codes
            and fp32 scales, see the module docstring; needs ``scale_page``).
        scale_page: fp8 pools: tokens per scale (1: per token; else a divisor of ``block_size``).

    GPU memory: each active decode step holds a ring of N x 2 x round_up(max_tokens, block_size)
    x Hkv x D elements; each sequence that has decoded holds a decode buffer of num_layers x 2 x
    block_size x Hkv x D elements.

    Raises:
        ValueError/TypeError for bad arguments; PoolAllocationError (a MemoryError) when the host
        pool cannot be allocated (message names the size and suggests fewer/smaller blocks);
        RuntimeError: an fp8 pool for a GPU below compute capability 8.9.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device="cuda", max_tokens: int = 131072,
                 block_size: int = 1024, num_buffers: int = 4, num_blocks: int | None = None,
                 pin: bool = True, gather: bool | None = None, placement: str = "host",
                 kv_dtype: torch.dtype | None = None, scale_page: int | None = None):
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                          ("max_tokens", max_tokens), ("block_size", block_size), ("num_buffers", num_buffers)):
            check_int(name, val, 1, type_error=ValueError)
        if num_blocks is None:
            num_blocks = math.ceil(max_tokens / block_size)
        check_int("num_blocks", num_blocks, 0, type_error=ValueError)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r} asked for but CUDA is not available; use device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if placement not in ("host", "device"):
            raise ValueError(f"placement must be 'host' or 'device', got {placement!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype not in (dtype, FP8_DTYPE):
            raise TypeError(f"kv_dtype must be None, {dtype} or torch.float8_e4m3fn, got {kv_dtype!r}")
        self.fp8 = self.kv_dtype == FP8_DTYPE
        if self.fp8:
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise TypeError(f"an fp8 pool quantizes fp16/bf16/fp32 K/V, got dtype {dtype}")
            check_fp8_supported(dev)
        self.device = dev
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.num_buffers = num_buffers
        self.buffer_tokens = math.ceil(max_tokens / block_size) * block_size
        self._sync = Sync(dev)
        sp = scale_page if self.fp8 else None
        self.pool = DeviceKVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self.kv_dtype, device=dev,
                                 scale_page=sp) \
            if placement == "device" else CpuKVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                                    self.kv_dtype, pin=pin and dev.type == "cuda", scale_page=sp)
        self.scale_page = self.pool.scale_page  # tokens per scale of an fp8 pool; 0 for 16-bit
        self.allocator = BlockAllocator(num_blocks, block_size)
        readable = self.pool.pinned or placement == "device"  # the device can read it in place
        self.use_gather = (dev.type == "cuda" and readable) if gather is None else bool(gather)
        if self.use_gather and dev.type == "cuda" and not readable:
            raise ValueError("gather=True on CUDA needs a pinned pool (pin=True)")
        self._offload_stream = self._sync.stream()
        self._pending = Pending()
        self._rings: list[LayerRing] = []
        self._free_rings: list[LayerRing] = []
        self._seqs: dict[int, SeqState] = {}
        self._next_id = 0
        self._closed = False
        self.cow_copies = 0  # copy-on-write block copies made (stats/tests)

    # =================================================================== sequences
    def add_sequence(self, *, prefix_blocks=(), prefix_len: int | None = None) -> int:
        """Register a new sequence; returns its engine-assigned int id (never reused).

        Without arguments the sequence is empty. With ``prefix_blocks`` (physical pool block ids,
        in token order, each held now by a live sequence or the prefix cache) it starts with
        their first ``prefix_len`` tokens (default ``len(prefix_blocks) * block_size``) in every
        layer, sharing the blocks (one more reference each; nothing is copied). The blocks must
        hold those tokens' KV in every layer. The last block may be partly used (``prefix_len``
        not a multiple of ``block_size``): the sequence's first write into it copies it first
        (copy-on-write), so the other holders' KV is never changed.

        Raises:
            ValueError: a block id out of range, free, or repeated; ``prefix_len`` outside
                ``((n-1)*block_size, n*block_size]`` for ``n`` blocks (0 for none) or above
                ``max_tokens``; the engine is closed.
            TypeError: a non-int id or length.
        """
        self._check_open()
        blocks = [check_int("prefix block id", b) for b in prefix_blocks]
        nb, bs = len(blocks), self.block_size
        if prefix_len is None:
            prefix_len = nb * bs
        check_int("prefix_len", prefix_len, 0, self.max_tokens, type_error=TypeError)
        lo, hi = ((nb - 1) * bs + 1, nb * bs) if nb else (0, 0)
        if not lo <= prefix_len <= hi:
            raise ValueError(f"prefix_len={prefix_len} does not fit {nb} prefix block(s) of {bs} tokens "
                             f"(must be in [{lo}, {hi}])")
        for o in self._seqs.values():  # a block a running step flushes into must not be shared
            if o.step is not None:
                busy = set(self.allocator.table(o.id)[min(o.pool_len) // bs:]) & set(blocks)
                if busy:
                    raise ValueError(f"prefix block(s) {sorted(busy)} are being written by sequence "
                                     f"{o.id}'s decode step; share them after its end_step")
        sid = self._next_id
        self.allocator.add(sid, blocks)  # validates the blocks; nothing changed on error
        self._next_id += 1
        st = SeqState(sid, self.num_layers)
        if prefix_len:
            # the shared blocks may still have pool writes in flight (all on the offload stream):
            # every read of this sequence waits on write_ev, so point it after them
            ev = self._sync.record(self._offload_stream)
            for l in range(self.num_layers):
                st.layer_len[l] = st.pool_len[l] = prefix_len
                st.write_ev[l] = ev
        self._seqs[sid] = st
        return sid

    def kv_in_pool(self, seq: int, n: int, what: str = "kv_in_pool") -> int:
        """Make the first ``min(n, len)`` tokens' KV of ``seq`` (``len``: the tokens it holds)
        be in its pool blocks in every layer, flushing its decode buffer when needed; returns
        that count. Raises ValueError (named ``what``): seq unknown/freed, inside a decode step,
        or with layers of unequal length; PoolExhaustedError if the flush needs a copy-on-write
        block and none is free."""
        s = self._get(seq)
        n = min(self._uniform_len(s, what), int(n))
        if n > min(s.pool_len):
            self.flush(seq)
        return n

    def fork(self, parent: int, n_tokens: int | None = None) -> int:
        """New sequence sharing the first ``n_tokens`` (default: all) tokens of ``parent``'s KV.

        The parent's decode-buffer tokens are first written to the pool (:meth:`flush`). Full
        blocks are shared for good (nobody writes into them again); a partly used last block is
        copied by whichever of the two writes into it first (copy-on-write). Returns the new id.

        Raises ValueError: parent unknown/freed, inside a decode step, layers of unequal length,
        or ``n_tokens`` outside ``[0, seq_len(parent)]``; PoolExhaustedError if flushing needs a
        copy-on-write block and none can be freed.
        """
        s = self._get(parent)
        n = self._uniform_len(s, "fork")
        n_tokens = n if n_tokens is None else check_int("n_tokens", n_tokens, 0, n)
        if n_tokens > min(s.pool_len):
            self.flush(parent)
        nb = math.ceil(n_tokens / self.block_size)
        return self.add_sequence(prefix_blocks=self.allocator.table(parent)[:nb], prefix_len=n_tokens)

    def flush(self, seq: int) -> None:
        """Write every layer's decode-buffer tokens of ``seq`` to the pool (async, offload stream;
        copy-on-write first if the block they go to is shared). Afterwards ``pool_len == layer_len``
        for every layer. Needed before the sequence's blocks are shared (``fork``,
        ``PrefixCache.insert`` call it). Raises ValueError inside a decode step;
        PoolExhaustedError when a copy-on-write block is needed and none can be freed."""
        s = self._get(seq)
        if s.step is not None:
            raise ValueError(f"flush: sequence {seq} is inside a decode step (call end_step first)")
        layers = [l for l in range(self.num_layers) if s.dec_len[l]]
        if not layers:
            return
        self._make_writable(s, min(s.pool_len[l] for l in layers), max(s.layer_len[l] for l in layers))
        off = self._offload_stream
        off.wait_event(self._sync.record())  # the decode buffer is written on the current stream
        with self._sync.use(off):
            for l in layers:
                self._dec_to_pool(s, l)
        ev = self._sync.record(off)
        for l in layers:
            s.write_ev[l] = ev
            s.flush_ev[l] = ev

    def sequences(self) -> list[int]:
        """Ids of the live (added, not freed) sequences."""
        return list(self._seqs)

    def seq_len(self, seq: int) -> int:
        """Tokens stored for ``seq`` (pool + decode buffer). During a decode step: the length
        before the step (it becomes +1 at ``end_step``). During prefill, before every layer got
        the same chunk: the smallest layer length."""
        s = self._get(seq)
        if s.step is not None:
            return s.step.start_len
        return min(s.layer_len)

    def layer_len(self, seq: int, layer: int) -> int:
        """Tokens stored for one layer of ``seq`` (committed; excludes an open step's new token)."""
        return self._get(seq).layer_len[self._layer(layer)]

    def block_table(self, seq: int) -> tuple[int, ...]:
        """Physical pool block ids of ``seq`` (logical block i -> element i); blocks may be shared
        with other sequences or the prefix cache (``allocator.refcount(b) > 1``)."""
        self._get(seq)
        return self.allocator.table(seq)

    def num_seq_blocks(self, seq: int) -> int:
        """Blocks owned by ``seq`` (valid logical ids for :meth:`fetch_blocks` are 0..this-1)."""
        self._get(seq)
        return len(self.allocator.table(seq))

    @property
    def num_free_blocks(self) -> int:
        """Free pool blocks (reference count 0; blocks only the prefix cache holds are not free
        but are evicted on demand)."""
        return self.allocator.num_free

    # ==================================================================== prefill
    def offload_layer(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append ``T`` tokens of layer ``layer`` to ``seq`` in the host pool, asynchronously.

        Args:
            k, v: ``[T, Hkv, D]`` tensors on the engine's device with the engine's dtype (last dim
                contiguous; other strides allowed). The caller may free or overwrite them right
                after this call: the copy runs on the offload stream after an event recorded on the
                caller's current stream, and the tensors are kept alive until it is done.

        Raises:
            ValueError: unknown/freed seq, bad layer, shape mismatch, device mismatch, called
                during a decode step, the layer would pass ``max_tokens``, or (an fp8 pool with
                ``scale_page > 1``) the layer's length is not a multiple of ``scale_page``.
            TypeError: wrong dtype or not a tensor.
            PoolExhaustedError (ValueError): not enough free blocks (names needed and free).
            Nothing is changed when an error is raised.

        Returns:
            The event recorded on the offload stream after the copy (a no-op event in host mode):
            a stream that waits on it may overwrite ``k``/``v``. Reusing the same staging buffers
            for later layers this way bounds prefill memory by stream order, however far the host
            runs ahead of the GPU (the engine's own reference to ``k``/``v`` is dropped only once
            the host sees the copy done).
        """
        s = self._get(seq)
        l = self._layer(layer)
        if s.step is not None:
            raise ValueError(f"offload_layer: sequence {seq} is inside a decode step (call end_step first)")
        T = self._check_kv("k", k, "v", v, None)
        if T == 0:
            return self._sync.record()
        new_len = s.layer_len[l] + T
        if new_len > self.max_tokens:
            raise ValueError(
                f"offload_layer: layer {l} of sequence {seq} would hold {new_len} tokens "
                f"({s.layer_len[l]} + {T}), more than max_tokens={self.max_tokens}")
        if self.fp8 and self.scale_page > 1 and s.layer_len[l] % self.scale_page:
            raise ValueError(
                f"offload_layer: layer {l} of sequence {seq} holds {s.layer_len[l]} tokens, not a multiple of the "
                f"fp8 pool's scale page ({self.scale_page} tokens): a page's scale is written once, with the page")
        self._make_writable(s, s.pool_len[l], new_len)
        self._pending.prune()
        scales = ()
        if self.fp8:  # quantized on the caller's stream, the codes and scales then copied out
            gran = "token" if self.scale_page == 1 else "page"
            k, ks = quantize_kv_fp8(k, page_size=self.scale_page, granularity=gran)
            v, vs = quantize_kv_fp8(v, page_size=self.scale_page, granularity=gran)
            scales = (ks, vs)
        off = self._offload_stream
        off.wait_event(self._sync.record())
        flushed = s.dec_len[l] > 0
        with self._sync.use(off):
            if flushed:  # tokens decoded since the last full block go first (pool stays in order)
                self._dec_to_pool(s, l)
            self._write_pool(s, l, s.pool_len[l], k, v, *scales)
        ev = self._sync.record(off)
        s.write_ev[l] = ev
        if flushed:
            s.flush_ev[l] = ev
        self._pending.add(ev, k, v, *scales)
        s.pool_len[l] += T
        s.layer_len[l] = new_len
        return ev

    # ===================================================================== decode
    def begin_step(self, seq: int, *, prefetch: bool = True) -> None:
        """Start a decode step of ``seq``: make room for one token and (``prefetch=True``) start
        loading layers ``0..num_buffers-1`` into a ring.

        With ``prefetch=False`` no ring is used: append the new token with :meth:`append_kv` and
        read blocks with :meth:`fetch_blocks` (sparse decode).

        Raises ValueError: seq unknown or already in a step, layers of unequal length, the
        sequence is at ``max_tokens``, an fp8 pool (the batched stores read those; the decode
        buffer and ring hold 16-bit KV); PoolExhaustedError when no block is free for the new token.
        """
        s = self._get(seq)
        if self.fp8:
            raise ValueError("begin_step: the decode buffer and ring read 16-bit pools; this pool stores fp8 codes "
                             "(the batched KV stores read them with their scales)")
        if s.step is not None:
            raise ValueError(f"begin_step: sequence {seq} is already in a decode step")
        if len(set(s.layer_len)) != 1:
            raise ValueError(
                f"begin_step: layers of sequence {seq} hold different token counts {sorted(set(s.layer_len))}; "
                f"offload_layer must give every layer the same tokens before decoding")
        n = s.layer_len[0]
        if n + 1 > self.max_tokens:
            raise ValueError(f"begin_step: sequence {seq} already holds {n} tokens = max_tokens={self.max_tokens}")
        # the new token (and any decode-buffer tokens) will be flushed into these blocks: copy a
        # shared one now, so that end_layer never needs a block (it cannot fail half-way)
        self._make_writable(s, min(s.pool_len), n + 1)
        if s.dec_k is None:
            shape = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
            s.dec_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            s.dec_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._pending.prune()
        ring = self._take_ring() if prefetch else None
        s.step = StepState(n, ring)
        if ring is not None:
            try:
                for l in range(min(self.num_buffers, self.num_layers)):
                    self._load(s, ring, l)
            except BaseException:
                s.step = None
                self._free_rings.append(ring)
                raise

    def layer_kv(self, seq: int, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Append the step's new token to ``layer`` and return all of that layer's K and V.

        Args:
            k_new, v_new: ``[1, Hkv, D]`` (or ``[Hkv, D]``) on the device, engine dtype.
        Returns:
            ``(k, v)``: contiguous device views ``[n_total, Hkv, D]`` (n_total = seq_len after the
            step) of the ring buffer; valid until :meth:`end_layer`. The current stream has been
            made to wait for the layer's load.
        Raises ValueError for a seq not in a prefetching step, layers out of order (layers must go
        0, 1, ..., each ended before the next), bad shapes/device; TypeError for dtype.
        """
        s = self._get(seq)
        step = self._open_layer(s, layer, "layer_kv")
        if step.ring is None:
            raise ValueError("layer_kv: this step was begun with prefetch=False; use append_kv and fetch_blocks")
        kn, vn = self._check_new(k_new, v_new)
        l = layer
        kb, vb = step.ring.acquire(l)
        d = self._append_dec(s, l, kn, vn)
        p = s.pool_len[l]
        kb[p:p + d + 1].copy_(s.dec_k[l, :d + 1])
        vb[p:p + d + 1].copy_(s.dec_v[l, :d + 1])
        step.open = l
        return kb[:p + d + 1], vb[:p + d + 1]

    def append_kv(self, seq: int, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Append the step's new token to ``layer`` without the ring (steps begun with
        ``prefetch=False``). Returns the decode buffer's views ``(k, v)`` ``[m, Hkv, D]`` holding the
        layer's tokens not yet in the pool (the last one is the new token); valid until
        :meth:`end_layer`. Same errors as :meth:`layer_kv`."""
        s = self._get(seq)
        step = self._open_layer(s, layer, "append_kv")
        if step.ring is not None:
            raise ValueError("append_kv: this step prefetches layers; use layer_kv (or begin_step(prefetch=False))")
        kn, vn = self._check_new(k_new, v_new)
        d = self._append_dec(s, layer, kn, vn)
        step.open = layer
        return s.dec_k[layer, :d + 1], s.dec_v[layer, :d + 1]

    def end_layer(self, seq: int, layer: int) -> None:
        """Finish ``layer`` of the current step: record compute-done on the current stream (its
        ring slot may then be refilled with layer ``layer + num_buffers``), commit the new token,
        and flush the decode buffer to the pool asynchronously when it completes a block.

        Raises ValueError if ``layer`` is not the open layer of ``seq``'s step."""
        s = self._get(seq)
        step = s.step
        if step is None or step.open != layer:
            raise ValueError(
                f"end_layer: layer {layer} of sequence {seq} is not open (call layer_kv/append_kv first; "
                f"open layer: {None if step is None else step.open})")
        l = layer
        if step.ring is not None:
            step.ring.release(l)
        s.dec_len[l] += 1
        s.layer_len[l] += 1
        step.open = None
        step.next_layer = l + 1
        if s.layer_len[l] % self.block_size == 0:
            off = self._offload_stream
            off.wait_event(self._sync.record())
            with self._sync.use(off):
                self._dec_to_pool(s, l)
            ev = self._sync.record(off)
            s.write_ev[l] = ev
            s.flush_ev[l] = ev
        if step.ring is not None and l + self.num_buffers < self.num_layers:
            self._load(s, step.ring, l + self.num_buffers)

    def end_step(self, seq: int) -> None:
        """Finish the decode step (after the last layer's ``end_layer``); seq_len grows by one and
        the ring is returned for the next step. ValueError if layers are missing."""
        s = self._get(seq)
        step = s.step
        if step is None:
            raise ValueError(f"end_step: sequence {seq} is not in a decode step")
        if step.next_layer != self.num_layers or step.open is not None:
            raise ValueError(
                f"end_step: sequence {seq} finished {step.next_layer} of {self.num_layers} layers")
        if step.ring is not None:
            self._free_rings.append(step.ring)
        s.step = None

    # ===================================================================== sparse
    def fetch_blocks(self, seq: int, layer: int, block_ids):
        """Gather logical blocks of one layer into new device tensors, in one step.

        Args:
            block_ids: logical block indices of ``seq`` (0 = its first ``block_size`` tokens), any
                order, repeats allowed: a list/tuple of ints or a 1-D integer tensor. A CUDA tensor
                is read on the host (the host waits for the current stream); pass a host list to
                avoid that.
        Returns:
            ``(k, v)`` device tensors ``[len(block_ids) * block_size, Hkv, D]``; block i of the
            output is logical block ``block_ids[i]``. Tokens still in the decode buffer (including
            an open step's new token) are included; rows past the layer's last token are zero.
            Runs on the current stream, which waits for the layer's pool writes. Pinned CUDA pools
            use the Triton gather kernel (reads pinned memory directly).
        Raises:
            ValueError: unknown/freed seq, bad layer, a block id the sequence does not own.
            TypeError: block_ids of a non-integer type.
        """
        s = self._get(seq)
        l = self._layer(layer)
        ids = self._ids(block_ids)
        table = self.allocator.table(seq)
        bad = [b for b in ids if not 0 <= b < len(table)]
        if bad:
            raise ValueError(
                f"fetch_blocks: block(s) {bad[:8]} not owned by sequence {seq} (it owns logical blocks "
                f"0..{len(table) - 1})" if table else
                f"fetch_blocks: block(s) {bad[:8]} not owned by sequence {seq} (it owns no blocks)")
        bs, n = self.block_size, len(ids)
        shape = (n * bs, self.num_kv_heads, self.head_dim)
        out_k = torch.empty(shape, dtype=self.dtype, device=self.device)
        out_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        if n == 0:
            return out_k, out_v
        self._pending.prune()
        cur = self._sync.current()
        if s.write_ev[l] is not None:
            cur.wait_event(s.write_ev[l])
        phys = [table[b] for b in ids]
        if self.fp8:  # codes and scales gathered, dequantized into the outputs
            out_k, out_v = self._gather_fp8(l, phys)
        else:
            self._gather(l, phys, out_k.view(n, bs, self.num_kv_heads, self.head_dim),
                         out_v.view(n, bs, self.num_kv_heads, self.head_dim))
        # tokens not in the pool: decode buffer rows, then zeros
        p = s.pool_len[l]
        live = s.layer_len[l] + (1 if (s.step is not None and s.step.open == l) else 0)
        for i, b in enumerate(ids):
            b0 = b * bs
            if b0 + bs <= p:
                continue
            a = max(p, b0)
            e = min(live, b0 + bs)
            if e > a:
                out_k[i * bs + a - b0:i * bs + e - b0].copy_(s.dec_k[l, a - p:e - p])
                out_v[i * bs + a - b0:i * bs + e - b0].copy_(s.dec_v[l, a - p:e - p])
            z = max(e, a) - b0
            if z < bs:
                out_k[i * bs + z:(i + 1) * bs].zero_()
                out_v[i * bs + z:(i + 1) * bs].zero_()
        return out_k, out_v

    # ================================================================== lifecycle
    def free(self, seq: int) -> None:
        """Drop one reference to each block of ``seq`` (a block returns to the free list when no
        other sequence nor the prefix cache holds it) and every record of ``seq`` (an open step is
        abandoned; the ring returns to the engine). Later use of ``seq`` raises ValueError."""
        s = self._get(seq)
        cur_ev = self._sync.record()
        if s.step is not None and s.step.ring is not None:
            s.step.ring.release_all()
            self._free_rings.append(s.step.ring)
        s.step = None
        off = self._offload_stream
        # the offload stream is the only pool writer: order later writes after in-flight reads
        off.wait_event(cur_ev)
        for ring in self._rings:
            for st in ring.load_streams():
                off.wait_event(self._sync.record(st))
        if s.dec_k is not None:
            self._pending.add(self._sync.record(off), s.dec_k, s.dec_v)
        self.allocator.free(seq)
        del self._seqs[seq]

    def reclaim(self) -> None:
        """Drop the engine's references to K/V tensors whose D2H copies have finished
        (non-blocking event queries), so their GPU memory can be reused. :meth:`offload_layer`
        does this itself; call it before allocating the next layer's buffers to keep one
        layer's K/V, not two, alive during a layerwise prefill."""
        self._pending.prune()

    def release_ring_buffers(self) -> int:
        """Free the GPU ring buffers of rings no decode step holds (they are re-created, fresh,
        by the next step). Returns the bytes released. Between requests this takes the ring's
        ``num_buffers x 2 x round_up(max_tokens, block_size) x Hkv x D`` elements off the GPU
        while a long prefill runs. The current stream first waits for the rings' load streams,
        so no copy into the freed memory can still be running when it is reused."""
        freed = 0
        cur = self._sync.current()
        for ring in self._free_rings:
            for st in ring.load_streams():
                cur.wait_stream(st)
            freed += ring.nbytes()
            self._rings.remove(ring)
        self._free_rings = []
        return freed

    def reset(self) -> None:
        """Free every sequence (the pool and rings are kept for reuse)."""
        for sid in list(self._seqs):
            self.free(sid)
        self._pending.prune()

    def host_kv(self, seq: int, layer: int):
        """Debug/test accessor: the layer's committed tokens as CPU tensors ``[layer_len, Hkv, D]``.

        Blocks the host until the layer's pending pool writes are done (event wait) and reads the
        decode buffer with a blocking copy. Not for the hot path."""
        s = self._get(seq)
        l = self._layer(layer)
        if s.write_ev[l] is not None:
            s.write_ev[l].synchronize()
        table = self.allocator.table(seq)
        ks, vs = [], []
        for phys, _, m in block_runs(table, 0, s.pool_len[l], self.block_size):
            if self.fp8:
                ks.append(self._dequant_rows(l, phys, m, "k"))
                vs.append(self._dequant_rows(l, phys, m, "v"))
                continue
            ks.append(self.pool.k_rows(l)[phys:phys + m].to("cpu", copy=True))
            vs.append(self.pool.v_rows(l)[phys:phys + m].to("cpu", copy=True))
        d = s.dec_len[l]
        if d:
            ks.append(s.dec_k[l, :d].to("cpu"))
            vs.append(s.dec_v[l, :d].to("cpu"))
        empty = torch.empty(0, self.num_kv_heads, self.head_dim, dtype=self.dtype)
        return (torch.cat(ks) if ks else empty), (torch.cat(vs) if vs else empty.clone())

    def close(self) -> None:
        """Wait (event waits) for the engine's in-flight copies, then unregister and drop the pool."""
        if self._closed:
            return
        self._closed = True
        evs = [self._sync.record(), self._sync.record(self._offload_stream)]
        for ring in self._rings:
            evs.extend(self._sync.record(st) for st in ring.load_streams())
        for ev in evs:
            ev.synchronize()
        self._pending.wait_all()
        self._seqs.clear()
        self.allocator.reset()
        self._rings, self._free_rings = [], []
        self.pool.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ================================================================== internals
    def _check_open(self):
        if self._closed:
            raise ValueError("the OffloadRuntime is closed")

    def _get(self, seq) -> SeqState:
        self._check_open()
        check_int("sequence id (from add_sequence())", seq)
        s = self._seqs.get(seq)
        if s is None:
            if 0 <= seq < self._next_id:
                raise ValueError(f"sequence {seq} was freed")
            raise ValueError(f"unknown sequence {seq} (not returned by add_sequence)")
        return s

    def _layer(self, layer) -> int:
        return check_int("layer", layer, 0, self.num_layers - 1, type_error=ValueError)

    def _check_kv(self, kn, k, vn, v, tokens):
        for name, t in ((kn, k), (vn, v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {t.dtype}; this engine stores {self.dtype}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must be [T, {self.num_kv_heads}, {self.head_dim}] (tokens, kv heads, head_dim), "
                    f"got {tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; this engine's device is {self.device}")
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dim, got strides {tuple(t.stride())}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"{kn} has {k.shape[0]} tokens but {vn} has {v.shape[0]}")
        if tokens is not None and k.shape[0] != tokens:
            raise ValueError(f"{kn}/{vn} must hold {tokens} token(s), got {k.shape[0]}")
        return k.shape[0]

    def _check_new(self, k_new, v_new):
        if isinstance(k_new, torch.Tensor) and k_new.dim() == 2:
            k_new = k_new.unsqueeze(0)
        if isinstance(v_new, torch.Tensor) and v_new.dim() == 2:
            v_new = v_new.unsqueeze(0)
        self._check_kv("k_new", k_new, "v_new", v_new, 1)
        return k_new, v_new

    def _open_layer(self, s, layer, what):
        step = s.step
        if step is None:
            raise ValueError(f"{what}: sequence {s.id} is not in a decode step (call begin_step first)")
        l = self._layer(layer)
        if step.open is not None:
            raise ValueError(f"{what}: layer {step.open} of sequence {s.id} is still open (call end_layer first)")
        if l != step.next_layer:
            raise ValueError(f"{what}: expected layer {step.next_layer} of sequence {s.id}, got {l} (layers go in order)")
        return step

    def _append_dec(self, s, l, kn, vn) -> int:
        """Write the new token into the decode buffer on the current stream; returns its row."""
        if s.flush_ev[l] is not None:
            self._sync.current().wait_event(s.flush_ev[l])
        d = s.dec_len[l]
        s.dec_k[l, d].copy_(kn[0])
        s.dec_v[l, d].copy_(vn[0])
        return d

    def _uniform_len(self, s, what) -> int:
        if s.step is not None:
            raise ValueError(f"{what}: sequence {s.id} is inside a decode step (call end_step first)")
        if len(set(s.layer_len)) != 1:
            raise ValueError(
                f"{what}: layers of sequence {s.id} hold different token counts {sorted(set(s.layer_len))}; "
                f"give every layer the same tokens first")
        return s.layer_len[0]

    def _make_writable(self, s, start, end):
        """Before ``s`` writes token rows ``[start, end)`` of any layer: blocks up to ``end`` exist
        and none of those rows' blocks is shared (a shared one is copied, all layers, into a fresh
        block: copy-on-write). All or nothing: room for every new block is made first."""
        if end <= start:
            return
        bs = self.block_size
        alloc = self.allocator
        table = alloc.table(s.id)
        shared = [i for i in range(start // bs, min(len(table), math.ceil(end / bs)))
                  if alloc.is_shared(table[i])]
        grow = max(0, math.ceil(end / bs) - len(table))
        alloc.ensure_free(len(shared) + grow, s.id)
        for i in shared:
            old, new = alloc.replace_block(s.id, i)
            self._copy_block(s, old, new)
        if grow:
            alloc.allocate(s.id, grow)

    def _copy_block(self, s, old, new):
        """Copy physical block ``old`` to ``new`` in every layer (K and V) for ``s``.

        CUDA: on the offload stream (the only pool writer, so it runs after every pending write
        of ``old``), bounced through a device buffer (a host-to-host copy of torch is not stream
        ordered); ``s``'s reads then wait on the recorded event (``write_ev`` of every layer).
        Host mode: a plain copy."""
        pool = self.pool
        self.cow_copies += 1
        parts = [(pool.k, pool.v)] + ([(pool.k_scale, pool.v_scale)] if self.fp8 else [])  # scales move with codes
        if self.device.type == "cpu":
            for l in range(self.num_layers):
                for pk, pv in parts:
                    pk[l][new].copy_(pk[l][old])
                    pv[l][new].copy_(pv[l][old])
            return
        off = self._offload_stream
        tmps = []
        with self._sync.use(off):
            for pk, pv in parts:
                tmp = torch.empty((2,) + tuple(pk[0].shape[1:]), dtype=pk[0].dtype, device=self.device)
                tmps.append(tmp)
                for l in range(self.num_layers):  # one bounce buffer, reused in stream order
                    tmp[0].copy_(pk[l][old], non_blocking=True)
                    tmp[1].copy_(pv[l][old], non_blocking=True)
                    pk[l][new].copy_(tmp[0], non_blocking=True)
                    pv[l][new].copy_(tmp[1], non_blocking=True)
        ev = self._sync.record(off)
        self._pending.add(ev, *tmps)
        for l in range(self.num_layers):
            s.write_ev[l] = ev

    def _write_pool(self, s, l, start, k, v, ks=None, vs=None):
        """Enqueue copies of k/v (token 0 = sequence token ``start``) into the pool, one per run;
        for an fp8 pool k/v are codes and ``ks`` / ``vs`` their scales (a row per ``scale_page``
        tokens, ``start`` on a page boundary)."""
        table = self.allocator.table(s.id)
        pk, pv = self.pool.k_rows(l), self.pool.v_rows(l)
        p = self.scale_page
        for phys, t, m in block_runs(table, start, start + k.shape[0], self.block_size):
            a = t - start
            pk[phys:phys + m].copy_(k[a:a + m], non_blocking=True)
            pv[phys:phys + m].copy_(v[a:a + m], non_blocking=True)
            if ks is not None:  # runs start on block (so page) boundaries after an aligned start
                r0, r1, a0 = phys // p, -(-(phys + m) // p), a // p
                self.pool.k_scale_rows(l)[r0:r1].copy_(ks[a0:a0 + r1 - r0], non_blocking=True)
                self.pool.v_scale_rows(l)[r0:r1].copy_(vs[a0:a0 + r1 - r0], non_blocking=True)

    def _dec_to_pool(self, s, l):
        """Copy the decode buffer of layer l into the pool (on the current = offload stream)."""
        d = s.dec_len[l]
        self._write_pool(s, l, s.pool_len[l], s.dec_k[l, :d], s.dec_v[l, :d])
        s.flush_ev[l] = None  # replaced by the caller's event
        s.pool_len[l] += d
        s.dec_len[l] = 0

    def _take_ring(self) -> LayerRing:
        if self._free_rings:
            return self._free_rings.pop()
        ring = LayerRing(self.num_buffers, self.buffer_tokens, self.num_kv_heads, self.head_dim,
                         dtype=self.dtype, device=self.device)
        self._rings.append(ring)
        return ring

    def _load(self, s, ring, l):
        def fill(kb, vb):
            self._read_layer(s, l, kb, vb)
        ring.load(l, fill, (s.write_ev[l],))

    def _read_layer(self, s, l, kb, vb):
        """Enqueue on the current stream: the layer's pool tokens -> kb/vb rows [0, pool_len)."""
        n = s.pool_len[l]
        if n == 0:
            return
        bs = self.block_size
        table = self.allocator.table(s.id)
        runs = block_runs(table, 0, n, bs)
        small = min(m for _, _, m in runs) * self.pool.block_bytes // bs < _MIN_COPY_BYTES
        if self.use_gather and len(runs) > 1 and small:
            nb = math.ceil(n / bs)
            shp = (nb, bs, self.num_kv_heads, self.head_dim)
            self._gather(l, table[:nb], kb[:nb * bs].view(shp), vb[:nb * bs].view(shp))
            return
        pk, pv = self.pool.k_rows(l), self.pool.v_rows(l)
        for phys, t, m in runs:
            kb[t:t + m].copy_(pk[phys:phys + m], non_blocking=True)
            vb[t:t + m].copy_(pv[phys:phys + m], non_blocking=True)

    def _gather(self, l, phys, out_k, out_v, src=None):
        """Blocks ``phys`` of layer l -> out_k/out_v ``[n, bs, Hkv, D]`` on the current stream
        (``src``: other per-block tensors ``(k, v)`` of the layer, e.g. an fp8 pool's scales)."""
        sk, sv = (self.pool.k[l], self.pool.v[l]) if src is None else src
        if self.device.type == "cpu":
            idx = torch.tensor(phys, dtype=torch.int64)
            gather_blocks(sk, sv, idx, out_k, out_v, backend="torch")
            return
        if not self.use_gather:
            for i, b in enumerate(phys):  # one copy per block (unpinned pool)
                out_k[i].copy_(sk[b], non_blocking=True)
                out_v[i].copy_(sv[b], non_blocking=True)
            return
        # ids go H2D on the current stream from pinned staging (a pageable copy would wait for
        # the stream); the index tensor is allocated and used on this stream only
        host = torch.tensor(list(phys), dtype=torch.int32).pin_memory()
        idx = host.to(self.device, non_blocking=True)
        gather_blocks(sk, sv, idx, out_k, out_v, backend="triton")

    def _gather_fp8(self, l, phys):
        """Blocks ``phys`` of layer l of an fp8 pool, dequantized: ``(k, v)`` ``[n * bs, Hkv, D]``
        in ``dtype`` on the device (current stream)."""
        n, bs, h, d, p = len(phys), self.block_size, self.num_kv_heads, self.head_dim, self.scale_page
        codes = [torch.empty((n, bs, h, d), dtype=torch.uint8, device=self.device) for _ in range(2)]
        sc = [torch.empty((n, bs // p, h), dtype=torch.float32, device=self.device) for _ in range(2)]
        pool = self.pool
        self._gather(l, phys, codes[0], codes[1], src=([t.view(torch.uint8) for t in (pool.k[l], pool.v[l])]))
        self._gather(l, phys, sc[0], sc[1], src=(pool.k_scale[l], pool.v_scale[l]))
        gran = "token" if p == 1 else "page"
        return tuple(dequantize_kv_fp8(c.view(FP8_DTYPE).view(n * bs, h, d), s_.view(-1, h), self.dtype,
                                       page_size=p, granularity=gran) for c, s_ in zip(codes, sc))

    def _dequant_rows(self, l, row, m, which):
        """Host copy of rows ``[row, row + m)`` of layer l's K or V of an fp8 pool, dequantized."""
        p = self.scale_page
        codes = (self.pool.k_rows(l) if which == "k" else self.pool.v_rows(l))[row:row + m].to("cpu", copy=True)
        srows = (self.pool.k_scale_rows(l) if which == "k" else self.pool.v_scale_rows(l))
        sc = srows[row // p:-(-(row + m) // p)].to("cpu", copy=True)
        return dequantize_kv_fp8(codes, sc, self.dtype, page_size=p, granularity="token" if p == 1 else "page")

    @staticmethod
    def _ids(block_ids) -> list[int]:
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
                raise TypeError(f"block_ids must be integers, got dtype {block_ids.dtype}")
            if block_ids.dim() != 1:
                raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
            return [int(x) for x in block_ids.tolist()]
        try:
            ids = list(block_ids)
        except TypeError:
            raise TypeError(f"block_ids must be a list of ints or a 1-D integer tensor, got {type(block_ids).__name__}") from None
        return [check_int("block_ids entry", x) for x in ids]
