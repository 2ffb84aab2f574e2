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
    anything else                           :class:`SerialBatchKV` around the one-request store
    ======================================  =====================================================
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
    if store_cls is OffloadPagedKV and isinstance(pol, QuestDecode) and not pol.prefetch \
            and (pol.exact_channels or pol.bound_scale == 1.0):
        return OffloadQuestBatchKV, {}
    return SerialBatchKV, {"store_cls": store_cls}

