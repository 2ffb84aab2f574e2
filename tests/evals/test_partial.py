"""ruler.partial.jsonl (xoffload.evals.partial): records reach the file as they finish, a cut run
keeps them, ``resume`` runs only the rest and gives the result an uncut run gives; a file of another
setup is a one-line error; RULER's per-task answer budgets reach every generate call. Stand-in LLMs
(no model runs): under a second."""
import argparse
import json
import os
from types import SimpleNamespace

import pytest

from xoffload.evals.cli import add_eval_parser
from xoffload.evals.partial import HEADER_KIND, PARTIAL_NAME, read_partial
from xoffload.evals.runner import JSON_NAME, PNG_NAME, run_eval
from xoffload.evals.tasks import MAX_NEW_TOKENS, TASKS, build_samples

TASKS3 = ["niah_single_1", "vt", "fwe"]
LENGTHS = [768, 1024]


class Killed(BaseException):
    """Stands for the process being killed by a time limit (not an Exception: nothing catches it)."""


class Recorder:
    """Stand-in LLM: answers with the references; counts calls in ``calls`` (shared by every LLM of a
    run); raises :class:`Killed` at call number ``kill_at``; ``seen`` collects (mode, task,
    max_tokens) and the partial file's record count at each call."""

    def __init__(self, mode, answers, calls, kill_at=None, partial=None, seen=None):
        self.mode, self.answers, self.calls, self.kill_at = mode, answers, calls, kill_at
        self.partial, self.seen = partial, seen if seen is not None else []

    def generate(self, ids, sp):
        n = self.calls[0]
        if n == self.kill_at:
            raise Killed()
        self.calls[0] += 1
        on_disk = None
        if self.partial is not None and os.path.exists(self.partial):
            on_disk = len(read_partial(self.partial)[1])
        task, refs = self.answers[tuple(ids)]
        self.seen.append((self.mode, task, sp.max_tokens, on_disk))
        text = " " + ", ".join(refs) if self.mode != "b" or task != "vt" else " nothing"
        return [SimpleNamespace(token_ids=[len(text), 2], text=text, finish_reason="stop", timings={},
                                peak_gpu_memory_bytes=None)]

    def close(self):
        pass


@pytest.fixture(scope="module")
def answers(tok):
    return {tuple(s.token_ids): (s.task, s.outputs) for s in build_samples(tok, TASKS3, LENGTHS, 2, seed=0)}


def _run(tok, out, answers, calls, *, kill_at=None, resume=False, seed=0, seen=None, modes=("a", "b"),
         mode_configs=None):
    part = os.path.join(out, PARTIAL_NAME)
    return run_eval(lambda m: Recorder(m, answers, calls, kill_at, part, seen), tok, tasks=TASKS3, lengths=LENGTHS,
                    samples=2, modes=list(modes), seed=seed, out_dir=out, progress=False, resume=resume,
                    meta={"model": "/x/fake.gguf", "dtype": "torch.float32", "device": "cpu"},
                    mode_configs=mode_configs)


def _comparable(res):
    keep = ("mode", "task", "length", "index", "sample", "prediction", "score", "generated_ids", "same_tokens",
            "first_diff", "prompt_sha1", "max_new_tokens")
    return [{k: r.get(k) for k in keep} for r in res.records], res.table, res.agreement


