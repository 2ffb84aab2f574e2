"""PyTorch fp32 references for every kernel in :mod:`xoffload.kernels`.

They compute the same function as the Triton kernels, in fp32, with the project's conventions:
flash-attn layout, natural-log fp32 LSE, bottom-right aligned causal masking, and rows that see no
key returning output 0 and LSE -inf. They are the CPU path (no interpreter) and the tests' oracle.
They are written for clarity, not speed: memory is O(Sq * Sk) per head.
"""
from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def _scale(d: int, softmax_scale):
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """Bool ``[sq, sk]``: query i sees key j iff ``j <= i + (sk - sq)`` (bottom-right aligned)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def masked_attention_ref(q, k, v, allowed=None, softmax_scale=None):
    """Attention of one batch item under an explicit boolean mask, in fp32.

    q: ``[Sq, Hq, D]``, k/v: ``[Sk, Hkv, D]``; ``allowed``: bool broadcastable to ``[Hq, Sq, Sk]``
    (None = all keys). Returns (out ``[Sq, Hq, D]`` fp32, lse ``[Hq, Sq]`` fp32); rows with no
    allowed key give out 0 and lse -inf.
    """
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    scale = _scale(d, softmax_scale)
    qf = q.float().permute(1, 0, 2)  # [Hq, Sq, D]
    kf = k.float().permute(1, 0, 2).repeat_interleave(group, dim=0)  # [Hq, Sk, D]
    vf = v.float().permute(1, 0, 2).repeat_interleave(group, dim=0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Sq, Sk]
    if allowed is not None:
        s = s.masked_fill(~allowed.to(s.device).expand(hq, sq, sk), NEG_INF)
    lse = torch.logsumexp(s, dim=-1) if sk > 0 else torch.full((hq, sq), NEG_INF, device=q.device)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows with lse = -inf
    out = torch.matmul(p, vf) if sk > 0 else torch.zeros(hq, sq, dv, device=q.device)
    return out.permute(1, 0, 2).contiguous(), lse


def attention_ref(q, k, v, *, causal=False, softmax_scale=None):
    """Reference for :func:`flash_attn_with_lse`.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``. Returns (out ``[B, Sq, Hq, D]`` fp32,
    lse ``[B, Hq, Sq]`` fp32).
    """
    b, sq = q.shape[:2]
    sk = k.shape[1]
    allowed = causal_mask(sq, sk, q.device) if causal else None
    outs, lses = [], []
    for i in range(b):
        o, l = masked_attention_ref(q[i], k[i], v[i], allowed, softmax_scale)
        outs.append(o)
        lses.append(l)
    if b == 0:
        return (torch.zeros(q.shape[:3] + (v.shape[-1],), device=q.device),
                torch.zeros(0, q.shape[2], sq, device=q.device))
    return torch.stack(outs), torch.stack(lses)


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None):
    """Reference for :func:`flash_attn_varlen_with_lse`.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``, int32 cu_seqlens of length B+1.
    Returns (out ``[total_q, Hq, D]`` fp32, lse ``[Hq, total_q]`` fp32).
    """
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, device=q.device)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        allowed = causal_mask(qe - qs, ke - ks, q.device) if causal else None
        o, l = masked_attention_ref(q[qs:qe], k[ks:ke], v[ks:ke], allowed, softmax_scale)
        out[qs:qe] = o
        lse[:, qs:qe] = l
    return out, lse


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, *, softmax_scale=None):
    """Reference for :func:`decode_attn_with_lse`.

    q ``[B, 1, Hq, D]``, caches ``[B, S_max, Hkv, D]``, cache_seqlens int ``[B]``: item b attends to
    its first ``cache_seqlens[b]`` cached tokens. Returns (out ``[B, 1, Hq, D]`` fp32, lse
    ``[B, Hq, 1]`` fp32).
    """
    lens = cache_seqlens.tolist()
    outs, lses = [], []
    for i, n in enumerate(lens):
        o, l = masked_attention_ref(q[i], k_cache[i, :n], v_cache[i, :n], None, softmax_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def merge_ref(outs, lses):
    """Reference for merging N partial attention states.

    outs ``[N, ..., D]`` (any float dtype), lses ``[N, ...]`` fp32 where ``...`` of lses equals the
    leading dims of outs. Returns (out fp32 ``[..., D]``, lse fp32 ``[...]``); all -inf -> (0, -inf).
    """
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - lse.unsqueeze(0))
    w = torch.nan_to_num(w, nan=0.0)
    out = (w.unsqueeze(-1) * outs.float()).sum(0)
    return out, lse


def block_sparse_attention_ref(q, k, v, block_mask, *, block_size=128, causal=True, softmax_scale=None):
    """Reference for :func:`block_sparse_attn_with_lse`: masked attention over the kept blocks.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, block_mask bool ``[B, Hq, ceil(Sq/bs), ceil(Sk/bs)]``
    (or with ``Hkv`` heads: one mask per KV head, shared by its query heads). Query blocks are
    counted from the first query row; with causal the bottom-right rule applies inside kept blocks.
    Returns (out fp32 ``[B, Sq, Hq, D]``, lse fp32 ``[B, Hq, Sq]``).
    """
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    mask_h = block_mask.shape[1]
    bm = block_mask.bool()
    if mask_h != hq:
        bm = bm.repeat_interleave(hq // mask_h, dim=1)
    outs, lses = [], []
    for i in range(b):
        allowed = bm[i].repeat_interleave(block_size, 1)[:, :sq].repeat_interleave(block_size, 2)[:, :, :sk]
        if causal:
            allowed = allowed & causal_mask(sq, sk, q.device)
        o, l = masked_attention_ref(q[i], k[i], v[i], allowed, softmax_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)
