"""A damaged withdrawal log (issue 50, item 3): repair rebuilds it conservatively rather than drop
it, so a withdrawn version is never installed again offline; the next sync's signed withdrawals
replace repair's guesses; and status never advises applying a withdrawn version."""

from __future__ import annotations

import json
import sqlite3

import pytest

from fctkit.edge_runtime import Device
from fctkit.edge_runtime.revert import take_withdrawals
from fctkit.edge_runtime.revert_records import withdrawal_log
from tests.edge.test_revert_edge import bundles, upgraded, withdrawal  # noqa: F401 (fixtures)
from tests.support.device_damage import fctkit


def _status(root) -> tuple[int, dict]:
    run = fctkit("device", "status", "--dir", str(root))
    return run.code, json.loads(run.stdout)


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE meta SET mac = zeroblob(32) WHERE key = 'withdrawn'",
        "UPDATE meta SET value = 'garbled', mac = zeroblob(32) WHERE key = 'withdrawn'",
    ],
    ids=["mac", "value-and-mac"],
)
def test_a_damaged_withdrawal_log_is_rebuilt_and_the_withdrawn_version_stays_out(
    upgraded,  # noqa: F811 (a fixture)
    tmp_path,
    publisher_key,
    bundles,  # noqa: F811 (a fixture)
    edit,
):
    device, _, _ = upgraded
    signed = withdrawal(tmp_path, publisher_key, 2, 1)
    take_withdrawals(device.parts, device.trust, [signed], client=None)
    assert device.version == 1
    root = device.root
    device.close()
    code, status = _status(root)
    assert code == 0 and "installed_not_applied" not in status, status  # never advised: v2 was withdrawn
    with sqlite3.connect(root / "gallery.sqlite") as db:
        db.execute(edit)
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 0, repaired
    assert "2" in json.loads(json.loads(repaired.stdout)["settings_restored"]["withdrawn"])["versions"]
    again = fctkit("device", "upgrade", "--dir", str(root), "--bundle", str(bundles[2]), "--quiet")
    assert again.code == 2 and "was withdrawn" in again.stderr, again
    code, status = _status(root)
    assert code == 0 and status["installed_version"] == 1 and "installed_not_applied" not in status
    assert status["withdrawals"]["withdrawn_versions"]["v2"]["rebuilt"] is True
    with Device.open(root) as device:  # the next sync's signed withdrawals replace repair's guess
        take_withdrawals(device.parts, device.trust, [signed], client=None)
        assert withdrawal_log(device.gallery).versions["2"]["reason"] == "the adapter hurts recall"
        take_withdrawals(device.parts, device.trust, [], client=None)
        assert withdrawal_log(device.gallery).withdrawn(2)  # a verified withdrawal is kept for good
