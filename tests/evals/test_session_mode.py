"""``xoffload eval`` asking each prompt as a session's second turn (``:session`` modes): the
question's first token is found in the prompt, the two turns see exactly the one-shot prompt's
tokens (so the answer equals the one-shot answer in fp32), and the mode syntax is checked."""
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
    llm = LLM(smol, mode="offload", kv_block_size=64, max_model_len=2048, prefix_caching=True, prefill_attn="sdpa")
    sp = SamplingParams(max_tokens=8)
    one = LLM(smol, mode="gpu", max_model_len=2048, prefill_attn="sdpa").generate(s.token_ids, sp)[0]
    two = ask_in_session(llm, s, tok, sp)
    assert two.token_ids == one.token_ids
    assert two.timings["history_tokens"] == j  # the first turn's prompt came from the prefix cache
    assert two.timings["chunk_tokens"] == len(s.token_ids) - j


def test_session_mode_syntax():
    """``:session`` takes no suffix (a history budget is no option any more: one-line error); it
    turns prefix caching on where the configuration takes it."""
    kw = mode_options("offload:session")
    assert kw["session"] == {} and kw["prefix_caching"] is True
    assert mode_options("offload+quest@512:session")["prefix_caching"] is True
    assert mode_options("resident:session")["prefix_caching"] is True
    assert mode_options("offload-uva:session")["prefix_caching"] is True
    assert mode_options("resident+quest:session")["prefix_caching"] is True  # the Quest store's device pool
    assert "session" not in mode_options("offload") and "prefix_caching" not in mode_options("offload")
    for bad in ("offload:session@1024", "offload+quest@512:session@512", "offload:session@512/dense=0.1.18",
                "offload:session/dense=0", "offload:session@", "offload:sessionx"):
        with pytest.raises(_ArgError, match=r":session takes no suffix .*history is read whole") as e:
            mode_options(bad)
        assert "\n" not in str(e.value)
