"""Plug-ins for other engines: a transformers attention backend, flash-attn-style functions and
torch custom ops (``torch.ops.xoffload.*``).

Submodules are imported lazily:

* :mod:`xoffload.integrations.flash_api` — ``flash_attn_func``, ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache`` (flash-attn 2 signatures);
* :mod:`xoffload.integrations.ops` — the custom ops, registered on import;
* :mod:`xoffload.integrations.transformers` — ``register()`` for ``attn_implementation="xoffload"``
  / ``"xoffload_xattn"``.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "flash_attn_func": ".flash_api",
    "flash_attn_varlen_func": ".flash_api",
    "flash_attn_with_kvcache": ".flash_api",
    "register_transformers": (".transformers", "register"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    spec = _LAZY.get(name)
    if spec is None:
        raise AttributeError(f"module 'xoffload.integrations' has no attribute {name!r}")
    mod, attr = (spec, name) if isinstance(spec, str) else spec
    value = getattr(importlib.import_module(mod, __name__), attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__ + ["flash_api", "ops", "transformers"]
