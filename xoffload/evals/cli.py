"""``xoffload eval``: RULER-style long-context evaluation on a real model, per KV mode.

Register it in ``xoffload/cli.py``'s ``build_parser`` with::

    from .evals.cli import add_eval_parser
    add_eval_parser(sub)

Every argument is checked before the model is loaded (tasks, ``--samples``, lengths, modes, the
``--data`` files line by line); the lengths against the model's context once its config is known.
A bad argument prints one line ``xoffload eval: error: ...`` to stderr and returns 2, with no JSON
written. Each finished record is appended to ``ruler.partial.jsonl`` at once; ``ruler.json`` is
written atomically after every run has finished, and the partial file is then removed. Every file
gets the same permissions as ``xoffload needle``'s (``0o666`` less the umask: 0644 under the usual
umask 022). The last line printed is the total time.

``--data`` runs RULER's own data as RULER does (:mod:`.ruler_data`): the prompt is ``input +
answer_prefix`` as written (RULER's template is in the data), unless ``--chat-template`` wraps it in
the model's; a sample whose prompt plus its effective answer length (RULER's per task, or
``--max-new-tokens`` when smaller) does not fit ``--max-model-len`` is skipped, listed on stdout and
in ``ruler.json``'s ``meta.skipped``, and the rest run.
``--resume`` continues a cut run from its partial file (same setup only); an interrupt (SIGINT,
e.g. ``timeout -s INT``) returns 130 with the finished records kept.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .modes import BOTH, _ArgError, _parse_modes, mode_config, mode_options  # noqa: F401 (re-exported)

GPU_LENGTHS = "4096,8192"
CPU_LENGTHS = "1024"


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to ``subparsers`` (from ``ArgumentParser.add_subparsers``) and
    return its parser; ``args.func`` is :func:`cmd_eval`."""
    from .hf_peer import HF_WEIGHTS
    from .tasks import TASKS

    p = subparsers.add_parser(
        "eval", help="RULER-style long-context evaluation: 11 synthetic tasks generated locally, or RULER's .jsonl data",
        description="RULER-style evaluation (Hsieh et al., 2024): needle retrieval (8 NIAH variants), variable "
                    "tracking, common and frequent words extraction, generated locally with the model's own "
                    "tokenizer and chat template; or RULER's own .jsonl data (incl. qa_1/qa_2) with --data. "
                    "Each prompt runs under each --mode (KV on the GPU, offloaded, or transformers' own model: hf); "
                    "prints a task x length table and answer agreement, writes ruler.json and ruler.png to --out "
                    "(records as they finish to ruler.partial.jsonl; --resume continues a cut run). Tasks: " + ", ".join(TASKS) + ".")
    p.add_argument("--tasks", default=None,
                   help="'all' (default without --data), 'niah' (the 8 NIAH tasks) or a comma-separated list "
                        "of task names; with --data and no --tasks only the data runs")
    p.add_argument("--lengths", default=None,
                   help=f"target context lengths in tokens (prompt + answer), comma-separated, e.g. 4096,8192 "
                        f"or 4k,8k (default {GPU_LENGTHS} on a GPU, {CPU_LENGTHS} on a CPU)")
    p.add_argument("--samples", type=int, default=1, help="samples per task and length (>= 1; default 1)")
    p.add_argument("--mode", "--modes", dest="mode", default="both",
                   help="engine configuration(s), comma-separated: resident (alias gpu), offload, offload-uva, "
                        "offload+quest, resident+quest, ... (xoffload.engine.modes), a decode policy's "
                        "budget as @N (offload+quest@512) and its GQA group score as /GROUP "
                        "(offload+quest@512/softmax) and its dense layers as /dense=I.J.K "
                        "(offload+quest@512/dense=0.1.18), exact key channels, bound scale and page size as "
                        "/ch=R, /alpha=A, /page=P, /reuse=B, /cache=C (offload+quest@512/ch=8/alpha=0.25), a :session suffix to ask each prompt as the "
                        "second turn of a session whose first turn gave the context (offload:session, prefix "
                        "caching on where the mode takes it), "
                        "both (= resident,offload; default), or hf: transformers' own "
                        "model (SDPA, greedy generate; every other mode's answers are also compared with it); "
                        "the first is the reference for answer agreement")
    p.add_argument("--hf-weights", default="ours", choices=list(HF_WEIGHTS),
                   help="weights of the hf mode: ours (our loaded tensors handed to transformers' model: "
                        "identical weights, no extra package; default) or source (transformers loads --model "
                        "itself: a HF directory, or a GGUF with the gguf package)")
    p.add_argument("--hf-samples", type=int, default=None,
                   help="the hf mode runs only the first N samples of each task and length (default: all)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the records of --out's ruler.partial.jsonl (or finished ruler.json) made with the "
                        "same setup and run only the rest; without it a run starts afresh")
    p.add_argument("--sparse", default=None, choices=["xattn", "none"],
                   help="XAttention sparse prefill (default: dense)")
    p.add_argument("--sparse-threshold", type=float, default=0.9, help="XAttention tau (with --sparse xattn)")
    p.add_argument("--model", default=None,
                   help="smollm2 (default), a .gguf file, or a HF model directory (needs a tokenizer)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--device", default=None, help="cuda | cpu (default cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence the LLM serves (default: the model's context length); every "
                        "length must fit in it")
    p.add_argument("--kv-block-size", type=int, default=1024, help="tokens per block of the KV pool (offload; resident with a decode policy)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model's dtype) or fp8 (e4m3 codes + fp32 scales; offload "
                        "modes with dense decode)")
    p.add_argument("--kv-cache-scale", default="page", choices=["page", "token"],
                   help="fp8 scales: page (per 64 tokens and KV head; default) or token")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on the answer length of every sample (default: RULER's per task: niah 128, "
                        "vt 30, cwe 120, fwe 50, qa 32)")
    p.add_argument("--data", default=None,
                   help="RULER .jsonl file(s), comma-separated (fields input, outputs, length; optional "
                        "index, answer_prefix, task); task name from a 'task' field, the file stem or, for "
                        "<task>/validation.jsonl, the folder")
    p.add_argument("--chat-template", action="store_true",
                   help="wrap each --data prompt in the model's chat template (input as the user turn, "
                        "answer_prefix opening the assistant turn); default: input + answer_prefix as they "
                        "are, tokenized with the tokenizer's default special tokens, as RULER sends them "
                        "(RULER's template is already in the data)")
    p.add_argument("--seed", type=int, default=0, help="seed of every generated prompt (default 0)")
    p.add_argument("--out", default="xoffload_eval",
                   help="output folder: ruler.partial.jsonl while running (each record as it finishes), "
                        "ruler.json and ruler.png at the end (the partial file is then removed)")
    p.add_argument("--min-score", type=float, default=None,
                   help="exit 1 when a mode's overall average (0-100) is below this")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 1 unless every mode's answers are token-identical to the first mode's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)
    return p


