"""Every RPC of a real `fctkit serve` process on loopback, with the precise status codes."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fctkit.cli import cli
from fctkit.errors import HashMismatchError, RollbackError, SignatureError
from fctkit.protos import fleet_pb2, limits, registry_pb2, registry_pb2_grpc, vault_pb2, vault_pb2_grpc
from fctkit.protos.bundle import MANIFEST_FILE, SIGNATURE_FILE, Manifest, pack_bundle, verify_manifest
from fctkit.protos.client import FctkitClient
from fctkit.protos.common_pb2 import Chunk

from .conftest import ADMIN_TOKEN, enrolled_client, status_code

QUOTA = 4_000_000
MAX_BLOB = 3_500_000


@pytest.fixture(scope="module")
def server(start_server, archives):
    """One server with v1..v4 published (v5 is published by the watch test)."""
    process = start_server("--quota-bytes", str(QUOTA), "--max-blob-bytes", str(MAX_BLOB), "--watch-keepalive", "0.3")
    with FctkitClient(process.target, ADMIN_TOKEN) as admin:
        for version in (1, 2, 3, 4):
            admin.publish_bundle(archives[version])
    return process


@pytest.fixture(scope="module")
def admin(server):
    with FctkitClient(server.target, ADMIN_TOKEN) as client:
        yield client


def _enrol(server, name: str) -> FctkitClient:
    return enrolled_client(server, name=name, chunk_size=256 * 1024)[0]


@pytest.fixture(scope="module")
def device(server):
    with _enrol(server, "camera-a") as client:
        yield client


@pytest.fixture(scope="module")
def other_device(server):
    with _enrol(server, "camera-b") as client:
        yield client


def _raw_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


# -- health, reflection, auth ----------------------------------------------------------------


def test_health_is_serving_and_reflection_lists_the_three_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "fctkit.v1.Registry", "fctkit.v1.Vault", "fctkit.v1.Fleet"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=name)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"fctkit.v1.Registry", "fctkit.v1.Vault", "fctkit.v1.Fleet", "grpc.health.v1.Health"} <= services
        described = database.FindFileContainingSymbol("fctkit.v1.Registry")
        assert described.name == "fctkit/v1/registry.proto" and "fctkit/v1/common.proto" in described.dependency


def test_reflection_is_served_as_v1_too(server):
    """grpcurl and other current tools ask grpc.reflection.v1 first (same messages as v1alpha on the wire)."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(server.target) as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="fctkit.v1.Vault"),
        ]
        listed, described = list(info(iter(requests)))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "fctkit.v1.Registry",
        "fctkit.v1.Vault",
        "fctkit.v1.Fleet",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert described.file_descriptor_response.file_descriptor_proto  # the vault.proto descriptor


@pytest.mark.parametrize("token", [None, "garbage", "Basic abc", "Bearer "])
def test_missing_or_garbage_tokens_are_unauthenticated(server, token):
    metadata = () if token is None else (("authorization", token if " " in token else f"Bearer {token}"),)
    with grpc.insecure_channel(server.target) as channel:
        calls = [
            lambda: registry_pb2_grpc.RegistryStub(channel).ListVersions(
                registry_pb2.ListVersionsRequest(), metadata=metadata
            ),
            lambda: vault_pb2_grpc.VaultStub(channel).List(vault_pb2.ListBlobsRequest(), metadata=metadata),
            lambda: list(
                registry_pb2_grpc.RegistryStub(channel).DownloadArtifact(
                    registry_pb2.DownloadArtifactRequest(version=1, artifact_name="embed"), metadata=metadata
                )
            ),
        ]
        for call in calls:
            assert _raw_code(call) == grpc.StatusCode.UNAUTHENTICATED


def test_roles_device_cannot_publish_or_list_devices_and_admin_has_no_vault(device, admin, archives):
    assert status_code(lambda: device.publish_bundle(archives[4])) == "PERMISSION_DENIED"
    assert status_code(device.list_devices) == "PERMISSION_DENIED"
    assert status_code(lambda: device.create_enrolment_code()) == "PERMISSION_DENIED"
    assert status_code(admin.list_blobs) == "PERMISSION_DENIED"
    assert status_code(lambda: admin.report(1, 1, fleet_pb2.UPGRADE_STATE_IDLE)) == "PERMISSION_DENIED"


