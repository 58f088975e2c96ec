"""The server's root of trust (issue 35), on both storage backends: a real server started with
--root and --timestamp-key serves the chain (GetTrust, in pages of 32) and one signed timestamp
naming exactly the releases on offer (reused while fresh, renewed on a publish, on expiry and
after the timestamp key rotates; replicas agree on its versions); PublishRoot takes the next
root and refuses a skipped one, one signed by the old or the new keys only, and one whose
timestamp keys this replica lacks, storing nothing; publishing needs the latest root's
publisher threshold and keeps the co-signatures; a schema-7 database keeps its releases; a
server with --publisher-key has no root (FAILED_PRECONDITION); reports' trust fields are
stored and listed."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from fctkit.errors import ConfigError, RpcStatusError
from fctkit.export.keys import save_private_key, sign_release
from fctkit.protos import fleet_pb2, registry_pb2
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.bundle_vocabulary import SIGNATURES_FILE
from fctkit.protos.client import FctkitClient
from fctkit.protos.trust import (
    parse_release_signatures,
    parse_root,
    parse_timestamp,
    release_entry,
    root_fingerprint,
    verify_timestamp,
)
from fctkit.server.registry import Catalog, RegistryService
from fctkit.server.root_of_trust import ROOTS_PER_PAGE, RootOfTrust
from fctkit.server.storage import VersionRecord
from tests.security.conftest import build_root, key, kid, signed
from tests.server.conftest import ADMIN_TOKEN, chain_bundle, enrolled_client, status_code

PUBLISHERS = ("alice", "bob", "carol")
DAY_S = 86400.0


def root(version: int, *, publishers=PUBLISHERS, timestamp=("ts",), root_keys=("r1", "r2"), signers=("r1", "r2")):
    """Root ``version``: 2-of-2 root keys, 2-of-n publishers, one timestamp key; signed by ``signers``."""
    body = build_root(
        version,
        root=root_keys,
        root_threshold=2,
        publishers=publishers,
        publisher_threshold=2,
        timestamp=timestamp,
        expires=datetime.now(UTC).replace(microsecond=0) + timedelta(days=30),
    )
    return signed(body, *signers)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def keyfiles(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("trust-keys")
    return {name: save_private_key(key(name), folder / f"{name}.key") for name in ("ts", "ts2")}


@pytest.fixture(scope="module")
def root1_file(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("roots") / "root.1.json", root(1).to_bytes())


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    """Archives: v2 by alice alone, v2 by alice+bob, v3 by alice+bob, v3 by bob+carol."""
    folder = tmp_path_factory.mktemp("trust-bundles")
    made = {}
    for name, version, signers in (
        ("v2-alice", 2, ("alice",)),
        ("v2-alice-bob", 2, ("alice", "bob")),
        ("v3-alice-bob", 3, ("alice", "bob")),
        ("v3-bob-carol", 3, ("bob", "carol")),
    ):
        bundle = chain_bundle(folder / name, version, key(signers[0]))
        for co_signer in signers[1:]:
            sign_release(bundle, key(co_signer))
        made[name] = pack_bundle(bundle, folder / f"{name}.tar")
    return made


@pytest.fixture(scope="module")
def trust_server(start_server, root1_file, keyfiles):
    return start_server("--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]))


def admin(server) -> FctkitClient:
    return FctkitClient(server.target, ADMIN_TOKEN)


def current_timestamp(client: FctkitClient, trusted=None):
    update = client.get_trust(0)
    chain = [parse_root(r) for r in update.roots]
    return update, verify_timestamp(trusted or chain[-1], parse_timestamp(update.timestamp), 0, datetime.now(UTC))


# -- over the wire ------------------------------------------------------------------------------


def test_a_legacy_server_serves_no_root(start_server):
    server = start_server()
    with admin(server) as client:
        assert status_code(lambda: client.get_trust(0)) == "FAILED_PRECONDITION"
        listing = client.version_listing(0)
        assert (listing.timestamp, listing.latest_root_version) == (b"", 0)
        assert status_code(lambda: client.publish_root(root(2).to_bytes())) == "FAILED_PRECONDITION"


def test_publishing_needs_the_latest_roots_publisher_threshold(trust_server, releases, tmp_path):
    device, enrolment = enrolled_client(trust_server)
    with device, admin(trust_server) as client:
        assert enrolment.publisher_key_id == min(kid(p) for p in PUBLISHERS)  # old clients still get a key to pin
        update, first = current_timestamp(device)
        assert [parse_root(r).body.version for r in update.roots] == [1] and first.body.releases == ()

        with pytest.raises(RpcStatusError, match=r"1 valid signature\(s\) of the 2 needed") as caught:
            client.publish_bundle(releases["v2-alice"])
        assert caught.value.code == "INVALID_ARGUMENT"
        assert client.publish_bundle(releases["v2-alice-bob"]).version == 2
        assert device.get_trust(0).timestamp == device.get_trust(0).timestamp  # reused while nothing changes
        _, second = current_timestamp(device)
        assert second.body.version == first.body.version + 1 and [e.version for e in second.body.releases] == [2]
        listing = device.version_listing(0)  # a sync's version list carries the same timestamp and root version
        assert (listing.timestamp, listing.latest_root_version) == (second.to_bytes(), 1)
        # a device that holds the current timestamp is told so instead of being sent it again
        held = device.version_listing(2, known_timestamp_version=second.body.version)
        assert (held.timestamp, held.timestamp_unchanged, held.versions, held.latest_root_version) == (b"", True, [], 1)
        older = device.version_listing(2, known_timestamp_version=first.body.version)
        assert (older.timestamp, older.timestamp_unchanged) == (second.to_bytes(), False)

        co_signatures = device.get_signed_manifest(2).co_signatures
        assert [s.keyid for s in parse_release_signatures(co_signatures)] == [kid("bob")]
        verified = device.download_bundle(2, tmp_path / "v2", parse_root(update.roots[0]), timestamp=second.body)
        assert verified.manifest.version == 2 and (tmp_path / "v2" / SIGNATURES_FILE).read_bytes() == co_signatures

        without_alice = root(2, publishers=("bob", "carol"))
        response = client.publish_root(without_alice.to_bytes())
        assert (response.root_version, response.fingerprint) == (2, root_fingerprint(without_alice))
        with pytest.raises(
            RpcStatusError, match=f"publisher key {kid('alice')[:16]}… is not a publisher key of root v2"
        ):
            client.publish_bundle(releases["v3-alice-bob"])
        assert client.publish_bundle(releases["v3-bob-carol"]).version == 3
        _, enrolment = enrolled_client(trust_server)
        assert enrolment.publisher_key_id == min(kid("bob"), kid("carol"))
    trust_server.stop()
    trust_server.start()  # v2 (alice + bob) verifies only under root v1: it stays on offer all the same
    with admin(trust_server) as client:
        assert [v.version for v in client.list_versions()] == [2, 3]


def test_publish_root_refuses_what_does_not_follow_and_stores_nothing(start_server, root1_file, keyfiles, tmp_path):
    server = start_server("--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]))
    refused = {
        "skips a version": root(3),
        r"root v2 \(the root keys of the trusted v1\) has 0 valid": root(
            2, root_keys=("r3", "r4"), signers=("r3", "r4")
        ),
        r"root v2 \(its own root keys\) has 1 valid": root(2, root_keys=("r1", "r3"), signers=("r1", "r2")),
        "too big": None,
    }
    with admin(server) as client:
        for reason, document in refused.items():
            data = b" " * (70 << 10) if document is None else document.to_bytes()
            with pytest.raises(RpcStatusError, match=reason if document else "at most") as caught:
                client.publish_root(data)
            assert caught.value.code == "INVALID_ARGUMENT"
        with pytest.raises(RpcStatusError, match=r"restart the replicas with --timestamp-key NEW.key") as caught:
            client.publish_root(root(2, timestamp=("ts2",)).to_bytes())
        assert caught.value.code == "FAILED_PRECONDITION"
        assert len(client.get_trust(0).roots) == 1
    assert server.backend.query(server.data_dir, "SELECT version FROM roots") == [(1,)]


def test_the_chain_comes_in_pages_and_the_timestamp_follows_a_key_rotation(start_server, root1_file, keyfiles):
    server = start_server(
        "--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]), "--timestamp-key", str(keyfiles["ts2"])
    )
    with admin(server) as client:
        first = parse_timestamp(client.get_trust(0).timestamp)
        for version in range(2, 41):
            client.publish_root(root(version, timestamp=("ts2",) if version == 40 else ("ts",)).to_bytes())
        update = client.get_trust(0)
        page = client._unary(client.registry.GetTrust, registry_pb2.GetTrustRequest(after_root_version=3))
    assert [parse_root(r).body.version for r in update.roots] == list(range(1, 41)) and update.latest_root_version == 40
    assert len(page.roots) == ROOTS_PER_PAGE and parse_root(page.roots[0]).body.version == 4
    rotated = parse_timestamp(update.timestamp)
    assert rotated.body.version == first.body.version + 1 and [s.keyid for s in rotated.signatures] == [kid("ts2")]


def test_reports_carry_the_trust_state_and_absurd_values_are_refused(trust_server):
    from fctkit.server.cli import admin_command

    device, enrolment = enrolled_client(trust_server, name="frozen")
    with device:
        device.report(
            0, 3, fleet_pb2.UPGRADE_STATE_IDLE, root_version=2, trust_stale=True, seconds_since_fresh=9 * 86400
        )
        for absurd in (
            {"root_version": 10**7},
            {"root_version": 0, "trust_stale": True},
            {"root_version": 1, "seconds_since_fresh": 2**62},
        ):
            assert (
                status_code(lambda absurd=absurd: device.report(0, 3, fleet_pb2.UPGRADE_STATE_IDLE, **absurd))
                == "INVALID_ARGUMENT"
            )
    with admin(trust_server) as client:
        listed = next(d for d in client.list_devices() if d.device_id == enrolment.device_id)
    assert (listed.root_version, listed.trust_stale, listed.seconds_since_fresh) == (2, True, 9 * 86400)
    table = CliRunner().invoke(
        admin_command, ["--server", trust_server.target, "list-devices"], env={"FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN}
    )
    assert table.exit_code == 0 and "stale: possible freeze" in next(
        line for line in table.output.splitlines() if "frozen" in line
    )


def test_admin_publish_root_prints_the_version_and_fingerprint(start_server, root1_file, keyfiles, tmp_path):
    from fctkit.server.cli import admin_command

    server = start_server("--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]))
    next_root = root(2, publishers=("bob", "carol"))
    result = CliRunner().invoke(
        admin_command,
        ["--server", server.target, "publish-root", str(write(tmp_path / "root.2.json", next_root.to_bytes()))],
        env={"FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"published root v2 (fingerprint {root_fingerprint(next_root)})"


def test_serve_takes_exactly_one_of_a_publisher_key_or_a_root(root1_file, keyfiles, publisher_pub, tmp_path, capsys):
    from fctkit.cli import main

    data = ["serve", "--data", str(tmp_path / "data")]
    for args, message in (
        ([], "give exactly one"),
        (["--publisher-key", str(publisher_pub), "--root", str(root1_file)], "give exactly one"),
        (["--root", str(root1_file)], "--root needs --timestamp-key"),
        (["--publisher-key", str(publisher_pub), "--timestamp-key", str(keyfiles["ts"])], "goes with --root"),
        (
            ["--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]), "--timestamp-expiry-hours", "0"],
            "timestamp_expiry_hours is 0.0; from 0.017 (one minute)",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            main(data + args)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_replicas_agree_on_the_timestamp_and_see_each_others_publishes(start_replicas, root1_file, keyfiles, releases):
    a, b = start_replicas(2, "--root", str(root1_file), "--timestamp-key", str(keyfiles["ts"]))
    with admin(a) as on_a, admin(b) as on_b:
        assert on_a.get_trust(0).timestamp == on_b.get_trust(0).timestamp
        on_a.publish_bundle(releases["v2-alice-bob"])
        named = parse_timestamp(on_b.get_trust(0).timestamp)  # at once, without waiting for the notification
        assert [e.version for e in named.body.releases] == [2]
        assert on_a.get_trust(0).timestamp == on_b.get_trust(0).timestamp
        on_b.publish_root(root(2, publishers=("bob", "carol")).to_bytes())
        assert on_a.get_trust(1).latest_root_version == 2
        assert status_code(lambda: on_a.publish_bundle(releases["v3-alice-bob"])) == "INVALID_ARGUMENT"


# -- on storage, in process ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC).replace(microsecond=0)

    def __call__(self) -> datetime:
        return self.now


def test_the_timestamp_is_reused_while_fresh_and_renewed_by_one_replica_at_a_time(
    tmp_path, open_storage, backend, root1_file
):
    storage = open_storage(tmp_path / "data")
    other = storage if backend.name == "sqlite" else open_storage(tmp_path / "data")  # sqlite: one server per directory
    clock = Clock()
    try:
        first = RootOfTrust.open(storage, root1_file, [key("ts")], DAY_S, clock)
        second = RootOfTrust.open(other, root1_file, [key("ts")], DAY_S, clock)
        offer = (release_entry(2, b"manifest two"),)
        issued = first.timestamp(offer).data
        assert second.timestamp(offer).data == issued == first.timestamp(offer).data  # the other replica signs nothing
        clock.now += timedelta(hours=11)
        assert first.timestamp(offer).data == issued  # more than half its lifetime left
        clock.now += timedelta(hours=2)
        renewed = second.timestamp(offer)
        assert parse_timestamp(renewed.data).body.version == renewed.version == 2
        assert first.timestamp(offer) == renewed
        published = first.timestamp((*offer, release_entry(3, b"manifest three"))).data
        assert [(e.version, e.manifest_length) for e in parse_timestamp(published).body.releases] == [(2, 12), (3, 14)]
        assert parse_timestamp(published).body.version == 3
        assert not storage.put_timestamp(3, b"a loser's") and storage.timestamp().data == published
    finally:
        storage.close()
        if other is not storage:
            other.close()


def test_a_replica_without_the_new_timestamp_key_serves_what_others_signed_and_signs_nothing(
    tmp_path, open_storage, root1_file
):
    storage = open_storage(tmp_path / "data")
    try:
        rotating = RootOfTrust.open(storage, root1_file, [key("ts"), key("ts2")], DAY_S)
        rotating.publish_root(root(2, timestamp=("ts2",)).to_bytes())
        behind = RootOfTrust(storage, [key("ts")], DAY_S)  # a replica not yet restarted with --timestamp-key ts2.key
        with pytest.raises(RpcStatusError, match=r"restart the replicas with --timestamp-key NEW.key") as caught:
            behind.timestamp(())
        assert caught.value.code == "FAILED_PRECONDITION" and storage.timestamp() is None
        signed_by_ts2 = rotating.timestamp(()).data
        assert [s.keyid for s in parse_timestamp(signed_by_ts2).signatures] == [kid("ts2")]
        assert behind.timestamp(()).data == signed_by_ts2
    finally:
        storage.close()


def test_a_release_published_on_another_replica_is_in_the_next_timestamp_at_once(
    tmp_path, open_storage, backend, root1_file, releases
):
    """No waiting for the other replica's notification: GetTrust looks at the stored versions first."""
    storage = open_storage(tmp_path / "data")
    other = storage if backend.name == "sqlite" else open_storage(tmp_path / "data")
    try:
        here, there = (registry_service(s, root1_file) for s in (storage, other))
        empty = asyncio.run(here.GetTrust(registry_pb2.GetTrustRequest(), None))
        asyncio.run(there._verify_and_store(releases["v2-alice-bob"], tmp_path / "unpacked"))
        answer = asyncio.run(here.GetTrust(registry_pb2.GetTrustRequest(), None))
        assert [e.version for e in parse_timestamp(answer.timestamp).body.releases] == [2]
        assert parse_timestamp(answer.timestamp).body.version == parse_timestamp(empty.timestamp).body.version + 1
    finally:
        storage.close()
        if other is not storage:
            other.close()


