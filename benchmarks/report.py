"""docs/RESULTS.md from benchmarks/results/*.json: ``python -m benchmarks.report [--check]``.

The one source of the project's figures. Every table names the machine (the GPU recorded in the
JSON), the commit the run measured, the command that made it, and whether the result is still
current: a result is **stale** when the code it measures (``CODE`` below) changed after the
recorded commit (``git log -1 -- PATHS`` is not an ancestor of it), **commit unknown** when the JSON
records none, **commit not in history** when git does not know it. The output depends only on the
JSON files and the git history, never on the clock.

:data:`HEADLINES` holds the figures README.md quotes: anchor -> the numbers as printed; the test
``tests/test_report.py`` checks that README's bold numbers on the line that links to an anchor are
exactly these, and that the committed RESULTS.md equals a fresh :func:`render`.

Plots: the PNGs in docs/ were drawn from the same JSONs by the scripts named under each table
(``bench_e2e.py --replot``, ``bench_batch.py --replot-cap``); the report links them.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUT = os.path.join(ROOT, "docs", "RESULTS.md")

# benchmark -> the code it measures (a result is stale when any of it changed after its commit)
_ENGINE = ["xoffload/engine", "xoffload/runtime", "xoffload/sparse", "xoffload/kernels", "xoffload/models"]
CODE = {
    "e2e": _ENGINE,
    "batch": _ENGINE,
    "session": _ENGINE,
    "ruler": _ENGINE + ["xoffload/evals"],
    "attention": ["xoffload/kernels/flash_attn.py", "xoffload/kernels/flash_attn_opts.py",
                  "xoffload/kernels/launch.py"],
    "decode": ["xoffload/kernels/decode.py"],
    "paged_decode": ["xoffload/kernels/paged_decode.py"],
    "merge": ["xoffload/kernels/merge.py"],
    "topk": ["xoffload/kernels/topk.py"],
    "quest_score": ["xoffload/kernels/quest_score.py", "xoffload/kernels/channel_score.py"],
    "layer_ops": ["xoffload/kernels/norm.py", "xoffload/kernels/swiglu.py", "xoffload/kernels/rope.py"],
    "xattn": ["xoffload/kernels/xattn.py", "xoffload/kernels/block_sparse.py", "xoffload/kernels/block_index.py",
              "xoffload/sparse/xattention.py"],
    "transfer": ["xoffload/runtime", "xoffload/kernels/gather.py"],
    "needle": _ENGINE + ["xoffload/evals"],
    "conversations": _ENGINE,
}

# the latest run of the benchmarks the tables above do not show: kept, indexed with their status
OTHER = {
    "attention_options.json": ("attention", "python benchmarks/bench_flash_attn.py --suite options "
                                   "--cases window,paged,softcap,alibi --seqs 32768,131072"),
    "attention_options_scores.json": ("attention", "python benchmarks/bench_flash_attn.py --suite options "
                                          "--cases softcap,alibi --no-flex"),
    "xattn.json": ("xattn", "python benchmarks/bench_xattn.py --quick"),
    "xattn_real.json": ("xattn", "python benchmarks/bench_xattention_real.py"),
    "xattn_bs_sweep.json": ("xattn", "python benchmarks/bench_block_sparse.py --quick"),
    "transfer.json": ("transfer", "python benchmarks/bench_offload.py --quick"),
    "e2e_full.json": ("e2e", "python benchmarks/bench_e2e.py --time-budget 545 (the basis of --plan's timings)"),
    "e2e_rest.json": ("e2e", "python benchmarks/bench_e2e.py --part qwen,smollm2,stall (the basis of --plan's timings)"),
    "model.json": ("e2e", "python benchmarks/bench_llm.py"),
    "needle_quest.json": ("needle", "python benchmarks/bench_needle_sparse.py"),
    "needle_dense_h200.json": ("needle", "xoffload needle --lengths 1k,2k,4k,8k --num-depths 10"),
    "conversations_n8_engine.json": ("conversations", "python benchmarks/bench_conversations.py --convs 8 --modes "
                                     "offload+quest,resident (the resident leg ran out of memory under the cap at its "
                                     "first 32K prefill, after the offload leg in the same process)"),
    "session_turns.json": ("session", "python benchmarks/bench_session.py --part profile,turns (measured a "
                           "session that stored its own history; its parts record turn2_dense and turn3_sparse)"),
}

# file -> (benchmark, command that wrote it)
SOURCES = {
    "e2e_defaults_new64.json": ("e2e", "python benchmarks/bench_e2e.py --part 8b --lengths 32768,131072 "
                                "--configs resident,offload+quest,offload+quest-ch --no-peers --new 64"),
    "e2e.json": ("e2e", "python benchmarks/bench_e2e.py --time-budget 560"),
    "ruler_smollm2_questch.json": ("ruler", None),  # the eval records its own command
    "ruler_smollm2_session.json": ("ruler", None),
    "ruler_smollm2_fp32_hf.json": ("ruler", None),
    "ruler_smollm2_reuse.json": ("ruler", None),
    "session_prefix_batch.json": ("session", "python benchmarks/bench_session.py --part prefix_batch"),
    "batch_cap_b16_allsparse.json": ("batch", "python benchmarks/bench_batch.py --part cap --no-peers "
                                     "--cap-batches 16 --cap-resident 1 --new 32 --dense-layers none"),
    "batch_cap_b16_default.json": ("batch", "python benchmarks/bench_batch.py --part cap --no-peers "
                                   "--cap-batches 16 --cap-resident 1 --new 32"),
    "batch_long_128k.json": ("batch", "python benchmarks/bench_batch.py --part long --no-peers "
                             "--long-batches max --new 32"),
    "attention.json": ("attention", "python benchmarks/bench_flash_attn.py --quick"),
    "decode.json": ("decode", "python benchmarks/bench_decode.py"),
    "paged_decode.json": ("paged_decode", "python benchmarks/bench_paged_decode.py --quick"),
    "merge.json": ("merge", "python benchmarks/bench_merge.py"),
    "topk.json": ("topk", "python benchmarks/bench_topk.py"),
    "quest_score.json": ("quest_score", "python benchmarks/bench_quest_score.py"),
    "layer_ops.json": ("layer_ops", "python benchmarks/bench_layer_ops.py --quick"),
    "e2e_engine_before.json": ("e2e", "python benchmarks/bench_e2e.py --part 8b --lengths 32768,131072 "
                               "--configs resident,offload+quest --no-peers --new 64 (the code before the step loop)"),
    "e2e_engine_after.json": ("e2e", "python benchmarks/bench_e2e.py --part 8b --lengths 32768,131072 "
                              "--configs resident,offload+quest --no-peers --new 64"),
    "batch_cap_engine_before.json": ("batch", "python benchmarks/bench_batch.py --part cap --cap-batches 16 "
                                     "--cap-resident 4 --new 16 --no-peers (the code before the step loop)"),
    "batch_cap_engine_after.json": ("batch", "python benchmarks/bench_batch.py --part cap --cap-batches 16 "
                                    "--cap-resident 4 --new 16 --no-peers"),
    "conversations.json": ("conversations", "python benchmarks/bench_conversations.py --convs 8"),
    "conversations_n4_16.json": ("conversations", "python benchmarks/bench_conversations.py --convs 4,16 "
                                 "--modes offload+quest,resident"),
    "ruler_real_4k.json": ("ruler", None),
    "ruler_real_8k.json": ("ruler", None),
    "e2e_fp8.json": ("e2e", "python benchmarks/bench_e2e.py --part 8b --lengths 32768,131072 --configs resident,"
                     "offload,offload-fp8,offload+quest,offload+quest-fp8,offload+quest-fp8-token,"
                     "offload+quest-nocache,offload+quest-fp8-nocache --no-peers --new 32"),
    "ruler_fp8_4k.json": ("ruler", None),
    "ruler_fp8_8k.json": ("ruler", None),
    "ruler_policy_sweep.json": ("ruler", "python -m xoffload eval --data ../shared/ruler_data/L/*.jsonl --modes "
                                "offload,offload+quest@B/ch=R/alpha=A[/page=P][/dense=I.J] --max-new-tokens 48 "
                                "(L = 4096, 8192; 10 such runs side by side: the file's commands)"),
}

GB = 1e9


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------- git: is a result still current
def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@functools.lru_cache(maxsize=None)
def _last_change(paths: tuple) -> str | None:
    out = _git("log", "-1", "--format=%H", "--", *paths).stdout.strip()
    return out or None


def env_of(d: dict) -> dict:
    """GPU, commit and date of a result, wherever its schema keeps them."""
    e = d.get("env") or d.get("meta") or d
    commit = e.get("commit") or d.get("commit")
    m = re.match(r"[0-9a-f]{7,40}", str(commit or ""))
    gpu = e.get("gpu") or d.get("gpu")
    if gpu is None and "H200" in str(d.get("command", "")):
        gpu = "NVIDIA H200"
    return {"gpu": gpu or "unknown", "commit": m.group(0)[:7] if m else None,
            "dirty": "dirty" in str(commit or ""), "date": str(e.get("date") or "")[:10] or "unknown"}


def status(commit: str | None, bench: str) -> str:
    if not commit:
        return "commit unknown"
    if _git("cat-file", "-e", commit + "^{commit}").returncode != 0:
        return "commit not in history"
    last = _last_change(tuple(CODE[bench]))
    if last and _git("merge-base", "--is-ancestor", last, commit).returncode != 0:
        return "stale: the measured code changed since"
    return "current"


def provenance(name: str) -> str:
    d = load(name)
    bench, cmd = {**SOURCES, **OTHER}[name]
    e = env_of(d)
    cmd = cmd or re.sub(r"^\S*__main__\.py", "xoffload", str((d.get("meta") or {}).get("command") or d.get("command")))
    cmd = re.sub(r" --out \S+", "", cmd)
    commit = (e["commit"] or "unknown") + (" (uncommitted changes)" if e["dirty"] else "")
    return (f"Source `benchmarks/results/{name}` · machine: {e['gpu']} · commit `{commit}` · {e['date']} · "
            f"**{status(e['commit'], bench)}**  \nCommand: `{cmd}`")


# ---------------------------------------------------------------- tables
def fmt(x) -> str:
    """Three significant figures or so: 5.91, 26.7, 349."""
    if x is None:
        return ""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def anchor(aid: str) -> str:
    return f'<a id="{aid}"></a>'


HEADLINES: dict = {}


def headline(aid: str, *values: str) -> str:
    HEADLINES[aid] = list(values)
    return anchor(aid)


def steady(d: dict, key: str, length: int):
    r = d["results"].get(key, {}).get(str(length))
    return r.get("decode_steady_ms_per_token") if isinstance(r, dict) else None


def sec_e2e_defaults() -> str:
    name = "e2e_defaults_new64.json"
    d = load(name)
    w = d["models"]["8b"]["weights_bytes"]
    rows = []
    for cfg, label in [("resident", "`resident`"), ("offload+quest", "`offload+quest` (budget 2048)"),
                       ("offload+quest-ch", "`offload+quest-ch` (16 exact channels)")]:
        for L in (32768, 131072):
            r = d["results"][f"8b/{cfg}"][str(L)]
            ms, res = r["decode_steady_ms_per_token"], steady(d, "8b/resident", L)
            ratio = ms / res
            cell = label
            if cfg == "offload+quest":
                k = "128k" if L == 131072 else "32k"
                vals = [f"{ms:.2f}", f"{res:.2f}"] + ([f"{(r['peak_gpu_memory_bytes'] - w) / GB:.2f}"] if L == 131072 else [])
                cell = headline(f"e2e-8b-quest-{k}", *vals) + label
            rows.append([cell, f"{L // 1024}K", f"{ms:.2f}", f"{ratio:.3f}×",
                         f"{r['h2d_bytes_per_token'] / 1e6:.1f}" if r.get("h2d_bytes_per_token") else "0",
                         f"{100 * r['cache_hit_rate']:.0f}%" if r.get("cache_hit_rate") else "",
                         f"{(r['peak_gpu_memory_bytes'] - w) / GB:.2f}"])
    return "\n\n".join([
        "## End to end: Llama-3.1-8B shape, today's defaults", provenance(name),
        f"Random weights, bf16, 64 new tokens; decode in the steady state (CUDA-graph replays). "
        f"H2D {d['h2d_GBps']:.1f} GB/s and HBM copy {d['hbm_GBps']:.0f} GB/s measured in the same run.",
        table(["configuration", "context", "decode ms/token", "÷ resident", "H2D MB/token", "cache hits",
               "peak GPU memory − weights (GB)"], rows),
        "![8B end to end, defaults](e2e_defaults_new64_8b.png)"])


E2E_CONFIGS = ["resident", "resident+quest", "resident+quest-ch", "offload", "offload-uva", "offload-ring",
               "offload+xattn", "offload+quest", "offload+quest-ch", "hf_gpu_cache", "hf_offloaded_cache"]
#: configurations the recorded runs measured that the library no longer offers -> what they were
#: (their rows stay: they are what those runs measured)
REMOVED_CONFIGS = {"offload-ring": "dense offload decode through a ring of whole GPU layers, eager; removed "
                                   "since: `offload` streams each layer through two GPU buffers inside the step's "
                                   "CUDA graph"}


def sec_e2e_all() -> str:
    name = "e2e.json"
    d = load(name)
    parts, shown = [], set()
    for part, title, png in [("8b", "Llama-3.1-8B shape (random weights)", "e2e_8b.png"),
                             ("qwen3_8b", "Qwen3-8B shape (random weights)", "e2e_qwen3_8b.png"),
                             ("smollm2", "SmolLM2-135M (real weights)", "e2e_smollm2.png")]:
        lengths = sorted({int(L) for k, v in d["results"].items() if k.startswith(part + "/")
                          and isinstance(v, dict) for L in v if L.isdigit()})
        rows = []
        for cfg in E2E_CONFIGS:
            key = f"{part}/{cfg}"
            if not isinstance(d["results"].get(key), dict):
                continue
            vals = [steady(d, key, L) for L in lengths]
            shown.add(cfg)
            cell = f"`{cfg}`"
            if part == "8b" and cfg == "offload":
                cell = headline("e2e-8b-offload", f"{vals[-1]:.0f}") + cell
            rows.append([cell] + [fmt(v) for v in vals])
        parts += [f"### {title}",
                  table(["decode ms/token"] + [f"{L // 1024}K" for L in lengths], rows),
                  f"![{title}]({png})"]
    return "\n\n".join([
        "## End to end: every configuration", provenance(name),
        "bf16, 12 new tokens per point, decode in the steady state; `hf_*`: transformers `generate` "
        "with its cache on the GPU / offloaded, on the same weights and prompts. The reuse bias was 2 then "
        "(8 now): the Quest rows are slower than today's (table above)."
        + "".join(f" `{c}`: {REMOVED_CONFIGS[c]}." for c in E2E_CONFIGS if c in REMOVED_CONFIGS and c in shown)]
        + parts)


def ruler_rows(name: str, modes=None, base="resident") -> list:
    d = load(name)
    rows = []
    for m, avg in d["average"].items():
        if modes and m not in modes:
            continue
        by = d["average_by_length"].get(m, {})
        ag = d["agreement"].get(m, {})
        rows.append([m, avg, by.get("4096"), by.get("8192"),
                     f"{ag['same_score']}/{ag['total']}" if ag else "",
                     f"{ag['token_identical']}/{ag['total']}" if ag else ""])
    return rows


def sec_ruler() -> str:
    out = ["## Accuracy: RULER-style, SmolLM2-135M",
           "11 tasks (8 needle variants, variable tracking, common / frequent words) × 4K and 8K tokens, "
           "score 0-100 averaged over the 22 cells; agreement with the first mode of the run, sample by sample."]
    name = "ruler_smollm2_reuse.json"
    d = load(name)
    rows = []
    for m, avg in d["average"].items():
        if m == "offload+quest-ch@512":
            cell = headline("ruler-questch-512", f"{avg:.2f}", f"{d['average']['resident']:.2f}") + f"`{m}`"
        else:
            cell = f"`{m}`"
        rows.append([cell, f"{d['prompts_per_mode'][m]}", f"{avg:.2f}", f"{d['average_on_common_prompts'][m]:.2f}"])
    out += ["### Decode policies at budget 512, default reuse bias", provenance(name),
            "The run's time limit stopped the last mode after 133 of 220 prompts; the last column averages the "
            "133 prompts every mode answered.",
            table(["mode", "prompts", "average", "average on the common 133"], rows)]
    for name, title, png in [("ruler_smollm2_questch.json", "`quest-ch` at every budget", "ruler_smollm2_questch.png"),
                             ("ruler_smollm2_session.json", "Asked as the second turn of a session", None),
                             ("ruler_smollm2_fp32_hf.json", "fp32: our resident mode against transformers (`hf`)", None)]:
        rows = [[f"`{r[0]}`", f"{r[1]:.2f}", f"{r[2]:.2f}", f"{r[3]:.2f}", r[4], r[5]] for r in ruler_rows(name)]
        out += [f"### {title}", provenance(name),
                table(["mode", "average", "4K", "8K", "same score", "token-identical"], rows)]
        if png:
            out.append(f"![{title}]({png})")
    return "\n\n".join(out)


def sec_session() -> str:
    name2 = "session_prefix_batch.json"
    pb = load(name2)["results"]["prefix_batch"]
    pc, nr = pb["prefix_caching"], pb["no_reuse"]
    rows2 = [[headline("prefix-batch", f"{pc['ratio_all_to_one']:.2f}") + "prefix caching",
              f"{pc['one_s']:.2f}", f"{pc['all_s']:.2f}", f"{pc['ratio_all_to_one']:.2f}×"],
             ["no reuse", f"{nr['one_s']:.2f}", f"{nr['all_s']:.2f}", f"{nr['ratio_all_to_one']:.2f}×"]]
    return "\n\n".join([
        "## Prefix caching, Llama-3.1-8B shape", provenance(name2),
        f"`resident`, `max_num_seqs={pb['max_num_seqs']}`: {pb['questions']} questions of {pb['question_tokens']} "
        f"tokens over one {pb['doc_tokens'] // 1024}K document, {pb['new_tokens']} new tokens each; all of them "
        "against one alone.",
        table(["", "one request (s)", f"all {pb['questions']} (s)", "ratio"], rows2)])


def sec_batch() -> str:
    out = ["## Batched decode, Llama-3.1-8B shape"]
    rows = []
    for name, label in [("batch_cap_b16_allsparse.json", "16 prompts, every layer sparse"),
                        ("batch_cap_b16_default.json", "16 prompts, default policy (layers 0-1 dense)")]:
        d = load(name)
        c = d["results"]["cap_part"]
        tg = c["targets"]
        cell = label
        if "allsparse" in name:
            cell = headline("batch-cap-16", f"{tg['offload_quest_best_tok_per_s']:.0f}",
                            f"{tg['offload_quest_over_resident']:.2f}") + label
        rows.append([cell, tg["most_offload_quest_seqs"], f"{tg['offload_quest_best_tok_per_s']:.0f}",
                     f"{tg['resident_under_cap_tok_per_s']:.0f}", f"{tg['offload_quest_over_resident']:.2f}×"])
        out.append(provenance(name))
    out += [f"32K-token contexts under a 24 GiB GPU cap (`torch.cuda.set_per_process_memory_fraction`); "
            "`offload` + Quest (budget 2048, reuse bias 8) with a page cache per sequence; `resident` fits one "
            "sequence there.",
            table(["", "sequences at once", "offload+quest tok/s", "resident tok/s", "ratio"], rows)]
    name = "batch_long_128k.json"
    lp = load(name)["results"]["long_part"]
    oq, rs = lp["offload_quest"], lp["resident"]
    n = max(oq, key=int)
    out += [provenance(name),
            f"128K-token contexts, no cap: host memory holds {lp['host_max_seqs']} sequences, the GPU "
            f"{lp['gpu_max_seqs']} for `resident`.",
            table(["", "sequences", "tok/s", "ms per step", "H2D MB per sequence and token"],
                  [["`offload` + Quest", n, f"{oq[n]['tok_per_s']:.0f}", f"{oq[n]['step_ms']:.2f}",
                    f"{oq[n]['h2d_bytes_per_token'] / 1e6:.1f}"],
                   ["`resident`", max(rs, key=int), f"{rs[max(rs, key=int)]['tok_per_s']:.0f}",
                    f"{rs[max(rs, key=int)]['step_ms']:.2f}", ""]])]
    return "\n\n".join(out)


def sec_prefill() -> str:
    name = "attention.json"
    d = load(name)
    rows = []
    for r in d["records"]:
        impl = r["impl"]
        ours = impl["ours"]["tflops"]
        cell = f"{r['shape']}, {r['S'] // 1024}K, {'causal' if r['causal'] else 'full'}"
        if r["shape"] == "d128_h32_kv8" and r["S"] == 32768 and r["causal"]:
            cell = headline("prefill-32k", f"{ours:.0f}", f"{r['ratios']['ours/flex']:.2f}") + cell
        peers = ", ".join(f"{k} {v['tflops']:.0f}" for k, v in impl.items() if k != "ours" and v.get("tflops"))
        rows.append([cell, f"{ours:.0f}", peers, f"{r['ratios']['ours/flex']:.2f}×"])
    return "\n\n".join(["## Kernels: dense prefill (`flash_attn_with_lse`)", provenance(name),
                        "bf16, batch 1; TFLOP/s by " + d["flops_rule"] + "; peers in the same run (SDPA's FLASH "
                        "and cuDNN backends return no LSE; FlexAttention does).",
                        table(["shape (D, query / KV heads), length", "ours TFLOP/s", "peers TFLOP/s", "ours ÷ Flex"],
                              rows)])


def _label(r: dict) -> str:
    if r.get("name"):
        return f"{r.get('kernel', '')} {r['name']}".strip()
    bits = [str(r.get(k)) for k in ("kernel", "case", "heads") if r.get(k)]
    for k, u in (("Sk", " tokens"), ("tokens", " tokens"), ("page", "-token pages"), ("B", " sequences")):
        if r.get(k) is not None:
            bits.append(f"{r[k]}{u}")
    return ", ".join(bits)


def sec_rows(name: str, title: str, frac_key: str, frac_label: str, head=None) -> str:
    d = load(name)
    rows = []
    for r in d["rows"]:
        cell = _label(r)
        if head and head[0](r):
            cell = headline(head[1], *[f(r) for f in head[2]]) + cell
        rows.append([cell, f"{r['ms'] * 1000:.1f}", f"{r['GBps']:.0f}",
                     f"{r[frac_key]:.2f}" if r.get(frac_key) is not None else ""])
    return "\n\n".join([f"## Kernels: {title}", provenance(name),
                        table(["case", "µs", "GB/s", frac_label], rows)])


def sec_other() -> str:
    out = ["## Other recorded runs",
           "The latest run of each benchmark the tables above do not show (their figures are in the JSON)."]
    for name in OTHER:
        out.append("- " + provenance(name).replace("  \n", " · "))
    return "\n\n".join(out)



def sec_engine() -> str:
    """The step loop against the code before it, in one device session."""
    before, after = load("e2e_engine_before.json"), load("e2e_engine_after.json")
    rows = []
    w = after["models"]["8b"]["weights_bytes"]
    for cfg in ("resident", "offload+quest"):
        for L in (32768, 131072):
            b, a = before["results"][f"8b/{cfg}"][str(L)], after["results"][f"8b/{cfg}"][str(L)]
            bm, am = b["decode_steady_ms_per_token"], a["decode_steady_ms_per_token"]
            cell = f"`{cfg}`"
            if cfg == "offload+quest":
                res = after["results"]["8b/resident"][str(L)]["decode_steady_ms_per_token"]
                vals = [f"{am:.2f}", f"{res:.2f}"] + ([f"{(a['peak_gpu_memory_bytes'] - w) / GB:.2f}"]
                                                      if L == 131072 else [])
                cell = headline(f"engine-quest-{L // 1024}k", *vals) + cell
            rows.append([cell, f"{L // 1024}K", f"{bm:.3f}", f"{am:.3f}", f"{am / bm:.3f}×",
                         f"{b['prefill_tok_per_s']:.0f}", f"{a['prefill_tok_per_s']:.0f}",
                         f"{a['prefill_tok_per_s'] / b['prefill_tok_per_s']:.3f}×"])
    cb, ca = load("batch_cap_engine_before.json"), load("batch_cap_engine_after.json")
    cap = []
    for what, key in (("offload+quest, 16 sequences", "offload_quest_best_tok_per_s"),
                      ("resident, as many as fit", "resident_under_cap_tok_per_s")):
        x, y = cb["results"]["cap_part"]["targets"][key], ca["results"]["cap_part"]["targets"][key]
        if key == "offload_quest_best_tok_per_s":
            t = ca["results"]["cap_part"]["targets"]
            what = headline("engine-cap-16", f"{y:.0f}", f"{t['offload_quest_over_resident']:.2f}") + what
        cap.append([what, f"{x:.0f}", f"{y:.0f}", f"{y / x:.3f}×"])
    return "\n\n".join([
        "## The step loop: speed before and after",
        "Llama-3.1-8B shape, one request at a time through `LLMEngine` against the one-request loop it "
        "replaced, same machine, same session; steady-state decode (first two steps left out).",
        provenance("e2e_engine_before.json"), provenance("e2e_engine_after.json"),
        anchor("engine-speed") + "\n\n" + table(["config", "context", "decode ms/token before", "after", "after ÷ before",
                                        "prefill tok/s before", "after", "after ÷ before"], rows),
        "Batched decode under a 24 GiB GPU memory cap (32K tokens per sequence, 16 new), tok/s:",
        provenance("batch_cap_engine_before.json"), provenance("batch_cap_engine_after.json"),
        table(["load", "before", "after", "after ÷ before"], cap)])


def sec_conversations() -> str:
    name, more = "conversations.json", "conversations_n4_16.json"
    d = load(name)
    rows = []
    results = dict(d["results"], **load(more)["results"])
    for key, r in sorted(results.items(), key=lambda kv: (int(kv[0].split("/")[1]), kv[0])):
        if "tok_per_s" not in r:
            rows.append([f"`{key}`", r.get("status", "")] + [""] * 7)
            continue
        rows.append([f"`{key}`", f"{r['tok_per_s']:.1f}", f"{r['followup_ttft_ms_p50']:.0f}",
                     f"{r['followup_ttft_ms_p99']:.0f}", f"{r['itl_ms_p50']:.1f}", f"{r['itl_ms_p99']:.1f}",
                     f"{(r['h2d_bytes_per_token'] or 0) / 1e6:.1f}", f"{r['peak_gpu_memory_bytes'] / GB:.1f}",
                     f"{r['host_rss_peak_bytes'] / GB:.1f}"])
    t = []
    for n, x in d.get("targets", {}).items():
        ttft, sp = x.get("followup_ttft_p99_s"), x.get("speedup_vs_resident")
        t.append(f"N={n}: follow-up TTFT p99 {ttft:.2f} s (target ≤ {x['followup_ttft_p99_target_s']} s: "
                 f"{'met' if ttft is not None and ttft <= x['followup_ttft_p99_target_s'] else 'missed'}); "
                 f"tok/s {sp:.2f}× resident under the cap (target ≥ {x['speedup_target']}×: "
                 f"{'met' if sp is not None and sp >= x['speedup_target'] else 'missed'}).")
    return "\n\n".join([
        "## Many conversations at once",
        f"{d['shape']} shape, N conversations over their own {d['doc_tokens']}-token documents, {d['questions']} "
        f"questions of {d['q_tokens']} tokens each, {d['answer_tokens']} tokens per answer, arriving "
        f"{d['gap_ms']:.0f} ms apart, {d['cap_gib']:.0f} GiB GPU cap. TTFT: queue + prefill + first token (CUDA "
        "events); ITL: decode step times; host RSS: the process's peak so far. The project's targets for this "
        "load: a follow-up question's TTFT p99 at most 0.3 s, and 3× the tok/s of resident mode under the "
        "same cap.", provenance(name), provenance(more),
        anchor("conversations") + "\n\n" + table(["mode / N", "tok/s", "follow-up TTFT p50 ms", "p99 ms", "ITL p50 ms",
                                         "p99 ms", "H2D MB/token", "peak GPU GB", "host RSS GB"], rows),
        " ".join(t)])


def sec_ruler_real() -> str:
    a, b = load("ruler_real_4k.json"), load("ruler_real_8k.json")
    base = "offload"
    rows = []
    for m in a["average"]:
        x, y = a["average"][m], b["average"][m]
        cell = f"`{m}`"
        if m == "offload+quest-ch@512":
            cell = headline("ruler-real-questch", f"{x:.1f}", f"{a['average'][base]:.1f}", f"{y:.1f}",
                            f"{b['average'][base]:.1f}") + cell
        if m == "offload+quest@512":
            cell = headline("ruler-real-quest", f"{a['average'][base] - x:.1f}", f"{b['average'][base] - y:.1f}") + cell
        worst = min(a["table"][m][t]["4096"] - a["table"][base][t]["4096"] for t in a["table"][m]) \
            if m != base else 0.0
        rows.append([cell, f"{x:.1f}", f"{x - a['average'][base]:+.1f}", f"{y:.1f}",
                     f"{y - b['average'][base]:+.1f}", f"{worst:+.1f}"])
    return "\n\n".join([
        "### Real RULER data (NVIDIA's generator, SmolLM2 tokenizer)",
        "`../shared/ruler_data`: 11 tasks × 20 samples at 4K and 8K, prompts as RULER sends them "
        "(`input + answer_prefix`, no chat template), 48 new tokens.",
        provenance("ruler_real_4k.json"), provenance("ruler_real_8k.json"),
        anchor("ruler-real") + "\n\n" + table(["mode", "4K average", "vs dense", "8K average", "vs dense",
                                      "worst task vs dense (4K)"], rows)])

def sec_policy_sweep() -> str:
    """The real-RULER sweep of Quest's exact key channels, page size and dense layers at budgets
    256 and 512 (SmolLM2): average and worst task, each against dense offload."""
    d = load("ruler_policy_sweep.json")
    avg, tab = d["average"], d["table"]
    modes = sorted(avg["4096"], key=lambda m: (m != "offload", m.split("@")[1] if "@" in m else "", m))
    rows = []
    for m in modes:
        row = [f"`{m}`"]
        for L in ("4096", "8192"):
            a, b = avg[L][m], avg[L]["offload"]
            worst = min(tab[L][m][t] - tab[L]["offload"][t] for t in tab[L][m])
            row += [f"{a:.1f}", f"{a - b:+.1f}" if m != "offload" else "", f"{worst:+.1f}" if m != "offload" else ""]
        rows.append(row)
    return "\n\n".join([
        "### Sparse-decode policy sweep on the real RULER data",
        "Quest with `R` exact key channels (`/ch=R`) and the bound scaled by `A` on the rest (`/alpha=A`), "
        "page size (`/page=P`) and dense layers (`/dense=I.J`), at budgets 256 and 512 (6.25% and 3.1% of "
        "an 8K context), against dense offload on the same data (11 tasks x 20 samples, SmolLM2, 48 new "
        "tokens). A task score moves in steps of 5 (one sample of 20); the same configuration has moved "
        "1.6 points on the 4K average between two runs of different commits. SmolLM2's head dim is 64, "
        "so `ch=32` keeps half of each key's channels exact.",
        provenance("ruler_policy_sweep.json"),
        anchor("ruler-policy-sweep") + "\n\n" + table(
            ["policy", "4K avg", "vs dense", "worst task", "8K avg", "vs dense", "worst task"], rows)])


def sec_fp8() -> str:
    """The fp8 KV cache beside its 16-bit twin (decode, H2D bytes) and on the real RULER data."""
    name = "e2e_fp8.json"
    d = load(name)
    rows = []
    for fp8, bf in [("offload-fp8", "offload"), ("offload+quest-fp8", "offload+quest"),
                    ("offload+quest-fp8-token", "offload+quest"),
                    ("offload+quest-fp8-nocache", "offload+quest-nocache")]:
        row = [f"`{fp8}`"]
        for L in ("32768", "131072"):
            a, b = d["results"][f"8b/{fp8}"][L], d["results"][f"8b/{bf}"][L]
            row += [fmt(a["decode_steady_ms_per_token"]), fmt(b["decode_steady_ms_per_token"]),
                    f"{a['decode_steady_ms_per_token'] / b['decode_steady_ms_per_token']:.2f}",
                    f"{a['h2d_bytes_per_token'] / b['h2d_bytes_per_token']:.3f}"]
        rows.append(row)
    def ratio128(fp8, bf):
        a, b = d["results"][f"8b/{fp8}"]["131072"], d["results"][f"8b/{bf}"]["131072"]
        return f"{a['decode_steady_ms_per_token'] / b['decode_steady_ms_per_token']:.2f}"
    heads = [ratio128("offload-fp8", "offload"), ratio128("offload+quest-fp8-nocache", "offload+quest-nocache"),
             ratio128("offload+quest-fp8-token", "offload+quest"), ratio128("offload+quest-fp8", "offload+quest")]
    bound = d["results"]["8b/offload-fp8"]["131072"]["h2d_bytes_per_token"] / (d["h2d_GBps"] * 1e9) * 1e3
    dense = d["results"]["8b/offload-fp8"]["131072"]["decode_steady_ms_per_token"]
    sweep, r4, r8 = load("ruler_policy_sweep.json")["average"], load("ruler_fp8_4k.json"), load("ruler_fp8_8k.json")
    acc = []
    for m in r4["average"]:
        a4, a8 = r4["average"][m], r8["average"][m]
        b4, b8 = sweep["4096"][m], sweep["8192"][m]
        acc.append([f"`{m}`", f"{a4:.1f}", f"{b4:.1f}", f"{a4 - b4:+.1f}", f"{a8:.1f}", f"{b8:.1f}", f"{a8 - b8:+.1f}"])
    return "\n\n".join([
        "### FP8 (e4m3) KV cache",
        "`kv_cache_dtype=\"fp8\"`: e4m3 codes with fp32 scales (per 64 tokens or Quest page and KV head; "
        "`-token`: per token) in the pinned pool, the staging buffers, the page caches and the GPU tail. "
        "Decode ms/token in the steady state, fp8 beside its 16-bit twin in one run; H2D: bytes per token "
        f"÷ the twin's. Dense fp8 offload at 128K: {dense:.0f} ms = {dense / bound:.2f}× its PCIe bound "
        f"({bound:.0f} ms at {d['h2d_GBps']:.0f} GB/s).", provenance(name),
        headline("fp8", *heads) + "\n\n" + table(["config", "32K fp8", "32K 16-bit", "÷", "H2D ÷", "128K fp8", "128K 16-bit",
                                         "÷", "H2D ÷"], rows),
        "Real RULER data, fp8 against bf16 (the bf16 column is the policy sweep's run, another process "
        "on another GPU: the H200):", provenance("ruler_fp8_4k.json"), provenance("ruler_fp8_8k.json"),
        table(["mode", "4K fp8", "4K bf16", "Δ", "8K fp8", "8K bf16", "Δ"], acc)])


def render() -> str:
    HEADLINES.clear()
    secs = [sec_e2e_defaults(), sec_engine(), sec_conversations(), sec_e2e_all(), sec_ruler(), sec_ruler_real(), sec_policy_sweep(), sec_fp8(),
            sec_session(), sec_batch(), sec_prefill(),
            sec_rows("decode.json", "split-KV decode (`decode_attn_with_lse`)", "frac_of_hbm_copy",
                     "÷ HBM copy",
                     (lambda r: r["Sk"] == 131072 and r["B"] == 1 and r["Hq"] == 32, "decode-128k",
                      [lambda r: f"{r['GBps'] / 1000:.2f}", lambda r: f"{100 * r['frac_of_hbm_copy']:.0f}"])),
            sec_rows("paged_decode.json", "paged decode (`paged_decode_attn_with_lse`)", "frac_of_contiguous",
                     "÷ contiguous decode"),
            sec_rows("merge.json", "LSE merge (`merge_attention_states`)", "frac_of_hbm_copy", "÷ HBM copy"),
            sec_rows("topk.json", "exact top-k (the page choice)", "ratio_to_launch_floor", "÷ launch floor"),
            sec_rows("quest_score.json", "Quest page scores", "frac_of_hbm_copy", "÷ HBM copy"),
            sec_rows("layer_ops.json", "fused RMSNorm / SwiGLU / QKV + RoPE", "frac_of_hbm_copy", "÷ HBM copy"), sec_other()]
    head = ["# Results",
            "<!-- generated by `python -m benchmarks.report` from benchmarks/results/*.json; do not edit by hand -->",
            "Every figure of the project, from the recorded JSON. Each table names the machine, the commit it "
            "measured, the command, and its status: **current** (the measured code has not changed since), "
            "**stale** (it has: rerun the command), **commit unknown**. Terms: [DESIGN.md, Glossary]"
            "(DESIGN.md#glossary)."]
    return "\n\n".join(head + secs) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write docs/RESULTS.md from benchmarks/results/*.json.")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/RESULTS.md differs from a fresh report")
    ap.add_argument("--out", default=OUT, help="where to write (default docs/RESULTS.md)")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(args.out, encoding="utf-8") as f:
            same = f.read() == text
        print("docs/RESULTS.md is up to date" if same else "docs/RESULTS.md differs: run python -m benchmarks.report")
        return 0 if same else 1
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
