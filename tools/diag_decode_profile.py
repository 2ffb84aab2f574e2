"""Diagnosis of sparse offload decode on the random-weight Llama-3.1-8B shape (GPU only): where the
peak GPU memory of a request comes from, and where a steady decode step's time goes.

1. ``memory``: one request with PyTorch's allocator history recorded; the trace is replayed to find
   the peak of allocated bytes, and the allocations alive at that peak are grouped by the first
   ``xoffload`` frame that made them (file:line, function). Also the peak after prefill and the
   peak of the whole request (what ``RequestOutput.peak_gpu_memory_bytes`` reports).
2. ``profile``: the decode loop of one request under ``torch.profiler`` (CUDA activity; graph
   replays included): per kernel name, calls per step and microseconds per step, and the kernel
   sequence of the last step with the idle gap before each kernel.

Writes ``--out`` (JSON) and a text report beside it. Usage::

    PYTHONPATH=$PWD python tools/diag_decode_profile.py --config offload+quest \
        --lengths 32768,131072 --out /tmp/diag_decode.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _common import doc_summary, env_record, parse_gpu_args  # noqa: E402
from bench_llm import _free, _prompt  # noqa: E402


def _site(frames) -> str:
    """The first frame inside the xoffload package (else the first frame), as file:line fn."""
    for f in frames or []:
        fn = f.get("filename", "")
        if "/xoffload/" in fn:
            return f"{fn.split('/xoffload/', 1)[1]}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} {f.get('name')}"
    return "?"


def peak_owners(trace, base: int, top: int = 20) -> dict:
    """Replay an allocator trace (``device_traces[i]``): the peak of allocated bytes above
    ``base`` and the live allocations at it, grouped by :func:`_site`."""
    live, cur, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, at = cur, i
        elif a == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])
    owners = collections.Counter()
    live2 = {}
    for i, e in enumerate(trace[:at + 1]):
        a = e.get("action")
        if a == "alloc":
            live2[e["addr"]] = (e["size"], _site(e.get("frames")))
        elif a == "free_completed":
            live2.pop(e["addr"], None)
    for size, site in live2.values():
        owners[site] += size
    return {"peak_above_start_GB": peak / 1e9, "start_allocated_GB": base / 1e9, "events": len(trace),
            "owners_GB": {k: v / 1e9 for k, v in owners.most_common(top)}}


def memory(llm, n_ctx: int, n_new: int) -> dict:
    from xoffload import SamplingParams

    marks = {}
    orig = llm._prefill

    def prefill(*a, **k):
        out = orig(*a, **k)
        torch.cuda.synchronize()
        marks["after_prefill_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        marks["after_prefill_allocated_GB"] = torch.cuda.memory_allocated() / 1e9
        return out

    llm._prefill = prefill
    ids = _prompt(n_ctx - 64, llm.cfg.vocab_size, 0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000, context="alloc", stacks="python")
    try:
        o = llm.generate(ids, SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        llm._prefill = orig
    trace = snap["device_traces"][torch.cuda.current_device()]
    rec = peak_owners(trace, base)
    rec.update(marks)
    rec["request_peak_GB"] = o.peak_gpu_memory_bytes / 1e9
    rec["weights_GB"] = llm.model.w.nbytes() / 1e9
    rec["peak_minus_weights_GB"] = rec["request_peak_GB"] - rec["weights_GB"]
    rec["decode_steady_ms_per_token"] = o.timings.get("decode_steady_ms_per_token")
    return rec


def profile(llm, n_ctx: int, n_new: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from xoffload import SamplingParams

    orig = llm._decode_loop
    box = {}

    def loop(*a, **k):
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            out = orig(*a, **k)
            torch.cuda.synchronize()
        box["prof"] = prof
        return out

    llm._decode_loop = loop
    try:
        o = llm.generate(_prompt(n_ctx - 64, llm.cfg.vocab_size, 1), SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    finally:
        llm._decode_loop = orig
    kernels = [e for e in box["prof"].events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    steps = n_new - 1
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by[e.name][0] += 1
        by[e.name][1] += e.time_range.elapsed_us()
    # the last step: the kernels after the last sampling kernel but one (argmax / topk of the logits)
    per_step = max(1, len(kernels) // max(1, steps))
    last = kernels[-per_step:]
    seq, prev_end = [], None
    for e in last:
        gap = (e.time_range.start - prev_end) if prev_end is not None else 0.0
        seq.append((e.name[:90], round(e.time_range.elapsed_us(), 2), round(gap, 2)))
        prev_end = e.time_range.end
    busy = sum(e.time_range.elapsed_us() for e in last)
    span = last[-1].time_range.end - last[0].time_range.start if last else 0.0
    table = sorted(((n, c / steps, t / steps) for n, (c, t) in by.items()), key=lambda r: -r[2])
    return {"steps": steps, "kernels_per_step": len(kernels) / steps,
            "decode_steady_ms_per_token": o.timings.get("decode_steady_ms_per_token"),
            "last_step_busy_us": busy, "last_step_span_us": span,
            "per_kernel_us_per_step": [(n[:120], round(c, 2), round(t, 2)) for n, c, t in table[:60]],
            "last_step": seq}


def _lengths(text: str) -> list:
    """``--lengths``-style value: comma-separated positive token counts (argparse error otherwise)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = None
    if out is None or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts, got {text!r}")
    return out


