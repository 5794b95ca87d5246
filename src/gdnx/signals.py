"""Signal handlers for the length of a block."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def handled(handler: Callable[[int, FrameType | None], Any], signals: tuple[int, ...] = STOPS) -> Iterator[None]:
    """`handler` takes these signals inside the block; the handlers before
    it are back after it (main thread only, as Python's signal module)."""
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)
