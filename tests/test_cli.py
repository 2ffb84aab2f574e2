"""The ``xoffload`` command line: needle (table, JSON, PNG) and generate, on SmolLM2 (CPU)."""
import json
import os
import subprocess
import sys

import pytest

from xoffload import cli

from helpers import smollm2


@pytest.fixture
def shared_model(monkeypatch):
    """Serve the already loaded SmolLM2 to the CLI (loading is tested elsewhere; saves ~10 s per call)."""
    m = smollm2()
    import xoffload.models as models
    import xoffload.engine.llm_engine as llm_mod

    def fake_load(model=None, **kw):
        assert model is None or model == "smollm2"
        return m

    monkeypatch.setattr(models, "load_model", fake_load, raising=False)
    monkeypatch.setattr(llm_mod, "load_model", fake_load)
    return m


def test_needle_cli_writes_table_json_png(shared_model, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["needle", "--device", "cpu", "--lengths", "400", "--depths", "50", "--out", str(out),
                   "--kv-block-size", "128"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "mode=resident" in text and "mode=offload" in text and "accuracy" in text
    assert "answers identical in both modes: 1/1" in text
    data = json.loads((out / "needle.json").read_text())
    assert data["meta"]["lengths"] == [400] and data["meta"]["depths"] == [0.5]  # "50" read as a percentage
    assert len(data["records"]) == 2 and {r["mode"] for r in data["records"]} == {"resident", "offload"}
    for r in data["records"]:
        assert r["prompt_tokens"] <= 400 - 16 and r["prefill_tok_per_s"] > 0 and isinstance(r["found"], bool)
    assert set(data["summary"]) == {"resident", "offload"}
    png = (out / "needle.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_cli(shared_model, tmp_path, capsys):
    rc = cli.main(["generate", "--device", "cpu", "--prompt", "What is the capital of France?",
                   "--max-tokens", "12", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and "Paris" in res["text"] and res["timings"]["prefill_tok_per_s"] > 0
    f = tmp_path / "p.txt"
    f.write_text("Name a color.")
    rc = cli.main(["generate", "--device", "cpu", "--prompt-file", str(f), "--max-tokens", "4", "--mode", "gpu"])
    cap = capsys.readouterr()
    assert rc == 0 and cap.out.strip() and "prompt tokens" in cap.err


def test_cli_errors(tmp_path, capsys):
    rc = cli.main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi", "--device", "cpu"])
    assert rc == 2 and "not found" in capsys.readouterr().err
    rc = cli.main(["generate", "--model", "no-such-preset", "--prompt", "hi", "--device", "cpu"])
    assert rc == 2 and "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--device", "cpu"])  # neither --prompt nor --prompt-file
    with pytest.raises(SystemExit):
        cli.main(["needle", "--depths", "2,x"])
    with pytest.raises(SystemExit):
        cli.main(["bogus"])


def test_console_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "xoffload", "needle", "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(cli.__file__))})
    assert r.returncode == 0 and "--lengths" in r.stdout and "--mode" in r.stdout


# ---------------------------------------------------------------------------- user errors: one line, exit 2
@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI loads a model: argument errors must be caught before that."""
    import xoffload.models as models

    def fail(*a, **k):
        raise AssertionError("load_model called")

    monkeypatch.setattr(models, "load_model", fail)


def _run_error(argv, capsys):
    """main(argv) must end with exit status 2 and exactly one stderr line ``xoffload <cmd>: error: ...``."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2, (rc, cap.err)
    assert len(lines) == 1 and lines[0].startswith(f"xoffload {argv[0]}: error: "), cap.err
    assert "Traceback" not in cap.err + cap.out
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["--lengths", "0"], "lengths"), (["--lengths", "-5"], "lengths"), (["--lengths", "two"], "bad length"),
    (["--lengths", ","], "lengths"), (["--samples", "0"], "samples"), (["--samples", "x"], "samples"),
    (["--depths", "2,x"], "depths"), (["--depths", "150"], "depths"), (["--depths", "-0.5"], "depths"),
    (["--num-depths", "0"], "num-depths"), (["--max-tokens", "0"], "max-tokens"), (["--dtype", "bogus"], "dtype"),
    (["--device", "tpu"], "device"), (["--mode", "bogus"], "mode"), (["--min-accuracy", "2"], "min-accuracy"),
    (["--lengths", "4k", "--max-model-len", "2048"], "max-model-len"),
    (["--mode", "offload", "--offload-decode", "ring"], "invalid choice: 'ring'"),
    (["--mode", "resident", "--sparse-decode", "quest", "--kv-block-size", "16"], "page_size 32"),
    (["--mode", "offload", "--kv-block-size", "48"], "power of two"),
])
def test_needle_argument_errors_before_model_load(no_model_load, tmp_path, capsys, args, words):
    out = tmp_path / "res"
    line = _run_error(["needle", "--out", str(out), *args], capsys)
    assert words in line
    assert not out.exists()


