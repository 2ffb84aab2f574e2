"""xoffload attention inside Hugging Face ``transformers`` models.

Usage::

    import xoffload.integrations.transformers as xt
    xt.register()                      # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="xoffload")
    # or "xoffload_xattn": XAttention sparse prefill, dense decode; its policy:
    xt.register(xattn=XAttentionPrefill(threshold=0.9, stride=8, dense_layers=()), xattn_min_len=1024)

:func:`register` adds two entries to transformers' ``AttentionInterface`` and, under the same names,
a mask function to ``AttentionMaskInterface`` (so transformers never materialises a 4D
``[B, 1, Sq, Sk]`` mask for these backends: it hands over ``None`` or the 2D padding mask).

``"xoffload"`` (dense) dispatches each attention call by its shapes:

* no padding, ``Sq == 1`` (decode step): the split-KV decode kernel over all ``Sk`` keys;
* no padding, ``Sq > 1``: the dense kernel, causal bottom-right aligned (``Sk > Sq`` = prefill of
  new tokens after a cached prefix);
* a 2D padding mask ``[B, L]`` (left or right padding, or holes): the valid keys and queries are
  gathered into the varlen layout (``cu_seqlens`` from the mask, one host sync) and run through the
  varlen kernel; padded query rows get output 0. This is exact for any 2D mask: the valid queries
  are the last valid positions, so bottom-right alignment in the packed sequence is the causal
  mask of the padded one. A mask shorter than ``Sk`` (static caches) marks keys past its end as
  empty slots;
* packed sequences in one row (no mask, ``position_ids`` restarting, or flash-attn style
  ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs from ``DataCollatorWithFlattening``): varlen.

``"xoffload_xattn"`` runs :func:`xoffload.sparse.xattention.xattention_prefill` (XAttention,
Xu et al. 2025: antidiagonal block scoring + threshold block selection + block-sparse attention)
for a causal prefill (``Sq > 1``; a cached prefix ``Sk > Sq`` is fine: the new queries sit at the
end) with no padding or packing and ``Sq >= min_len``, on the layers the policy applies to
(``policy.layers(config.num_hidden_layers)`` read through the module's ``layer_idx``); every other
call (decode steps, short prompts, padded batches, dense layers) is the dense path above. The
policy is a :class:`xoffload.sparse.XAttentionPrefill` (the same object ``xoffload.LLM(sparse=...)``
takes), given to :func:`register`; the registered function carries it (``fn.policy``,
``fn.min_len``), there is no module-global setting.

Dispatch rule of the kernels applies: CUDA tensors run Triton; CPU tensors run the fp32 PyTorch
reference, or the Triton code when ``TRITON_INTERPRET=1`` (slow: wrap whole-model CPU runs in
``xoffload.kernels.cpu_backend("reference")``).

Sliding-window layers and logit soft-capping run in the kernels on every path above (prefill,
decode, padded, packed): ``sliding_window=W`` (Mistral, Gemma 2/3 local layers, Qwen2-style
configs) is flash-attn's ``window_size=(W - 1, W - 1)`` as transformers' flash-attention path
passes it (causal: query at position p sees keys ``p - W < j <= p``, transformers' sliding mask),
and ``softcap`` (Gemma 2's ``attn_logit_softcapping``) is ``softcap * tanh(s / softcap)`` on the
scaled scores. A call with either runs the dense path of ``"xoffload_xattn"`` too (the sparse
prefill has neither). With a 2D padding mask the window counts the valid keys between query and
key (the same as transformers' mask for left or right padding; holes inside a row shift it).

Not supported, raising ``NotImplementedError`` naming the option: attention dropout > 0 (a model
in ``train()`` mode with ``attention_dropout``), attention sinks ``s_aux``, ``position_bias``;
a 4D or float ``attention_mask`` raises ``ValueError``. Forward only: inputs requiring grad under
grad mode raise ``NotImplementedError`` (run under ``torch.no_grad()``). ``output_attentions``
returns ``None`` weights, like ``sdpa``.
"""
from __future__ import annotations

import torch

from ..kernels.checks import check_int
from ..sparse.policy import PrefillPolicy, XAttentionPrefill
from . import ops

