"""Prefill staging: the GPU buffers a layerwise prefill writes each layer's K/V into before they
are copied out to the offload runtime's pinned pool."""
from __future__ import annotations

import torch

from ..kernels.checks import check_int

__all__ = ["PrefillStaging"]


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
