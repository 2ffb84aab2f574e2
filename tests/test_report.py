"""docs/RESULTS.md is what ``python -m benchmarks.report`` writes from benchmarks/results/*.json, and
every headline figure README.md states equals the report's value (README marks each with a link to
its RESULTS.md anchor; the bold numbers on that line are the figures)."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

in_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not in_git, reason="the report's status column needs the git history")
def test_results_md_regenerates_without_diff():
    text = report.render()
    assert (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8") == text, \
        "docs/RESULTS.md is out of date: run python -m benchmarks.report"


def _headline_lines():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [line for line in readme.splitlines() if "docs/RESULTS.md#" in line]


def test_readme_headline_figures_equal_the_report():
    report.render()
    lines = _headline_lines()
    assert 1 <= len(lines) <= 10
    for line in lines:
        anchors = re.findall(r"docs/RESULTS\.md#([\w-]+)", line)
        assert len(anchors) == 1, line
        assert anchors[0] in report.HEADLINES, f"no row {anchors[0]!r} in RESULTS.md"
        assert re.findall(r"\*\*([0-9][0-9.,]*)\*\*", line) == report.HEADLINES[anchors[0]], line


def test_every_anchor_is_in_results_md():
    text = report.render()
    for aid in report.HEADLINES:
        assert f'<a id="{aid}"></a>' in text
