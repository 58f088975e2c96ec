"""Ending a revoked device's open streams at once.

A revoked device's token stops working for new calls at once (the token lookup refuses it).
Streams it already had open — a Watch waiting for versions, a download a slow reader holds
open — are tracked here per device, and :meth:`OpenStreams.end` aborts each with
UNAUTHENTICATED from the revoking call (an abort from another task ends the call even while
its handler waits on flow control). The set of revoked devices closes the gap between a
stream's authorization and its tracking: tracking refuses a revoked device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from fctkit.errors import RpcStatusError

REVOKED = "this device was revoked: its calls end here; enrol it again with a new code"


class OpenStreams:
    """The streaming calls each device has open (one server process, one event loop)."""

    def __init__(self) -> None:
        self._calls: dict[str, set[grpc.aio.ServicerContext]] = {}
        self._revoked: set[str] = set()

    @contextlib.contextmanager
    def tracked(self, device_id: str | None, context: grpc.aio.ServicerContext) -> Iterator[None]:
        if device_id is None:
            yield
            return
        if device_id in self._revoked:
            raise RpcStatusError("UNAUTHENTICATED", REVOKED)
        calls = self._calls.setdefault(device_id, set())
        calls.add(context)
        try:
            yield
        finally:
            calls.discard(context)
            if not calls:
                self._calls.pop(device_id, None)

    async def end(self, device_id: str) -> int:
        """Refuse the device's streams from now on and abort those open; returns how many."""
        self._revoked.add(device_id)
        ended = 0
        for context in list(self._calls.get(device_id, ())):
            with contextlib.suppress(grpc.aio.AbortError, RuntimeError):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, REVOKED)
            ended += 1
        return ended
