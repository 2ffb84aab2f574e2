"""One Llama / Qwen3 decoder implementation: RMSNorm, RoPE (Llama-3 scaling), GQA attention through
:mod:`xoffload.kernels`, SwiGLU MLP, Qwen3's per-head q/k RMSNorm, tied or untied embeddings.

The model knows nothing about where KV lives. Prefill writes each layer's K/V through a *sink*
(``buffers(layer, T) -> (k, v)`` to fill, ``done(layer, k, v)`` once filled); decode reads it through
a *KV store* (``attend(layer, q, k_new, v_new) -> out``); :mod:`xoffload.kv` provides them (its
contracts: :mod:`xoffload.kv.protocols`); which attention a prefill layer runs is a
:class:`xoffload.sparse.PrefillPolicy`'s choice.

Prefill is layerwise: all prompt tokens pass layer ``l`` before layer ``l+1`` starts. Inside a layer,
pass 1 runs norm + QKV projection + RoPE over token chunks into the whole layer's q and K/V; the
layer's causal attention runs at once over the whole prompt (no LSE needed, so the fastest correct
kernel: :func:`xoffload.kernels.causal_attention`), written over q in place; pass 2 runs the output
projection and the MLP over token chunks, updating the residual rows in place. Whole-prompt
activations: the residual stream ``[T, hidden]``, q / attention output ``[T, Hq, D]`` and the
layer's K/V ``[T, Hkv, D]``; the rest is bounded by the chunk. :meth:`LlamaModel.prefill_batch` runs
the same layers over several sequences at once (their tokens concatenated, one varlen attention
launch per layer, each sequence its own positions and history).

(Over 450 lines on purpose: the one-sequence prefill, the batched prefill and the decode step share
the layer helpers and the weights; apart they would each re-import and re-document them.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import (causal_attention, flash_attn_varlen_with_lse, flash_attn_with_lse, merge_attention_states,
                       qkv_rope, silu_mul)
from ..kernels import rms_norm as fused_rms_norm
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


def _check_backend(attn_backend) -> None:
    if attn_backend not in ("auto", "cudnn", "xoffload", "sdpa"):
        raise ValueError(f"attn_backend must be 'auto', 'cudnn', 'xoffload' or 'sdpa', got {attn_backend!r}")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF (rotate-half) layout. x ``[T, H, D]``; cos/sin ``[T, 1, D]`` in x's dtype."""
    return x * cos + _rotate_half(x) * sin


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` through the fused kernel (one read, one write; torch on the CPU)."""
    return fused_rms_norm(x.reshape(-1, x.shape[-1]), w, eps).view(x.shape)


class LlamaModel:
    """A Llama / Qwen3 decoder with its weights on one device.

    Args:
        cfg: :class:`ModelConfig`.
        weights: :class:`Weights` on ``device`` in ``dtype``.
        tokenizer: a transformers tokenizer or None (then prompts must be token ids).
        tp: None (one device: the code path of a model without tensor parallelism), or this rank's
            :class:`xoffload.models.parallel.TensorParallel`: then ``cfg`` is the rank's local
            config and ``weights`` its shard, and the model calls ``tp.all_reduce`` after the
            o-projection and the down projection, ``tp.embed`` / ``tp.gather_logits`` for the
            vocab-parallel embedding and LM head.
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer=None, source: str = "", tp=None):
        self.cfg = cfg
        self.tp = tp
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

    def _mlp_residual(self, lw: LayerWeights, h: torch.Tensor) -> None:
        """h += MLP(norm(h)) in place. h ``[c, hidden]`` (rows contiguous)."""
        x = _norm(h, lw.mlp_norm, self.cfg.rms_norm_eps)
        gu = x @ lw.w_gate_up.t()
        del x
        i = self.cfg.intermediate_size
        a = silu_mul(gu, i, out=gu[:, :i])  # in place over the gate half
        self._add_proj(h, a, lw.w_down)

    def _add_proj(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        """h += x @ w.T in place; with tensor parallelism the partial product is all-reduced first."""
        if self.tp is None:
            h.addmm_(x, w.t())  # residual add fused into the GEMM (beta=1)
        else:
            h.add_(self.tp.all_reduce(x @ w.t()))

    def _layer_qkv(self, lw: LayerWeights, h: torch.Tensor, pos, k: torch.Tensor, v: torch.Tensor,
                   chunk: int) -> torch.Tensor:
        """A prefill layer's first half over token chunks: norm + QKV + RoPE of the residual rows
        ``h [T, hidden]`` into a new q ``[T, Hq, D]`` (returned) and the sink's ``k`` / ``v`` ``[T,
        Hkv, D]``; ``pos``: the first token's position (int: consecutive positions) or int64 ``[T]``
        on the device (each token's own)."""
        T = h.shape[0]
        q = torch.empty(T, self.cfg.num_heads, self.cfg.head_dim, dtype=self.dtype, device=self.device)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            self._qkv(lw, h[s:e], pos + s if isinstance(pos, int) else pos[s:e], q[s:e], k[s:e], v[s:e])
        return q

    def _out_mlp(self, lw: LayerWeights, h: torch.Tensor, o: torch.Tensor, chunk: int) -> None:
        """A prefill layer's second half over token chunks, in place on the residual ``h [T,
        hidden]``: output projection of the attention output ``o [T, Hq, D]`` + residual, MLP +
        residual."""
        T = h.shape[0]
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            hc = h[s:e]
            self._add_proj(hc, o[s:e].reshape(e - s, -1), lw.wo)
            self._mlp_residual(lw, hc)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.w.embed)
        return self.tp.embed(ids, self.w.embed)

    def _qkv(self, lw, h_rows, pos, q_out=None, k_out=None, v_out=None):
        """Norm, fused QKV projection, q/k norm (Qwen3) and RoPE of consecutive tokens starting at
        position ``pos`` (int, or int64 ``[1]`` on the device), written into q_out ``[c, Hq, D]``,
        k_out / v_out ``[c, Hkv, D]`` (views of the layer's buffers allowed; None: in place, as
        views of the projection's output — no extra allocation, e.g. per decode step). The RoPE
        tables must cover ``pos + c`` (:meth:`rope_tables`). Returns ``(q, k, v)``."""
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = _norm(h_rows, lw.attn_norm, cfg.rms_norm_eps)
        qkv = x @ lw.wqkv.t()
        del x
        c, qr, kr = qkv.shape[0], self._q_rows, self._kv_rows
        q_out = qkv[:, :qr].view(c, hq, d) if q_out is None else q_out
        k_out = qkv[:, qr:qr + kr].view(c, hkv, d) if k_out is None else k_out
        v_out = qkv[:, qr + kr:].view(c, hkv, d) if v_out is None else v_out
        return qkv_rope(qkv, self._cos, self._sin, pos, hq, hkv, d, q_out, k_out, v_out,
                                   q_norm=lw.q_norm, k_norm=lw.k_norm, eps=cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of final hidden states ``h`` ``[n, hidden]`` (final norm applied here)."""
        x = _norm(h, self.w.norm, self.cfg.rms_norm_eps)
        if self.tp is not None:
            return self.tp.gather_logits(x @ self.w.lm_head.t()).float()
        return (x @ self.w.lm_head.t()).float()

    # ------------------------------------------------------------------ prefill
    def prefill(self, ids: torch.Tensor, sink, *, chunk: int = 4096, all_logits: bool = False,
                policy=None, densities: list | None = None, attn_backend: str = "auto",
                start: int = 0) -> torch.Tensor:
        """Layerwise prefill of one sequence, or of a new chunk continuing one (``start > 0``).

        Per layer: (1) norm + fused QKV projection + RoPE over token chunks, writing the whole
        layer's q ``[T, Hq, D]`` and its K/V (into the sink's buffers); (2) causal attention of the
        whole prompt at once (no LSE is needed: :func:`xoffload.kernels.causal_attention`, the
        fastest correct kernel available, or the sparse ``policy``), written over q in place; (3) the
        sink gets the layer's K/V (offload: the D2H copy overlaps step 4); (4) output projection
        + residual + MLP over token chunks. Activation memory: the residual stream
        ``[T, hidden]``, q / attention output ``[T, Hq, D]``, the layer's K/V and one chunk's
        temporaries.

        Args:
            ids: int64 ``[T]`` token ids on the model's device, ``T >= 1``.
            sink: object with ``buffers(layer, T) -> (k, v)`` (``[T, Hkv, D]`` tensors to fill) and
                ``done(layer, k, v)`` (called once layer ``layer``'s K/V are written and attended).
            chunk: tokens per chunk for the projections and the MLP.
            all_logits: return logits for every position (``[T, V]``) instead of the last (``[1, V]``).
            policy: None (dense), or a :class:`xoffload.sparse.PrefillPolicy`: ``policy(q, k, v) ->
                (out, lse, density)`` runs instead of dense attention on the layers
                ``policy.layers(num_layers)``; called with the whole layer's q ``[1, T, Hq, D]`` and
                k/v ``[1, T, Hkv, D]``, returns out ``[1, T, Hq, D]``, the LSE (unused here) and the
                kept fraction.
            densities: list receiving one entry per layer: the policy's density, or None (dense).
            start: position of ``ids[0]``: the tokens ``0 .. start-1`` are a history whose K/V the
                sink holds (a session's earlier turns). With ``start > 0`` the sink must also have
                ``history(layer, q) -> (o, lse)``: the attention of the chunk's queries ``q [T, Hq,
                D]`` over (all or a chosen part of) the history, non-causal (every history token
                precedes the chunk), o ``[1, T, Hq, D]`` and fp32 lse ``[1, Hq, T]``; each layer
                then attends causally within the chunk with its LSE (``flash_attn_with_lse``, or
                the policy) and merges the two by LSE. Positions (RoPE) start at ``start``.
            attn_backend: dense causal attention: ``"auto"`` (cuDNN where it runs, else ours),
                ``"cudnn"``, ``"xoffload"`` (the Triton ``flash_attn_with_lse``; the kernels'
                reference on the CPU) or ``"sdpa"`` (PyTorch's own choice).
        Returns:
            fp32 logits.
        Raises:
            ValueError: unknown ``attn_backend``, a negative ``start``, or ``start > 0`` with a sink
                that has no ``history``.
        """
        _check_backend(attn_backend)
        start = int(start)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if start and not hasattr(sink, "history"):
            raise ValueError(f"prefill from start={start} needs a sink with history(layer, q); "
                             f"{type(sink).__name__} has none")
        cfg = self.cfg
        T = int(ids.shape[0])
        chunk = max(1, int(chunk))
        sparse_layers = frozenset(policy.layers(cfg.num_layers)) if policy is not None else frozenset()
        self.rope_tables(start + T)
        h = self._embed(ids)  # [T, hidden]
        for li, lw in enumerate(self.w.layers):
            k, v = sink.buffers(li, T)
            q = self._layer_qkv(lw, h, start, k, v, chunk)
            density = None
            if start:
                o, density = self._attend_with_history(li, q, k, v, sink, policy if li in sparse_layers else None)
            elif li in sparse_layers:
                o, _lse, density = policy(q[None], k[None], v[None])
                o = o[0]
            else:
                o = causal_attention(q[None], k[None], v[None], softmax_scale=self.scale, backend=attn_backend,
                                     out=q[None])[0]
            del q
            if densities is not None:
                densities.append(density)
            sink.done(li, k, v)
            del k, v
            self._out_mlp(lw, h, o, chunk)
            del o
        if all_logits:
            return torch.cat([self.logits(h[s:s + chunk]) for s in range(0, T, chunk)])
        return self.logits(h[-1:])

    def _attend_with_history(self, li, q, k, v, sink, policy):
        """Chunk attention of layer ``li`` continuing a history: causal within the chunk (with its
        LSE; the policy's when given) merged by LSE with ``sink.history(li, q)``; written over q.
        Returns ``(out [T, Hq, D], density or None)``."""
        density = None
        if policy is not None:
            o, lse, density = policy(q[None], k[None], v[None])
        else:
            o, lse = flash_attn_with_lse(q[None], k[None], v[None], causal=True, softmax_scale=self.scale)
        o_h, lse_h = sink.history(li, q)
        o, _ = merge_attention_states(o, lse, o_h, lse_h, out=q[None])
        return o[0], density

    # ------------------------------------------------------------------ batched prefill
    def prefill_batch(self, ids: torch.Tensor, lens, starts, sink, *, chunk: int = 4096,
                      attn_backend: str = "auto") -> torch.Tensor:
        """Layerwise prefill of ``B`` sequences at once (varlen, cu_seqlens style): e.g. the short
        prompts a batched generate admits together, each continuing its own reused prefix.

        The norms, the QKV projection, the o-projection and the MLP run over the concatenated
        tokens (the weights read once for the group; token chunks of ``chunk`` as in
        :meth:`prefill`); RoPE with one position per token (sequence b's tokens at ``starts[b] ..
        starts[b] + lens[b] - 1``); attention causal within each sequence by one varlen launch
        with its LSE (:func:`~xoffload.kernels.flash_attn_varlen_with_lse`, nothing read on the
        host) and, when some sequence has a history (``starts[b] > 0``), merged by LSE with
        ``sink.history`` (one call for the group). Activation memory: as :meth:`prefill` of
        ``T = sum(lens)`` tokens. Every sequence gives the logits its own :meth:`prefill` (with
        ``start=starts[b]``) gives, within the rounding of other GEMM shapes and kernels.

        Args:
            ids: int64 ``[T]`` on the model's device: sequence 0's tokens, then sequence 1's, ...
            lens: ``B >= 1`` ints >= 1 (host): tokens of each sequence in ``ids``.
            starts: ``B`` ints >= 0 (host): the position of each sequence's first token (the
                length of the history whose K/V the sink holds; 0: none).
            sink: ``buffers(layer, T) -> (k, v)`` (``[T, Hkv, D]`` to fill, rows in ``ids``'s
                order), ``done(layer, k, v)`` (layer ``layer``'s K/V written and attended; the
                sink stores each sequence's rows), and, when some start is > 0, ``history(layer,
                q) -> (o, lse)``: the queries ``q [T, Hq, D]`` over their own sequence's history,
                non-causal, o ``[T, Hq, D]`` in the model dtype and fp32 lse ``[Hq, T]`` (the
                varlen layout; rows of a sequence without history: lse -inf).
            chunk: tokens per chunk for the projections and the MLP.
            attn_backend: ``"auto"`` / ``"xoffload"``: the varlen kernel for every sequence;
                ``"cudnn"`` / ``"sdpa"``: each sequence as :meth:`prefill` attends it
                (:func:`~xoffload.kernels.causal_attention` with that backend without a history,
                ``flash_attn_with_lse`` with one): one launch per sequence, for comparisons.
        Returns:
            fp32 logits ``[B, V]`` of each sequence's last token.
        Raises:
            ValueError: unknown ``attn_backend``; lens / starts of another length than each other,
                empty, a length < 1 or a start < 0, or ``sum(lens)`` not ``ids``'s length; a start
                > 0 with a sink that has no ``history``.
        """
        _check_backend(attn_backend)
        lens, starts = [int(n) for n in lens], [int(s) for s in starts]
        if not lens or len(lens) != len(starts):
            raise ValueError(f"prefill_batch needs one start per sequence and at least one sequence, got "
                             f"{len(lens)} lens and {len(starts)} starts")
        if min(lens) < 1 or min(starts) < 0:
            raise ValueError(f"prefill_batch needs lens >= 1 and starts >= 0, got lens {lens[:8]} starts {starts[:8]}")
        T, B = sum(lens), len(lens)
        if ids.dim() != 1 or int(ids.shape[0]) != T:
            raise ValueError(f"ids must be [sum(lens)] = [{T}], got shape {tuple(ids.shape)}")
        hist = any(starts)
        if hist and not hasattr(sink, "history"):
            raise ValueError(f"prefill_batch with starts > 0 needs a sink with history(layer, q); "
                             f"{type(sink).__name__} has none")
        chunk = max(1, int(chunk))
        self.rope_tables(max(s + n for s, n in zip(starts, lens)))
        pos, last, cu = self._segments(lens, starts)
        per_seq = attn_backend in ("cudnn", "sdpa")
        bounds = [(sum(lens[:b]), sum(lens[:b + 1])) for b in range(B)] if per_seq else None
        h = self._embed(ids)  # [T, hidden]
        for li, lw in enumerate(self.w.layers):
            k, v = sink.buffers(li, T)
            q = self._layer_qkv(lw, h, pos, k, v, chunk)
            if per_seq:
                o = self._attend_segments(li, q, k, v, sink, bounds, starts, attn_backend)
            else:
                o, lse = flash_attn_varlen_with_lse(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                    softmax_scale=self.scale, check=False)
                if hist:
                    o_h, lse_h = sink.history(li, q)
                    o, _ = merge_attention_states(o, lse, o_h, lse_h, out=q)
                    del o_h, lse_h
                del lse
            del q
            sink.done(li, k, v)
            del k, v
            self._out_mlp(lw, h, o, chunk)
            del o
        return self.logits(h.index_select(0, last))

    def _segments(self, lens, starts):
        """Device tensors of a batched prefill, from one host buffer in one copy (pinned and
        asynchronous on CUDA: the host does not wait): int64 positions ``[T]``, int64 index of each
        sequence's last token ``[B]``, int32 cu_seqlens ``[B + 1]``."""
        T, B = sum(lens), len(lens)
        buf = torch.empty(T + 2 * B + 1, dtype=torch.int64)
        pos = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens)])
        cu = torch.zeros(B + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        buf[:T], buf[T:T + B], buf[T + B:] = pos, cu[1:] - 1, cu
        if self.device.type == "cuda":
            dev = buf.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = buf.to(self.device)
        return dev[:T], dev[T:T + B], dev[T + B:].to(torch.int32)

    def _attend_segments(self, li, q, k, v, sink, bounds, starts, backend):
        """Attention of a batched prefill one sequence at a time, as :meth:`prefill` attends each
        (``backend`` ``"cudnn"`` / ``"sdpa"``); the history (one ``sink.history`` call) merged per
        sequence that has one. Written over q; returns it ``[T, Hq, D]``."""
        hist = sink.history(li, q) if any(starts) else None
        for (a, e), st in zip(bounds, starts):
            qs, ks, vs = q[None, a:e], k[None, a:e], v[None, a:e]
            if not st:
                causal_attention(qs, ks, vs, softmax_scale=self.scale, backend=backend, out=qs)
                continue
            o, lse = flash_attn_with_lse(qs, ks, vs, causal=True, softmax_scale=self.scale)
            merge_attention_states(o, lse, hist[0][None, a:e], hist[1][None, :, a:e], out=qs)
        return q

    # ------------------------------------------------------------------ decode
    def decode_step(self, token: torch.Tensor, pos, kv) -> torch.Tensor:
        """One decode step for one sequence, or for ``B`` sequences at once (batched decode).

        Args:
            token: int64 ``[B]`` on the model's device: the token of each sequence at its position
                (``B = 1``: one sequence).
            pos: the positions (tokens already in the KV store): for ``B = 1`` a Python int or an
                int64 ``[1]`` tensor on the model's device; for ``B > 1`` an int64 ``[B]`` tensor
                (row b at position ``pos[b]``). A tensor is never read on the host (CUDA-graph
                safe): the caller must have grown the RoPE tables past every position with
                :meth:`rope_tables` first, they are not grown here.
            kv: object with ``attend(layer, q [B, Hq, D], k_new [B, Hkv, D], v_new) -> out`` (``[B,
                Hq, D]``, or ``[Hq, D]`` for ``B = 1``) that appends each row's new K/V to its
                sequence and attends over all of it (:class:`xoffload.kv.protocols.DecodeStore`).
        Returns:
            fp32 logits ``[B, V]``.
        Raises:
            ValueError: a tensor ``pos`` without ``rope_tables`` called first, or ``B > 1`` with an
                int position or a position tensor of another length.
        """
        B = int(token.shape[0])
        if isinstance(pos, torch.Tensor):
            if self._cos is None:
                raise ValueError("decode_step with a tensor pos needs rope_tables(n) called first")
            if B > 1 and pos.numel() != B:
                raise ValueError(f"decode_step of {B} sequences needs one position per sequence, got pos of "
                                 f"shape {tuple(pos.shape)}")
            # the kernel reads the positions on the device: no host read (CUDA-graph safe)
        elif B > 1:
            raise ValueError(f"decode_step of {B} sequences needs an int64 [{B}] position tensor, got {pos!r}")
        else:
            self.rope_tables(pos + 1)
        h = self._embed(token)  # [B, hidden]
        layers = self.w.layers
        for li, lw in enumerate(layers):
            q, k, v = self._qkv(lw, h, pos)
            o = kv.attend(li, q, k, v)
            self._add_proj(h, o.reshape(B, -1).to(self.dtype), lw.wo)
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
