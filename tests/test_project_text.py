"""The project's text speaks of the project: no 'session <number>' (a work session; 'session' alone is
the product's conversations), no issue numbers, in README.md, docs/, xoffload/, tests/ and
benchmarks/ (.py and .md files)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
BANNED = re.compile(r"\bsessions? [0-9]+\b|\bissue #?[0-9]+\b", re.I)
THIS = pathlib.Path(__file__).resolve()


def _files():
    yield ROOT / "README.md"
    for top in ("docs", "xoffload", "tests", "benchmarks", "tools"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in (".py", ".md") and p.resolve() != THIS:
                yield p


def test_no_work_session_or_issue_numbers():
    hits = []
    for p in _files():
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            m = BANNED.search(line)
            if m:
                hits.append(f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "work-session or issue numbers in the project's text:\n" + "\n".join(hits)
