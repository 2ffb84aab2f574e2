"""``xoffload serve``: an OpenAI-compatible HTTP server over the engine's step loop.

- :mod:`~xoffload.serve.app`: :func:`create_app` (FastAPI: completions, chat, models, health, metrics);
- :mod:`~xoffload.serve.loop`: :class:`EngineLoop`, the one thread that steps the engine;
- :mod:`~xoffload.serve.protocol`: request checks and OpenAI's error object;
- :mod:`~xoffload.serve.detok`: incremental detokenization and stop strings;
- :mod:`~xoffload.serve.metrics`: the Prometheus exposition;
- :mod:`~xoffload.serve.cli`: the ``serve`` sub-command.

Names resolve on first use, so importing the package (and the command line's ``--help``) loads
no FastAPI, uvicorn or torch.
"""
from .._lazy import lazy_exports

_LAZY = {"create_app": ".app", "EngineLoop": ".loop", "QueueFull": ".loop", "ApiError": ".protocol",
         "IncrementalText": ".detok"}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
