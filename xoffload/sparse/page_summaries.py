"""Quest's page summaries and scores (Tang et al., 2024, "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference"): per page and KV head the elementwise min / max of K
(:class:`PageSummaries`), optionally the exact values of a few key channels
(:func:`choose_channels`), and the page scores a query gives them (:func:`page_scores`). The
decode policy that uses them: :mod:`.quest`."""
from __future__ import annotations

import torch

from ..kernels.checks import check_int
from ..kernels.channel_score import channel_page_scores, check_channels
from ..kernels.quest_score import check_summaries, quest_page_scores
from ..kernels.reference import channel_page_scores_ref

__all__ = ["GROUP_SCORES", "PageSummaries", "choose_channels", "page_scores"]

#: how :func:`page_scores` combines a KV head's query heads
GROUP_SCORES = ("max", "softmax")


def choose_channels(kp: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` key channels per KV head where a page's min/max bound is loosest: the largest
    mean key range ``M - m`` over the pages times the mean ``|k|`` (RoPE's low-frequency channels
    of the retrieval heads, whose wide, large-magnitude range makes every page's bound alike).

    Args:
        kp: ``[n_pages, P, Hkv, D]`` whole pages of one layer's (post-RoPE) keys, ``n_pages >= 1``.
        r: channels to keep, ``1 <= r <= D``.
    Returns:
        int32 ``[Hkv, r]`` distinct channel indices per KV head, on kp's device.
    Raises:
        ValueError: ``kp`` not 4-D or without a page, ``r`` outside ``[1, D]``.
    """
    if kp.dim() != 4 or kp.shape[0] == 0:
        raise ValueError(f"choose_channels: kp must be [n_pages >= 1, P, Hkv, D], got {tuple(kp.shape)}")
    d = kp.shape[-1]
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= d:
        raise ValueError(f"choose_channels: r must be an int in [1, head_dim={d}], got {r!r}")
    kf = kp.float()
    rng = (kf.amax(1) - kf.amin(1)).mean(0)  # [Hkv, D]
    w = rng * kf.abs().mean((0, 1))
    return w.topk(r, dim=-1).indices.to(torch.int32)


class PageSummaries:
    """Per-page elementwise min and max of K, per layer and KV head, kept on the KV's device, and
    optionally the values of ``exact_channels`` chosen key channels, token by token.

    Storage: ``kmin`` / ``kmax`` ``[L, Hkv, max_pages, D]`` in the K dtype (min and max are K
    elements, so no rounding: the bound is exact for the stored K). Bytes: ``2 / page_size`` of K's.
    With ``exact_channels = r > 0``: ``channels`` int32 ``[L, Hkv, r]`` (chosen by
    :func:`choose_channels` at a layer's first write, then fixed) and ``klab`` ``[L, Hkv,
    max_pages * page_size, r]`` (``r / D`` of K's bytes more).

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        max_pages: pages per layer (``ceil(max_tokens / page_size)``).
        page_size: tokens per page.
        dtype, device: of the K it summarises.
        exact_channels: ``r`` (0: min/max only); ``< head_dim`` and ``<= 64`` (the score kernel's
            limit, as :class:`QuestDecode`'s).
    Raises:
        TypeError / ValueError: ``exact_channels`` not an int in ``[0, min(head_dim, 65))``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_pages: int, page_size: int,
                 dtype, device, exact_channels: int = 0):
        shape = (num_layers, num_kv_heads, max_pages, head_dim)
        self.kmin = torch.empty(shape, dtype=dtype, device=device)
        self.kmax = torch.empty(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.max_pages = max_pages
        r = check_int("exact_channels", exact_channels, 0)
        if r >= head_dim or r > 64:
            raise ValueError(f"exact_channels must be below head_dim={head_dim} and at most 64, got {exact_channels}")
        self.exact_channels = r
        self.channels = self.klab = None
        self._chosen = [False] * num_layers
        if r:
            self.channels = torch.zeros(num_layers, num_kv_heads, r, dtype=torch.int32, device=device)
            self.klab = torch.zeros(num_layers, num_kv_heads, max_pages * page_size, r, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        n = 2 * self.kmin.numel() * self.kmin.element_size()
        if self.klab is not None:
            n += self.klab.numel() * self.klab.element_size() + self.channels.numel() * 4
        return n

    def write(self, layer: int, k: torch.Tensor, first_page: int = 0) -> int:
        """Summarise the whole pages of ``k`` ``[T, Hkv, D]`` (tokens of pages ``first_page ..``;
        a partial last page is left out: it is never a candidate). Returns the pages written.
        With exact channels, the layer's first write with a whole page chooses them.
        Raises ValueError when they would pass ``max_pages``."""
        P = self.page_size
        n = k.shape[0] // P
        if first_page + n > self.max_pages:
            raise ValueError(f"PageSummaries.write: pages {first_page}..{first_page + n - 1} pass max_pages={self.max_pages}")
        if n:
            kp = k[: n * P].unflatten(0, (n, P))  # [n, P, Hkv, D]
            self.kmin[layer, :, first_page:first_page + n] = kp.amin(1).transpose(0, 1)
            self.kmax[layer, :, first_page:first_page + n] = kp.amax(1).transpose(0, 1)
            if self.klab is not None:
                if not self._chosen[layer]:
                    self.channels[layer] = choose_channels(kp, self.exact_channels)
                    self._chosen[layer] = True
                ch = self.channels[layer].long()  # [Hkv, r]
                kt = k[: n * P].transpose(0, 1)  # [Hkv, nP, D]
                self.klab[layer, :, first_page * P:(first_page + n) * P] = torch.gather(
                    kt, 2, ch[:, None, :].expand(-1, n * P, -1))
        return n

    def scores(self, layer: int, q: torch.Tensor, first: int, n: int, policy: "QuestDecode",
               scale: float | None = None) -> torch.Tensor:
        """fp32 ``[Hkv, n]``: :func:`page_scores` of query ``q`` ``[Hq, D]`` over pages ``first ..
        first + n - 1`` of ``layer``, with the policy's group score and bound scale, and the
        stored exact channels (when kept; no host read: :func:`choose_channels` made them distinct
        and in range, so the decode step needs no check and stays CUDA-graph safe)."""
        P = self.page_size
        ch = kl = None
        if self.klab is not None:
            ch, kl = self.channels[layer], self.klab[layer, :, first * P:(first + n) * P]
        return page_scores(q, self.kmin[layer, :, first:first + n], self.kmax[layer, :, first:first + n],
                           group=policy.group_score, scale=scale, channels=ch, klab=kl, alpha=policy.bound_scale,
                           check=False)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, *, group: str = "max",
                scale: float | None = None, channels: torch.Tensor | None = None, klab: torch.Tensor | None = None,
                alpha: float = 1.0, check: bool = True) -> torch.Tensor:
    """Quest's upper bound of ``q·k`` per page, combined over each KV head's query-head group.

    Args:
        q: ``[Hq, D]`` the step's (post-RoPE) query of one layer, any float dtype.
        kmin, kmax: ``[Hkv, n_pages, D]`` page minima / maxima of the same (post-RoPE) keys.
        group: how the group's query heads combine: ``"max"`` (default) — the largest bound, itself
            an upper bound for every head of the group; ``"softmax"`` — each head's bounds through a
            softmax over the pages (``scale`` times the bound), summed over the group, so a head
            whose bounds are all alike does not outvote one that singles a page out (the CPU
            diagnosis in ``tools/diag_quest.py`` found it at the oracle's recall on SmolLM2).
        scale: softmax scale for ``group="softmax"`` (default ``1/sqrt(D)``).
        channels, klab: optional exact channels ``[Hkv, r]`` and their values ``[Hkv, n_pages * P,
            r]`` (:class:`PageSummaries`); alpha: the range weight on the other channels (``[0,
            1]``). With either, each head's score is :func:`xoffload.kernels.channel_score.channel_page_scores`'
            (still an upper bound when ``alpha = 1``).
        check: check the channel values on the host (in ``[0, D)``, distinct per KV head; a
            device->host read): as :func:`xoffload.kernels.channel_score.channel_page_scores`;
            ``False`` in a decode step.
    Returns:
        fp32 ``[Hkv, n_pages]``. With ``"max"``: ``max over g of (q_g⁺ · M + q_g⁻ · m)``, which is
        >= ``q_g · k`` for every key k of the page and every query head g of the group.
    Raises:
        TypeError / ValueError: shapes that do not fit (Hq not a multiple of Hkv, head_dim
            mismatch), an unknown ``group``, exact-channel arguments or ``alpha`` that do not fit
            (:func:`xoffload.kernels.channel_score.check_channels`).
    """
    hq, hkv, n, d = check_summaries(q, kmin, kmax)
    if group not in GROUP_SCORES:
        raise ValueError(f"group must be one of {GROUP_SCORES}, got {group!r}")
    hybrid = channels is not None or klab is not None or alpha != 1.0
    if group == "max":  # one kernel (fp32 accumulation): xoffload.kernels.quest_score
        if hybrid:
            return channel_page_scores(q.to(kmin.dtype), kmin, kmax, channels, klab, alpha=alpha, check=check)
        return quest_page_scores(q.to(kmin.dtype), kmin, kmax)
    if hybrid:
        check_channels(channels, klab, alpha, hkv, n, d, kmin.dtype, check=check)
        s = channel_page_scores_ref(q, kmin, kmax, channels, klab, alpha, per_head=True)
        return torch.softmax(s * (d ** -0.5 if scale is None else float(scale)), dim=-1).sum(1)
    qg = q.to(kmin.dtype).view(hkv, hq // hkv, d)
    s = torch.bmm(qg.clamp(min=0), kmax.transpose(1, 2)).float()
    s += torch.bmm(qg.clamp(max=0), kmin.transpose(1, 2)).float()
    return torch.softmax(s * (d ** -0.5 if scale is None else float(scale)), dim=-1).sum(1)
