"""The engine room: everything between a loaded model and ``LLM.generate``, one job per file.

- :mod:`.config`: :class:`EngineConfig` (the LLM's options and their checks);
- :mod:`.sampling`: :class:`SamplingParams`, :func:`sample`;
- :mod:`.request`: per-request state, the token log, the clock and :class:`RequestOutput`;
- :mod:`.kv_store`: the KV stores behind one interface (:class:`KVStore`: :class:`ResidentKV`,
  :class:`OffloadKV`) and their registry (:func:`register_store`);
- :mod:`.kv_paged`: the paged stores (:class:`PagedKV`: decode reads the prompt's pages in place —
  from the pinned pool over PCIe in ``offload`` mode, or from HBM — all of them or a decode
  policy's choice, plus a GPU tail; one CUDA graph per step);
- :mod:`.cuda_graph`: decode steps replayed from a CUDA graph (per request, or per batch-size
  bucket: :class:`BatchGraphs`);
- batched generation (``max_num_seqs > 1``): :mod:`.scheduler` (:class:`Sequence`,
  :class:`Scheduler`: queues and admission), :mod:`.kv_batch` (batched KV stores:
  :class:`ResidentBatchKV`, :class:`OffloadBatchKV`, :class:`OffloadQuestBatchKV`,
  :class:`SerialBatchKV`), :mod:`.runner` (:class:`BatchRunner`, the generate loop);
- :mod:`.llm`: :class:`LLM`, which wires them.

Layering: kernels -> runtime | sparse -> models -> engine -> integrations / cli.
"""
from __future__ import annotations

from .config import EngineConfig
from .cuda_graph import BatchGraphs, GraphDecode
from .kv_store import (MODE_ALIASES, STORES, KVStore, OffloadKV, ResidentKV, Splits, canonical_mode,
                       register_store, store_class)
from .kv_paged import OffloadPagedKV, PagedKV, ResidentPagedKV
from .kv_batch import BatchKV, OffloadBatchKV, OffloadQuestBatchKV, ResidentBatchKV, SerialBatchKV, batch_store_class
from .llm import LLM
from .request import Clock, Request, RequestOutput, TokenLog
from .runner import BatchRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "KVStore", "ResidentKV", "OffloadKV",
           "Splits", "PagedKV", "OffloadPagedKV", "ResidentPagedKV", "STORES", "MODE_ALIASES", "register_store", "canonical_mode", "store_class", "GraphDecode",
           "Clock", "Request", "TokenLog", "sample", "BatchGraphs", "BatchKV", "ResidentBatchKV", "OffloadBatchKV",
           "OffloadQuestBatchKV", "SerialBatchKV", "batch_store_class", "BatchRunner", "Scheduler", "Sequence"]
