"""ListDevices filters (issue 49): by version, upgrade state, staleness and owner, in the database,
page by page (keyset pages of matching devices only), on both backends over real gRPC; bad filter
values are INVALID_ARGUMENT; ``fctkit admin list-devices`` filters and prints page by page."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.cli import admin_command

from .conftest import ADMIN_TOKEN, enrolled_client, status_code

IDLE, UPGRADING, FAILED = (
    fleet_pb2.UPGRADE_STATE_IDLE,
    fleet_pb2.UPGRADE_STATE_UPGRADING,
    fleet_pb2.UPGRADE_STATE_FAILED,
)
GAP_S = 2.0  # between the old reports and the fresh ones, on each side of the staleness limit


@dataclass(frozen=True)
class Planned:
    """A device of the test fleet: its owner and its report (None: it never reports), old or fresh."""

    name: str
    owner: str
    version: int = 0
    state: int = 0
    fresh: bool = False


FLEET = (
    Planned("a0", "own-a", 1, IDLE),
    Planned("a1", "own-a", 1, UPGRADING, fresh=True),
    Planned("a2", "own-a"),
    Planned("a3", "own-a", 2, IDLE, fresh=True),
    Planned("a4", "own-a", 1, FAILED),
    Planned("b0", "own-b", 1, IDLE, fresh=True),
    Planned("b1", "own-b", 2, IDLE),
    Planned("b2", "own-b"),
    Planned("b3", "own-b", 1, IDLE),
)


def _report(client: FctkitClient, device: Planned) -> None:
    upgrading = {"target_version": 2, "progress": 0.5} if device.state == UPGRADING else {}
    client.report(device.version, 0, device.state, **upgrading)


def _build_fleet(server, archives) -> tuple[dict[str, str], float]:
    """The devices of :data:`FLEET`, enrolled in order (name -> device id), the old reports sent,
    then after :data:`GAP_S` the fresh ones; returns the ids and the moment between the two."""
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])
        admin.publish_bundle(archives[2])
    clients = {d.name: enrolled_client(server, owner=d.owner, name=d.name) for d in FLEET}
    for device in FLEET:
        if device.version and not device.fresh:
            _report(clients[device.name][0], device)
    time.sleep(GAP_S)
    between = time.time()
    time.sleep(GAP_S)
    for device in FLEET:
        if device.fresh:
            _report(clients[device.name][0], device)
    for client, _ in clients.values():
        client.close()
    return {name: enrolment.device_id for name, (_, enrolment) in clients.items()}, between


def _listed(admin: FctkitClient, **filters) -> list[str]:
    """The device ids ListDevices lists in pages of two for ``filters``."""
    pages = list(admin.device_pages(page_size=2, **filters))
    assert all(len(page) <= 2 for page in pages) and all(pages[:-1])
    return [device.device_id for page in pages for device in page]


def _names(ids: dict[str, str], keep) -> list[str]:
    return [ids[d.name] for d in FLEET if keep(d)]


def test_each_filter_lists_exactly_its_devices_across_pages(start_server, archives) -> None:
    server = start_server()
    ids, between = _build_fleet(server, archives)
    stale_s = round(time.time() - between)
    expected = {
        "version 1": ({"version": 1}, lambda d: d.version == 1),
        "version 0": ({"version": 0}, lambda d: d.version == 0),
        "idle": ({"upgrade_state": IDLE}, lambda d: d.state == IDLE),
        "failed": ({"upgrade_state": FAILED}, lambda d: d.state == FAILED),
        "stale": ({"stale_seconds": stale_s}, lambda d: not d.fresh),
        "owner": ({"owner_id": "own-b"}, lambda d: d.owner == "own-b"),
        "all of them": (
            {"version": 1, "upgrade_state": IDLE, "stale_seconds": stale_s, "owner_id": "own-a"},
            lambda d: d.name == "a0",
        ),
        "none": ({"version": 2, "upgrade_state": FAILED}, lambda d: False),
    }
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        assert _listed(admin) == list(ids.values())
        found = {what: _listed(admin, **filters) for what, (filters, _) in expected.items()}
        assert admin.list_devices(owner_id="own-a", version=1) == [
            d for d in admin.list_devices() if d.owner_id == "own-a" and d.version == 1
        ]
    assert found == {what: _names(ids, keep) for what, (_, keep) in expected.items()}


@pytest.mark.parametrize(
    "filters",
    [
        {"upgrade_state": 99},
        {"stale_seconds": 100 * 366 * 86400 + 1},
        {"owner_id": "own\x00a"},
        {"owner_id": "o" * 1000},
        {"page_size": 501, "version": 1},
    ],
    ids=["unknown state", "stale beyond 100 years", "control character", "long owner", "page size"],
)
def test_bad_filter_values_are_invalid_argument(start_server, filters) -> None:
    server = start_server()
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        assert status_code(lambda: admin.list_devices(**filters)) == "INVALID_ARGUMENT"


def test_admin_list_devices_filters_page_by_page(start_server, archives) -> None:
    server = start_server()
    ids, _ = _build_fleet(server, archives)

    def listed(*options: str) -> str:
        result = CliRunner().invoke(
            admin_command,
            ["--server", server.target, "list-devices", *options],
            env={"FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN},
        )
        assert result.exit_code == 0, result.output
        return result.output

    rows = json.loads(listed("--json", "--version", "1", "--state", "idle", "--owner", "own-b"))
    assert [row["device_id"] for row in rows] == [ids["b0"], ids["b3"]]
    assert json.loads(listed("--json", "--state", "backfilling")) == []
    assert listed("--stale", "30") == "(none)\n"
    table = listed("--owner", "own-a").splitlines()
    assert table[0].startswith("device_id") and [line.split()[0] for line in table[1:]] == _names(
        ids, lambda d: d.owner == "own-a"
    )
    result = CliRunner().invoke(admin_command, ["--server", server.target, "list-devices", "--state", "lost"])
    assert result.exit_code == 2 and "lost" in result.output
