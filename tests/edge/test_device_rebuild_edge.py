"""The rebuild steps `fctkit device repair` prints when a gallery cannot be repaired in place (issue
50): commands that work as printed for the device's trust (the publisher key it pins, or its newest
root), at the server its settings name, run here one by one against a real server on loopback."""

from __future__ import annotations

import re
import shlex
import shutil
import sqlite3
from pathlib import Path

import pytest

from fctkit.edge_runtime import Device
from fctkit.protos.trust import root_fingerprint
from tests.edge.conftest import ServerProcess, enrolment_code
from tests.edge.test_device_trust_edge import root_server, root_v, tiny_keyed_bundles  # noqa: F401 (fixtures)
from tests.edge.test_replication_edge import enrolled, server, state  # noqa: F401 (server is a fixture)
from tests.support.device_damage import fctkit

LEAD = "rebuild it from the owner's replica: "


def _device(trust: str, request, make_device, tmp_path: Path) -> tuple[Device, ServerProcess]:
    """An enrolled device of owner "olga" with v1 installed: pinning the test publisher key, or root v1."""
    if trust == "publisher key":
        hub = request.getfixturevalue("server")
        return enrolled(make_device, hub, "phone", "olga"), hub
    hub = request.getfixturevalue("root_server")
    device = Device.init(tmp_path / "rooted")
    device.progress = False
    device.enrol(hub.target, enrolment_code(hub, owner="olga"), root_fingerprint=root_fingerprint(root_v(1)))
    device.sync()
    return device, hub


def _steps(said: str) -> list[list[str]]:
    """The commands of the rebuild advice in ``said`` to run on the device, as argument lists (the
    admin's `fctkit admin enrol-code` named for CODE is not one of them)."""
    assert LEAD in said, said
    commands = [shlex.split(command) for command in re.findall(r"`([^`]+)`", said.split(LEAD, 1)[1])]
    return [c for c in commands if c[:2] != ["fctkit", "admin"]]


@pytest.mark.parametrize("trust", ["publisher key", "root"])
def test_the_printed_rebuild_steps_bring_the_rows_back_as_printed(trust, request, make_device, images, tmp_path):
    device, hub = _device(trust, request, make_device, tmp_path)
    device.add(images(12, seed=31), item_ids=[f"o{i:02d}" for i in range(12)], labels=[f"L{i % 3}" for i in range(12)])
    device.sync()  # pushed: the owner's replica holds every row
    expected, root = state(device), device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:  # the key check and its MAC: the gallery cannot be opened
        db.execute("UPDATE meta SET value = 'AAAA' || substr(value, 5), mac = substr(mac, 2) WHERE key = 'key_check'")
    failed = fctkit("device", "repair", "--dir", str(root))
    assert failed.code != 0 and "Running it again will not help" in failed.stderr, failed
    steps = _steps(failed.stderr)
    assert [s[:3] for s in steps] == [
        ["mv", str(root), f"{root}.damaged"],
        ["fctkit", "device", "init"],
        ["fctkit", "device", "enrol"],
        ["fctkit", "device", "sync"],
    ]
    assert ("--publisher-key" in steps[1]) == (trust == "publisher key") and hub.target in steps[2]
    shutil.move(steps[0][1], steps[0][2])
    for step in steps[1:]:
        code = enrolment_code(hub, owner="olga")
        run = fctkit(*[code if arg == "CODE" else arg for arg in step[1:]])
        assert run.code == 0, (step, run)
    with Device.open(root) as rebuilt:
        assert state(rebuilt) == expected


def test_the_advice_names_the_trust_a_device_has_and_host_port_only_without_a_server(tmp_path, publisher_pub):
    from fctkit.edge_runtime.rebuild import rebuild_advice

    bare = Device.init(tmp_path / "bare")
    bare.close()
    keyed = Device.init(tmp_path / "keyed", publisher_key=publisher_pub)
    keyed.close()
    init, enrol = _steps(rebuild_advice(tmp_path / "bare"))[1:3]
    assert "--publisher-key" not in init and enrol[-2:] == ["--root-fingerprint", "SHA256"]
    assert enrol[enrol.index("--server") + 1] == "HOST:PORT"  # never enrolled: no server to name
    init, enrol = _steps(rebuild_advice(tmp_path / "keyed"))[1:3]
    assert init[-2:] == ["--publisher-key", f"{tmp_path}/keyed.damaged/publisher.pub"] and "--root" not in enrol
