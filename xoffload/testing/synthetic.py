"""Synthetic Q/K/V with the attention structure of real LLM layers (local window + attention sink).

Random Gaussian Q/K give near-uniform attention, on which any sparse method looks bad (or, with a
low threshold, deceptively good). Real prefill attention is dominated by keys near the query and
by a few "sink" tokens at the start. This builds that structure from RoPE (Su et al. 2021) alone:

* every KV head has a content vector ``u``; key ``s`` is ``RoPE(s)(u + noise)`` and a query of that
  head at ``t`` is ``RoPE(t)(u + head offset + noise)``. Then ``q_t . k_s`` is a sum of cosines
  of ``theta_i (t - s)``: large at ``t = s`` and decaying, oscillating, with distance — local
  attention whose width is set by the RoPE frequencies, with noise as the background;
* the first ``sink_tokens`` keys get an extra component in the slowest-rotating RoPE pairs that
  every query shares, so all queries put a sizeable share of their mass on them (attention sink).

``peak`` is the softmax logit (``q.k / sqrt(D)``) at distance 0; ``sink`` the logit of the sink.
Used by the XAttention benchmark and GPU tests; state these settings when reporting numbers.
"""
from __future__ import annotations

import math

import torch

__all__ = ["rope", "structured_qkv"]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotate ``x [..., S, H, D]`` (half-split pairs ``(i, i + D/2)``) by ``positions [S]``; fp32."""
    d = x.shape[-1]
    half = d // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2.0 / d)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [S, D/2]
    cos = ang.cos().float()[:, None, :]
    sin = ang.sin().float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:2 * half] = x1 * sin + x2 * cos
    if d % 2:
        out[..., -1] = x[..., -1].float()
    return out


@torch.no_grad()
def structured_qkv(seq_len, num_heads, num_kv_heads, head_dim, *, batch=1, dtype=torch.bfloat16,
                   device="cuda", seed=0, peak=(14.0, 26.0), sink=8.0, sink_tokens=4, noise=0.6,
                   head_spread=0.3, theta=500000.0):
    """Q ``[B, S, Hq, D]``, K/V ``[B, S, Hkv, D]`` in ``dtype`` with local + sink attention.

    Args:
        seq_len, num_heads, num_kv_heads, head_dim, batch: shapes (``num_heads % num_kv_heads == 0``).
        peak: logit at distance 0 (content-vector norm^2 / sqrt(D)); a ``(lo, hi)`` pair spreads
            the KV heads' peaks evenly over that range (broad to sharp heads).
        sink: extra logit every query gives the first ``sink_tokens`` keys.
        noise: relative per-position noise on the content vectors (background attention).
        head_spread: relative per-query-head deviation from its KV head's content.
        theta: RoPE base (Llama-3 style 500000).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    g = torch.Generator(device="cpu").manual_seed(seed)
    d = head_dim
    group = num_heads // num_kv_heads
    if isinstance(peak, (tuple, list)):
        lo, hi = float(peak[0]), float(peak[1])
        peaks = torch.linspace(lo, hi, num_kv_heads) if num_kv_heads > 1 else torch.tensor([(lo + hi) / 2])
    else:
        peaks = torch.full((num_kv_heads,), float(peak))
    norm = torch.sqrt(peaks * math.sqrt(d))[:, None]  # [Hkv, 1]
    u = torch.randn(num_kv_heads, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True) * norm
    dq = torch.randn(num_heads, d, generator=g)
    dq = dq / dq.norm(dim=-1, keepdim=True) * norm.repeat_interleave(group, 0) * head_spread
    uq = u.repeat_interleave(group, 0) + dq
    # sink direction: the slowest-rotating RoPE pair (i = D/2 - 1 and its partner)
    sdir = torch.zeros(d)
    sdir[d // 2 - 1] = 1.0
    sdir[d - 1] = 1.0
    sdir = sdir / sdir.norm()
    sink_amp = math.sqrt(sink * math.sqrt(d))
    uq = uq + sdir * sink_amp  # every query carries the sink component
    nk = (noise * norm / math.sqrt(d)).to(device)  # [Hkv, 1] noise scale per KV head
    nq = nk.repeat_interleave(group, 0)
    u, uq, sdir = u.to(device), uq.to(device), sdir.to(device)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    pos = torch.arange(seq_len, device=device)
    qs, ks, vs = [], [], []
    for _ in range(batch):
        kc = u[None] + nk * torch.randn(seq_len, num_kv_heads, d, generator=dev_gen, device=device)
        kc[:sink_tokens] += sdir * sink_amp
        qc = uq[None] + nq * torch.randn(seq_len, num_heads, d, generator=dev_gen, device=device)
        ks.append(rope(kc, pos, theta).to(dtype))
        del kc
        qs.append(rope(qc, pos, theta).to(dtype))
        del qc
        vs.append(torch.randn(seq_len, num_kv_heads, d, generator=dev_gen, device=device).to(dtype))
    return torch.stack(qs), torch.stack(ks), torch.stack(vs)
