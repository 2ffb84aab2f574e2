"""The runtime of ``mode="resident"`` with a :class:`~xoffload.sparse.QuestDecode` the batched Quest
store serves: an :class:`~xoffload.runtime.OffloadRuntime` whose KV pool lives on the model's
device (``placement="device"``, :class:`~xoffload.runtime.DeviceKVPool`), opened once per engine.

:class:`~.quest.OffloadQuestBatchKV` reads the pages a step chooses from that pool in place
(HBM, not PCIe: no page cache, no host bytes per step) and the dense layers from the same pool;
prefix caching (:class:`~xoffload.runtime.PrefixCache`) works over it as over the pinned pool.
The store table (:func:`~.table.batch_store_class`) asks for it with ``pool_placement="device"``.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..runtime import OffloadRuntime, PoolAllocationError
from .base import _pool_memory_limit

__all__ = ["TAIL_NEW_TOKENS", "device_pool_blocks", "open_device_runtime"]

#: generated tokens per sequence that the pool's sizing leaves GPU room for in the store's tails
#: (sink, recent and generated tokens live there, not in the pool); a longer answer takes memory
#: the pool left free, or waits for it
TAIL_NEW_TOKENS = 2048


def device_pool_blocks(model, config) -> int:
    """Blocks of ``config.kv_block_size`` tokens in the device pool.

    ``kv_cache_tokens`` when given (rounded up to whole blocks); else ``max_num_seqs`` sequences of
    ``max_model_len`` tokens (whole blocks each, and with ``prefix_caching`` one more each for the
    copy of a shared, partly filled last block), cut on CUDA to what fits: the free memory under
    the process's cap less a prefill's headroom for a ``max_model_len`` prompt
    (:func:`~.base._pool_memory_limit`), less the tails of ``max_num_seqs`` sequences (their plan's
    resident tokens + :data:`TAIL_NEW_TOKENS`), each pool token also paying for its page summaries
    (min, max and exact channels of the sparse layers). May be 0 (nothing fits)."""
    B, n = int(config.kv_block_size), int(config.max_num_seqs)
    if config.kv_cache_tokens is not None:
        return -(-int(config.kv_cache_tokens) // B)
    cap = n * (-(-int(config.max_model_len) // B) + int(config.prefix_caching))  # + a copy-on-write block
    limit = _pool_memory_limit(model, [SimpleNamespace(prompt_len=config.max_model_len)], config, model.device)
    if limit is None:  # the CPU: no memory limit
        return cap
    c, pol = model.cfg, config.decode_policy
    el = torch.empty((), dtype=model.dtype).element_size()
    tok = c.kv_bytes_per_token(model.dtype)  # K and V of every layer
    sparse = len(pol.sparse_layers(c.num_layers))
    summ = sparse * c.num_kv_heads * (2 * c.head_dim + pol.page_size * pol.exact_channels) * el / pol.page_size
    tails = n * (pol.largest_plan(config.max_model_len)[2] + TAIL_NEW_TOKENS) * tok
    return int(min(cap, max(0, (limit - tails) // ((tok + summ) * B))))


def open_device_runtime(model, config) -> OffloadRuntime:
    """The engine's runtime over a device pool of :func:`device_pool_blocks` blocks (``config``: the
    bound :class:`~xoffload.engine.config.EngineConfig`).

    Raises:
        PoolAllocationError (a MemoryError): no block fits on the device, or the allocation failed
            (the message names the sizes and suggests ``kv_cache_tokens`` or a shorter
            ``max_model_len`` / fewer ``max_num_seqs``).
    """
    c = model.cfg
    blocks = device_pool_blocks(model, config)
    if blocks < 1:
        raise PoolAllocationError(
            f"no KV block of {config.kv_block_size} tokens fits on {model.device} after a prefill's headroom for "
            f"max_model_len={config.max_model_len} and the tails of max_num_seqs={config.max_num_seqs} sequences; "
            f"set kv_cache_tokens, or lower max_model_len or max_num_seqs")
    return OffloadRuntime(c.num_layers, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=str(model.device),
                          max_tokens=config.max_model_len, block_size=config.kv_block_size,
                          num_blocks=blocks, placement="device")
