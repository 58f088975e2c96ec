"""Work in the windows a device gives: phones and cameras upgrade and backfill in short
background windows (iOS background tasks, Android WorkManager: minutes, on power).

A :class:`Window` bounds one call of :meth:`~.device.Device.upgrade` or
:meth:`~.device.Device.backfill` by seconds and/or rows and names a ``progress(rows done, rows
total)`` callback. The work stops at a batch boundary, after a committed batch, once the window
is spent; every call does at least one batch (so repeated windows always move on) and a batch
is never cut (so windows form the same batches, and the same gallery, as one uninterrupted run:
``max_rows`` is reached at the end of the batch that crosses it). A paused upgrade or backfill
is a consistent gallery (its plan stays recorded) and the next call resumes it where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fctkit.errors import InputError

Progress = Callable[[int, int], object]  # progress(rows done, rows total)

PAUSED_EXIT = 5  # `device upgrade` / `device backfill`: the window was spent, more to do (run it again)


@dataclass(frozen=True)
class Window:
    """Bounds of one call: ``max_seconds`` of wall time and/or ``max_rows`` rows (None: unbounded);
    ``progress(rows done, rows total)`` is called after each committed batch."""

    max_seconds: float | None = None
    max_rows: int | None = None
    progress: Progress | None = None

    def __post_init__(self) -> None:
        if self.max_seconds is not None and not self.max_seconds >= 0:
            raise InputError(f"max_seconds must be >= 0, got {self.max_seconds}")
        if self.max_rows is not None and self.max_rows < 1:
            raise InputError(f"max_rows must be >= 1, got {self.max_rows}")

    def clock(self) -> WindowClock:
        """This window, started now."""
        return WindowClock(self)

    def tell(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


@dataclass
class WindowClock:
    """A started :class:`Window`; ``stopped`` once :meth:`spent` said so (the work paused)."""

    window: Window
    started: float = field(default_factory=time.monotonic)
    stopped: bool = False

    def spent(self, rows: int) -> bool:
        """Whether a call that took ``rows`` rows so far stops before its next batch (never before
        its first: ``rows`` 0)."""
        window = self.window
        over_rows = window.max_rows is not None and rows >= window.max_rows
        over_time = window.max_seconds is not None and time.monotonic() - self.started >= window.max_seconds
        self.stopped = rows > 0 and (over_rows or over_time)
        return self.stopped


def paused_report(rows_left: int, rows_total: int, command: str) -> dict[str, object]:
    """What a paused call prints beside its result: how far it is and how to go on."""
    return {"paused": True, "rows_done": rows_total - rows_left, "rows_left": rows_left, "continue": command}
