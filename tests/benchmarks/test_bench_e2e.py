"""CPU tests of bench_e2e's plan, cap search and partial results (the GPU work mocked out or run on
a tiny random model on the CPU)."""
import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import _e2e_plan as P  # noqa: E402
import bench_e2e as E  # noqa: E402

LENGTHS = [8192, 16384, 32768, 65536, 131072]
K = 16384


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "benchmarks", "results")
MEASURED = ("e2e_full.json", "e2e_rest.json")  # H200, 2026-12-01, commit 9c873dd: the plan's basis
PREFIX = {"8b": "8b", "qwen": "qwen3_8b", "smollm2": "smollm2"}


def _measured(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _names(res):
    """The configurations in a result JSON's results (sorted; the transformers peers left out)."""
    r = res["results"]
    return sorted({k.split("/", 1)[1] for k, v in r.items()
                   if "/" in k and k.split("/", 1)[0] in PREFIX.values() and isinstance(v, dict)
                   and not k.split("/", 1)[1].startswith("hf_")})


def _plan_of(res):
    """The plan of the command a result JSON ran: its finished parts, its 8B lengths, the
    configurations in its results (retired ones as measured_configs stands them in), its
    transformers tokens, its pools (fresh before the JSON said)."""
    lengths = sorted(int(n) for n in res["results"].get("8b/resident", {})) or LENGTHS
    return P.plan(res["parts_done"], lengths, P.measured_configs(_names(res)), hf_new=res["hf_n_new"],
                  fresh_pools=res.get("fresh_pools", True))


# ------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("name", MEASURED)
def test_plan_of_the_measured_commands_reproduces_their_part_seconds(name):
    res = _measured(name)
    assert res["env"]["commit"] == "9c873dd" and res["env"]["gpu"] == "NVIDIA H200"
    planned = P.plan_seconds(_plan_of(res))
    for part, seconds in res["part_seconds"].items():
        assert planned[part] == pytest.approx(seconds, rel=0.05), part
    assert planned["total"] == pytest.approx(res["elapsed_s"], rel=0.05)
    assert planned["startup"] == pytest.approx(res["startup_s"], abs=1.0)


def test_the_measured_runs_had_the_variants_and_fresh_pools():
    full = _measured("e2e_full.json")
    assert set(P.VARIANTS) <= {k.split("/", 1)[1] for k in full["results"] if k.startswith("8b/")}
    assert all(v > 4.0 for k, v in full["llm_init_s"].items() if "offload" in k)  # 16 GiB pinned each time
    assert full["hf_n_new"] == 6 and "fresh_pools" not in full


def test_default_run_is_planned_under_nine_minutes():
    p = P.plan(P.PARTS, LENGTHS, P.all_configs())
    assert list(p) == ["startup", *P.PARTS, "report"]
    tot = P.plan_seconds(p)
    assert tot["total"] == pytest.approx(sum(v for k, v in tot.items() if k != "total"))
    assert tot["total"] <= 540  # 10 minutes with a 10% margin
    # the largest parts: the 8B sweep and the cap searches
    assert tot["8b"] > tot["cap"] > max(tot["qwen"], tot["smollm2"], tot["stall"])
    # the two-call split: each call under 10 minutes on its own
    first = P.plan_seconds(P.plan(["8b"], LENGTHS, P.all_configs()))["total"]
    second = P.plan_seconds(P.plan(["cap", "qwen", "smollm2", "stall"], LENGTHS, P.all_configs()))["total"]
    assert first < 600 and second < 600
    # what the savings are: the measured command's plan (its configurations, offload-ring and the
    # prefetch variant included) is the measured 660 s
    names = sorted(set(_names(_measured("e2e_full.json"))) | set(_names(_measured("e2e_rest.json"))))
    old = P.plan_seconds(P.plan(P.PARTS, LENGTHS, P.measured_configs(names), hf_new=6, fresh_pools=True))
    assert old["total"] > 600 and old["total"] - tot["total"] > 100


def test_plan_follows_the_options():
    cfgs = P.all_configs()
    full = P.plan_seconds(P.plan(P.PARTS, LENGTHS, cfgs))
    quick = P.plan_seconds(P.plan(P.PARTS, [32768, 131072], cfgs))
    no_peers = P.plan(P.PARTS, LENGTHS, cfgs, peers=False)
    assert quick["8b"] < full["8b"]
    assert no_peers["8b"]["peers"] == 0 and "hf_gpu_cache" not in no_peers["cap"]
    two = {k: v for k, v in cfgs.items() if k in ("resident", "offload")}
    two_8b, full_8b = P.plan(["8b"], LENGTHS, two)["8b"], P.plan(["8b"], LENGTHS, cfgs)["8b"]
    assert sum(two_8b.values()) < full["8b"] - 100  # 2 of the 8 configurations: a quarter of the points
    assert two_8b["prefill"] < full_8b["prefill"] / 3 and two_8b["other"] == full_8b["other"]
    # the cap part without the 8b part builds its own model and transformers view
    alone = P.plan(["cap"], LENGTHS, cfgs)
    assert alone["cap"]["model"] > 0 and P.plan(["8b", "cap"], LENGTHS, cfgs)["cap"]["model"] == 0
    # variants, fresh pools, transformers' tokens
    var = P.plan(["8b", "qwen"], LENGTHS, P.all_configs(variants=True))
    base = P.plan(["8b", "qwen"], LENGTHS, cfgs)
    assert var["8b"]["prefill"] - base["8b"]["prefill"] == pytest.approx(
        len(P.VARIANTS) * sum(P.prefill_s(n) + P.REQUEST_S for n in P.VARIANT_LENGTHS), rel=1e-6)
    assert var["qwen"]["prefill"] > base["qwen"]["prefill"]
    fresh = P.plan(["8b"], LENGTHS, cfgs, fresh_pools=True)["8b"]
    n_offload = sum(map(P.is_offload, cfgs.values()))
    assert n_offload == 5  # offload, -uva, +xattn, +quest, +quest-ch: the first pins, the others reuse
    assert fresh["init"] - base["8b"]["init"] == pytest.approx((n_offload - 1) * P.PIN_S_PER_GIB
                                                               * P.pool_gib(131136, 131072))
    assert fresh["close"] > base["8b"]["close"]
    six = P.plan(["8b"], LENGTHS, cfgs, hf_new=6)["8b"]["peers"]
    assert six - base["8b"]["peers"] == pytest.approx(2 * sum(P._interp(P.HF_DECODE_MS["hf_offloaded_cache"], n)
                                                              for n in LENGTHS) * 1e-3)
    assert P.hf_steps(6) == {"hf_gpu_cache": 6, "hf_offloaded_cache": 6} and P.hf_steps() == P.HF_NEW


def test_print_plan(capsys):
    P.print_plan(P.plan(["stall"], LENGTHS, P.all_configs()))
    out = capsys.readouterr().out
    assert "stall" in out and "total" in out


def test_prefill_fit_reproduces_the_measured_ttft():
    full = _measured("e2e_full.json")
    pts = {int(n): p["ttft_ms"] / 1e3 for n, p in full["results"]["8b/resident"].items()}
    for name in P.CAP_TARGETS:  # our cap probes: 48K, 192K, 224K
        for n, p in full["results"]["cap_24GiB"][name]["probes"].items():
            if p.get("ttft_ms") and int(n) > 32768:
                pts[int(n)] = p["ttft_ms"] / 1e3
    assert {49152, 196608, 229376} <= set(pts)
    for n, t in pts.items():
        assert P.prefill_s(n) == pytest.approx(t, rel=0.035), n
    assert P.prefill_s(65536) < P.prefill_s(131072) / 2  # attention: worse than linear
    assert P.prefill_s(32768, "offload+xattn") > P.prefill_s(32768)


def test_decode_and_transformers_tables_are_the_measured_figures():
    full = _measured("e2e_full.json")
    r = full["results"]
    for name, row in P.DECODE_MS.items():
        for n, v in zip(P.MEASURED_LENGTHS, row):
            p = r[f"8b/{name}"].get(str(n))
            assert (v is None) == (p is None)
            if p:
                assert v == pytest.approx(p["decode_steady_ms_per_token"], abs=0.01)
                assert P.decode_ms(name, {}, n) == pytest.approx(v)
    for c in P.HF_CACHES:
        for i, n in enumerate(P.MEASURED_LENGTHS):
            p = r[f"8b/{c}"][str(n)]
            assert P.HF_TTFT_S[c][i] == pytest.approx(p["ttft_ms"] / 1e3, abs=1e-3)
            assert P.HF_DECODE_MS[c][i] == pytest.approx(p["decode_ms_per_token"], abs=0.1)
            assert P.hf_point_s(c, n, 1) == pytest.approx(P.HF_REQUEST_S + p["ttft_ms"] / 1e3, abs=1e-3)
    # pinning: INIT_S + PIN_S_PER_GIB x GiB within 30% of each offload LLM's construction
    for res in (full, _measured("e2e_rest.json")):
        for k, v in res["llm_init_s"].items():
            prefix, name = k.split("/", 1)
            if "offload" in name:
                kvt = res["models"][prefix]["kv_bytes_per_token"]
                tokens = (131072 if prefix == "8b" else 32768 if prefix == "qwen3_8b" else 8192) + 64
                assert P.llm_s({"mode": "offload"}, tokens, kvt)["init"] == pytest.approx(v, rel=0.3, abs=0.15), k
    # the cap searches: the plan's probes are the measured ones (16K first, then the fit's)
    cap = r["cap_24GiB"]
    for name in [*P.CAP_TARGETS, *P.HF_CACHES]:
        assert cap[name]["longest_served"] == P.CAP_LIMITS[name]


def test_plans_cap_searches_probe_what_the_run_probed(monkeypatch):
    full = _measured("e2e_full.json")
    seen = {}
    real = P.longest_served

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen[len(seen)] = out["probed"]
        return out

    monkeypatch.setattr(P, "longest_served", spy)
    names = [*P.CAP_TARGETS, *P.HF_CACHES]
    for name in names:
        P._plan_search(name, P.CAP_MAX, P.CAP_STEP)
    for i, name in enumerate(names):
        assert sorted(seen[i]) == sorted(int(n) for n in full["results"]["cap_24GiB"][name]["probes"]), name


def test_variants_are_opt_in():
    cfgs = P.all_configs()
    assert not set(P.VARIANTS) & set(cfgs) and {"offload+quest", "offload+quest-ch", "resident+quest-ch"} <= set(cfgs)
    with_v = P.all_configs(variants=True)
    assert list(with_v)[-len(P.VARIANTS):] == list(P.VARIANTS) and set(cfgs) < set(with_v)
    assert list(P.all_configs("offload+quest-nocache,resident")) == ["resident", "offload+quest-nocache"]
    with pytest.raises(ValueError, match="offload\\+quest-cache2x"):  # the variants are among the known names
        P.all_configs("nope")


def test_retired_configurations_are_planned_never_run():
    """offload-ring and the prefetch variant (gone from the library) are in the measured runs: the
    plan stands them in (their own decode rows, a variant's lengths), the benchmark refuses them."""
    assert not set(P.RETIRED) & set(P.all_configs(variants=True)) and set(P.RETIRED_VARIANTS) <= set(P.RETIRED)
    for name in P.RETIRED:
        with pytest.raises(ValueError, match=rf"unknown configuration\(s\) \['{re.escape(name)}'\]"):
            P.all_configs(name)
        assert name in P.DECODE_MS and name in P.SMOLLM2
    cfgs = P.measured_configs("resident,offload-ring,offload+quest-prefetch,offload+quest-nocache")
    assert list(cfgs) == ["resident", "offload+quest-nocache", "offload-ring", "offload+quest-prefetch"]
    assert cfgs["offload-ring"] == {"mode": "offload"}
    assert P.decode_ms("offload-ring", cfgs["offload-ring"], 131072) == P.DECODE_MS["offload-ring"][-1]
    assert P.config_lengths("offload+quest-prefetch", LENGTHS) == [32768, 131072]
    assert P.config_lengths("offload-ring", LENGTHS) == LENGTHS
    assert P.warm_layers(cfgs["offload+quest-prefetch"], 32) == 3
    with pytest.raises(ValueError, match="nope"):
        P.measured_configs(["resident", "nope"])


def test_variants_run_at_32k_and_128k_only():
    assert P.config_lengths("offload", LENGTHS) == LENGTHS
    for v in P.VARIANTS:
        assert P.config_lengths(v, LENGTHS) == [32768, 131072]
        assert P.config_lengths(v, [2048, 4096, 8192]) == [8192]
        assert P.config_lengths(v, [32768]) == [32768]


def test_warm_up_views():
    cfgs = P.all_configs(variants=True)
    assert P.warm_layers(cfgs["resident"], 32) == 1
    assert P.warm_layers(cfgs["offload-uva"], 32) == 1
    assert P.warm_layers(cfgs["offload+quest"], 32) == 3  # layers 0-1 dense, 2 sparse
    assert P.warm_layers(cfgs["offload+xattn"], 32) == 5  # the first 4 dense
    assert P.warm_layers(cfgs["offload+quest"], 2) == 2  # no sparse layer at all: the whole model
    runs = {name: (k, ns) for name, _, k, ns in P.warm_runs(cfgs, LENGTHS, 32)[1:]}
    first = P.warm_runs(cfgs, LENGTHS, 32)[0]
    assert first[2:] == (1, LENGTHS)  # every length through a one-layer dense view
    assert runs["offload+xattn"] == (5, LENGTHS)  # its estimate autotunes per length
    assert runs["offload"] == (1, [8192])
    assert runs["offload+quest-nocache"] == (3, [32768])


# ----------------------------------------------------------------------------- the cap search
def _target(limit, slope=33e3, base=16e9):
    """A probe serving up to ``limit`` tokens, its peak memory a straight line; with the probes."""
    probed = []

    def probe(n):
        probed.append(n)
        return (n <= limit, base + slope * n if n <= limit else None)

    return probe, probed


def test_search_with_good_hints_settles_in_three_probes():
    limit = 270000
    probe, probed = _target(limit)
    cap = 16e9 + 33e3 * limit
    hints = {n: 16e9 + 33e3 * n for n in (32768, 131072)}
    r = P.longest_served(probe, K, 524288, K, cap, hints=hints)
    assert r["longest_served"] == 16 * K and r["refused"] == 17 * K
    assert probed == [K, 16 * K, 17 * K] == r["probed"]
    assert r["predicted"] == pytest.approx(limit, abs=2)


def test_search_without_hints_fits_its_probes_and_refines():
    probe, probed = _target(270000)
    r = P.longest_served(probe, K, 524288, K, 16e9 + 33e3 * 270000)
    assert (r["longest_served"], r["refused"]) == (16 * K, 17 * K)
    assert probed == [K, 2 * K, 8 * K, 16 * K, 17 * K]  # 16K, 32K, half the prediction, the limit


@pytest.mark.parametrize("limit", [0, K - 1, K, 2 * K + 5, 100000, 262144, 400000, 524288, 10**7])
@pytest.mark.parametrize("hints", [None, {32768: 16e9, 131072: 18e9}, {32768: 30e9, 131072: 60e9}])
def test_search_finds_the_limit_whatever_the_hints(limit, hints):
    probe, probed = _target(limit)
    r = P.longest_served(probe, K, 524288, K, 24 * 2**30, hints=hints)
    want = min(limit, 524288) // K * K
    assert r["longest_served"] == want
    assert r["refused"] == (None if want == 524288 else want + K)
    assert len(probed) == len(set(probed)) <= 12  # never the same length twice; a bisection's worth


def test_search_uses_known_points_and_stays_on_the_grid():
    probe, probed = _target(200000)
    known = {131072: (True, 16e9 + 33e3 * 131072)}
    r = P.longest_served(probe, K, 524288, K, 16e9 + 33e3 * 200000, known=known)
    assert 131072 not in probed and r["longest_served"] == 12 * K and r["refused"] == 13 * K
    assert all(n % K == 0 for n in probed)


def test_all_on_gpu_bound():
    kvt = 131072
    assert P.all_on_gpu_bound("resident", P.WEIGHTS_8B, kvt) == (P.CAP_BYTES - P.WEIGHTS_8B) // kvt
    assert P.all_on_gpu_bound("offload", P.WEIGHTS_8B, kvt) is None


def test_cap_search_refuses_past_the_bound_without_a_run():
    ran = []

    def probe(n):
        ran.append(n)
        return {"status": "ok", "peak_gpu_memory_bytes": int(16e9 + 147e3 * n)}

    rec = E.cap_search("resident", probe, {}, 524288, K, bound=74080)
    assert rec["longest_served"] == 4 * K and rec["refused"] == 5 * K
    assert max(ran) <= 74080 and rec["probes"][str(5 * K)]["status"] == "refused"
    assert rec["probes"][str(K)]["probe_s"] >= 0 and "probe_s" not in rec["probes"][str(5 * K)]
    assert rec["granularity"] == K and rec["searched"] == [K, 524288]


def test_cap_hints_prefer_this_runs_points():
    res = {"results": {"8b/offload": {"32768": {"peak_gpu_memory_bytes": 1}, "131072": {"peak_gpu_memory_bytes": 2}}}}
    rec = {}
    assert E.cap_hints(res, "offload", rec) == {32768: 1, 131072: 2} and "this run" in rec["hints_from"]
    rec = {}
    h = E.cap_hints(res, "offload+quest", rec)
    assert sorted(h) == list(P.PEAK_LENGTHS) and "PEAK_GIB" in rec["hints_from"]


def test_guarded_records_allocation_failures_and_raises_the_rest():
    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def host():
        raise MemoryError("could not allocate 64 GiB of pinned host memory")

    assert E._guarded(lambda: {"x": 1}) == {"x": 1, "status": "ok"}
    assert E._guarded(oom)["status"] == "OOM"
    assert E._guarded(host)["status"] == "host memory"
    with pytest.raises(RuntimeError, match="other"):
        E._guarded(lambda: (_ for _ in ()).throw(RuntimeError("other")))


# --------------------------------------------------------------------------- partial results
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_json_after_every_part_partial_until_the_end(tmp_path):
    out = str(tmp_path / "e2e.json")
    clock = FakeClock()
    res = E.new_result(["8b", "cap", "qwen"], out, {"8b": 300.0, "cap": 100.0, "qwen": 40.0})
    seen = {}

    def part(name, seconds, fail=False):
        def fn():
            on_disk = json.load(open(out)) if os.path.exists(out) else None
            seen[name] = on_disk
            clock.t += seconds
            if fail:
                raise RuntimeError("boom")
            res["results"][f"{name}/x"] = {"1": {"v": 1}}
            return "ok"
        return fn

    E.run_parts(res, {"8b": part("8b", 290), "cap": part("cap", 50, fail=True), "qwen": part("qwen", 30)},
                start=0.0, clock=clock)
    assert seen["8b"] is None  # nothing had finished
    assert seen["cap"]["complete"] is False and seen["cap"]["part_seconds"] == {"8b": 290}
    assert seen["cap"]["parts_done"] == ["8b"] and "8b/x" in seen["cap"]["results"]
    assert seen["qwen"]["part_seconds"] == {"8b": 290, "cap": 50} and "cap_24GiB" in seen["qwen"]["errors"]
    on_disk = json.load(open(out))
    assert on_disk["complete"] is False and on_disk["parts_done"] == ["8b", "qwen"]
    E.finish(res, 0.0, clock)
    on_disk = json.load(open(out))
    assert on_disk["complete"] is False  # the cap part failed
    assert on_disk["elapsed_s"] == 370 and on_disk["plan_seconds"]["8b"] == 300


def test_complete_when_every_part_ran(tmp_path):
    out = str(tmp_path / "e2e.json")
    res = E.new_result(["stall"], out, {})
    E.run_parts(res, {"stall": lambda: {"median_wall_ms": 1.0}})
    E.finish(res, 0.0, lambda: 5.0)
    on_disk = json.load(open(out))
    assert on_disk["complete"] is True and on_disk["results"]["stall"] == {"median_wall_ms": 1.0}
    assert not os.path.exists(out + f".tmp{os.getpid()}")


def test_time_budget_skips_a_part_that_would_not_fit(tmp_path):
    out = str(tmp_path / "e2e.json")
    clock = FakeClock()
    res = E.new_result(["8b", "cap", "stall"], out, {"8b": 300.0, "cap": 200.0, "stall": 10.0})

    def spend(s):
        def fn():
            clock.t += s
            return "ok"
        return fn

    E.run_parts(res, {"8b": spend(320), "cap": spend(100), "stall": spend(8)}, budget=500, planned=res["plan_seconds"],
                start=0.0, clock=clock)
    assert list(res["parts_skipped"]) == ["cap"] and res["parts_done"] == ["8b", "stall"]
    E.finish(res, 0.0, clock)
    assert json.load(open(out))["complete"] is False


def test_a_kill_keeps_the_finished_parts(tmp_path):
    out = str(tmp_path / "e2e.json")
    res = E.new_result(["8b", "cap"], out, {})

    def killed():
        raise SystemExit(143)  # what the SIGTERM handler raises

    with pytest.raises(SystemExit):
        E.run_parts(res, {"8b": lambda: "ok", "cap": killed})
    on_disk = json.load(open(out))
    assert on_disk["complete"] is False and on_disk["parts_done"] == ["8b"]
    assert set(on_disk["part_seconds"]) == {"8b", "cap"}


def test_main_plan_runs_without_a_gpu(capsys):
    assert E.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and all(p in out for p in P.PARTS)
    assert E.main(["--plan", "--part", "8b", "--configs", "resident,offload", "--quick"]) == 0
    with pytest.raises(SystemExit):  # a one-line argparse error naming it
        E.main(["--plan", "--configs", "nope"])
    assert "unknown configuration(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        E.main(["--plan", "--part", "8b,nope"])


def test_main_plan_with_the_opt_ins(capsys):
    def total(*args):
        capsys.readouterr()
        assert E.main(["--plan", *args]) == 0
        out = capsys.readouterr().out
        return float(next(line.split()[1] for line in out.splitlines() if line.startswith("total")))

    default, variants, fresh = total(), total("--variants"), total("--fresh-pools")
    assert default <= 500 < variants and default < fresh
    # the measured command, less offload-ring and the prefetch variant (660 s measured with them)
    assert 560 < total("--variants", "--fresh-pools") < 620


def test_time_split_without_the_variants():
    res = {"results": {"8b/offload+quest": {"32768": {"decode_steady_ms_per_token": 8.4, "cache_hit_rate": 0.2,
                                                      "h2d_bytes_per_token": 4e7}},
                       "8b/resident+quest": {"32768": {"decode_steady_ms_per_token": 6.4}}},
           "bounds": {"8b": {"32768": {"weights_hbm_ms": 3.8}}}}
    split = E.time_split(res)["8b/32768"]
    assert split["fetch"] == pytest.approx(2.0) and split["selection+attention+rest"] == pytest.approx(2.6)
    assert "fetch_without_cache" not in split
    res["results"]["8b/offload+quest-nocache"] = {"32768": {"decode_steady_ms_per_token": 10.9}}
    assert E.time_split(res)["8b/32768"]["fetch_without_cache"] == pytest.approx(4.5)


def test_new_result_records_the_options():
    res = E.new_result(["8b"], None, {}, variants=True, fresh_pools=False)
    assert res["variants"] is True and res["fresh_pools"] is False and res["hf_n_new"] == P.HF_NEW
    assert res["hf_n_new"]["hf_offloaded_cache"] < res["hf_n_new"]["hf_gpu_cache"]


def test_sweep_on_a_tiny_model_on_the_cpu():
    """The measured path end to end on the CPU: warm-up views, one LLM per configuration, the
    points' records, the variants only at their lengths."""
    from xoffload.models import random_model

    model = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=0)
    view = E.layer_view(model, 1)
    assert view.cfg.num_layers == 1 and view.w.layers[0] is model.w.layers[0] and view.w.embed is model.w.embed
    assert E.layer_view(model, 5) is model
    res = E.new_result(["8b"], None, {})
    res.update(h2d_GBps=50.0, hbm_GBps=4000.0)
    cfgs = P.all_configs("resident,offload,offload+quest-nocache")
    E.sweep_configs(model, [64, 128], cfgs, res, "tiny")
    assert res["errors"] == {}
    r = res["results"]
    assert r["tiny/warm-up"] == "ok" and set(r["tiny/offload"]) == {"64", "128"}
    assert set(r["tiny/offload+quest-nocache"]) == {"128"}  # neither 32K nor 128K here: the longest
    p = r["tiny/resident"]["128"]
    assert p["prompt_tokens"] == 128 - P.N_NEW and p["decode_steady_ms_per_token"] > 0 and p["wall_s"] > 0
    names = {"tiny/resident", "tiny/offload", "tiny/offload+quest-nocache"}
    assert set(res["llm_init_s"]) == set(res["llm_close_s"]) == names
    assert res["pinned_slabs"]["tiny"] == {"reused": 0, "registered": 0}  # CPU pools are not pinned
    assert {"tiny/warm-up", *names} <= set(res["section_s"])
    fresh = E.new_result(["8b"], None, {})
    E.sweep_configs(model, [64], P.all_configs("offload"), fresh, "tiny", fresh_pools=True)
    assert fresh["errors"] == {} and "pinned_slabs" not in fresh and set(fresh["results"]["tiny/offload"]) == {"64"}


