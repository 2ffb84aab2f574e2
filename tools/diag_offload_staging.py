"""Dense offload decode, staged or in place, against resident: decode ms per token of the offload
store (:class:`~xoffload.kv.OffloadBatchKV`, ``offload_decode`` ``direct`` = staged through two GPU
buffers, ``uva`` = read in place) and of resident decode, per prompt length and batch size.

Each case runs twice in one LLM (the first compiles and captures); the second's median steady decode
ms per token is kept, with the store's ``describe()``. Per length and batch, each offload row also
gets ``over_resident`` (its ms / resident's) and the staged row ``over_in_place`` (direct / uva).

Usage::

    PYTHONPATH=$PWD python tools/diag_offload_staging.py --model smollm2 --lengths 4096,16384,32768 \
        --batches 1,4 --out /tmp/offload_staging.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.models import load_model
from xoffload.runtime.pool import reuse_pinned_slabs

#: (store, offload_decode) of each case, in the order they run
CASES = (("resident", None), ("offload", "direct"), ("offload", "uva"))


def run_case(model, n_ctx: int, new: int, batch: int, store: str, decode: str | None) -> dict:
    """One case: ``store`` ``resident`` or ``offload`` (with ``decode``); returns its row."""
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n_ctx,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    kw = dict(max_model_len=n_ctx + new + 8, max_num_seqs=batch, mode=store)
    if decode is not None:
        kw["offload_decode"] = decode
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    llm = LLM(model, **kw)
    try:
        llm.generate(prompts, sp)
        outs = llm.generate(prompts, sp)
        info = dict(llm.batch_stats.get("store") or {})
    finally:
        llm.close()
    ms = statistics.median(o.timings["decode_steady_ms_per_token"] for o in outs)
    return {"ctx": n_ctx, "batch": batch, "store": store, "offload_decode": decode, "ms_per_step": ms,
            "h2d_bytes_per_token": outs[0].timings.get("h2d_bytes_per_token"), "describe": info}


def add_ratios(rows: list) -> None:
    """The rows of one length and batch (:data:`CASES`): ``over_resident`` on each offload row,
    ``over_in_place`` on the staged one."""
    res = next(r["ms_per_step"] for r in rows if r["store"] == "resident")
    by = {r["offload_decode"]: r["ms_per_step"] for r in rows if r["store"] == "offload"}
    for r in rows:
        if r["store"] == "offload":
            r["over_resident"] = r["ms_per_step"] / res
            if r["offload_decode"] == "direct" and "uva" in by:
                r["over_in_place"] = r["ms_per_step"] / by["uva"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="what load_model takes (a preset: random weights)")
    ap.add_argument("--lengths", default="4096,16384", help="prompt tokens, comma-separated")
    ap.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny-llama on the CPU (checks the script runs)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        model = load_model("tiny-llama", dtype=torch.float32, device="cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("diag_offload_staging: needs a CUDA GPU (or --cpu-smoke)")
    else:
        model = load_model(a.model, device="cuda")
    rows = []
    with reuse_pinned_slabs():
        for n in (int(x) for x in a.lengths.split(",")):
            for b in (int(x) for x in a.batches.split(",")):
                group = [run_case(model, n, a.new, b, store, d) for store, d in CASES]
                add_ratios(group)
                for r in group:
                    ratio = "".join(f" {k} {r[k]:.3f}" for k in ("over_resident", "over_in_place") if k in r)
                    print(f"ctx {n:>6} batch {b:>2} {r['store']:>8} {r['offload_decode'] or '':>6}: "
                          f"{r['ms_per_step']:8.3f} ms/step {r['describe'].get('prompt_read', '')}{ratio}", flush=True)
                rows += group
    out = {"model": a.model if not a.cpu_smoke else "tiny-llama", "new": a.new, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


if __name__ == "__main__":
    main()
