"""FP8 (e4m3) KV in the batched stores: the GPU tail of generated tokens with token scales
(:class:`Fp8RowPool`, :class:`Fp8Region`) and the byte counts of an fp8 pool.

Where the codes and scales live (``kv_cache_dtype="fp8"``, offload mode, dense decode):

- the pinned pool (:class:`~xoffload.runtime.pool.CpuKVPool`): e4m3 codes in the blocks, fp32
  scales beside them per block (``k_scale[layer]`` ``[num_blocks, block // P, Hkv]``, ``P`` the
  scale page: ``EngineConfig.kv_scale_page``), written by the prefill sink
  (``OffloadRuntime.offload_layer`` quantizes each layer on the compute stream, then copies codes
  and scales D2H); copy-on-write and the prefix cache move a block's scales with it;
- the staging buffers of direct decode (:class:`~.staging.LayerStaging`): the batch's blocks and
  their scales, one gather launch each;
- the GPU tail (this module): a generated token is quantized when it is written, with a scale of
  its own (token scales whatever ``kv_cache_scale`` says: a page scale would have to be written
  before the page's later tokens exist, or change the codes already stored).

With Quest decode (:class:`~.quest.OffloadQuestBatchKV`) the scale page is the Quest page (the
pool's pages are what Quest reads and caches); the page caches hold codes with the pool's scales,
copied with their pages (:class:`~.page_cache.BatchPageCache`); the tail has token scales, so with
page scales the sparse layers' tail is not fused with the cache's rows (``fused_tail`` False: two
attention calls and an LSE merge); the page summaries (min / max of K, exact channels) come from
the prefill's 16-bit K -- a reused prefix's from its dequantized pool rows -- and stay in the
model's dtype, as does the GPU dense pool of the dense layers (it crosses no PCIe link).

Every read dequantizes inside the paged decode kernel (``k_scale`` / ``v_scale``); the CPU path
and the pool's ``fetch_blocks`` (a reused prefix, earlier prefill chunks) dequantize with torch.
"""
from __future__ import annotations

import torch

from ..kernels import paged_decode_attn_with_lse
from ..kernels.fp8 import FP8_DTYPE, quantize_kv_fp8
from .base import RowPool, _Region

__all__ = ["Fp8RowPool", "Fp8Region", "pool_read_bytes"]


class Fp8RowPool(RowPool):
    """A :class:`~.base.RowPool` of e4m3 codes (``k`` / ``v`` ``[L, rows, Hkv, D]``
    ``float8_e4m3fn``) with a fp32 scale per token and KV head (``k_scale`` / ``v_scale``
    ``[L, rows, Hkv]``, or per-layer lists with ``external``). Same arguments as RowPool
    (``dtype`` is ignored); ``external`` maps a layer to ``(k, v, k_scale, v_scale)`` rows of
    another store (the Quest page cache's tail rows, token scales)."""

    def __init__(self, cfg, num_blocks: int, block: int, dtype, device, external: dict | None = None):
        ext = {l: (e[0], e[1]) for l, e in external.items()} if external else None
        super().__init__(cfg, num_blocks, block, FP8_DTYPE, device, external=ext)
        rows, hkv, L = (self.num_blocks + 1) * self.block, cfg.num_kv_heads, cfg.num_layers
        if not external:
            self.k_scale = torch.ones((L, rows, hkv), dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)
        else:
            for layer, e in external.items():
                if tuple(e[2].shape) != (rows, hkv) or tuple(e[3].shape) != (rows, hkv):
                    raise ValueError(f"layer {layer}'s external scales must be {(rows, hkv)}, got {tuple(e[2].shape)}")
            own = {l: torch.ones((2, rows, hkv), dtype=torch.float32, device=device) for l in range(L)
                   if l not in external}
            self.k_scale = [external[l][2] if l in external else own[l][0] for l in range(L)]
            self.v_scale = [external[l][3] if l in external else own[l][1] for l in range(L)]
        self._bytes += 2 * L * rows * hkv * 4

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize 16-bit ``k`` / ``v`` ``[n, Hkv, D]`` (a scale per token and KV head) into
        int64 ``rows`` of ``layer``."""
        for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            q, s = quantize_kv_fp8(x, page_size=1, granularity="token")
            codes.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))  # no fp8 index_copy on the CPU
            scales.index_copy_(0, rows, s)


class Fp8Region(_Region):
    """A :class:`~.base._Region` over an :class:`Fp8RowPool`: :meth:`write` quantizes the rows'
    new K/V (a scale per token and KV head) and :meth:`attend` reads codes and scales."""

    def write(self, layer: int, k_new, v_new, n: int):
        """Quantize and write the rows' new K/V ``[n, Hkv, D]`` (16-bit); returns the layer's
        ``(k, v, k_scale, v_scale)`` row stores."""
        pool = self.pool
        pool.write_rows(layer, self.wrow[:n], k_new, v_new)
        return pool.k[layer], pool.v[layer], pool.k_scale[layer], pool.v_scale[layer]

    def attend(self, layer: int, q4, k_new, v_new, n: int, scale: float):
        """Write the rows' new K/V and attend over the region: ``(out [n, 1, Hq, D], lse)``."""
        k, v, ks, vs = self.write(layer, k_new, v_new, n)
        return paged_decode_attn_with_lse(q4, k, v, self.table[:n], self.lens[:n], page_size=self.pool.block,
                                          softmax_scale=scale, check=False, k_scale=ks, v_scale=vs)


def pool_read_bytes(cfg, pool, n_tokens: int, n_pages: int) -> int:
    """Bytes of K and V of every layer that a read of ``n_tokens`` tokens of ``pool`` moves, with
    ``n_pages`` scale rows of an fp8 pool (its pages visited; tokens with token scales)."""
    per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * pool.itemsize
    scales = 2 * cfg.num_layers * cfg.num_kv_heads * 4 * n_pages if pool.fp8 else 0
    return n_tokens * per_tok + scales
