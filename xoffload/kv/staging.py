"""Staging between the offload runtime's pinned pool and the GPU: the buffers a layerwise prefill
writes each layer's K/V into before they are copied out to the pool (:class:`PrefillStaging`),
the two buffers dense decode copies each layer's prompt blocks into ahead of its attention
(:class:`LayerStaging`), and a reused prefix read back one layer ahead of a prefill past it
(:class:`PrefixReader`)."""
from __future__ import annotations

import contextlib

import torch

from ..kernels import gather_blocks
from ..kernels.checks import check_int

__all__ = ["PrefillStaging", "LayerStaging", "PrefixReader"]


class PrefillStaging:
    """The K/V staging buffers of a layerwise prefill that copies each layer out to the offload
    pool. Before a buffer is refilled the current stream waits (on the GPU, not the host) for its
    previous copy, so the host may run layers ahead without prefill memory growing (fresh buffers
    per layer grew by one layer's K/V per layer of host run-ahead). The buffers grow to the
    longest ``T`` asked for (the engine keeps replaced ones alive until their copies end).

    One buffer by default: layer ``l``'s D2H copy starts after its attention and runs beside its
    output projection and MLP, which take ~7x longer than the copy on the 8B shape (0.59 vs 0.08 us
    a token) and longer on every shape measured, so layer ``l + 1`` finds the buffer free; a second
    buffer only added one layer's K/V to prefill's peak (0.54 GB at 128K on the 8B shape).

    Args: ``num_kv_heads``, ``head_dim``, ``dtype``, ``device`` of the K/V; ``num_buffers`` (1 or
    more) buffers used in turn by layer. Raises ValueError for ``num_buffers < 1``."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype, device, num_buffers: int = 1):
        self.hkv, self.d, self.dtype, self.device = num_kv_heads, head_dim, dtype, torch.device(device)
        self.n = check_int("num_buffers", num_buffers, 1)
        self.clear()

    def buffers(self, engine, layer: int, T: int):
        """``(k, v)`` ``[T, Hkv, D]`` views for layer ``layer``, ordered after the previous copy out
        of the same buffer; also lets ``engine`` drop its references to finished copies."""
        engine.reclaim()
        if self._buf is None or self._buf[0][0].shape[0] < T:
            shape = (T, self.hkv, self.d)
            self._buf = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                          torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(self.n)]
            self._ev = [None] * self.n
        ev = self._ev[layer % self.n]
        if ev is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(ev)
        k, v = self._buf[layer % self.n]
        return k[:T], v[:T]

    def copied(self, layer: int, ev) -> None:
        """``ev``: the event after which layer ``layer``'s buffer has been copied out."""
        self._ev[layer % self.n] = ev

    def clear(self) -> None:
        """Drop the buffers (the prefill is over; the engine holds the sources until copied)."""
        self._buf, self._ev = None, [None] * self.n


