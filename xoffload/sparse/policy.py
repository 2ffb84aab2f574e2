"""Sparse attention policies: which KV blocks an attention call reads.

One interface per phase, each a plain object configured once and handed to whoever runs attention
(:class:`xoffload.LLM`'s ``sparse=``, :meth:`xoffload.models.llama.LlamaModel.prefill`'s ``policy=``,
the transformers backend's ``register(xattn=...)``):

- :class:`PrefillPolicy`: ``policy(q, k, v) -> (out, lse, density)`` for a whole layer's causal
  prefill, and ``policy.layers(num_layers)``: the layers it applies to (the others run the model's
  own dense attention). Implementations: :class:`DensePrefill` (applies to no layer: dense
  everywhere) and :class:`XAttentionPrefill`.
- :class:`DecodePolicy`: the selection of KV pages a decode step reads (declared, not implemented).

Strings name policies only at the edge: :func:`resolve_prefill` turns ``None`` / ``"dense"`` /
``"xattn"`` into a policy object once; everything after that passes the object.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.checks import check_bool, check_int, is_int
from ..kernels.flash_attn import flash_attn_with_lse
from ..kernels.xattn import check_geometry
from .xattention import DEFAULT_DENSE_FALLBACK_LEN, DEFAULT_DENSE_LAST_Q, dense_rows, xattention_prefill

__all__ = ["PrefillPolicy", "DensePrefill", "XAttentionPrefill", "DecodePolicy", "resolve_prefill",
           "PREFILL_POLICIES", "DEFAULT_DENSE_LAYERS"]

#: layers an :class:`XAttentionPrefill` keeps dense by default: the first four (on SmolLM2's needle
#: grid, 4 dense layers with tau=0.9, S=8 found what dense attention found, 2 missed one cell more)
DEFAULT_DENSE_LAYERS = 4


class PrefillPolicy:
    """Base of prefill policies (subclass it to add one).

    ``__call__(q, k, v, *, softmax_scale=None) -> (out, lse, density)``: causal (bottom-right)
    attention of a whole layer: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; out like q, lse fp32
    ``[B, Hq, Sq]``, density the kept fraction of the causally visible blocks (fp32 ``[Hq]``, or a
    float, or None when not measured). ``layers(num_layers)``: sorted tuple of the layer indices the
    policy applies to. ``dense`` is True for a policy equal to dense attention everywhere (no
    density is reported for it).
    """

    dense: bool = False

    def __call__(self, q, k, v, *, softmax_scale=None):
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__(q, k, v)")

    def layers(self, num_layers: int) -> tuple:
        """All layers (override to restrict)."""
        return tuple(range(check_int("num_layers", num_layers, 0)))


@dataclass(frozen=True)
class DensePrefill(PrefillPolicy):
    """Dense causal prefill. Applies to no layer: the model's own dense attention (the fastest
    correct kernel, no LSE) runs everywhere. Called directly it runs
    :func:`xoffload.kernels.flash_attn_with_lse` and returns density all ones."""

    causal: bool = True
    dense = True

    def __post_init__(self):
        check_bool("causal", self.causal)

    def __call__(self, q, k, v, *, softmax_scale=None):
        out, lse = flash_attn_with_lse(q, k, v, causal=self.causal, softmax_scale=softmax_scale)
        return out, lse, torch.ones(q.shape[2], dtype=torch.float32, device=q.device)

    def layers(self, num_layers: int) -> tuple:
        check_int("num_layers", num_layers, 0)
        return ()


@dataclass(frozen=True)
class XAttentionPrefill(PrefillPolicy):
    """XAttention sparse prefill (estimate -> select -> block-sparse) with fixed settings; see
    :func:`xoffload.sparse.xattention.xattention_prefill` for ``threshold``, ``stride``,
    ``block_size``, ``chunk_size``, ``dense_fallback_len``, ``keep_last``, ``dense_last_q`` and
    ``causal``. ``dense_layers``: layer indices kept dense (negative counts from the end); None
    (default) = the first :data:`DEFAULT_DENSE_LAYERS`, or every layer of a smaller model.

    Options are checked at construction (ValueError / TypeError naming the value); layer indices
    are checked against the model in :meth:`layers`.
    """

    threshold: float = 0.9
    stride: int = 8
    block_size: int = 128
    chunk_size: int | None = None
    dense_fallback_len: int = DEFAULT_DENSE_FALLBACK_LEN
    keep_last: int = 0
    dense_last_q: int | None = DEFAULT_DENSE_LAST_Q
    dense_layers: tuple | None = None
    causal: bool = True

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"threshold must be a float in [0, 1], got {type(t).__name__} {t!r}")
        if not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        check_geometry(self.stride, self.block_size)
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size, 1)
        check_int("dense_fallback_len", self.dense_fallback_len, 0)
        check_int("keep_last", self.keep_last, 0)
        dense_rows(self.dense_last_q, self.block_size)
        check_bool("causal", self.causal)
        if self.dense_layers is not None:
            dl = tuple(self.dense_layers)
            bad = [i for i in dl if not is_int(i)]
            if bad:
                raise TypeError(f"dense_layers must be ints, got {bad[0]!r}")
            object.__setattr__(self, "dense_layers", tuple(int(i) for i in dl))

    def __call__(self, q, k, v, *, softmax_scale=None):
        return xattention_prefill(q, k, v, threshold=self.threshold, stride=self.stride,
                                  block_size=self.block_size, chunk_size=self.chunk_size,
                                  dense_fallback_len=self.dense_fallback_len, keep_last=self.keep_last,
                                  dense_last_q=self.dense_last_q, causal=self.causal,
                                  softmax_scale=softmax_scale)

    def layers(self, num_layers: int) -> tuple:
        L = check_int("num_layers", num_layers, 0)
        dl = tuple(range(min(DEFAULT_DENSE_LAYERS, L))) if self.dense_layers is None else self.dense_layers
        bad = [i for i in dl if not -L <= i < L]
        if bad:
            raise ValueError(f"dense_layers {bad} are outside the model's {L} layers")
        dense = {i % L for i in dl}
        return tuple(i for i in range(L) if i not in dense)


class DecodePolicy:
    """Base of decode policies: which of the prompt's KV pages each decode step reads.

    A decode policy fixes per request, from the prompt length, what stays resident and how many
    pages a step reads (``plan(prompt_len)``), and which layers select at all
    (``sparse_layers(num_layers)``); the selection itself is a device tensor of page rows that the
    KV store's paged attention consumes without a host round trip
    (:class:`xoffload.kv.quest.OffloadQuestBatchKV`). Implementation: :class:`xoffload.sparse.quest.QuestDecode`.
    """

    def plan(self, prompt_len: int):
        raise NotImplementedError(f"{type(self).__name__}.plan")

    def sparse_layers(self, num_layers: int) -> tuple:
        raise NotImplementedError(f"{type(self).__name__}.sparse_layers")

    def for_model(self, cfg) -> "DecodePolicy":
        """This policy fitted to a model of config ``cfg`` (a
        :class:`~xoffload.models.config.ModelConfig`), as the engine uses it: itself after checking
        that its layers exist (ValueError naming those outside the model); a policy with settings
        that depend on the model's shape returns a fitted copy."""
        self.sparse_layers(cfg.num_layers)
        return self


