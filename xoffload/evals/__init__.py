"""Long-context evaluations: the needle-in-a-haystack test and RULER-style tasks (Hsieh et al.,
2024) generated locally.

* :mod:`.needle` — needle prompts and scoring (``xoffload needle``).
* :mod:`.haystack` — RULER's repeated-noise haystack and a generated, seeded essay haystack.
* :mod:`.tasks` — the 11 synthetic tasks: ``build(task, tokenizer, length, sample_index, seed) -> Sample``.
* :mod:`.scoring` — RULER's ``string_match_all`` / ``string_match_part``.
* :mod:`.ruler_data` — RULER's own ``.jsonl`` files (incl. qa_1/qa_2) as samples.
* :mod:`.runner` — ``run_eval(...)``: every prompt once, under each LLM mode, length by length;
  tables, agreement, JSON, PNG.
* :mod:`.partial` — ``ruler.partial.jsonl``: records as they finish; resuming a cut run.
* :mod:`.hf_peer` — mode ``hf``: transformers' own model (on our weights) as the peer every mode is
  compared with.
* :mod:`.cli` — ``xoffload eval`` (``add_eval_parser``, ``cmd_eval``).
"""
from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "add_eval_parser": ".cli", "cmd_eval": ".cli", "NOISE": ".haystack", "Essay": ".haystack",
    "load_ruler_data": ".ruler_data", "load_ruler_jsonl": ".ruler_data", "EvalResult": ".runner",
    "run_eval": ".runner", "score": ".scoring", "string_match_all": ".scoring", "string_match_part": ".scoring",
    "task_score": ".scoring", "TASKS": ".tasks", "Sample": ".tasks", "build": ".tasks", "build_samples": ".tasks",
    "chat_ids": ".tasks", "depth_for_index": ".tasks", "parse_tasks": ".tasks",
}

__all__ = ["EvalResult", "Essay", "NOISE", "Sample", "TASKS", "add_eval_parser", "build", "build_samples", "chat_ids",
           "cmd_eval", "depth_for_index", "load_ruler_data", "load_ruler_jsonl", "parse_tasks", "run_eval", "score",
           "string_match_all", "string_match_part", "task_score"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
