"""Per-sequence and per-decode-step bookkeeping of :class:`~xoffload.runtime.OffloadRuntime`
(plain slotted records; the engine owns every mutation)."""
from __future__ import annotations


class StepState:
    __slots__ = ("start_len", "ring", "next_layer", "open")

    def __init__(self, start_len, ring):
        self.start_len = start_len
        self.ring = ring
        self.next_layer = 0
        self.open = None  # layer whose new token was appended and not yet ended


class SeqState:
    __slots__ = ("id", "layer_len", "pool_len", "dec_len", "write_ev", "flush_ev", "dec_k", "dec_v",
                 "step")

    def __init__(self, sid, num_layers):
        self.id = sid
        self.layer_len = [0] * num_layers  # tokens stored per layer (pool + decode buffer)
        self.pool_len = [0] * num_layers   # of which in the host pool
        self.dec_len = [0] * num_layers    # of which in the GPU decode buffer
        self.write_ev = [None] * num_layers  # last pool write (prefill D2H or flush) per layer
        self.flush_ev = [None] * num_layers  # last flush read of the decode buffer per layer
        self.dec_k = None  # [num_layers, block_size, Hkv, D] on the device, allocated lazily
        self.dec_v = None
        self.step = None