@pytest.mark.parametrize("args, line_end", [
    (["--max-tokens", "-5"], "--max-tokens must be an int >= 1, got -5"),
    (["--max-tokens=-5"], "--max-tokens must be an int >= 1, got -5"),
    (["--max-tokens", "-1e3"], "--max-tokens must be an int >= 1, got -1e3"),
    (["--max-tokens", "0"], "--max-tokens must be an int >= 1, got 0"),
    (["--max-tokens", "2.5"], "--max-tokens must be an int >= 1, got 2.5"),
    (["--max-model-len", "-.5"], "--max-model-len must be an int >= 1, got -.5"),
    (["--temperature", "-1"], "--temperature must be a number >= 0, got -1"),
    (["--temperature", "nan"], "--temperature must be a number >= 0, got nan"),
    (["--temperature", "-inf"], "--temperature must be a number >= 0, got -inf"),
    (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0"),
    (["--top-p", "-0.5"], "--top-p must be a number in (0, 1], got -0.5"),
    (["--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
    (["--sparse", "xattn", "--sparse-threshold", "-1"], "--sparse-threshold must be a number in [0, 1], got -1"),
    (["--sparse-threshold", "0.5"], "--sparse-threshold 0.5 needs --sparse xattn"),
    (["--prompt-file", "p.txt"], "give exactly one of --prompt or --prompt-file"),
    (["--model", "tiny-llama"], "needs smollm2, a .gguf file or a HF model directory"),
])
def test_generate_argument_errors_name_the_range(no_model_load, capsys, args, line_end):
    """Out-of-range and negative numbers, and clashing options: one line naming the option, the
    allowed range and the value given (never argparse's "expected one argument"), before any load."""
    line = _run_error(["generate", "--prompt", "hi", *args], capsys)
    assert line.endswith(line_end), line
    assert "expected one argument" not in line


@pytest.mark.parametrize("args, line_end", [
    (["--samples", "-3"], "--samples must be an int >= 1, got -3"),
    (["--num-depths", "-1"], "--num-depths must be an int >= 1, got -1"),
    (["--lengths", "-5"], "--lengths must be token counts > 16 (e.g. 1k,2k), got -5"),
    (["--depths", "-0.5"], "--depths must be in [0, 1] (or percentages 0-100), got -0.5"),
    (["--min-accuracy", "-0.1"], "--min-accuracy must be a number in [0, 1], got -0.1"),
    (["--depths", "0.5", "--num-depths", "3"], "give --depths or --num-depths, not both"),
    (["--model", "tiny-llama"], "is a random-weight preset with no tokenizer; xoffload needle needs smollm2, "
                                "a .gguf file or a HF model directory"),
])
def test_needle_argument_errors_name_the_range(no_model_load, tmp_path, capsys, args, line_end):
    out = tmp_path / "res"
    line = _run_error(["needle", "--out", str(out), *args], capsys)
    assert line.endswith(line_end), line
    assert not out.exists()


def test_generate_engine_option_clash_before_model_load(no_model_load, capsys):
    line = _run_error(["generate", "--prompt", "hi", "--mode", "offload", "--kv-block-size", "16",
                       "--token-budget", "256"], capsys)
    assert "kv_block_size 16 must be a multiple of the decode policy's page_size 32" in line


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["needle"], ["serve", "smollm2"], ["eval"]])
def test_num_kv_buffers_is_no_option(no_model_load, capsys, cmd):
    """The offload ring's buffer count went with the ring: the flag is refused, nothing loads."""
    with pytest.raises(SystemExit) as e:
        cli.main([*cmd, "--num-kv-buffers", "4"])
    assert e.value.code == 2 and "unrecognized arguments: --num-kv-buffers 4" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_one_line(no_model_load, tmp_path, capsys):
    line = _run_error(["needle", "--device", "cuda", "--out", str(tmp_path / "res")], capsys)
    assert "not available" in line and "--device cpu" in line
    assert not (tmp_path / "res").exists()


def test_runtime_errors_one_line(tmp_path, capsys):
    out = tmp_path / "res"
    line = _run_error(["needle", "--model", str(tmp_path / "missing.gguf"), "--device", "cpu", "--out", str(out)], capsys)
    assert "not found" in line and not out.exists()
    line = _run_error(["needle", "--model", "tiny-llama", "--device", "cpu", "--lengths", "100", "--out", str(out)], capsys)
    assert "no tokenizer" in line and not out.exists()
    line = _run_error(["generate", "--model", "no-such-preset", "--prompt", "hi", "--device", "cpu"], capsys)
    assert "unknown model" in line
    _run_error(["generate", "--device", "cpu"], capsys)  # neither --prompt nor --prompt-file
    _run_error(["generate", "--device", "cpu", "--prompt", "  "], capsys)


def test_mode_gpu_alias_reported_as_resident(shared_model, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["needle", "--device", "cpu", "--lengths", "300", "--depths", "0.5", "--mode", "gpu",
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "mode=resident" in text and "mode=gpu" not in text and "answers identical" not in text
    assert "peak GPU memory" not in text and "process peak RSS" in text  # CPU: the RSS, labelled as such
    data = json.loads((out / "needle.json").read_text())
    assert data["meta"]["modes"] == ["resident"] and {r["mode"] for r in data["records"]} == {"resident"}
    assert "cells" in text.strip().splitlines()[-1] and "model load" in text.strip().splitlines()[-1]


def _subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_help_lists_only_accepted_models_and_every_option_has_help():
    """needle, generate and eval need the model's tokenizer: no help text offers a random-weight
    preset (which has none), and every option has a help line."""
    from xoffload.models.config import PRESETS

    parser = cli.build_parser()
    texts = {"xoffload": parser.format_help()}
    for name, sp in _subparsers(parser).items():
        for act in sp._actions:
            assert act.help, f"xoffload {name} {act.option_strings} has no help"
        texts[name] = sp.format_help()
    assert set(texts) == {"xoffload", "needle", "generate", "eval", "serve"}
    for name, text in texts.items():
        flat = " ".join(text.split())
        assert "smollm2" in flat and ".gguf" in flat, name
        for preset in PRESETS:
            assert preset not in flat and preset not in text.replace("\n", "").replace(" ", ""), (name, preset)
    for name in ("needle", "generate"):
        assert "tokenizer" in " ".join(texts[name].split())
    # each subcommand's --mode lists its own choices
    assert "both" in _subparsers(parser)["needle"].format_usage()
    assert "both" not in _subparsers(parser)["generate"].format_usage()


def test_offload_decodes_match_the_engine():
    from xoffload.engine.config import OFFLOAD_DECODES

    assert cli.OFFLOAD_DECODES == tuple(OFFLOAD_DECODES)


def test_kv_cache_options_match_the_engine():
    from xoffload.engine.config import KV_CACHE_DTYPES, KV_CACHE_SCALES

    assert cli.KV_CACHE_DTYPES == tuple(KV_CACHE_DTYPES) and cli.KV_CACHE_SCALES == tuple(KV_CACHE_SCALES)


def _cli_env():
    return {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(cli.__file__))}


@pytest.mark.parametrize("cmd", [[], ["needle"], ["generate"], ["eval"], ["serve"]])
def test_help_is_fast(cmd):
    """``--help`` of the command and of every subcommand: under 1 s (best of 3 runs: a loaded CI
    machine gets some slack), which rules out importing torch (~1-3 s)."""
    import time

    best = None
    for _ in range(3):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "xoffload", *cmd, "--help"], capture_output=True, text=True,
                           env=_cli_env())
        dt = time.perf_counter() - t
        assert r.returncode == 0 and "usage: xoffload" in r.stdout, r.stderr
        best = dt if best is None else min(best, dt)
    assert best < 1.0, f"xoffload {' '.join(cmd)} --help took {best:.2f} s"


