"""The store table: the one place a configuration's KV store is chosen, and the runtime it needs."""
from __future__ import annotations

import torch

from ..runtime import OffloadRuntime

__all__ = ["batch_store_class", "open_runtime"]


def batch_store_class(config):
    """The store that serves ``config`` (an :class:`~xoffload.engine.config.EngineConfig`), for
    every ``max_num_seqs`` (a single request is a batch of one): ``(store class, open keyword
    arguments)``.

    ===================================  ========================================================
    configuration                        store
    ===================================  ========================================================
    ``resident``, dense decode           :class:`~.resident.ResidentBatchKV` (with
                                         ``prefix_caching``: :class:`~.resident_prefix.
                                         ResidentPrefixBatchKV`)
    ``offload``, dense decode            :class:`~.offload.OffloadBatchKV` (``direct``: staged
                                         through two GPU buffers; ``uva``: read in place)
    ``offload`` + QuestDecode            :class:`~.quest.OffloadQuestBatchKV` over the pinned pool
    ``resident`` + QuestDecode           :class:`~.quest.OffloadQuestBatchKV` over a pool on the
                                         model's device (``pool_placement="device"``: no page
                                         cache, no host bytes)
    ===================================  ========================================================

    Raises:
        ValueError: a decode policy no store reads (the stores read the pages a
            :class:`~xoffload.sparse.QuestDecode` chooses).
    """
    from ..sparse.quest import QuestDecode
    from .offload import OffloadBatchKV
    from .quest import OffloadQuestBatchKV
    from .resident import ResidentBatchKV
    from .resident_prefix import ResidentPrefixBatchKV

    pol = config.decode_policy
    if pol is None:
        if config.mode == "offload":
            return OffloadBatchKV, {}
        return (ResidentPrefixBatchKV if config.prefix_caching else ResidentBatchKV), {}
    if not isinstance(pol, QuestDecode):
        raise ValueError(f"no KV store reads the pages of sparse_decode={type(pol).__name__}: the stores serve "
                         f"dense decode and QuestDecode")
    return OffloadQuestBatchKV, ({"pool_placement": "device"} if config.mode == "resident" else {})


def open_runtime(model, config, store_kw: dict) -> OffloadRuntime | None:
    """The engine's :class:`~xoffload.runtime.OffloadRuntime` for the store the table chose: a pinned
    host pool of ``kv_cache_tokens`` tokens (default ``max_num_seqs * max_model_len``) in offload
    mode (fp8 codes and scales with ``kv_cache_dtype="fp8"``), a pool on the model's device for ``pool_placement="device"``
    (:func:`~.device_runtime.open_device_runtime`), None for the resident dense stores (their GPU
    pool is opened per store epoch).

    Raises:
        PoolAllocationError (a MemoryError): the pool cannot be allocated (sizes named).
    """
    if store_kw.get("pool_placement") == "device":
        from .device_runtime import open_device_runtime

        return open_device_runtime(model, config)
    if config.mode != "offload":
        return None
    c = model.cfg
    B = config.kv_block_size
    if config.kv_cache_tokens:
        blocks = -(-config.kv_cache_tokens // B)
    else:
        blocks = config.max_num_seqs * (-(-config.max_model_len // B) + int(config.prefix_caching))
    fp8 = {"kv_dtype": torch.float8_e4m3fn, "scale_page": config.kv_scale_page} if config.fp8 else {}
    return OffloadRuntime(c.num_layers, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=str(model.device),
                          max_tokens=config.max_model_len, block_size=B, num_blocks=blocks, **fp8)
