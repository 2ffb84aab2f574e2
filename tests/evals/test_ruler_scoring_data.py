"""RULER's metrics on hand examples, and RULER's own .jsonl data loaded (qa with string_match_part,
old- and new-style answer prefixes, task names from paths, malformed lines named by line; the raw
prompt by default, the chat template on request; the fit check with the effective answer length)."""
import json

import pytest

from xoffload.evals.ruler_data import (added_special_tokens, effective_max_new_tokens, load_ruler_data,
                                       load_ruler_jsonl, prompt_ids, split_fitting, task_name_for)
from xoffload.evals.scoring import (postprocess_pred, score, string_match_all, string_match_part,
                                    task_score)
from xoffload.evals.tasks import chat_ids


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_all("nothing", ["123", "456", "789", "000"]) == 0.0
    assert string_match_all("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)  # case-insensitive
    assert string_match_all(None, ["x"]) == 0.0
    assert string_match_all(" 1234567\x00", "1234567") == 1.0  # one reference as a string
    with pytest.raises(ValueError, match="no reference"):
        string_match_all("x", [])


def test_string_match_part_and_task_score():
    assert string_match_part("Paris, France", ["paris", "Lyon"]) == 1.0
    assert string_match_part("Berlin", ["paris", "Lyon"]) == 0.0
    assert score("a b", ["a", "c"], "part") == 1.0 and score("a b", ["a", "c"], "all") == 0.5
    with pytest.raises(ValueError, match="metric"):
        score("a", ["a"], "exact")
    # RULER: task score = mean x 100
    assert task_score(["123", "nope", "456 123"], [["123"], ["9"], ["123", "456"]]) == pytest.approx(200 / 3)
    assert task_score(["x"], [["x", "y"]], "part") == 100.0
    with pytest.raises(ValueError):
        task_score(["a"], [])
    assert postprocess_pred("  a\x01b\n ") == "a\nb"


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n", encoding="utf-8")
    return path


def test_load_new_and_old_style(tmp_path, tok):
    qa = _write(tmp_path / "4096" / "data" / "qa_1" / "validation.jsonl", [
        {"index": 0, "input": "Answer the question ...\n\nQuestion: Who?", "outputs": ["Ada", "Ada Lovelace"],
         "length": 3900, "answer_prefix": " Answer:"},
        "",
        {"index": 1, "input": "Question: Where?", "outputs": ["Paris"], "length": 4000, "answer_prefix": " Answer:"},
    ])
    ss = load_ruler_jsonl(str(qa), tok)
    assert [s.task for s in ss] == ["qa_1", "qa_1"] and [s.index for s in ss] == [0, 1]
    assert all(s.metric == "part" and s.max_new_tokens == 32 and s.length == 4096 for s in ss)
    assert ss[0].meta["line"] == 1 and ss[1].meta["line"] == 3 and ss[0].meta["ruler_length"] == 3900
    # RULER's prompt: input + answer_prefix as written, no template added (SmolLM2 adds no BOS)
    assert ss[0].token_ids == tok.encode(ss[0].input + " Answer:", add_special_tokens=False)
    assert tok.decode(ss[0].token_ids) == ss[0].input + " Answer:"
    (c,) = load_ruler_jsonl(str(qa), tok, chat=True)[:1]
    assert c.token_ids == chat_ids(tok, c.input, " Answer:") and len(c.token_ids) > len(ss[0].token_ids)
    assert tok.decode(c.token_ids).rstrip().endswith("Answer:")
    # old style: the answer prefix is inside "input"; the file stem is the task; no length folder
    niah = _write(tmp_path / "niah_single_1.jsonl", [
        {"input": "A special magic number ... What is the special magic number for x-y mentioned in the provided "
                  "text? The special magic number for x-y mentioned in the provided text is",
         "outputs": ["1234567"], "length": 1000}])
    (s,) = load_ruler_jsonl(str(niah))
    assert s.task == "niah_single_1" and s.metric == "all" and s.max_new_tokens == 128 and s.length == 1000
    assert s.answer_prefix == " The special magic number for x-y mentioned in the provided text is"
    assert s.input.endswith("provided text?") and s.token_ids == [] and s.index == 0
    assert prompt_ids(tok, s.input, s.answer_prefix) == tok.encode(s.input + s.answer_prefix)  # the text as written
    both = load_ruler_data(f"{qa},{niah}", tok)
    assert [x.task for x in both] == ["qa_1", "qa_1", "niah_single_1"] and all(x.token_ids for x in both)
    # a task field and a generation length win over the path
    f = _write(tmp_path / "x.jsonl", [{"input": "hi", "outputs": "a", "length": 10, "task": "vt",
                                       "tokens_to_generate": 7}])
    (s,) = load_ruler_jsonl(str(f))
    assert s.task == "vt" and s.max_new_tokens == 7 and s.outputs == ["a"]
    assert task_name_for("/a/b/cwe/test.jsonl") == "cwe"


@pytest.mark.parametrize("bad,what", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"input": "x", "length": 5}', "missing field 'outputs'"),
    ('{"input": "x", "outputs": [1], "length": 5}', "'outputs' must be a non-empty list of strings"),
    ('{"input": "x", "outputs": ["a"], "length": "5"}', "'length' must be a positive integer"),
    ('{"input": "", "outputs": ["a"], "length": 5}', "'input' must be a non-empty string"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, what):
    good = json.dumps({"input": "x", "outputs": ["a"], "length": 5})
    f = _write(tmp_path / "vt.jsonl", [good, "", bad, good])
    with pytest.raises(ValueError) as e:
        load_ruler_jsonl(str(f))
    assert f"{f}:3: " in str(e.value) and what in str(e.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_ruler_jsonl(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no records"):
        load_ruler_jsonl(str(_write(tmp_path / "empty.jsonl", [""])))


class _BosTokenizer:
    """A stand-in tokenizer that puts id 7 in front by default, as Llama's does: one id per character."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([7] if add_special_tokens else []) + [100 + ord(c) for c in text]}


def test_prompt_ids_and_added_special_tokens(tok):
    assert added_special_tokens(tok) == []  # SmolLM2: no BOS, so prompts match RULER's own count
    bos = _BosTokenizer()
    assert added_special_tokens(bos) == [7]
    assert prompt_ids(bos, "ab", " c") == [7, 197, 198, 132, 199]  # sent as RULER sends it: BOS included


def test_split_fitting_uses_the_effective_answer_length(tmp_path):
    f = _write(tmp_path / "8192" / "cwe.jsonl", [{"input": "x", "outputs": ["a"], "length": 10}] * 3)
    ss = load_ruler_jsonl(str(f))
    for s, n in zip(ss, (8000, 8080, 8192)):
        s.token_ids = [1] * n
    assert [s.max_new_tokens for s in ss] == [120] * 3 and effective_max_new_tokens(ss[0], 48) == 48
    assert effective_max_new_tokens(ss[0], 500) == 120 and effective_max_new_tokens(ss[0]) == 120
    kept, skipped = split_fitting(ss, 8192)  # RULER's 120: only the first fits
    assert kept == ss[:1] and [k["line"] for k in skipped] == [2, 3]
    assert skipped[0] == {"source": str(f), "line": 2, "task": "cwe", "index": 1, "length": 8192,
                          "prompt_tokens": 8080, "max_new_tokens": 120, "max_model_len": 8192}
    kept, skipped = split_fitting(ss, 8192, max_new_tokens=48)  # capped at 48: the second fits too
    assert kept == ss[:2] and [(k["line"], k["max_new_tokens"]) for k in skipped] == [(3, 48)]
    ss[0].token_ids = []
    with pytest.raises(ValueError, match="no token ids"):
        split_fitting(ss, 8192)
