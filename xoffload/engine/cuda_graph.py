"""Decode steps replayed from one CUDA graph per request (resident KV, CUDA only)."""
from __future__ import annotations

import torch

from .kv_store import KVStore

__all__ = ["GraphDecode"]


class GraphDecode:
    """Decode steps of one request replayed from one CUDA graph.

    Step 1 runs eagerly on a side stream (compiles the Triton kernels, creates cuBLAS workspaces:
    torch's required warm-up; its logits are real and used). Step 2 captures one whole decode
    step — embedding of the static token input, all layers (KV written at the device position,
    attention with the request's fixed split count), final norm and logits into a static buffer,
    then ``pos_t += 1`` — into a graph with its own memory pool, and replays it; later steps only
    copy the sampled token into the static input (device to device) and replay. The host never
    reads the position or the token. :meth:`close` frees the graph and its pool.

    Args:
        model: the :class:`~xoffload.models.llama.LlamaModel` (CUDA).
        kv: the request's store; must be ``capturable`` (e.g. a
            :class:`~xoffload.engine.kv_store.ResidentKV` built with a fixed ``max_len``), with
            ``pos_t`` and ``capacity``.
        pos: position of the first decode step (the prompt length).
    """

    def __init__(self, model, kv: KVStore, pos: int):
        if not kv.capturable:
            raise ValueError(f"CUDA-graph decode needs a capturable KV store (a ResidentKV with a fixed "
                             f"split count, max_len), got {type(kv).__name__}")
        self.m, self.kv = model, kv
        dev = model.device
        model.rope_tables(kv.capacity + 1)  # grown here, never inside the graph
        kv.pos_t.fill_(pos)
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.stream = torch.cuda.Stream(dev)
        self.graph = None
        self.out = None
        self.warm = False

    def _body(self) -> torch.Tensor:
        self.kv.begin_step(None)
        logits = self.m.decode_step(self.tok, self.kv.pos_t, self.kv)
        self.kv.end_step()
        self.kv.advance()
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Run one decode step for ``token`` (int64 ``[1]``, device) at the current device
        position; returns fp32 logits ``[1, V]`` (after capture: the static buffer, overwritten by
        the next step, so sample from it before calling again)."""
        self.tok.copy_(token)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        cur = torch.cuda.current_stream(self.m.device)
        if not self.warm:
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                logits = self._body()
            cur.wait_stream(self.stream)
            logits.record_stream(cur)
            self.warm = True
            return logits
        # capture_begin/end on the warm-up stream rather than ``torch.cuda.graph``, whose entry
        # synchronises the device and empties the allocator caches; nothing executes during
        # capture, and the private pool keeps the graph's memory apart from everything else
        g = torch.cuda.CUDAGraph()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            try:
                out = self._body()
            finally:
                g.capture_end()
        self.graph, self.out = g, out
        self.graph.replay()
        return self.out

    def close(self):
        """Free the graph, its memory pool and the static buffers."""
        self.out = None
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
