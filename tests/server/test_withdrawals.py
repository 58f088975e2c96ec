"""Withdrawals on the server (issue 36 §3), on both storage backends: a signed withdrawal.<V>.json
is verified as a device would verify it (a root's publisher threshold, or a legacy server's
--publisher-key) and refused, storing nothing, when under-signed, signed by a key outside the
root, of an unknown version or with a bad revert_to; a proper one is stored once (the same bytes
again: OK; another: ALREADY_EXISTS), carried by every ListVersions page, and the version is
offered to no device that does not run it (ListVersions, PlanUpgrade, WatchVersions,
DownloadArtifact), while later versions are offered normally and plans skip its adapters;
replicas agree within a second; `fctkit admin withdraw` both ways; reports' revert fields are
checked, stored and shown by rollout-status; a schema-9 database gets the tables."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from fctkit.export.bundle_builder import build_bundle
from fctkit.export.keys import save_private_key, sign_release, sign_withdrawal_file
from fctkit.protos import fleet_pb2, registry_pb2
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.client import FctkitClient
from fctkit.protos.trust import Signed, Withdrawal, parse_withdrawal
from fctkit.server.cli import admin_command
from fctkit.server.storage_schema import SCHEMA_VERSION
from fctkit.server.withdrawal_store import StoredWithdrawal
from tests.security.conftest import build_root, key, signed
from tests.server.conftest import ADMIN_TOKEN, IMAGE_DIM, _sources, chain_bundle, enrolled_client, status_code

IDLE = fleet_pb2.UPGRADE_STATE_IDLE
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def admin(server) -> FctkitClient:
    return FctkitClient(server.target, ADMIN_TOKEN)


def withdrawal(version: int, revert_to: int, *signers, reason: str = "adapter hurts recall") -> bytes:
    """withdrawal.<version>.json signed by ``signers`` (key names, or private keys)."""
    document = Signed(Withdrawal(version, revert_to, reason, NOW))
    for signer in signers:
        document = document.signed_by(key(signer) if isinstance(signer, str) else signer)
    return document.to_bytes()


def listing(client: FctkitClient, page_size: int = 0, after: int = 0) -> registry_pb2.ListVersionsResponse:
    request = registry_pb2.ListVersionsRequest(after_version=after, page_size=page_size)
    return client.registry.ListVersions(request, metadata=client._metadata, timeout=10)


def listed(client: FctkitClient) -> tuple[list[int], int]:
    page = listing(client)
    return [v.version for v in page.versions], page.latest_version


def withdrawn_versions(client: FctkitClient) -> list[int]:
    return [parse_withdrawal(data).body.version for data in listing(client).withdrawals]


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def fetch(client: FctkitClient, version: int) -> None:
    client.fetch_artifact(version, "embed", _Sink())


# -- a server under a root: the publishers' threshold -------------------------------------------------


@pytest.fixture(scope="module")
def root_server(start_server, tmp_path_factory):
    """A server under root v1 (2 of alice, bob, carol publish) with v1..v3 signed by alice and bob."""
    folder = tmp_path_factory.mktemp("withdraw-root")
    body = build_root(
        1,
        root=("r1", "r2"),
        root_threshold=2,
        publishers=("alice", "bob", "carol"),
        publisher_threshold=2,
        expires=datetime.now(UTC).replace(microsecond=0) + timedelta(days=30),
    )
    root_file = folder / "root.1.json"
    root_file.write_bytes(signed(body, "r1", "r2").to_bytes())
    timestamp_key = save_private_key(key("ts"), folder / "ts.key")
    server = start_server("--root", str(root_file), "--timestamp-key", str(timestamp_key))
    with admin(server) as a:
        for version in (1, 2, 3):
            bundle = chain_bundle(folder, version, key("alice"))
            sign_release(bundle, key("bob"))
            a.publish_bundle(pack_bundle(bundle, folder / f"v{version}.tar"))
    return server


def test_under_a_root_a_withdrawal_needs_the_publisher_threshold_and_bad_ones_store_nothing(root_server):
    with admin(root_server) as a:
        refused = {
            "one of two publishers (k-1 of k)": withdrawal(3, 2, "alice"),
            "a key outside the root": withdrawal(3, 2, "mallory"),
            "an outsider beside one publisher": withdrawal(3, 2, "alice", "mallory"),
            "the timestamp key": withdrawal(3, 2, "ts", "alice"),
            "not JSON": b"{not json",
            "too large": b" " * (17 << 10),
        }
        for why, data in refused.items():
            with pytest.raises(Exception) as caught:
                a.withdraw(data)
            assert caught.value.code == "INVALID_ARGUMENT", why
        assert "publisher" in str(status_message(lambda: a.withdraw(withdrawal(3, 2, "alice"))))
        assert status_code(lambda: a.withdraw(withdrawal(7, 2, "alice", "bob"))) == "NOT_FOUND"
        assert listing(a).withdrawals == [] and a.rollout_status(3).state == "none"
        response = a.withdraw(withdrawal(3, 2, "alice", "bob"))
        assert (response.version, response.revert_to) == (3, 2)
        assert a.withdraw(withdrawal(3, 2, "alice", "bob")) == response  # the same bytes again: nothing changes
        assert status_code(lambda: a.withdraw(withdrawal(3, 1, "bob", "carol"))) == "ALREADY_EXISTS"
        assert [parse_withdrawal(d).body.reason for d in listing(a).withdrawals] == ["adapter hurts recall"]
        status = a.rollout_status(3)
        assert (status.state, status.withdrawn_reason, status.revert_to) == ("withdrawn", "adapter hurts recall", 2)


def status_message(call) -> str:
    with pytest.raises(Exception) as caught:
        call()
    return str(caught.value)


def test_a_withdrawal_reverting_to_a_withdrawn_version_is_refused(start_server, archives, publisher_key):
    server = start_server()
    with admin(server) as a:
        for version in (1, 2, 3):
            a.publish_bundle(archives[version])
        a.withdraw(withdrawal(2, 1, publisher_key))
        assert status_code(lambda: a.withdraw(withdrawal(3, 2, publisher_key))) == "INVALID_ARGUMENT"
        assert withdrawn_versions(a) == [2] and a.rollout_status(3).state == "none"
        assert status_code(lambda: a.withdraw(withdrawal(3, 1, key("someone-else")))) == "INVALID_ARGUMENT"
        assert a.withdraw(withdrawal(3, 1, publisher_key)).revert_to == 1  # the legacy server's --publisher-key
        assert withdrawn_versions(a) == [2, 3]


def test_revert_to_must_be_published_or_0(start_server, archives, publisher_key):
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(archives[2])  # the first release this server holds
        message = status_message(lambda: a.withdraw(withdrawal(2, 1, publisher_key)))
        assert "INVALID_ARGUMENT" in message and "v1, which is not published" in message
        assert withdrawn_versions(a) == []
        assert a.withdraw(withdrawal(2, 0, publisher_key)).revert_to == 0
        assert withdrawn_versions(a) == [2]


# -- what devices are offered ---------------------------------------------------------------------------


def test_a_withdrawn_version_is_offered_to_nobody_new_and_later_versions_are_offered(
    start_server, archives, publisher_key
):
    server = start_server("--watch-keepalive", "0.3")
    with admin(server) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2])
        a.publish_bundle(archives[3], rollout_percent=0)
    clients = {}
    for name in ("on_v3", "inside", "outside", "on_v1"):
        clients[name], enrolment = enrolled_client(server, name=name)
        clients[name].device_id = enrolment.device_id
    on_v3, inside, outside, on_v1 = (clients[n] for n in ("on_v3", "inside", "outside", "on_v1"))
    with admin(server) as a:
        a.set_rollout(3, cohort=[on_v3.device_id, inside.device_id])
    on_v3.report(3, 10, IDLE)
    inside.report(2, 10, IDLE)
    outside.report(2, 10, IDLE)
    on_v1.report(1, 10, IDLE)
    assert listed(inside) == ([1, 2, 3], 3) and listed(outside) == ([1, 2], 2)
    with admin(server) as a:
        a.withdraw(withdrawal(3, 2, publisher_key))
    for client in (inside, outside, on_v3):
        assert listed(client) == ([1, 2], 2)
        assert status_code(lambda c=client: c.plan_upgrade(2, 3)) == "FAILED_PRECONDITION"
        assert withdrawn_versions(client) == [3]
    for client in (inside, outside):
        message = status_message(lambda c=client: fetch(c, 3))
        assert "withdrawn" in message and "adapter hurts recall" in message
    fetch(on_v3, 3)  # a device that installed it keeps what it has
    assert inside.plan_upgrade(2).to_version == 2
    stream = inside.registry.WatchVersions(
        registry_pb2.WatchVersionsRequest(after_version=2), metadata=inside._metadata
    )
    seen: list[str] = []
    with admin(server) as a:
        a.publish_bundle(archives[4])  # later versions are offered normally: 4 carries 3->4 and 1->4
        assert [v.version for v in a.list_versions()] == [1, 2, 3, 4]  # the admin sees every version
    for event in stream:
        seen.append(event.WhichOneof("event") + (f":{event.published.version}" if event.HasField("published") else ""))
        if "published:4" in seen:
            break
    stream.cancel()
    assert seen[-1] == "published:4" and "published:3" not in seen
    for client in (inside, outside):
        assert listed(client) == ([1, 2, 4], 4)
    pages = [listing(inside, page_size=1, after=after) for after in (0, 1, 2)]
    assert [[v.version for v in p.versions] for p in pages] == [[1], [2], [4]]
    assert all(withdrawn_versions_of(p) == [3] for p in pages)  # every page carries every withdrawal
    # plans skip v3's adapters: 2 -> 4 only went through 3; 1 -> 4 has a direct adapter
    message = status_message(lambda: inside.plan_upgrade(2, 4))
    assert "withdrawn" in message and "FAILED_PRECONDITION" in message
    assert [(h.source_version, h.target_version) for h in on_v1.plan_upgrade(1, 4).hops] == [(1, 4)]
    assert on_v1.plan_upgrade(1).to_version == 4
    with admin(server) as a:
        assert (
            status_code(lambda: a.set_rollout(3, percent=50)) == "FAILED_PRECONDITION"
        )  # rolling out a withdrawn version


def test_a_plan_around_a_withdrawn_version_takes_a_direct_adapter(start_server, archives, publisher_key, tmp_path):
    sources = _sources(tmp_path / "src4", 4, ((3, 4), (2, 4)), IMAGE_DIM)  # v4 also carries a direct 2->4
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    v4 = build_bundle(
        tmp_path / "v4",
        version=4,
        parents=(3,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": ecc},
        private_key=publisher_key,
    ).root
    server = start_server()
    with admin(server) as a:
        for version in (1, 2, 3):
            a.publish_bundle(archives[version])
        a.publish_bundle(pack_bundle(v4, tmp_path / "v4.tar"))
    device, _ = enrolled_client(server)
    device.report(2, 10, IDLE)
    assert [(h.source_version, h.target_version) for h in device.plan_upgrade(2, 3).hops] == [(2, 3)]
    with admin(server) as a:
        a.withdraw(withdrawal(3, 2, publisher_key))
    plan = device.plan_upgrade(2)
    assert plan.to_version == 4 and [(h.source_version, h.target_version, h.bundle_version) for h in plan.hops] == [
        (2, 4, 4)
    ]
    assert [(h.source_version, h.target_version) for h in device.plan_upgrade(1, 4).hops] == [(1, 2), (2, 4)]


def withdrawn_versions_of(page: registry_pb2.ListVersionsResponse) -> list[int]:
    return [parse_withdrawal(d).body.version for d in page.withdrawals]


def test_replicas_agree_on_a_withdrawal_within_a_second(start_replicas, archives, publisher_key):
    first, second = start_replicas(2)
    with admin(first) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2])
    on_second, _enrolment = enrolled_client(second)
    on_second.report(1, 10, IDLE)
    assert listed(on_second) == ([1, 2], 2)
    with admin(first) as a:
        a.withdraw(withdrawal(2, 1, publisher_key))
    changed = time.monotonic()
    while listed(on_second) != ([1], 1) or withdrawn_versions(on_second) != [2]:
        assert time.monotonic() - changed < 1.0, "the second replica still offers v2 a second later"
        time.sleep(0.02)
    assert status_code(lambda: fetch(on_second, 2)) == "FAILED_PRECONDITION"
    with admin(second) as a:
        assert a.rollout_status(2).state == "withdrawn"
        assert status_code(lambda: a.withdraw(withdrawal(2, 1, publisher_key, reason="another"))) == "ALREADY_EXISTS"


# -- reports and the admin CLI -------------------------------------------------------------------------


def test_reports_revert_fields_are_checked_stored_and_shown(
    start_server, archives, publisher_key, admin_token_file, tmp_path, monkeypatch
):
    server = start_server()
    base = ["--server", server.target, "--admin-token-file", str(admin_token_file)]

    def cli(*args: str):
        return CliRunner().invoke(admin_command, [*base, *args], catch_exceptions=False)

    with admin(server) as a:
        for version in (1, 2, 3):
            a.publish_bundle(archives[version], rollout_percent=None if version < 3 else 100)
    devices = [enrolled_client(server, name=f"d{k}")[0] for k in range(4)]
    for device in devices:
        device.report(3, 10, IDLE)
    bad = {
        "an unknown method": (3, "magic"),
        "a method without a version": (0, "exact"),
        "a version not withdrawn": (3, "exact"),
        "no method": (3, ""),
        "a huge method": (3, "x" * 100_000),
    }
    for why, (version, method) in bad.items():
        assert (
            status_code(lambda v=version, m=method: devices[0].report(2, 10, IDLE, reverted_from=v, revert_method=m))
            == "INVALID_ARGUMENT"
        ), why
    key_file = save_private_key(publisher_key, tmp_path / "publisher.key")
    monkeypatch.chdir(tmp_path)
    result = cli("withdraw", "3", "--reason", "recall fell", "--key", str(key_file))
    assert result.exit_code == 0, result.output
    assert "withdrew version 3" in result.output and "go back to v2" in result.output
    assert parse_withdrawal((tmp_path / "withdrawal.3.json").read_bytes()).body.reason == "recall fell"
    again = CliRunner().invoke(admin_command, [*base, "withdraw", "--file", str(tmp_path / "withdrawal.3.json")])
    assert again.exit_code == 0 and "withdrew version 3" in again.output  # the same bytes: OK
    assert cli("withdraw", "3").exit_code == 2  # VERSION without --reason and --key
    for device, method in zip(devices[:3], ("exact", "exact", "backward")):
        device.report(2, 10, IDLE, reverted_from=3, revert_method=method)
    assert (
        status_code(lambda: devices[3].report(2, 10, IDLE, reverted_from=2, revert_method="exact"))
        == "INVALID_ARGUMENT"
    )
    with admin(server) as a:
        status = a.rollout_status(3)
    assert status.state == "withdrawn" and status.withdrawn_reason == "recall fell" and status.revert_to == 2
    assert sum(s.reverted for s in status.stages) == 3
    methods: dict[str, int] = {}
    for stage in status.stages:
        for method, count in stage.revert_methods.items():
            methods[method] = methods.get(method, 0) + count
    assert methods == {"exact": 2, "backward": 1}
    table = cli("rollout-status", "3")
    assert "withdrawn: recall fell (devices that installed it go back to v2)" in table.output
    assert "backward 1, exact 2" in table.output
    data = json.loads(cli("rollout-status", "3", "--json").output)
    assert data["state"] == "withdrawn" and data["withdrawn_reason"] == "recall fell"


def test_admin_withdraw_file_publishes_a_co_signed_withdrawal(root_server, admin_token_file, tmp_path):
    path = tmp_path / "withdrawal.2.json"
    path.write_bytes(withdrawal(2, 1, "carol"))
    base = ["--server", root_server.target, "--admin-token-file", str(admin_token_file)]
    under = CliRunner().invoke(admin_command, [*base, "withdraw", "--file", str(path)])
    assert under.exit_code != 0 and "INVALID_ARGUMENT" in str(under.exception)
    sign_withdrawal_file(path, key("bob"))
    done = CliRunner().invoke(admin_command, [*base, "withdraw", "--file", str(path)], catch_exceptions=False)
    assert done.exit_code == 0 and "withdrew version 2: devices that installed it go back to v1" in done.output
    with admin(root_server) as a:
        assert 2 in withdrawn_versions(a)


# -- storage ---------------------------------------------------------------------------------------------


def test_a_schema_9_database_gets_the_withdrawal_tables(tmp_path, open_storage, backend):
    data_dir = tmp_path / "data"
    storage = backend.aged(
        data_dir, open_storage, 9, "DROP TABLE device_reverts", "DROP TABLE withdrawals", versions=(1, 2)
    )
    try:
        assert [r.version for r in storage.versions()] == [1, 2] and storage.withdrawals() == {}
        first = StoredWithdrawal(2, 1, "why", b"signed bytes", "now")
        assert storage.add_withdrawal(first).added and storage.withdrawals() == {2: first}
        again = storage.add_withdrawal(StoredWithdrawal(2, 0, "other", b"other bytes", "later"))
        assert not again.added and again.stored == first
        storage.record_revert("dev-0123456789abcdef", 2, "exact", "now")
        storage.record_revert("dev-0123456789abcdef", 2, "backward", "later")
        assert storage.device_reverts(2) == {"dev-0123456789abcdef": "backward"}
    finally:
        storage.close()
    if backend.name == "sqlite":
        assert backend.query(data_dir, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
