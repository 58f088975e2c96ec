"""Ending a revoked device's open streams at once.

A revoked device's token stops working for new calls at once (the token lookup refuses it).
Streams it already had open — a Watch waiting for versions, a download a slow reader holds
open — are tracked here per device, and :meth:`OpenStreams.end` aborts each with
UNAUTHENTICATED from the revoking call (an abort from another task ends the call even while
its handler waits on flow control). The set of revoked devices closes the gap between a
stream's authorization and its tracking: tracking refuses a revoked device.
"""

from __future__ import annotations

import asyncio
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
        self._aborting: set[asyncio.Task] = set()  # kept referenced until done

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

    def devices(self) -> list[str]:
        """The devices with a stream open here now."""
        return list(self._calls)

    def end(self, device_id: str) -> int:
        """Refuse the device's streams from now on and abort those open, each in a task of its own
        (an abort may wait while the peer's flow-control window is full: no stream waits for
        another, and neither does the revoking call); returns how many."""
        self._revoked.add(device_id)
        calls = list(self._calls.get(device_id, ()))
        for context in calls:
            task = asyncio.get_running_loop().create_task(_abort(context))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)
        return len(calls)


async def _abort(context: grpc.aio.ServicerContext) -> None:
    with contextlib.suppress(grpc.aio.AbortError, RuntimeError):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REVOKED)
