"""Dense offload decode, staged or in place, one store for one sequence or many: decode ms per token
of the batched store (:class:`~xoffload.kv.OffloadBatchKV`, ``offload_decode`` ``direct`` = staged,
``uva`` = in place) against the one-request store (``OffloadPagedKV``, what ``max_num_seqs=1``
runs today) and resident decode, per prompt length and batch size.

At batch 1 the batched store is forced for ``max_num_seqs=1`` (a bucket of one, one CUDA graph),
as the store table will route it; ``batched / one-request`` of the same ``offload_decode`` is the
single-request cost of serving one sequence through the batched store (target: <= 1.03). Each
case runs twice in one LLM (the first compiles and captures); the second's median steady decode
ms per token is kept, with the store's ``describe()``.

Usage::

    PYTHONPATH=$PWD python tools/diag_offload_staging.py --model smollm2 --lengths 4096,16384,32768 \
        --batches 1,4 --out /tmp/offload_staging.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.kv import OffloadBatchKV
from xoffload.models import load_model
from xoffload.runtime.pool import reuse_pinned_slabs


@contextlib.contextmanager
def batched_at_one(on: bool):
    """Within the context (when ``on``), LLMs made with offload dense decode use OffloadBatchKV
    whatever ``max_num_seqs`` is."""
    from xoffload.engine import llm_engine

    table = llm_engine.batch_store_class

    def route(config):
        if config.mode == "offload" and config.offload_decode != "ring" and config.decode_policy is None:
            return OffloadBatchKV, {}
        return table(config)

    if on:
        llm_engine.batch_store_class = route
    try:
        yield
    finally:
        llm_engine.batch_store_class = table


def run_case(model, n_ctx: int, new: int, batch: int, store: str, decode: str | None) -> dict:
    """One case: ``store`` ``one-request`` / ``batched`` / ``resident``; returns its row."""
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n_ctx,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    kw = dict(max_model_len=n_ctx + new + 8, max_num_seqs=batch, mode="offload", offload_decode=decode)
    if store == "resident":
        kw.update(mode="resident", offload_decode="direct")
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    with batched_at_one(store == "batched"):
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
                cases = [("resident", None)] + [("batched", d) for d in ("direct", "uva")]
                if b == 1:
                    cases += [("one-request", d) for d in ("direct", "uva")]
                for store, d in cases:
                    rows.append(run_case(model, n, a.new, b, store, d))
                    r = rows[-1]
                    print(f"ctx {n:>6} batch {b:>2} {store:>11} {d or '':>6}: {r['ms_per_step']:8.3f} ms/step "
                          f"{r['describe'].get('prompt_read', '')}", flush=True)
                one = {r["offload_decode"]: r["ms_per_step"] for r in rows[-len(cases):] if r["store"] == "one-request"}
                for r in rows[-len(cases):]:
                    if r["store"] == "batched" and r["offload_decode"] in one:
                        r["over_one_request"] = r["ms_per_step"] / one[r["offload_decode"]]
                        print(f"  batched / one-request ({r['offload_decode']}): {r['over_one_request']:.3f}")
    out = {"model": a.model if not a.cpu_smoke else "tiny-llama", "new": a.new, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


if __name__ == "__main__":
    main()
