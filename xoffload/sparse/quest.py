"""Quest page selection for decode (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference"), GQA-aware, for KV that lives in pinned CPU memory or on the GPU.

The prompt's K of each layer is cut into pages of ``page_size`` tokens. Per page and KV head we keep
the elementwise minimum ``m`` and maximum ``M`` of its keys (:class:`PageSummaries`, on the GPU).
For a query ``q`` every key ``k`` of the page satisfies ``q·k <= sum_i max(q_i m_i, q_i M_i)``, and
that bound splits into two matrix products: ``q⁺·M + q⁻·m`` with ``q⁺ = max(q, 0)``,
``q⁻ = min(q, 0)`` (:func:`page_scores`). A KV head serves a group of query heads (GQA); its page
score is the maximum of the group's bounds, still an upper bound for every query head of the group,
so one selection per KV head serves the whole group and one fetch per KV head suffices.

A decode step of a sparse layer then attends to: the sink (the first pages), the recent tokens
(the prompt's tail and every generated token), both resident on the GPU, and the ``k`` best-scoring
pages of the candidate region between them (:func:`select_pages`), read where the pool lives. The
selection is a device tensor of pool row indices (no host round trip, CUDA-graph safe).

:class:`QuestDecode` is the decode policy object (``LLM(..., sparse_decode=QuestDecode(...))``);
:meth:`QuestDecode.plan` fixes, per request, which tokens are resident and how many pages each
step reads, so every step of a request has the same shapes.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass


from ..kernels.checks import check_int, fits_fp32
from ..kernels.page_cache import MAX_SLOTS
from .page_summaries import GROUP_SCORES, PageSummaries, choose_channels, page_scores  # noqa: F401  (re-exported)
from .policy import DecodePolicy
from .select import select_page_ids, select_pages  # noqa: F401  (re-exported: the page choice)

__all__ = ["DEFAULT_REUSE_BIAS", "DecodePlan", "GROUP_SCORES", "PageSummaries", "QuestDecode", "choose_channels", "page_scores",
           "select_page_ids", "select_pages"]

#: QuestDecode's reuse bias when none is given (group score "max"): a cached page gives way only to
#: a page whose score says eight times its attention weight (2 earlier; 8 now,
#: measured on the H200 for speed and on SmolLM2 for accuracy, see QuestDecode)
DEFAULT_REUSE_BIAS = 8.0


@dataclass(frozen=True)
class DecodePlan:
    """What one request's sparse decode reads, fixed at the end of its prefill.

    Attributes:
        prompt_len: prompt tokens ``T`` (all in the pool).
        page_size: tokens per page ``P``.
        sink_len: resident head of the prompt, tokens ``[0, sink_len)`` (a multiple of ``P`` or T).
        tail_start: resident tail of the prompt, tokens ``[tail_start, T)``.
        first_page, num_candidates: candidate pages ``first_page .. first_page + num_candidates - 1``
            (tokens ``[sink_len, tail_start)``, whole pages).
        pages_per_step: pages read per KV head and step (``k``), ``<= num_candidates``.
    """

    prompt_len: int
    page_size: int
    sink_len: int
    tail_start: int
    first_page: int
    num_candidates: int
    pages_per_step: int

    @property
    def resident_prompt_tokens(self) -> int:
        """Prompt tokens kept on the GPU (sink + tail)."""
        return self.sink_len + self.prompt_len - self.tail_start

    @property
    def dense(self) -> bool:
        """True when every candidate page is read each step (the selection changes nothing)."""
        return self.pages_per_step == self.num_candidates


@dataclass(frozen=True)
class QuestDecode(DecodePolicy):
    """Quest decode policy: per KV head, the top pages by their min/max bound, up to a token budget.

    Args:
        token_budget: tokens one sparse layer attends to per step and KV head, counting the sink,
            the prompt's resident tail and the selected pages (generated tokens are attended on
            top: they are resident). ``None``: every page (dense decode through the same path).
        page_size: tokens per page (power of two >= 16; must divide the pool's block size).
        sink_tokens: leading prompt tokens always attended (rounded up to whole pages).
        recent_tokens: trailing prompt tokens always attended (resident; the tail is extended
            down to a page boundary).
        dense_layers: layers that read all their KV every step (kept resident on the GPU by the
            offload store); default ``(0, 1)`` as in Quest, whose first two layers show < 10%
            sparsity. ``()`` makes every layer sparse. Indices may be negative (from the end) and
            need not be contiguous; :func:`~xoffload.sparse.quest_calibrate.calibrate_dense_layers` adds the layers where the
            min/max bound loses the most attention on calibration prompts (SmolLM2: ``(0, 1, 8,
            15, 18, 19)``: its bound misses the needle in retrieval layers 18-19 even at budget 1024 of 4K; see
            ``tools/calibrate_quest_layers.py``). Checked against the model's layers when the
            store is built (ValueError naming the layers outside it); a non-int entry is a TypeError.
        group_score: how a KV head's query heads combine their page bounds (:func:`page_scores`):
            ``"max"`` (default, measured on the H200) or ``"softmax"`` (per-head softmax over pages,
            summed; better on one SmolLM2 prompt on the CPU, not yet measured on a GPU).
        cache_pages: offload only — GPU cache slots per KV head and sparse layer for pages fetched
            from the pool (ShadowKV's reuse of the pages chosen by consecutive steps;
            :mod:`xoffload.kernels.page_cache`): a step copies only the pages it misses. ``None``
            (default): as many slots as ``cache_bytes`` holds, and at least four times the pages a
            step reads; ``0``: no cache, pages are read in place over PCIe every step. Capped at
            the candidate pages (a cache that holds them all fetches each page once) and at
            :data:`~xoffload.kernels.page_cache.MAX_SLOTS` (no cache when a step reads more pages
            than that).
        cache_bytes: with ``cache_pages=None``, the GPU bytes (K and V, all sparse layers) the page
            cache is sized to, unless four times a step's pages need more (that floor wins):
            default 2 GiB (the 8B shape: 546 slots of 32 tokens per KV head and
            layer, 13% of a 128K prompt's pages; 4x the pages a step reads would be 232). It is
            allocated at the first decode step, after prefill's buffers are freed, so it adds to
            the decode footprint, not to prefill's peak; it is not fitted to the free memory, so
            on a GPU with less than that free after prefill set it lower.
        exact_channels: ``r`` key channels per KV head and sparse layer whose values are kept on
            the GPU token by token (``r / D`` of K's bytes on top of the min/max summaries) and scored
            exactly (:func:`xoffload.kernels.channel_score.channel_page_scores`): the channels where
            the min/max bound is loosest, chosen from the prompt's keys (:func:`choose_channels`).
            0 (default): Quest's summaries alone. At most 64 and below ``head_dim``.
        bound_scale: ``alpha`` in ``[0, 1]``, the weight of the page's key range on the channels
            scored from the summary: page score = exact part + ``q·mid + alpha·|q|·radius``.
            1 (default): Quest's upper bound; smaller estimates the page's best key instead (with
            ``exact_channels > 0`` only).
        fit_channels: ``exact_channels`` is a ceiling the model may lower: :meth:`for_model` keeps
            ``min(exact_channels, head_dim // 2)`` channels (at most half of a key's channels stored
            exactly) instead of refusing a model whose ``head_dim`` is not above them. The named
            policy ``"quest-ch"`` sets it (16 channels; 8 on a head_dim-16 model such as
            ``tiny-llama``). False (default): the channels are exactly ``exact_channels``, and a
            ``head_dim <= exact_channels`` is refused when the engine is built.
        reuse_bias: offload with the page cache only — ``beta >= 1``: a page already in the GPU
            cache is preferred; its score gains ``ln(beta) / softmax_scale`` (``ln(beta)`` in logit
            units), so a page outside the cache displaces a cached one only when its score says
            its attention weight is ``beta`` times larger. Fewer misses, fewer bytes over PCIe;
            the pages read are then not the top of the scores alone (hysteresis), so measure the
            accuracy (``xoffload eval``, mode suffix ``/reuse=B``). None (default):
            :data:`DEFAULT_REUSE_BIAS` (8) with ``group_score="max"``, off with ``"softmax"``
            (:attr:`reuse_factor` is the value in use); 1.0: off. A value other than 1 needs
            ``group_score="max"`` (raw ``q·k`` scores). Chosen from measurements on the H200 and
            SmolLM2 (docs/DESIGN.md): at 8 the 8B shape decodes 32K at 0.98x and 128K
            at 0.73x resident dense, RULER-style accuracy unchanged against 2.

    Raises:
        TypeError / ValueError on a bad value (named in the message).
    """

    token_budget: int | None = 2048
    page_size: int = 32
    sink_tokens: int = 32
    recent_tokens: int = 128
    dense_layers: tuple = (0, 1)
    group_score: str = "max"
    cache_pages: int | None = None
    cache_bytes: int = 2 << 30
    reuse_bias: float | None = None
    exact_channels: int = 0
    bound_scale: float = 1.0
    fit_channels: bool = False

    def __post_init__(self):
        if self.token_budget is not None:
            check_int("token_budget", self.token_budget, 1)
        p = check_int("page_size", self.page_size, 16)
        if p & (p - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {p}")
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("recent_tokens", self.recent_tokens, 0)
        if isinstance(self.dense_layers, (str, bytes)) or not hasattr(self.dense_layers, "__iter__"):
            raise TypeError(f"dense_layers must be a tuple of layer indices, got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", tuple(check_int("dense_layers entry", i) for i in self.dense_layers))
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.cache_pages is not None:
            check_int("cache_pages", self.cache_pages, 0)
        check_int("cache_bytes", self.cache_bytes, 0)
        if self.reuse_bias is not None:
            if isinstance(self.reuse_bias, bool) or not isinstance(self.reuse_bias, numbers.Real) \
                    or not 1.0 <= float(self.reuse_bias) < float("inf"):
                raise ValueError(f"reuse_bias must be a finite number >= 1 (or None: the default), got "
                                 f"{self.reuse_bias!r}")
            object.__setattr__(self, "reuse_bias", float(self.reuse_bias))
            if self.reuse_bias != 1.0 and self.group_score != "max":
                raise ValueError(f"reuse_bias={self.reuse_bias} needs group_score='max', got {self.group_score!r}")
        check_int("exact_channels", self.exact_channels, 0)
        if self.exact_channels > 64:
            raise ValueError(f"exact_channels must be <= 64, got {self.exact_channels}")
        if self.exact_channels and p > 256:  # the channel score kernel holds a page's tokens in one tile
            raise ValueError(f"exact_channels needs page_size <= 256, got page_size={p}")
        if not isinstance(self.fit_channels, bool):
            raise TypeError(f"fit_channels must be a bool, got {self.fit_channels!r}")
        if isinstance(self.bound_scale, bool) or not isinstance(self.bound_scale, (int, float)):
            raise TypeError(f"bound_scale must be a number in [0, 1], got {self.bound_scale!r}")
        if not 0.0 <= float(self.bound_scale) <= 1.0:
            raise ValueError(f"bound_scale must be in [0, 1], got {self.bound_scale!r}")
        object.__setattr__(self, "bound_scale", float(self.bound_scale))
        if self.bound_scale != 1.0 and not self.exact_channels:
            raise ValueError(f"bound_scale={self.bound_scale} weighs the key range on the channels not scored "
                             f"exactly; it needs exact_channels > 0 (without them the score is Quest's bound: 1.0)")

    def for_model(self, cfg) -> "QuestDecode":
        """This policy for a model of config ``cfg`` (``num_layers``, ``head_dim``): with
        ``fit_channels``, ``exact_channels`` lowered to ``head_dim // 2`` where it is more (itself
        otherwise). Raises ValueError for dense layers outside the model or exact channels not
        below ``head_dim``."""
        pol = super().for_model(cfg)
        if self.fit_channels and self.exact_channels > cfg.head_dim // 2:
            pol = dataclasses.replace(self, exact_channels=cfg.head_dim // 2)
        if pol.exact_channels >= cfg.head_dim:
            raise ValueError(f"exact_channels={pol.exact_channels} must be below the model's head_dim {cfg.head_dim}")
        return pol

    @property
    def reuse_factor(self) -> float:
        """The reuse bias in use: ``reuse_bias``, or with None :data:`DEFAULT_REUSE_BIAS` for
        ``group_score="max"`` and 1.0 (off) for ``"softmax"``."""
        if self.reuse_bias is not None:
            return self.reuse_bias
        return DEFAULT_REUSE_BIAS if self.group_score == "max" else 1.0

    def reuse_bonus(self, softmax_scale: float) -> float:
        """The score bonus of a page already in the GPU cache, in the units of the page scores
        (raw ``q·k``): ``ln(reuse_factor) / softmax_scale``; 0.0 when the bias is off. Raises
        ValueError for a scale so small that the bonus is past fp32's range (top-k adds it in fp32)."""
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
                or not 0.0 < float(softmax_scale) < float("inf"):
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
        b = self.reuse_factor
        if b == 1.0:
            return 0.0
        bonus = math.log(b) / float(softmax_scale)
        if not fits_fp32(bonus):
            raise ValueError(f"reuse bias {b} over softmax_scale={softmax_scale!r} is a page-score bonus of "
                             f"{bonus:.3g}, past fp32's range")
        return bonus

    def cache_slots(self, plan: "DecodePlan", slot_bytes: int = 0) -> int:
        """GPU cache slots per KV head and sparse layer for ``plan`` (0: no cache): ``cache_pages``,
        or by default ``max(4 * pages_per_step, cache_bytes // slot_bytes)`` (``slot_bytes``: K and
        V bytes of one slot over every sparse layer and KV head; 0: the ``4 * pages_per_step``
        rule alone); at least ``pages_per_step``, at most the candidates and
        :data:`~xoffload.kernels.page_cache.MAX_SLOTS`; 0 when a step reads more pages than
        ``MAX_SLOTS`` (the cache cannot hold one step's pages: they are read in place)."""
        k, n = plan.pages_per_step, plan.num_candidates
        if k == 0 or self.cache_pages == 0 or k > MAX_SLOTS:
            return 0
        if self.cache_pages is None:
            c = max(4 * k, self.cache_bytes // slot_bytes if slot_bytes > 0 else 0)
        else:
            c = self.cache_pages
        return min(max(c, k), n, MAX_SLOTS)

    def sparse_layers(self, num_layers: int) -> tuple:
        """Indices of the layers that select pages (the others are dense). Raises ValueError for a
        dense layer outside ``[-num_layers, num_layers)``."""
        bad = [i for i in self.dense_layers if not -num_layers <= i < num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} are outside the model's {num_layers} layers")
        dense = {i % num_layers for i in self.dense_layers}
        return tuple(i for i in range(num_layers) if i not in dense)

    def plan(self, prompt_len: int) -> DecodePlan:
        """The request's :class:`DecodePlan` for a prompt of ``prompt_len`` tokens.

        Defined for every case: a prompt shorter than sink + recent + one page has no candidate
        page (everything resident, ``pages_per_step = 0``); a budget smaller than the resident
        prompt tokens reads no page (sink + tail only); a budget >= the prompt (or None) reads
        every candidate page each step (``plan.dense``).
        """
        T = check_int("prompt_len", prompt_len, 1)
        P = self.page_size
        first = min(-(-self.sink_tokens // P), T // P)  # sink pages (ceil), never past the last full page
        last = max(first, (T - self.recent_tokens) // P)  # candidate pages end before the tail
        sink_len, tail_start = first * P, last * P
        n_cand = last - first
        if self.token_budget is None:
            k = n_cand
        else:
            resident = sink_len + T - tail_start
            k = min(n_cand, max(0, (self.token_budget - resident) // P))
        return DecodePlan(prompt_len=T, page_size=P, sink_len=sink_len, tail_start=tail_start,
                          first_page=first, num_candidates=n_cand, pages_per_step=k)

    def largest_plan(self, max_prompt_len: int) -> tuple:
        """``(num_candidates, pages_per_step, resident_prompt_tokens)``: the most of each over the
        plans of every prompt of ``1 .. max_prompt_len`` tokens (the widths a batched store sized
        for prompts up to that length needs: a shorter prompt may read more pages per step, or
        keep more tokens resident, than a longer one, its page-aligned tail holding fewer or
        more of the budget's tokens).

        The candidates never decrease with the prompt length; the pages per step are largest at
        the longest prompt whose tail is exactly ``recent_tokens`` (the resident tokens are then
        fewest and the candidates most) and the resident tokens at the longest whose tail is
        ``page_size - 1`` tokens more, so only the last ``page_size`` lengths are looked at.
        Raises ValueError for ``max_prompt_len < 1``."""
        T = check_int("max_prompt_len", max_prompt_len, 1)
        plans = [self.plan(t) for t in range(max(1, T - self.page_size + 1), T + 1)]
        return (max(p.num_candidates for p in plans), max(p.pages_per_step for p in plans),
                max(p.resident_prompt_tokens for p in plans))
