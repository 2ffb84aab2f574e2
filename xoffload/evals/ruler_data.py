"""Load RULER's own ``.jsonl`` data (what its ``prepare.py`` writes) as :class:`~.tasks.Sample` s.

A line is a JSON object with ``input`` (str), ``outputs`` (list of str, or one str) and ``length``
(int: RULER's count of input + generation tokens under its tokenizer); optional ``index`` (int),
``answer_prefix`` (str; newer RULER versions store it apart from ``input``), ``task`` (str),
``max_new_tokens`` / ``tokens_to_generate`` (int). Blank lines are skipped; anything else raises
ValueError naming the file and line.

* task: the ``task`` field, else the file stem — or, for RULER's ``<task>/validation.jsonl`` (or
  ``test.jsonl``), the folder name.
* metric: ``part`` for ``qa*`` tasks (RULER's string_match_part), ``all`` otherwise.
* generation length: the line's field, else RULER's per task family (niah 128, vt 30, cwe 120,
  fwe 50, qa 32), else 128.
* target length (the table's column): an all-digit folder name on the path (RULER writes
  ``.../<max_seq_length>/data/<task>/validation.jsonl``), else the line's ``length``.
* without an ``answer_prefix`` field, an old-style ``input`` that ends with the answer prefix of its
  task family has it split off (as RULER does: the last occurrence of the prefix's first 10
  characters), so that ``input + answer_prefix`` is the text as written and the prefix can open
  the assistant turn when a chat template is asked for.

The prompt (:func:`prompt_ids`), by default, is what RULER's own prediction script sends:
``input + answer_prefix`` as they are, tokenized as one string with the tokenizer's default special
tokens (``tokenizer(text)``, as RULER's HF wrapper calls it) and no chat template, because RULER
bakes its template into the data (``--model_template_type``). RULER counts ``length`` as
``len(tokenizer.tokenize(input + answer_prefix)) + tokens_to_generate``, i.e. without special
tokens; so the prompt has exactly ``length - tokens_to_generate`` tokens whenever the tokenizer adds
none. SmolLM2's tokenizer adds none (no BOS: its post-processor is empty, and that is what the
tokenizer xoffload builds from the GGUF does with the installed transformers), so its prompts match
RULER's count token for token. A tokenizer that does add a BOS (e.g. Llama's) gets it here too, as
under RULER, and such a prompt is one token longer than RULER's count: a sample that RULER sized to
the budget exactly then no longer fits (:func:`split_fitting` skips it).
:func:`added_special_tokens` says which ids a tokenizer adds.

``chat=True`` (``xoffload eval --chat-template``) wraps the prompt in the model's chat template
instead (:func:`~.tasks.chat_ids`: ``input`` as the user turn, the stripped ``answer_prefix``
opening the assistant turn), as the locally generated tasks are; SmolLM2's template adds ~30
tokens (its default system turn included).
"""
from __future__ import annotations

import json
import os

from .tasks import (CWE_ANSWER_PREFIX, FWE_ANSWER_PREFIX, NIAH_TOKENS, QA_ANSWER_PREFIX, QA_TOKENS,
                    VT_ANSWER_PREFIX, Sample, chat_ids, CWE_TOKENS, FWE_TOKENS, VT_TOKENS)

_FAMILY_TOKENS = (("niah", NIAH_TOKENS), ("vt", VT_TOKENS), ("variable_tracking", VT_TOKENS),
                  ("cwe", CWE_TOKENS), ("common_words", CWE_TOKENS), ("fwe", FWE_TOKENS),
                  ("freq_words", FWE_TOKENS), ("qa", QA_TOKENS))
_FAMILY_PREFIX = (("niah", " The special magic"), ("vt", VT_ANSWER_PREFIX), ("variable_tracking", VT_ANSWER_PREFIX),
                  ("cwe", CWE_ANSWER_PREFIX), ("common_words", CWE_ANSWER_PREFIX), ("fwe", FWE_ANSWER_PREFIX),
                  ("freq_words", FWE_ANSWER_PREFIX), ("qa", QA_ANSWER_PREFIX))
