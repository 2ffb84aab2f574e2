"""Collect benchmarks/bench_*.py under pytest (``pytest benchmarks/ --benchmark-json ...``): the
project's pytest.ini only names tests/test_*.py. Files given explicitly on the command line are
collected by pytest itself."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
