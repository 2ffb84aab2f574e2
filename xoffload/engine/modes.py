"""The engine's named configurations — every KV placement and decode path the library offers, with
the sparse policies that apply — for benchmarks and evaluations to iterate over (so they pick up
new stores and policies from the library rather than from a list of their own).

``configurations()`` -> ``{name: LLM keyword arguments}``, e.g. ``"resident"``,
``"resident+quest"``, ``"offload"``, ``"offload-uva"``, ``"offload+xattn"``,
``"offload+quest"``.
"""
from __future__ import annotations

from ..sparse.policy import PREFILL_POLICIES, decode_policies
from .config import MODES

__all__ = ["configurations"]


def configurations() -> dict:
    """Every mode (dense), offload's in-place read (``uva``), each sparse prefill policy on offload (its
    setting: the layer's whole K is on the GPU during layerwise prefill) and each decode policy in
    every mode. Values are keyword arguments of :class:`~xoffload.engine.llm.LLM`."""
    out = {}
    for mode in sorted(MODES):
        out[mode] = {"mode": mode}
        if mode == "offload":
            out["offload-uva"] = {"mode": mode, "offload_decode": "uva"}
            for name, cls in sorted(PREFILL_POLICIES.items()):
                if not cls().dense:
                    out[f"offload+{name}"] = {"mode": mode, "sparse": name}
        for name in sorted(decode_policies()):
            out[f"{mode}+{name}"] = {"mode": mode, "sparse_decode": name}
    return out
