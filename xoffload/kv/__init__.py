"""The KV layer: where every running sequence's KV lives and how a step reads it.

- :mod:`.protocols`: the contracts (prefill sink, decode store, admission, placement) as
  ``typing.Protocol`` classes;
- :mod:`.table`: :func:`batch_store_class`, the one place a configuration's store is chosen;
- :mod:`.base`: :class:`BatchKV` (what every store shares), :class:`RowPool` (paged GPU rows);
- :mod:`.resident`, :mod:`.resident_prefix`: KV on the model's device (with prefix caching);
- :mod:`.offload`, :mod:`.quest`: prompts in the pinned host pool, read in place or staged
  (dense), or the pages a :class:`~xoffload.sparse.QuestDecode` chooses (sparse); the Quest
  store also over a pool on the device (``resident``, :mod:`.device_runtime` opens its runtime);
- :mod:`.page_cache`, :mod:`.chunk`, :mod:`.quest_prefix`, :mod:`.batch_prefill`,
  :mod:`.staging`: the parts those stores are built from.

Layering: kernels -> runtime | sparse -> models -> kv -> engine.
"""
from __future__ import annotations

from .base import BatchKV, RowPool
from .offload import OffloadBatchKV
from .quest import OffloadQuestBatchKV
from .resident import ResidentBatchKV
from .staging import PrefillStaging
from .table import batch_store_class

__all__ = ["BatchKV", "RowPool", "OffloadBatchKV", "OffloadQuestBatchKV", "ResidentBatchKV", "PrefillStaging",
           "batch_store_class"]
