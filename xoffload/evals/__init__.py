"""Long-context evaluations: RULER-style tasks (Hsieh et al., 2024) generated locally.

* :mod:`.haystack` — RULER's repeated-noise haystack and a generated, seeded essay haystack.
* :mod:`.tasks` — the 11 synthetic tasks: ``build(task, tokenizer, length, sample_index, seed) -> Sample``.
* :mod:`.scoring` — RULER's ``string_match_all`` / ``string_match_part``.
* :mod:`.ruler_data` — RULER's own ``.jsonl`` files (incl. qa_1/qa_2) as samples.
* :mod:`.runner` — ``run_eval(...)``: every prompt once, under each LLM mode; tables, JSON, PNG.
* :mod:`.cli` — ``xoffload eval`` (``add_eval_parser``, ``cmd_eval``).

Names are imported lazily so that ``import xoffload.evals`` stays light.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "Sample": ".tasks", "TASKS": ".tasks", "build": ".tasks", "build_samples": ".tasks",
    "parse_tasks": ".tasks", "chat_ids": ".tasks", "depth_for_index": ".tasks",
    "string_match_all": ".scoring", "string_match_part": ".scoring", "score": ".scoring",
    "task_score": ".scoring",
    "load_ruler_jsonl": ".ruler_data", "load_ruler_data": ".ruler_data",
    "run_eval": ".runner", "EvalResult": ".runner",
    "add_eval_parser": ".cli", "cmd_eval": ".cli",
    "Essay": ".haystack", "NOISE": ".haystack",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'xoffload.evals' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
