"""The demo's phases: each timed and printed as it ends, and a Ctrl-C or SIGTERM that stops
the run at the next phase boundary (or device step) whatever phase it hit."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType


class Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM raise KeyboardInterrupt, so ``finally`` stops the server,
    and are remembered: :meth:`check` raises again. A signal that lands while a library's
    finalizer runs (gRPC channels have ``__del__``) only prints "Exception ignored" and the
    run would go on; every phase boundary and every device's step checks, so the demo stops
    at the latest there and exits 130 whatever phase the signal hit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        raise KeyboardInterrupt(f"signal {signum}")

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"signal {self.received}")

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """The handlers for the duration (outside the main thread: signals are left alone)."""
        try:
            previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:
            yield self
            return
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass
class Phases:
    """Wall time of each phase, printed as it ends; a remembered interrupt stops the run at
    each phase's start and end (and at each :meth:`step`)."""

    log: Callable[[str], None]
    interrupts: Interrupts = field(default_factory=Interrupts)
    seconds: dict[str, float] = field(default_factory=dict)
    count: int = 0

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.step()
        self.count += 1
        self.log(f"[{self.count}] {name} ...")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.log(f"[{self.count}] {name}: {self.seconds[name]:.1f} s")
        self.step()

    def step(self) -> None:
        self.interrupts.check()


__all__ = ["Interrupts", "Phases"]