def registry_service(storage, root_file: Path) -> RegistryService:
    trust = RootOfTrust.open(storage, root_file, [key("ts")], DAY_S)
    return RegistryService(storage, Catalog.load(storage, trust), trust, max_bundle_bytes=1 << 30, keepalive_s=60.0)


def test_start_up_takes_the_first_root_or_the_next_and_refuses_the_rest(tmp_path, open_storage, root1_file):
    storage = open_storage(tmp_path / "data")
    try:
        with pytest.raises(ConfigError, match=r"holds no root yet: start it with root.1.json"):
            RootOfTrust.open(storage, write(tmp_path / "r2.json", root(2).to_bytes()), [key("ts")], DAY_S)
        with pytest.raises(ConfigError, match=r"its own root keys\) has 1 valid"):
            RootOfTrust.open(
                storage, write(tmp_path / "half.json", root(1, signers=("r1",)).to_bytes()), [key("ts")], DAY_S
            )
        with pytest.raises(ConfigError, match=f"holds {kid('ts2')[:16]}…: restart the replicas"):
            RootOfTrust.open(storage, root1_file, [key("ts2")], DAY_S)
        assert storage.roots() == [(1, root1_file.read_bytes())]  # the root was right: it stays for the next start
        trust = RootOfTrust.open(storage, root1_file, [key("ts")], DAY_S)
        with pytest.raises(ConfigError, match="differs from the stored root v1"):
            RootOfTrust.open(
                storage, write(tmp_path / "other.json", root(1, publishers=("bob",)).to_bytes()), [key("ts")], DAY_S
            )
        with pytest.raises(ConfigError, match="skips a version"):
            RootOfTrust.open(storage, write(tmp_path / "r3.json", root(3).to_bytes()), [key("ts")], DAY_S)
        trust = RootOfTrust.open(storage, write(tmp_path / "r2.json", root(2).to_bytes()), [key("ts")], DAY_S)
        assert trust.latest().body.version == 2 and trust.enrolment_key() is not None
        assert [v for v, _ in storage.roots()] == [1, 2]
        assert (
            RootOfTrust.open(storage, root1_file, [key("ts")], DAY_S).latest().body.version == 2
        )  # an older file of the chain
    finally:
        storage.close()


def test_a_schema_7_database_keeps_its_releases(tmp_path, open_storage, backend):
    data_dir = tmp_path / "data"
    storage = backend.aged(
        data_dir,
        open_storage,
        7,
        "DROP TABLE roots",
        "DROP TABLE timestamps",
        "ALTER TABLE versions DROP COLUMN co_signatures",
        *(f"ALTER TABLE devices DROP COLUMN {c}" for c in ("root_version", "trust_stale", "seconds_since_fresh")),
        versions=(1,),
    )
    try:
        assert storage.versions() == [VersionRecord(1, b"{}", b"sig", "now", b"")]
        assert storage.roots() == [] and storage.timestamp() is None
        assert (
            storage.add_root(1, b"root one") and not storage.add_root(1, b"again") and not storage.add_root(3, b"skips")
        )
        storage.add_version(VersionRecord(2, b"{}", b"sig", "now", b'{"signatures":[]}'), [])
        assert storage.versions()[-1].co_signatures == b'{"signatures":[]}'
    finally:
        storage.close()
