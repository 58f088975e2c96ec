"""Several `fctkit serve` replicas over one PostgreSQL database and one S3 bucket (issue 21):
the schema is created once however many start together; a publish on one reaches a Watch on
another within a second; a revocation ends the device's streams on every replica within a
second; quotas stay exact and replica pushes lose and duplicate nothing while the calls are
spread over replicas; an upload begun on one replica resumes on another; sweeps are single-flight."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fctkit.protos import registry_pb2, vault_pb2
from fctkit.protos.client import FctkitClient
from fctkit.protos.common_pb2 import Chunk
from fctkit.protos.retry_policy import RetryPolicy
from tests.server.conftest import ADMIN_TOKEN, enrolled_client, status_code
from tests.server.test_replica_compaction import _record


def test_replicas_started_together_create_the_schema_once(start_replicas, scale_out):
    replicas = start_replicas(3)
    from fctkit.server.storage_schema import SCHEMA_VERSION

    assert scale_out.query(replicas[0].data_dir, "SELECT version FROM fctkit_schema") == [(SCHEMA_VERSION,)]
    for replica in replicas:
        with FctkitClient(replica.target, ADMIN_TOKEN) as admin:
            assert admin.list_versions() == []


def test_a_version_published_on_one_replica_reaches_a_watch_on_another_within_a_second(start_replicas, archives):
    first, second = start_replicas(2)
    device, _ = enrolled_client(second)
    stream = device.registry.WatchVersions(registry_pb2.WatchVersionsRequest(), metadata=device._metadata)
    arrived: list[float] = []

    def watch() -> None:
        for event in stream:
            if event.WhichOneof("event") == "published":
                arrived.append(time.monotonic())
                return

    reader = threading.Thread(target=watch)
    reader.start()
    time.sleep(0.5)  # the stream is open on the second replica
    with FctkitClient(first.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])
        published = time.monotonic()
    reader.join(10)
    stream.cancel()
    assert arrived and arrived[0] - published < 1.0, (
        f"the watch got v1 {arrived and arrived[0] - published} s after the publish"
    )
    assert [v.version for v in device.list_versions()] == [1]


def test_a_revoked_device_is_refused_on_every_replica_within_a_second_streams_included(start_replicas):
    replicas = start_replicas(3)
    device, enrolment = enrolled_client(replicas[0])
    clients = [FctkitClient(r.target, device._metadata[0][1].removeprefix("Bearer ")) for r in replicas[1:]]
    streams = [c.registry.WatchVersions(registry_pb2.WatchVersionsRequest(), metadata=c._metadata) for c in clients]
    ended: list[tuple[float, grpc.StatusCode]] = []

    def hold(stream) -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError as error:
            ended.append((time.monotonic(), error.code()))

    readers = [threading.Thread(target=hold, args=(s,)) for s in streams]
    for reader in readers:
        reader.start()
    time.sleep(0.5)
    with FctkitClient(replicas[0].target, ADMIN_TOKEN) as admin:
        admin.revoke_device(enrolment.device_id)
        revoked = time.monotonic()
    for reader in readers:
        reader.join(5)
    assert len(ended) == 2 and all(code == grpc.StatusCode.UNAUTHENTICATED for _, code in ended)
    assert max(at for at, _ in ended) - revoked < 1.0
    for client in clients:
        assert status_code(client.list_versions) == "UNAUTHENTICATED"
        client.close()


def test_quota_is_exact_under_concurrent_uploads_spread_over_replicas(start_replicas):
    size, fits = 50_000, 5
    replicas = start_replicas(3, "--quota-bytes", str(size * fits + size // 2))
    first, _enrolment = enrolled_client(replicas[0], name="phone")
    token = first._metadata[0][1].removeprefix("Bearer ")
    clients = [FctkitClient(r.target, token) for r in replicas]
    blobs = [hashlib.sha256(bytes([k])).digest() * (size // 32) + bytes(size % 32) for k in range(12)]

    def upload(k: int) -> str:
        try:
            clients[k % 3].upload_blob(blobs[k], f"item-{k}")
            return "stored"
        except Exception as exc:
            return getattr(exc, "code", repr(exc))

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(upload, range(12)))
    assert outcomes.count("stored") == fits and outcomes.count("RESOURCE_EXHAUSTED") == 12 - fits, outcomes
    listed = first.list_blobs()
    assert len(listed) == fits and sum(b.size for b in listed) == size * fits
    for client in clients:
        client.close()


def test_concurrent_pushes_and_pulls_through_different_replicas_lose_and_duplicate_nothing(start_replicas):
    replicas = start_replicas(3)
    phone, enrolment = enrolled_client(replicas[0], name="phone")
    tablet, _ = enrolled_client(replicas[1], enrolment.owner_id, name="tablet")
    reader, _ = enrolled_client(replicas[2], enrolment.owner_id, name="reader")
    per_device, batch = 600, 50

    def push(client: FctkitClient, prefix: str) -> None:
        for start in range(0, per_device, batch):
            records = [_record(start + k + 1, f"{prefix}-{start + k}", size=40) for k in range(batch)]
            client.push_records(records)
            client.push_records(records[: batch // 2])  # a retried push stores nothing twice

    seen: list[int] = []
    stop = threading.Event()

    def pull() -> None:
        after = 0
        while not stop.is_set():
            for response in reader.pull_records(after):
                seen.extend(r.sequence for r in response.records)
                after = max(after, *(r.sequence for r in response.records))
            time.sleep(0.05)

    pushers = [threading.Thread(target=push, args=(phone, "p")), threading.Thread(target=push, args=(tablet, "t"))]
    puller = threading.Thread(target=pull)
    for thread in (*pushers, puller):
        thread.start()
    for thread in pushers:
        thread.join(120)
    stop.set()
    puller.join(30)
    for replica in replicas:
        with FctkitClient(replica.target, phone._metadata[0][1].removeprefix("Bearer ")) as client:
            records = [r for response in client.pull_records() for r in response.records]
            assert sorted(r.item_id for r in records) == sorted(
                [f"p-{k}" for k in range(per_device)] + [f"t-{k}" for k in range(per_device)]
            )
            assert [r.sequence for r in records] == list(range(1, 2 * per_device + 1))  # every sequence once, in order
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(1, 2 * per_device + 1))
    assert seen == sorted(seen)  # a reader never sees a sequence number appear behind one it already has


def test_an_upload_begun_on_one_replica_resumes_on_another(start_replicas):
    first, second = start_replicas(2)
    client, _enrolment = enrolled_client(first, name="camera")
    data = hashlib.sha256(b"original").digest() * 100_000  # 3.2 MB: three part objects and a bit
    sha256 = hashlib.sha256(data).hexdigest()
    sent = 2_500_000

    def half() -> vault_pb2.UploadBlobRequest:
        yield vault_pb2.UploadBlobRequest(header=vault_pb2.UploadHeader(sha256=sha256, size=len(data), item_id="photo"))
        for start in range(0, sent, 1 << 20):
            yield vault_pb2.UploadBlobRequest(
                chunk=Chunk(offset=start, data=data[start : min(start + (1 << 20), sent)])
            )

    with pytest.raises(grpc.RpcError) as cut_short:
        client.vault.Upload(half(), metadata=client._metadata)
    assert cut_short.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the stream ended early: resume
    token = client._metadata[0][1].removeprefix("Bearer ")
    with FctkitClient(second.target, token) as other:
        state = other.stat_blob(sha256)
        assert state.state == vault_pb2.BLOB_STATE_PARTIAL and state.received == sent
        transfer = other.upload_blob(data, "photo")
        assert transfer.resumed_from == sent
        assert other.read_blob(sha256) == data
    assert client.read_blob(sha256) == data


def test_sweeps_run_on_one_replica_at_a_time(scale_out, tmp_path):
    from fctkit.server.vault import VaultService

    first, second = (scale_out.open_storage(tmp_path / "data") for _ in range(2))
    try:
        with first.single_flight("sweep-uploads") as mine:
            assert mine
            with second.single_flight("sweep-uploads") as theirs:
                assert not theirs
            assert VaultService(second, quota_bytes=1 << 20, max_blob_bytes=1 << 20).sweep_uploads() == 0
        with second.single_flight("sweep-uploads") as theirs:
            assert theirs  # released with the first one's turn
    finally:
        first.close()
        second.close()


def test_an_unreachable_object_store_is_unavailable_not_an_internal_error(
    scale_out, publisher_pub, admin_token_file, tmp_path
):
    from tests.server.conftest import Backend, ServerProcess
    from tests.support.scale_services import start_s3

    own_s3 = start_s3(tmp_path / "moto.log")
    own_s3.create_bucket("fctkit-tests")
    replica = ServerProcess(
        tmp_path / "data", publisher_pub, admin_token_file, backend=Backend("postgres", scale_out.cluster, own_s3)
    ).start()
    try:
        client, _ = enrolled_client(replica, name="camera")
        client.retry = RetryPolicy(attempts=1)
        own_s3.stop()  # the bucket's endpoint goes away
        assert status_code(lambda: client.upload_blob(b"sealed" * 1000, "photo")) == "UNAVAILABLE"
        assert any(e.get("event") == "storage unreachable" for e in replica.events())
        client.close()
    finally:
        replica.stop()
        own_s3.stop()


def test_health_is_not_serving_while_the_database_is_unreachable(scale_out, publisher_pub, admin_token_file, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.server.conftest import Backend, ServerProcess
    from tests.support.scale_services import start_postgres

    own_cluster = start_postgres(tmp_path / "pg")
    replica = ServerProcess(
        tmp_path / "data", publisher_pub, admin_token_file, backend=Backend("postgres", own_cluster, scale_out.s3)
    ).start()
    try:
        with grpc.insecure_channel(replica.target) as channel:
            check = lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status  # noqa: E731
            assert check() == health_pb2.HealthCheckResponse.SERVING
            own_cluster.stop()  # the database goes away
            deadline = time.monotonic() + 5
            while check() == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                time.sleep(0.05)
            assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with FctkitClient(replica.target, ADMIN_TOKEN, retry=RetryPolicy(attempts=1)) as client:
            assert status_code(client.list_devices) == "UNAVAILABLE"  # at once, not after the pool's wait
        assert any(e.get("event") == "event listener lost the database; reconnecting" for e in replica.events())
    finally:
        replica.stop()
        own_cluster.stop()


def test_storage_options_are_checked_with_errors_that_say_what_to_do(tmp_path, scale_out):
    from fctkit.errors import ConfigError
    from fctkit.server import ServerConfig
    from fctkit.server.object_store import BucketLocation
    from fctkit.server.scale_out import ScaleOutStorage

    key = tmp_path / "publisher.pub"
    for options, message in (
        ({"data_dir": tmp_path, "database": "postgresql://x/y", "object_store": "s3://b/p"}, "choose one storage"),
        ({}, "no storage"),
        ({"database": "postgresql://x/y"}, "no storage"),
        ({"database": "postgresql://x/y", "object_store": "s3://bucket/p"}, "--admin-token-file"),
    ):
        with pytest.raises(ConfigError, match=message):
            ServerConfig(publisher_key=key, **options)
    with pytest.raises(ConfigError, match="not s3://BUCKET"):
        BucketLocation.parse("s3://Not_A_Bucket/x")
    assert BucketLocation.parse("s3://fctkit-prod/v1/") == BucketLocation("fctkit-prod", "v1/")
    with pytest.raises(ConfigError, match="cannot reach bucket 'missing-bucket'"):
        ScaleOutStorage(scale_out.cluster.dsn("postgres"), "s3://missing-bucket/x", s3_endpoint_url=scale_out.s3.url)
    wrong = f"postgresql://nobody:secret-pw@127.0.0.1:{scale_out.cluster.port}/no_such_database"
    with pytest.raises(ConfigError, match="cannot connect to the database") as refused:
        ScaleOutStorage(wrong, "s3://fctkit-tests/x", s3_endpoint_url=scale_out.s3.url)
    assert "secret-pw" not in str(refused.value) and "***" in str(refused.value)
