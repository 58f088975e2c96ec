"""Revoking a device on a real server: its token is refused at once on every service, the
owner's other devices and everything the owner stored are untouched, the admin list and CLI
show it, it no longer holds back its owner's replica compaction, and a schema-3 database gets
the column in place."""

from __future__ import annotations

import sqlite3

from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.protos import fleet_pb2, vault_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.storage import SqliteStorage

from .conftest import ADMIN_TOKEN, enrolled_client, status_code

IDLE = fleet_pb2.UPGRADE_STATE_IDLE


def _enrol(server, owner: str, name: str) -> tuple[FctkitClient, str]:
    client, enrolment = enrolled_client(server, owner, name)
    return client, enrolment.device_id


def _record(change_id: int, item: str, version: int) -> vault_pb2.SealedRecord:
    return vault_pb2.SealedRecord(
        change_id=change_id,
        item_id=item,
        version=version,
        origin_version=1,
        via="native",
        sealed=bytes([change_id]) * 40,
    )


def test_a_revoked_device_is_locked_out_and_its_owner_keeps_everything(start_server, archives):
    server = start_server()
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        for version in (1, 2):
            admin.publish_bundle(archives[version])
    phone, phone_id = _enrol(server, "rita", "phone")
    lost, lost_id = _enrol(server, "rita", "lost-phone")
    sha256 = lost.upload_blob(b"sealed original" * 10, "x").sha256
    lost.push_records([_record(1, "x", 1)])
    phone.report(2, 1, IDLE)
    lost.report(1, 1, IDLE)
    phone.push_records([_record(2, "x", 2)])
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        assert status_code(lambda: admin.revoke_device("dev-nope")) == "NOT_FOUND"
        assert status_code(lambda: admin.revoke_device("")) == "INVALID_ARGUMENT"
        assert status_code(lambda: phone.revoke_device(lost_id)) == "PERMISSION_DENIED"
        revoked_at = admin.revoke_device(lost_id).revoked_at
        assert revoked_at and admin.revoke_device(lost_id).revoked_at == revoked_at  # once
        listed = {d.device_id: d.revoked_at for d in admin.list_devices()}
    assert listed[lost_id] == revoked_at and listed[phone_id] == ""
    for call in (
        lambda: lost.list_versions(),
        lambda: lost.read_blob(sha256),
        lambda: lost.report(1, 1, IDLE),
        lambda: list(lost.pull_records()),
        lambda: lost.push_records([_record(3, "y", 1)]),
    ):
        assert status_code(call) == "UNAUTHENTICATED"
    assert phone.read_blob(sha256) == b"sealed original" * 10  # the owner's, whoever uploaded it
    # the lost phone stayed at v1; revoked, it no longer holds the v1 record of x alive
    assert [(r.item_id, r.version) for b in phone.pull_records() for r in b.records] == [("x", 2)]


def test_admin_cli_revokes_and_lists(start_server, admin_token_file):
    server = start_server()
    _, device_id = _enrol(server, "", "tablet")
    base = ["admin", "--server", server.target, "--admin-token-file", str(admin_token_file)]
    result = CliRunner().invoke(cli, [*base, "revoke-device", device_id])
    assert result.exit_code == 0 and result.output.startswith(f"revoked {device_id} at 20"), result.output
    result = CliRunner().invoke(cli, [*base, "list-devices"])
    assert "revoked_at" in result.output.splitlines()[0] and device_id in result.output
    result = CliRunner().invoke(cli, [*base, "revoke-device", "dev-unknown"])
    assert result.exit_code != 0 and "list-devices" in str(result.exception) + result.output


def test_a_schema_3_database_gets_revocation(tmp_path):
    storage = SqliteStorage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "old", "token-hash")
    storage.close()
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:
        db.execute("DROP INDEX devices_by_owner")  # schema 13's, on the column schema 3 lacks
        db.execute("ALTER TABLE devices DROP COLUMN revoked_at")
        db.execute("PRAGMA user_version=3")
    storage = SqliteStorage(tmp_path / "data")
    assert storage.device_for_token("token-hash") == "dev-1"
    assert storage.revoke_device("dev-1", "now") == ("now", None)  # no other device: no compaction due
    assert storage.device_for_token("token-hash") is None and storage.list_devices(0, 10)[0].revoked_at == "now"
    storage.close()


def test_a_revoked_devices_open_streams_end_with_unauthenticated(start_server):
    """Used to keep streaming: a Watch and a slow download were still open 10 s after the revoke.
    The Watch ends within a second. The slow reader's download stops at once on the server; the
    reader sees UNAUTHENTICATED after the chunks the transport had already queued for it (they
    precede the status on the stream), long before the blob's end."""
    import threading
    import time

    from fctkit.protos import registry_pb2

    server = start_server("--max-blob-bytes", str(32 << 20))
    lost, lost_id = _enrol(server, "sam", "lost-phone")
    size = 24 << 20
    sha256 = lost.upload_blob(bytes(size), "big").sha256
    watch = lost.registry.WatchVersions(registry_pb2.WatchVersionsRequest(after_version=0), metadata=lost._metadata)
    download = lost.vault.Download(
        vault_pb2.DownloadBlobRequest(sha256=sha256, chunk_size=64 << 10), metadata=lost._metadata
    )
    ended: dict[str, tuple[str, float]] = {}
    received = [0]

    def drain(name: str, call) -> None:
        try:
            for message in call:
                if name == "download":
                    received[0] += len(message.chunk.data)
                    time.sleep(0.02)  # a slow reader
        except Exception as error:  # grpc.RpcError
            ended[name] = (error.code().name, time.monotonic())

    threads = [
        threading.Thread(target=drain, args=(name, call), daemon=True)
        for name, call in (("watch", watch), ("download", download))
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        revoked = time.monotonic()
        admin.revoke_device(lost_id)
    for thread in threads:
        thread.join(timeout=60)
    assert {name: code for name, (code, _) in ended.items()} == {
        "watch": "UNAUTHENTICATED",
        "download": "UNAUTHENTICATED",
    }
    assert ended["watch"][1] - revoked < 1.0
    assert received[0] < size // 2, f"{received[0]} of {size} bytes arrived: the download went on after the revoke"
