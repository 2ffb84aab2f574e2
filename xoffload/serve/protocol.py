"""The OpenAI request bodies the server accepts, checked by hand (:func:`parse_completion`,
:func:`parse_chat`), and its error object (:class:`ApiError`).

Every check names the offending field: an unknown field, a value of the wrong type or out of
range raises :class:`ApiError` (HTTP 400, ``{"error": {"message", "type", "param", "code"}}``),
never a server error. No torch here: parsing needs only the body and the served model's name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ApiError", "ParsedRequest", "parse_completion", "parse_chat", "error_body",
           "COMPLETION_FIELDS", "CHAT_FIELDS"]

#: fields of ``POST /v1/completions`` (anything else is refused, named)
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                               "stream", "stream_options", "n", "user"})
#: fields of ``POST /v1/chat/completions``
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                         "top_k", "seed", "stop", "stream", "stream_options", "n", "user"})
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered with OpenAI's error object.

    Args:
        message: the one-line reason (str).
        param: the request field it concerns, or None.
        status: the HTTP status (default 400).
        type: OpenAI's error type (default ``"invalid_request_error"``).
        code: a short machine-readable code, or None.
        headers: extra response headers (e.g. ``Retry-After`` with 429).
    """

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object as a dict."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """A checked request: what the engine needs and how to answer.

    ``kind``: ``"completion"`` or ``"chat"``; ``prompt``: a string or token ids (completions),
    None for chat; ``messages``: the chat messages (``{"role", "content"}`` with string content);
    ``max_tokens``: None = as many as ``max_model_len`` leaves; ``temperature`` / ``top_p`` /
    ``top_k`` / ``seed``: sampling; ``stop_strings`` / ``stop_ids``: the two kinds of ``stop``;
    ``stream``, ``include_usage``.
    """

    kind: str
    model: str
    prompt: object = None
    messages: list | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: list = field(default_factory=list)
    stop_ids: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _typename(x) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(x), type(x).__name__)


def _common(body, allowed, served: str, kind: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_typename(body)}")
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        raise ApiError(f"unsupported field {extra[0]!r} (this server takes: {', '.join(sorted(allowed))})",
                       extra[0], code="unsupported_field")
    model = body.get("model")
    if model is None:
        raise ApiError("'model' is required", "model")
    if not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {_typename(model)}", "model")
    if model != served:
        raise ApiError(f"model {model!r} does not exist; this server serves {served!r}", "model",
                       code="model_not_found")
    r = ParsedRequest(kind=kind, model=model)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(f"'n' must be 1 (one choice per request), got {n!r}", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"'user' must be a string, got {_typename(user)}", "user")
    for name, lo, lo_open, hi in (("temperature", 0.0, False, None), ("top_p", 0.0, True, 1.0)):
        v = body.get(name)
        if v is None:
            continue
        if not _is_num(v) or not math.isfinite(v):
            raise ApiError(f"{name!r} must be a number, got {v!r}", name)
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            rng = f"in ({lo:g}, {hi:g}]" if lo_open else f">= {lo:g}"
            raise ApiError(f"{name!r} must be {rng}, got {v!r}", name)
        setattr(r, name, float(v))
    k = body.get("top_k")
    if k is not None:
        if not _is_int(k) or k < -1:
            raise ApiError(f"'top_k' must be an integer >= 1 (0 or -1: off), got {k!r}", "top_k")
        r.top_k = max(0, k)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise ApiError(f"'seed' must be an integer, got {seed!r}", "seed")
        r.seed = seed
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v <= 0:
            raise ApiError(f"{name!r} must be an integer >= 1, got {v!r}", name)
        r.max_tokens = v
    _stop(body.get("stop"), r)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(f"'stream' must be a boolean, got {_typename(stream)}", "stream")
    r.stream = bool(stream)
    so = body.get("stream_options")
    if so is not None:
        if not r.stream:
            raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(so, dict):
            raise ApiError(f"'stream_options' must be an object, got {_typename(so)}", "stream_options")
        bad = sorted(x for x in so if x != "include_usage")
        if bad:
            raise ApiError(f"unsupported field {bad[0]!r} in 'stream_options'", "stream_options")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise ApiError(f"'stream_options.include_usage' must be a boolean, got {_typename(iu)}",
                           "stream_options")
        r.include_usage = iu
    return r


def _stop(stop, r: ParsedRequest) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(items, list):
        raise ApiError(f"'stop' must be a string, a token id or an array of those, got {_typename(stop)}", "stop")
    for x in items:
        if isinstance(x, str):
            if not x:
                raise ApiError("'stop' strings must not be empty", "stop")
            r.stop_strings.append(x)
        elif _is_int(x) and x >= 0:
            r.stop_ids.append(x)
        else:
            raise ApiError(f"'stop' entries must be non-empty strings or token ids >= 0, got {x!r}", "stop")


def parse_completion(body, served: str) -> ParsedRequest:
    """Check a ``/v1/completions`` body against ``served`` (the model name). ``prompt``: a
    non-empty string or a non-empty array of token ids (or an array holding one of those).
    Raises :class:`ApiError` (400) naming the field."""
    r = _common(body, COMPLETION_FIELDS, served, "completion")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise ApiError("'prompt' is empty", "prompt")
    elif isinstance(p, list):
        if not p:
            raise ApiError("'prompt' is empty", "prompt")
        if not all(_is_int(x) for x in p):
            raise ApiError("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    elif p is None:
        raise ApiError("'prompt' is required", "prompt")
    else:
        raise ApiError(f"'prompt' must be a string or an array of token ids, got {_typename(p)}", "prompt")
    r.prompt = p
    if r.max_tokens is None:
        r.max_tokens = 16  # OpenAI's default for completions
    return r


def parse_chat(body, served: str) -> ParsedRequest:
    """Check a ``/v1/chat/completions`` body against ``served``. ``messages``: a non-empty array
    of ``{"role", "content"}`` (content a string or an array of ``{"type": "text", "text"}``
    parts, joined). Raises :class:`ApiError` (400) naming the field."""
    r = _common(body, CHAT_FIELDS, served, "chat")
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise ApiError(f"'messages' must be an array, got {_typename(msgs)}", "messages")
    if not msgs:
        raise ApiError("'messages' is empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object, got {_typename(m)}", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise ApiError(f"{where}.content: only text parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string, got {_typename(content)}", "messages")
        out.append({"role": role, "content": content})
    r.messages = out
    return r
