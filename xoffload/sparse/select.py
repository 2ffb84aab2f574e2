"""Block selection for XAttention (keep the fewest blocks holding a threshold of each row's mass)
and Quest's page choice (:func:`select_page_ids`, :func:`select_pages`: the top pages per KV head).

Given block scores ``[B, H, q_blocks, k_blocks]`` (:func:`xoffload.kernels.xattn_estimate`), for
every (batch item, head, query block) independently:

1. only *causally visible* blocks can be kept: key block ``J`` is visible to query block ``I`` iff
   it holds a key that some row of ``I`` may see (absolute positions; query row ``r`` sits at
   ``q_start + r``, default ``q_start = Sk - Sq``);
2. the sink block (``J = 0``) and the diagonal blocks (the key blocks meeting the absolute
   positions of the query block's rows: one block when ``q_start`` is a multiple of the block
   size, else two) are always kept, and optionally the ``keep_last`` blocks ending at the
   diagonal;
3. the other visible blocks are added in descending score (ties: lower index first) while the kept
   score is below ``threshold x`` the row's visible score; the block that crosses the threshold is
   kept (XAttention, Xu et al. 2025, threshold tau).

``threshold = 1`` keeps every visible block (dense); ``threshold = 0`` keeps sink and diagonal.
Everything runs as batched torch ops on the scores' device (sort + cumsum + scatter; no Python
loop over blocks or rows).
"""
from __future__ import annotations

import torch

from ..kernels.checks import is_int
from ..kernels.topk import topk_ids

__all__ = ["select_blocks", "kv_head_union", "causal_block_visibility", "forced_blocks", "mask_density",
           "thresholds", "select_page_ids", "select_pages"]


def _check_lengths(sq, sk, block_size, q_start):
    for name, v in (("sq", sq), ("sk", sk), ("block_size", block_size)):
        if not is_int(v):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if q_start is None:
        return sk - sq
    if not is_int(q_start):
        raise TypeError(f"q_start must be an int, got {type(q_start).__name__}")
    return q_start


def causal_block_visibility(sq, sk, block_size, *, q_start=None, causal=True, device=None):
    """Bool ``[ceil(sq/bs), ceil(sk/bs)]``: key block J holds a key that a row of query block I may see.

    Query row r is at absolute position ``q_start + r`` (default ``sk - sq``); key block J holds keys
    ``J*bs .. min(J*bs+bs, sk)-1``. Non-causal: every block is visible.
    """
    q_start = _check_lengths(sq, sk, block_size, q_start)
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    if not causal:
        return torch.ones(nqb, nkb, dtype=torch.bool, device=device)
    I = torch.arange(nqb, device=device)
    last = q_start + torch.clamp((I + 1) * block_size, max=sq) - 1  # last row's position
    J = torch.arange(nkb, device=device)
    return (J[None, :] * block_size) <= last[:, None]


