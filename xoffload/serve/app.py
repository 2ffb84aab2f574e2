"""The OpenAI-compatible HTTP app: :func:`create_app` builds a FastAPI application over an
:class:`~xoffload.engine.LLMEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or Server-Sent Events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Requests reach the engine through one :class:`~xoffload.serve.loop.EngineLoop` thread; each
handler awaits its request's asyncio queue and turns the outputs into text deltas
(:class:`~xoffload.serve.detok.IncrementalText`). Bad input is a 400 with OpenAI's error object,
never a 500; a client that goes away aborts its request (its KV freed); past ``max_queue``
waiting requests a 429 with ``Retry-After``; with an API key ``/v1/*`` needs
``Authorization: Bearer <key>`` (401 otherwise).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .detok import IncrementalText, make_decoder
from .loop import EngineLoop, QueueFull
from .metrics import CONTENT_TYPE, render_metrics
from .protocol import ApiError, error_body, parse_chat, parse_completion

__all__ = ["create_app", "DEFAULT_MAX_QUEUE"]

#: default ``max_queue``: requests that may wait beyond the running ones
DEFAULT_MAX_QUEUE = 256
#: seconds between two checks for a gone client while a request waits for output
POLL_S = 0.5
#: the ``Retry-After`` header of a 429 (seconds)
RETRY_AFTER_S = 1


class _Stream(StreamingResponse):
    """A streaming response that calls ``on_close()`` however it ends (finished, client gone,
    cancelled at shutdown)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(engine, served_model_name: str, *, api_key: str | None = None,
               max_queue: int | None = DEFAULT_MAX_QUEUE, shutdown_timeout: float = 30.0) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``engine``.

    Args:
        engine: an :class:`~xoffload.engine.LLMEngine` nobody else steps; the app's engine loop
            thread starts with the app (ASGI lifespan, or the first request) and closes the
            engine at shutdown.
        served_model_name: the name clients pass as ``model`` (others: 400).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (401 otherwise);
            ``/health`` and ``/metrics`` stay open.
        max_queue: requests that may wait beyond the ``max_num_seqs`` running ones (None: no
            limit); past it a 429 with ``Retry-After``.
        shutdown_timeout: seconds the lifespan shutdown lets requests still in flight finish
            before aborting them and closing the engine.
    Returns: the app; ``app.state.loop`` is its :class:`~xoffload.serve.loop.EngineLoop`;
        ``app.state.drain()`` starts a graceful shutdown (the server calls it on SIGTERM): new
        requests get 503, requests in flight run on for ``shutdown_timeout`` seconds and then end
        with ``finish_reason`` ``"abort"`` (a stream gets its last chunk and ``[DONE]``).
    Raises: ValueError for a negative ``max_queue`` or an empty ``served_model_name``.
    """
    if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 0):
        raise ValueError(f"max_queue must be an int >= 0 or None, got {max_queue!r}")
    if not isinstance(served_model_name, str) or not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty str, got {served_model_name!r}")
    loop = EngineLoop(engine, max_queue=max_queue)
    started = []

    def ensure_started():
        if not started:
            started.append(True)
            loop.start()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        ensure_started()
        yield
        await asyncio.to_thread(loop.shutdown, shutdown_timeout)

    app = FastAPI(title="xoffload", lifespan=lifespan)
    app.state.loop = loop
    server = _Server(engine, loop, served_model_name, ensure_started, shutdown_timeout)
    app.state.drain = server.drain
    created = int(time.time())

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            got = request.headers.get("authorization", "")
            if got != f"Bearer {api_key}":
                why = "missing API key" if not got else "invalid API key"
                return JSONResponse(error_body(f"{why}: send 'Authorization: Bearer <key>'", "authentication_error",
                                               None, "invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        loc = [str(x) for x in (errs[0].get("loc", ()) if errs else ()) if x != "body"]
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(error_body(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=loc[0] if loc else None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(loop, served_model_name), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "xoffload", "max_model_len": engine.config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.handle(request, parse_chat)

    return app


class _Server:
    """The generation routes' work: body -> prompt ids and sampling -> engine -> response."""

    def __init__(self, engine, loop: EngineLoop, name: str, ensure_started, shutdown_timeout: float):
        self.engine, self.loop, self.name, self.ensure_started = engine, loop, name, ensure_started
        self.model = engine.model
        self.decode = make_decoder(self.model.tokenizer)
        self.max_len = int(engine.config.max_model_len)
        self.shutdown_timeout = float(shutdown_timeout)
        self.drain_deadline = None  # monotonic time at which requests in flight are aborted

    def drain(self) -> None:
        """Begin a graceful shutdown (see :func:`create_app`); a second call changes nothing."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.shutdown_timeout

    async def handle(self, request: Request, parse):
        """Answer one generation request (JSON or SSE). Raises :class:`ApiError` for bad input."""
        from xoffload.engine import SamplingParams

        if self.drain_deadline is not None:
            raise ApiError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        p = parse(body, self.name)
        ids = await asyncio.to_thread(self._prompt_ids, p)
        if len(ids) > self.max_len:
            raise ApiError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_len}",
                           "messages" if p.kind == "chat" else "prompt", code="context_length_exceeded")
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_len - len(ids) + 1
        try:
            # no seed: a fresh one per request (the engine's default seed would give every sampled
            # request with the same prompt the same answer)
            seed = p.seed if p.seed is not None else random.getrandbits(63)
            sp = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=max_tokens,
                                seed=seed, stop_token_ids=tuple(p.stop_ids))
        except (ValueError, TypeError) as e:
            raise ApiError(str(e)) from None
        rid = ("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.ensure_started()
        try:
            q = self.loop.submit(rid, ids, sp)
        except QueueFull as e:
            raise ApiError(f"the server is busy ({e}); retry later", status=429, type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (ValueError, TypeError) as e:
            raise ApiError(str(e), "messages" if p.kind == "chat" else "prompt") from None
        except RuntimeError as e:
            raise ApiError(str(e), status=503, type="server_error", code="shutting_down") from None
        text = IncrementalText(self.decode, p.stop_strings, set(p.stop_ids) | set(self.engine.stop_ids))
        run = _Run(self, rid, q, request, text, p, len(ids))
        if p.stream:
            return _Stream(run.sse(), run.close, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await run.wait()
        finally:
            run.close()
        if run.error is not None:
            raise ApiError(run.error, status=500, type="server_error", code="engine_error")
        return run.response()

    def _prompt_ids(self, p) -> list:
        from xoffload.engine.inputs import apply_chat_template, encode

        try:
            if p.kind == "chat":
                if self.model.tokenizer is None or not getattr(self.model.tokenizer, "chat_template", None):
                    raise ApiError(f"model {self.name!r} has no tokenizer with a chat template: use "
                                   f"/v1/completions with a prompt of token ids", "messages",
                                   code="no_chat_template")
                return apply_chat_template(self.model, p.messages)
            if isinstance(p.prompt, str):
                if self.model.tokenizer is None:
                    raise ApiError(f"model {self.name!r} has no tokenizer: send the prompt as token ids", "prompt",
                                   code="no_tokenizer")
                return encode(self.model, p.prompt)
            return list(p.prompt)
        except ApiError:
            raise
        except Exception as e:  # a template that refuses the messages (roles, order)
            raise ApiError(f"cannot build the prompt: {type(e).__name__}: {e}",
                           "messages" if p.kind == "chat" else "prompt") from None


class _Run:
    """One request in flight: its outputs read off its queue, text deltas, the final figures."""

    def __init__(self, server: _Server, rid, q, request, text: IncrementalText, p, prompt_tokens: int):
        self.s, self.rid, self.q, self.request, self.text, self.p = server, rid, q, request, text, p
        self.prompt_tokens, self.cached = prompt_tokens, 0
        self.finish_reason = None
        self.error = None
        self.created = int(time.time())

    def close(self) -> None:
        """Abort the engine request unless it finished (a client gone, a stop string, shutdown)."""
        if self.finish_reason in (None, "abort") or self.text.stopped:
            self.s.loop.abort(self.rid)

    async def deltas(self):
        """Text deltas as they come (an async generator); sets ``finish_reason`` (and ``error``)
        at the end. A gone client ends it early (the request is aborted by :meth:`close`)."""
        checked = time.monotonic()
        while True:
            try:
                o = await asyncio.wait_for(self.q.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                o = None
            end = self.s.drain_deadline
            if end is not None and time.monotonic() >= end:  # shutting down: time is up
                self.finish_reason = "abort"
                return
            if o is None or time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await self.request.is_disconnected():
                    return
                if o is None:
                    continue
            while not o.finished and not self.q.empty():
                o = self.q.get_nowait()  # a slow reader skips to the newest progress
            self.cached = max(self.cached, int(o.num_cached_tokens or 0),
                              int((o.timings or {}).get("prefix_reused_tokens", 0) or 0))
            if o.finished and o.finish_reason == "error":
                self.finish_reason = "error"
                self.error = f"the engine failed this request: {type(o.error).__name__}: {o.error}"
                return
            delta = self.text.update(o.token_ids, final=o.finished)
            if self.text.stopped:
                self.finish_reason = "stop"
            elif o.finished:
                self.finish_reason = o.finish_reason
            if delta or self.s.decode is None:
                yield delta
            if self.finish_reason is not None:
                return

    async def wait(self) -> None:
        """Read the whole request (non-streaming)."""
        async for _ in self.deltas():
            pass

    def usage(self) -> dict:
        n = self.text.num_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def response(self) -> dict:
        """The non-streaming body."""
        if self.p.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text.text},
                      "logprobs": None, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text.text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.s.name,
                "choices": [choice], "usage": self.usage()}

    def _chunk(self, delta: str | None, finish=None, *, role: bool = False, usage: bool = False) -> str:
        if self.p.kind == "chat":
            d = {} if delta is None else {"content": delta}
            if role:
                d = {"role": "assistant", "content": ""}
            choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
            obj = "chat.completion.chunk"
        else:
            choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.s.name, "choices": choices}
        if usage:
            body["choices"] = []
            body["usage"] = self.usage()
        elif self.p.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self):
        """The Server-Sent Events of a streamed request, ending with ``data: [DONE]``."""
        if self.p.kind == "chat":
            yield self._chunk(None, role=True)
        async for delta in self.deltas():
            yield self._chunk(delta)
        if self.finish_reason is None:  # the client went away
            return
        if self.error is not None:
            yield f"data: {json.dumps(error_body(self.error, 'server_error', None, 'engine_error'))}\n\n"
        else:
            yield self._chunk(None, self.finish_reason)
            if self.p.include_usage:
                yield self._chunk(None, usage=True)
        yield "data: [DONE]\n\n"
