"""The metrics port's HTTP server (``fctkit serve --metrics-port``): ``/metrics`` and nothing else.

One thread of its own runs an asyncio loop that serves every connection: no thread per scrape,
and nothing of it on the gRPC event loop. A scrape is answered from :class:`CachedPage`: the
rendered text is kept for ``cache_s`` seconds, and the scrapes that find it too old share one
render, made in a worker thread (the rollout gauges it reads come from the gRPC loop, once per
render). Responses leave at most one per ``min_interval_s`` (the scrapes beyond wait their turn,
idle), so a scraping storm costs the replica a bounded share of its CPU and GIL. A request that
is not answered within :data:`REQUEST_TIMEOUT_S` (a slow client, or one too many waiting) is
closed unanswered. Every other path is 404, every other method 405; each response closes its
connection.

Why not ``prometheus_client.start_http_server``: it starts a thread per connection, renders the
whole registry at each request and answers 200 on every path; sixteen threads scraping nonstop
raised ListVersions' median latency from 0.7 to 103 ms (``benchmarks/metrics_scrape.py``
measures it again).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .jsonlog import log_event

T = TypeVar("T")

REQUEST_TIMEOUT_S = 10.0  # Prometheus' own default scrape timeout
CLOSE_GRACE_S = 2.0  # scrapes in flight at close get this long to finish
MAX_HEAD_BYTES = 16384  # a request line and headers beyond this are refused unanswered
REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}


class CachedPage:
    """The rendered metrics text, rendered at most once per ``cache_s`` seconds (0: again for every
    scrape that comes after a render ended); scrapes arriving while a render runs share it. Used
    from one event loop; ``render`` runs in a worker thread of its own. :attr:`renders` counts them."""

    def __init__(self, render: Callable[[], bytes], cache_s: float, clock: Callable[[], float] = time.monotonic):
        self._render, self._cache_s, self._clock = render, cache_s, clock
        self._text: bytes | None = None
        self._rendered_at = 0.0
        self._pending: asyncio.Future[bytes] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fctkit-metrics-render")
        self.renders = 0

    async def text(self) -> bytes:
        if self._text is not None and self._clock() - self._rendered_at < self._cache_s:
            return self._text
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._rendered())
        return await asyncio.shield(self._pending)

    async def _rendered(self) -> bytes:
        started = self._clock()
        try:
            text = await asyncio.get_running_loop().run_in_executor(self._worker, self._render)
        finally:
            self._pending = None
        self.renders += 1
        self._text, self._rendered_at = text, started
        return text

    def close(self) -> None:
        self._worker.shutdown(wait=False)


class MetricsHttpServer:
    """Serves ``page`` at ``/metrics`` on its own thread (:meth:`start`, :meth:`close`)."""

    def __init__(self, page: CachedPage, content_type: str, min_interval_s: float) -> None:
        self._page, self._content_type, self._min_interval_s = page, content_type, min_interval_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fctkit-metrics", daemon=True)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._turn: asyncio.Lock | None = None
        self._next_turn = 0.0

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port) and serve; the port. Binding fails here (OSError)."""
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._thread.start()
        self._server = self._on_loop(self._listen(listener))
        return int(listener.getsockname()[1])

    async def _listen(self, listener: socket.socket) -> asyncio.Server:
        self._turn = asyncio.Lock()
        return await asyncio.start_server(self._serve, sock=listener, limit=MAX_HEAD_BYTES)

    def close(self) -> None:
        """Stop listening, let the scrapes in flight finish (at most :data:`CLOSE_GRACE_S`), stop the thread."""
        if self._server is not None:
            self._on_loop(self._stop())
            self._server = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLOSE_GRACE_S)
        if not self._thread.is_alive():
            self._loop.close()
        self._page.close()

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        if self._handlers:
            _, late = await asyncio.wait(self._handlers, timeout=CLOSE_GRACE_S)
            for handler in late:
                handler.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=REQUEST_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            status, method, body = await asyncio.wait_for(self._answer(reader), REQUEST_TIMEOUT_S)
            writer.write(self._response(status, b"" if method == "HEAD" else body, len(body)))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client gone, too slow, or not speaking HTTP: nothing to answer
        except Exception as exc:  # a render that failed: this scrape goes unanswered, the next renders again
            log_event("metrics scrape failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
        finally:
            writer.close()
            if handler is not None:
                self._handlers.discard(handler)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        """(status, method, body) for the request ``reader`` holds, once it is its turn."""
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        await self._wait_turn()
        if urlsplit(target).path != "/metrics":
            return 404, method, b"not found: the metrics are at /metrics\n"
        if method not in ("GET", "HEAD"):
            return 405, method, b"only GET and HEAD are answered at /metrics\n"
        return 200, method, await self._page.text()

    async def _wait_turn(self) -> None:
        """At most one response per ``min_interval_s``; the others wait here in arrival order, idle."""
        assert self._turn is not None
        async with self._turn:
            loop = asyncio.get_running_loop()
            wait = self._next_turn - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next_turn = loop.time() + self._min_interval_s

    def _response(self, status: int, body: bytes, length: int) -> bytes:
        content_type = self._content_type if status == 200 else "text/plain; charset=utf-8"
        head = (
            f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n"
        )
        return (head + ("Allow: GET, HEAD\r\n" if status == 405 else "") + "\r\n").encode("latin-1") + body