# -- registry --------------------------------------------------------------------------------


def test_versions_and_manifests_are_exactly_as_published(device, bundles, publisher_key):
    versions = device.list_versions()
    assert [v.version for v in versions][:4] == [1, 2, 3, 4]
    paged = device.registry.ListVersions(
        registry_pb2.ListVersionsRequest(after_version=1, page_size=2), metadata=device._metadata
    )
    assert [v.version for v in paged.versions] == [2, 3] and paged.more
    for version in (1, 4):
        manifest, signature = device.get_manifest(version)
        assert manifest == (bundles[version] / MANIFEST_FILE).read_bytes()
        assert signature == (bundles[version] / SIGNATURE_FILE).read_bytes()
        verify_manifest(manifest, signature, publisher_key.public_key())
    info = versions[3]
    assert {a.name for a in info.artifacts} == {a.name for a in Manifest.from_bytes(manifest).artifacts}
    assert info.manifest_sha256 == hashlib.sha256(manifest).hexdigest() and list(info.parents) == [3]


def test_unknown_versions_and_artifacts_are_not_found(device):
    assert status_code(lambda: device.get_manifest(99)) == "NOT_FOUND"
    assert status_code(lambda: device.plan_upgrade(99, 4)) == "NOT_FOUND"
    assert status_code(lambda: device.plan_upgrade(1, 99)) == "NOT_FOUND"
    assert status_code(lambda: device.read_blob("0" * 64)) == "NOT_FOUND"
    with open("/dev/null", "wb") as sink:
        assert status_code(lambda: device.fetch_artifact(99, "embed", sink)) == "NOT_FOUND"
        assert status_code(lambda: device.fetch_artifact(1, "forward_9_to_10", sink)) == "NOT_FOUND"
    assert status_code(lambda: device.get_manifest(0)) == "INVALID_ARGUMENT"


def _hops(plan) -> list[tuple[int, int, str, str]]:
    return [(h.source_version, h.target_version, h.forward.name, h.side_forward.name) for h in plan.hops]


def test_plans_go_hop_by_hop_or_take_a_published_direct_adapter(device):
    # v3 has no direct 1->3 adapter: two hops through v2.
    assert _hops(device.plan_upgrade(1, 3)) == [
        (1, 2, "forward_1_to_2", "side_forward_1_to_2"),
        (2, 3, "forward_2_to_3", "side_forward_2_to_3"),
    ]
    # v4 was published with a direct 1->4 adapter: one hop instead of three.
    direct = device.plan_upgrade(1, 4)
    assert _hops(direct) == [(1, 4, "forward_1_to_4", "side_forward_1_to_4")]
    assert direct.hops[0].bundle_version == 4 and not direct.hops[0].identity
    assert _hops(device.plan_upgrade(2, 4)) == [
        (2, 3, "forward_2_to_3", "side_forward_2_to_3"),
        (3, 4, "forward_3_to_4", "side_forward_3_to_4"),
    ]
    assert device.plan_upgrade(3, 3).hops == []
    assert status_code(lambda: device.plan_upgrade(3, 1)) == "NOT_FOUND"  # no adapters lead backwards


def test_interrupted_artifact_download_resumes_from_its_offset(device, bundles, tmp_path):
    expected = (bundles[1] / "embed.onnx").read_bytes()
    chunk = 64 * 1024
    request = registry_pb2.DownloadArtifactRequest(version=1, artifact_name="embed", chunk_size=chunk)
    stream = device.registry.DownloadArtifact(request, metadata=device._metadata)
    received = []
    for message in stream:
        if message.WhichOneof("payload") == "chunk":
            received.append(message.chunk.data)
            if len(received) == 3:
                break
    stream.cancel()  # the connection "breaks" after three chunks
    dest = tmp_path / "embed.onnx"
    (tmp_path / "embed.onnx.part").write_bytes(b"".join(received))
    transfer = device.download_artifact(1, "embed", dest)
    assert transfer.resumed_from == 3 * chunk and transfer.size == len(expected) > 1_000_000
    assert dest.read_bytes() == expected and transfer.sha256 == hashlib.sha256(expected).hexdigest()
    assert not (tmp_path / "embed.onnx.part").exists()


