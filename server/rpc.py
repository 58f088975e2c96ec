"""What every served fctkit RPC goes through (:func:`wrap_handler`):

- requests that do not decode become INVALID_ARGUMENT (instead of gRPC's generic INTERNAL);
- the caller is authorized before the handler runs (and named in the log even when refused);
- :class:`~fctkit.errors.RpcStatusError` raised by a handler becomes that status; kit input
  errors become INVALID_ARGUMENT; anything unexpected is logged with its traceback and answered
  INTERNAL with an incident id, so no request can take the server down;
- one JSON access-log line per call (method, peer, principal, status, milliseconds).

:class:`MeteringInterceptor` (outermost, only with ``fctkit serve --metrics-port``) hands each
call's status, duration and message bytes, and the storage errors met on the way, to a
:class:`RpcMeter` (:class:`fctkit.server.metrics.ServerMetrics`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from typing import Any, Literal, Protocol

import grpc

from fctkit.errors import ConfigError, InputError, RpcStatusError

from .database import storage_unreachable
from .jsonlog import log_event
from .revocation import OpenStreams

_MALFORMED = object()

CALLER: contextvars.ContextVar[Any] = contextvars.ContextVar("fctkit_caller", default=None)
"""Who makes the RPC being served (set by the authorizer; each RPC runs in its own task)."""


class RpcMeter(Protocol):
    """What :class:`MeteringInterceptor` reports each fctkit RPC to."""

    def finished(self, method: str, code: str, seconds: float) -> None: ...
    def transferred(self, method: str, direction: Literal["received", "sent"], size: int) -> None: ...
    def storage_error(self, exc: BaseException) -> None: ...


METER: contextvars.ContextVar[RpcMeter | None] = contextvars.ContextVar("fctkit_meter", default=None)
"""The meter of the RPC being served (set by :class:`MeteringInterceptor`), None without metrics."""


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:
            return _MALFORMED

    return decode


def _checked(request: Any) -> Any:
    if request is _MALFORMED:
        raise RpcStatusError("INVALID_ARGUMENT", "the request is not a valid protobuf message of this RPC's type")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


@contextlib.asynccontextmanager
async def _served(method: str, context: grpc.aio.ServicerContext, authorize: Callable) -> AsyncIterator[Any]:
    started = time.perf_counter()
    code, fields = "OK", dict[str, Any]()
    peer = context.peer()  # read it now: asking a cancelled call's context for it crashes grpc (SIGSEGV)
    try:
        yield authorize(context)
    except grpc.aio.AbortError:
        code = "ABORTED_BY_HANDLER"
        raise
    except Exception as exc:  # every failure ends as a precise status, never as a crash
        code, details = _status_of(exc, fields)
        await context.abort(grpc.StatusCode[code], details)
    except BaseException:
        code = "CANCELLED"
        raise
    finally:
        log_event(
            "rpc",
            level=logging.WARNING if code == "INTERNAL" else logging.INFO,
            method=method,
            peer=peer,
            principal=getattr(CALLER.get(), "name", "-"),
            code=code,
            ms=round((time.perf_counter() - started) * 1000, 2),
            **fields,
        )


def _status_of(exc: Exception, fields: dict[str, Any]) -> tuple[str, str]:
    if isinstance(exc, RpcStatusError) and exc.code in grpc.StatusCode.__members__:
        return exc.code, exc.details
    if isinstance(exc, (InputError, ConfigError)):
        return "INVALID_ARGUMENT", str(exc)
    if (meter := METER.get()) is not None:
        meter.storage_error(exc)  # it tells storage errors from other failures
    if storage_unreachable(exc):
        log_event("storage unreachable", level=logging.WARNING, error=f"{type(exc).__name__}: {exc}")
        return (
            "UNAVAILABLE",
            "the server cannot reach its database or object store right now; retry (another replica may answer)",
        )
    incident = secrets.token_hex(6)
    fields["incident"] = incident
    log_event("unexpected error", level=logging.ERROR, exc_info=True, incident=incident)
    return "INTERNAL", f"internal server error (incident {incident} in the server log)"


def wrap_handler(
    handler: grpc.RpcMethodHandler, method: str, authorize: Callable, streams: OpenStreams | None = None
) -> grpc.RpcMethodHandler:
    """``handler`` with decoding checks, ``authorize(context)`` (returns the caller), error
    mapping and access log; a device's streaming calls are tracked in ``streams`` so that
    revoking the device ends them."""
    streams = streams or OpenStreams()
    decode, encode = _tolerant(handler.request_deserializer), handler.response_serializer
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            async with _served(method, context, authorize):
                return await inner_uu(_checked(request), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, decode, encode)
    if handler.stream_unary:
        inner_su: Any = handler.stream_unary  # a coroutine function (grpc.aio); the stubs type the sync server's

        async def stream_unary(requests, context):
            async with _served(method, context, authorize) as caller:
                with streams.tracked(getattr(caller, "device_id", None), context):
                    return await inner_su(_checked_stream(requests), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, encode)
    # an async generator function (grpc.aio); the stubs type the sync server's handlers
    inner_stream: Any = handler.unary_stream or handler.stream_stream
    streaming_requests = handler.stream_stream is not None

    async def streaming(request_or_requests, context):
        async with _served(method, context, authorize) as caller:
            with streams.tracked(getattr(caller, "device_id", None), context):
                first = _checked_stream(request_or_requests) if streaming_requests else _checked(request_or_requests)
                async for response in inner_stream(first, context):
                    yield response

    make = grpc.stream_stream_rpc_method_handler if streaming_requests else grpc.unary_stream_rpc_method_handler
    return make(streaming, decode, encode)


class MeteringInterceptor(grpc.aio.ServerInterceptor):
    """Reports every call of ``methods`` to ``meter``: status and seconds once the call ends
    (a stream at its end), request and response message bytes as they are decoded and encoded.
    Put it first (outermost), so that it sees what authorization and error mapping answered."""

    def __init__(self, meter: RpcMeter, methods: Collection[str]) -> None:
        self._meter, self._methods = meter, frozenset(methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        return _metered(handler, handler_call_details.method, self._meter)


def _metered(handler: grpc.RpcMethodHandler, method: str, meter: RpcMeter) -> grpc.RpcMethodHandler:
    decode, encode = handler.request_deserializer, handler.response_serializer

    def counted_decode(data: bytes) -> Any:
        meter.transferred(method, "received", len(data))
        return decode(data) if decode else data

    def counted_encode(message: Any) -> bytes:
        data = encode(message) if encode else message
        meter.transferred(method, "sent", len(data))
        return data

    @contextlib.contextmanager
    def measured(context: grpc.aio.ServicerContext) -> Iterator[None]:
        METER.set(meter)
        started, code = time.perf_counter(), "OK"
        try:
            yield
        except BaseException as exc:
            code = _final_code(exc, context)
            raise
        finally:
            meter.finished(method, code, time.perf_counter() - started)

    inner = handler.unary_unary or handler.stream_unary
    if inner is not None:

        async def single(request_or_requests, context):
            with measured(context):
                return await inner(request_or_requests, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(single, counted_decode, counted_encode)
    inner_stream: Any = handler.unary_stream or handler.stream_stream  # async (grpc.aio), as above

    async def streaming(request_or_requests, context):
        with measured(context):
            async for response in inner_stream(request_or_requests, context):
                yield response

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streaming, counted_decode, counted_encode)


def _final_code(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The status a call that raised ``exc`` ends with (an abort set it on the context)."""
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "UNKNOWN" if isinstance(exc, Exception) else "CANCELLED"