__all__ = [
    "register",
    "xoffload_attention_forward",
    "xoffload_xattn_attention_forward",
    "xoffload_mask",
    "xattn_attention",
    "DEFAULT_XATTN",
    "DEFAULT_XATTN_MIN_LEN",
    "XATTN_STATS",
    "NAMES",
]

NAMES = ("xoffload", "xoffload_xattn")

#: the policy of ``register()`` without arguments: tau 0.9, stride 8, block 128, every layer sparse,
#: no dense fallback inside the policy (the backend's ``min_len`` on the query length decides)
DEFAULT_XATTN = XAttentionPrefill(threshold=0.9, stride=8, block_size=128, dense_fallback_len=0, dense_layers=())
#: shortest prefill (query tokens) that runs the sparse path by default
DEFAULT_XATTN_MIN_LEN = 1024
#: Counters of the ``"xoffload_xattn"`` dispatch (updated in eager mode only): calls that ran the
#: sparse prefill, calls that ran the dense path, and the last density returned (kept blocks /
#: causal blocks, as returned by ``xattention_prefill``; not read on the host here).
XATTN_STATS = {"sparse_calls": 0, "dense_calls": 0, "last_density": None}


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------
def register(*, xattn: PrefillPolicy | None = None, xattn_min_len: int | None = None) -> None:
    """Register ``"xoffload"`` and ``"xoffload_xattn"`` with transformers (idempotent).

    Args:
        xattn: the prefill policy of ``"xoffload_xattn"`` (a :class:`xoffload.sparse.PrefillPolicy`,
            e.g. ``XAttentionPrefill(threshold=0.9, stride=8, dense_layers=())``); None: the
            default :data:`DEFAULT_XATTN`.
        xattn_min_len: shortest prefill (query tokens) that runs the sparse path (default 1024);
            shorter prompts run dense attention.
        With no arguments the default function :func:`xoffload_xattn_attention_forward` is
        registered; otherwise one built by :func:`xattn_attention` (replacing an earlier one).

    Raises:
        TypeError: ``xattn`` not a policy. ValueError: ``xattn_min_len`` < 1. ImportError:
        transformers is not installed.
    """
    from transformers import AttentionInterface

    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # pragma: no cover - older layouts
        from transformers.masking_utils import AttentionMaskInterface

    if xattn is None and xattn_min_len is None:
        fn = xoffload_xattn_attention_forward
    else:
        fn = xattn_attention(DEFAULT_XATTN if xattn is None else xattn,
                             DEFAULT_XATTN_MIN_LEN if xattn_min_len is None else xattn_min_len)
    AttentionInterface.register("xoffload", xoffload_attention_forward)
    AttentionInterface.register("xoffload_xattn", fn)
    for name in NAMES:
        AttentionMaskInterface.register(name, xoffload_mask)


def xattn_attention(policy: PrefillPolicy, min_len: int = DEFAULT_XATTN_MIN_LEN):
    """A transformers attention function running ``policy`` for causal prefills of at least
    ``min_len`` query tokens (see the module doc), dense otherwise; arguments and returns as
    :func:`xoffload_attention_forward`. The function has ``.policy`` and ``.min_len``."""
    if not isinstance(policy, PrefillPolicy):
        raise TypeError(f"xattn must be a xoffload.sparse.PrefillPolicy, got {type(policy).__name__} {policy!r}")
    min_len = check_int("xattn_min_len", min_len, 1)

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                          (policy, min_len), kwargs)

    forward.policy, forward.min_len = policy, min_len
    forward.__name__ = forward.__qualname__ = "xoffload_xattn_attention_forward"
    return forward


