"""Decode steps replayed from CUDA graphs (CUDA only): one graph per batch-size bucket of a store
epoch (:class:`BatchGraphs`; a single request is the bucket of one)."""
from __future__ import annotations

import torch

__all__ = ["BatchGraphs"]


class BatchGraphs:
    """Batched decode steps, one CUDA graph per batch-size bucket, for one store epoch.

    The step body is the batched store's: ``store.begin_step()``, the model's decode step of the
    static token input ``tok[:rows]`` at the store's device positions ``store.pos[:rows]``,
    ``store.end_step()``, ``store.advance()``. The first step at a bucket runs eagerly on a side
    stream (Triton compiles, cuBLAS makes its workspaces; its logits are real and used), the second
    captures the body into that bucket's graph and replays it; later steps at the bucket copy the
    tokens in and replay. A graph keeps addresses, so the store's tensors must stay where they are
    for the whole call (its pools and row state are allocated once when it opens). All graphs share
    one memory pool: a graph's output is consumed (sampled) before any other graph replays, which is
    what sharing allows. With ``use_graphs=False`` (the CPU, ``cuda_graph=False``, a store that is
    not ``capturable``) every step runs the body eagerly.

    Args:
        model: the :class:`~xoffload.models.llama.LlamaModel`.
        store: the call's :class:`~xoffload.kv.base.BatchKV` (``pos``, ``max_len``,
            ``buckets``).
        use_graphs: capture graphs (CUDA and a capturable store only).
    Attributes:
        captured: the buckets whose graph was captured.
    """

    def __init__(self, model, store, use_graphs: bool):
        self.m, self.store = model, store
        dev = model.device
        self.use = bool(use_graphs) and dev.type == "cuda" and store.capturable
        model.rope_tables(store.max_len + 1)  # grown here, never inside a graph
        self.tok = torch.zeros(store.buckets[-1], dtype=torch.int64, device=dev)
        self.graphs, self.outs, self.warm = {}, {}, set()
        self._captured = set()
        self.stream = torch.cuda.Stream(dev) if self.use else None
        self.pool = torch.cuda.graph_pool_handle() if self.use else None

    @property
    def captured(self) -> list:
        """Buckets whose graph was captured during the call (kept after :meth:`close`)."""
        return sorted(self._captured)

    def _body(self, rows: int) -> torch.Tensor:
        st = self.store
        st.begin_step()
        logits = self.m.decode_step(self.tok[:rows], st.pos[:rows], st)
        st.end_step()
        st.advance()
        return logits

    def step(self, rows: int, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the store's current batch (``rows`` = what ``set_batch`` returned)
        for ``tokens`` (int64 ``[n]``, ``n <= rows``, on the device: row i's input token; padding
        rows keep whatever they held). Returns fp32 logits ``[rows, V]`` (after capture: the
        bucket's static buffer, overwritten by its next replay: sample from it first)."""
        self.tok[:tokens.shape[0]].copy_(tokens)
        if not self.use:
            return self._body(rows)
        g = self.graphs.get(rows)
        if g is not None:
            g.replay()
            return self.outs[rows]
        cur = torch.cuda.current_stream(self.m.device)
        self.stream.wait_stream(cur)
        if rows not in self.warm:
            with torch.cuda.stream(self.stream):
                logits = self._body(rows)
            cur.wait_stream(self.stream)
            logits.record_stream(cur)
            self.warm.add(rows)
            return logits
        # capture_begin/end on the side stream (no device-wide synchronize)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool)
            try:
                out = self._body(rows)
            finally:
                g.capture_end()
        cur.wait_stream(self.stream)
        self.graphs[rows], self.outs[rows] = g, out
        self._captured.add(rows)
        g.replay()
        return out

    def close(self):
        """Free every graph and their pool."""
        self.outs = {}
        for g in self.graphs.values():
            g.reset()
        self.graphs = {}
