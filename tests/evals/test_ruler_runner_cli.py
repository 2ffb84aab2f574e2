"""run_eval with stand-in LLMs (tables, agreement, JSON written atomically and only after every run,
PNG), and ``xoffload eval``'s argument errors: exit 2, one line, no JSON, model not loaded first."""
import argparse
import json
import os
from types import SimpleNamespace

import pytest

from xoffload.evals.cli import add_eval_parser, cmd_eval
from xoffload.evals.partial import PARTIAL_NAME, read_partial
from xoffload.evals.runner import JSON_NAME, PNG_NAME, run_eval
from xoffload.evals.tasks import build_samples


class FakeLLM:
    """Answers every prompt with its references (``wrong``: sample numbers answered with "no idea")."""

    def __init__(self, answers, wrong=(), fail_at=None):
        self.answers, self.wrong, self.fail_at, self.n, self.closed = answers, set(wrong), fail_at, 0, False

    def generate(self, ids, sp):
        k = self.n
        self.n += 1
        if k == self.fail_at:
            raise RuntimeError("boom")
        assert sp.temperature == 0.0 and sp.max_tokens >= 1
        text = "no idea" if k in self.wrong else " " + ", ".join(self.answers[tuple(ids)])
        return [SimpleNamespace(token_ids=[len(text), 2], text=text, finish_reason="stop",
                                timings={"prefill_tok_per_s": 1.0}, peak_gpu_memory_bytes=None)]

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def small_samples(tok):
    return build_samples(tok, ["niah_single_1", "vt", "fwe"], [768, 1024], 1, seed=0)


