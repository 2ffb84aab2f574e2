"""``xoffload serve MODEL``: the OpenAI-compatible server (:func:`~xoffload.serve.app.create_app`)
on uvicorn.

The model and engine options are the ones ``needle`` and ``generate`` take (``xoffload/cli.py``'s
``_add_model_args`` and ``_llm_kwargs``), plus the batching ones a server needs
(``--max-num-seqs``, ``--prefix-caching``, ``--kv-cache-tokens``). Prefix caching is on by default
where the configuration supports it (a conversation's next turn then prefills only its new
tokens). Importing this module loads no torch, FastAPI or uvicorn (``--help`` stays fast).
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_serve_parser", "cmd_serve"]

API_KEY_ENV = "XOFFLOAD_API_KEY"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``subparsers`` and return its parser (``args.func`` is
    :func:`cmd_serve`)."""
    from ..cli import _add_model_args, _float_in, _int_at_least, _mode

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over HTTP with OpenAI's API: /v1/completions and /v1/chat/completions (JSON or "
                    "streamed as Server-Sent Events), /v1/models, /health and Prometheus /metrics. One engine "
                    "loop decodes every running request together (continuous batching); conversations that "
                    "re-send their history reuse its KV through prefix caching.")
    p.add_argument("model", help="smollm2, a .gguf file or a HF model directory (chat needs its tokenizer and chat "
                                 "template; a random-weight preset name serves token-id prompts only)")
    _add_model_args(p, model_option=False)
    p.add_argument("--mode", default="offload", type=_mode, choices=["resident", "offload"],
                   help="where the KV cache lives: resident (on the model's device; alias gpu) or offload (pinned "
                        "CPU memory; default)")
    p.add_argument("--max-num-seqs", type=_int_at_least(1), default=8,
                   help="most requests decoded together (default 8)")
    p.add_argument("--kv-cache-tokens", type=_int_at_least(1), default=None,
                   help="tokens of KV all requests may hold: the pinned pool (offload; default max-num-seqs x "
                        "max-model-len) or a cap on the GPU pool (resident)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of a prompt's cached prefix (default: on where the mode supports it)")
    p.add_argument("--seed", type=int, default=0, help="default sampling seed (and random-weight weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL as given)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-queue", type=_int_at_least(0), default=256,
                   help="requests that may wait beyond the running ones; more get 429 (default 256)")
    p.add_argument("--shutdown-timeout", type=_float_in(0.0, None), default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    p.set_defaults(func=cmd_serve)
    return p


def engine_options(a, device_type: str) -> dict:
    """The :class:`~xoffload.engine.LLMEngine` options of parsed ``serve`` arguments: the shared
    model options, batching, and prefix caching (on by default where the configuration takes it;
    an explicit ``--prefix-caching`` the configuration refuses raises ValueError with the reason)."""
    from ..cli import UsageError, _llm_kwargs
    from ..engine.config import EngineConfig

    if a.sparse_threshold is not None and not a.sparse:
        raise UsageError(f"--sparse-threshold {a.sparse_threshold:g} needs --sparse xattn")
    kw = _llm_kwargs(a, a.mode, a.max_model_len, device_type)
    kw.update(max_num_seqs=a.max_num_seqs, seed=a.seed)
    if a.kv_cache_tokens is not None:
        kw["kv_cache_tokens"] = a.kv_cache_tokens
    if a.device is not None:
        kw["device"] = a.device
    EngineConfig.from_kwargs(**kw)  # clashes of the other options raise first
    want = a.prefix_caching
    if want is None:
        why = EngineConfig.from_kwargs(**kw)._prefix_caching_refusal()
        want = why is None
    kw["prefix_caching"] = bool(want)
    EngineConfig.from_kwargs(**kw)
    return kw


def cmd_serve(a) -> int:
    """Load the model, build the engine and the app, run uvicorn until SIGINT / SIGTERM (in-flight
    requests get ``--shutdown-timeout`` seconds, then end with ``finish_reason`` ``"abort"``; the
    engine is closed last)."""
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise ImportError(f"{e}; xoffload serve needs the serve extra: pip install 'xoffload[serve]'") from None
    from ..cli import _has_cuda
    from ..engine import LLMEngine
    from ..models import load_model

    device_type = "cuda" if _has_cuda(a.device) else "cpu"
    kw = engine_options(a, device_type)
    kw.pop("device", None)
    model = load_model(a.model, dtype=a.dtype, device=a.device, seed=a.seed)
    engine = LLMEngine(model, **kw)
    name = a.served_model_name or a.model
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = create_app(engine, name, api_key=key, max_queue=a.max_queue, shutdown_timeout=a.shutdown_timeout)
    c = engine.config
    print(f"xoffload serve: {name} ({model.cfg.arch}, {model.device}, {model.dtype}), mode {c.mode}, max_num_seqs "
          f"{c.max_num_seqs}, prefix caching {'on' if c.prefix_caching else 'off'}, max_model_len {c.max_model_len}"
          f"{'' if model.tokenizer is not None else '; no tokenizer: token-id prompts only'}", file=sys.stderr,
          flush=True)
    cfg = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                         timeout_graceful_shutdown=a.shutdown_timeout + DRAIN_SLACK_S)
    _draining_server(cfg, app.state.drain).run()
    return 0


#: seconds uvicorn waits past ``--shutdown-timeout`` before it cancels what is still open (the app
#: ends its requests at the timeout itself, each with its last chunk)
DRAIN_SLACK_S = 5.0


def _draining_server(config, drain):
    """A uvicorn server that calls ``drain()`` (the app's graceful shutdown) when SIGINT / SIGTERM
    starts its shutdown."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            drain()
            super().handle_exit(sig, frame)

    return DrainingServer(config)