def main(argv=None):
    from xoffload.engine.modes import configurations

    configs = configurations()
    ap = argparse.ArgumentParser(description=doc_summary(__doc__, "diag_decode_profile"))
    ap.add_argument("--preset", default="llama-3.1-8b", help="random-weight model preset (default llama-3.1-8b)")
    ap.add_argument("--config", default="offload+quest", choices=sorted(configs), metavar="CONFIG",
                    help="a name of xoffload.engine.modes.configurations() (default offload+quest)")
    ap.add_argument("--lengths", type=_lengths, default="32768,131072", help="prompt lengths to profile the decode of")
    ap.add_argument("--memory-lengths", type=_lengths, default="131072",
                    help="prompt lengths whose peak GPU memory is traced")
    ap.add_argument("--eager-lengths", type=_lengths, default="32768",
                    help="also profile these lengths without CUDA graphs ('' for none)")
    ap.add_argument("--new", type=int, default=24, help="tokens generated per request (default 24)")
    ap.add_argument("--out", default="/tmp/diag_decode.json", help="result JSON (a _last_step.txt beside it)")
    a = parse_gpu_args(ap, argv)
    if a is None:
        return 0
    from xoffload import LLM
    from xoffload.models import random_model

    kw = configs[a.config]
    model = random_model(a.preset, dtype=torch.bfloat16, device="cuda", seed=0)
    lengths, mem_lengths = a.lengths, a.memory_lengths
    res = {"env": env_record(), "config": a.config, "kw": kw, "preset": a.preset, "memory": {}, "profile": {}}
    llm = LLM(model, max_model_len=max(lengths + mem_lengths) + 64, **kw)
    try:
        llm.generate(_prompt(4096, model.cfg.vocab_size, 2), __import__("xoffload").SamplingParams(max_tokens=8, ignore_eos=True))
        for n in mem_lengths:
            t = time.perf_counter()
            res["memory"][str(n)] = memory(llm, n, a.new)
            print(f"memory {n}: {time.perf_counter() - t:.1f} s", json.dumps(res["memory"][str(n)], indent=1), flush=True)
            _free()
        for n in lengths:
            res["profile"][str(n)] = p = profile(llm, n, a.new)
            print(f"profile {n}: {p['decode_steady_ms_per_token']:.3f} ms/token, {p['kernels_per_step']:.0f} kernels/step, "
                  f"last step busy {p['last_step_busy_us']:.0f} of {p['last_step_span_us']:.0f} us", flush=True)
            for row in p["per_kernel_us_per_step"][:30]:
                print("  ", row, flush=True)
            _free()
    finally:
        llm.close()
        del llm
        _free()
    eager = a.eager_lengths
    if eager:
        llm = LLM(model, max_model_len=max(eager) + 64, cuda_graph=False, **kw)
        try:
            for n in eager:
                res["profile"][f"{n}/eager"] = p = profile(llm, n, a.new)
                print(f"profile {n} eager: {p['decode_steady_ms_per_token']:.3f} ms/token, "
                      f"{p['kernels_per_step']:.0f} kernels/step", flush=True)
                for row in p["per_kernel_us_per_step"][:30]:
                    print("  ", row, flush=True)
        finally:
            llm.close()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.splitext(a.out)[0] + "_last_step.txt", "w") as f:
        for n, p in res["profile"].items():
            f.write(f"== {a.config} at {n}: kernel, us, gap before (us)\n")
            for row in p["last_step"]:
                f.write(f"{row[1]:9.2f} {row[2]:8.2f}  {row[0]}\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
