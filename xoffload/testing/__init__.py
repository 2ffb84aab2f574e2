"""Helpers for tests and benchmarks (synthetic attention inputs); not used by the library itself."""