def xoffload_mask(batch_size=None, q_length=None, kv_length=None, q_offset=None, kv_offset=0, mask_function=None,
                  attention_mask=None, cache_position=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: returns None or a 2D bool padding mask.

    Never builds a 4D mask. Given transformers' 2D ``attention_mask`` ``[B, N]`` (True = real
    token), returns its last ``kv_length`` columns, or None when they are all True and cover all
    ``kv_length`` keys (the common no-padding case; reading that costs one host sync, as for
    transformers' flash-attention mask). Without a mask, returns a mask only when fewer than
    ``kv_length`` keys are filled (static caches): ``q_offset + q_length - kv_offset`` keys
    (older transformers pass ``cache_position`` instead of ``q_offset``/``q_length``). The causal
    pattern itself is applied by the attention function.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask  # a prepared 4D mask: the attention function reports it
    if kv_length is None:
        return attention_mask if attention_mask is None else attention_mask.to(torch.bool)
    if attention_mask is None:
        # filled keys = absolute end of the queries - first key position; a tensor offset (static
        # caches) is read on the host: the padded path syncs anyway
        if q_offset is None and cache_position is not None:
            end = int(cache_position[-1]) + 1
        else:
            end = int(0 if q_offset is None else q_offset) + int(q_length or 0)
        n_valid = end - int(kv_offset)
        if n_valid >= kv_length:
            return None
        return torch.ones(batch_size, max(n_valid, 0), dtype=torch.bool, device=kwargs.get("device", "cpu"))
    m = attention_mask[:, -kv_length:].to(torch.bool)
    if m.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(m.all()):
        return None
    return m


# ----------------------------------------------------------------------------------------------
# attention functions
# ----------------------------------------------------------------------------------------------
def xoffload_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
    """transformers attention function ``"xoffload"`` (dense).

    Args:
        module: the attention module (``is_causal`` read from it unless given).
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Sk, D]`` (transformers layout).
        attention_mask: None or a 2D bool ``[B, L]`` padding mask (from :func:`xoffload_mask`).
        dropout: must be 0 (NotImplementedError otherwise).
        scaling: softmax scale (default ``1/sqrt(D)``).
        is_causal: overrides ``module.is_causal``.
        kwargs: ``position_ids``, ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/
            ``max_length_k`` (packed sequences), ``sliding_window`` (int >= 1 or None) and
            ``softcap`` (float > 0 or None), run in the kernel, and unsupported options (see
            module doc).

    Returns:
        ``(attn_output [B, Sq, Hq, D] in query's dtype, None)``.
    """
    return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, None, kwargs)


xoffload_xattn_attention_forward = xattn_attention(DEFAULT_XATTN, DEFAULT_XATTN_MIN_LEN)
xoffload_xattn_attention_forward.__doc__ = """transformers attention function ``"xoffload_xattn"`` with
:data:`DEFAULT_XATTN`: XAttention sparse prefill (see module doc for when it applies), dense
otherwise. Arguments and returns as :func:`xoffload_attention_forward`."""


def _check_options(dropout, kwargs):
    """Refuse what the kernels do not run; return the kernel options ``{window_size, softcap}``
    for transformers' ``sliding_window`` and ``softcap`` (empty when neither is set)."""
    if dropout is not None and float(dropout) != 0.0:
        raise NotImplementedError(
            f"xoffload attention: dropout={dropout} is not supported (inference only); call model.eval()"
        )
    opts = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"xoffload attention: sliding_window must be an int >= 1 or None, got {window!r}")
        # transformers' window counts the query's own key: left = W - 1 (flash-attn's convention,
        # symmetric as transformers passes it; causal sets right = 0)
        opts["window_size"] = (window - 1, window - 1)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
            raise ValueError(f"xoffload attention: softcap must be a float > 0 or None, got {softcap!r}")
        opts["softcap"] = float(softcap)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("xoffload attention: attention sinks (s_aux) are not supported")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("xoffload attention: position_bias is not supported")
    return opts


