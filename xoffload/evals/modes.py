"""Mode names of ``xoffload eval``: what ``resident``, ``offload+quest-ch@512/reuse=1``,
``offload:session`` ... mean as LLM keyword arguments (:func:`mode_options`), what a name
resolves to today (:func:`mode_config`, stored with every record so that ``--resume`` reruns a
mode whose meaning changed) and the parsing of a ``--modes`` list. Errors are :class:`ArgError`
(a ValueError the command line prints as one line)."""
from __future__ import annotations

BOTH = ("resident", "offload")


class ArgError(ValueError):
    """A bad command-line value (one line, printed as ``xoffload eval: error: ...``)."""


_ArgError = ArgError


#: ``/KEY=VALUE`` suffixes of a decode-policy mode: QuestDecode field and value type
_POLICY_KEYS = {"ch": ("exact_channels", int), "alpha": ("bound_scale", float), "page": ("page_size", int),
                "reuse": ("reuse_bias", float), "cache": ("cache_pages", int)}


def _number(text: str, conv):
    """``conv(text)`` for a plain ASCII number (digits for an int; digits, one point and an exponent
    for a float: no sign, spaces, underscores, ``nan`` or ``inf``), else None."""
    import re

    pattern = r"[0-9]+" if conv is int else r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
    return conv(text) if re.fullmatch(pattern, text) else None


def mode_options(name: str) -> dict:
    """LLM keyword arguments of a mode name: a configuration of
    :func:`xoffload.engine.modes.configurations` (``resident``, ``offload``, ``offload+quest``, ...;
    ``gpu`` = ``resident``), with ``@N`` after a decode-policy configuration setting its token
    budget (``offload+quest@512``) and an optional ``/GROUP`` after it the policy's GQA group score
    (``offload+quest@512/softmax``, see :class:`xoffload.sparse.QuestDecode`), its dense layers
    as ``/dense=I.J.K`` (``resident+quest@512/dense=0.1.7.18``: layer indices joined by ``.``; the
    mode list itself is comma-separated), its exact channels ``/ch=R``, bound scale ``/alpha=A``
    and page size ``/page=P`` (``offload+quest@512/ch=8/alpha=0.25``; each suffix at most once;
    ``/ch=`` also turns off the named policy's fitting of its channels to the model,
    ``QuestDecode.fit_channels``). A ``:session`` suffix (``offload:session``) asks each prompt as
    a session's second turn (``kw["session"] == {}``), with ``prefix_caching=True`` where the
    configuration caches prefixes (the second turn then prefills only the question). Raises
    ValueError naming the known names or the bad suffix."""
    from xoffload.engine.modes import configurations

    from .hf_peer import HF_MODE

    if name == HF_MODE:
        raise _ArgError(f"--mode {HF_MODE} is transformers' model, not an engine configuration")
    confs = configurations()
    name, sep, sess = name.partition(":session")
    session = None
    if sep:
        if sess:
            raise _ArgError(f"--mode {name + sep + sess!r}: :session takes no suffix (no @HISTORY_BUDGET, no /dense=): "
                            f"a session's history is read whole through the prefix cache and the decode policy "
                            f"chooses what each decode step reads; use {name + sep!r}")
        if name == HF_MODE:
            raise _ArgError(f"--mode {HF_MODE}:session: the transformers peer cannot run as a session")
        session = {}
    base, at, budget = name.partition("@")
    base = "resident" if base == "gpu" else base.replace("gpu+", "resident+")
    if base not in confs:
        raise _ArgError(f"unknown --mode {name!r}; known: both, gpu, {', '.join(confs)}, {HF_MODE} "
                        f"(decode policies take @BUDGET[/GROUP][/dense=I.J][/ch=R][/alpha=A][/page=P][/reuse=B][/cache=C]; any engine "
                        f"mode :session)")
    kw = dict(confs[base])
    if at:
        budget, slash, group = budget.partition("/")
        if "sparse_decode" not in kw or not (budget.isascii() and budget.isdigit()) or int(budget) < 1:
            raise _ArgError(f"--mode {name!r}: @BUDGET needs a decode-policy mode and a positive integer")
        kw["token_budget"] = int(budget)
        if slash:
            import dataclasses

            from xoffload.sparse.policy import resolve_decode

            pol = resolve_decode(kw.pop("sparse_decode"), kw.pop("token_budget"))
            fields = {}
            for part in group.split("/"):
                key, eq, val = part.partition("=")
                field = "dense_layers" if key == "dense" else _POLICY_KEYS[key][0] if key in _POLICY_KEYS \
                    else "group_score"
                if eq and field == "group_score":
                    raise _ArgError(f"--mode {name!r}: unknown /{key}= (known: /dense=, "
                                    f"{', '.join('/' + k + '=' for k in _POLICY_KEYS)})")
                if field in fields:
                    raise _ArgError(f"--mode {name!r}: /{key + eq if eq else 'GROUP'} given twice")
                if field == "dense_layers":  # /dense=0.1.7: the policy's dense layers
                    ids = val.split(".") if val else []
                    if not eq or not all(x.isascii() and x.isdigit() for x in ids):
                        raise _ArgError(f"--mode {name!r}: /dense= takes layer indices joined by '.', got {part!r}")
                    fields["dense_layers"] = tuple(int(x) for x in ids)
                elif field != "group_score":  # /ch=8, /alpha=0.25, /page=16
                    conv = _POLICY_KEYS[key][1]
                    fields[field] = _number(val, conv)
                    if fields[field] is None:
                        raise _ArgError(f"--mode {name!r}: /{key}= takes {'an integer' if conv is int else 'a number'}"
                                        f", got {val!r}")
                    if key == "ch":  # an explicit count: exactly these channels, not fitted to the model
                        fields["fit_channels"] = False
                else:
                    fields["group_score"] = part
            if any(not hasattr(pol, f) for f in fields):
                raise _ArgError(f"--mode {name!r}: /GROUP, /dense=, /ch=, /alpha=, /page=, /reuse= and /cache= need a Quest-style "
                                f"decode policy")
            try:
                kw["sparse_decode"] = dataclasses.replace(pol, **fields)
            except (TypeError, ValueError) as e:
                raise _ArgError(f"--mode {name!r}: {e}") from None
    if session is not None:
        kw["session"] = session
        if "prefix_caching" not in kw:  # the second turn finds the first one's KV where the mode caches prefixes
            from xoffload.engine.config import EngineConfig

            try:
                kw["prefix_caching"] = EngineConfig(**kw_engine(kw))._prefix_caching_refusal() is None
            except (TypeError, ValueError):  # the LLM itself names what is wrong
                pass
    return kw


