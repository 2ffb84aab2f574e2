"""Where a follow-up question's time goes, and what GPU memory an offload engine leaves behind.

Part 1 (``followup``): one conversation over a ``--doc-tokens`` document in offload + Quest mode with
prefix caching, under a GPU memory cap; its follow-up question (``--q-tokens``) is prefilled past
the reused document, whose KV is read back from the pinned pool layer by layer. The follow-up's
engine step is timed with CUDA events and profiled (``torch.profiler``: the top GPU kernels by
time); beside it, one layer's prefix read alone (:meth:`OffloadRuntime.fetch_blocks`, the gather
kernel over pinned memory) and a copy-engine H2D of the same bytes from one pinned buffer.

Part 2 (``memory``): after that engine is closed, the allocator's allocated / reserved bytes and
the free memory under the cap; then a resident engine is opened for a ``--doc-tokens`` prompt and
its pool size and prefill are reported (or its error).

Usage (GPU)::

    PYTHONPATH=$PWD python tools/diag_followup.py --out /tmp/followup.json
"""
from __future__ import annotations

import argparse
import json

import torch


def _tokens(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def _run_turn(llm, sess, msg, sp):
    rid = sess.submit(msg, sp)
    out = None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def _timed_step(llm):
    """Step until the queued follow-up has its first token; CUDA-event ms of each step."""
    e, ms = llm.engine, []
    while True:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        outs = e.step()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
        if any(len(o.token_ids) >= 1 for o in outs):
            return ms


def followup(model, a) -> dict:
    from xoffload import LLM, SamplingParams

    V = model.cfg.vocab_size
    max_len = a.doc_tokens + 4 * (a.q_tokens + 32) + 64
    llm = LLM(model, mode="offload", sparse_decode="quest", prefix_caching=True, max_num_seqs=8,
              max_model_len=max_len, kv_cache_tokens=4 * (max_len + 1024))
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    res = {}
    try:
        # warm-up conversation (compilation), then the measured one
        for salt in (10**6, 0):
            s = llm.session()
            _run_turn(llm, s, _tokens(a.doc_tokens, V, salt + 1) + _tokens(a.q_tokens, V, salt + 2), sp)
            _run_turn(llm, s, _tokens(a.q_tokens, V, salt + 3), sp)
        s.submit(_tokens(a.q_tokens, V, 7), SamplingParams(max_tokens=2, ignore_eos=True))
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = _timed_step(llm)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        ev = prof.key_averages()
        rows = sorted(ev, key=lambda r: -r.device_time_total)[:25]
        res["followup_step_ms"] = ms
        res["gpu_kernel_ms_total"] = sum(r.self_device_time_total for r in ev) / 1e3
        res["top_kernels"] = [{"name": r.key[:90], "calls": r.count, "gpu_ms": r.self_device_time_total / 1e3}
                              for r in rows]
        # one layer's prefix read alone, against the copy engine over the same bytes
        eng = llm.engine.offload
        sid = eng.add_sequence()  # a stand-in sequence holding a document's KV in every layer
        kv = torch.randn(a.doc_tokens, eng.num_kv_heads, eng.head_dim, dtype=model.dtype, device="cuda")
        for layer in range(model.cfg.num_layers):
            eng.offload_layer(sid, layer, kv, kv)
        nb = -(-a.doc_tokens // eng.block_size)
        ids = list(range(nb))
        eng.fetch_blocks(sid, 0, ids)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for layer in range(model.cfg.num_layers):
            eng.fetch_blocks(sid, layer, ids)
        t1.record()
        t1.synchronize()
        nbytes = 2 * nb * eng.block_size * eng.num_kv_heads * eng.head_dim * 2 * model.cfg.num_layers
        res["fetch_all_layers_ms"] = t0.elapsed_time(t1)
        res["fetch_GBps"] = nbytes / t0.elapsed_time(t1) / 1e6
        host = torch.empty(nbytes // model.cfg.num_layers, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        dev.copy_(host, non_blocking=True)
        t0.record()
        for _ in range(model.cfg.num_layers):
            dev.copy_(host, non_blocking=True)
        t1.record()
        t1.synchronize()
        res["copy_engine_ms"] = t0.elapsed_time(t1)
        res["copy_engine_GBps"] = nbytes / t0.elapsed_time(t1) / 1e6
        del host, dev
        eng.free(sid)
    finally:
        llm.close()
    return res


def memory(model, a) -> dict:
    from xoffload import LLM, SamplingParams
    from xoffload.kv.base import _gpu_kv_limit_bytes

    torch.cuda.empty_cache()
    res = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "limit_no_headroom": _gpu_kv_limit_bytes(torch.device("cuda"), 0),
           "mem_get_info": list(torch.cuda.mem_get_info())}
    V = model.cfg.vocab_size
    llm = LLM(model, mode="resident", prefix_caching=True, max_num_seqs=8, max_model_len=a.doc_tokens + 512)
    try:
        s = llm.session()
        try:
            o = _run_turn(llm, s, _tokens(a.doc_tokens, V, 5), SamplingParams(max_tokens=8, ignore_eos=True))
            res["resident"] = {"finish_reason": o.finish_reason, "error": str(getattr(o, "error", None))[:400],
                               "store": llm.engine.stats.get("store") if llm.engine.stats else None}
        except Exception as e:  # noqa: BLE001 -- a diagnostic: report it
            res["resident"] = {"exception": f"{type(e).__name__}: {str(e)[:400]}"}
        res["after_resident"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                                 "max_allocated": torch.cuda.max_memory_allocated()}
    finally:
        llm.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--doc-tokens", type=int, default=32768)
    ap.add_argument("--q-tokens", type=int, default=64)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--parts", default="followup,memory")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from xoffload.models import random_model

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    model = random_model(a.shape, dtype=torch.bfloat16, device="cuda", seed=0)
    out = {}
    for part in a.parts.split(","):
        out[part] = {"followup": followup, "memory": memory}[part](model, a)
        print(part, json.dumps(out[part], indent=1, default=str)[:6000], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
