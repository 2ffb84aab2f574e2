"""PyTorch fp32 references for every kernel in :mod:`xoffload.kernels`.

(Over 450 lines on purpose: one fp32 reference per kernel, kept together so that every test
reads its ground truth from one module.)

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


def window_mask(sq: int, sk: int, window_size=(-1, -1), causal: bool = False, device=None) -> torch.Tensor:
    """Bool ``[sq, sk]``: flash-attn's local (sliding-window) mask, bottom-right aligned. Query i at
    position ``pos = i + sk - sq`` sees key j iff ``pos - left <= j <= pos + right``; -1 leaves that
    side unbounded; ``causal`` forces ``right = 0``."""
    left, right = window_size
    if causal:
        right = 0
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= pos + right
    if left >= 0:
        ok &= j >= pos - left
    return ok


def alibi_bias(slopes, sq: int, sk: int) -> torch.Tensor:
    """ALiBi bias fp32 ``[H, sq, sk]`` for slopes ``[H]``: ``-slope * |i + sk - sq - j|`` (flash-attn's
    formula; natural-log units, added to the scaled scores)."""
    pos = torch.arange(sq, device=slopes.device, dtype=torch.float32)[:, None] + (sk - sq)
    j = torch.arange(sk, device=slopes.device, dtype=torch.float32)[None, :]
    return -slopes.float()[:, None, None] * (pos - j).abs()[None]


def paged_kv_ref(cache, block_table_row, n: int) -> torch.Tensor:
    """The first ``n`` token rows ``[n, H, D]`` of one sequence in a paged cache
    ``[num_pages, page_size, H, D]``: token t is row ``t % page_size`` of page
    ``block_table_row[t // page_size]``."""
    page = cache.shape[1]
    t = torch.arange(n, device=cache.device)
    pages = block_table_row.to(cache.device).long()[t // page]
    return cache[pages, t % page]


def masked_attention_ref(q, k, v, allowed=None, softmax_scale=None, *, softcap=0.0, bias=None):
    """Attention of one batch item under an explicit boolean mask, in fp32.

    q: ``[Sq, Hq, D]``, k/v: ``[Sk, Hkv, D]``; ``allowed``: bool broadcastable to ``[Hq, Sq, Sk]``
    (None = all keys). Scores are ``s = softmax_scale * q.k``, then ``softcap * tanh(s / softcap)``
    when ``softcap > 0``, then ``+ bias`` (fp32 broadcastable to ``[Hq, Sq, Sk]``, e.g.
    :func:`alibi_bias`), then the mask. Returns (out ``[Sq, Hq, D]`` fp32, lse ``[Hq, Sq]`` fp32);
    rows with no allowed key give out 0 and lse -inf.
    """
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    scale = _scale(d, softmax_scale)
    qf = q.float().permute(1, 0, 2)  # [Hq, Sq, D]
    kf = k.float().permute(1, 0, 2).repeat_interleave(group, dim=0)  # [Hq, Sk, D]
    vf = v.float().permute(1, 0, 2).repeat_interleave(group, dim=0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.device).float()
    if allowed is not None:
        s = s.masked_fill(~allowed.to(s.device).expand(hq, sq, sk), NEG_INF)
    lse = torch.logsumexp(s, dim=-1) if sk > 0 else torch.full((hq, sq), NEG_INF, device=q.device)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows with lse = -inf
    out = torch.matmul(p, vf) if sk > 0 else torch.zeros(hq, sq, dv, device=q.device)
    return out.permute(1, 0, 2).contiguous(), lse


def _one_sequence_ref(q, k, v, *, causal, softmax_scale, window_size, softcap, slopes):
    """Attention of one sequence (q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]``) with every option."""
    sq, sk = q.shape[0], k.shape[0]
    allowed = None
    if causal or tuple(window_size) != (-1, -1):
        allowed = window_mask(sq, sk, window_size, causal, q.device)
    bias = alibi_bias(slopes, sq, sk) if slopes is not None else None
    return masked_attention_ref(q, k, v, allowed, softmax_scale, softcap=softcap, bias=bias)


def _keys_of(k, v, b, n, block_table, start=0):
    if block_table is not None:
        return paged_kv_ref(k, block_table[b], n), paged_kv_ref(v, block_table[b], n)
    return k[start:start + n], v[start:start + n]


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, block_table=None, seqused_k=None):
    """Reference for :func:`flash_attn_with_lse`, every option included.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, or with ``block_table`` (int ``[B, P]``) paged
    caches ``[num_pages, page_size, Hkv, D]`` holding ``P * page_size`` keys per sequence;
    ``seqused_k`` (int ``[B]``): sequence b uses its first ``seqused_k[b]`` keys. Window, softcap and
    ALiBi (``alibi_slopes`` fp32 ``[Hq]`` or ``[B, Hq]``) as in :func:`masked_attention_ref`,
    :func:`window_mask`, :func:`alibi_bias`, positions aligned bottom-right to each sequence's key
    length. Returns (out ``[B, Sq, Hq, D]`` fp32, lse ``[B, Hq, Sq]`` fp32).
    """
    b, sq, hq = q.shape[:3]
    sk = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[1]
    lens = seqused_k.tolist() if seqused_k is not None else [sk] * b
    outs, lses = [], []
    for i in range(b):
        ki, vi = _keys_of(k if block_table is not None else k[i], v if block_table is not None else v[i],
                          i, lens[i], block_table)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l = _one_sequence_ref(q[i], ki, vi, causal=causal, softmax_scale=softmax_scale,
                                 window_size=window_size, softcap=softcap, slopes=slopes)
        outs.append(o)
        lses.append(l)
    if b == 0:
        return (torch.zeros(q.shape[:3] + (v.shape[-1],), device=q.device),
                torch.zeros(0, q.shape[2], sq, device=q.device))
    return torch.stack(outs), torch.stack(lses)


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, block_table=None, seqused_k=None):
    """Reference for :func:`flash_attn_varlen_with_lse`, every option included.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]`` (or paged caches with ``block_table``, where
    cu_seqlens_k gives only the key lengths), int32 cu_seqlens of length B+1; options as in
    :func:`attention_ref`, per sequence. Returns (out ``[total_q, Hq, D]`` fp32, lse ``[Hq, total_q]`` fp32).
    """
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, device=q.device)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        n = ke - ks if used is None else used[i]
        ki, vi = _keys_of(k, v, i, n, block_table, start=ks)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l = _one_sequence_ref(q[qs:qe], ki, vi, causal=causal, softmax_scale=softmax_scale,
                                 window_size=window_size, softcap=softcap, slopes=slopes)
        out[qs:qe] = o
        lse[:, qs:qe] = l
    return out, lse