def forced_blocks(sq, sk, block_size, *, q_start=None, causal=True, keep_last=0, device=None):
    """Bool ``[nqb, nkb]`` of the blocks always kept: sink, diagonal, ``keep_last`` recent blocks.

    The diagonal of query block I is the key blocks meeting the positions
    ``[max(first, 0), last]`` of its rows (clipped to the key blocks that exist); ``keep_last = k``
    adds the k blocks ending at the last diagonal block. Only visible blocks are returned.
    """
    q_start = _check_lengths(sq, sk, block_size, q_start)
    if not is_int(keep_last) or keep_last < 0:
        raise ValueError(f"keep_last must be an int >= 0, got {keep_last!r}")
    nqb, nkb = -(-sq // block_size), -(-sk // block_size)
    vis = causal_block_visibility(sq, sk, block_size, q_start=q_start, causal=causal, device=device)
    I = torch.arange(nqb, device=device)
    J = torch.arange(nkb, device=device)[None, :]
    first = q_start + I * block_size
    last = q_start + torch.clamp((I + 1) * block_size, max=sq) - 1
    lo = (torch.clamp(first, min=0) // block_size)[:, None]
    hi = torch.clamp(last // block_size, max=nkb - 1)[:, None]
    has = (last >= 0)[:, None]
    diag = has & (J >= lo) & (J <= hi)
    recent = has & (J > hi - keep_last) & (J <= hi)
    sink = (J == 0)
    return (diag | recent | sink) & vis


def thresholds(threshold, h, device):
    """Threshold as an fp32 tensor broadcastable to ``[B, H, nqb, 1]``; validates [0, 1]."""
    if isinstance(threshold, bool):
        raise TypeError("threshold must be a float or a per-head tensor, got bool")
    if isinstance(threshold, (int, float)):
        t = float(threshold)
        if not (0.0 <= t <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        return torch.full((1, 1, 1, 1), t, dtype=torch.float32, device=device)
    t = torch.as_tensor(threshold)
    if t.dtype == torch.bool or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"threshold tensor must be floating point, got {t.dtype}")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1 or t.numel() not in (1, h):
        raise ValueError(f"threshold must be a float or a 1-D tensor of {h} per-head values, got shape {tuple(t.shape)}")
    t = t.to(device=device, dtype=torch.float32)
    # validation reads the values (a GPU sync; thresholds are set once per call)
    if bool(((t < 0) | (t > 1) | torch.isnan(t)).any()):
        raise ValueError(f"threshold values must be in [0, 1], got {t.tolist()[:16]}")
    return t.view(1, -1, 1, 1)


def select_blocks(block_scores, threshold=0.9, *, sq, sk, block_size=128, q_start=None, causal=True,
                  keep_last=0):
    """Pick the key blocks each query block attends to (see the module docstring).

    Args:
        block_scores: fp32 (or fp16/bf16) ``[B, H, ceil(sq/block_size), ceil(sk/block_size)]``,
            non-negative.
        threshold: tau in [0, 1]: a float, or a tensor of ``H`` per-head values.
        sq, sk: query and key lengths (tokens) the scores were computed for.
        block_size: tokens per block.
        q_start: absolute position of the first query row; default ``sk - sq`` (bottom-right).
        causal: restrict to causally visible blocks (non-causal: all blocks visible).
        keep_last: also keep the ``keep_last`` key blocks ending at the diagonal (recent window).

    Returns:
        bool ``[B, H, nqb, nkb]`` on the scores' device. Every visible row keeps its sink and
        diagonal; ``threshold >= 1`` keeps all visible blocks.

    Raises:
        TypeError: non-tensor scores, bad threshold type, non-int lengths.
        ValueError: scores not 4-D or not shaped for (sq, sk, block_size); threshold outside
            [0, 1] or of the wrong length; negative keep_last.
    """
    if not isinstance(block_scores, torch.Tensor):
        raise TypeError(f"block_scores must be a torch.Tensor, got {type(block_scores).__name__}")
    if not block_scores.is_floating_point():
        raise TypeError(f"block_scores must be floating point, got {block_scores.dtype}")
    if block_scores.dim() != 4:
        raise ValueError(f"block_scores must be [B, H, q_blocks, k_blocks], got shape {tuple(block_scores.shape)}")
    q_start = _check_lengths(sq, sk, block_size, q_start)
    b, h, nqb, nkb = block_scores.shape
    want = (-(-sq // block_size), -(-sk // block_size))
    if (nqb, nkb) != want:
        raise ValueError(
            f"block_scores {tuple(block_scores.shape)} does not match sq={sq}, sk={sk}, "
            f"block_size={block_size}: expected [B, H, {want[0]}, {want[1]}]"
        )
    dev = block_scores.device
    tau = thresholds(threshold, h, dev)
    vis = causal_block_visibility(sq, sk, block_size, q_start=q_start, causal=causal, device=dev)
    forced = forced_blocks(sq, sk, block_size, q_start=q_start, causal=causal, keep_last=keep_last,
                           device=dev)
    if block_scores.numel() == 0:
        return torch.zeros(block_scores.shape, dtype=torch.bool, device=dev)
    s = torch.clamp(block_scores.float(), min=0.0)
    s = torch.nan_to_num(s, nan=0.0, posinf=0.0)
    s_vis = s * vis
    total = s_vis.sum(-1, keepdim=True)
    forced_mass = (s * forced).sum(-1, keepdim=True)
    cand = vis & ~forced
    # candidates first in descending score; non-candidates get -1 and sort last
    key = torch.where(cand, s, torch.full_like(s, -1.0))
    vals, idx = torch.sort(key, dim=-1, descending=True, stable=True)
    is_cand = vals >= 0.0
    excl = torch.cumsum(torch.clamp(vals, min=0.0), dim=-1) - torch.clamp(vals, min=0.0)
    keep_sorted = is_cand & ((forced_mass + excl < tau * total) | (tau >= 1.0))
    mask = torch.zeros_like(keep_sorted)
    mask.scatter_(-1, idx, keep_sorted)
    return mask | forced


def kv_head_union(block_mask, num_kv_heads):
    """One mask per KV head: the union over the query heads that share it (GQA).

    Args:
        block_mask: bool ``[B, Hq, nqb, nkb]``.
        num_kv_heads: Hkv, dividing Hq; query head h belongs to KV head ``h // (Hq // Hkv)``.

    Returns:
        bool ``[B, Hkv, nqb, nkb]``.

    Raises:
        TypeError / ValueError: non-bool or non-4-D mask, Hkv not dividing Hq.
    """
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError("block_mask must be a bool torch.Tensor")
    if block_mask.dim() != 4:
        raise ValueError(f"block_mask must be [B, Hq, q_blocks, k_blocks], got shape {tuple(block_mask.shape)}")
    if not is_int(num_kv_heads) or num_kv_heads <= 0 or block_mask.shape[1] % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive int dividing Hq={block_mask.shape[1]}")
    b, hq, nqb, nkb = block_mask.shape
    return block_mask.view(b, num_kv_heads, hq // num_kv_heads, nqb, nkb).any(dim=2)


def mask_density(block_mask, sq, sk, block_size, *, q_start=None, causal=True):
    """Kept fraction of the visible blocks, per head: fp32 ``[H]`` (averaged over the batch).

    Blocks are counted, not tokens (partial edge blocks count as one). A head with no visible
    block reports 0.
    """
    vis = causal_block_visibility(sq, sk, block_size, q_start=q_start, causal=causal,
                                  device=block_mask.device)
    n_vis = vis.sum().clamp(min=1).float()
    kept = (block_mask & vis).sum(dim=(2, 3)).float()  # [B, H]
    return (kept / n_vis).mean(0)


# ------------------------------------------------------------------ Quest: pages
def select_page_ids(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
                    prefer: torch.Tensor | None = None, prefer_bonus: float = 0.0) -> torch.Tensor:
    """Indices ``[Hkv, k]`` (int32, distinct and ascending per row) of each KV head's ``k``
    best-scoring candidates of ``scores`` ``[Hkv, n_cand]`` (ties: the lowest indices); all of
    them when ``k == n_cand``. One Triton program per row
    (:func:`xoffload.kernels.topk.topk_ids`), CUDA-graph safe; ``out``: an optional int32
    ``[Hkv, k]`` destination; ``prefer`` / ``prefer_bonus``: entries with ``prefer >= 0`` (the
    page cache's ``slot_of``) compete with their score plus the bonus (:attr:`QuestDecode.reuse_bias`).
    Raises ValueError unless ``0 <= k <= n_cand``."""
    hkv, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] (candidate pages), got {k}")
    return topk_ids(scores, k, out=out, prefer=prefer, prefer_bonus=prefer_bonus)


def select_pages(scores: torch.Tensor, k: int, first_page: int, page_size: int, block_table: torch.Tensor | None,
                 block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pool row of the first token of each KV head's ``k`` best candidate pages.

    Args:
        scores: fp32 ``[Hkv, n_cand]`` (:func:`page_scores` of the candidate pages only).
        k: pages per KV head, ``0 <= k <= n_cand``.
        first_page: logical index of candidate 0.
        page_size, block_size: tokens per page / per pool block (``block_size % page_size == 0``).
        block_table: int32 ``[n_blocks]`` physical pool block of each logical block of the sequence
            (on the scores' device), or None when rows are logical token indices (a contiguous cache).
        out: optional int32 ``[1, Hkv, k]`` written in place (a CUDA graph's static buffer).
    Returns:
        int32 ``[1, Hkv, k]`` row indices (the page table of
        :func:`xoffload.kernels.paged_decode_attn_with_lse`), in no particular order.
    """
    hkv, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] (candidate pages), got {k}")
    if block_table is not None and block_size % page_size:
        raise ValueError(f"block_size {block_size} must be a multiple of page_size {page_size}")
    idx = select_page_ids(scores, k).long()
    tok = (idx + first_page) * page_size
    if block_table is None:
        rows = tok
    else:
        rows = block_table.long()[tok // block_size] * block_size + tok % block_size
    rows = rows.to(torch.int32)[None]
    if out is None:
        return rows
    out.copy_(rows)
    return out