def test_download_from_any_offset_and_offset_limits(device, bundles):
    expected = (bundles[1] / "embed.onnx").read_bytes()

    def fetch(offset: int, chunk_size: int = 0):
        request = registry_pb2.DownloadArtifactRequest(
            version=1, artifact_name="embed", offset=offset, chunk_size=chunk_size
        )
        return list(device.registry.DownloadArtifact(request, metadata=device._metadata))

    tail = fetch(len(expected) - 10)
    assert (
        tail[0].header.offset == len(expected) - 10
        and tail[0].header.artifact.sha256 == hashlib.sha256(expected).hexdigest()
    )
    assert b"".join(m.chunk.data for m in tail[1:]) == expected[-10:]
    assert len(fetch(len(expected))) == 1  # the header only
    whole = fetch(0)
    assert all(len(m.chunk.data) <= limits.MAX_CHUNK_BYTES for m in whole[1:]) and len(whole) == 1 + 3
    assert _raw_code(lambda: fetch(len(expected) + 1)) == grpc.StatusCode.OUT_OF_RANGE
    assert _raw_code(lambda: fetch(0, limits.MAX_CHUNK_BYTES + 1)) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_corrupted_partial_download_is_detected_and_discarded(device, tmp_path):
    dest = tmp_path / "embed.onnx"
    (tmp_path / "embed.onnx.part").write_bytes(b"not the first bytes of the artifact")
    with pytest.raises(HashMismatchError):
        device.download_artifact(1, "embed", dest)
    assert not dest.exists() and not (tmp_path / "embed.onnx.part").exists()
    assert device.download_artifact(1, "embed", dest).resumed_from == 0