def kvcache_visible_ref(sq: int, n: int, *, causal=False, window_size=(-1, -1), leftpad: int = 0,
                        device=None) -> torch.Tensor:
    """Bool ``[sq, n]`` visibility of the decode kernels (flash-attn's kvcache semantics): query row
    i sits at position ``n - sq + i`` (bottom-right aligned) and sees key j iff ``leftpad <= j < n``,
    ``j <= pos + right`` (right = 0 with causal) when right >= 0 and ``j >= pos - left`` when
    left >= 0 (-1: no limit on that side)."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    pos = n - sq + i
    ok = (j >= leftpad).expand(sq, n).clone()
    if right >= 0:
        ok &= j <= pos + right
    if left >= 0:
        ok &= j >= pos - left
    return ok


def alibi_bias_ref(slopes: torch.Tensor, sq: int, n: int) -> torch.Tensor:
    """fp32 ``[Hq, sq, n]``: ALiBi bias ``-slope[h] * |pos_i - j|`` with query row i at position
    ``n - sq + i`` (flash-attn's sign and position convention; slopes ``[Hq]``)."""
    i = torch.arange(sq, device=slopes.device)[:, None]
    j = torch.arange(n, device=slopes.device)[None, :]
    dist = (n - sq + i - j).abs().float()
    return -slopes.float()[:, None, None] * dist[None]


def scored_attention_ref(q, k, v, allowed=None, bias=None, softcap=0.0, softmax_scale=None):
    """Attention of one batch item with soft-capping and an additive bias, in fp32, in flash-attn's
    order: ``s = softmax_scale * q k^T``; ``s = softcap * tanh(s / softcap)`` when softcap > 0; then
    ``s + bias`` on the allowed keys (others -inf); softmax.

    q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]``; allowed bool broadcastable to ``[Hq, Sq, Sk]`` (None:
    all); bias fp32 broadcastable to ``[Hq, Sq, Sk]`` (None: 0). Returns (out ``[Sq, Hq, D]`` fp32,
    lse ``[Hq, Sq]`` fp32); rows with no allowed key give out 0 and lse -inf.
    """
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    scale = _scale(d, softmax_scale)
    if sk == 0 or sq == 0:
        return (torch.zeros(sq, hq, dv, device=q.device), torch.full((hq, sq), NEG_INF, device=q.device))
    qf = q.float().permute(1, 0, 2)
    kf = k.float().permute(1, 0, 2).repeat_interleave(group, dim=0)
    vf = v.float().permute(1, 0, 2).repeat_interleave(group, dim=0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Sq, Sk]
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.device)
    if allowed is not None:
        s = s.masked_fill(~allowed.to(s.device).expand(hq, sq, sk), NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.matmul(p, vf).permute(1, 0, 2).contiguous(), lse


def _options_set(causal, window_size, softcap, alibi_slopes, cache_leftpad):
    return bool(causal) or tuple(int(x) for x in window_size) != (-1, -1) or bool(softcap) \
        or alibi_slopes is not None or cache_leftpad is not None


def _kvcache_item_ref(q_i, k_i, v_i, n, lp, slopes, *, causal, window_size, softcap, softmax_scale):
    """One item of the decode references: q_i ``[Sq, Hq, D]`` over keys ``k_i/v_i[:n]``."""
    sq = q_i.shape[0]
    allowed = kvcache_visible_ref(sq, n, causal=causal, window_size=window_size, leftpad=lp, device=q_i.device)
    bias = alibi_bias_ref(slopes.to(q_i.device), sq, n) if slopes is not None else None
    return scored_attention_ref(q_i, k_i[:n], v_i[:n], allowed[None], bias, softcap, softmax_scale)


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, *, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, cache_leftpad=None,
                         cache_batch_idx=None):
    """Reference for :func:`decode_attn_with_lse`.

    q ``[B, Sq, Hq, D]``, caches ``[B_cache, S_max, Hkv, D]``, cache_seqlens int ``[B]``: item b
    attends to the first ``cache_seqlens[b]`` tokens of cache row ``cache_batch_idx[b]`` (default
    b), keys before ``cache_leftpad[b]`` excluded, with the visibility of
    :func:`kvcache_visible_ref` (query row i at position ``n - Sq + i``), soft-capping and ALiBi
    (``alibi_slopes`` fp32 ``[Hq]`` or ``[B, Hq]``) as :func:`scored_attention_ref`. Returns
    (out ``[B, Sq, Hq, D]`` fp32, lse ``[B, Hq, Sq]`` fp32).
    """
    lens = [int(x) for x in cache_seqlens.tolist()]
    rows = list(range(len(lens))) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    plain = not _options_set(causal, window_size, softcap, alibi_slopes, cache_leftpad)
    lps = [0] * len(lens) if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    outs, lses = [], []
    for i, (n, r) in enumerate(zip(lens, rows)):
        if plain and q.shape[1] == 1:
            o, l = masked_attention_ref(q[i], k_cache[r, :n], v_cache[r, :n], None, softmax_scale)
        else:
            sl = None
            if alibi_slopes is not None:
                sl = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
            o, l = _kvcache_item_ref(q[i], k_cache[r], v_cache[r], n, lps[i], sl, causal=causal,
                                     window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
        outs.append(o)
        lses.append(l)
    if not outs:
        return (torch.zeros(q.shape[:3] + (v_cache.shape[-1],), device=q.device),
                torch.zeros(0, q.shape[2], q.shape[1], device=q.device))
    return torch.stack(outs), torch.stack(lses)


def paged_rows_ref(page_table_row, n: int, page_size: int) -> torch.Tensor:
    """Row indices (int64 ``[n]``) of the first ``n`` tokens along one page list: token t lives at
    row ``page_table_row[t // page_size] + t % page_size``."""
    npages = -(-n // page_size)
    starts = page_table_row[:npages].to(torch.int64)
    rows = starts[:, None] + torch.arange(page_size, dtype=torch.int64, device=starts.device)[None, :]
    return rows.reshape(-1)[:n]


def paged_gather_ref(k_pages, v_pages, page_table, b: int, n: int, page_size: int):
    """The first ``n`` tokens of item b along its page list(s) as ``[n, Hkv, D]`` K and V (on the
    store's device). Row store ``[R, Hkv, D]``: entry = row of the page's first token; block store
    ``[num_blocks, page_size, Hkv, D]`` (flash-attn's paged layout): entry = block index."""
    hkv = k_pages.shape[-2]
    table = page_table.cpu()
    ks, vs = [], []
    for h in range(hkv):
        row = table[b, h if table.shape[1] > 1 else 0]
        if k_pages.dim() == 4:
            t = torch.arange(n)
            blk = row[:max(-(-n // page_size), 0)].to(torch.int64)[t // page_size].to(k_pages.device)
            off = (t % page_size).to(k_pages.device)
            ks.append(k_pages[blk, off, h])
            vs.append(v_pages[blk, off, h])
        else:
            rows = paged_rows_ref(row, n, page_size).to(k_pages.device)
            ks.append(k_pages[rows, h])
            vs.append(v_pages[rows, h])
    return torch.stack(ks, 1), torch.stack(vs, 1)


def paged_decode_attn_ref(q, k_pages, v_pages, page_table, seqlens, *, page_size, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, cache_leftpad=None):
    """Reference for :func:`paged_decode_attn_with_lse`: gather each (batch, KV head)'s token rows,
    then plain attention in fp32 (with the options of :func:`decode_attention_ref`).

    q ``[B, Sq, Hq, D]``; k/v_pages ``[R, Hkv, D]`` row stores or ``[num_blocks, page_size, Hkv, D]``
    block stores (any device; rows are gathered there and moved to q's device); page_table int
    ``[B, Hkv, P]`` or ``[B, 1, P]`` (shared by the KV heads): entry j = row of the first token (row
    store) or block index (block store) of the j-th page of (b, h); seqlens int ``[B]``.
    Returns (out ``[B, Sq, Hq, D]`` fp32, lse ``[B, Hq, Sq]`` fp32); a length of 0 gives out 0 and
    LSE -inf.
    """
    b, sq, hq, d = q.shape
    hkv = k_pages.shape[-2]
    g = hq // hkv
    scale = _scale(d, softmax_scale)
    out = torch.zeros(b, sq, hq, v_pages.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq), NEG_INF, dtype=torch.float32, device=q.device)
    lens = [int(x) for x in seqlens.tolist()]
    plain = sq == 1 and not _options_set(causal, window_size, softcap, alibi_slopes, cache_leftpad)
    lps = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    for i, n in enumerate(lens):
        if n <= 0:
            continue
        kf, vf = paged_gather_ref(k_pages, v_pages, page_table, i, n, page_size)
        kf, vf = kf.to(q.device), vf.to(q.device)
        if plain:
            for h in range(hkv):
                qf = q[i, 0, h * g:(h + 1) * g].float()  # [g, D]
                s = (qf @ kf[:, h].float().T) * scale
                l = torch.logsumexp(s, dim=-1)
                out[i, 0, h * g:(h + 1) * g] = torch.exp(s - l[:, None]) @ vf[:, h].float()
                lse[i, h * g:(h + 1) * g, 0] = l
            continue
        sl = None
        if alibi_slopes is not None:
            sl = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
        o, l = _kvcache_item_ref(q[i], kf, vf, n, lps[i], sl, causal=causal, window_size=window_size,
                                 softcap=softcap, softmax_scale=softmax_scale)
        out[i] = o
        lse[i] = l
    return out, lse


def quest_page_scores_ref(q, kmin, kmax):
    """fp32 ``[Hkv, n]``: ``max over the group's heads g of (q_g⁺ · kmax + q_g⁻ · kmin)`` for q
    ``[Hq, D]`` and page summaries ``[Hkv, n, D]`` (Quest's page bound, GQA group maximum)."""
    hkv, n, d = kmin.shape
    qg = q.float().view(hkv, q.shape[0] // hkv, d)
    s = torch.bmm(qg.clamp(min=0), kmax.float().transpose(1, 2)) + torch.bmm(qg.clamp(max=0), kmin.float().transpose(1, 2))
    return s.amax(1)


def channel_page_scores_ref(q, kmin, kmax, channels, klab, alpha=1.0, per_head=False):
    """fp32 ``[Hkv, n]`` (``per_head``: ``[Hkv, g, n]`` before the group maximum): the page score of
    :func:`xoffload.kernels.channel_score.channel_page_scores` — per query head ``g`` of KV head ``h``,
    ``max over the page's tokens t of sum_{c in C_h} q_gc k_tc`` (exact, over the stored channels
    ``C_h = channels[h]`` of ``klab [Hkv, n * P, r]``) plus, over the other channels, the midpoint
    ``q·(m + M)/2`` plus ``alpha`` times the radius ``|q|·(M - m)/2`` of the page's key range
    (``alpha = 1``: Quest's bound on those channels; the sum is then still an upper bound).
    Channel entries are clamped into ``[0, D)`` as the kernel does with ``check=False``."""
    hkv, n, d = kmin.shape
    g = q.shape[0] // hkv
    qg = q.float().view(hkv, g, d)
    lab = torch.zeros(hkv, d, dtype=torch.bool, device=q.device)
    if channels is not None and channels.shape[-1]:
        channels = channels.long().clamp(0, d - 1)
        lab.scatter_(1, channels, True)
    qr = qg.masked_fill(lab[:, None, :], 0.0)
    mid = (kmin.float() + kmax.float()) * 0.5
    rad = (kmax.float() - kmin.float()) * 0.5
    s = torch.bmm(qr, mid.transpose(1, 2)) + float(alpha) * torch.bmm(qr.abs(), rad.transpose(1, 2))
    if channels is not None and channels.shape[-1]:
        r = channels.shape[-1]
        qc = torch.gather(qg, 2, channels.long()[:, None, :].expand(hkv, g, r))  # [Hkv, g, r]
        ex = torch.bmm(qc, klab.float().transpose(1, 2))  # [Hkv, g, n * P]
        s = s + ex.view(hkv, g, n, -1).amax(-1)
    return s if per_head else s.amax(1)


def channel_page_scores_batched_ref(q, kmin, kmax, channels, klab, index, n_valid, alpha=1.0):
    """fp32 ``[R, Hkv, N]``: :func:`channel_page_scores_ref` of row r's query ``q[r]`` with its
    channels ``channels[r]`` over the summary pages ``index[r]`` of a shared pool (``kmin`` /
    ``kmax`` ``[Hkv, NP, D]``, ``klab`` ``[Hkv, NP * P, r]``: page p holds tokens ``p*P ..``);
    ``-inf`` for candidates ``j >= n_valid[r]`` (their index entries clamped into the pool)."""
    hkv, npg, d = kmin.shape
    R, n = index.shape
    P = klab.shape[1] // max(npg, 1)
    out = torch.full((R, hkv, n), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(R):
        idx = index[r].long().clamp(0, max(npg - 1, 0))
        tok = (idx[:, None] * P + torch.arange(P, device=q.device)[None, :]).flatten()
        s = channel_page_scores_ref(q[r], kmin[:, idx], kmax[:, idx], channels[r], klab[:, tok], alpha)
        nv = int(n_valid[r])
        out[r, :, :nv] = s[:, :nv]
    return out


def quest_page_scores_batched_ref(q, kmin, kmax, index, n_valid):
    """fp32 ``[R, Hkv, N]``: :func:`quest_page_scores_ref` of row r's query ``q[r]`` ``[Hq, D]``
    over the summary pages ``index[r]`` of a shared pool ``[Hkv, NP, D]``; ``-inf`` for candidates
    ``j >= n_valid[r]`` (their index entries are clamped into the pool, never trusted)."""
    hkv, npg, d = kmin.shape
    R, hq, _ = q.shape
    n = index.shape[1]
    idx = index.long().clamp(0, max(npg - 1, 0))
    qg = q.float().view(R, hkv, hq // hkv, d)
    km = kmin.float()[:, idx].permute(1, 0, 3, 2)  # [R, Hkv, D, N]
    kM = kmax.float()[:, idx].permute(1, 0, 3, 2)
    s = (torch.matmul(qg.clamp(min=0), kM) + torch.matmul(qg.clamp(max=0), km)).amax(2)
    valid = torch.arange(n, device=q.device)[None, :] < n_valid.long()[:, None]
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def merge_ref(outs, lses):
    """Reference for merging N partial attention states.

    outs ``[N, ..., D]`` (any float dtype), lses ``[N, ...]`` fp32 where ``...`` of lses equals the
    leading dims of outs. Returns (out fp32 ``[..., D]``, lse fp32 ``[...]``); all -inf -> (0, -inf);
    a NaN or +inf LSE gives NaN.
    """
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - lse.unsqueeze(0))
    # all sides empty (-inf - -inf = NaN) -> weight 0; a NaN or +inf LSE stays NaN (garbage in,
    # NaN out, never a silent 0)
    w = torch.where(torch.isneginf(lse).unsqueeze(0), torch.zeros((), dtype=w.dtype), w)
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


# ----------------------------------------------------------------------------------------------
# XAttention estimate and block selection references (owner: xattention helper)
# ----------------------------------------------------------------------------------------------

def xattn_strided_scores_ref(q, k, *, stride, q_start, k_offset=0, causal=True, softmax_scale=None):
    """Strided antidiagonal scores of one batch item (XAttention, Xu et al. 2025), fp32.

    q ``[Sq, Hq, D]`` (relative rows; row r sits at absolute position ``q_start + r``), k
    ``[Sk, Hkv, D]`` (key r at absolute position ``k_offset + r``; ``k_offset % stride == 0``).
    Strided query row i pairs query rows ``i*S + S-1-t`` with key rows ``j*S + t``, t = 0..S-1,
    and the score is ``softmax_scale / S * sum_t q[i*S+S-1-t] . k[j*S+t]`` over the valid terms:
    both rows exist and, with ``causal``, the key's absolute position is <= the query's.
    A cell with no valid term is not visible.

    Returns (scores ``[Hq, nr, nc]`` fp32 natural units, -inf where not visible;
    visible bool ``[Hq, nr, nc]``) with ``nr = ceil(Sq/S)``, ``nc = ceil(Sk/S)``.
    """
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    s_ = int(stride)
    scale = _scale(d, softmax_scale)
    nr, nc = -(-sq // s_), -(-sk // s_)
    qp = torch.zeros(nr * s_, hq, d, device=q.device)
    qp[:sq] = q.float()
    kp = torch.zeros(nc * s_, hkv, d, device=q.device)
    kp[:sk] = k.float()
    kp = kp.repeat_interleave(hq // hkv, dim=1)
    i = torch.arange(nr, device=q.device)[:, None]
    j = torch.arange(nc, device=q.device)[None, :]
    acc = torch.zeros(hq, nr, nc, device=q.device)
    vis = torch.zeros(nr, nc, dtype=torch.bool, device=q.device)
    for t in range(s_):
        qrow = i * s_ + (s_ - 1 - t)
        krow = j * s_ + t
        valid = (qrow < sq) & (krow < sk)
        if causal:
            valid = valid & (k_offset + krow <= q_start + qrow)
        qt = qp[s_ - 1 - t::s_].permute(1, 0, 2)  # [Hq, nr, D]
        kt = kp[t::s_].permute(1, 0, 2)  # [Hq, nc, D]
        acc += torch.matmul(qt, kt.transpose(1, 2)) * valid
        vis |= valid
    scores = (acc * (scale / s_)).masked_fill(~vis, NEG_INF)
    return scores, vis.expand(hq, nr, nc)


def xattn_estimate_ref(q, k, *, stride=8, block_size=128, q_start=None, causal=True, softmax_scale=None):
    """Reference for :func:`xattn_estimate` (one-shot, straight from the definition).

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``; ``q_start`` defaults to ``Sk - Sq``. Each strided
    query row is softmax-normalised over its visible cells (a row with none contributes 0); block
    score ``[I, J]`` sums the normalised cells of strided rows ``I*B/S .. (I+1)*B/S - 1`` and
    strided columns ``J*B/S .. (J+1)*B/S - 1``. Returns fp32 ``[B, Hq, ceil(Sq/B), ceil(Sk/B)]``.
    """
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    q_start = sk - sq if q_start is None else int(q_start)
    cb = block_size // stride
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    out = torch.zeros(b, hq, nqb, nkb, device=q.device)
    for x in range(b):
        s, _ = xattn_strided_scores_ref(q[x], k[x], stride=stride, q_start=q_start, causal=causal,
                                        softmax_scale=softmax_scale)
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # all -inf rows -> 0
        pp = torch.zeros(hq, nqb * cb, nkb * cb, device=q.device)
        pp[:, : p.shape[1], : p.shape[2]] = p
        out[x] = pp.view(hq, nqb, cb, nkb, cb).sum(dim=(2, 4))
    return out


def xattn_chunk_stats_ref(q, k, *, stride, block_size, q_start, k_offset=0, causal=True, softmax_scale=None):
    """Reference for :func:`xattn_chunk_stats`: (row_max, row_sum, block_lse) of one KV chunk.

    Shapes: row_max / row_sum fp32 ``[B, Hq, R]`` with ``R = ceil(Sq/B) * B/S``; block_lse fp32
    ``[B, Hq, R, ceil(Sk_chunk/B)]`` = log of the sum of exp(score) over a row's cells in one key
    block (-inf when none is visible). row_max is -inf and row_sum 0 for rows with no visible cell.
    """
    b, sq, hq, _ = q.shape
    skc = k.shape[1]
    cb = block_size // stride
    nqb, nkb = -(-sq // block_size), -(-skc // block_size)
    r = nqb * cb
    bl = torch.full((b, hq, r, nkb), NEG_INF, device=q.device)
    rmax = torch.full((b, hq, r), NEG_INF, device=q.device)
    rsum = torch.zeros(b, hq, r, device=q.device)
    for x in range(b):
        s, _ = xattn_strided_scores_ref(q[x], k[x], stride=stride, q_start=q_start, k_offset=k_offset,
                                        causal=causal, softmax_scale=softmax_scale)
        sp = torch.full((hq, r, nkb * cb), NEG_INF, device=q.device)
        sp[:, : s.shape[1], : s.shape[2]] = s
        bl[x] = torch.logsumexp(sp.view(hq, r, nkb, cb), dim=-1)
        if nkb:
            m = sp.amax(-1)
            safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            rmax[x] = m
            rsum[x] = torch.exp(sp - safe[..., None]).sum(-1)
    return rmax, rsum, bl


def xattn_block_scores_ref(block_lse, row_max, row_sum, *, rows_per_block):
    """Reference for :func:`xattn_block_scores`: ``sum_{rows of I} exp(block_lse - row_lse)``.

    block_lse ``[B, H, R, nkb]``, row_max/row_sum ``[B, H, R]`` (merged over all chunks); rows
    whose sum is 0 contribute nothing. Returns fp32 ``[B, H, R // rows_per_block, nkb]``.
    """
    b, h, r, nkb = block_lse.shape
    lse = row_max + torch.log(row_sum)
    p = torch.exp(block_lse - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0, posinf=0.0)
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    return p.view(b, h, r // rows_per_block, rows_per_block, nkb).sum(3)


def select_blocks_ref(scores, threshold, *, sq, sk, block_size, q_start=None, causal=True, keep_last=0):
    """Reference for :func:`select_blocks`, one row at a time (slow, for tests).

    scores ``[B, H, nqb, nkb]``; threshold float or per-head sequence/tensor of length H.
    Visible blocks (causal): block (I, J) holds a key some query row of I may see, judged on
    absolute positions (query row r at ``q_start + r``, default ``q_start = sk - sq``). Always kept
    (when visible): block 0 (sink), the blocks holding the absolute positions of the query block's
    first and last rows (diagonal), and the ``keep_last`` blocks ending at the last of those. Then
    the remaining visible blocks in descending score (ties: lower index first) until the kept
    score reaches ``threshold`` x the row's visible score; the block that crosses is kept.
    ``threshold >= 1`` keeps every visible block. Returns bool ``[B, H, nqb, nkb]``.
    """
    b, h, nqb, nkb = scores.shape
    q_start = sk - sq if q_start is None else int(q_start)
    if isinstance(threshold, (int, float)):
        taus = [float(threshold)] * h
    else:
        taus = [float(x) for x in torch.as_tensor(threshold).flatten().tolist()]
    out = torch.zeros(b, h, nqb, nkb, dtype=torch.bool)
    sc = scores.detach().float().cpu()
    for I in range(nqb):
        first = q_start + I * block_size
        last = q_start + min((I + 1) * block_size, sq) - 1
        vis = []
        for J in range(nkb):
            lo_key, hi_key = J * block_size, min((J + 1) * block_size, sk) - 1
            ok = lo_key <= hi_key
            if causal:
                ok = ok and lo_key <= last
            vis.append(ok)
        forced = set()
        if vis[0] if nkb else False:
            forced.add(0)
        if last >= 0:  # diagonal: the key blocks meeting positions [max(first, 0), last]
            lo_d, hi_d = max(first, 0) // block_size, min(last // block_size, nkb - 1)
            for J in range(lo_d, hi_d + 1):
                forced.add(J)
            for J in range(hi_d - keep_last + 1, hi_d + 1):
                forced.add(J)
        forced = {J for J in forced if 0 <= J < nkb and vis[J]}
        for x in range(b):
            for hh in range(h):
                row = sc[x, hh, I]
                total = sum(float(row[J]) for J in range(nkb) if vis[J])
                kept = set(forced)
                mass = sum(float(row[J]) for J in kept)
                cand = sorted((J for J in range(nkb) if vis[J] and J not in kept),
                              key=lambda J: (-float(row[J]), J))
                tau = taus[hh]
                for J in cand:
                    if tau < 1.0 and mass >= tau * total:
                        break
                    kept.add(J)
                    mass += float(row[J])
                for J in kept:
                    out[x, hh, I, J] = True
    return out


def topk_ids_ref(scores, k: int):
    """Reference of :func:`xoffload.kernels.topk.topk_ids`: int32 ``[R, k]``, per row the indices of
    the ``k`` largest scores in ascending order; scores compare by their order-preserving int32
    keys (so NaN is above every number and -0.0 below +0.0), ties at the k-th value go to the
    lowest indices (one stable descending sort)."""
    b = scores.float().contiguous().view(torch.int32)
    key = (b ^ ((b >> 31) & 0x7FFFFFFF)).long()
    key[scores.isnan()] = 2**31 - 1
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values.to(torch.int32)


def topk_ids_rows_ref(scores, k: int, k_rows):
    """Reference of :func:`xoffload.kernels.topk.topk_ids` with per-row counts, on the scores'
    device without host reads: ``(ids, mask)``, int32 ``[R, k]`` whose row r starts with the
    indices of its ``min(max(k_rows[r], 0), k)`` largest scores in ascending order (the same keys
    and tie rule as :func:`topk_ids_ref`: a stable descending sort's first entries), and the bool
    ``[R, k]`` mask of those entries."""
    b = scores.float().contiguous().view(torch.int32)
    key = (b ^ ((b >> 31) & 0x7FFFFFFF)).long()
    key = torch.where(scores.isnan(), torch.full_like(key, 2**31 - 1), key)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    mask = torch.arange(k, device=scores.device)[None, :] < k_rows.long().clamp(0, k)[:, None]
    ids = torch.where(mask, order, scores.shape[1]).sort(dim=1).values  # the row's k_r ids first, ascending
    return ids.to(torch.int32), mask


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) KV pages: quantization with per-(page, KV head) or per-(token, KV head) scales
# ----------------------------------------------------------------------------------------------
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
FP8_SCALE_MIN = 2.0 ** -126  # the smallest normal fp32: the floor of a scale (amax below 448 * it)


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales of e4m3 groups from their fp32 absolute maxima: ``amax / 448`` (correctly
    rounded), at least ``FP8_SCALE_MIN`` (a subnormal or zero quotient would make ``x / scale``
    overflow), and 1 for an all-zero group (its codes are all 0).

    The divisor is a tensor of amax's shape, not the Python number: on a CUDA tensor PyTorch
    computes ``t / number`` as ``t * (1 / number)`` (one rounding more; for 448, whose reciprocal is
    not a binary fraction, about half of all maxima then get a scale one ulp off the quotient),
    while an elementwise tensor division is IEEE-rounded on every device."""
    s = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp_min(FP8_SCALE_MIN)
    return torch.where(amax > 0, s, torch.ones_like(s))


def _fp8_scale_per_token(scale, shape, page_size: int, token: bool):
    """The scale of each token row of a K/V tensor ``shape`` (``[T, Hkv, D]`` row layout or
    ``[num_pages, page_size, Hkv, D]`` page layout) as a tensor broadcastable to ``shape``."""
    if token:
        return scale[..., None]
    if len(shape) == 4:
        return scale[:, None, :, None]
    rows = torch.arange(shape[0], device=scale.device) // page_size
    return scale[rows][..., None]


def quantize_kv_fp8_ref(x, *, page_size: int, granularity: str = "page"):
    """Reference of :func:`xoffload.kernels.fp8.quantize_kv_fp8`: ``(q, scale)``.

    x ``[T, Hkv, D]`` (pages of ``page_size`` consecutive rows, the last one possibly partial) or
    ``[num_pages, page_size, Hkv, D]``. ``granularity="page"``: one scale per (page, KV head),
    ``[ceil(T / page_size), Hkv]`` / ``[num_pages, Hkv]``; ``"token"``: one per (token, KV head),
    ``x.shape[:-1]``. scale = :func:`fp8_scale_from_amax` of the group's ``max |x|`` (fp32);
    q = ``x / scale`` in fp32, clamped to ``[-448, 448]`` (saturation, never inf/NaN for finite
    x), rounded to the nearest e4m3 value (ties to even) as ``torch.float8_e4m3fn``."""
    xf = x.float()
    if granularity == "token":
        amax = xf.abs().amax(-1)
    elif x.dim() == 4:
        amax = xf.abs().amax(dim=(1, 3))
    else:
        t, h = x.shape[0], x.shape[1]
        n = -(-t // page_size)
        pad = torch.zeros(n * page_size - t, *x.shape[1:], dtype=torch.float32, device=x.device)
        amax = torch.cat([xf.abs(), pad]).view(n, page_size, h, -1).amax(dim=(1, 3))
    scale = fp8_scale_from_amax(amax)
    y = xf / _fp8_scale_per_token(scale, x.shape, page_size, granularity == "token")
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_kv_fp8_ref(q, scale, *, page_size: int, granularity: str = "page", dtype=torch.float32):
    """``q.float() * scale`` (the scales of :func:`quantize_kv_fp8_ref`, each applied to its
    group), cast to ``dtype``. The product is exact in fp32 (a 4-bit significand times a scale,
    unless it leaves fp32's normal range)."""
    s = _fp8_scale_per_token(scale.float(), q.shape, page_size, granularity == "token")
    return (q.float() * s).to(dtype)


def dequantize_cache_fp8_ref(cache, scale, scale_page_size: int = 1):
    """fp32 ``[B_cache, S_max, Hkv, D]`` of an e4m3 cache: position j of row b times
    ``scale[b, j // scale_page_size]`` (token scales ``[B_cache, S_max, Hkv]``: page size 1)."""
    s = scale.float().repeat_interleave(scale_page_size, dim=1)[:, :cache.shape[1]]
    return cache.float() * s[..., None]