def test_sweep_reuses_pinned_slabs_across_configurations(monkeypatch):
    """The sweep's offload LLMs take the slabs the one before registered (the pinned path faked)."""
    from xoffload.runtime import pool as pool_mod

    made = []

    class FakePool:
        def __init__(self):
            self.cache = pool_mod._ACTIVE_CACHE
            made.append(self)

    class FakeLLM:
        def __init__(self, model, max_model_len, **kw):
            self.pool = FakePool() if kw.get("mode") == "offload" else None

        def close(self):
            pass

    monkeypatch.setattr("xoffload.LLM", FakeLLM)
    monkeypatch.setattr(E, "point", lambda llm, n, n_new=P.N_NEW: {"n": n})
    monkeypatch.setattr(E, "warm_up", lambda *a: "ok")
    res = E.new_result(["8b"], None, {})
    E.sweep_configs(None, [64], P.all_configs("offload,offload-uva,resident"), res, "x")
    assert len(made) == 2 and made[0].cache is made[1].cache is not None  # one cache for the sweep
    assert pool_mod._ACTIVE_CACHE is None  # and gone after it
    made.clear()
    E.sweep_configs(None, [64], P.all_configs("offload"), E.new_result(["8b"], None, {}), "x", fresh_pools=True)
    assert made[0].cache is None


def test_replot_draws_a_recorded_run_without_a_gpu(tmp_path):
    """``--replot JSON``: the plots of a recorded run next to --out, no run (the committed
    session-10 defaults run: one 8B figure)."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "benchmarks", "results", "e2e_defaults_new64.json")
    assert E.main(["--replot", src, "--out", str(tmp_path / "x.json")]) == 0
    png = tmp_path / "x_8b.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
