"""One Llama / Qwen3 decoder implementation: RMSNorm, RoPE (Llama-3 scaling), GQA attention through
:mod:`xoffload.kernels`, SwiGLU MLP, Qwen3's per-head q/k RMSNorm, tied or untied embeddings.

The model knows nothing about where KV lives. Prefill writes each layer's K/V through a *sink*
(``buffers(layer, T) -> (k, v)`` to fill, ``done(layer, k, v)`` once filled); decode reads it through
a *KV store* (``attend(layer, q, k_new, v_new) -> out``). :mod:`xoffload.models.llm` provides the
GPU cache and the offload-engine versions.

Prefill is layerwise: all prompt tokens pass layer ``l`` before layer ``l+1`` starts. Inside a layer
there are two passes over token chunks of ``chunk`` tokens, so activations stay bounded by the chunk
(only the residual stream ``[T, hidden]`` and the layer's K/V ``[T, Hkv, D]`` are whole-prompt):
pass 1 computes K and V for every token; pass 2 computes q for one chunk, attends causally to the
keys up to the chunk's end (``flash_attn_with_lse``, bottom-right aligned), then runs the output
projection and the MLP for that chunk and updates its residual rows in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig, rope_inv_freq


@dataclass
class LayerWeights:
    """Weights of one decoder layer, ``[out_features, in_features]`` like ``nn.Linear``.

    ``wqkv``: q, k, v projections stacked on dim 0 (``(Hq + 2*Hkv) * D`` rows); ``w_gate_up``: gate
    and up stacked (``2 * intermediate`` rows). ``q_norm``/``k_norm`` ``[D]`` for Qwen3, else None.
    """

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class Weights:
    """All weights: embedding ``[V, hidden]``, layers, final norm, lm_head (the embedding when tied)."""

    embed: torch.Tensor
    layers: list
    norm: torch.Tensor
    lm_head: torch.Tensor
    rope_freq_factors: torch.Tensor | None = None  # GGUF ``rope_freqs``: inv_freq is divided by it

    def nbytes(self) -> int:
        seen, total = set(), 0
        ts = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            ts += [lw.attn_norm, lw.wqkv, lw.wo, lw.mlp_norm, lw.w_gate_up, lw.w_down, lw.q_norm, lw.k_norm]
        for t in ts:
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and scaled by ``w`` in ``x``'s dtype (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF (rotate-half) layout. x ``[T, H, D]``; cos/sin ``[T, 1, D]`` in x's dtype."""
    return x * cos + _rotate_half(x) * sin


