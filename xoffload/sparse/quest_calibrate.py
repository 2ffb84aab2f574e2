"""Measured choices for :class:`~xoffload.sparse.quest.QuestDecode` on a given model: how much
attention a layer's page selection loses against an oracle (:func:`selection_loss`) and which
layers to keep dense because of it (:func:`calibrate_dense_layers`; Quest itself keeps layers 0-1
dense from the sparsity it measured). Used by ``tools/calibrate_quest_layers.py``.
"""
from __future__ import annotations

import torch

from ..kernels.checks import check_int
from .quest import PageSummaries, QuestDecode, select_page_ids

__all__ = ["calibrate_dense_layers", "selection_loss"]


def selection_loss(q: torch.Tensor, k: torch.Tensor, policy: QuestDecode, prompt_len: int,
                   scale: float | None = None) -> tuple:
    """How much attention one layer's Quest selection drops, and how much an oracle would drop.

    For decode step ``s`` (query ``q[s]`` at position ``prompt_len + s``, keys ``k[:prompt_len + s
    + 1]``) the exact softmax of every query head is split over the plan's candidate pages
    (``policy.plan(prompt_len)``); the *lost* mass of a head is the share of its softmax on
    candidate pages the selection leaves out (sink, tail and generated tokens are always read).
    Per step the worst query head counts (the answer's retrieval head is one head); the result is
    the mean over the steps, for the policy's selection (:func:`page_scores` with
    its group score, bound scale and exact channels, top ``pages_per_step`` per KV head) and for the oracle (per KV head the
    pages with the most of the group's exact mass). Their difference is what a better page score
    could win back in this layer; :func:`calibrate_dense_layers` ranks layers by it.

    Args:
        q: ``[S, Hq, D]`` the layer's post-RoPE decode queries of ``S >= 1`` steps (any float dtype).
        k: ``[>= prompt_len + S, Hkv, D]`` the layer's post-RoPE keys (prompt, then generated).
        policy: the :class:`QuestDecode` whose plan and group score are measured.
        prompt_len: ``T`` prompt tokens.
        scale: softmax scale (default ``1/sqrt(D)``).
    Returns:
        ``(quest_lost, oracle_lost)``: Python floats in [0, 1]; both 0 when the plan reads every
        candidate (``plan.dense``) or has none.
    Raises:
        ValueError: shapes that do not fit (``q`` not 3-D, too few keys, Hq not a multiple of Hkv,
            head dims that differ).
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"selection_loss: q must be [S, Hq, D] and k [N, Hkv, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    S, hq, d = q.shape
    T = check_int("prompt_len", prompt_len, 1)
    n_keys, hkv, dk = k.shape
    if dk != d or hq % hkv:
        raise ValueError(f"selection_loss: q {tuple(q.shape)} and k {tuple(k.shape)} do not fit (head dim, GQA)")
    if n_keys < T + S:
        raise ValueError(f"selection_loss: k has {n_keys} keys, {S} steps after a {T}-token prompt need {T + S}")
    p = policy.plan(T)
    P, f, n, kk = p.page_size, p.first_page, p.num_candidates, p.pages_per_step
    if n == 0 or p.dense:
        return 0.0, 0.0
    g = hq // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    summ = PageSummaries(1, hkv, d, T // P, P, torch.float32, k.device, exact_channels=policy.exact_channels)
    summ.write(0, k[:T].float())  # as the stores: the prompt's whole pages (and its channels)
    lost, olost = 0.0, 0.0
    for s in range(S):
        qs = q[s].float()
        keys = k[:T + s + 1].float().repeat_interleave(g, 1)  # [N, Hq, D]
        prob = torch.softmax(torch.einsum("hd,nhd->hn", qs, keys) * scale, -1)
        cand = prob[:, f * P:(f + n) * P].reshape(hkv, g, n, P).sum(-1)  # [Hkv, g, n]
        sc = summ.scores(0, qs, f, n, policy, scale)
        for ids, acc in ((select_page_ids(sc, kk).long(), 0),
                         (select_page_ids(cand.sum(1), kk).long(), 1)):
            keep = torch.zeros(hkv, n, dtype=torch.bool, device=q.device).scatter_(1, ids, True)
            worst = float((cand * ~keep[:, None]).sum(-1).max())
            if acc == 0:
                lost += worst
            else:
                olost += worst
    return lost / S, olost / S


def calibrate_dense_layers(records, policy: QuestDecode, extra: int) -> tuple:
    """Quest's dense layers plus the ``extra`` sparse layers where its selection loses the most
    attention over an oracle's on calibration prompts (a measured choice for one model; Quest
    itself keeps layers 0-1 dense from the sparsity it measured).

    Args:
        records: iterable of dicts, one per calibration prompt: ``q`` ``[S, L, Hq, D]`` (the
            decode queries of every layer), ``k`` ``[L, >= T + S, Hkv, D]``, ``T`` (prompt tokens)
            and optionally ``scale``.
        policy: the :class:`QuestDecode` to calibrate (its budget, pages, group score and
            ``dense_layers``).
        extra: layers to add, ``>= 0``.
    Returns:
        ``(dense_layers, excess)``: the sorted tuple for ``QuestDecode(dense_layers=...)`` and
        ``{layer: mean over the records of quest_lost - oracle_lost}`` of every sparse layer
        (:func:`selection_loss`).
    Raises:
        ValueError: no records, a negative ``extra`` or one above the sparse layers, shapes that
            do not fit.
    """
    extra = check_int("extra", extra, 0)
    records = list(records)
    if not records:
        raise ValueError("calibrate_dense_layers: no calibration records")
    L = records[0]["q"].shape[1]
    sparse = policy.sparse_layers(L)
    if extra > len(sparse):
        raise ValueError(f"extra={extra} is more than the {len(sparse)} sparse layers")
    excess = {}
    for layer in sparse:
        tot = 0.0
        for r in records:
            a, b = selection_loss(r["q"][:, layer], r["k"][layer], policy, int(r["T"]), r.get("scale"))
            tot += a - b
        excess[layer] = tot / len(records)
    worst = sorted(sparse, key=lambda i: -excess[i])[:extra]
    dense = {i % L for i in policy.dense_layers} | set(worst)
    return tuple(sorted(dense)), excess
