"""Helpers shared by the benchmark modules (benchmarks/bench_*.py).

- :func:`env_record`: GPU name, SM count, torch / triton / CUDA versions, git commit, UTC date.
- :func:`bench_ms`: median GPU time in ms through ``triton.testing.do_bench`` (CUDA events).
- :func:`hbm_copy_gbps`: device-to-device copy bandwidth (bytes read + written per second), the
  ceiling memory-bound kernels are compared against.
- :func:`bench_parser`: the one argparse base of every script (``--quick``, ``--out``, default
  ``benchmarks/results/<name>.json``); :func:`parse_gpu_args` (None without a GPU); :func:`run`:
  the ``__main__`` entry (``run(main)``).
- :func:`write_json`: the one result writer: ``benchmarks/results/<name>.json`` or a path, with
  the environment record (GPU, versions, commit, date) added under ``"env"`` when the payload has
  none, and a copy under ``$XOFFLOAD_BENCH_OUT`` when that is set (runs on a remote machine).
  Payloads carry the shapes, medians and ratios of their rows.
- :data:`requires_cuda`: ``pytest.mark.skipif`` for machines without a GPU.
- :func:`tflops`, :func:`fmt_table`: small formatting helpers.

Importing this module puts the repository root on ``sys.path`` so that ``python
benchmarks/bench_x.py`` finds the ``xoffload`` package without installing it.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="benchmark needs a CUDA GPU")


def git_commit() -> str:
    """``$GIT_COMMIT`` if set (copies of the tree without .git), else ``git rev-parse HEAD`` with
    ``-dirty`` appended when tracked files differ from it (a device's copy of a working tree sits on
    its base commit: without the mark its records named code they did not run)."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def env_record() -> dict:
    """Where and with what a benchmark ran: GPU, versions, commit, date (UTC, ISO 8601)."""
    import triton

    rec = {
        "gpu": torch.cuda.get_device_name() if HAS_CUDA else None,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if HAS_CUDA else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if HAS_CUDA:
        try:
            rec["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            rec["cudnn"] = None
    return rec


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median GPU time of ``fn()`` in milliseconds (``triton.testing.do_bench``: CUDA events, L2
    cleared between repetitions). ``warmup`` / ``rep`` are target durations in ms."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_ms(fn, reps: int = 3) -> float:
    """Median GPU time of ``fn()`` in ms for calls that may be long: one warm-up call, then calls
    timed with CUDA events (``reps`` in all, the warm-up's timed twin included); a call under
    20 ms goes to :func:`bench_ms` instead (many repetitions)."""
    import statistics

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(max(1, reps)):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
        if ts[0] < 20.0:
            return bench_ms(fn, warmup=10, rep=60)
    return statistics.median(ts)


def record_extra(benchmark, row: dict, skip=("peers",)) -> None:
    """Put a benchmark row into pytest-benchmark's ``extra_info``: its fields (less ``skip``), the
    HBM copy ceiling, and each peer's fields as ``<peer>_<field>``."""
    benchmark.extra_info.update({k: v for k, v in row.items() if k not in skip})
    benchmark.extra_info["hbm_copy_GBps"] = hbm_copy_gbps()
    for name, p in row.get("peers", {}).items():
        for k, v in p.items():
            benchmark.extra_info[f"{name}_{k}"] = v


def bench_graph_ms(fn) -> float | None:
    """Median GPU time in ms of ``fn`` captured once in a CUDA graph and replayed (no Python launch
    overhead; L2 flushed between replays). None if ``fn`` cannot be captured."""
    try:
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception:
        return None
    return bench_ms(g.replay)


@functools.lru_cache(maxsize=None)
def hbm_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting bytes read plus bytes
    written, over a copy of ``nbytes`` (default 2 GiB, well past the L2)."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=10, rep=50)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` floating-point operations done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def write_json(name_or_path: str, payload: dict, out_dir: str | None = None) -> str:
    """Write a benchmark result as JSON: to ``name_or_path`` if it ends in ``.json``, else to
    ``<out_dir or benchmarks/results>/<name>.json``; ``env`` (:func:`env_record`) is added when
    the payload has neither ``env`` nor ``commit``. Also copies it under ``$XOFFLOAD_BENCH_OUT``
    when set. Each file is replaced whole (written next to it, then renamed): a run killed while
    writing leaves the previous version. Returns the path written."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(out_dir or RESULTS_DIR,
                                                                              f"{name_or_path}.json")
    if "env" not in payload and "commit" not in payload:
        payload = {**payload, "env": env_record()}
    text = json.dumps(payload, indent=2, default=str) + "\n"
    _replace_file(path, text)
    extra = os.environ.get("XOFFLOAD_BENCH_OUT")
    if extra and os.path.abspath(extra) != os.path.dirname(os.path.abspath(path)):
        _replace_file(os.path.join(extra, os.path.basename(path)), text)
    return path


def _replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (never half written)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


save_json = write_json  # the name bench scripts outside this room still use


def doc_summary(doc: str | None, name: str = "") -> str:
    """The first paragraph of a module docstring as one line (``name`` when there is none): a
    ``--help`` description that does not stop mid-sentence at the docstring's first line break."""
    para = (doc or "").strip().split("\n\n")[0]
    return " ".join(para.split()) or name


def bench_parser(doc: str, name: str, quick_help: str = "fewer shapes") -> argparse.ArgumentParser:
    """The argparse base of every benchmark script: description from the module docstring's first
    paragraph (:func:`doc_summary`), ``--quick`` and ``--out`` (default
    ``benchmarks/results/<name>.json``)."""
    ap = argparse.ArgumentParser(description=doc_summary(doc, name))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"{name}.json"), help="result JSON path")
    return ap


def parse_gpu_args(ap: argparse.ArgumentParser, argv=None):
    """``ap.parse_args(argv)``, or None (after saying so) when there is no CUDA GPU to run on."""
    args = ap.parse_args(argv)
    if not HAS_CUDA:
        print(f"{ap.prog}: no CUDA GPU, skipped")
        return None
    return args


def hbm_shape_rows(shapes, run_case, line, quick_names=None) -> tuple:
    """The common loop of the HBM-bound kernel benchmarks: measure the HBM copy bandwidth (printed),
    then ``run_case(*shape, hbm)`` for each shape (only those named in ``quick_names`` when given),
    printing ``line(shape, row)`` after each. Returns ``(hbm GB/s, rows)``."""
    hbm = hbm_copy_gbps()
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s (read + write)")
    return hbm, [_printed(run_case(*shape, hbm), shape, line) for shape in shapes
                 if quick_names is None or shape[0] in quick_names]


def _printed(row: dict, shape, line) -> dict:
    print(line(shape, row), flush=True)
    return row


def run(main) -> None:
    """``if __name__ == "__main__": run(main)``: exit with ``main()``'s return code."""
    sys.exit(main())


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    """Plain-text table of ``rows`` (dicts) restricted to ``cols``; floats with 3 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
