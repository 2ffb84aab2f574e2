"""``GET /metrics``: the serving figures of an :class:`~xoffload.serve.loop.EngineLoop` in
Prometheus' text exposition format (version 0.0.4), written by hand (no client library).

Gauges: ``xoffload_requests_running``, ``xoffload_requests_waiting``,
``xoffload_kv_blocks{pool="host"|"gpu", state="used"|"cached"|"free"|"total"}`` (host: the pinned
pool of offload mode; gpu: the open store's paged pool of resident mode, or resident + Quest's
device pool; ``cached``: blocks only the prefix cache holds, which it frees when the pool runs
short), ``xoffload_generation_tokens_per_second``
(the last 10 s), ``xoffload_gpu_memory_allocated_bytes`` (CUDA). Counters:
``xoffload_generation_tokens_total``, ``xoffload_prompt_tokens_total``,
``xoffload_prefix_cache_hit_tokens_total``, ``xoffload_requests_finished_total{reason}``,
``xoffload_engine_step_errors_total``.
"""
from __future__ import annotations

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(loop, model_name: str) -> str:
    """The exposition text of ``loop``'s figures, every sample labelled ``model_name``.

    Args:
        loop: an :class:`~xoffload.serve.loop.EngineLoop` (read without stopping it: the figures
            are at most one engine step old).
        model_name: the served model name (label ``model``).
    Returns: the text, ending with a newline.
    """
    m = f'model="{_label(model_name)}"'
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, v in samples:
            lab = ",".join([m] + [f'{k}="{_label(x)}"' for k, x in labels])
            lines.append(f"{name}{{{lab}}} {float(v):g}" if isinstance(v, float) else f"{name}{{{lab}}} {int(v)}")

    running = loop.running
    metric("xoffload_requests_running", "gauge", "Requests decoding in the engine now.", [((), running)])
    metric("xoffload_requests_waiting", "gauge", "Requests accepted and not running yet.",
           [((), max(0, loop.active - running))])
    blocks = [((("pool", pool), ("state", state)), n)
              for pool, d in sorted(loop.blocks.items()) for state, n in sorted(d.items())]
    metric("xoffload_kv_blocks", "gauge", "KV cache blocks by pool (host: pinned CPU pool, gpu: paged GPU pool) "
           "and state (used by requests, cached: held only by the prefix cache, free, total).", blocks)
    metric("xoffload_generation_tokens_total", "counter", "Tokens generated.", [((), loop.generated_tokens_total)])
    metric("xoffload_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
           [((), loop.prompt_tokens_total)])
    metric("xoffload_prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose KV came from the prefix cache.",
           [((), loop.prefix_hit_tokens_total)])
    metric("xoffload_generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           [((), float(loop.tokens_per_s()))])
    metric("xoffload_requests_finished_total", "counter", "Finished requests by engine finish reason.",
           [((("reason", r),), n) for r, n in sorted(loop.finished_total.items())])
    metric("xoffload_engine_step_errors_total", "counter", "Engine steps that raised.", [((), loop.step_errors_total)])
    dev = getattr(loop.engine.model, "device", None)
    if dev is not None and dev.type == "cuda":
        import torch

        metric("xoffload_gpu_memory_allocated_bytes", "gauge", "GPU memory allocated by torch.",
               [((), int(torch.cuda.memory_allocated(dev)))])
    return "\n".join(lines) + "\n"