def test_run_eval_tables_agreement_json_png(tmp_path, tok, small_samples):
    answers = {tuple(s.token_ids): s.outputs for s in small_samples}
    made = {}

    def factory(mode):  # called once per (length, mode): one FakeLLM per mode, counting its calls
        if mode not in made:
            made[mode] = FakeLLM(answers, wrong={1} if mode == "offload" else ())
        return made[mode]

    res = run_eval(factory, tok, tasks=["niah_single_1", "vt", "fwe"], lengths=[1024, 768], samples=1,
                   modes=["gpu", "offload"], seed=0, out_dir=str(tmp_path), progress=False,
                   meta={"model": "fake", "device": "cpu", "dtype": "torch.float32"})
    assert all(m.closed for m in made.values()), "LLMs made by the factory are closed"
    assert res.modes == ["gpu", "offload"] and res.lengths == [768, 1024] and res.tasks == ["niah_single_1", "vt", "fwe"]
    assert res.table["gpu"] == {t: {"768": 100.0, "1024": 100.0} for t in res.tasks}
    # runs go length by length: the second offload prompt is vt at 768, answered wrong
    assert res.table["offload"]["vt"] == {"768": 0.0, "1024": 100.0}
    assert res.average["gpu"] == 100.0 and res.average["offload"] == pytest.approx(500 / 6)
    assert res.average_by_length["offload"]["768"] == pytest.approx(200 / 3)
    a = res.agreement["offload"]
    assert (a["token_identical"], a["same_score"], a["total"]) == (5, 5, 6) and "gpu" not in res.agreement
    assert a["differing"] == [{"task": "vt", "length": 768, "index": 0, "first_diff": 0}]
    rec = [r for r in res.records if r["mode"] == "offload"]
    assert [r["same_tokens"] for r in rec] == [True, False, True, True, True, True]
    assert [r["first_diff"] for r in rec] == [None, 0, None, None, None, None]
    assert [(r["mode"], r["length"]) for r in res.records] == \
        [("gpu", 768)] * 3 + [("offload", 768)] * 3 + [("gpu", 1024)] * 3 + [("offload", 1024)] * 3
    # the prompts were built by run_eval itself (same seed -> same prompts as small_samples)
    assert [r["prompt_tokens"] for r in rec] == [len(s.token_ids) for s in
                                                sorted(small_samples, key=lambda s: (s.length, ["niah_single_1", "vt", "fwe"].index(s.task)))]
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert set(data) >= {"meta", "table", "average", "agreement", "records"} and len(data["records"]) == 12
    assert data["meta"]["seed"] == 0 and data["meta"]["date"] and data["meta"]["wall_s_by_mode"].keys() == {"gpu", "offload"}
    assert (tmp_path / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == [JSON_NAME, PNG_NAME], "no temporary files left"
    text = res.format_table()
    assert "mode=offload" in text and "token-identical answers 5/6" in text and "niah_single_1" in text
    assert "fake" in res.title() and "float32" in res.title()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_permissions_of_a_plain_open(tmp_path, tok, small_samples, umask):
    """ruler.json and ruler.png come out as `xoffload needle`'s needle.json (written with open()):
    0o666 less the umask, not the 0600 of a temporary file."""
    answers = {tuple(s.token_ids): s.outputs for s in small_samples[:1]}
    old = os.umask(umask)
    try:
        with open(tmp_path / "plain.json", "w") as f:
            f.write("{}")
        run_eval({"gpu": FakeLLM(answers)}, tok, tasks=None, data=small_samples[:1], out_dir=str(tmp_path / "o"),
                 progress=False)
    finally:
        os.umask(old)
    want = (tmp_path / "plain.json").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    for name in (JSON_NAME, PNG_NAME):
        assert (tmp_path / "o" / name).stat().st_mode & 0o777 == want, name


def test_run_eval_failure_writes_no_json(tmp_path, tok, small_samples):
    answers = {tuple(s.token_ids): s.outputs for s in small_samples}
    llms = {"gpu": FakeLLM(answers), "offload": FakeLLM(answers, fail_at=2)}  # a dict: used, not closed
    with pytest.raises(RuntimeError, match="boom"):
        run_eval(llms, tok, tasks=None, data=small_samples, out_dir=str(tmp_path), progress=False)
    assert not llms["gpu"].closed
    # no result: only the partial file, which says what it is; it holds the 5 records that finished
    # (gpu's three at 768, then offload's first two before its third call failed)
    assert os.listdir(tmp_path) == [PARTIAL_NAME]
    header, recs, _ = read_partial(str(tmp_path / PARTIAL_NAME))
    assert header["kind"] == "xoffload-eval-partial" and "NOT a result" in header["note"]
    assert [(r["mode"], r["length"]) for r in recs] == [("gpu", 768)] * 3 + [("offload", 768)] * 2
    with pytest.raises(ValueError, match="no LLM given"):
        run_eval(llms, tok, tasks=["vt"], lengths=[768], modes=["gpu", "resident"], progress=False)
    with pytest.raises(ValueError, match="nothing to run"):
        run_eval(llms, tok, tasks=None, progress=False)


def _parser():
    p = argparse.ArgumentParser(prog="xoffload")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_eval_parser(sub)
    return p


def _run(argv, capsys):
    a = _parser().parse_args(["eval", *argv])
    rc = a.func(a)
    return rc, capsys.readouterr()


def test_every_option_has_help():
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["eval"]
    opts = [a for a in sub._actions if a.option_strings and "-h" not in a.option_strings]
    assert len(opts) >= 18 and all(a.help for a in opts), [a.dest for a in opts if not a.help]
    assert sub.get_default("func") is cmd_eval


@pytest.fixture
def no_model(monkeypatch):
    import xoffload.models as models

    def boom(*a, **k):
        raise AssertionError("the model must not be loaded before the arguments are checked")

    monkeypatch.setattr(models, "load_model", boom, raising=False)


@pytest.mark.parametrize("argv,what", [
    (["--tasks", "niah_single_1,bogus"], "unknown task 'bogus'; known tasks: all, niah, niah_single_1"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--mode", "gpu,turbo"], "unknown --mode 'turbo'"),
    (["--lengths", "4k,lots"], "--lengths: bad length 'lots'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--mode", "offload+quest@"], "@BUDGET needs a decode-policy mode and a positive integer"),
    (["--mode", "offload@"], "@BUDGET needs a decode-policy mode and a positive integer"),
    (["--mode", "offload+quest@\u00b2"], "@BUDGET needs a decode-policy mode and a positive integer"),
    (["--modes", "resident,hf2"], "unknown --mode 'hf2'; known: both, gpu, offload"),
    (["--modes", "resident,hf", "--hf-samples", "0"], "--hf-samples must be >= 1"),
    (["--modes", "offload-ring"], "unknown --mode 'offload-ring'; known: both, gpu, offload, offload-uva,"),
    (["--kv-block-size", "0"], "--kv-block-size must be >= 1, got 0"),
])
def test_bad_arguments_exit_2_before_loading(tmp_path, capsys, no_model, argv, what):
    out = tmp_path / "o"
    rc, cap = _run([*argv, "--device", "cpu", "--out", str(out)], capsys)
    assert rc == 2, cap
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xoffload eval: error: ") and what in lines[0], cap.err
    assert not out.exists()


def test_out_is_a_file_exit_2_before_loading(tmp_path, capsys, no_model):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, cap = _run(["--device", "cpu", "--out", str(f)], capsys)
    assert rc == 2 and cap.err.count("\n") == 1 and "--out" in cap.err and "not a folder" in cap.err, cap.err
    assert f.read_text() == "x"


def test_malformed_data_exit_2_before_loading(tmp_path, capsys, no_model):
    f = tmp_path / "qa_1.jsonl"
    f.write_text(json.dumps({"input": "q", "outputs": ["a"], "length": 9}) + "\n{oops\n")
    rc, cap = _run(["--data", str(f), "--device", "cpu", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and cap.err.count("\n") == 1 and f"{f}:2: not valid JSON" in cap.err
    rc, cap = _run(["--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "not found" in cap.err and not (tmp_path / "o").exists()


@pytest.fixture
def shared_model(monkeypatch, smol):
    """Serve the already loaded SmolLM2 to ``xoffload eval`` (loading is tested elsewhere)."""
    import xoffload.models as models

    def fake_load(model=None, **kw):
        assert model in (None, "smollm2")
        return smol

    monkeypatch.setattr(models, "load_model", fake_load, raising=False)
    return smol


def test_length_above_max_model_len_exit_2(tmp_path, capsys, shared_model):
    rc, cap = _run(["--lengths", "4k,16k", "--device", "cpu", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "length 16384 is above max_model_len 8192" in cap.err and cap.err.count("\n") == 1
    rc, cap = _run(["--lengths", "1024", "--max-model-len", "512", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "above max_model_len 512" in cap.err
    rc, cap = _run(["--tasks", "vt", "--lengths", "100", "--out", str(tmp_path / "o")], capsys)  # too short
    assert rc == 2 and "vt at length 100" in cap.err and cap.err.count("\n") == 1
    f = tmp_path / "vt.jsonl"
    f.write_text(json.dumps({"input": "word " * 600, "outputs": ["a"], "length": 9}) + "\n")
    rc, cap = _run(["--data", str(f), "--max-model-len", "300", "--out", str(tmp_path / "o")], capsys)
    # the one sample does not fit: skipped (a note), and with nothing left to run, exit 2 naming it
    err = cap.err.strip().splitlines()
    assert rc == 2 and len(err) == 2 and err[0].startswith(f"note: skipped {f}:1: prompt of ")
    assert err[1].startswith("xoffload eval: error: none of the 1 --data samples fits max_model_len 300 ")
    assert f"{f}:1: " in err[1]
    assert not (tmp_path / "o").exists()


def test_mode_group_score_suffix():
    """``NAME@BUDGET/GROUP`` sets the decode policy's budget and GQA group score; bad ones are
    one-line errors naming the mode."""
    from xoffload.evals.cli import mode_options
    from xoffload.sparse import QuestDecode

    kw = mode_options("offload+quest@512/softmax")
    assert kw["mode"] == "offload" and kw["sparse_decode"] == QuestDecode(token_budget=512, group_score="softmax")
    assert "token_budget" not in kw
    for bad, msg in (("offload+quest@512/bad", "group_score"), ("offload@512/softmax", "@BUDGET")):
        with pytest.raises(ValueError, match=msg):
            mode_options(bad)


def test_mode_dense_layers_suffix():
    """``NAME@BUDGET/dense=I.J.K`` (alone or with /GROUP) sets the decode policy's dense layers; a
    bad list is a one-line error naming it."""
    from xoffload.evals.cli import mode_options
    from xoffload.sparse import QuestDecode

    kw = mode_options("resident+quest@512/dense=0.1.18")
    assert kw["sparse_decode"] == QuestDecode(token_budget=512, dense_layers=(0, 1, 18))
    kw = mode_options("offload+quest@256/softmax/dense=0.7")
    assert kw["sparse_decode"] == QuestDecode(token_budget=256, group_score="softmax", dense_layers=(0, 7))
    assert mode_options("resident+quest@512/dense=")["sparse_decode"].dense_layers == ()
    kw = mode_options("offload+quest@512/ch=8/alpha=0.25/page=16/dense=0.1")
    assert kw["sparse_decode"] == QuestDecode(token_budget=512, exact_channels=8, bound_scale=0.25, page_size=16,
                                              dense_layers=(0, 1))
    assert mode_options("offload+quest-ch@512/reuse=2")["sparse_decode"].reuse_bias == 2.0
    assert mode_options("offload+quest-ch@512/cache=32/reuse=2")["sparse_decode"].cache_pages == 32
    for bad, msg in (("offload+quest@512/ch=x", "/ch= takes an integer"), ("offload+quest@512/alpha=2", "bound_scale"),
                     ("offload+quest@512/reuse=0.5", "reuse_bias"), ("offload+quest@512/softmax/reuse=2", "group_score"),
                     ("offload+quest@512/page=24", "power of two"), ("offload@512/ch=8", "decode-policy")):
        with pytest.raises(ValueError, match=msg):
            mode_options(bad)
    for bad, msg in (("resident+quest@512/dense=1,2", "joined by '.'"), ("resident+quest@512/dense=a.1", "dense=a.1"),
                     ("resident+quest@512/dense=-1", "joined by '.'")):
        with pytest.raises(ValueError, match=msg):
            mode_options(bad)


def test_mode_policy_suffixes_strict():
    """Found by adversarial testing: a repeated suffix silently took the last value
    (``/ch=8/ch=4``: 4), ``int()`` / ``float()`` took ``1_0``, `` 8`` and non-ASCII digits, an
    unknown ``/key=`` was reported as a bad group score, and a page of 512 with channels failed
    only at the first decode step. Each is now a one-line error naming it, as is ``/alpha=``
    without exact channels; ``/ch=`` on the named policy quest-ch asks for exactly that many
    channels (no fitting to the model)."""
    from xoffload.evals.cli import mode_options
    from xoffload.sparse import QuestDecode

    for bad, msg in (("offload+quest@512/ch=8/ch=4", "/ch= given twice"),
                     ("offload+quest@512/softmax/max", "/GROUP given twice"),
                     ("offload+quest@512/dense=0/dense=1", "/dense= given twice"),
                     ("offload+quest@512/ch=1_0", "takes an integer, got '1_0'"),
                     ("offload+quest@512/ch= 8", "takes an integer"),
                     ("offload+quest@512/ch=\u0668", "takes an integer"),
                     ("offload+quest@512/ch=-1", "takes an integer"),
                     ("offload+quest@512/page=0x10", "takes an integer"),
                     ("offload+quest@512/alpha=nan", "/alpha= takes a number, got 'nan'"),
                     ("offload+quest@512/alpha=1_0", "takes a number"),
                     ("offload+quest@512/alpha=-0.5", "takes a number"),
                     ("offload+quest@512/alpha=1e400", "bound_scale"),
                     ("offload+quest@512/foo=1", "unknown /foo="),
                     ("offload+quest@512/page=512/ch=8", "page_size <= 256"),
                     ("offload+quest-ch/ch=4", r"\[/ch=R\]"),
                     ("offload+quest@512/alpha=.5", r"bound_scale=0.5 .* needs exact_channels > 0")):
        with pytest.raises(ValueError, match=msg):
            mode_options(bad)
    assert mode_options("offload+quest@512/ch=0")["sparse_decode"].exact_channels == 0
    assert mode_options("offload+quest@512/ch=8/alpha=.5")["sparse_decode"].bound_scale == 0.5
    assert mode_options("resident+quest@64/alpha=1e-1/page=16/ch=8/dense=")["sparse_decode"] == QuestDecode(
        token_budget=64, bound_scale=0.1, page_size=16, exact_channels=8, dense_layers=())
    assert mode_options("offload+quest-ch@512") == {"mode": "offload", "sparse_decode": "quest-ch", "token_budget": 512}
    kw = mode_options("offload+quest-ch@512/alpha=0.5")["sparse_decode"]
    assert kw.fit_channels and kw.exact_channels == 16 and kw.bound_scale == 0.5
    kw = mode_options("offload+quest-ch@512/ch=4")["sparse_decode"]
    assert not kw.fit_channels and kw.exact_channels == 4 and kw.bound_scale == 0.25
