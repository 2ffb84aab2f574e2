"""End-to-end model benchmark (§5): random-weight Llama-3.1-8B shape, bf16, one GPU.

Measured in one run, on the same random weights:
- ours, ``gpu`` and ``offload`` modes: prefill tok/s, TTFT, decode ms/token, peak GPU memory, at
  32K and 128K context (``--quick``: 32K only);
- the peer, transformers' ``generate`` (SDPA) with the cache on the GPU and with
  ``DynamicCache(offloading=True)``: prefill tok/s and decode ms/token from CUDA events recorded
  by a logits processor at every generated token (one ``generate`` call per point);
- H2D bandwidth (pinned host -> GPU, 1 GiB copies) and the full-offload decode bound
  ``KV bytes per token / H2D``;
- a 24 GiB GPU memory cap (``torch.cuda.set_per_process_memory_fraction``): ``offload`` serves
  128K, ``gpu`` mode runs out of memory.

Each section is wrapped so that a failure is recorded in the JSON (``errors``) and the rest still
runs. Run: ``python benchmarks/bench_llm.py [--quick]`` (writes benchmarks/results/model.json), or
through pytest-benchmark (``test_bench_model``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import HAS_CUDA, env_record, fmt_table, requires_cuda, write_json  # noqa: E402

import torch  # noqa: E402

# transformers' LlamaForCausalLM holding OUR weight tensors (views: no copy), on the same device;
# the same builder serves the eval's transformers peer (xoffload eval --modes ...,hf)
from xoffload.evals.hf_peer import hf_from_ours  # noqa: E402

PRESET = "llama-3.1-8b"
N_NEW = 8  # generated tokens per point (1 prefill token + 7 decode steps)
CAP_BYTES = 24 * 2**30


def _free():
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def _prompt(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def h2d_bandwidth_gbps(nbytes=1 << 30, reps=5) -> float:
    """Pinned host -> device copy bandwidth (GB/s, 1e9) with CUDA events, median of ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    times.sort()
    return nbytes / (times[len(times) // 2] * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------- ours
def run_ours(llm, n_ctx, seed=0, repeat=1) -> dict:
    """``repeat`` generate calls of the same prompt; the last one is reported (the earlier ones'
    prefill tok/s are kept under ``earlier_prefill_tok_per_s``: first-call costs such as the
    caching allocator growing or cuDNN building its plan for a new length show there)."""
    from xoffload import SamplingParams

    ids = _prompt(n_ctx - N_NEW, llm.cfg.vocab_size, seed)
    earlier = []
    for i in range(repeat):
        o = llm.generate(ids, SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
        if i < repeat - 1:
            earlier.append(o.timings["prefill_tok_per_s"])
    t = o.timings
    rec = {"prompt_tokens": len(ids), "prefill_tok_per_s": t["prefill_tok_per_s"], "ttft_ms": t["ttft_ms"],
           "decode_ms_per_token": t["decode_ms_per_token"], "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes,
           "token_ids": o.token_ids}
    if earlier:
        rec["earlier_prefill_tok_per_s"] = earlier
    return rec


# ------------------------------------------------------------------------------------------- peer
def token_marker(events: list):
    """A transformers logits processor that records a CUDA timing event into ``events`` at every
    generated token (the peer's per-token decode time, without a host clock)."""
    from transformers import LogitsProcessor

    class _Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)
            return scores

    return _Mark()


def run_hf(hf, n_ctx, offloading: bool, seed=0, n_new=N_NEW) -> dict:
    """One ``generate`` call of ``n_new`` tokens after a prompt of ``n_ctx - n_new``; a logits
    processor records a CUDA event per token: ``decode_ms_per_token`` their mean,
    ``decode_step_ms`` each step, ``decode_steady_ms_per_token`` the median step. Peak memory:
    allocated and reserved."""
    from transformers import LogitsProcessorList

    events = []
    ids = torch.tensor([_prompt(n_ctx - n_new, hf.config.vocab_size, seed)], device="cuda")
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
              attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([token_marker(events)]))
    if offloading:
        from transformers import DynamicCache

        try:
            kw["past_key_values"] = DynamicCache(config=hf.config, offloading=True)
        except TypeError:
            kw["cache_implementation"] = "offloaded"
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.no_grad():
        out = hf.generate(ids, **kw)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    prefill_ms = start.elapsed_time(events[0])
    steps = len(events) - 1
    dec = events[0].elapsed_time(events[-1]) / steps if steps > 0 else None
    step_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    return {"prompt_tokens": ids.shape[1], "prefill_tok_per_s": ids.shape[1] / prefill_ms * 1e3,
            "ttft_ms": prefill_ms, "decode_ms_per_token": dec, "decode_step_ms": step_ms,
            "decode_steady_ms_per_token": sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
            "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_gpu_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "token_ids": out[0, ids.shape[1]:].tolist()}


# ------------------------------------------------------------------------------------------- main
def _section(res, name, fn):
    t = time.perf_counter()
    try:
        out = fn()
        res["results"][name] = out
        print(f"[{name}] done in {time.perf_counter() - t:.1f} s", flush=True)
        return out
    except Exception as e:  # record and go on
        res["errors"][name] = f"{type(e).__name__}: {e}"
        res["tracebacks"][name] = traceback.format_exc()[-3000:]
        print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        _free()
        return None


def run(quick: bool = False, out_dir=None, peers: bool = True, cap: bool = True) -> dict:
    from xoffload import LLM, SamplingParams
    from xoffload.models import random_model

    ctxs = [32768] if quick else [32768, 131072]
    res = {"name": "model", "env": env_record(), "preset": PRESET, "dtype": "bfloat16", "n_new_tokens": N_NEW,
           "contexts": ctxs, "quick": quick, "results": {}, "errors": {}, "tracebacks": {}}
    model = random_model(PRESET, dtype=torch.bfloat16, device="cuda", seed=0)
    cfg = model.cfg
    res["weights_bytes"] = model.w.nbytes()
    res["kv_bytes_per_token"] = cfg.kv_bytes_per_token(torch.bfloat16)
    from xoffload.kernels import causal_attention_backend

    probe = torch.empty(1, 16, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    probe_k = torch.empty(1, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    auto = causal_attention_backend(probe, probe_k)
    res["prefill_attention_kernel"] = {
        "ours_gpu / ours_offload": f"causal_attention backend 'auto' -> {auto!r} "
                                   "(whole prompt per layer, no LSE, in place over q, 256 MiB head groups)",
        "ours_offload_triton": "causal_attention backend 'xoffload': our Triton flash_attn_with_lse",
        "transformers": "SDPA (attn_implementation='sdpa', PyTorch's backend choice)"}
    max_len = max(ctxs)

    h2d = _section(res, "h2d_gbps", h2d_bandwidth_gbps)
    # warm-up: compile every kernel variant the measured points use. Triton specialises integer
    # arguments on divisibility by 16 (full 8K chunks and a ragged last chunk both occur) and the
    # decode merge on the split count (128 splits from ~32.5K keys on), so the warm-up prompt has
    # 33000 tokens; a 3000-token warm-up left ~1.3 s of compilation in the first measured prefill
    # and ~0.4 s in its decode.
    def warm():
        for mode in ("gpu", "offload"):
            llm = LLM(model, mode=mode, max_model_len=34000)
            llm.generate(_prompt(33000, cfg.vocab_size, seed=1), SamplingParams(max_tokens=3, ignore_eos=True))
            llm.close()
            _free()
        return True

    _section(res, "warmup", warm)
    # (mode, prefill attention): the Triton kernel by default; PyTorch SDPA as the alternative
    # (mode, prefill attention): "auto" (cuDNN on an H200) by default; our Triton kernel as the
    # alternative at 32K. 32K points run twice (the second is reported), 128K once.
    for mode, attn in (("gpu", "auto"), ("offload", "auto"), ("offload", "xoffload")):
        def one_mode(mode=mode, attn=attn):
            llm = LLM(model, mode=mode, max_model_len=max_len, prefill_attn=attn)
            try:
                return {str(n): run_ours(llm, n, repeat=2 if n <= 32768 else 1)
                        for n in (ctxs[:1] if attn == "xoffload" else ctxs)}
            finally:
                llm.close()
                _free()

        _section(res, f"ours_{mode}" + ("_triton" if attn == "xoffload" else ""), one_mode)
        _free()

    if peers:
        hf = None
        try:
            hf = _section(res, "hf_build", lambda: hf_from_ours(model))
            if hf is not None:
                res["results"]["hf_build"] = "ok"
                _section(res, "hf_warmup", lambda: (run_hf(hf, 4096, False), _free(), True)[-1])
                for off in (False, True):
                    name = "hf_offloaded_cache" if off else "hf_gpu_cache"
                    # like ours: 32K twice (the second reported), 128K once
                    def pts(off=off):
                        out = {}
                        for n in ctxs:
                            recs = [(run_hf(hf, n, off), _free())[0] for _ in range(2 if n <= 32768 else 1)]
                            out[str(n)] = recs[-1]
                            if len(recs) > 1:
                                out[str(n)]["earlier_prefill_tok_per_s"] = [x["prefill_tok_per_s"] for x in recs[:-1]]
                        return out

                    _section(res, name, pts)
        finally:
            del hf
            _free()

    if cap and not quick:
        def capped():
            out = {}
            total = torch.cuda.get_device_properties(0).total_memory
            _free()
            torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
            try:
                for mode in ("gpu", "offload"):
                    llm = None
                    try:
                        llm = LLM(model, mode=mode, max_model_len=131072)
                        out[mode] = run_ours(llm, 131072)
                        out[mode]["status"] = "ok"
                    except torch.cuda.OutOfMemoryError as e:
                        out[mode] = {"status": "OOM", "error": str(e).splitlines()[0][:300]}
                    finally:
                        if llm is not None:
                            llm.close()
                        del llm
                        _free()
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
            out["cap_bytes"] = CAP_BYTES
            return out

        _section(res, "cap_24GiB_128K", capped)

    # ---- derived numbers and the targets
    r = res["results"]
    tgt = {}
    for n in map(str, ctxs):
        g, o = r.get("ours_gpu", {}).get(n), r.get("ours_offload", {}).get(n)
        hg = (r.get("hf_gpu_cache") or {}).get(n)
        ho = (r.get("hf_offloaded_cache") or {}).get(n)
        t = {}
        if g and o:
            t["offload_prefill_vs_gpu"] = o["prefill_tok_per_s"] / g["prefill_tok_per_s"]
            t["offload_equals_gpu_tokens"] = o["token_ids"] == g["token_ids"]
        os_ = r.get("ours_offload_triton", {}).get(n)
        if o and hg:
            t["offload_prefill_vs_hf_gpu"] = o["prefill_tok_per_s"] / hg["prefill_tok_per_s"]
        if os_ and hg:
            t["offload_triton_prefill_vs_hf_gpu"] = os_["prefill_tok_per_s"] / hg["prefill_tok_per_s"]
        if os_ and o:
            t["fastest_prefill_attention"] = (f"auto ({auto})" if o["prefill_tok_per_s"] >= os_["prefill_tok_per_s"]
                                              else "xoffload flash_attn_with_lse")
        if g and hg:
            t["gpu_decode_vs_hf_gpu"] = g["decode_ms_per_token"] / hg["decode_ms_per_token"]
        if o and ho:
            t["offload_decode_speedup_vs_hf_offloaded"] = ho["decode_ms_per_token"] / o["decode_ms_per_token"]
        if o and h2d:
            bound_ms = (int(n) * res["kv_bytes_per_token"]) / (h2d * 1e9) * 1e3
            t["h2d_bound_ms_per_token"] = bound_ms
            t["offload_decode_vs_h2d_bound"] = o["decode_ms_per_token"] / bound_ms
        if o:
            t["offload_peak_minus_weights_GB"] = (o["peak_gpu_memory_bytes"] - res["weights_bytes"]) / 1e9
        tgt[n] = t
    res["targets"] = tgt

    rows = []
    for name in ("ours_gpu", "ours_offload", "ours_offload_triton", "hf_gpu_cache", "hf_offloaded_cache"):
        for n, v in (r.get(name) or {}).items():
            if isinstance(v, dict):
                rows.append({"impl": name, "ctx": n, "prefill_tok/s": v["prefill_tok_per_s"],
                             "ttft_ms": v["ttft_ms"], "decode_ms/tok": v["decode_ms_per_token"] or float("nan"),
                             "peak_GiB": v["peak_gpu_memory_bytes"] / 2**30})
    print(fmt_table(rows, ["impl", "ctx", "prefill_tok/s", "ttft_ms", "decode_ms/tok", "peak_GiB"]))
    if h2d:
        print(f"H2D {h2d:.1f} GB/s; KV bytes/token {res['kv_bytes_per_token']}")
    for n, t in tgt.items():
        print(n, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()})
    if "cap_24GiB_128K" in r:
        c = r["cap_24GiB_128K"]
        print("24 GiB cap, 128K:", {m: c[m].get("status") for m in ("gpu", "offload") if m in c})
    if res["errors"]:
        print("errors:", res["errors"])
    for v in r.values():  # token ids are bulky: keep the first few
        if isinstance(v, dict):
            for x in v.values():
                if isinstance(x, dict) and "token_ids" in x:
                    x["token_ids"] = x["token_ids"][:N_NEW]
    path = write_json("model", res, out_dir)
    print(f"wrote {path}")
    return res


def _one_sequence_store(llm, ids, max_new):
    """The KV store ``llm``'s engine serves its configuration with (the store table,
    :func:`xoffload.kv.table.batch_store_class`), opened for one sequence of prompt ``ids`` and up
    to ``max_new`` new tokens, with that sequence admitted: ``(store, sequence)``. Prefill it with
    ``model.prefill(ids, store.sink(seq))``, then ``store.set_batch([seq])`` and per step
    ``begin_step``, ``model.decode_step(tok, store.pos[:1], store)``, ``end_step``, ``advance``."""
    from xoffload import SamplingParams
    from xoffload.engine.request import Request
    from xoffload.engine.scheduler import Sequence

    e = llm.engine
    sp = SamplingParams(max_tokens=max_new, ignore_eos=True)
    seq = Sequence(0, Request.make(ids, sp, max_model_len=e.config.max_model_len, seed=0, stop_ids=(),
                                   device=e.model.device))
    st = e.store_cls.open(e.model, e.config, e.offload, [seq], **e.store_kw)
    st.admit(seq)
    return st, seq


def diagnose(preset="llama-3.2-1b", lengths=(3000, 33000), out_dir=None, device="cuda", steps=4) -> dict:
    """Find where ``offload`` and ``gpu`` modes part: the tokens each LLM generates, then the two
    stores the engine runs them with (``ResidentBatchKV``, ``OffloadBatchKV``: one sequence each,
    driven by hand): prefill logits through each store's sink, the K/V each stored (the resident
    pool's rows against the pinned pool's, ``host_kv``), then ``steps`` decode steps' logits with
    the same input tokens (the resident run's greedy ones). Prints and writes
    ``model_diagnose.json``; returns the report."""
    from xoffload import LLM, SamplingParams
    from xoffload.models import random_model

    model = random_model(preset, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device,
                         seed=0, std=0.02 if device == "cuda" else 0.15)
    cfg = model.cfg
    rep = {"name": "model_diagnose", "env": env_record(), "preset": preset, "cases": {}}
    for n in lengths:
        case = {}
        ids = _prompt(n, cfg.vocab_size)
        ids_t = torch.tensor(ids, device=device)
        g = o = None
        stores = []
        try:
            sp = SamplingParams(max_tokens=6, ignore_eos=True)
            g = LLM(model, mode="gpu", max_model_len=n + 16)
            o = LLM(model, mode="offload", max_model_len=n + 16)
            case["tokens_gpu"] = g.generate(ids, sp)[0].token_ids
            case["tokens_offload"] = o.generate(ids, sp)[0].token_ids
            # prefill through both stores, same model, same input
            from xoffload.kernels import cpu_backend

            with torch.no_grad(), (cpu_backend("reference") if device == "cpu" else contextlib.nullcontext()):
                for x in (g, o):
                    stores.append(_one_sequence_store(x, ids, steps + 1))
                (gs, gq), (os_, oq) = stores
                case["stores"] = [type(gs).__name__, type(os_).__name__]
                lg = model.prefill(ids_t, gs.sink(gq), chunk=8192)
                lo = model.prefill(ids_t, os_.sink(oq), chunk=8192)
                case["prefill_logits_max_abs_diff"] = float((lg - lo).abs().max())
                case["prefill_logits_nan"] = [bool(lg.isnan().any()), bool(lo.isnan().any())]
                case["first_token"] = [int(lg.argmax()), int(lo.argmax())]
                rows = gs.pool.rows(gq.kv["table"], n).to(device)
                kv_diff = {}
                for layer in sorted({0, 1, cfg.num_layers // 2, cfg.num_layers - 1}):
                    hk, hv = o.offload.host_kv(oq.kv["sid"], layer)
                    kv_diff[layer] = [float((hk.to(device).float() - gs.pool.k[layer][rows].float()).abs().max()),
                                      float((hv.to(device).float() - gs.pool.v[layer][rows].float()).abs().max())]
                case["stored_kv_max_abs_diff_by_layer"] = kv_diff
                for st, seq in stores:
                    seq.n_out = 1  # the prefill's token: decode starts at position n
                    st.set_batch([seq])
                model.rope_tables(n + steps + 1)
                diffs = []
                tok = lg.argmax(-1).view(1)
                for _ in range(steps):
                    out = []
                    for st, _seq in stores:
                        st.begin_step()
                        out.append(model.decode_step(tok, st.pos[:1], st))
                        st.end_step()
                        st.advance()
                    diffs.append(float((out[0] - out[1]).abs().max()))
                    tok = out[0].argmax(-1)
                case["decode_logits_max_abs_diff"] = diffs
        except Exception as e:  # noqa: BLE001
            case["error"] = f"{type(e).__name__}: {e}"
            case["traceback"] = traceback.format_exc()[-2000:]
        finally:
            for st, seq in stores:
                st.release(seq)
                st.close()
            for x in (g, o):
                if x is not None:
                    x.close()
        rep["cases"][str(n)] = case
        print(n, {k: v for k, v in case.items() if k != "traceback"}, flush=True)
        _free()
    write_json("model_diagnose", rep, out_dir)
    return rep


@requires_cuda
def test_bench_model(benchmark):
    res = benchmark.pedantic(lambda: run(quick=True), rounds=1, iterations=1)
    benchmark.extra_info.update({"targets": res["targets"], "errors": res["errors"]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32K only, no memory-cap section")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--no-cap", action="store_true", help="skip the 24 GiB cap section")
    ap.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    ap.add_argument("--diagnose", action="store_true",
                    help="compare offload and gpu modes stage by stage (prefill logits, stored KV, decode)")
    ap.add_argument("--diagnose-preset", default="llama-3.2-1b")
    a = ap.parse_args(argv)
    if not HAS_CUDA:
        print("bench_model: no CUDA GPU, skipped")
        return 0
    if a.diagnose:
        diagnose(a.diagnose_preset, out_dir=a.out)
        return 0
    res = run(quick=a.quick, out_dir=a.out, peers=not a.no_peers, cap=not a.no_cap)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
