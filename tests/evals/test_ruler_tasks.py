"""RULER-style tasks built with the real SmolLM2 tokenizer: sizes within 2% of the target, needles at
their stated depths, vt/cwe/fwe references recomputed from the generated text, determinism."""
import re
import time
from collections import Counter

import pytest

from xoffload.evals import haystack as hs
from xoffload.evals.tasks import (MAX_NEW_TOKENS, NIAH_NEEDLE, TASKS, build, build_samples, depth_for_index,
                                  parse_tasks)

NIAH = [t for t in TASKS if t.startswith("niah")]


def _check_size(s, length):
    budget = length - s.max_new_tokens
    assert s.length == length and s.max_new_tokens == MAX_NEW_TOKENS[s.task]
    assert 0.98 * budget <= len(s.token_ids) <= budget, (s.task, len(s.token_ids), budget)


def _decoded(tok, s):
    text = tok.decode(s.token_ids)
    assert s.input in text, "the user text survives tokenization"
    assert text.rstrip().endswith(s.answer_prefix.strip()), "the prompt ends with RULER's answer prefix"
    assert "<|im_start|>assistant" in text  # SmolLM2's chat template
    return text


def test_task_list_and_parse():
    assert len(TASKS) == 11 and len(NIAH) == 8 and set(TASKS) - set(NIAH) == {"vt", "cwe", "fwe"}
    assert parse_tasks("all") == list(TASKS) and parse_tasks("niah") == NIAH
    assert parse_tasks("vt, cwe,vt") == ["vt", "cwe"]
    with pytest.raises(ValueError, match="unknown task 'bogus'.*niah_single_1"):
        parse_tasks("vt,bogus")


@pytest.mark.parametrize("task", TASKS)
def test_every_task_builds_at_1k(tok, task):
    t = time.perf_counter()
    s = build(task, tok, 1024, 0, seed=0)
    assert time.perf_counter() - t < 1.0
    _check_size(s, 1024)
    text = _decoded(tok, s)
    assert s.metric == "all" and s.outputs and all(isinstance(o, str) and o for o in s.outputs)
    for o in s.outputs:
        assert o in s.input, (task, o)
    if task in NIAH:
        assert s.depth == depth_for_index(0) == 0.5
        assert "special magic" in text
    else:
        assert s.depth is None


def test_8k_prompt_builds_fast(tok):
    for task in ("niah_single_2", "niah_multikey_3", "cwe"):
        t = time.perf_counter()
        s = build(task, tok, 8192, 0, seed=0)
        dt = time.perf_counter() - t
        _check_size(s, 8192)
        assert dt < 0.8, (task, dt)


def _context(s):
    head = s.input.index("afterwards.\n") + len("afterwards.\n")
    tail = s.input.rindex("\nWhat ")
    return s.input[head:tail]


@pytest.mark.parametrize("task", NIAH)
def test_niah_needles_at_their_depths(tok, task):
    kind = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
    for index in (0, 1, 2, 3):  # depths 0.5, 0, 1, 0.3 for the needle of outputs[0]
        s = build(task, tok, 1024, index, seed=3)
        assert s.depth == depth_for_index(index)
        text = _decoded(tok, s)
        ctx = _context(s)
        assert ctx in text
        needles = {}
        for k in s.meta["keys"]:
            for v, d in s.meta["needle_depths"].items():
                n = NIAH_NEEDLE.format(type_needle_v=kind, key=k, value=v)
                if n in ctx:
                    needles[v] = (n, d)
        assert set(needles) == set(s.meta["needle_depths"]), "every needle is in the context"
        assert set(s.outputs) <= set(needles)
        assert s.meta["needle_depths"][s.outputs[0]] == s.depth
        for v, (n, d) in needles.items():
            assert ctx.count(n) == 1
            # depth within the haystack: drop the other inserted needles, then locate this one
            rest = ctx
            for v2, (n2, _) in needles.items():
                if v2 != v:
                    rest = rest.replace(n2, "")
            rel = rest.index(n) / max(1, len(rest) - len(n))
            assert abs(rel - d) < 0.06, (task, index, v, rel, d)
        # the queried keys are asked for
        question = s.input[s.input.rindex("\nWhat "):]
        for k in s.meta["query_keys"]:
            assert k in question and k in s.answer_prefix


def test_niah_kinds(tok):
    uuid_re = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
    s = build("niah_single_1", tok, 1024, 0)
    assert re.fullmatch(r"[1-9]\d{6}", s.outputs[0]) and "The grass is green. The sky is blue." in s.input
    assert s.input.startswith("A special magic number is hidden") and s.answer_prefix.endswith(" is")
    s = build("niah_single_3", tok, 1024, 0)
    assert uuid_re.match(s.outputs[0]) and "The grass is green" not in s.input
    s = build("niah_multikey_3", tok, 1024, 0)
    assert uuid_re.match(s.outputs[0]) and uuid_re.match(s.meta["query_keys"][0])
    assert _context(s).count("One of the special magic uuids for") > 8  # a haystack of needles
    s = build("niah_multikey_1", tok, 1024, 0)
    assert len(s.meta["keys"]) == 4 and len(s.outputs) == 1  # 3 distractor keys
    s = build("niah_multivalue", tok, 1024, 0)
    assert len(s.outputs) == 4 and len(s.meta["keys"]) == 1
    assert s.input.startswith("Some special magic numbers are hidden") and s.answer_prefix.endswith(" are")
    s = build("niah_multiquery", tok, 1024, 0)
    assert len(s.outputs) == 4 and len(s.meta["query_keys"]) == 4 and ", and " in s.answer_prefix