def _has_cuda(device) -> bool:
    import torch

    if device is not None:
        return str(device).startswith("cuda")
    return torch.cuda.is_available()


def _parse_lengths(spec: str) -> list:
    from .needle import parse_length

    out = []
    for x in str(spec).split(","):
        if not x.strip():
            continue
        try:
            L = parse_length(x)
        except ValueError as e:
            raise _ArgError(f"--lengths: {e}") from None
        if L < 1:
            raise _ArgError(f"--lengths must be positive, got {x.strip()!r}")
        out.append(L)
    if not out:
        raise _ArgError("--lengths is empty")
    return sorted(set(out))


def _check_args(a):
    """Everything that needs no model: returns (tasks, lengths, modes, data samples)."""
    from .ruler_data import load_ruler_data
    from .tasks import parse_tasks

    if a.samples < 1:
        raise _ArgError(f"--samples must be >= 1, got {a.samples}")
    if a.hf_samples is not None and a.hf_samples < 1:
        raise _ArgError(f"--hf-samples must be >= 1, got {a.hf_samples}")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise _ArgError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.max_model_len is not None and a.max_model_len < 1:
        raise _ArgError(f"--max-model-len must be >= 1, got {a.max_model_len}")
    if a.kv_block_size < 1:
        raise _ArgError(f"--kv-block-size must be >= 1, got {a.kv_block_size}")
    if not 0.0 <= a.sparse_threshold <= 1.0:
        raise _ArgError(f"--sparse-threshold must be in [0, 1], got {a.sparse_threshold}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise _ArgError(f"--out {a.out!r} exists and is not a folder")
    if a.tasks is None and a.data:
        tasks = []
    else:
        try:
            tasks = parse_tasks(a.tasks if a.tasks is not None else "all")
        except ValueError as e:
            raise _ArgError(f"--tasks: {e}") from None
    lengths = []
    if tasks:
        lengths = _parse_lengths(a.lengths or (GPU_LENGTHS if _has_cuda(a.device) else CPU_LENGTHS))
    modes = _parse_modes(a.mode)
    data = load_ruler_data(a.data) if a.data else []  # ValueError "<file>:<line>: ..." on a bad line
    return tasks, lengths, modes, data


def _one_line(e) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def cmd_eval(a) -> int:
    """Run ``xoffload eval`` with parsed arguments ``a`` (see :func:`add_eval_parser`).

    Returns 0 on success, 1 when ``--min-score`` / ``--require-identical`` fail, 2 on bad arguments
    or a failure before any result (one line ``xoffload eval: error: ...`` on stderr; no JSON).
    """
    try:
        return _cmd_eval(a)
    except (ValueError, TypeError, FileNotFoundError, ImportError, MemoryError) as e:
        print(f"xoffload eval: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. `timeout -s INT`: the finished records are on disk
        from .partial import PARTIAL_NAME

        p = os.path.join(a.out, PARTIAL_NAME)
        n = _count_records(p)
        print(f"xoffload eval: interrupted; {n} finished records kept in {p} (run again with --resume to "
              f"continue)" if n else "xoffload eval: interrupted before any record finished", file=sys.stderr)
        return 130


def _count_records(path) -> int:
    try:
        with open(path, "rb") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return 0


def _cmd_eval(a) -> int:
    t_start = time.perf_counter()
    tasks, lengths, modes, data = _check_args(a)

    from xoffload import models

    t_load = time.perf_counter()
    model = models.load_model(a.model, dtype=a.dtype, device=a.device, seed=a.seed)
    if model.tokenizer is None:
        raise _ArgError(f"model {model.source} has no tokenizer: eval needs one (use a GGUF or HF directory)")
    max_len = a.max_model_len or model.cfg.max_position_embeddings
    if lengths and max(lengths) > max_len:
        raise _ArgError(f"length {max(lengths)} is above max_model_len {max_len} of {os.path.basename(str(model.source))}"
                        f"{'' if a.max_model_len else ' (its context length)'}")
    skipped = []
    if data:
        from .ruler_data import split_fitting, tokenize_samples

        tokenize_samples(data, model.tokenizer, chat=a.chat_template)
        data, skipped = split_fitting(data, max_len, a.max_new_tokens)
        for k in skipped:
            print(f"note: skipped {k['source']}:{k['line']}: prompt of {k['prompt_tokens']} tokens + "
                  f"{k['max_new_tokens']} new tokens is above max_model_len {max_len}", file=sys.stderr)
        if not data and not tasks:
            raise _ArgError(f"none of the {len(skipped)} --data samples fits max_model_len {max_len} "
                            f"(e.g. {skipped[0]['source']}:{skipped[0]['line']}: {skipped[0]['prompt_tokens']} "
                            f"prompt tokens + {skipped[0]['max_new_tokens']} new tokens)")
    t_load = time.perf_counter() - t_load
    # build every prompt now, so that a length too short for a template fails before any generation
    from .tasks import build_samples

    t_b = time.perf_counter()
    prompts = build_samples(model.tokenizer, tasks, lengths, a.samples, a.seed) if tasks else []
    t_b = time.perf_counter() - t_b
    print(f"model {model.source} ({model.cfg.arch}, {model.cfg.num_layers} layers, {model.dtype}, {model.device}) "
          f"loaded in {t_load:.1f} s; {len(prompts) + len(data)} prompts built in {t_b:.2f} s; modes {modes}; "
          f"lengths {lengths}; samples {a.samples}; seed {a.seed}", flush=True)

    from xoffload.engine.llm import LLM
    from xoffload.sparse import XAttentionPrefill

    from . import hf_peer
    from .partial import PARTIAL_NAME
    from .runner import JSON_NAME, run_eval

    sparse = None if a.sparse in (None, "none") else a.sparse
    policy = XAttentionPrefill(threshold=a.sparse_threshold) if sparse else None
    with_hf = hf_peer.HF_MODE in modes
    if with_hf and a.hf_weights == "source":
        hf_peer.check_source(model.source)  # before any run: a preset or a missing gguf package

    def factory(mode):
        if mode == hf_peer.HF_MODE:
            return hf_peer.hf_peer_llm(model, weights=a.hf_weights, max_model_len=max_len)
        kw = {"sparse": policy, **mode_options(mode)}
        if a.kv_cache_dtype != "auto":
            kw.update(kv_cache_dtype=a.kv_cache_dtype, kv_cache_scale=a.kv_cache_scale)
        session = kw.pop("session", None)
        llm = LLM(model, kv_block_size=a.kv_block_size, max_model_len=max_len, **kw)
        llm.eval_session = session  # run_eval asks each prompt as the second turn of a session
        return llm

    meta = {"model": str(model.source), "arch": model.cfg.arch, "dtype": str(model.dtype),
            "device": str(model.device), "load_s": t_load, "sparse": sparse,
            "sparse_threshold": a.sparse_threshold if sparse else None, "kv_block_size": a.kv_block_size,
            "kv_cache_dtype": a.kv_cache_dtype, "max_model_len": max_len, "command": " ".join(sys.argv)}
    if a.data:
        from .ruler_data import added_special_tokens

        meta.update(data_prompt="chat" if a.chat_template else "raw",
                    data_special_tokens=added_special_tokens(model.tokenizer), skipped=skipped,
                    num_skipped=len(skipped))
    if os.environ.get("GIT_COMMIT"):
        meta["commit"] = os.environ["GIT_COMMIT"]
    if with_hf:
        import transformers

        meta.update(hf_weights=a.hf_weights, transformers=transformers.__version__,
                    hf_stop_token_ids=list(hf_peer.stop_token_ids(model)))
    if model.device.type == "cuda":
        import torch

        meta["gpu"] = torch.cuda.get_device_name(model.device)
    partial = os.path.join(a.out, PARTIAL_NAME)
    if not a.resume and os.path.isfile(partial):
        print(f"note: {partial} (an unfinished run) is replaced by this run's records; --resume would continue it",
              file=sys.stderr)
    # what each label means today (a resume reruns a record made under another meaning, e.g. an
    # older default of the decode policy)
    configs = {m: mode_config(m) for m in modes if m != hf_peer.HF_MODE}
    # the prompts are built above (to fail early); run_eval gets them as ready samples
    res = run_eval(factory, model.tokenizer, tasks=None, lengths=lengths, samples=a.samples, modes=modes,
                   seed=a.seed, data=[*prompts, *data], max_new_tokens=a.max_new_tokens, out_dir=a.out, meta=meta,
                   progress=not a.no_progress, resume=a.resume,
                   samples_by_mode={hf_peer.HF_MODE: a.hf_samples} if with_hf and a.hf_samples else None,
                   mode_configs=configs)
    print(res.format_table())
    if res.meta.get("records_reused"):
        print(f"resumed: {res.meta['records_reused']} records reused from {res.meta['resumed_from']}")
    if res.meta.get("records_stale"):
        print(f"resumed: {res.meta['records_stale']} records made under another meaning of their mode ran again")
    if skipped:
        print(f"skipped {len(skipped)} --data sample(s) that do not fit max_model_len {max_len}: "
              + ", ".join(f"{os.path.basename(k['source'])}:{k['line']}" for k in skipped[:8])
              + (f", +{len(skipped) - 8}" if len(skipped) > 8 else "") + f" (listed in {JSON_NAME} meta.skipped)")
    print(f"wrote {os.path.join(a.out, JSON_NAME)} and ruler.png")
    total = time.perf_counter() - t_start
    wall = res.meta.get("wall_s_by_mode") or {}
    print(f"eval: {len(res.records)} records ({res.meta.get('num_prompts', 0)} prompts, {len(res.modes)} mode(s)"
          + (f", {len(skipped)} skipped" if skipped else "") + f") on {model.device}: {total:.1f} s in all "
          f"(model load {t_load:.1f} s, " + "".join(f"{m} {w:.1f} s, " for m, w in wall.items())
          + f"rest {max(0.0, total - t_load - sum(wall.values())):.1f} s)")
    ok = True
    if a.min_score is not None:
        ok = all(res.average[m] >= a.min_score for m in res.modes)
    if a.require_identical and any(v["token_identical"] != v["total"] for v in res.agreement.values()):
        ok = False
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m xoffload.evals.cli [eval] ARGS``: the same command without ``xoffload/cli.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["eval"]:
        argv = ["eval", *argv]
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