def test_cli_import_and_parser_load_no_torch():
    code = ("import sys, xoffload.cli as c; c.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'transformers', "
            "'matplotlib', 'numpy', 'tqdm'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_cli_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_lazy_package_names_resolve():
    import xoffload

    for name in xoffload.__all__:
        assert getattr(xoffload, name) is not None
    from xoffload import LLM, SamplingParams  # noqa: F401
    with pytest.raises(AttributeError, match="no_such_name"):
        xoffload.no_such_name  # noqa: B018
    import xoffload.evals as ev

    for name in ev.__all__:
        assert getattr(ev, name) is not None


def test_table_prefill_column_separated(capsys):
    records = [{"mode": "resident", "length": L, "depth": 0.5, "found": True, "prefill_tok_per_s": v,
                "decode_ms_per_token": 1.0, "peak_gpu_memory_bytes": None, "token_ids": [1]}
               for L, v in ((1024, 51657.0), (2048, 120865.0))]
    rate, summary, _ = cli._summarize(records, ["resident"], [1024, 2048], [0.5])
    cli._print_mode_table("resident", records, summary, [1024, 2048], [0.5], 1)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("prefill"))
    assert "51,657 tok/s" in row and "120,865 tok/s" in row and "tok/s1" not in row
    assert "peak GPU memory" not in out and " - " not in out
    header = next(line for line in out.splitlines() if line.startswith("depth"))
    assert len(header) == len(row)  # fixed-width columns


