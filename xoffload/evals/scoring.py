"""RULER's metrics (its ``eval/synthetic/constants.py``): references are matched as case-insensitive
substrings of the prediction, after RULER's post-processing of the prediction (control characters
become newlines, surrounding whitespace is dropped).

* ``string_match_all`` — per sample, the fraction of references found; used by every synthetic task.
* ``string_match_part`` — per sample, 1 if any reference is found; used by the QA tasks.

A task's score is the mean over its samples times 100 (:func:`task_score`).
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred) -> str:
    """RULER's clean-up of a prediction: control characters to ``"\\n"``, then strip. None → ``""``."""
    if pred is None:
        return ""
    return _CONTROL.sub("\n", str(pred).strip()).strip()


def _refs(refs) -> list:
    if isinstance(refs, str):
        return [refs]
    refs = list(refs)
    if not refs:
        raise ValueError("no reference strings")
    return [str(r) for r in refs]


def string_match_all(pred, refs) -> float:
    """Fraction in [0, 1] of the reference strings ``refs`` (a list, or one string) that occur in
    ``pred``, case-insensitive. Raises ValueError on an empty ``refs``."""
    p = postprocess_pred(pred).lower()
    rs = _refs(refs)
    return sum(1.0 for r in rs if r.lower() in p) / len(rs)


def string_match_part(pred, refs) -> float:
    """1.0 if any of the reference strings occurs in ``pred`` (case-insensitive), else 0.0. Raises
    ValueError on an empty ``refs``."""
    p = postprocess_pred(pred).lower()
    return max(1.0 if r.lower() in p else 0.0 for r in _refs(refs))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(pred, refs, metric: str = "all") -> float:
    """Per-sample score in [0, 1] with ``metric`` ``"all"`` or ``"part"`` (ValueError otherwise)."""
    try:
        fn = METRICS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; use 'all' or 'part'") from None
    return fn(pred, refs)


def task_score(preds, refs_list, metric: str = "all") -> float:
    """RULER's task score: mean per-sample score x 100, in [0, 100] (two lists of equal length;
    ValueError when they differ or are empty)."""
    preds, refs_list = list(preds), list(refs_list)
    if len(preds) != len(refs_list) or not preds:
        raise ValueError(f"need as many predictions as references (>0), got {len(preds)} and {len(refs_list)}")
    return 100.0 * sum(score(p, r, metric) for p, r in zip(preds, refs_list)) / len(preds)
