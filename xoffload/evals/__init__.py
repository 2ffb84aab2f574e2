"""Evaluations: the needle-in-a-haystack test and RULER-style long-context tasks."""