DEFAULT_TOKENS = 128


def _family_value(task: str, table, default):
    for prefix, v in table:
        if task.startswith(prefix):
            return v
    return default


def task_name_for(path: str) -> str:
    """Task name of a RULER data file from its path (``.../niah_single_1/validation.jsonl`` →
    ``"niah_single_1"``, ``.../vt.jsonl`` → ``"vt"``)."""
    p = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(p))[0]
    if stem in ("validation", "test", "train", "data"):
        parent = os.path.basename(os.path.dirname(p))
        return parent or stem
    return stem


def _target_length_from_path(path: str):
    parts = os.path.abspath(path).split(os.sep)[:-1]
    for part in reversed(parts):
        if part.isdigit() and int(part) > 0:
            return int(part)
    return None


def _split_prefix(task: str, text: str):
    pfx = _family_value(task, _FAMILY_PREFIX, None)
    if not pfx:
        return text, ""
    key = pfx[:10]
    i = text.rfind(key)
    if i < 0 or len(text) - i > 400:
        return text, ""
    return text[:i], text[i:]


def read_jsonl(path: str) -> list:
    """The records of a RULER ``.jsonl`` file as dicts, validated (see the module doc); each has its
    ``_line`` number added. Raises FileNotFoundError, or ValueError ``"<path>:<line>: <what>"``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"RULER data file {path} not found")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            for k in ("input", "outputs", "length"):
                if k not in rec:
                    raise ValueError(f"{where}: missing field {k!r}")
            if not isinstance(rec["input"], str) or not rec["input"]:
                raise ValueError(f"{where}: 'input' must be a non-empty string")
            outs = rec["outputs"]
            if isinstance(outs, str):
                outs = [outs]
            if not isinstance(outs, list) or not outs or not all(isinstance(o, str) for o in outs):
                raise ValueError(f"{where}: 'outputs' must be a non-empty list of strings")
            rec["outputs"] = outs
            for k in ("length", "index", "max_new_tokens", "tokens_to_generate"):
                v = rec.get(k)
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if k != "index" else 0)):
                    raise ValueError(f"{where}: {k!r} must be a {'positive' if k != 'index' else 'non-negative'} "
                                     f"integer, got {v!r}")
            for k in ("answer_prefix", "task"):
                if k in rec and not isinstance(rec[k], str):
                    raise ValueError(f"{where}: {k!r} must be a string")
            rec["_line"] = lineno
            out.append(rec)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def prompt_ids(tokenizer, text: str, answer_prefix: str = "", chat: bool = False) -> list:
    """Token ids of one RULER prompt (see the module doc): ``text + answer_prefix`` as one string with
    the tokenizer's default special tokens (``chat=False``, what RULER sends), or
    :func:`~.tasks.chat_ids` (``chat=True``: the model's chat template around it)."""
    if chat:
        return chat_ids(tokenizer, text, answer_prefix)
    ids = tokenizer(text + answer_prefix)["input_ids"]
    return [int(x) for x in ids]


def added_special_tokens(tokenizer) -> list:
    """The token ids ``tokenizer`` adds around a text by default (e.g. ``[bos_id]``; ``[]`` for
    SmolLM2), found by tokenizing one word with and without special tokens."""
    with_sp = [int(x) for x in tokenizer("a")["input_ids"]]
    without = [int(x) for x in tokenizer("a", add_special_tokens=False)["input_ids"]]
    if without and len(with_sp) >= len(without):
        for j in range(len(with_sp) - len(without) + 1):
            if with_sp[j:j + len(without)] == without:
                return with_sp[:j] + with_sp[j + len(without):]
    return with_sp


def load_ruler_jsonl(path: str, tokenizer=None, chat: bool = False) -> list:
    """Samples of one RULER ``.jsonl`` file (see the module doc for the fields and rules).

    With ``tokenizer`` the samples carry ``token_ids`` (:func:`prompt_ids`: ``input + answer_prefix``
    as RULER sends it, or in the chat template with ``chat=True``); without, ``token_ids`` is empty
    and :func:`tokenize_samples` fills it later (so files can be checked before a model is loaded).
    Raises FileNotFoundError, or ValueError naming file and line."""
    recs = read_jsonl(path)
    task_default = task_name_for(path)
    tlen = _target_length_from_path(path)
    samples = []
    for i, rec in enumerate(recs):
        task = rec.get("task") or task_default
        text = rec["input"]
        if "answer_prefix" in rec:
            prefix = rec["answer_prefix"]
        else:
            text, prefix = _split_prefix(task, text)
        max_new = rec.get("max_new_tokens") or rec.get("tokens_to_generate") or \
            _family_value(task, _FAMILY_TOKENS, DEFAULT_TOKENS)
        s = Sample(task=task, index=int(rec.get("index", i)), length=int(tlen or rec["length"]), token_ids=[],
                   outputs=list(rec["outputs"]), depth=None, metric="part" if task.startswith("qa") else "all",
                   max_new_tokens=int(max_new), input=text, answer_prefix=prefix,
                   meta={"source": os.path.abspath(path), "line": rec["_line"], "ruler_length": rec["length"]})
        samples.append(s)
    if tokenizer is not None:
        tokenize_samples(samples, tokenizer, chat=chat)
    return samples


def tokenize_samples(samples, tokenizer, chat: bool = False) -> list:
    """Fill ``token_ids`` of loaded samples (in place; also returned) with :func:`prompt_ids`:
    RULER's raw prompt by default, the model's chat template with ``chat=True``."""
    for s in samples:
        s.token_ids = prompt_ids(tokenizer, s.input, s.answer_prefix, chat=chat)
    return samples


def effective_max_new_tokens(sample, cap=None) -> int:
    """The answer length a sample runs with: its own ``max_new_tokens`` (RULER's per task), or
    ``cap`` (``--max-new-tokens``) when that is smaller."""
    return int(sample.max_new_tokens) if cap is None else min(int(sample.max_new_tokens), int(cap))


def split_fitting(samples, max_model_len: int, max_new_tokens=None) -> tuple:
    """``(kept, skipped)``: the tokenized samples whose prompt plus effective answer length
    (:func:`effective_max_new_tokens` with the cap ``max_new_tokens``) fits in ``max_model_len``,
    and one dict per sample that does not (``source, line, task, index, length, prompt_tokens,
    max_new_tokens, max_model_len``), in order. Raises ValueError for a sample not yet tokenized."""
    kept, skipped = [], []
    for s in samples:
        if not s.token_ids:
            raise ValueError(f"sample {s.task}#{s.index} has no token ids (tokenize_samples first)")
        mt = effective_max_new_tokens(s, max_new_tokens)
        if len(s.token_ids) + mt <= max_model_len:
            kept.append(s)
        else:
            skipped.append({"source": s.meta.get("source"), "line": s.meta.get("line"), "task": s.task,
                            "index": s.index, "length": s.length, "prompt_tokens": len(s.token_ids),
                            "max_new_tokens": mt, "max_model_len": int(max_model_len)})
    return kept, skipped


def load_ruler_data(paths, tokenizer=None, chat: bool = False) -> list:
    """Samples of several files (a list, or one comma-separated string), in order; ``tokenizer`` and
    ``chat`` as in :func:`load_ruler_jsonl`."""
    if isinstance(paths, str):
        paths = [p for p in (x.strip() for x in paths.split(",")) if p]
    out = []
    for p in paths:
        out.extend(load_ruler_jsonl(p, tokenizer, chat=chat))
    return out