def test_png_title_names_model_device_dtype_date(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    meta = {"model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "arch": "llama", "dtype": "torch.float32",
            "device": "cpu", "gpu": None, "date": "2026-12-01 09:00"}
    title = cli._figure_title(meta)
    assert title == "needle in a haystack: SmolLM2-135M-Instruct.Q4_1.gguf (llama), cpu, float32, 2026-12-01 09:00"
    seen = []
    orig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (seen.append(self._suptitle.get_text()),
                                                                   orig(self, *a, **k)))
    rate = {m: {(1024, 0.5): 1.0} for m in ("resident", "offload")}
    cli._heatmap(str(tmp_path / "n.png"), ["resident", "offload"], [1024], [0.5], rate, title)
    assert seen == [title] and (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"


def test_sparse_options_one_place():
    """The command line's sparse flags become policy objects in one place."""
    import argparse

    from xoffload.sparse import QuestDecode, XAttentionPrefill

    ns = lambda **kw: argparse.Namespace(**{**dict(sparse=None, sparse_threshold=0.9, sparse_decode=None,  # noqa: E731
                                                   token_budget=None, offload_decode="direct"), **kw})
    assert cli._sparse_options(ns()) == {"offload_decode": "direct"}
    assert cli._sparse_options(ns(sparse="xattn", sparse_threshold=0.8))["sparse"] == XAttentionPrefill(threshold=0.8)
    assert cli._sparse_options(ns(token_budget=512))["sparse_decode"] == QuestDecode(token_budget=512)
    assert cli._sparse_options(ns(sparse_decode="quest"))["sparse_decode"] == QuestDecode()
    assert cli._sparse_options(ns(offload_decode="uva"))["offload_decode"] == "uva"


def _text_overlaps(fig) -> list:
    """Pairs of visible labels (tick labels, axis labels, panel titles, the figure title) whose
    drawn bounding boxes intersect."""
    import itertools

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text() and t.get_visible()]
        texts += [t for t in (ax.xaxis.label, ax.yaxis.label, ax.title) if t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in texts]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


@pytest.mark.parametrize("modes, lengths, depths", [
    (["resident", "offload"], [1024], [0.5]),
    (["resident", "offload"], [1024, 2048], [0.0, 0.5, 1.0]),
    (["resident", "offload"], [1024, 2048, 4096, 8192], [i / 9 for i in range(10)]),
    (["resident", "offload"], [100000 * i for i in range(1, 7)], [0.5]),
    (["resident", "offload"], list(range(1000, 20000, 1000)), [i / 40 for i in range(41)]),
    (["offload"], [400], [0.5]),
])
def test_heatmap_labels_do_not_overlap(tmp_path, monkeypatch, modes, lengths, depths):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figs = []
    orig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self), orig(self, *a, **k)))
    rate = {m: {(L, d): 0.5 for L in lengths for d in depths} for m in modes}
    title = cli._figure_title({"model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "arch": "llama", "dtype": "torch.float32",
                               "device": "cpu", "gpu": None, "date": "2026-12-01 09:00"})
    cli._heatmap(str(tmp_path / "n.png"), modes, lengths, depths, rate, title, "xattn@0.9+quest-ch@2048")
    assert len(figs) == 1 and (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"
    assert _text_overlaps(figs[0]) == []
    shown = [t.get_text() for t in figs[0].axes[0].get_yticklabels() if t.get_text()]
    assert 1 <= len(shown) <= cli.MAX_TICK_LABELS


def test_needle_no_progress(shared_model, tmp_path, capsys):
    """The progress bar goes to stderr; --no-progress leaves it out (the table on stdout stays)."""
    args = ["needle", "--device", "cpu", "--lengths", "200", "--depths", "0.5", "--mode", "resident",
            "--kv-block-size", "128"]
    assert cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    cap = capsys.readouterr()
    assert "needle: 100%" in cap.err and "mode=resident" in cap.out
    assert cli.main([*args, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert "needle:" not in cap.err and "%|" not in cap.err and "mode=resident" in cap.out