class LlamaModel:
    """A Llama / Qwen3 decoder with its weights on one device.

    Args:
        cfg: :class:`ModelConfig`.
        weights: :class:`Weights` on ``device`` in ``dtype``.
        tokenizer: a transformers tokenizer or None (then prompts must be token ids).
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer=None, source: str = ""):
        self.cfg = cfg
        self.w = weights
        self.tokenizer = tokenizer
        self.source = source
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.scale = cfg.head_dim ** -0.5
        inv = rope_inv_freq(cfg, device=self.device)
        if weights.rope_freq_factors is not None:
            inv = inv / weights.rope_freq_factors.to(device=self.device, dtype=torch.float32)
        self._inv_freq = inv
        self._cos = self._sin = None
        self._rope_len = 0
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self._q_rows, self._kv_rows = hq * d, hkv * d

    # ------------------------------------------------------------------ helpers
    def rope_tables(self, n: int):
        """cos/sin ``[n, 1, D]`` in the model dtype for positions ``0..n-1`` (cached, grown on demand)."""
        if n > self._rope_len:
            n2 = max(n, 2 * self._rope_len, 256)
            pos = torch.arange(n2, device=self.device, dtype=torch.int64).float()
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(self.dtype)[:, None, :]
            self._sin = emb.sin().to(self.dtype)[:, None, :]
            self._rope_len = n2
        return self._cos, self._sin

    def _qk_norm(self, x, w):
        return rms_norm(x, w, self.cfg.rms_norm_eps) if w is not None else x

    def _mlp_residual(self, lw: LayerWeights, h: torch.Tensor) -> None:
        """h += MLP(norm(h)) in place. h ``[c, hidden]``."""
        x = rms_norm(h, lw.mlp_norm, self.cfg.rms_norm_eps)
        gu = x @ lw.w_gate_up.t()
        i = self.cfg.intermediate_size
        a = F.silu(gu[:, :i]) * gu[:, i:]
        del gu
        h += a @ lw.w_down.t()

    def _q_chunk(self, lw, h_chunk, cos, sin):
        cfg = self.cfg
        x = rms_norm(h_chunk, lw.attn_norm, cfg.rms_norm_eps)
        q = (x @ lw.wqkv[: self._q_rows].t()).view(-1, cfg.num_heads, cfg.head_dim)
        q = self._qk_norm(q, lw.q_norm)
        return apply_rope(q, cos, sin)

    def _kv_chunk(self, lw, h_chunk, cos, sin):
        cfg = self.cfg
        x = rms_norm(h_chunk, lw.attn_norm, cfg.rms_norm_eps)
        kv = x @ lw.wqkv[self._q_rows:].t()
        k = kv[:, : self._kv_rows].view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = kv[:, self._kv_rows:].view(-1, cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(self._qk_norm(k, lw.k_norm), cos, sin)
        return k, v

    def _causal_attn(self, q, k, v, backend: str):
        """Causal (bottom-right aligned) attention of a query chunk: q ``[c, Hq, D]`` against
        k/v ``[e, Hkv, D]`` (``e >= c``: the chunk's own keys are the last ``c``). Returns
        ``[c, Hq, D]``. ``backend``: ``"xoffload"`` (flash_attn_with_lse) or ``"sdpa"`` (PyTorch's
        scaled_dot_product_attention with a lower-right causal bias and native GQA)."""
        if backend == "sdpa":
            c, e = q.shape[0], k.shape[0]
            qt, kt, vt = (x[None].transpose(1, 2) for x in (q, k, v))
            if c == e:
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right

                o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(c, e),
                                                   scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2)[0]
        from xoffload.kernels import flash_attn_with_lse

        o, _ = flash_attn_with_lse(q[None], k[None], v[None], causal=True, softmax_scale=self.scale)
        return o[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of final hidden states ``h`` ``[n, hidden]`` (final norm applied here)."""
        x = rms_norm(h, self.w.norm, self.cfg.rms_norm_eps)
        return (x @ self.w.lm_head.t()).float()

    # ------------------------------------------------------------------ prefill
    def prefill(self, ids: torch.Tensor, sink, *, chunk: int = 4096, all_logits: bool = False,
                sparse_fn=None, sparse_layers=(), densities: list | None = None,
                attn_backend: str = "xoffload") -> torch.Tensor:
        """Layerwise prefill of one sequence.

        Args:
            ids: int64 ``[T]`` token ids on the model's device, ``T >= 1``.
            sink: object with ``buffers(layer, T) -> (k, v)`` (``[T, Hkv, D]`` tensors to fill) and
                ``done(layer, k, v)`` (called once layer ``layer``'s K/V are written).
            chunk: tokens per chunk for projections, attention queries and the MLP.
            all_logits: return logits for every position (``[T, V]``) instead of the last (``[1, V]``).
            sparse_fn: None, or ``fn(q, k, v) -> (out, density)`` used instead of dense attention
                for the layers in ``sparse_layers``; called with the whole layer's q ``[1, T, Hq, D]``
                and k/v ``[1, T, Hkv, D]``, returns out ``[1, T, Hq, D]`` and the kept fraction.
            sparse_layers: layer indices that use ``sparse_fn``.
            densities: list receiving one entry per layer: ``sparse_fn``'s density, or None (dense).
            attn_backend: dense causal attention of the prompt: ``"xoffload"`` (the Triton
                ``flash_attn_with_lse``; the kernels' reference on the CPU) or ``"sdpa"`` (PyTorch).
        Returns:
            fp32 logits.
        """
        if attn_backend not in ("xoffload", "sdpa"):
            raise ValueError(f"attn_backend must be 'xoffload' or 'sdpa', got {attn_backend!r}")
        cfg = self.cfg
        T = int(ids.shape[0])
        chunk = max(1, int(chunk))
        cos_all, sin_all = self.rope_tables(T)
        h = F.embedding(ids, self.w.embed)  # [T, hidden]
        for li, lw in enumerate(self.w.layers):
            k, v = sink.buffers(li, T)
            for s in range(0, T, chunk):
                e = min(T, s + chunk)
                kc, vc = self._kv_chunk(lw, h[s:e], cos_all[s:e], sin_all[s:e])
                k[s:e] = kc
                v[s:e] = vc
                del kc, vc
            out_full = density = None
            if sparse_fn is not None and li in sparse_layers:
                q_full = torch.empty(T, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
                for s in range(0, T, chunk):
                    e = min(T, s + chunk)
                    q_full[s:e] = self._q_chunk(lw, h[s:e], cos_all[s:e], sin_all[s:e])
                out_full, density = sparse_fn(q_full[None], k[None], v[None])
                del q_full
            if densities is not None:
                densities.append(density)
            for s in range(0, T, chunk):
                e = min(T, s + chunk)
                if out_full is not None:
                    o = out_full[0, s:e]
                else:
                    q = self._q_chunk(lw, h[s:e], cos_all[s:e], sin_all[s:e])
                    o = self._causal_attn(q, k[:e], v[:e], attn_backend)
                    del q
                hc = h[s:e]
                hc += o.reshape(e - s, -1).to(self.dtype) @ lw.wo.t()
                del o
                self._mlp_residual(lw, hc)
            del out_full
            sink.done(li, k, v)
            del k, v
        if all_logits:
            return torch.cat([self.logits(h[s:s + chunk]) for s in range(0, T, chunk)])
        return self.logits(h[-1:])

    # ------------------------------------------------------------------ decode
    def decode_step(self, token: torch.Tensor, pos, kv) -> torch.Tensor:
        """One decode step for one sequence.

        Args:
            token: int64 ``[1]`` on the model's device (the token at position ``pos``).
            pos: its position (number of tokens already in the KV store): a Python int, or an int64
                ``[1]`` tensor on the model's device (CUDA-graph safe: the position is never read on
                the host; the caller must have grown the RoPE tables past it with
                :meth:`rope_tables` first, they are not grown here).
            kv: object with ``attend(layer, q [1, Hq, D], k_new [1, Hkv, D], v_new) -> out [1, Hq, D]``
                that appends the new K/V to the layer and attends over all of it.
        Returns:
            fp32 logits ``[1, V]``.
        """
        cfg = self.cfg
        if isinstance(pos, torch.Tensor):
            if self._cos is None:
                raise ValueError("decode_step with a tensor pos needs rope_tables(n) called first")
            # rows of the same tables as the int path: bit-identical values, no host read
            cos, sin = self._cos.index_select(0, pos), self._sin.index_select(0, pos)
        else:
            cos_all, sin_all = self.rope_tables(pos + 1)
            cos, sin = cos_all[pos:pos + 1], sin_all[pos:pos + 1]
        h = F.embedding(token, self.w.embed)  # [1, hidden]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for li, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.attn_norm, cfg.rms_norm_eps)
            qkv = x @ lw.wqkv.t()
            q = qkv[:, : self._q_rows].view(1, hq, d)
            k = qkv[:, self._q_rows: self._q_rows + self._kv_rows].view(1, hkv, d)
            v = qkv[:, self._q_rows + self._kv_rows:].view(1, hkv, d)
            q = apply_rope(self._qk_norm(q, lw.q_norm), cos, sin)
            k = apply_rope(self._qk_norm(k, lw.k_norm), cos, sin)
            o = kv.attend(li, q, k, v.contiguous())
            h = h + o.reshape(1, -1).to(self.dtype) @ lw.wo.t()
            self._mlp_residual(lw, h)
        return self.logits(h)

    # ------------------------------------------------------------------ plain forward
    def forward(self, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Logits ``[T, V]`` fp32 for every position of ``ids`` (int64 ``[T]``); no cache kept."""
        cfg = self.cfg
        dev, dt = self.device, self.dtype

        class _Scratch:
            def buffers(self, layer, T):
                shape = (T, cfg.num_kv_heads, cfg.head_dim)
                return torch.empty(shape, dtype=dt, device=dev), torch.empty(shape, dtype=dt, device=dev)

            def done(self, layer, k, v):
                pass

        return self.prefill(ids.to(dev), _Scratch(), chunk=chunk, all_logits=True)
