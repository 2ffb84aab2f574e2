"""An app served by uvicorn on a background thread of this process (tests, benchmarks):
:class:`BackgroundServer`."""
from __future__ import annotations

import socket
import threading
import time

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Run ``app`` with uvicorn on a thread, listening on ``host`` and a free port.

    Use as a context manager (``with BackgroundServer(app) as srv: srv.url``) or call
    :meth:`start` / :meth:`stop`. On stop, uvicorn shuts down as on SIGTERM: in-flight requests get
    ``graceful_s`` seconds, then the app's lifespan shutdown runs (for :func:`create_app`: the
    engine loop stops and the engine is closed).

    Args:
        app: an ASGI app.
        host: the address to bind (default 127.0.0.1).
        graceful_s: uvicorn's ``timeout_graceful_shutdown`` (seconds).
        start_timeout_s: how long :meth:`start` waits for the server to come up (RuntimeError after).
    Attributes: ``url`` (``http://host:port``), ``port``.
    """

    def __init__(self, app, host: str = "127.0.0.1", *, graceful_s: float = 5.0, start_timeout_s: float = 30.0,
                 log_level: str = "warning"):
        self.app, self.host, self.graceful_s, self.start_timeout_s = app, host, graceful_s, start_timeout_s
        self.log_level = log_level
        self.port = None
        self.url = None
        self._server = None
        self._thread = None

    def start(self) -> "BackgroundServer":
        """Bind a free port, start the server thread and wait until it accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        cfg = uvicorn.Config(self.app, log_level=self.log_level, timeout_graceful_shutdown=self.graceful_s,
                             lifespan="on")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="xoffload-uvicorn", daemon=True)
        self._thread.start()
        end = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Shut the server down (graceful, then the lifespan shutdown) and join its thread."""
        if self._server is None:
            return
        drain = getattr(getattr(self.app, "state", None), "drain", None)
        if drain is not None:  # create_app's graceful shutdown: requests in flight end at its timeout
            drain()
        self._server.should_exit = True
        self._thread.join(timeout=self.graceful_s + 60)
        self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
