"""The prefill sink of a chunk that continues a stored history (a session's turn): the chunk's
K/V go where the session stores them, and ``history(layer, q)`` attends the chunk's queries to the
history — every block (dense history: staged layer by layer into two GPU buffers by the UVA gather
kernel on a copy stream, or read in place on the device) or the pages Quest's bound picks per KV
head (sparse history: :func:`history_page_ids`, only those pages copied). Used by
:class:`~xoffload.engine.session.Session`; see that module for the design.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..kernels import flash_attn_with_lse, gather_blocks, paged_decode_attn_with_lse, topk_ids
from ..kernels.channel_score import channel_page_scores_batched
from ..kernels.page_cache import page_cache_fill
from .kv_store import PrefillStaging

if TYPE_CHECKING:
    from .session import Session

__all__ = ["dense_layer_set", "ChunkSink", "history_page_ids"]

_Q_CHUNK = 64  # query tokens per block of the page-bound computation (bounds its memory)


def _to_device(values, dtype, device) -> torch.Tensor:
    """A host list as a device tensor without making the host wait for the stream (a pageable
    copy would): staged in pinned memory, copied asynchronously."""
    t = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def history_page_ids(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k: int, *,
                     recent_pages: int = 4, channels: torch.Tensor | None = None,
                     klab: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    """The history pages a chunk's sparse layer reads, per KV head (Quest's bound, Tang et al. 2024,
    or with exact key channels the score of :func:`~xoffload.kernels.channel_score.channel_page_scores`).

    Args:
        q: ``[T, Hq, D]`` the chunk's (post-RoPE) queries of one layer, any float dtype.
        kmin, kmax: ``[Hkv, n_pages, D]`` page minima / maxima of the history's K (whole pages).
        k: pages to read per KV head (clamped to ``[forced, n_pages]``).
        recent_pages: the last pages always read (with page 0, the sink).
        channels, klab: the summaries' exact key channels (int ``[Hkv, r]``) and the history's
            values in them (``[Hkv, n_pages * P, r]``, kmin's dtype), or None (both): a page is then
            scored per chunk token by the exact part on those channels plus ``q·mid +
            alpha·|q|·radius`` on the others (as sparse decode with ``exact_channels``), instead
            of Quest's bound.
        alpha: the radius weight with ``channels`` (the decode policy's ``bound_scale``).
    Returns:
        int32 ``[Hkv, k']`` distinct page ids per KV head (ascending), ``k' = min(n_pages, max(k,
        forced))``: the sink page, the ``recent_pages`` last pages, then the highest scores
        maximised over the chunk's tokens t and each KV head's query-head group (Quest's bound
        ``q_t⁺·max + q_t⁻·min``: an upper bound of every ``q·k`` of the page for every query of
        the chunk).
    Raises:
        ValueError: shapes that do not fit, ``k < 0``, ``channels`` without ``klab``.
    """
    if q.dim() != 3 or kmin.dim() != 3 or kmin.shape != kmax.shape or q.shape[-1] != kmin.shape[-1]:
        raise ValueError(f"q must be [T, Hq, D] and kmin/kmax [Hkv, n_pages, D] with the same D, got "
                         f"{tuple(q.shape)}, {tuple(kmin.shape)}, {tuple(kmax.shape)}")
    hkv, full, d = kmin.shape
    if q.shape[1] % hkv:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={hkv}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if (channels is None) != (klab is None):
        raise ValueError("channels and klab come together (both None: Quest's bound)")
    g = q.shape[1] // hkv
    forced = sorted({0, *range(max(1, full - recent_pages), full)}) if full else []
    k = min(full, max(k, len(forced)))
    if k >= full:
        return torch.arange(full, dtype=torch.int32, device=kmin.device).expand(hkv, full)
    best = torch.full((hkv, full), float("-inf"), dtype=torch.float32, device=kmin.device)
    if channels is not None:
        best = _channel_best(q, kmin, kmax, channels, klab, alpha, best)
    else:
        mx, mn = kmax.float(), kmin.float()
        for a in range(0, q.shape[0], _Q_CHUNK):
            qc = q[a:a + _Q_CHUNK].float().view(-1, hkv, g, d)  # [t, Hkv, g, D]
            b = torch.einsum("thgd,hpd->thgp", qc.clamp(min=0), mx) + torch.einsum("thgd,hpd->thgp", qc.clamp(max=0), mn)
            best = torch.maximum(best, b.amax(dim=(0, 2)))
    best[:, forced] = float("inf")
    return topk_ids(best, k)


def _channel_best(q, kmin, kmax, channels, klab, alpha, best):
    """``best`` maxed with each chunk token's exact-channel page scores (one batched launch per
    :data:`_Q_CHUNK` tokens: the rows of :func:`channel_page_scores_batched` are the tokens, all
    over the same pages)."""
    hkv, full, _ = kmin.shape
    rows = min(_Q_CHUNK, q.shape[0])
    dev = kmin.device
    index = torch.arange(full, dtype=torch.int32, device=dev).expand(rows, full).contiguous()
    n_valid = torch.full((rows,), full, dtype=torch.int32, device=dev)
    ch = channels.expand(rows, *channels.shape).contiguous()
    for a in range(0, q.shape[0], _Q_CHUNK):
        qc = q[a:a + _Q_CHUNK].to(kmin.dtype).contiguous()
        t = qc.shape[0]
        sc = channel_page_scores_batched(qc, kmin, kmax, ch[:t], klab, index[:t], n_valid[:t], alpha=alpha)
        best = torch.maximum(best, sc.amax(0))
    return best


class ChunkSink:
    """The model's prefill sink for one turn's chunk of ``T`` tokens at positions ``n .. n+T-1``
    of session ``sess`` (whose stored history holds tokens ``0 .. n-1``): ``buffers`` / ``done``
    as any sink (resident: views of the session's device rows; offload: two staging buffers whose
    layers go to the pool), plus ``history(layer, q)``. ``dense=True`` reads the whole history in
    every layer whatever the session's budget. ``h2d_bytes`` counts what it copied from the pool;
    ``events`` are the chunk's pool writes."""

    def __init__(self, sess: "Session", n: int, T: int, dense: bool = False):
        self.s, self.n, self.T = sess, n, T
        self.h2d_bytes = 0
        self.events = []
        self._to_release = None
        self._sel = None  # sparse history: (lengths, gathered rows, their page table), made once
        s = sess
        self._stage = PrefillStaging(s.cfg.num_kv_heads, s.cfg.head_dim, s.dtype, s.device)
        self.sparse_layers = frozenset() if dense else s._history_sparse_layers(n)
        self.dense_layers = [l for l in range(s.cfg.num_layers) if l not in self.sparse_layers]
        self._staging = s.offload is not None and n > 0 and bool(self.dense_layers)
        if self._staging:
            self._open_staging()

    # -- prefill sink
    def buffers(self, layer, T):
        s = self.s
        if s.offload is None:
            return s._rows[0][layer, self.n:self.n + T], s._rows[1][layer, self.n:self.n + T]
        return self._stage.buffers(s.offload, layer, T)

    def done(self, layer, k, v):
        s = self.s
        self._release(layer)  # the history attention that read its staging buffer is enqueued
        s._summarize(layer, self.n, k)
        if s.offload is not None:
            ev = s.offload.offload_layer(s.seq, layer, k, v)
            self._stage.copied(layer, ev)
            s._write_ev[layer] = ev
            self.events.append(ev)
            if layer == s.cfg.num_layers - 1:
                self._stage.clear()

    # -- history attention
    def history(self, layer, q):
        """Attention of the chunk's queries ``q [T, Hq, D]`` over the history of ``layer``:
        ``(o [1, T, Hq, D], lse fp32 [1, Hq, T])``."""
        if layer in self.sparse_layers:
            return self._sparse(layer, q)
        s, n = self.s, self.n
        if s.offload is None:
            k, v = s._rows[0][layer, :n], s._rows[1][layer, :n]
        else:
            k, v = self._staged(layer)
        return flash_attn_with_lse(q[None], k[None], v[None], causal=False, softmax_scale=s.scale)

    def _open_staging(self):
        """Two GPU buffers of whole pool blocks; dense-history layer ``dense_layers[i]`` is copied
        into buffer ``i % 2`` (one gather kernel over UVA, on a copy stream) while the layer before
        it computes."""
        s = self.s
        eng = s.offload
        B = eng.block_size
        nb = -(-self.n // B)
        cfg = s.cfg
        self._sbuf = [(torch.empty(nb, B, cfg.num_kv_heads, cfg.head_dim, dtype=s.dtype, device=s.device),
                       torch.empty(nb, B, cfg.num_kv_heads, cfg.head_dim, dtype=s.dtype, device=s.device))
                      for _ in range(min(2, len(self.dense_layers)))]
        self._bt = _to_device(eng.block_table(s.seq)[:nb], torch.int32, s.device)
        self._cs = torch.cuda.Stream(s.device) if s.cuda else None
        self._copied, self._freed = {}, [None, None]
        if self._cs is not None:
            self._cs.wait_stream(torch.cuda.current_stream(s.device))
        for i in range(min(2, len(self.dense_layers))):
            self._stage_layer(i)

    def _stage_layer(self, i):
        s, layer = self.s, self.dense_layers[i]
        kb, vb = self._sbuf[i & 1]
        cs = self._cs
        ctx = torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext()
        with ctx:
            if cs is not None:
                if s._write_ev[layer] is not None:
                    cs.wait_event(s._write_ev[layer])
                if self._freed[i & 1] is not None:
                    cs.wait_event(self._freed[i & 1])
            pool = s.offload.pool
            gather_blocks(pool.k[layer], pool.v[layer], self._bt, kb, vb)
            if cs is not None:
                ev = torch.cuda.Event()
                ev.record(cs)
                self._copied[layer] = ev
        self.h2d_bytes += 2 * kb.numel() * kb.element_size()

    def _staged(self, layer):
        i = self.dense_layers.index(layer)
        s = self.s
        if self._cs is not None:
            cur = torch.cuda.current_stream(s.device)
            cur.wait_event(self._copied.pop(layer))
        kb, vb = self._sbuf[i & 1]
        k, v = kb.flatten(0, 1)[:self.n], vb.flatten(0, 1)[:self.n]
        if i + 2 < len(self.dense_layers):
            self._to_release = i  # refilled by :meth:`_release` once this layer's attention is enqueued
        return k, v

    def _release(self, layer):
        """Once layer ``layer``'s history attention is enqueued (the model calls ``done`` after
        it): its staging buffer is refilled with the dense-history layer two ahead."""
        i = self._to_release
        if i is None or self.dense_layers[i] != layer:
            return
        self._to_release = None
        if self._cs is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.s.device))
            self._freed[i & 1] = ev
        self._stage_layer(i + 2)

    def _sparse(self, layer, q):
        """Quest-selected history pages of ``layer`` (see the module docstring)."""
        s, n = self.s, self.n
        P = s.page
        full = n // P
        r = n - full * P
        k_sel = min(full, s.history_budget // P - (1 if r else 0))
        hkv = s.cfg.num_kv_heads
        summ = s._summ
        ch = kl = None
        if summ.klab is not None:  # the decode policy's exact key channels score the history too
            ch, kl = summ.channels[layer], summ.klab[layer, :, :full * P]
        ids = history_page_ids(q, summ.kmin[layer, :, :full], summ.kmax[layer, :, :full], k_sel,
                               recent_pages=s.recent_pages, channels=ch, klab=kl,
                               alpha=s.policy.bound_scale if ch is not None else 1.0)
        k_sel = ids.shape[1]
        tok = ids.long() * P  # first token of each chosen page, [Hkv, k]
        if r:
            tok = torch.cat([tok, torch.full((hkv, 1), full * P, dtype=tok.dtype, device=s.device)], 1)
        m = tok.shape[1]
        if self._sel is None:  # the same page count in every sparse layer: one set of buffers per turn
            lens = torch.full((1,), k_sel * P + r, dtype=torch.int32, device=s.device)
            rows = table = None
            if s.offload is not None:
                rows = (torch.empty(m * P, hkv, s.cfg.head_dim, dtype=s.dtype, device=s.device),
                        torch.empty(m * P, hkv, s.cfg.head_dim, dtype=s.dtype, device=s.device))
                table = torch.arange(0, m * P, P, dtype=torch.int32, device=s.device).expand(hkv, m).contiguous()
            self._sel = (lens, rows, table)
        lens, rows, table = self._sel
        if s.offload is None:
            table = tok.to(torch.int32)[None]
            kr, vr = s._rows[0][layer], s._rows[1][layer]
        else:
            eng = s.offload
            B = eng.block_size
            bt = _to_device(eng.block_table(s.seq), torch.int64, s.device)
            src = (bt[tok // B] * B + tok % B).to(torch.int32)
            kr, vr = rows
            if s.cuda and s._write_ev[layer] is not None:
                torch.cuda.current_stream(s.device).wait_event(s._write_ev[layer])
            page_cache_fill(eng.pool.k_rows(layer), eng.pool.v_rows(layer), kr, vr, src, table, page_size=P)
            table = table[None]
            self.h2d_bytes += 2 * kr.numel() * kr.element_size()
        return paged_decode_attn_with_lse(q[None], kr, vr, table, lens, page_size=P, causal=False,
                                          softmax_scale=s.scale, check=False)


def dense_layer_set(dense_layers, policy, L: int) -> tuple:
    """A session's layers that always read the whole history: ``dense_layers`` None (the decode
    policy's dense layers, else 0 and 1), an int N (the first N) or layer indices. Raises
    ValueError for anything else or an index outside ``[0, L)``."""
    if dense_layers is None:
        sparse = set(policy.sparse_layers(L)) if policy is not None else set(range(2, L))
        dense_layers = tuple(l for l in range(L) if l not in sparse)
    elif isinstance(dense_layers, int) and not isinstance(dense_layers, bool):
        if not 0 <= dense_layers <= L:
            raise ValueError(f"dense_layers must be an int in [0, {L}] or layer indices, got {dense_layers!r}")
        dense_layers = tuple(range(dense_layers))
    else:
        try:
            ids = tuple(dense_layers)
        except TypeError:
            raise ValueError(f"dense_layers must be an int or layer indices, got {dense_layers!r}") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < L for x in ids):
            raise ValueError(f"dense_layers must hold layer indices in [0, {L}), got {dense_layers!r}")
        dense_layers = tuple(sorted(set(ids)))
    return dense_layers
