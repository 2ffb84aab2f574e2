"""The engine: one step loop over one model and its KV stores, one job per file.

- :mod:`.llm_engine`: :class:`LLMEngine` (``add_request`` / ``step`` / ``abort_request``,
  continuous batching; every client below runs on it);
- :mod:`.llm`: :class:`LLM` (offline lists of prompts), :mod:`.session`: :class:`Session`
  (conversations: each turn a request carrying the whole conversation, found by the prefix cache);
- :mod:`.runner`: :class:`StepRunner` (one store epoch: prefill, decode step, retire),
  :mod:`.scheduler` (:class:`Sequence`, :class:`Scheduler`: queues and admission);
- :mod:`xoffload.kv`: the KV layer (stores, the table that picks one); :class:`SerialBatchKV`;
  :mod:`.kv_store`, :mod:`.kv_paged`: the one-request stores the serial store wraps;
- :mod:`.config` (:class:`EngineConfig`), :mod:`.sampling`, :mod:`.request`, :mod:`.inputs`,
  :mod:`.cuda_graph`.

Layering: kernels -> runtime | sparse -> models -> engine -> integrations / cli.
"""
from __future__ import annotations

from .config import EngineConfig
from .cuda_graph import BatchGraphs, GraphDecode
from .kv_store import (MODE_ALIASES, STORES, KVStore, OffloadKV, ResidentKV, Splits, canonical_mode,
                       register_store, store_class)
from .kv_paged import OffloadPagedKV, PagedKV, ResidentPagedKV
from ..kv import BatchKV, OffloadBatchKV, OffloadQuestBatchKV, ResidentBatchKV, batch_store_class
from .kv_batch_serial import SerialBatchKV
from .llm import LLM
from .llm_engine import LLMEngine
from .request import Clock, Request, RequestOutput
from .runner import StepRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "KVStore", "ResidentKV", "OffloadKV",
           "Splits", "PagedKV", "OffloadPagedKV", "ResidentPagedKV", "STORES", "MODE_ALIASES", "register_store", "canonical_mode", "store_class", "GraphDecode",
           "Clock", "Request", "sample", "BatchGraphs", "BatchKV", "ResidentBatchKV", "OffloadBatchKV",
           "OffloadQuestBatchKV", "SerialBatchKV", "batch_store_class", "StepRunner", "Scheduler", "Sequence"]
