"""RULER's real data (``../shared/ruler_data`` beside the repo: 4K and 8K, made by RULER for the
SmolLM2 tokenizer) as ``xoffload eval --data`` runs it: the raw prompt (input + answer_prefix, no
template) has exactly RULER's token count, every sample of both halves fits max_model_len 8192 with
RULER's answer lengths, and the command runs a whole 8K file through a stand-in engine, skipping and
counting what does not fit instead of stopping. Skipped when the data is absent.

One real-model run of a 4K sample is gated by ``XOFFLOAD_SLOW=1`` (a 4K prefill takes ~3-4 min of
CPU here)."""
import argparse
import glob
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from xoffload.evals.cli import add_eval_parser
from xoffload.evals.ruler_data import load_ruler_data, split_fitting, tokenize_samples

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "ruler_data"
needs_data = pytest.mark.skipif(not (DATA / "8192").is_dir(), reason=f"RULER data not found at {DATA}")
# RULER's tokens_to_generate (scripts/data/synthetic/constants.py)
RULER_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}


def _files(length):
    return sorted(glob.glob(str(DATA / str(length) / "*.jsonl")))


@needs_data
@pytest.mark.parametrize("length", [4096, 8192])
def test_every_sample_has_rulers_count_and_fits(tok, length):
    files = _files(length)
    assert len(files) == 11
    ss = load_ruler_data(files, tok)
    assert len(ss) == 220 and all(s.length == length for s in ss)
    for s in ss:
        assert s.max_new_tokens == RULER_TOKENS[s.task.split("_")[0]], s.task
        # RULER: length = len(tokenize(input + answer_prefix)) + tokens_to_generate, no special tokens
        assert len(s.token_ids) + s.max_new_tokens == s.meta["ruler_length"], (s.meta["source"], s.meta["line"])
    kept, skipped = split_fitting(ss, 8192)
    assert skipped == [] and len(kept) == 220
    kept, skipped = split_fitting(ss, length)  # each half fits its own budget too
    assert skipped == []


@needs_data
def test_chat_template_would_push_8k_samples_over(tok):
    ss = load_ruler_data(str(DATA / "8192" / "cwe.jsonl"), tok)
    raw = {s.meta["line"]: len(s.token_ids) for s in ss}
    tokenize_samples(ss, tok, chat=True)
    assert all(len(s.token_ids) > raw[s.meta["line"]] for s in ss)
    _, skipped = split_fitting(ss, 8192)
    assert 5 in [k["line"] for k in skipped]  # 8080 tokens + 120 > 8192
    _, skipped = split_fitting(ss, 8192, max_new_tokens=48)
    assert skipped == []


class _StubLLM:
    """Stands in for the engine: answers every prompt with a fixed text, instantly."""

    def __init__(self, model, **kw):
        self.kw = kw

    def generate(self, ids, sp):
        assert len(ids) + sp.max_tokens <= self.kw["max_model_len"]
        return [SimpleNamespace(token_ids=[5, 2], text=" no idea", finish_reason="stop", timings={},
                                peak_gpu_memory_bytes=None)]

    def close(self):
        pass


@pytest.fixture
def stub_engine(monkeypatch, smol):
    import xoffload.engine.llm as engine_llm
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    monkeypatch.setattr(engine_llm, "LLM", _StubLLM)
    old = os.umask(0o022)
    yield
    os.umask(old)


def _eval(argv, capsys):
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["eval", "--device", "cpu", "--mode", "offload", "--no-progress", *argv])
    rc = a.func(a)
    return rc, capsys.readouterr()


@needs_data
def test_eval_runs_8k_data_skipping_what_does_not_fit(tmp_path, capsys, stub_engine):
    cwe, vt = str(DATA / "8192" / "cwe.jsonl"), str(DATA / "8192" / "vt.jsonl")
    out = tmp_path / "raw"
    rc, cap = _eval(["--data", f"{cwe},{vt}", "--out", str(out)], capsys)
    assert rc == 0, cap.err
    d = json.loads((out / "ruler.json").read_text())
    assert len(d["records"]) == 40 and d["meta"]["num_skipped"] == 0 and d["meta"]["skipped"] == []
    assert d["meta"]["data_prompt"] == "raw" and d["meta"]["data_special_tokens"] == []
    for r in d["records"]:
        assert r["prompt_tokens"] + r["max_new_tokens"] <= 8192 and r["max_new_tokens"] in (120, 30)
    assert d["lengths"] == [8192] and set(d["tasks"]) == {"cwe", "vt"}
    last = cap.out.strip().splitlines()[-1]
    assert last.startswith("eval: 40 records (40 prompts, 1 mode(s)) on cpu: ") and " s in all (model load " in last
    for name in ("ruler.json", "ruler.png"):  # as `xoffload needle` writes its files: 0644 under umask 022
        assert (out / name).stat().st_mode & 0o777 == 0o644, name

    # in the chat template some prompts no longer fit: they are skipped and counted, the rest run
    out = tmp_path / "chat"
    rc, cap = _eval(["--data", f"{cwe},{vt}", "--chat-template", "--out", str(out)], capsys)
    assert rc == 0, cap.err
    d = json.loads((out / "ruler.json").read_text())
    sk = d["meta"]["skipped"]
    assert d["meta"]["data_prompt"] == "chat" and d["meta"]["num_skipped"] == len(sk) > 0
    assert len(d["records"]) == 40 - len(sk) and (cwe, 5) in [(k["source"], k["line"]) for k in sk]
    assert f"skipped {len(sk)} --data sample(s) that do not fit max_model_len 8192" in cap.out
    assert f"note: skipped {cwe}:5: prompt of 8080 tokens + 120 new tokens is above max_model_len 8192" in cap.err
    assert f", {len(sk)} skipped) on cpu" in cap.out.strip().splitlines()[-1]

    # the fit check uses the answer cap: with --max-new-tokens 48 cwe line 5 runs
    rc, cap = _eval(["--data", cwe, "--chat-template", "--max-new-tokens", "48", "--out", str(tmp_path / "c48")],
                    capsys)
    d = json.loads((tmp_path / "c48" / "ruler.json").read_text())
    assert rc == 0 and d["meta"]["num_skipped"] == 0 and len(d["records"]) == 20
    assert all(r["max_new_tokens"] == 48 for r in d["records"])


@pytest.mark.slow
@needs_data
@pytest.mark.skipif(not os.environ.get("XOFFLOAD_SLOW"), reason="set XOFFLOAD_SLOW=1: a 4K prefill takes minutes on CPU")
def test_eval_4k_sample_real_model_cpu(tmp_path, capsys, monkeypatch, smol):
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    f = tmp_path / "4096" / "vt.jsonl"
    f.parent.mkdir()
    with open(DATA / "4096" / "vt.jsonl", encoding="utf-8") as src:
        line = src.readline()
    f.write_text(line, encoding="utf-8")
    rc, cap = _eval(["--mode", "resident", "--data", str(f), "--max-new-tokens", "8", "--out", str(tmp_path / "o")],
                    capsys)
    assert rc == 0, cap.err
    d = json.loads((tmp_path / "o" / "ruler.json").read_text())
    (r,) = d["records"]
    assert r["task"] == "vt" and r["length"] == 4096 and r["prompt_tokens"] == json.loads(line)["length"] - 30 and r["generated_ids"]
    assert 0.0 <= r["score"] <= 100.0 and cap.out.strip().splitlines()[-1].startswith("eval: 1 records")