def kw_engine(kw: dict) -> dict:
    """The LLM keyword arguments of :func:`mode_options`'s result (without its ``session`` key)."""
    return {k: v for k, v in kw.items() if k != "session"}


def mode_config(name: str) -> str:
    """What mode ``name`` means now: its engine options with the prefill and decode policies
    resolved (named policies and budgets become the dataclasses, defaults included), as a string."""
    from xoffload.sparse.policy import resolve_decode

    from xoffload.sparse.policy import resolve_prefill

    kw = dict(mode_options(name))
    if kw.get("sparse") is not None:  # a prefill policy by name: its settings today
        kw["sparse"] = resolve_prefill(kw["sparse"])
    if "sparse_decode" in kw or "token_budget" in kw:
        pol = resolve_decode(kw.pop("sparse_decode", None), kw.pop("token_budget", None))
        kw["sparse_decode"] = pol
        if hasattr(pol, "reuse_factor"):  # reuse_bias=None means the library's default: name its value
            kw["reuse_factor"] = pol.reuse_factor
    return repr(sorted(kw.items(), key=lambda x: x[0]))


def _parse_modes(spec: str) -> list:
    from .hf_peer import HF_MODE

    items = [x.strip() for x in str(spec).split(",") if x.strip()]
    out = []
    for it in items:
        for m in (BOTH if it == "both" else (it,)):
            if m != HF_MODE:
                mode_options(m)  # raises for an unknown name
            m = "resident" if m == "gpu" else m
            if m not in out:
                out.append(m)
    if not out:
        raise _ArgError("--mode is empty")
    return out
