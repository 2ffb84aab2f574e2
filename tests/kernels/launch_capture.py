"""A pytest plugin (``-p tests.kernels.launch_capture``) for ``test_compile_sm90.py``: under Triton's
interpreter, every kernel launch the tests make is recorded — the kernel, its argument types and
its constexpr values — and NOT run (the tests' results are then meaningless; only the launches
count). The records go, one JSON object per line, to the file named by ``XOFFLOAD_CAPTURE``.

A record: ``{"module", "name", "signature": {arg: type or "constexpr"}, "constexprs": {arg: value},
"options": {"num_warps", "num_stages"}}`` with types as Triton spells them (``*fp16``, ``i32``,
``fp32``, ...)."""
from __future__ import annotations

import inspect
import json
import os

_DT = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.int32": "i32",
       "torch.int64": "i64", "torch.int16": "i16", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1",
       "torch.float8_e4m3fn": "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _type(v):
    """Triton's type string of a launch argument, or None for a constexpr-like value."""
    if v is None:
        return None
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):  # a tensor, or an object standing for one (UVA)
        return "*" + _DT.get(str(v.dtype), "fp32")
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if type(v).__name__.startswith(("int", "uint")):  # numpy / torch integer scalars
        return "i64"
    return None


def spec(fn, args, kwargs) -> dict | None:
    """The compile spec of one launch of ``fn`` (the Python function of a jitted kernel)."""
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts = {}, {}
    for p in params:
        v = bound.get(p.name, p.default if p.default is not inspect.Parameter.empty else None)
        ann = p.annotation
        is_const = ann is not inspect.Parameter.empty and "constexpr" in str(ann)
        t = None if is_const else _type(v)
        if t is None:
            if isinstance(v, (bool, int, float, str)) or v is None:
                sig[p.name] = "constexpr"
                consts[p.name] = v
            else:
                return None  # an argument this capture cannot type
        else:
            sig[p.name] = t
    return {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts,
            "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}


def pytest_configure(config):
    from triton.runtime.interpreter import InterpretedFunction

    path = os.environ["XOFFLOAD_CAPTURE"]
    seen = set()

    def run(self, *args, grid=None, warmup=False, **kwargs):
        s = spec(self.fn, args, kwargs)
        if s is not None:
            line = json.dumps(s, sort_keys=True, default=str)
            if line not in seen:
                seen.add(line)
                with open(path, "a") as f:
                    f.write(line + "\n")
        return None

    InterpretedFunction.run = run
