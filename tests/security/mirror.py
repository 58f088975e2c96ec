"""An attacker's mirror for the trust tests: a real gRPC server on loopback that forwards every
call, byte for byte, to the real server, except the methods a test takes over. It stands for a
compromised server, a malicious mirror or a man in the middle: it can replay, withhold, swap or
inflate any answer, but it holds no key the real root did not give the server."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from fctkit.protos import registry_pb2

Override = Callable[[bytes, Callable[[bytes], Any]], Any]
"""``override(request_bytes, forward)`` -> the response (bytes, or a message to serialise);
``forward(request_bytes)`` asks the real server."""


def _identity(data: bytes) -> bytes:
    return data


class Mirror:
    """Forward everything to ``upstream`` (``host:port``); ``mirror.overrides[method] = fn`` takes
    a unary method over (``"/fctkit.v1.Registry/GetTrust"`` …), ``stream_overrides[method] =
    fn(request_bytes) -> response stream`` a server-streaming one."""

    def __init__(self, upstream: str) -> None:
        self.overrides: dict[str, Override] = {}
        self.stream_overrides: dict[str, Callable[[bytes], Iterator[bytes]]] = {}
        self.calls: list[str] = []
        self._caller = threading.local()  # the metadata of the call being answered
        self._channel = grpc.insecure_channel(upstream)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers((_Forwarder(self),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def take_over(self, method: str, answer: Override) -> None:
        self.overrides[f"/fctkit.v1.{method}"] = answer

    def serve_trust(
        self, change: Callable[[registry_pb2.GetTrustResponse], registry_pb2.GetTrustResponse | None]
    ) -> None:
        """Answer GetTrust with ``change(the real answer)`` (changed in place when it returns None),
        and give ListVersions answers that answer's timestamp and latest root version."""
        get_trust = self._channel.unary_unary(
            "/fctkit.v1.Registry/GetTrust", request_serializer=_identity, response_deserializer=_identity
        )

        def changed(request: bytes, forward: Callable[[bytes], Any]) -> registry_pb2.GetTrustResponse:
            response = registry_pb2.GetTrustResponse.FromString(forward(request))
            return change(response) or response

        def listing(request: bytes, forward: Callable[[bytes], Any]) -> registry_pb2.ListVersionsResponse:
            response = registry_pb2.ListVersionsResponse.FromString(forward(request))
            ask = registry_pb2.GetTrustRequest(after_root_version=0).SerializeToString()
            trust = changed(ask, lambda data: get_trust(data, metadata=self._caller.metadata))
            response.timestamp, response.latest_root_version = trust.timestamp, trust.latest_root_version
            return response

        self.take_over("Registry/GetTrust", changed)
        self.take_over("Registry/ListVersions", listing)

    def restore(self) -> None:
        self.overrides.clear()
        self.stream_overrides.clear()

    def _unary(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        forward_call = self._channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls.append(method)
            self._caller.metadata = context.invocation_metadata()

            def forward(data: bytes) -> bytes:
                try:
                    return forward_call(data, metadata=context.invocation_metadata())
                except grpc.RpcError as error:
                    context.abort(error.code(), error.details())

            override = self.overrides.get(method)
            answer = forward(request) if override is None else override(request, forward)
            return answer if isinstance(answer, bytes) else answer.SerializeToString()

        return handle

    def _client_stream(self, method: str) -> Callable[[Iterator[bytes], grpc.ServicerContext], bytes]:
        forward_call = self._channel.stream_unary(method, request_serializer=_identity, response_deserializer=_identity)

        def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            self.calls.append(method)
            try:
                return forward_call(requests, metadata=context.invocation_metadata())
            except grpc.RpcError as error:
                context.abort(error.code(), error.details())

        return handle

    def _stream(self, method: str, client_streaming: bool) -> Callable[..., Iterator[bytes]]:
        kind = self._channel.stream_stream if client_streaming else self._channel.unary_stream
        forward_call = kind(method, request_serializer=_identity, response_deserializer=_identity)

        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.calls.append(method)
            override = None if client_streaming else self.stream_overrides.get(method)
            if override is not None:
                yield from override(request)
                return
            call = forward_call(request, metadata=context.invocation_metadata())
            context.add_callback(call.cancel)
            try:
                yield from call
            except grpc.RpcError as error:
                context.abort(error.code(), error.details())

        return handle


class _Forwarder(grpc.GenericRpcHandler):
    """Every method of the three services, by its kind (unary, server-, client-streaming)."""

    def __init__(self, mirror: Mirror) -> None:
        self._mirror = mirror
        self._kinds = _method_kinds()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        kind = self._kinds.get(method)
        if kind is None:
            return None
        client_streaming, server_streaming = kind
        common = {"request_deserializer": _identity, "response_serializer": _identity}
        if not client_streaming and not server_streaming:
            return grpc.unary_unary_rpc_method_handler(self._mirror._unary(method), **common)
        if not client_streaming:
            return grpc.unary_stream_rpc_method_handler(self._mirror._stream(method, False), **common)
        if not server_streaming:
            return grpc.stream_unary_rpc_method_handler(self._mirror._client_stream(method), **common)
        return grpc.stream_stream_rpc_method_handler(self._mirror._stream(method, True), **common)


def _method_kinds() -> dict[str, tuple[bool, bool]]:
    from fctkit.protos import fleet_pb2, vault_pb2

    return {
        f"/{service.full_name}/{method.name}": (method.client_streaming, method.server_streaming)
        for module in (registry_pb2, vault_pb2, fleet_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
