"""Sparse attention policies: which KV blocks a step needs.

- :mod:`~xoffload.sparse.policy`: the interfaces (:class:`PrefillPolicy`, :class:`DecodePolicy`),
  :class:`DensePrefill`, :class:`XAttentionPrefill` and :func:`resolve_prefill` (``None`` /
  ``"dense"`` / ``"xattn"`` -> a policy object, once).
- :mod:`~xoffload.sparse.xattention`: :func:`xattention_prefill` (XAttention estimate + block
  selection + block-sparse attention for prefill, Xu et al. 2025) and :func:`xattention_mask`.
- :mod:`~xoffload.sparse.select`: the block selection itself.
- :mod:`~xoffload.sparse.quest`: :class:`QuestDecode` (decode: Quest min/max page summaries, GQA
  group scores, top pages per KV head up to a token budget; Tang et al. 2024),
  :func:`selection_loss` / :func:`calibrate_dense_layers` (which layers to keep dense, measured) and
  :func:`resolve_decode` (``sparse_decode=`` / ``token_budget=`` -> a policy object, once).

Prefill policies are callables ``policy(q, k, v) -> (out, lse, density)`` with q ``[B, Sq, Hq, D]``,
k/v ``[B, Sk, Hkv, D]``, causal bottom-right prefill; density is an fp32 ``[Hq]`` tensor (kept
fraction of the causally visible blocks per query head); ``policy.layers(num_layers)`` says which
layers of a model they apply to.
"""
from __future__ import annotations

from .policy import (DEFAULT_DENSE_LAYERS, PREFILL_POLICIES, DecodePolicy, DensePrefill, PrefillPolicy,
                     XAttentionPrefill, resolve_decode, resolve_prefill)
from .quest import DecodePlan, PageSummaries, QuestDecode, page_scores, select_pages
from .quest_calibrate import calibrate_dense_layers, selection_loss
from .xattention import DEFAULT_DENSE_FALLBACK_LEN, DEFAULT_DENSE_LAST_Q, xattention_mask, xattention_prefill

__all__ = ["PrefillPolicy", "DecodePolicy", "DensePrefill", "XAttentionPrefill", "resolve_prefill",
           "resolve_decode", "QuestDecode", "DecodePlan", "PageSummaries", "page_scores", "select_pages",
           "selection_loss", "calibrate_dense_layers",
           "PREFILL_POLICIES", "DEFAULT_DENSE_LAYERS", "DEFAULT_DENSE_FALLBACK_LEN", "DEFAULT_DENSE_LAST_Q",
           "xattention_prefill", "xattention_mask"]
