"""The engine: one step loop over one model and its KV stores, one job per file.

- :mod:`.llm_engine`: :class:`LLMEngine` (``add_request`` / ``step`` / ``abort_request``,
  continuous batching; every client below runs on it);
- :mod:`.llm`: :class:`LLM` (offline lists of prompts), :mod:`.session`: :class:`Session`
  (conversations: each turn a request carrying the whole conversation, found by the prefix cache);
- :mod:`.runner`: :class:`StepRunner` (one store epoch: prefill, decode step, retire),
  :mod:`.scheduler` (:class:`Sequence`, :class:`Scheduler`: queues and admission);
- :mod:`xoffload.kv`: the KV layer (the stores, their contracts, the table that picks one);
- :mod:`.config` (:class:`EngineConfig`), :mod:`.sampling`, :mod:`.request`, :mod:`.inputs`,
  :mod:`.cuda_graph`.

Layering: kernels -> runtime | sparse -> models -> kv -> engine -> serve / evals / integrations / cli.
"""
from __future__ import annotations

from ..kv import BatchKV, OffloadBatchKV, OffloadQuestBatchKV, ResidentBatchKV, batch_store_class
from .config import MODE_ALIASES, MODES, EngineConfig, canonical_mode
from .cuda_graph import BatchGraphs
from .llm import LLM
from .llm_engine import LLMEngine
from .request import Clock, Request, RequestOutput
from .runner import StepRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "MODES", "MODE_ALIASES",
           "canonical_mode", "Clock", "Request", "sample", "BatchGraphs", "BatchKV", "ResidentBatchKV", "OffloadBatchKV",
           "OffloadQuestBatchKV", "batch_store_class", "StepRunner", "Scheduler", "Sequence"]
