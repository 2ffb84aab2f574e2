"""One request: its state (:class:`Request`), the clock its timings are read from
(:class:`Clock`), and its result (:class:`RequestOutput`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

__all__ = ["RequestOutput", "Request", "Clock", "EOS_LAG", "request_timings"]

#: decode steps between producing a token and the host checking it for EOS (GPU)
EOS_LAG = 2


@dataclass
class RequestOutput:
    """Result of one request, or its progress so far (an engine step's output, ``finished`` False).

    ``request_id``: the engine's name of the request (``LLM.generate``: its index as a str);
    ``token_ids``: generated ids (the stop token included when generation stopped on it);
    ``text``: their decoding without special tokens (None without a tokenizer); ``finished``;
    ``finish_reason``: ``"stop"`` (EOS / stop id), ``"length"``, ``"abort"`` (aborted) or
    ``"error"`` (``error`` holds the exception; no KV is kept), None while unfinished; ``timings``
    (finished ones): ``prefill_ms``, ``prefill_tok_per_s``,
    ``ttft_ms`` (prefill + first token), ``decode_ms_per_token`` (None if no decode step; ``decode_first_steps_ms`` and
    ``decode_steady_ms_per_token`` split off the first two steps, warm-up and graph capture),
    ``decode_steps``, ``total_ms``, ``prompt_tokens``, and with sparse prefill ``density`` (per layer,
    None for dense layers) and ``mean_density``, with an offloading store ``h2d_bytes_per_token``
    (bytes each decode step reads from host memory); ``peak_gpu_memory_bytes``: peak allocated during the
    request (None on the CPU); ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache
    (0 before the prefill and without reuse; on progress outputs too).
    """

    prompt_token_ids: list
    token_ids: list
    text: str | None
    finish_reason: str | None
    timings: dict = field(default_factory=dict)
    peak_gpu_memory_bytes: int | None = None
    request_id: str = ""
    finished: bool = True
    error: BaseException | None = None
    num_cached_tokens: int = 0


class Clock:
    """Timestamps: CUDA events on a GPU (the host waits only on events), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return float(a.elapsed_time(b))
        return (b - a) * 1e3


@dataclass
class Request:
    """What one request needs to run: prompt ids, sampling, how many new tokens at most
    (``max_new``, capped by ``max_model_len``), its own generator and its stop ids."""

    ids: list
    sp: SamplingParams
    max_new: int
    gen: torch.Generator
    stop: set

    @classmethod
    def make(cls, ids: list, sp: SamplingParams, *, max_model_len: int, seed: int, stop_ids, device) -> "Request":
        max_new = min(sp.max_tokens, max_model_len - len(ids) + 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed if sp.seed is None else int(sp.seed))
        stop = set() if sp.ignore_eos else set(stop_ids)
        stop.update(sp.stop_token_ids)
        return cls(list(ids), sp, max_new, gen, stop)

    @property
    def final_len(self) -> int:
        """Tokens the KV store must hold: the prompt and every new token but the last."""
        return len(self.ids) + self.max_new - 1

    def finish(self, all_ids: list):
        """``(token_ids, finish_reason)``: ``all_ids`` cut after the first stop id."""
        for j, t in enumerate(all_ids):
            if t in self.stop:
                return all_ids[:j + 1], "stop"
        return all_ids, "length"


def request_timings(clock: Clock, marks: dict, prompt_tokens: int, steps: int, densities,
                    computed_tokens: int | None = None) -> dict:
    """The ``timings`` dict of a :class:`RequestOutput` from the marks ``t0`` (start), ``prefill``,
    ``first`` (first token sampled) and ``end``; ``densities``: per-layer densities of a sparse
    prefill (tensor, float or None per layer), or None for a dense one; ``computed_tokens``: the
    prompt tokens the prefill computed when fewer than ``prompt_tokens`` (a reused prefix): then
    ``prefill_tok_per_s`` counts those only."""
    prefill_ms = clock.ms(marks["t0"], marks["prefill"])
    dec_ms = clock.ms(marks["first"], marks["end"])
    done = prompt_tokens if computed_tokens is None else computed_tokens
    t = {
        "prompt_tokens": prompt_tokens,
        "prefill_ms": prefill_ms,
        "prefill_tok_per_s": done / prefill_ms * 1e3 if prefill_ms > 0 else float("inf"),
        "ttft_ms": clock.ms(marks["t0"], marks["first"]),
        "decode_steps": steps,
        "decode_ms_per_token": dec_ms / steps if steps > 0 else None,
        "total_ms": clock.ms(marks["t0"], marks["end"]),
    }
    if "steady" in marks and steps > 2:
        # the first two steps hold the eager warm-up and the CUDA-graph capture
        t["decode_first_steps_ms"] = clock.ms(marks["first"], marks["steady"])
        t["decode_steady_ms_per_token"] = clock.ms(marks["steady"], marks["end"]) / (steps - 2)
    if densities is not None:
        dens = [None if d is None else float(d.float().mean()) if isinstance(d, torch.Tensor) else float(d)
                for d in densities]
        t["density"] = dens
        vals = [d for d in dens if d is not None]
        t["mean_density"] = sum(vals) / len(vals) if vals else None
    return t
