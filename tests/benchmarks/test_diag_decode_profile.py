"""The memory attribution of tools/diag_decode_profile.py on a synthetic allocator trace: the
peak of allocated bytes and what is alive at it, grouped by the first xoffload frame."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import diag_decode_profile as D  # noqa: E402


def _fr(path, line, fn):
    return [{"filename": "/site/torch/x.py", "line": 1, "name": "alloc"},
            {"filename": f"/repo/xoffload/{path}", "line": line, "name": fn}]


def test_peak_owners_finds_the_peak_and_groups_by_xoffload_frame():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _fr("models/llama.py", 10, "prefill")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _fr("kv/resident.py", 5, "_staging")},
        {"action": "alloc", "addr": 3, "size": 30, "frames": _fr("models/llama.py", 10, "prefill")},
        {"action": "free_requested", "addr": 3, "size": 30},
        {"action": "free_completed", "addr": 3, "size": 30},  # peak was 180, before this free
        {"action": "alloc", "addr": 4, "size": 20, "frames": []},
        {"action": "free_completed", "addr": 99, "size": 7},  # a block allocated before the trace
    ]
    r = D.peak_owners(trace, base=1000)
    assert r["peak_above_start_GB"] == 180 / 1e9 and r["start_allocated_GB"] == 1000 / 1e9
    assert r["owners_GB"] == {"models/llama.py:10 prefill": 130 / 1e9, "kv/resident.py:5 _staging": 50 / 1e9}
    assert r["events"] == len(trace)


def test_site_falls_back_to_the_first_frame():
    assert D._site([{"filename": "/a/b/c.py", "line": 3, "name": "f"}]) == "c.py:3 f"
    assert D._site([]) == "?"
