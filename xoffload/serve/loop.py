"""The engine's thread: :class:`EngineLoop` drives :meth:`LLMEngine.step` while there is work and
hands each output to the asyncio queue of the HTTP request that owns it.

One background thread steps the engine; it sleeps on a condition while the engine has nothing to
do and wakes when a request arrives or one is aborted (no spinning). HTTP handlers run on the
asyncio event loop: :meth:`EngineLoop.submit` calls :meth:`LLMEngine.add_request` there (it is
thread-safe and raises at once for a bad request, so the handler can answer 400), and every
output the loop thread gets from ``step()`` is put on the request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. Aborts (a client gone, a stop string found) are queued for the
loop thread, which calls :meth:`LLMEngine.abort_request` between steps: only that thread touches
the device.

The thread also keeps the serving figures :mod:`xoffload.serve.metrics` exposes: generated tokens,
prefix-cache hit tokens, finished requests by reason, running requests, KV block usage.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

__all__ = ["EngineLoop", "QueueFull"]

log = logging.getLogger("xoffload.serve")

#: seconds of generated-token history behind the tokens/s gauge
RATE_WINDOW_S = 10.0
#: most engine steps the loop thread takes at shutdown to collect the aborted requests' outputs
SHUTDOWN_STEPS = 1000
#: shortest gap between two KV block counts taken after steps (seconds; always taken when idle)
BLOCKS_EVERY_S = 0.25


class QueueFull(Exception):
    """More requests wait than ``max_queue`` allows (the server answers 429 with Retry-After)."""


class EngineLoop:
    """The thread that steps ``engine`` (an :class:`~xoffload.engine.LLMEngine`) and routes its
    outputs.

    Args:
        engine: the engine; this loop becomes the only thread that calls its ``step()``.
        max_queue: most requests waiting beyond the ``max_num_seqs`` that can run at once (None:
            no limit); :meth:`submit` raises :class:`QueueFull` past it.

    Call :meth:`start` once, :meth:`shutdown` at the end (it closes the engine).
    """

    def __init__(self, engine, *, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.capacity = int(engine.config.max_num_seqs)
        self._cv = threading.Condition()
        self._routes: dict = {}  # request_id -> (asyncio loop, asyncio.Queue)
        self._aborts: list = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="xoffload-engine-loop", daemon=True)
        self._counts: dict = {}  # request_id -> tokens seen so far
        self._rate = collections.deque()  # (time, new tokens) over the last RATE_WINDOW_S
        self.started_at = time.monotonic()
        self.generated_tokens_total = 0
        self.prefix_hit_tokens_total = 0
        self.prompt_tokens_total = 0
        self.finished_total: collections.Counter = collections.Counter()
        self.step_errors_total = 0
        self.running = 0
        self.blocks: dict = {}
        self._blocks_at = 0.0

    # ------------------------------------------------------------------ from the event loop
    def start(self) -> None:
        """Start the loop thread (once)."""
        self._take_blocks()
        self._thread.start()

    @property
    def active(self) -> int:
        """Requests submitted through this loop and not finished or aborted yet."""
        with self._cv:
            return len(self._routes)

    @property
    def waiting(self) -> int:
        """Active requests beyond the ones running now."""
        return max(0, self.active - self.running)

    def submit(self, request_id: str, prompt_ids: list, sampling_params) -> asyncio.Queue:
        """Queue a request with the engine; returns the asyncio queue its outputs
        (:class:`~xoffload.engine.RequestOutput`, the last one ``finished``) arrive on. Call from
        the event loop's thread.

        Raises:
            QueueFull: ``max_queue`` requests already wait beyond the running ones.
            ValueError / TypeError: what :meth:`LLMEngine.add_request` raises for a bad request
                (a prompt over ``max_model_len``, KV that can never fit, ...); RuntimeError once
                the loop is shut down.
        """
        q: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            if self.max_queue is not None and len(self._routes) >= self.capacity + self.max_queue:
                raise QueueFull(f"{len(self._routes)} requests in flight: {self.capacity} can run and "
                                f"max_queue={self.max_queue} can wait")
            self._routes[request_id] = (asyncio.get_running_loop(), q)
        try:
            self.engine.add_request(request_id, prompt_ids, sampling_params)
        except BaseException:
            with self._cv:
                self._routes.pop(request_id, None)
            raise
        with self._cv:
            self.prompt_tokens_total += len(prompt_ids)
            self._cv.notify()
        return q

    def abort(self, request_id: str) -> None:
        """Stop routing ``request_id`` and have the loop thread abort it in the engine before its
        next step (its KV freed). Unknown or finished ids are ignored. Any thread."""
        with self._cv:
            if self._routes.pop(request_id, None) is None:
                return
            self._aborts.append(request_id)
            self._cv.notify()

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last :data:`RATE_WINDOW_S` seconds."""
        now = time.monotonic()
        with self._cv:
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()
            n = sum(k for _, k in self._rate)
        span = min(RATE_WINDOW_S, max(1e-3, now - self.started_at))
        return n / span

    def shutdown(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` seconds for the active requests to finish, abort the rest, stop
        the thread and close the engine. Safe to call twice."""
        end = time.monotonic() + max(0.0, timeout)
        while self.active and time.monotonic() < end:
            time.sleep(0.05)
        with self._cv:
            rids = list(self._routes)
        for rid in rids:
            self.abort(rid)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, timeout))
        self.engine.close()

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        e = self.engine
        while True:
            with self._cv:
                while not (self._stop or self._aborts or e.has_unfinished_requests()):
                    self._cv.wait()
                aborts, self._aborts = self._aborts, []
                stop = self._stop
            if aborts:
                e.abort_request(aborts)
            if stop:
                for _ in range(SHUTDOWN_STEPS):  # the aborted ones' final outputs
                    if not e.has_unfinished_requests():
                        break
                    self._step()
                self._take_blocks()
                return
            self._step()
            if not e.has_unfinished_requests():
                self._take_blocks()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception:  # the engine failed the epoch's requests; their outputs come next step
            log.exception("engine step failed")
            self.step_errors_total += 1
            return
        now = time.monotonic()
        new = 0
        with self._cv:
            for o in outs:
                n = len(o.token_ids)
                new += max(0, n - self._counts.get(o.request_id, 0))
                self._counts[o.request_id] = n
                route = self._routes.get(o.request_id)
                if o.finished:
                    self._counts.pop(o.request_id, None)
                    self.finished_total[o.finish_reason or "unknown"] += 1
                    self.prefix_hit_tokens_total += int((o.timings or {}).get("prefix_reused_tokens", 0) or 0)
                    self._routes.pop(o.request_id, None)
                if route is not None:
                    loop, q = route
                    try:
                        loop.call_soon_threadsafe(q.put_nowait, o)
                    except RuntimeError:  # that event loop is closed: nobody reads this request
                        pass
            self.generated_tokens_total += new
            if new:
                self._rate.append((now, new))
            r = self.engine._runner
            self.running = len(r.sched.running) if r is not None else 0
        if now - self._blocks_at >= BLOCKS_EVERY_S:
            self._take_blocks()

    def _take_blocks(self) -> None:
        """KV block counts: the runtime's pool (offload: pinned host; resident + Quest: on the GPU)
        and the open store's GPU pool."""
        e = self.engine
        blocks = {}
        try:
            if e.offload is not None and not getattr(e, "closed", False):
                u = e.offload.allocator.usage()
                where = "gpu" if e.offload.pool.placement == "device" else "host"
                blocks[where] = {"total": u["total"], "free": u["free"], "used": u["seq_held"],
                                  "cached": u["external_only"]}
            r = e._runner
            pool = getattr(r.store, "pool", None) if r is not None else None
            alloc = getattr(pool, "alloc", None)
            if alloc is not None and hasattr(alloc, "usage"):
                u = alloc.usage()
                blocks["gpu"] = {"total": u["total"], "free": u["free"], "used": u["seq_held"],
                                 "cached": u["external_only"]}
        except Exception:  # a store closing under us: keep the last counts
            return
        self.blocks = blocks
        self._blocks_at = time.monotonic()
