"""What a request brings in: prompt ids checked against the model (:func:`prompt_ids`), lists of
prompts (:func:`normalize_prompts`), sampling parameters (:func:`sampling_list`), and the
tokenizer's text and chat-template conversions."""
from __future__ import annotations

import torch

from .sampling import SamplingParams

__all__ = ["prompt_ids", "normalize_prompts", "sampling_list", "encode", "decode", "apply_chat_template"]


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def encode(model, text: str) -> list:
    """Token ids of raw text (the tokenizer's default special tokens). ValueError without a
    tokenizer."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; pass token ids instead of text")
    return [int(x) for x in model.tokenizer.encode(text)]


def decode(model, ids) -> str | None:
    """Text of token ids (special tokens skipped); None for a model without a tokenizer."""
    if model.tokenizer is None:
        return None
    return model.tokenizer.decode(list(ids), skip_special_tokens=True)


def apply_chat_template(model, messages, add_generation_prompt: bool = True) -> list:
    """Token ids of a chat (a user string or a list of ``{"role", "content"}`` dicts) through the
    tokenizer's chat template. ValueError without a tokenizer or chat template."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"model {model.source} has no tokenizer; pass token ids")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer of {model.source} has no chat template")
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(x) for x in ids]


def prompt_ids(model, max_model_len: int, name, p) -> list:
    """Checked token ids of one prompt ``p`` (a string, tokenized as it is, a list / tuple / 1-D
    tensor of ids). ``name`` names it in errors. Raises ValueError for an empty prompt, one longer
    than ``max_model_len``, ids outside the vocabulary; TypeError for another type."""
    if isinstance(p, str):
        if not p:
            raise ValueError(f"prompt {name} is empty")
        ids = encode(model, p)
    elif isinstance(p, (list, tuple, torch.Tensor)):
        if isinstance(p, torch.Tensor) and p.dim() != 1:
            raise TypeError(f"prompt {name} must be a 1-D tensor of token ids, got shape {tuple(p.shape)}")
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not all(_is_id(x) for x in ids):
            raise TypeError(f"prompt {name}: token ids must be ints")
    else:
        raise TypeError(f"prompt {name} must be a str or a list of token ids, got {type(p).__name__}")
    if len(ids) == 0:
        raise ValueError(f"prompt {name} is empty (0 tokens)")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt {name} has {len(ids)} tokens, more than max_model_len={max_model_len}")
    V = model.cfg.vocab_size
    bad = next((x for x in ids if x < 0 or x >= V), None)
    if bad is not None:
        raise ValueError(f"prompt {name}: token id {bad} outside the vocabulary [0, {V})")
    return ids


def normalize_prompts(model, max_model_len: int, prompts) -> list:
    """A list of checked token-id lists from what ``LLM.generate`` takes: a string, a list of ids,
    a list of strings / id lists, a 1-D / 2-D int tensor. Raises as :func:`prompt_ids`, and
    ValueError for an empty list."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
        if prompts and _is_id(prompts[0]):
            prompts = [prompts]
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)):
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass a string, a list of token ids, or a list of those")
        if all(_is_id(x) for x in prompts):
            prompts = [list(prompts)]
    else:
        raise TypeError(f"prompts must be str, list of ids, or a list of those; got {type(prompts).__name__}")
    return [prompt_ids(model, max_model_len, i, p) for i, p in enumerate(prompts)]


def sampling_list(sp, n: int) -> list:
    """``n`` :class:`SamplingParams`: one for all (default greedy, 64 tokens) or a list of ``n``.
    ValueError / TypeError otherwise."""
    if sp is None:
        sp = SamplingParams()
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if isinstance(sp, (list, tuple)):
        if len(sp) != n:
            raise ValueError(f"sampling_params is a list of {len(sp)}, but there are {n} prompts")
        for i, x in enumerate(sp):
            if not isinstance(x, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(x).__name__}")
        return list(sp)
    raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(sp).__name__}")
