"""Needle-in-a-haystack prompts and scoring (used by ``xoffload needle`` and the tests).

A prompt is the model's chat template around: a repeated noise haystack, one sentence holding a
7-digit number (the needle) at a relative depth, and a question at the end. The answer is found when
the 7 digits appear in the generated text.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

HAYSTACK = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE = "The special magic number is {number}. Remember it: {number}."
QUESTION = ("What is the special magic number mentioned in the text above? "
            "Answer with the number only.")
ANSWER_PREFIX = "The special magic number is"


@dataclass
class NeedlePrompt:
    """One prompt: ``token_ids``, the needle ``number`` (7-digit string), target ``length``
    (context tokens, prompt + answer budget), ``depth`` in [0, 1] and where it landed."""

    token_ids: list
    number: str
    length: int
    depth: float
    needle_token_pos: int


def _chat_ids(tokenizer, user: str) -> list:
    msgs = [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(x) for x in ids]
    else:
        ids = [int(x) for x in tokenizer.encode(user + "\n")]
    return ids + [int(x) for x in tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False)]


def make_number(rng: random.Random) -> str:
    """A 7-digit number string (no leading zero)."""
    return str(rng.randint(1_000_000, 9_999_999))


def build_prompt(tokenizer, length: int, depth: float, number: str, answer_tokens: int = 16) -> NeedlePrompt:
    """Token ids of a needle prompt of at most ``length - answer_tokens`` tokens (and close to it).

    The haystack is whole noise sentences; the needle goes after the sentence nearest to ``depth``
    of the haystack (0 = first, 1 = last, just before the question). Raises ValueError when
    ``length`` leaves no room for any haystack or ``depth`` is outside [0, 1].
    """
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    budget = int(length) - int(answer_tokens)
    sentences = [s.strip() + " " for s in re.split(r"(?<=\.)\s", HAYSTACK) if s.strip()]
    needle = NEEDLE.format(number=number)

    def compose(n_sent):
        hay = [sentences[i % len(sentences)] for i in range(n_sent)]
        at = int(round(float(depth) * n_sent))
        text = "".join(hay[:at]) + needle + " " + "".join(hay[at:])
        return text.rstrip() + "\n\n" + QUESTION, at

    base = len(_chat_ids(tokenizer, compose(0)[0]))
    if base >= budget:
        raise ValueError(f"length {length} too short: the prompt without haystack already takes {base} tokens "
                         f"(+{answer_tokens} for the answer)")
    per = max(1, len(tokenizer.encode("".join(sentences), add_special_tokens=False)) / len(sentences))
    n = max(0, int((budget - base) / per))
    ids, at = None, 0
    for _ in range(64):
        text, at = compose(n)
        ids = _chat_ids(tokenizer, text)
        if len(ids) > budget:
            n = max(0, n - max(1, int((len(ids) - budget) / per + 0.5)))
            continue
        # try to grow by whole sentences while it fits
        grow = int((budget - len(ids)) / per)
        if grow <= 0:
            break
        text2, at2 = compose(n + grow)
        ids2 = _chat_ids(tokenizer, text2)
        if len(ids2) > budget:
            break
        n, ids, at = n + grow, ids2, at2
    # where the needle starts, in tokens (approximate: prefix before it)
    prefix = compose(n)[0].split(needle)[0]
    pos = len(_chat_ids(tokenizer, prefix)) - len(_chat_ids(tokenizer, ""))
    return NeedlePrompt(token_ids=ids, number=number, length=int(length), depth=float(depth),
                        needle_token_pos=max(0, pos))


def found(text: str, number: str) -> bool:
    """Whether the answer ``text`` contains the needle's digits (separators between digits ignored)."""
    if text is None:
        return False
    digits = re.sub(r"[\s,._'-]", "", text)
    return number in digits


def parse_length(s) -> int:
    """``"2k"`` → 2048, ``"1500"`` → 1500, ``"0.5k"`` → 512. Raises ValueError."""
    t = str(s).strip().lower()
    try:
        if t.endswith("k"):
            return int(float(t[:-1]) * 1024)
        return int(t)
    except ValueError:
        raise ValueError(f"bad length {s!r}: use a token count like 2048 or 2k") from None
