"""The store table: the one place a configuration's KV store is chosen."""
from __future__ import annotations

__all__ = ["batch_store_class"]


def batch_store_class(config):
    """The store table: ``(batched store class, open keyword arguments)`` that serves ``config``
    (the one place a configuration's store is chosen).

    ======================================  =====================================================
    configuration                           store
    ======================================  =====================================================
    ``resident``, dense decode              :class:`ResidentBatchKV` (with ``prefix_caching``:
                                            :class:`~.kv_batch_prefix.ResidentPrefixBatchKV`)
    ``offload`` direct/uva, dense decode    :class:`OffloadBatchKV`
    ``offload`` direct/uva + QuestDecode    :class:`OffloadQuestBatchKV` (not with ``prefetch``,
                                            nor ``bound_scale < 1`` without exact channels)
    ``resident`` + QuestDecode              :class:`OffloadQuestBatchKV` over a runtime whose pool
                                            is on the model's device (``pool_placement=
                                            "device"``: no page cache, no host bytes; not with
                                            ``bound_scale < 1`` without exact channels)
    anything else                           :class:`SerialBatchKV` around the one-request store
    ======================================  =====================================================

    The open keyword ``pool_placement`` (``"host"`` when absent) is also where the engine's
    runtime keeps the pool: the engine opens a device pool for ``"device"``.
    """
    from ..sparse.quest import QuestDecode
    from .offload import OffloadBatchKV
    from .quest import OffloadQuestBatchKV
    from .resident import ResidentBatchKV
    from ..engine.kv_batch_serial import SerialBatchKV
    from ..engine.kv_paged import OffloadPagedKV
    from ..engine.kv_store import ResidentKV, store_class

    store_cls = store_class(config.mode).variant(config)
    pol = config.decode_policy
    if store_cls is ResidentKV:
        if config.prefix_caching:
            from .resident_prefix import ResidentPrefixBatchKV

            return ResidentPrefixBatchKV, {}
        return ResidentBatchKV, {}
    if store_cls is OffloadPagedKV and pol is None:
        return OffloadBatchKV, {}
    served = isinstance(pol, QuestDecode) and (pol.exact_channels or pol.bound_scale == 1.0)
    if store_cls is OffloadPagedKV and served and not pol.prefetch:
        return OffloadQuestBatchKV, {}
    if config.mode == "resident" and served:  # (prefetch only feeds a page cache: none on the device)
        return OffloadQuestBatchKV, {"pool_placement": "device"}
    return SerialBatchKV, {"store_cls": store_cls}