def _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, xattn, kwargs):
    """``xattn``: None (dense) or ``(policy, min_len)``."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"xoffload attention: {name} must be a 4D tensor [B, H, S, D], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    b, hq, sq, _ = query.shape
    sk = key.shape[2]
    opts = _check_options(dropout, kwargs)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise NotImplementedError(
            "xoffload attention is forward-only (no backward); run the model under torch.no_grad() "
            "or torch.inference_mode()"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal)
    sparse = xattn is not None
    # transformers [B, H, S, D] -> flash layout [B, S, H, D] (views; the kernels honour strides)
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)

    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            raise ValueError(
                "xoffload attention takes no 4D or float attention_mask (got "
                f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
                f"{tuple(getattr(attention_mask, 'shape', ()))}); it needs the 2D bool padding mask that "
                "xoffload's mask function passes (call xoffload.integrations.transformers.register() before "
                "building the model, and pass a 2D attention_mask [batch, seq] to the model)"
            )
        if sparse:
            _count(False, None)
        return _padded(q, k, v, attention_mask, causal, scaling, opts), None

    cu = _packed_cu_seqlens(q, sq, sk, kwargs)
    if cu is not None:
        if sparse:
            _count(False, None)
        cu_q, cu_k, max_q, max_k = cu
        out, _ = ops.flash_attn_varlen(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, causal, scaling, **opts)
        return out.unsqueeze(0), None

    if sparse and not opts and causal and sq > 1 and sq >= xattn[1] and _policy_layer(module, xattn[0]):
        out, _lse, density = xattn[0](q, k, v, softmax_scale=scaling)
        _count(True, density)
        return out, None
    if sparse:
        _count(False, None)
    if sq == 1:
        seqlens = torch.full((b,), sk, dtype=torch.int32, device=q.device)
        out, _ = ops.decode_attn(q, k, v, seqlens, scaling, check=False, causal=causal, **opts)
    else:
        out, _ = ops.flash_attn(q, k, v, causal, scaling, **opts)
    return out, None


def _count(sparse_call: bool, density) -> None:
    if torch.compiler.is_compiling():
        return
    if sparse_call:
        XATTN_STATS["sparse_calls"] += 1
        XATTN_STATS["last_density"] = density
    else:
        XATTN_STATS["dense_calls"] += 1


def _policy_layer(module, policy) -> bool:
    """Whether ``policy`` applies to ``module``'s layer (True when the module does not say which)."""
    idx = getattr(module, "layer_idx", None)
    n = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    if idx is None or n is None:
        return True
    return int(idx) in policy.layers(int(n))


def _packed_cu_seqlens(q, sq, sk, kwargs):
    """(cu_q, cu_k, max_q, max_k) when one batch row holds several packed sequences, else None."""
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_q/cu_seq_lens_k need batch 1 (packed sequences), got batch {q.shape[0]}")
        max_q = kwargs.get("max_length_q")
        max_k = kwargs.get("max_length_k")
        cu_q = cu_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_k.to(device=q.device, dtype=torch.int32)
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q, cu_k, max_q, max_k
    pos = kwargs.get("position_ids")
    if (
        pos is None
        or torch.compiler.is_compiling()
        or q.shape[0] != 1
        or sq != sk
        or sq <= 1
        or pos.dim() != 2
        or pos.shape != (1, sq)
    ):
        return None
    p = pos[0]
    brk = torch.diff(p) != 1  # a sequence starts where positions do not continue
    if not bool(brk.any()):
        return None
    starts = torch.nonzero(brk).flatten() + 1
    dev = q.device
    cu = torch.cat([
        torch.zeros(1, dtype=torch.int32, device=dev),
        starts.to(device=dev, dtype=torch.int32),
        torch.full((1,), sq, dtype=torch.int32, device=dev),
    ])
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu, cu, max_len, max_len


def _padded(q, k, v, mask, causal, scaling, opts=None):
    """Attention of a padded batch through the varlen kernel (see module doc); ``opts``: the
    kernel's window / softcap keywords."""
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    if mask.shape[0] != b:
        raise ValueError(f"attention_mask has batch {mask.shape[0]} but the query has batch {b}")
    length = mask.shape[1]
    if length > sk or length < sq:
        raise ValueError(
            f"attention_mask covers {length} positions; expected between q_len={sq} and kv_len={sk}"
        )
    mask = mask.to(q.device)
    kmask = mask  # keys [0, length); keys past it are empty cache slots
    qmask = mask[:, length - sq:]  # queries sit at the last positions the mask covers
    k_len = kmask.sum(1, dtype=torch.int32)
    q_len = qmask.sum(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_k = torch.cat([zero, torch.cumsum(k_len, 0, dtype=torch.int32)])
    cu_q = torch.cat([zero, torch.cumsum(q_len, 0, dtype=torch.int32)])
    max_k = int(k_len.max()) if b else 0
    max_q = int(q_len.max()) if b else 0
    kp = k[:, :length][kmask]  # [total_k, Hkv, D]
    vp = v[:, :length][kmask]
    qp = q[qmask]  # [total_q, Hq, D]
    out_p, _ = ops.flash_attn_varlen(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal, scaling, **(opts or {}))
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=out_p.dtype, device=q.device)
    out[qmask] = out_p
    return out