class LayerStaging:
    """Decode's copy of each layer's prompt blocks from the pinned pool into one of two GPU
    buffers, one layer ahead of the layer that reads them, all on the device (CUDA-graph safe).

    A step (:meth:`begin`) starts the copies of layers 0 and 1; :meth:`acquire` of layer ``l``
    makes the current stream wait for its copy and hands its buffer; :meth:`release` of ``l``, once
    the reads of that buffer are enqueued, starts layer ``l + 2``'s copy into it. On CUDA the
    copies run on a copy stream of their own, ordered by events recorded on the streams (no host
    wait), so layer ``l + 1``'s copy crosses PCIe while layer ``l`` computes; each copy is one
    :func:`~xoffload.kernels.gather_blocks` launch reading the pinned pool over UVA
    (``cudaMemcpyAsync`` from ``cudaHostRegister``-ed memory cannot be captured by torch). Off CUDA
    the copy runs inline on the host.

    Args:
        pool: the pinned :class:`~xoffload.runtime.pool.CpuKVPool` (``k[layer]`` / ``v[layer]``:
            contiguous ``[num_blocks, block, Hkv, D]``).
        num_blocks: ``N``, staged blocks per layer (the length of :attr:`ids`, >= 1).
        num_layers: layers of a step.
        device: where the buffers live.
        skip_negative: negative entries of :attr:`ids` copy nothing (their staged block keeps
            what it held); otherwise every entry must be a valid pool block.

    An fp8 pool's scales (``pool.k_scale`` / ``v_scale``) are staged beside the codes, one more
    gather launch per layer (:meth:`scales`).

    Attributes:
        k, v: per buffer (2), the staged K / V ``[N, block, Hkv, D]`` of the pool's dtype
            (zeroed at first).
        k_scale, v_scale: fp8 pools: per buffer, the staged scales ``[N, block // scale_page,
            Hkv]`` fp32; else None.
        ids: int32 ``[N]`` on ``device``, the pool block copied into each staged block; the owner
            writes it before the steps that read it (stream-ordered on the current stream).
        nbytes: bytes of the two buffers.
    Raises:
        ValueError for ``num_blocks < 1``; torch.OutOfMemoryError when the buffers do not fit.
    """

    def __init__(self, pool, num_blocks: int, num_layers: int, device, *, skip_negative: bool = False):
        self.pool, self.n, self.L = pool, check_int("num_blocks", num_blocks, 1), int(num_layers)
        self.device, self.skip = torch.device(device), bool(skip_negative)
        shape = (self.n,) + tuple(pool.k[0].shape[1:])
        self.k = [torch.zeros(shape, dtype=pool.k[0].dtype, device=self.device) for _ in range(2)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.fp8 = bool(getattr(pool, "fp8", False))
        self.k_scale = self.v_scale = None
        if self.fp8:
            sshape = (self.n,) + tuple(pool.k_scale[0].shape[1:])
            self.k_scale = [torch.ones(sshape, dtype=torch.float32, device=self.device) for _ in range(2)]
            self.v_scale = [torch.ones_like(t) for t in self.k_scale]
        self.ids = torch.full((self.n,), -1 if self.skip else 0, dtype=torch.int32, device=self.device)
        self.nbytes = 4 * self.k[0].numel() * self.k[0].element_size() + (4 * self.k_scale[0].numel() * 4 if self.fp8 else 0)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() for _ in range(self.L)] if cuda else []
        self._freed = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._count = self.n

    def begin(self, count: int | None = None) -> None:
        """Start of a step: copy the first ``count`` entries of :attr:`ids` (default all) for every
        layer of the step; the copy stream first waits for the current stream (the step's inputs
        and the ids written before it)."""
        self._count = self.n if count is None else int(count)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for layer in range(min(2, self.L)):
            self._stage(layer)

    def _stage(self, layer: int) -> None:
        c, i = self._count, layer & 1
        cs = self._stream
        with torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext():
            pk, pv, ok, ov = self.pool.k[layer], self.pool.v[layer], self.k[i][:c], self.v[i][:c]
            if self.fp8:  # codes as bytes (no fp8 index ops on the CPU), then the scales
                pk, pv, ok, ov = (t.view(torch.uint8) for t in (pk, pv, ok, ov))
                gather_blocks(self.pool.k_scale[layer], self.pool.v_scale[layer], self.ids[:c], self.k_scale[i][:c],
                              self.v_scale[i][:c], skip_negative=self.skip)
            gather_blocks(pk, pv, self.ids[:c], ok, ov, skip_negative=self.skip)
            if cs is not None:
                self._copied[layer].record(cs)

    def acquire(self, layer: int):
        """``(k, v)`` ``[N, block, Hkv, D]``: layer ``layer``'s staged blocks, the current stream
        ordered after their copy."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[layer])
        return self.k[layer & 1], self.v[layer & 1]

    def scales(self, layer: int):
        """fp8 pools: ``(k_scale, v_scale)`` ``[N, block // scale_page, Hkv]`` of layer ``layer``'s
        staged blocks (call after :meth:`acquire`, which orders the current stream after them)."""
        return self.k_scale[layer & 1], self.v_scale[layer & 1]

    def release(self, layer: int) -> None:
        """Layer ``layer``'s reads of its buffer are enqueued: the buffer takes layer ``layer + 2``
        (its copy waits for those reads)."""
        if layer + 2 >= self.L:
            return
        if self._stream is not None:
            ev = self._freed[layer & 1]
            ev.record(torch.cuda.current_stream(self.device))
            self._stream.wait_event(ev)
        self._stage(layer + 2)


class PrefixReader:
    """The K/V of a sequence's first ``n_tokens`` tokens, read back from the offload pool layer by
    layer for a prefill that continues them (a follow-up over a cached conversation, a chunk after
    the chunks before it), each layer's read started while the layer before it computes.

    :meth:`get` of layer ``l`` hands that layer's prefix (read ahead, or now if it was not) and
    starts layer ``l + 1``'s read: :meth:`~xoffload.runtime.OffloadRuntime.fetch_blocks` (the
    gather kernel over the pinned pool; it waits for the layer's pool writes itself) on a copy
    stream of its own, behind an event the current stream waits on in the next :meth:`get`. A
    prefill's layers come in order, so every read but the first overlaps a layer's compute; a
    follow-up's prefill is bound by these reads (8B shape, 32K tokens: 4.3 GB over PCIe). Off
    CUDA the read runs at once, in the same order. Memory: one more layer's prefix on the device.

    Args:
        engine: the :class:`~xoffload.runtime.OffloadRuntime`; seq: its sequence id;
        n_tokens: tokens of the prefix (>= 1); num_layers: the model's layers.
    """

    def __init__(self, engine, seq: int, n_tokens: int, num_layers: int):
        self.eng, self.seq, self.n, self.L = engine, seq, check_int("n_tokens", n_tokens, 1), int(num_layers)
        self.ids = list(range(-(-self.n // engine.block_size)))
        dev = torch.device(engine.device)
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._next = None  # (layer, k, v, event)
        self.reads_ahead = 0  # layers handed from a read started before they were asked for

    def _start(self, layer: int):
        cs = self._stream
        if cs is None:
            return (layer,) + tuple(self.eng.fetch_blocks(self.seq, layer, self.ids)) + (None,)
        with torch.cuda.stream(cs):
            k, v = self.eng.fetch_blocks(self.seq, layer, self.ids)
            ev = torch.cuda.Event()
            ev.record(cs)
        return layer, k, v, ev

    def get(self, layer: int):
        """``(k, v)`` ``[n_tokens, Hkv, D]`` of ``layer``'s prefix on the device, the current stream
        ordered after their read; starts layer ``layer + 1``'s read. Raises what ``fetch_blocks``
        raises."""
        got, self._next = self._next, None
        if got is not None and got[0] == layer:
            self.reads_ahead += 1
        else:
            got = (layer,) + tuple(self.eng.fetch_blocks(self.seq, layer, self.ids)) + (None,)
        _, k, v, ev = got
        if ev is not None:  # read on the copy stream: order the current stream after it
            cur = torch.cuda.current_stream(k.device)
            cur.wait_event(ev)
            k.record_stream(cur)
            v.record_stream(cur)
        if layer + 1 < self.L:
            self._next = self._start(layer + 1)
        return k[:self.n], v[:self.n]