def _vt_assignments(text):
    vals = {}
    for name, ref, num in re.findall(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))", text):
        vals[name] = num if num else vals[ref]
    return vals


def test_vt_references_recomputed(tok):
    for index in range(2):
        s = build("vt", tok, 1024, index, seed=1)
        _decoded(tok, s)
        main = s.input[s.input.rindex("Memorize and track"):]
        example = s.input[:s.input.rindex("Memorize and track")]
        value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
        vals = _vt_assignments(main)
        assert sorted(n for n, v in vals.items() if v == value) == sorted(s.outputs)
        assert len(s.outputs) == 5 and all(len(v) == 5 for v in s.outputs)
        assert f"5 variables are assgined the value {value}" in s.answer_prefix
        # RULER's in-context example, with its answer
        ex_vals = _vt_assignments(example)
        ex_value = s.meta["example_value"]
        ex_ans = [n for n, v in ex_vals.items() if v == ex_value]
        assert sorted(ex_ans) == sorted(s.meta["example_outputs"]) and example.rstrip().endswith(" ".join(s.meta["example_outputs"]))


def _cwe_main_list(s):
    main = s.input[s.input.rindex("Below is a numbered list"):]
    body = main[main.index("most often.\n") + len("most often.\n"):main.rindex("\nQuestion:")]
    entries = re.findall(r"(\d+)\. (\S+)", body)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    return [w for _, w in entries]


@pytest.mark.parametrize("length,reps", [(1024, (6, 1)), (4096, (30, 3))])
def test_cwe_references_recomputed(tok, length, reps):
    s = build("cwe", tok, length, 0, seed=2)
    _check_size(s, length)
    _decoded(tok, s)
    counts = Counter(_cwe_main_list(s))
    top = counts.most_common()
    assert {w for w, _ in top[:10]} == set(s.outputs)
    assert top[9][1] == reps[0] and top[10][1] == reps[1]
    assert s.input.count("Question: What are the 10 most common words in the above list?") == 2  # + the example


def test_fwe_references_recomputed(tok):
    for length in (1024, 4096):
        s = build("fwe", tok, length, 0, seed=5)
        _check_size(s, length)
        _decoded(tok, s)
        body = s.input[s.input.index("coded words. ") + len("coded words. "):s.input.rindex("\nQuestion:")]
        counts = Counter(w for w in body.split() if w != "...")
        top = counts.most_common(4)
        assert [w for w, _ in top[:3]] == s.outputs and top[2][1] > top[3][1]
        assert Counter(body.split()).most_common(1)[0][0] == "..."  # RULER's noise word is the most frequent


def test_determinism(tok):
    for task in ("niah_multikey_2", "niah_multiquery", "vt", "cwe", "fwe"):
        a, b = build(task, tok, 1024, 1, seed=7), build(task, tok, 1024, 1, seed=7)
        assert a.token_ids == b.token_ids and a.outputs == b.outputs
        assert build(task, tok, 1024, 1, seed=8).token_ids != a.token_ids
        assert build(task, tok, 1024, 2, seed=7).token_ids != a.token_ids
    ss = build_samples(tok, ["niah_single_1", "vt"], [1024], 2, seed=0)
    assert [(s.task, s.index) for s in ss] == [("niah_single_1", 0), ("niah_single_1", 1), ("vt", 0), ("vt", 1)]
    assert [s.depth for s in ss[:2]] == [0.5, 0.0]


def test_build_errors(tok):
    with pytest.raises(ValueError, match="unknown task 'qa_9'.*niah_single_1"):
        build("qa_9", tok, 1024)
    with pytest.raises(ValueError, match="niah_single_2 at length 150"):
        build("niah_single_2", tok, 150)
    with pytest.raises(ValueError, match="sample_index"):
        build("vt", tok, 1024, -1)
    with pytest.raises(ValueError, match="samples"):
        build_samples(tok, ["vt"], [1024], 0)


def test_haystacks():
    e1, e2 = hs.Essay(0), hs.Essay(0)
    assert e1.text(500) == e2.text(500) and hs.Essay(1).text(50) != e1.text(50)
    assert len(e1.text(321).split()) == 321 and e1.text(800).startswith(e1.text(321))
    words = set(re.findall(r"[a-z]+", hs.Essay(3).text(20000).lower()))
    assert len(words) > 1500  # varied, not a repeated paragraph
    assert len(hs.word_pool()) > 2000 and len(hs.NOUNS) > 1000
    segs = hs.noise_segments(10)
    assert "".join(segs).startswith(hs.NOISE + "\n") and len(segs) == 10
    assert hs.plural("city") == "cities" and hs.plural("box") == "boxes" and hs.plural("key") == "keys"
    assert hs.third_person("carry") == "carries" and hs.third_person("watch") == "watches"
    assert hs.article("owl") == "an" and hs.article("unit") == "a" and hs.article("hour") == "an"
    segs = ["a. ", "b. ", "c. ", "d. "]
    assert hs.compose(segs, [(0.5, "N.")]) == "a. b. N. c. d."
    assert hs.compose(segs, [(0.0, "N.")]).startswith("N. a.") and hs.compose(segs, [(1.0, "N.")]).endswith("d. N.")
    assert hs.compose(["x\n", "y\n"], [(0.5, "N")]) == "x\nN\ny"
    with pytest.raises(ValueError, match="depth"):
        hs.boundary_at(segs, 1.5)
