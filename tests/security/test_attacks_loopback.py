"""The TUF attack list as the test list (issue 35), against a real `fctkit serve --root` on
loopback, on both storage backends, with real devices. Where the server itself would have to
misbehave, the device talks to it through :class:`~tests.security.mirror.Mirror`, a real gRPC
server that forwards every call except the ones the attacker answers. Each attack is refused
with the rule's error and the device's gallery answers exactly as before.

Keys: root keys r1, r2, r3 (2 of 3); publishers alice, bob, carol (2 of 3); timestamp key ts.
Bundles are the edge tests' tiny chain v1 → v2 → v3 (16-value images)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import (
    ExpiredMetadataError,
    HashMismatchError,
    MetadataRollbackError,
    ReleaseSignatureError,
    RootChainError,
    RpcStatusError,
    SnapshotMismatchError,
    ThresholdError,
    TrustError,
)
from fctkit.export.keys import save_private_key, sign_release
from fctkit.protos import registry_pb2
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.client import FctkitClient
from fctkit.protos.trust import MAX_TIMESTAMP_BYTES, Signed, parse_timestamp, root_fingerprint
from tests.edge.conftest import TINY_CHAIN, make_tiny_bundle
from tests.security.conftest import build_root, key, signed
from tests.security.mirror import Mirror
from tests.server.conftest import (  # noqa: F401 (fixtures)
    ADMIN_TOKEN,
    admin_token_file,
    backend,
    publisher_key,
    publisher_pub,
    start_server,
)

ROOT_KEYS = ("r1", "r2", "r3")
PUBLISHERS = ("alice", "bob", "carol")
IMAGES = np.random.default_rng(5).standard_normal((12, 16)).astype(np.float32)
QUERIES = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)


def root(version: int, *, publishers=PUBLISHERS, root_keys=ROOT_KEYS, timestamp=("ts",), signers=ROOT_KEYS) -> Signed:
    body = build_root(
        version, root=root_keys, root_threshold=2, publishers=publishers, publisher_threshold=2, timestamp=timestamp
    )
    return signed(body, *signers)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("attack-keys")
    (folder / "root.1.json").write_bytes(root(1).to_bytes())
    return {
        "root1": folder / "root.1.json",
        "folder": folder,
        **{name: save_private_key(key(name), folder / f"{name}.key") for name in ("ts", "ts2")},
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """``release(version, *signers, seed=0)``: a tiny bundle folder signed by the first signer, co-signed by the others."""
    folder = tmp_path_factory.mktemp("attack-bundles")
    made: dict[tuple, Path] = {}

    def make(version: int, *signers: str, seed: int = 0) -> Path:
        if (version, signers, seed) not in made:
            out = folder / f"v{version}-{'-'.join(signers)}-{seed}"
            bundle = (
                make_tiny_bundle(out, key(signers[0]), version, TINY_CHAIN[version])
                if seed == 0
                else _reseeded(out, signers[0], version, seed)
            )
            for co_signer in signers[1:]:
                sign_release(bundle, key(co_signer))
            made[(version, signers, seed)] = bundle
        return made[(version, signers, seed)]

    return make


def _reseeded(out: Path, signer: str, version: int, seed: int) -> Path:
    """Another bundle of the same version (other weights): what a second snapshot could hold."""
    from fctkit.export.bundle_builder import build_bundle
    from tests.server.conftest import IMAGE_DIM, _sources

    sources = _sources(out.parent / f"{out.name}-src", version + 10 * seed, TINY_CHAIN[version], IMAGE_DIM)
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    return build_bundle(
        out,
        version=version,
        parents=(version - 1,) if version > 1 else (),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": ecc},
        private_key=key(signer),
    ).root


def publish(server, bundle: Path, tmp: Path) -> None:
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(pack_bundle(bundle, tmp / f"{bundle.name}-{id(bundle)}.tar"))


def publish_root(server, document: Signed) -> None:
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.publish_root(document.to_bytes())


def enrolment_code(server) -> str:
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        return admin.create_enrolment_code().code


@pytest.fixture
def world(start_server, files, release, tmp_path):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    """A server with root v1 and v1 (alice+bob) published; a mirror in front of it; a device
    enrolled through the mirror by fingerprint, synced to v1, holding 12 items."""
    server = start_server("--root", str(files["root1"]), "--timestamp-key", str(files["ts"]))
    publish(server, release(1, "alice", "bob"), tmp_path)
    mirror = Mirror(server.target)
    device = Device.init(tmp_path / "device")
    device.progress = False
    device.enrol(mirror.target, enrolment_code(server), root_fingerprint=root_fingerprint(root(1)))
    assert device.sync().installed_after == 1
    device.add(IMAGES, item_ids=[f"item{i}" for i in range(len(IMAGES))])
    yield World(server, mirror, device, tmp_path)
    device.close()
    mirror.close()
    server.stop()


class World:
    def __init__(self, server, mirror: Mirror, device: Device, tmp: Path) -> None:
        self.server, self.mirror, self.device, self.tmp = server, mirror, device, tmp

    def answers(self) -> list[list[tuple[str, float]]]:
        return [[(m.item_id, round(m.distance, 6)) for m in row] for row in self.device.query(QUERIES, k=5)]

    def snapshot(self, with_timestamp: bool) -> tuple:
        state = self.device.trust.state()
        return (
            self.device.version,
            self.device.installed_versions(),
            state.root_version,
            state.timestamp_version if with_timestamp else None,
            self.answers(),
        )

    def refused(self, error: type[Exception], match: str, action=None, *, metadata: bool = True) -> None:
        """``action`` (a sync by default) fails with ``error``; nothing the device holds changed:
        not its gallery, versions or root, nor (``metadata``: a refused timestamp or root) the
        timestamp it last accepted. A refused bundle may follow a valid new timestamp."""
        before = self.snapshot(metadata)
        with pytest.raises(error, match=match):
            (action or self.device.sync)()
        assert self.snapshot(metadata) == before


def test_a_sync_takes_the_timestamp_from_its_version_list_and_asks_for_roots_only_when_they_changed(world):
    world.mirror.calls.clear()
    world.device.sync()
    assert "/fctkit.v1.Registry/ListVersions" in world.mirror.calls
    assert "/fctkit.v1.Registry/GetTrust" not in world.mirror.calls
    publish_root(world.server, root(2, signers=("r1", "r2")))
    world.mirror.calls.clear()
    world.device.sync()
    assert world.mirror.calls.count("/fctkit.v1.Registry/GetTrust") == 1
    assert world.device.trust.state().root_version == 2


# -- arbitrary installation, thresholds, removed keys ------------------------------------------


def test_arbitrary_bundle_is_refused_from_the_server_and_from_a_folder(world, release):
    mallory = release(2, "mallory")
    with pytest.raises(RpcStatusError, match="INVALID_ARGUMENT"):
        publish(world.server, mallory, world.tmp)
    world.refused(ReleaseSignatureError, "0 valid signature", lambda: world.device.upgrade(mallory))

    def swapped_manifest(request: bytes, forward):
        answer = registry_pb2.GetManifestResponse.FromString(forward(request))
        answer.manifest = (mallory / "manifest.json").read_bytes()
        answer.signature = (mallory / "manifest.sig").read_bytes()
        return answer

    publish(world.server, release(2, "alice", "bob"), world.tmp)
    world.mirror.take_over("Registry/GetManifest", swapped_manifest)
    world.refused(SnapshotMismatchError, "not the one timestamp", metadata=False)


def test_a_bundle_signed_by_k_minus_1_of_k_publishers_is_refused(world, release):
    lone = release(2, "carol")
    with pytest.raises(RpcStatusError, match=r"INVALID_ARGUMENT.*1 valid signature"):
        publish(world.server, lone, world.tmp)
    world.refused(ReleaseSignatureError, "1 valid signature", lambda: world.device.upgrade(lone))


def test_a_removed_publisher_key_no_longer_counts(world, release):
    publish_root(world.server, root(2, publishers=("bob", "carol", "dave"), signers=("r1", "r2")))
    assert world.device.sync().installed_after == 1 and world.device.trust.state().root_version == 2
    by_alice_and_bob = release(2, "alice", "bob")
    with pytest.raises(RpcStatusError, match="INVALID_ARGUMENT"):
        publish(world.server, by_alice_and_bob, world.tmp)
    world.refused(ReleaseSignatureError, "1 valid signature", lambda: world.device.upgrade(by_alice_and_bob))
    assert world.device.engine(1).manifest.version == 1  # the model in use, signed by alice+bob, still loads


# -- the chain of roots -------------------------------------------------------------------------


def serve_roots(world: World, *roots: Signed) -> None:
    def change(answer: registry_pb2.GetTrustResponse) -> None:
        del answer.roots[:]
        answer.roots.extend(r.to_bytes() for r in roots)
        answer.latest_root_version = roots[-1].body.version

    world.mirror.serve_trust(change)


@pytest.mark.parametrize(
    "case, signers, error, match",
    [
        ("old keys only", None, ThresholdError, "its own root keys"),
        ("new keys only", ("n1", "n2"), ThresholdError, "root keys of the trusted v1"),
    ],
)
def test_a_root_signed_by_one_side_of_a_rotation_is_refused(world, case, signers, error, match):
    new_keys = ("n1", "n2", "n3")
    body = build_root(2, root=new_keys, root_threshold=2, publishers=PUBLISHERS, publisher_threshold=2)
    document = signed(body, *(signers or ("r1", "r2")))
    with pytest.raises(RpcStatusError, match="INVALID_ARGUMENT"):
        publish_root(world.server, document)
    serve_roots(world, document)
    world.refused(error, match)


def test_a_skipped_root_version_is_refused(world):
    serve_roots(world, root(3, signers=ROOT_KEYS))
    world.refused(RootChainError, "skips a version")
    with pytest.raises(RpcStatusError, match=r"INVALID_ARGUMENT.*skips a version"):
        publish_root(world.server, root(3))


def test_oversized_metadata_is_refused_before_it_is_parsed(world):
    world.mirror.serve_trust(lambda answer: setattr(answer, "timestamp", b"{" + b" " * MAX_TIMESTAMP_BYTES + b"}"))
    world.refused(TrustError, "allowed: refused unread")

    def oversized_root(answer):
        answer.roots.append(b"[" + b" " * (64 << 10) + b"]")
        answer.latest_root_version = 2

    world.mirror.serve_trust(oversized_root)
    world.refused(TrustError, "allowed: refused unread")


def test_a_wrong_root_enrolment_is_refused_and_writes_nothing(world, tmp_path):
    other = signed(build_root(1, root=("m1",), root_threshold=1, publishers=("mallory",)), "m1")
    with Device.init(tmp_path / "wrong-fingerprint") as device:
        before = sorted(p.name for p in device.root.iterdir())
        with pytest.raises(RootChainError):
            device.enrol(world.mirror.target, enrolment_code(world.server), root_fingerprint=root_fingerprint(other))
        assert sorted(p.name for p in device.root.iterdir()) == before
    # the attacker's chain offered under the real fingerprint: refused too
    serve_roots(world, other)
    with Device.init(tmp_path / "substituted") as device:
        with pytest.raises(RootChainError):
            device.enrol(world.mirror.target, enrolment_code(world.server), root_fingerprint=root_fingerprint(root(1)))
        assert not (device.root / "token").exists() and not device.trust.pins_root


# -- freshness: rollback, freeze, fast-forward --------------------------------------------------


def recorded_listings(mirror: Mirror, change=None) -> list[registry_pb2.ListVersionsResponse]:
    """The ListVersions answers passing through ``mirror`` from now on (``change`` edits each first)."""
    answers: list[registry_pb2.ListVersionsResponse] = []

    def record(request: bytes, forward) -> registry_pb2.ListVersionsResponse:
        answer = registry_pb2.ListVersionsResponse.FromString(forward(request))
        if change is not None:
            change(answer)
        answers.append(answer)
        return answer

    mirror.take_over("Registry/ListVersions", record)
    return answers


def test_a_sync_that_finds_nothing_new_is_told_unchanged_instead_of_sent_the_timestamp(world):
    before = world.device.trust.state()
    answers = recorded_listings(world.mirror)
    assert world.device.sync().installed_after == 1
    assert [(a.timestamp, a.timestamp_unchanged, list(a.versions)) for a in answers] == [(b"", True, [])]
    assert len(answers[0].SerializeToString()) < 2048
    after = world.device.trust.state()
    assert after.timestamp == before.timestamp and after.fresh_at >= before.fresh_at  # still fresh


def test_an_unchanged_answer_cannot_hide_a_newer_release_past_the_timestamps_expiry(world, release):
    """A mirror that answers "unchanged" and strips the new versions freezes the device at most
    like a replayed timestamp does: it keeps the one it holds, and that one still expires."""
    publish(world.server, release(2, "alice", "bob"), world.tmp)

    def frozen(answer: registry_pb2.ListVersionsResponse) -> None:
        answer.timestamp, answer.timestamp_unchanged = b"", True
        del answer.versions[:]

    recorded_listings(world.mirror, frozen)
    held = world.device.trust.state().timestamp
    assert world.device.sync().installed_after == 1 and world.device.trust.state().timestamp == held
    expired = world.device.trust.clock() + timedelta(days=400)
    world.device.trust.clock = lambda: expired
    world.refused(ExpiredMetadataError, "expired")


def test_rollback_and_freeze_by_a_replayed_timestamp_are_refused(world, release):
    with FctkitClient(world.server.target, ADMIN_TOKEN) as admin:
        old_timestamp = admin.get_trust(1).timestamp
    publish(world.server, release(2, "alice", "bob"), world.tmp)
    assert world.device.sync().installed_after == 2  # the device accepted the timestamp naming v2
    publish(world.server, release(3, "bob", "carol"), world.tmp)
    world.mirror.serve_trust(lambda answer: setattr(answer, "timestamp", old_timestamp))  # withholds v3
    world.refused(MetadataRollbackError, "older than")


def test_withheld_metadata_makes_the_device_stale_and_it_keeps_answering(world):
    with FctkitClient(world.server.target, ADMIN_TOKEN) as admin:
        frozen = admin.get_trust(1).timestamp
    world.mirror.serve_trust(lambda answer: setattr(answer, "timestamp", frozen))
    assert world.device.sync().installed_after == 1  # the same timestamp again: not older, still valid
    answers = world.answers()
    limit = root(1).body.freshness_limit_s
    real_clock = world.device.trust.clock
    world.device.trust.clock = lambda: real_clock() + timedelta(seconds=limit + 3600)
    world.refused(ExpiredMetadataError, "expired at")
    trust = world.device.status()["trust"]
    assert trust["stale"] and trust["freshness"].startswith("stale: possible freeze")
    assert world.answers() == answers


def test_fast_forward_recovery_after_the_timestamp_key_rotates(world, files, release):
    """An attacker with the old timestamp key signed version 10^6; after the root replaces that
    key, the device forgets the inflated version and accepts the server's again."""
    with FctkitClient(world.server.target, ADMIN_TOKEN) as admin:
        current = parse_timestamp(admin.get_trust(1).timestamp).body
    inflated = Signed(type(current)(1_000_000, current.expires, current.releases)).signed_by(key("ts"))
    world.mirror.serve_trust(lambda answer: setattr(answer, "timestamp", inflated.to_bytes()))
    world.device.sync()
    assert world.device.trust.state().timestamp_version == 1_000_000
    world.mirror.restore()
    world.refused(MetadataRollbackError, "older than")  # stuck: the fast-forward attack
    world.server.stop()
    world.server.args = [
        "--root",
        str(files["root1"]),
        "--timestamp-key",
        str(files["ts"]),
        "--timestamp-key",
        str(files["ts2"]),
    ]
    world.server.start()
    world.mirror.close()
    world.mirror = Mirror(world.server.target)
    world.device.use_servers(world.mirror.target)
    publish_root(world.server, root(2, timestamp=("ts2",), signers=("r1", "r2")))
    world.device.sync()
    state = world.device.trust.state()
    assert state.root_version == 2 and state.timestamp_version < 1_000_000