def test_download_bundle_gives_a_verified_bundle_or_refuses(device, publisher_key, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    bundle = device.download_bundle(4, tmp_path / "v4", publisher_key.public_key(), installed_version=1)
    assert bundle.manifest.version == 4 and len(bundle.manifest.artifacts) == 6
    with pytest.raises(SignatureError):
        device.download_bundle(4, tmp_path / "wrong-key", Ed25519PrivateKey.generate().public_key())
    with pytest.raises(RollbackError):
        device.download_bundle(2, tmp_path / "rollback", publisher_key.public_key(), installed_version=4)
    assert not (tmp_path / "wrong-key" / "embed.onnx").exists()  # refused before any artifact was fetched


def _tampered(bundle_dir, tmp_path, edit) -> object:
    copy = tmp_path / f"copy-{edit.__name__}"
    shutil.copytree(bundle_dir, copy)
    edit(copy)
    return pack_bundle(copy, tmp_path / f"{edit.__name__}.tar")


def flip_artifact_byte(root):
    path = root / "forward_4_to_5.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(root):
    path = root / MANIFEST_FILE
    path.write_bytes(path.read_bytes().replace(b'"normalize":true', b'"normalize":false'))


def test_tampered_or_incomplete_bundles_are_refused_and_never_listed(admin, server, bundles, archives, tmp_path):
    before = [v.version for v in admin.list_versions()]
    for edit in (flip_artifact_byte, edit_manifest):
        assert status_code(lambda edit=edit: admin.publish_bundle(_tampered(bundles[5], tmp_path, edit))) == (
            "INVALID_ARGUMENT"
        )
    archive = archives[5].read_bytes()
    header = registry_pb2.PublishHeader(archive_size=len(archive), archive_sha256=hashlib.sha256(archive).hexdigest())

    def publish(chunks):
        messages = [registry_pb2.PublishBundleRequest(header=header)] + [
            registry_pb2.PublishBundleRequest(chunk=c) for c in chunks
        ]
        return admin.registry.PublishBundle(iter(messages), metadata=admin._metadata)

    half = Chunk(offset=0, data=archive[: len(archive) // 2])
    assert _raw_code(lambda: publish([half])) == grpc.StatusCode.INVALID_ARGUMENT  # stream ends half-way
    gap = Chunk(offset=len(archive) // 2 + 1, data=archive[len(archive) // 2 + 1 :])
    assert _raw_code(lambda: publish([half, gap])) == grpc.StatusCode.INVALID_ARGUMENT  # not contiguous
    oversized = Chunk(offset=0, data=archive[: limits.MAX_CHUNK_BYTES + 1].ljust(limits.MAX_CHUNK_BYTES + 1, b"\0"))
    assert _raw_code(lambda: publish([oversized])) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(lambda: admin.publish_bundle(archives[4])) == "ALREADY_EXISTS"
    assert status_code(lambda: admin.publish_bundle(archives[2])) == "FAILED_PRECONDITION"
    assert [v.version for v in admin.list_versions()] == before
    if server.backend.name == "sqlite":  # the scale-out replica stages in a private temp folder of its own
        assert not list((server.data_dir / "tmp").glob("publish-*"))


def test_messages_over_the_limit_are_refused_by_size(admin):
    request = registry_pb2.PublishBundleRequest(chunk=Chunk(data=b"\0" * (limits.MAX_MESSAGE_BYTES + 10)))
    code = _raw_code(lambda: admin.registry.PublishBundle(iter([request]), metadata=admin._metadata))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_watch_survives_idle_time_and_receives_a_newly_published_version(server, admin, device, archives):
    latest = device.list_versions()[-1].version
    stream = device.registry.WatchVersions(
        registry_pb2.WatchVersionsRequest(after_version=latest), metadata=device._metadata
    )
    events: list = []

    def consume():
        for event in stream:
            events.append(event)
            if event.WhichOneof("event") == "published":
                return

    reader = threading.Thread(target=consume)
    reader.start()
    reader.join(1.0)  # idle: the server sends keep-alives every 0.3 s meanwhile
    assert events and all(e.WhichOneof("event") == "keepalive" for e in events)
    assert events[0].keepalive.latest_version == latest
    admin.publish_bundle(archives[latest + 1])
    reader.join(30)
    stream.cancel()
    assert events[-1].published.version == latest + 1
    assert [a.name for a in events[-1].published.artifacts] == [
        a.name for a in Manifest.from_bytes(device.get_manifest(latest + 1)[0]).artifacts
    ]


# -- vault -----------------------------------------------------------------------------------


def test_vault_upload_list_download_delete(server, device):
    ciphertext = hashlib.sha256(b"seed").digest() * 40_000  # 1.28 MB, spans several chunks
    transfer = device.upload_blob(ciphertext, item_id="item-7")
    assert transfer.resumed_from == 0 and transfer.header.item_id == "item-7"
    assert device.upload_blob(ciphertext).resumed_from == len(ciphertext)  # already stored
    listed = {b.sha256: b for b in device.list_blobs()}
    assert listed[transfer.sha256].size == len(ciphertext)
    stored = server.backend.objects(server.data_dir, "blobs")[transfer.sha256]
    assert stored == ciphertext  # kept exactly as given: the server has nothing to decrypt it with
    assert device.read_blob(transfer.sha256) == ciphertext
    assert device.stat_blob(transfer.sha256).state == vault_pb2.BLOB_STATE_STORED
    assert device.delete_blob(transfer.sha256) == sum(b.size for b in listed.values()) - len(ciphertext)
    assert transfer.sha256 not in {b.sha256 for b in device.list_blobs()}
    assert status_code(lambda: device.delete_blob(transfer.sha256)) == "NOT_FOUND"


def _upload_messages(
    data: bytes, *, size: int | None = None, sha256: str | None = None, offset: int = 0, upto: int | None = None
):
    header = vault_pb2.UploadHeader(
        sha256=sha256 or hashlib.sha256(data).hexdigest(), size=len(data) if size is None else size, offset=offset
    )
    yield vault_pb2.UploadBlobRequest(header=header)
    end = len(data) if upto is None else upto
    for start in range(offset, end, 100_000):
        yield vault_pb2.UploadBlobRequest(chunk=Chunk(offset=start, data=data[start : min(start + 100_000, end)]))


def test_interrupted_vault_upload_resumes_where_the_server_stopped(device, tmp_path):
    data = bytes(range(256)) * 4000  # 1,024,000 bytes
    sha256 = hashlib.sha256(data).hexdigest()
    upload = lambda messages: device.vault.Upload(messages, metadata=device._metadata)  # noqa: E731
    with pytest.raises(grpc.RpcError) as cut:
        upload(_upload_messages(data, upto=300_000))  # the stream ends early
    assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume from offset 300000" in cut.value.details()
    state = device.stat_blob(sha256)
    assert state.state == vault_pb2.BLOB_STATE_PARTIAL and state.received == 300_000
    assert _raw_code(lambda: upload(_upload_messages(data, offset=400_000))) == grpc.StatusCode.FAILED_PRECONDITION
    transfer = device.upload_blob(data)
    assert transfer.resumed_from == 300_000
    assert device.download_blob(sha256, tmp_path / "blob").resumed_from == 0
    assert (tmp_path / "blob").read_bytes() == data
    device.delete_blob(sha256)


def test_vault_refuses_bad_uploads(device):
    data = b"ciphertext" * 1000
    upload = lambda messages: device.vault.Upload(messages, metadata=device._metadata)  # noqa: E731
    assert _raw_code(lambda: upload(_upload_messages(data, sha256="ab" * 32))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw_code(lambda: upload(_upload_messages(data, sha256="not-a-digest"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw_code(lambda: upload(_upload_messages(data, size=MAX_BLOB + 1))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw_code(lambda: upload(iter([]))) == grpc.StatusCode.INVALID_ARGUMENT
    chunk_first = vault_pb2.UploadBlobRequest(chunk=Chunk(offset=0, data=data))
    assert _raw_code(lambda: upload(iter([chunk_first]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert device.stat_blob("ab" * 32).state == vault_pb2.BLOB_STATE_ABSENT


def test_a_device_cannot_reach_another_devices_blob(device, other_device):
    secret = b"encrypted image of device a" * 100
    sha256 = device.upload_blob(secret).sha256
    assert status_code(lambda: other_device.read_blob(sha256)) == "PERMISSION_DENIED"
    assert status_code(lambda: other_device.delete_blob(sha256)) == "PERMISSION_DENIED"
    assert status_code(lambda: other_device.stat_blob(sha256)) == "PERMISSION_DENIED"
    assert sha256 not in {b.sha256 for b in other_device.list_blobs()}
    assert device.read_blob(sha256) == secret


def test_quota_exceeded_is_resource_exhausted(server, admin):
    with _enrol(server, "camera-quota") as client:
        first = client.upload_blob(b"\1" * 3_000_000)
        assert status_code(lambda: client.upload_blob(b"\2" * 1_500_000)) == "RESOURCE_EXHAUSTED"
        client.delete_blob(first.sha256)
        assert client.upload_blob(b"\2" * 1_500_000).size == 1_500_000
        listing = client.vault.List(vault_pb2.ListBlobsRequest(), metadata=client._metadata)
        assert listing.quota_bytes == QUOTA and listing.used_bytes == 1_500_000


# -- fleet -----------------------------------------------------------------------------------


def test_enrolment_codes_work_once_and_only_hashes_are_stored(server, admin, publisher_key):
    from cryptography.hazmat.primitives import serialization

    code = admin.create_enrolment_code(ttl_seconds=600, label="shelf 3").code
    anonymous = FctkitClient(server.target)
    enrolment = anonymous.enrol(code.lower(), "camera-c")  # codes are case- and dash-insensitive
    raw = publisher_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert enrolment.publisher_public_key == raw and enrolment.device_id.startswith("dev-")
    assert status_code(lambda: anonymous.enrol(code, "again")) == "PERMISSION_DENIED"
    assert status_code(lambda: anonymous.enrol("AAAA-BBBB-CCCC", "guess")) == "PERMISSION_DENIED"
    assert status_code(lambda: anonymous.enrol("", "empty")) == "INVALID_ARGUMENT"
    assert (
        status_code(lambda: admin.create_enrolment_code(ttl_seconds=limits.MAX_ENROLMENT_TTL_S + 1))
        == "INVALID_ARGUMENT"
    )
    stored = server.backend.metadata_dump(server.data_dir)
    for secret in (enrolment.token, code, code.replace("-", ""), ADMIN_TOKEN):
        assert secret.encode() not in stored
    hashes = {row[0] for row in server.backend.query(server.data_dir, "SELECT token_hash FROM devices")}
    assert hashlib.sha256(enrolment.token.encode()).hexdigest() in hashes
    anonymous.close()


def test_reports_reach_the_fleet_list_and_bad_reports_are_refused(device, admin):
    response = device.report(
        2, 1234, fleet_pb2.UPGRADE_STATE_UPGRADING, target_version=4, progress=0.25, detail="batch 3/12"
    )
    assert response.latest_version >= 4
    mine = [d for d in admin.list_devices() if d.name == "camera-a"]
    assert len(mine) == 1
    assert (mine[0].version, mine[0].gallery_size, mine[0].upgrade_state, mine[0].target_version, mine[0].progress) == (
        2,
        1234,
        fleet_pb2.UPGRADE_STATE_UPGRADING,
        4,
        0.25,
    )
    assert mine[0].last_report_at == response.recorded_at and mine[0].label == "for camera-a"
    for bad in ({"progress": float("nan")}, {"progress": 1.5}, {"detail": "x" * (limits.MAX_DETAIL_CHARS + 1)}):
        assert status_code(lambda bad=bad: device.report(2, 1, fleet_pb2.UPGRADE_STATE_IDLE, **bad)) == (
            "INVALID_ARGUMENT"
        )
    assert status_code(lambda: device.report(2, 1, fleet_pb2.UPGRADE_STATE_UNSPECIFIED)) == "INVALID_ARGUMENT"
    assert status_code(lambda: device.report(2, 1, 77)) == "INVALID_ARGUMENT"
    assert status_code(lambda: device.report(2, 2**63, fleet_pb2.UPGRADE_STATE_IDLE)) == "INVALID_ARGUMENT"


def test_list_devices_pages(admin):
    first = admin.fleet.ListDevices(fleet_pb2.ListDevicesRequest(page_size=1), metadata=admin._metadata)
    second = admin.fleet.ListDevices(
        fleet_pb2.ListDevicesRequest(page_size=1, page_token=first.next_page_token), metadata=admin._metadata
    )
    assert first.next_page_token and first.devices[0].device_id != second.devices[0].device_id
    assert [d.device_id for d in admin.list_devices()][:2] == [first.devices[0].device_id, second.devices[0].device_id]
    assert (
        status_code(lambda: admin._unary(admin.fleet.ListDevices, fleet_pb2.ListDevicesRequest(page_token="x")))
        == "INVALID_ARGUMENT"
    )
    assert (
        status_code(
            lambda: admin._unary(
                admin.fleet.ListDevices, fleet_pb2.ListDevicesRequest(page_size=limits.MAX_DEVICES_PAGE + 1)
            )
        )
        == "INVALID_ARGUMENT"
    )


# -- admin CLI and log -----------------------------------------------------------------------


def test_admin_cli_lists_and_makes_codes_with_the_token_from_a_file_or_env(server, admin_token_file):
    runner = CliRunner()
    base = ["admin", "--server", server.target]
    result = runner.invoke(cli, [*base, "--admin-token-file", str(admin_token_file), "list-versions", "--json"])
    assert result.exit_code == 0, result.output
    assert [v["version"] for v in json.loads(result.output)][:4] == [1, 2, 3, 4]
    result = runner.invoke(cli, [*base, "enrol-code", "--label", "cli"], env={"FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN})
    assert result.exit_code == 0 and len(result.output.splitlines()[0].replace("-", "")) == 24
    result = runner.invoke(cli, [*base, "--admin-token-file", str(admin_token_file), "list-devices"])
    assert result.exit_code == 0 and "camera-a" in result.output
    result = runner.invoke(cli, [*base, "list-devices"], env={"FCTKIT_ADMIN_TOKEN": ""})
    assert result.exit_code != 0 and "admin token" in str(result.exception)


def test_every_call_is_logged_as_one_json_line(server):
    events = [e for e in server.events() if e.get("event") == "rpc"]
    assert events and all({"method", "peer", "principal", "code", "ms"} <= set(e) for e in events)
    assert {"OK", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "INVALID_ARGUMENT"} <= {
        e["code"] for e in events
    }
    assert not [e for e in events if e["code"] == "INTERNAL"]
    refused = [
        e for e in events if e["method"] == "/fctkit.v1.Registry/PublishBundle" and e["code"] == "PERMISSION_DENIED"
    ]
    assert refused and refused[0]["principal"].startswith("dev-")  # who tried is on the record
