"""What every served fctkit RPC goes through (:func:`wrap_handler`):

- requests that do not decode become INVALID_ARGUMENT (instead of gRPC's generic INTERNAL);
- the caller is authorized before the handler runs (and named in the log even when refused);
- :class:`~fctkit.errors.RpcStatusError` raised by a handler becomes that status; kit input
  errors become INVALID_ARGUMENT; anything unexpected is logged with its traceback and answered
  INTERNAL with an incident id, so no request can take the server down;
- one JSON access-log line per call (method, peer, principal, status, milliseconds).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from fctkit.errors import ConfigError, InputError, RpcStatusError

from .database import storage_unreachable
from .jsonlog import log_event
from .revocation import OpenStreams

_MALFORMED = object()

CALLER: contextvars.ContextVar[Any] = contextvars.ContextVar("fctkit_caller", default=None)
"""Who makes the RPC being served (set by the authorizer; each RPC runs in its own task)."""


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
    code, fields = "OK", {}
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
    if storage_unreachable(exc):
        log_event("storage unreachable", level=logging.WARNING, error=f"{type(exc).__name__}: {exc}")
        return "UNAVAILABLE", "the server cannot reach its database or object store right now; retry (another replica may answer)"
    incident = secrets.token_hex(6)
    fields["incident"] = incident
    log_event("unexpected error", level=logging.ERROR, exc_info=True, incident=incident)
    return "INTERNAL", f"internal server error (incident {incident} in the server log)"


def wrap_handler(handler: grpc.RpcMethodHandler, method: str, authorize: Callable,
                 streams: OpenStreams | None = None) -> grpc.RpcMethodHandler:
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
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            async with _served(method, context, authorize) as caller:
                with streams.tracked(getattr(caller, "device_id", None), context):
                    return await inner_su(_checked_stream(requests), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, encode)
    inner_stream = handler.unary_stream or handler.stream_stream
    streaming_requests = handler.stream_stream is not None

    async def streaming(request_or_requests, context):
        async with _served(method, context, authorize) as caller:
            with streams.tracked(getattr(caller, "device_id", None), context):
                first = _checked_stream(request_or_requests) if streaming_requests else _checked(request_or_requests)
                async for response in inner_stream(first, context):
                    yield response

    make = grpc.stream_stream_rpc_method_handler if streaming_requests else grpc.unary_stream_rpc_method_handler
    return make(streaming, decode, encode)