def test_records_on_disk_as_they_finish_cut_and_resume(tmp_path, tok, answers):
    total = len(TASKS3) * len(LENGTHS) * 2 * 2  # tasks x lengths x samples x modes = 24
    full = _run(tok, str(tmp_path / "full"), answers, [0])
    assert sorted(os.listdir(tmp_path / "full")) == [JSON_NAME, PNG_NAME], "partial file removed on success"

    out = str(tmp_path / "cut")
    seen = []
    with pytest.raises(Killed):
        _run(tok, out, answers, [0], kill_at=9, seen=seen)
    # every record was on disk before the next prompt started
    assert [s[3] for s in seen] == [None] + list(range(1, 9))
    # the order: at 768 mode a's prompts task by task, then mode b's; 1024 after both
    assert [(m, t) for m, t, _, _ in seen[:7]] == [("a", t) for t in TASKS3 for _ in (0, 1)] + [("b", TASKS3[0])]
    assert sorted(os.listdir(out)) == [PARTIAL_NAME], "a cut run leaves no ruler.json"
    header, recs, _ = read_partial(os.path.join(out, PARTIAL_NAME))
    assert header["kind"] == HEADER_KIND and "NOT a result" in header["note"] and len(recs) == 9
    assert header["setup"]["seed"] == 0 and header["setup"]["model"] == "fake.gguf"

    # a torn last line (killed while writing) is dropped, not an error
    with open(os.path.join(out, PARTIAL_NAME), "a") as f:
        f.write('{"mode": "a", "task": "vt", "len')
    calls = [0]
    res = _run(tok, out, answers, calls, resume=True)
    assert calls[0] == total - 9, "only the records not on disk ran"
    assert res.meta["records_reused"] == 9 and res.meta["resumed_from"] == PARTIAL_NAME
    assert _comparable(res) == _comparable(full)
    assert res.agreement["b"]["token_identical"] == 8 and len(res.agreement["b"]["differing"]) == 4
    assert sorted(os.listdir(out)) == [JSON_NAME, PNG_NAME]

    # resume once more: everything is in ruler.json, nothing runs
    calls = [0]
    again = _run(tok, out, answers, calls, resume=True)
    assert calls[0] == 0 and again.meta["resumed_from"] == JSON_NAME and _comparable(again) == _comparable(full)

    # without resume a run starts afresh
    calls = [0]
    _run(tok, out, answers, calls)
    assert calls[0] == total


def test_resume_reruns_a_mode_whose_meaning_changed(tmp_path, tok, answers):
    """Records carry what their mode meant (mode_config); a resume reuses a record only under the
    same meaning: after a library default changed under mode "b", its records run again, "a"'s are
    reused."""
    out = str(tmp_path / "o")
    cfg = {"a": "A1", "b": "B1"}
    with pytest.raises(Killed):
        _run(tok, out, answers, [0], kill_at=18, mode_configs=cfg)  # all of 768 (12) + 6 of a at 1024
    recs = read_partial(os.path.join(out, PARTIAL_NAME))[1]
    assert {r["mode"]: r["mode_config"] for r in recs} == cfg
    calls = [0]
    res = _run(tok, out, answers, calls, resume=True, mode_configs={"a": "A1", "b": "B2"})
    assert res.meta["records_reused"] == 12 and res.meta["records_stale"] == 6  # a's 12 kept, b's 6 rerun
    assert calls[0] == 24 - 12
    assert {r["mode_config"] for r in res.records if r["mode"] == "b"} == {"B2"}


def test_resume_other_setup_is_an_error(tmp_path, tok, answers):
    out = str(tmp_path / "o")
    with pytest.raises(Killed):
        _run(tok, out, answers, [0], kill_at=3)
    with pytest.raises(ValueError, match=r"different setup \(seed: 0 there, 1 here; prompts_sha1: "):
        _run(tok, out, answers, [0], resume=True, seed=1)
    p = os.path.join(out, PARTIAL_NAME)
    lines = open(p).read().splitlines()
    lines.insert(2, "{broken")
    open(p, "w").write("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{PARTIAL_NAME}:3: not a JSON object"):
        _run(tok, out, answers, [0], resume=True)
    with pytest.raises(ValueError, match="resume needs out_dir"):
        run_eval({"a": None}, tok, tasks=["vt"], lengths=[768], resume=True, progress=False)


def test_resume_a_file_of_an_older_version_that_recorded_num_kv_buffers(tmp_path, tok, answers):
    """A partial file whose setup still lists ``num_kv_buffers`` (an option that is gone) resumes
    (any value); another key that differs is still an error."""
    out = str(tmp_path / "o")
    with pytest.raises(Killed):
        _run(tok, out, answers, [0], kill_at=5)
    p = os.path.join(out, PARTIAL_NAME)
    lines = open(p).read().splitlines()
    header = json.loads(lines[0])
    assert "num_kv_buffers" not in header["setup"]
    for setup in ({**header["setup"], "seed": 7, "num_kv_buffers": 4}, {**header["setup"], "num_kv_buffers": 2}):
        open(p, "w").write("\n".join([json.dumps({**header, "setup": setup}), *lines[1:]]) + "\n")
        if setup["seed"] == 7:
            with pytest.raises(ValueError, match=r"different setup \(seed: 7 there, 0 here\)"):
                _run(tok, out, answers, [0], resume=True)
            continue
        calls = [0]
        res = _run(tok, out, answers, calls, resume=True)
        assert res.meta["records_reused"] == 5 and calls[0] == 24 - 5
        assert "num_kv_buffers" not in res.meta["setup"]


