"""LayerRing: N device buffers that each hold one layer's K and V.

Layer ``l`` lives in slot ``l % N``. Per slot: a load stream, a load-done event and a compute-done
event. A load first makes its stream wait on the slot's compute-done event (so a buffer is never
refilled while compute may still read it) and on the caller's extra events (e.g. the pool writes
of that layer), then runs the fill on that stream and records load-done. ``acquire`` makes the
caller's current stream wait on load-done; ``release`` records compute-done on the current stream.
Any N >= 1 works, whether or not it divides the layer count.
"""
from __future__ import annotations

import torch

from ..kernels.checks import check_int
from .streams import Sync


class _Slot:
    __slots__ = ("k", "v", "stream", "load_done", "compute_done", "layer", "in_use")

    def __init__(self):
        self.k = self.v = None
        self.stream = None
        self.load_done = None
        self.compute_done = None
        self.layer = None
        self.in_use = False


class LayerRing:
    """Ring of ``num_buffers`` layer buffers of ``buffer_tokens`` rows each.

    Args:
        num_buffers: N >= 1.
        buffer_tokens: rows per buffer (tokens of one layer of one sequence).
        num_kv_heads, head_dim, dtype, device: buffer shape ``[buffer_tokens, Hkv, D]`` for K and V.

    Buffers are allocated lazily on a slot's first load (N larger than the layer count costs
    nothing). Misuse raises RuntimeError: loading a slot that is acquired and not yet released,
    acquiring a layer that is not the one loaded in its slot.
    """

    def __init__(self, num_buffers: int, buffer_tokens: int, num_kv_heads: int, head_dim: int, *,
                 dtype=torch.bfloat16, device="cpu"):
        check_int("num_buffers", num_buffers, 1, type_error=ValueError)
        check_int("buffer_tokens", buffer_tokens, 1, type_error=ValueError)
        self.num_buffers = num_buffers
        self.buffer_tokens = buffer_tokens
        self.shape = (buffer_tokens, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self._sync = Sync(self.device)
        self._slots = [_Slot() for _ in range(num_buffers)]
        self.loads = 0  # number of load() calls, for tests and stats

    def nbytes(self) -> int:
        """GPU bytes held by the slots allocated so far (K and V)."""
        return sum(x.numel() * x.element_size() for sl in self._slots for x in (sl.k, sl.v) if x is not None)

    def slot_of(self, layer: int) -> int:
        """Slot index of ``layer`` (``layer % num_buffers``)."""
        return layer % self.num_buffers

    def holds(self, layer: int) -> bool:
        """Whether ``layer``'s slot was last loaded with ``layer``."""
        return self._slots[self.slot_of(layer)].layer == layer

    def load_streams(self):
        """The load streams of the slots created so far."""
        return [s.stream for s in self._slots if s.stream is not None]

    def load(self, layer: int, fill, wait_for=()) -> None:
        """Refill ``layer``'s slot: ``fill(k_buf, v_buf)`` runs on the slot's load stream after that
        stream waits on the slot's compute-done event and on every event in ``wait_for``.

        ``fill`` must only enqueue work on the current stream (it is the load stream).
        Raises RuntimeError if the slot is acquired and not released.
        """
        s = self._slots[self.slot_of(layer)]
        if s.in_use:
            raise RuntimeError(
                f"ring slot {self.slot_of(layer)} still holds layer {s.layer} in use (acquired, not "
                f"released); cannot load layer {layer} into it"
            )
        if s.k is None:
            s.k = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            s.v = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            s.stream = self._sync.stream()
            s.load_done = self._sync.event()
            s.compute_done = self._sync.event()
            # The buffers come from the caching allocator on the current stream: their memory may
            # have been freed there by work still queued (a prefill the host ran ahead of). The
            # load stream writes them, so it first waits for everything queued so far.
            s.stream.wait_stream(self._sync.current())
        st = s.stream
        st.wait_event(s.compute_done)  # no-op if never recorded
        for ev in wait_for:
            if ev is not None:
                st.wait_event(ev)
        with self._sync.use(st):
            fill(s.k, s.v)
        s.load_done.record(st)
        s.layer = layer
        self.loads += 1

    def acquire(self, layer: int):
        """Make the current stream wait for ``layer``'s load; return the slot's full ``(k, v)``
        buffers ``[buffer_tokens, Hkv, D]``. Raises RuntimeError if the slot holds another layer
        or is already acquired."""
        s = self._slots[self.slot_of(layer)]
        if s.layer != layer:
            raise RuntimeError(f"layer {layer} is not loaded (its slot {self.slot_of(layer)} holds layer {s.layer})")
        if s.in_use:
            raise RuntimeError(f"layer {layer} is already acquired")
        self._sync.current().wait_event(s.load_done)
        s.in_use = True
        return s.k, s.v

    def release(self, layer: int) -> None:
        """Record compute-done for ``layer``'s slot on the current stream; the slot may be refilled
        after everything enqueued so far on that stream has run. RuntimeError if not acquired."""
        s = self._slots[self.slot_of(layer)]
        if s.layer != layer or not s.in_use:
            raise RuntimeError(f"layer {layer} is not acquired")
        s.compute_done.record(self._sync.current())
        s.in_use = False

    def release_all(self) -> None:
        """Release every acquired slot (compute-done recorded on the current stream)."""
        for s in self._slots:
            if s.in_use:
                s.compute_done.record(self._sync.current())
                s.in_use = False

    def in_use(self) -> list[int]:
        """Layers currently acquired."""
        return [s.layer for s in self._slots if s.in_use]
