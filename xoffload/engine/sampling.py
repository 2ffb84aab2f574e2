"""How a request picks its tokens: :class:`SamplingParams` and :func:`sample` (on the device)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ..kernels.checks import is_int

__all__ = ["SamplingParams", "sample"]


@dataclass
class SamplingParams:
    """How to pick tokens.

    Args:
        temperature: 0 (default) = greedy argmax; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 = no truncation.
        top_k: sample among the ``top_k`` most likely tokens only (an int >= 0; 0 = all of them).
        max_tokens: most new tokens to generate (>= 1); also capped by ``max_model_len``.
        seed: seed of the request's own random generator (None: the LLM's ``seed``).
        ignore_eos: keep generating past EOS (benchmarks).
        stop_token_ids: extra token ids that end generation (besides the model's EOS ids).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple = ()
    top_k: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a number, got {v!r}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)) \
                or not all(is_int(x) for x in ids):
            raise TypeError(f"stop_token_ids must be a list or tuple of ints, got {ids!r}")
        t = float(self.temperature)
        if not (t >= 0 and t < float("inf")):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        p = float(self.top_p)
        if not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self.temperature, self.top_p = t, p
        self.stop_token_ids = tuple(int(x) for x in self.stop_token_ids)
        self.top_k = int(self.top_k)


def sample(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[1]`` token from fp32 logits ``[1, V]`` (stays on the device, no host sync)."""
    if sp.temperature <= 0:
        return logits.argmax(-1)
    if 0 < sp.top_k < logits.shape[-1]:  # keep the k largest logits (ties at the k-th included)
        kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # subtract the max first: a tiny temperature then gives a one-hot, not inf - inf = NaN
    p = torch.softmax((logits - logits.amax(-1, keepdim=True)) / sp.temperature, dim=-1)
    if sp.top_p < 1.0:
        ps, idx = p.sort(dim=-1, descending=True)
        cum = ps.cumsum(-1)
        ps = ps.masked_fill((cum - ps) > sp.top_p, 0.0)
        choice = torch.multinomial(ps, 1, generator=gen)
        return idx.gather(-1, choice).view(1)
    return torch.multinomial(p, 1, generator=gen).view(1)