#: prefill policy names accepted by :func:`resolve_prefill` (the class is built with its defaults)
PREFILL_POLICIES = {"dense": DensePrefill, "none": DensePrefill, "xattn": XAttentionPrefill}


def resolve_prefill(spec) -> PrefillPolicy:
    """The policy object for ``spec``: a :class:`PrefillPolicy` (returned as is), None (dense), or
    a name in :data:`PREFILL_POLICIES` (``"dense"``, ``"xattn"``) built with default settings.
    Raises ValueError for an unknown name, TypeError for anything else."""
    if spec is None:
        return DensePrefill()
    if isinstance(spec, PrefillPolicy):
        return spec
    if isinstance(spec, str):
        if spec not in PREFILL_POLICIES:
            raise ValueError(f"sparse must be None, a PrefillPolicy or one of {sorted(PREFILL_POLICIES)}, got {spec!r}")
        return PREFILL_POLICIES[spec]()
    raise TypeError(f"sparse must be None, a PrefillPolicy or a policy name, got {type(spec).__name__} {spec!r}")


def decode_policies() -> dict:
    """Decode policy names accepted by :func:`resolve_decode` -> their classes (callables taking
    ``token_budget=``): ``"quest"`` (Quest's min/max bound) and ``"quest-ch"`` (Quest with 16 exact
    key channels per KV head and the bound scaled by 0.25 on the rest:
    ``QuestDecode(exact_channels=16, bound_scale=0.25, fit_channels=True)``: on a model whose head_dim is
    below 32, ``head_dim // 2`` channels; on SmolLM2's RULER-style tasks at budget
    512 it scored 33.0 against dense 32.8 and Quest's 13.3 (H200, 10 samples per task at 4K and 8K,
    ``benchmarks/results/ruler_smollm2_channels*.json``); batched offload generation runs it in the batched Quest
    store)."""
    import functools

    from .quest import QuestDecode

    return {"quest": QuestDecode,
            "quest-ch": functools.partial(QuestDecode, exact_channels=16, bound_scale=0.25, fit_channels=True)}


def resolve_decode(spec, token_budget=None):
    """The decode policy for ``sparse_decode=spec, token_budget=token_budget``: None (dense decode;
    a ``token_budget`` alone means Quest with that budget), a name of :func:`decode_policies`
    (``"quest"``: Quest with ``token_budget`` or its default; ``"quest-ch"``), or a :class:`DecodePolicy` object (then ``token_budget``
    must be None: it is the policy's own). Raises ValueError / TypeError naming the value."""
    if isinstance(spec, DecodePolicy):
        if token_budget is not None and token_budget != getattr(spec, "token_budget", None):
            raise ValueError(f"token_budget={token_budget!r} given with a policy object: set it in the policy "
                             f"({type(spec).__name__}(token_budget=...))")
        return spec
    if spec is None and token_budget is None:
        return None
    names = decode_policies()
    if spec is None or spec in names:
        cls = names[spec or "quest"]
        return cls() if token_budget is None else cls(token_budget=token_budget)
    if isinstance(spec, str):
        raise ValueError(f"sparse_decode must be None, a DecodePolicy or one of {sorted(names)}, got {spec!r}")
    raise TypeError(f"sparse_decode must be None, a policy name ({', '.join(sorted(names))}) or a DecodePolicy, "
                    f"got {type(spec).__name__}")