# -- mix-and-match ------------------------------------------------------------------------------


def test_a_manifest_or_artifacts_from_another_snapshot_are_refused(world, start_server, files, release, tmp_path):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    """A second server (same root, same timestamp key) holds another v2: its manifest or its
    artifacts, served with the first server's timestamp, never install."""
    publish(world.server, release(2, "alice", "bob"), world.tmp)
    other = start_server("--root", str(files["root1"]), "--timestamp-key", str(files["ts"]))
    publish(other, release(1, "alice", "bob"), tmp_path)
    publish(other, release(2, "alice", "bob", seed=1), tmp_path)
    channel = grpc.insecure_channel(other.target)
    metadata = (("authorization", f"Bearer {ADMIN_TOKEN}"),)

    def from_other(method: str):
        call = channel.unary_unary(
            f"/fctkit.v1.{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        return lambda request, forward: call(request, metadata=metadata)

    try:
        world.mirror.take_over("Registry/GetManifest", from_other("Registry/GetManifest"))
        world.refused(SnapshotMismatchError, "not the one timestamp", metadata=False)
        world.mirror.restore()
        stream = channel.unary_stream(
            "/fctkit.v1.Registry/DownloadArtifact", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        world.mirror.stream_overrides["/fctkit.v1.Registry/DownloadArtifact"] = lambda request: stream(
            request, metadata=metadata
        )
        world.refused(HashMismatchError, "SHA-256", metadata=False)
    finally:
        channel.close()
        other.stop()


def test_endless_artifact_data_is_refused_at_the_signed_length(world, release):
    """A server announcing an artifact of another size than the signed manifest's is refused
    before a byte is written; one sending bytes past what it announced is cut off there."""
    publish(world.server, release(2, "alice", "bob"), world.tmp)
    channel = grpc.insecure_channel(world.server.target)
    real = channel.unary_stream(
        "/fctkit.v1.Registry/DownloadArtifact",
        request_serializer=lambda b: b,
        response_deserializer=registry_pb2.DownloadArtifactResponse.FromString,
    )
    metadata = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    sent = {"bytes": 0}

    def endless(request: bytes, *, announce: int | None = None):
        header = next(iter(real(request, metadata=metadata))).header
        if announce is not None:
            header.artifact.size = announce
        yield header_message(header)
        offset = registry_pb2.DownloadArtifactRequest.FromString(request).offset
        for _ in range(2000):  # 2 GB if nobody stops reading
            sent["bytes"] += 1 << 20
            yield registry_pb2.DownloadArtifactResponse(
                chunk={"offset": offset, "data": b"\0" * (1 << 20)}
            ).SerializeToString()
            offset += 1 << 20

    def header_message(header) -> bytes:
        return registry_pb2.DownloadArtifactResponse(header=header).SerializeToString()

    method = "/fctkit.v1.Registry/DownloadArtifact"
    try:
        world.mirror.stream_overrides[method] = lambda request: endless(request, announce=10 << 30)
        world.refused(HashMismatchError, "signed metadata says", metadata=False)
        assert sent["bytes"] <= 64 << 20  # nothing read past what was in flight when the client hung up
        sent["bytes"] = 0
        world.mirror.stream_overrides[method] = endless
        world.refused(HashMismatchError, "endless data", metadata=False)
        assert sent["bytes"] <= 64 << 20
        largest = max(
            (f.stat().st_size for f in world.device.root.rglob("*") if f.is_file() and "downloads" in f.parts),
            default=0,
        )
        assert largest < 1 << 20  # the tiny artifacts are a few KiB: nothing past them was kept
    finally:
        channel.close()


# -- the whole flow -----------------------------------------------------------------------------


def test_the_whole_flow_two_of_three_then_a_revocation_by_root_rotation(start_server, files, release, tmp_path):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    """Enrol by fingerprint → 2-of-3 publishers sign v2 → devices upgrade → alice's key is revoked
    by rotating the root → a bundle she signs is refused by every device → a properly signed v3 installs."""
    server = start_server("--root", str(files["root1"]), "--timestamp-key", str(files["ts"]))
    devices = []
    try:
        publish(server, release(1, "alice", "bob"), tmp_path)
        for i in range(3):
            device = Device.init(tmp_path / f"dev{i}")
            device.progress = False
            device.enrol(server.target, enrolment_code(server), root_fingerprint=root_fingerprint(root(1)))
            assert device.sync().installed_after == 1
            device.add(IMAGES[4 * i : 4 * i + 4], item_ids=[f"d{i}-{j}" for j in range(4)])
            devices.append(device)
        publish(server, release(2, "bob", "carol"), tmp_path)
        assert [d.sync().installed_after for d in devices] == [2, 2, 2]
        publish_root(server, root(2, publishers=("bob", "carol", "dave"), signers=("r1", "r3")))
        revoked = release(3, "alice", "bob")
        with pytest.raises(RpcStatusError, match="INVALID_ARGUMENT"):
            publish(server, revoked, tmp_path)
        for device in devices:
            assert device.sync().installed_after == 2 and device.trust.state().root_version == 2
            before = device.query(QUERIES, k=3)
            with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
                device.upgrade(revoked)
            assert device.version == 2 and device.query(QUERIES, k=3) == before
        publish(server, release(3, "carol", "dave"), tmp_path)
        for device in devices:
            assert device.sync().installed_after == 3
            assert device.status()["trust"]["root_version"] == 2
            assert len(device.query(QUERIES, k=4)[0]) == 4
    finally:
        for device in devices:
            device.close()
        server.stop()
