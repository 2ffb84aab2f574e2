"""Benchmarks: one script per kernel or end-to-end workload (``bench_*.py``) on the shared harness
``_common.py``, and ``report.py`` (``python -m benchmarks.report``), which writes docs/RESULTS.md
from ``results/*.json``."""
