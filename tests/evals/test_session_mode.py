"""``xoffload eval`` asking each prompt as a session's second turn (``:session`` modes): the
question's first token is found in the prompt, the two turns see exactly the one-shot prompt's
tokens (so the answer equals the one-shot answer in fp32), and the mode syntax is checked."""
import re

import pytest

from xoffload.engine import LLM, SamplingParams
from xoffload.evals.cli import _ArgError, mode_options
from xoffload.evals.runner import ask_in_session, question_start
from xoffload.evals.tasks import build_samples


@pytest.mark.parametrize("task", ["niah_single_1", "cwe"])  # cwe: its example repeats the question
def test_question_start_and_second_turn_equal_one_shot(smol, tok, task):
    s = build_samples(tok, [task], [1024], 1, seed=3)[0]
    j = question_start(s, tok)
    assert 0 < j < len(s.token_ids) - 4
    line = s.input.rstrip().rsplit("\n", 1)[-1]
    assert line.strip() in tok.decode(s.token_ids[j - 2:])  # the question follows the cut
    full = tok.decode(s.token_ids)
    assert tok.decode(s.token_ids[:j]).count(line.strip()) == full.count(line.strip()) - 1  # its last copy
    llm = LLM(smol, mode="gpu", max_model_len=2048, prefill_attn="sdpa")
    sp = SamplingParams(max_tokens=8)
    one = llm.generate(s.token_ids, sp)[0]
    two = ask_in_session(llm, s, tok, sp)
    assert two.token_ids == one.token_ids
    assert two.timings["history_tokens"] == j


def test_session_mode_syntax():
    assert mode_options("offload:session")["session"] == {"history_budget": None}
    assert mode_options("offload+quest@512:session@1024")["session"] == {"history_budget": 1024}
    assert "session" not in mode_options("offload")
    assert mode_options("offload:session@512/dense=0.1.18")["session"] == {"history_budget": 512,
                                                                           "dense_layers": (0, 1, 18)}
    for bad in ("offload:session@", "offload:session@x", "offload:session@0", "offload:sessionx",
                "offload:session@512/dense=a"):
        with pytest.raises(_ArgError, match="session"):
            mode_options(bad)


def test_session_history_budget_is_checked_against_the_page_size_before_any_run():
    """The session's own rule (a multiple of the page size, at least 2 pages) is a --mode error at
    parse time, not a failure after the model is loaded and earlier modes have run."""
    assert mode_options("offload+quest-ch:session@512")["session"] == {"history_budget": 512}
    assert mode_options("offload+quest@512/page=16:session@48")["session"] == {"history_budget": 48}
    for bad, page, got in (("offload+quest-ch:session@100", 32, 100), ("offload:session@32", 32, 32),
                           ("offload+quest@512/page=16:session@40", 16, 40)):
        with pytest.raises(_ArgError, match=f"{re.escape(bad)}'.*multiple of the page size {page} .*got {got}$"):
            mode_options(bad)
