"""Streams and events for one device, with no-op stand-ins in host mode (device "cpu").

Ordering between streams is by events only; nothing here synchronizes the whole device.
"""
from __future__ import annotations

import contextlib

import torch


class NullEvent:
    """Host-mode event: every operation is already complete."""

    def record(self, stream=None):
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


class NullStream:
    """Host-mode stream: work runs synchronously, so waiting is a no-op."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None


class Sync:
    """Stream/event factory for ``device`` (CUDA) or no-op objects (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def stream(self):
        """A new side stream (a pooled CUDA stream) or a NullStream."""
        return torch.cuda.Stream(device=self.device) if self.cuda else NullStream()

    def current(self):
        """The caller's current stream on the device."""
        return torch.cuda.current_stream(self.device) if self.cuda else NullStream()

    def use(self, stream):
        """Context manager making ``stream`` current (nullcontext in host mode)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def event(self):
        return torch.cuda.Event() if self.cuda else NullEvent()

    def record(self, stream=None):
        """A new event recorded on ``stream`` (default: the current stream)."""
        if not self.cuda:
            return NullEvent()
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev


class Pending:
    """Objects kept alive until an event completes (sources of async copies, dropped buffers)."""

    def __init__(self):
        self._items: list = []

    def add(self, event, *objs) -> None:
        if isinstance(event, NullEvent):
            return
        self._items.append((event, objs))

    def prune(self) -> None:
        """Drop every entry whose event has completed (non-blocking ``event.query()``)."""
        if self._items:
            self._items = [it for it in self._items if not it[0].query()]

    def wait_all(self) -> None:
        """Block the host until every entry's event completes, then drop them (used by close())."""
        for ev, _ in self._items:
            ev.synchronize()
        self._items = []

    def __len__(self):
        return len(self._items)