def test_resume_other_setup_cli_one_line(tmp_path, capsys, monkeypatch, smol):
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    out = tmp_path / "o"
    out.mkdir()
    (out / PARTIAL_NAME).write_text(json.dumps({"kind": HEADER_KIND, "setup": {"seed": 5}}) + "\n")
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["eval", "--device", "cpu", "--tasks", "vt", "--lengths", "1024", "--modes", "resident,hf",
                      "--out", str(out), "--resume", "--no-progress"])
    rc = a.func(a)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("xoffload eval: error: --resume: ")
    assert "different setup (" in err and "seed: 5 there, 0 here" in err
    assert sorted(os.listdir(out)) == [PARTIAL_NAME], "the other setup's file is left as it was"


def test_ruler_answer_budgets_reach_generate(tok, answers):
    # RULER's tokens_to_generate (its synthetic constants): niah 128, variable tracking 30,
    # common words 120, frequent words 50
    assert MAX_NEW_TOKENS == {**{t: 128 for t in TASKS if t.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50}
    seen = []
    run_eval(lambda m: Recorder(m, answers, [0], seen=seen), tok, tasks=TASKS3, lengths=[768], samples=1,
             modes=["a"], progress=False)
    assert {(t, mt) for _, t, mt, _ in seen} == {("niah_single_1", 128), ("vt", 30), ("fwe", 50)}
    seen.clear()
    res = run_eval(lambda m: Recorder(m, answers, [0], seen=seen), tok, tasks=TASKS3, lengths=[768], samples=1,
                   modes=["a"], progress=False, max_new_tokens=40)  # a cap only lowers a budget
    assert {(t, mt) for _, t, mt, _ in seen} == {("niah_single_1", 40), ("vt", 30), ("fwe", 40)}
    assert [r["max_new_tokens"] for r in res.records] == [40, 30, 40]


def test_samples_by_mode_runs_a_subset(tok, answers):
    seen = []
    res = run_eval(lambda m: Recorder(m, answers, [0], seen=seen), tok, tasks=["vt"], lengths=LENGTHS, samples=2,
                   modes=["a", "hf"], progress=False, samples_by_mode={"hf": 1})
    assert [m for m, *_ in seen].count("hf") == 2 and [m for m, *_ in seen].count("a") == 4
    assert res.peer == "hf" and res.peer_agreement["a"]["total"] == 2 and res.agreement["hf"]["total"] == 2
    with pytest.raises(ValueError, match="samples_by_mode"):
        run_eval({"a": None}, tok, tasks=["vt"], lengths=[768], progress=False, samples_by_mode={"a": 0})


def test_cli_interrupted_then_resumed(tmp_path, capsys, monkeypatch, smol):
    """``xoffload eval`` cut by SIGINT (``timeout -s INT``): exit 130, one line saying how many
    records are kept; the same command with ``--resume`` runs the rest."""
    import xoffload.engine.llm as llm_mod
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    calls = [0]

    class FakeEngineLLM:
        interrupt_at = 3

        def __init__(self, model, **kw):
            pass

        def generate(self, ids, sp):
            if calls[0] == FakeEngineLLM.interrupt_at:
                raise KeyboardInterrupt
            calls[0] += 1
            return [SimpleNamespace(token_ids=[1, 2], text=" x", finish_reason="stop", timings={},
                                    peak_gpu_memory_bytes=None)]

        def close(self):
            pass

    monkeypatch.setattr(llm_mod, "LLM", FakeEngineLLM)
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd"))
    out = tmp_path / "o"
    argv = ["eval", "--device", "cpu", "--tasks", "niah_single_1,vt", "--lengths", "768,1024", "--modes",
            "resident,offload", "--out", str(out), "--no-progress", "--resume"]
    a = p.parse_args(argv)
    assert a.func(a) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"xoffload eval: interrupted; 3 finished records kept in {out / PARTIAL_NAME} "
                   f"(run again with --resume to continue)"]
    FakeEngineLLM.interrupt_at = None
    calls[0] = 0
    a = p.parse_args(argv)
    assert a.func(a) == 0
    text = capsys.readouterr().out
    assert calls[0] == 8 - 3 and "resumed: 3 records reused from ruler.partial.jsonl" in text
    assert sorted(os.listdir(out)) == [JSON_NAME, PNG_NAME]
