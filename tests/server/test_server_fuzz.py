"""Property test: random, garbled and raw-garbage requests to every RPC of a real server.

The server must answer each one with a precise status (never crash, never UNKNOWN/INTERNAL)
and leave its data directory exactly as it was."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fctkit.protos import fleet_pb2, registry_pb2, vault_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.auth import METHOD_ROLES

from .conftest import ADMIN_TOKEN

EXPECTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
}
METHODS = [
    method
    for module in (registry_pb2, vault_pb2, fleet_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]
FD = pb_descriptor.FieldDescriptor


@pytest.fixture(scope="module")
def fuzz_target(start_server, archives):
    """A server with v1, v2, one device holding one blob, and a second device to fuzz with."""
    server = start_server("--watch-keepalive", "0.05", "--quota-bytes", "3000000")
    admin = FctkitClient(server.target, ADMIN_TOKEN)
    for version in (1, 2):
        admin.publish_bundle(archives[version])
    owner = FctkitClient(
        server.target, FctkitClient(server.target).enrol(admin.create_enrolment_code().code, "owner").token
    )
    blob_sha256 = owner.upload_blob(b"\x99ciphertext" * 1000, item_id="kept").sha256
    fuzzer_token = FctkitClient(server.target).enrol(admin.create_enrolment_code().code, "fuzzer").token
    versions = admin.list_versions()
    artifact_shas = [a.sha256 for v in versions for a in v.artifacts]
    return server, fuzzer_token, blob_sha256, artifact_shas


def _snapshot(server) -> dict:
    """What must not change: every stored object's digest (checked against its name), and the rows."""
    files = {}
    for store in ("artifacts", "blobs"):
        for name, data in server.backend.objects(server.data_dir, store).items():
            digest = hashlib.sha256(data).hexdigest()
            assert digest == name, f"{store}/{name} does not hash to its name"
            files[f"{store}/{name}"] = digest
    query = lambda sql: server.backend.query(server.data_dir, sql)  # noqa: E731
    return {
        "files": files,
        "versions": query("SELECT version, manifest, signature FROM versions ORDER BY version"),
        "blobs": query("SELECT device_id, sha256, size, item_id FROM blobs ORDER BY sha256"),
        "devices": query("SELECT device_id, token_hash FROM devices ORDER BY seq"),
    }


def _field_values(field: pb_descriptor.FieldDescriptor, strings: list[str], depth: int) -> st.SearchStrategy:
    scalar = {
        FD.TYPE_STRING: st.one_of(st.text(max_size=40), st.sampled_from(strings)),
        FD.TYPE_BYTES: st.binary(max_size=300),
        FD.TYPE_UINT32: st.one_of(st.integers(0, 6), st.integers(0, 2**32 - 1)),
        FD.TYPE_UINT64: st.one_of(st.integers(0, 3_000_000), st.integers(0, 2**64 - 1)),
        FD.TYPE_DOUBLE: st.floats(),
        FD.TYPE_BOOL: st.booleans(),
        FD.TYPE_ENUM: st.integers(-3, 9),
    }
    if field.type == FD.TYPE_MESSAGE:
        value = _messages(field.message_type, strings, depth + 1) if depth < 2 else st.just(None)
    else:
        value = scalar[field.type]
    return st.lists(value, max_size=3) if field.is_repeated else value


def _build(cls, values: dict):
    message = cls()
    for name, value in values.items():
        if isinstance(value, list):
            getattr(message, name).extend(v for v in value if v is not None)
        elif hasattr(value, "SerializeToString"):
            getattr(message, name).CopyFrom(value)
        elif value is not None:
            setattr(message, name, value)
    return message


def _messages(descriptor, strings: list[str], depth: int = 0) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(descriptor)
    optional = {f.name: _field_values(f, strings, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))


def _requests(method, strings: list[str]) -> st.SearchStrategy:
    """Serialized request(s) for ``method``: well-typed random messages or raw garbage bytes."""
    typed = _messages(method.input_type, strings).map(lambda m: m.SerializeToString())
    one = st.one_of(typed, st.binary(max_size=200))
    return st.lists(one, max_size=4) if method.client_streaming else one


def _path(method) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _invoke(channel: grpc.Channel, method, payload, metadata) -> grpc.StatusCode:
    path = _path(method)
    try:
        if method.client_streaming:
            channel.stream_unary(path)(iter(payload), metadata=metadata, timeout=20)
        elif method.server_streaming:
            call = channel.unary_stream(path)(payload, metadata=metadata, timeout=20)
            try:
                next(call, None)  # the first answer (or the error) is enough
            finally:
                call.cancel()
        else:
            channel.unary_unary(path)(payload, metadata=metadata, timeout=20)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_random_and_garbled_requests_get_status_codes_and_leave_the_data_intact(fuzz_target):
    server, fuzzer_token, blob_sha256, artifact_shas = fuzz_target
    before = _snapshot(server)
    strings = [
        blob_sha256,
        *artifact_shas,
        "0" * 64,
        "",
        "embed",
        "side_info",
        "forward_1_to_2",
        "x" * 300,
        "\x00",
        "1",
        "-1",
        "9" * 40,
        "AAAA-BBBB",
        "Bearer",
    ]
    admin, device = f"Bearer {ADMIN_TOKEN}", f"Bearer {fuzzer_token}"

    def tokens(method) -> st.SearchStrategy:
        """Mostly the right role's token, so that requests get past auth and into validation."""
        right, wrong = (admin, device) if "admin" in METHOD_ROLES[_path(method)] else (device, admin)
        return st.sampled_from([right, right, right, right, right, wrong, None, "garbage"])

    calls = st.one_of([st.tuples(st.just(m), _requests(m, strings), tokens(m)) for m in METHODS])
    answers: dict[str, int] = {}
    methods_called: set[str] = set()

    with grpc.insecure_channel(server.target) as channel:

        @settings(
            max_examples=1200,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(calls)
        def check(call):
            method, payload, token = call
            metadata = (
                ()
                if token is None
                else (("authorization", token if token.startswith("Bearer") else f"Bearer {token}"),)
            )
            code = _invoke(channel, method, payload, metadata)
            assert code == grpc.StatusCode.OK or code in EXPECTED_CODES, (method.full_name, code)
            answers[code.name] = answers.get(code.name, 0) + 1
            methods_called.add(method.full_name)

        check()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    assert server.alive()
    assert sum(answers.values()) >= 1000 and methods_called == {m.full_name for m in METHODS}
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND"} <= set(answers), answers
    assert answers["INVALID_ARGUMENT"] > answers["UNAUTHENTICATED"], answers  # most got past auth
    assert not [e for e in server.events() if e.get("code") == "INTERNAL" or e.get("level") == "error"]
    assert _snapshot(server) == before
