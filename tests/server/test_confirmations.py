"""Confirming a version (issue 36 §3, `fctkit admin rollout-confirm`), on both storage backends:
a confirmation is stored once (confirming again keeps the first time), shown by rollout-status,
carried by every ListVersions page (devices and the admin alike) and dropped from it when the
version is withdrawn later; an unknown version, a withdrawn one and one offered to no device yet
are refused and nothing is stored; replicas agree within a second; a schema-10 database gets the
table."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from fctkit.protos import fleet_pb2
from fctkit.server.cli import admin_command
from fctkit.server.storage_schema import SCHEMA_VERSION
from tests.server.conftest import enrolled_client, status_code
from tests.server.test_withdrawals import admin, listing, status_message, withdrawal

IDLE = fleet_pb2.UPGRADE_STATE_IDLE


def confirmed(client) -> list[int]:
    return list(listing(client).confirmed_versions)


def test_a_confirmation_is_stored_once_listed_on_every_page_and_bad_ones_change_nothing(
    start_server, archives, publisher_key
):
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2], rollout_percent=0)
        a.publish_bundle(archives[3])
    device, _ = enrolled_client(server, name="d")
    device.report(1, 10, IDLE)
    with admin(server) as a:
        assert status_code(lambda: a.confirm_version(9)) == "NOT_FOUND"
        assert "offered to no device yet" in status_message(lambda: a.confirm_version(2))
        assert status_code(lambda: a.confirm_version(2)) == "FAILED_PRECONDITION"
        a.withdraw(withdrawal(3, 1, publisher_key))
        assert status_code(lambda: a.confirm_version(3)) == "FAILED_PRECONDITION"
        assert confirmed(a) == confirmed(device) == [] and a.rollout_status(2).confirmed_at == ""
        assert a.rollout_status(3).confirmed_at == ""

        first = a.confirm_version(1)
        assert first.state == "none" and first.confirmed_at
        assert a.confirm_version(1).confirmed_at == first.confirmed_at  # again: the first time stays
        a.set_rollout(2, percent=5)
        assert a.confirm_version(2).confirmed_at and a.rollout_status(2).state == "staged"
        assert confirmed(a) == confirmed(device) == [1, 2]
        pages = [listing(a, page_size=1, after=after) for after in (0, 1)]
        assert [list(p.confirmed_versions) for p in pages] == [[1, 2], [1, 2]]

        a.withdraw(withdrawal(2, 1, publisher_key))  # a confirmed version can still be withdrawn
        assert confirmed(a) == confirmed(device) == [1]  # the withdrawal overrides: its devices revert exactly
        status = a.rollout_status(2)
        assert status.state == "withdrawn" and status.confirmed_at


def test_admin_rollout_confirm_and_rollout_status_show_it(start_server, archives, admin_token_file):
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2], rollout_percent=25)
    base = ["--server", server.target, "--admin-token-file", str(admin_token_file)]

    def cli(*args: str):
        return CliRunner().invoke(admin_command, [*base, *args])

    refused = cli("rollout-confirm", "7")
    assert refused.exit_code != 0 and "NOT_FOUND" in str(refused.exception)
    done = cli("rollout-confirm", "2")
    assert done.exit_code == 0, done.output
    assert "version 2: staged at 25% (cohort of 0); confirmed at " in done.output
    assert "devices running v2 drop the vectors kept for a revert at their next sync" in done.output
    assert "; confirmed at " in cli("rollout-status", "2").output
    assert "confirmed" not in cli("rollout-status", "1").output
    data = json.loads(cli("rollout-status", "2", "--json").output)
    assert data["confirmed_at"] and data["state"] == "staged"
    assert cli("rollout-confirm", "0").exit_code == 2  # versions start at 1


def test_replicas_agree_on_a_confirmation_within_a_second(start_replicas, archives):
    first, second = start_replicas(2)
    with admin(first) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2], rollout_percent=50)
    on_second, _ = enrolled_client(second)
    on_second.report(1, 10, IDLE)
    assert confirmed(on_second) == []
    with admin(first) as a:
        at = a.confirm_version(2).confirmed_at
    changed = time.monotonic()
    while confirmed(on_second) != [2]:
        assert time.monotonic() - changed < 1.0, "the second replica does not list v2 as confirmed a second later"
        time.sleep(0.02)
    with admin(second) as a:
        assert a.confirm_version(2).confirmed_at == a.rollout_status(2).confirmed_at == at


def test_a_schema_10_database_gets_the_confirmations_table(tmp_path, open_storage, backend):
    data_dir = tmp_path / "data"
    storage = backend.aged(data_dir, open_storage, 10, "DROP TABLE confirmations", versions=(1,))
    try:
        assert [r.version for r in storage.versions()] == [1] and storage.confirmations() == {}
        assert storage.confirm_version(1, "now", lambda rollout: None) == "now"
        assert storage.confirm_version(1, "later", lambda rollout: None) == "now"
        assert storage.confirmations() == {1: "now"}
    finally:
        storage.close()
    if backend.name == "sqlite":
        assert backend.query(data_dir, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
