"""Plug-ins for other engines.

* :mod:`xoffload.integrations.flash_api` — ``flash_attn_func``, ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache`` (flash-attn 2 signatures and conventions);
* :mod:`xoffload.integrations.ops` — ``torch.ops.xoffload.*`` custom ops (torch.compile and
  CUDA-graph safe), registered when that module is imported;
* :mod:`xoffload.integrations.transformers` — ``register()`` for ``attn_implementation="xoffload"``
  / ``"xoffload_xattn"`` (imports transformers, so it is not imported here).
"""
from __future__ import annotations

from .flash_api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
