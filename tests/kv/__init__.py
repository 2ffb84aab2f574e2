"""Tests of xoffload/kv/ (the batched KV stores), one module each."""
