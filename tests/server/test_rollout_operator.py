"""What operators missed in the rollout commands (issue 48): a guard removed with `--no-guard`,
a resume refused while the guard would halt again at once, a guard that keeps watching a completed
rollout until the version is confirmed, a withdrawn headline that names the cohort it had reached,
and a status that shows a gate overridden at export with its reason."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fctkit.protos.bundle import pack_bundle
from fctkit.server.cli import admin_command
from tests.server.conftest import chain_bundle
from tests.server.test_rollouts import IDLE, admin, health, staged
from tests.server.test_withdrawals import withdrawal


def cli_of(server, admin_token_file):
    base = ["--server", server.target, "--admin-token-file", str(admin_token_file)]
    return lambda *args: CliRunner().invoke(admin_command, [*base, *args])


def test_no_guard_removes_the_guard_and_nothing_halts_the_rollout_after(start_server, archives, admin_token_file):
    server, devices = staged(start_server, archives, 100, devices=3)
    cli = cli_of(server, admin_token_file)
    assert cli("rollout", "2", "--halt-below", "0.8", "--halt-min-devices", "1").exit_code == 0
    assert cli("rollout", "2", "--no-guard", "--halt-below", "0.5").exit_code == 2  # one or the other
    removed = cli("rollout", "2", "--no-guard")
    assert removed.exit_code == 0, removed.output
    assert "staged at 100%" in removed.output and "guard" not in removed.output
    for device in devices.values():
        device.report(2, 100, IDLE, health=health(2, 0.1))
    with admin(server) as a:
        status = a.rollout_status(2)
        assert (status.state, status.halt_min_devices, status.halt_below) == ("staged", 0, 0.0)


def test_the_guard_watches_a_completed_rollout_until_the_version_is_confirmed(start_server, archives):
    server, devices = staged(start_server, archives, 10, devices=4)
    ids = list(devices)
    with admin(server) as a:
        a.set_rollout(2, halt_below=0.8, halt_min_devices=2, action="complete")
        devices[ids[0]].report(2, 100, IDLE, health=health(2, 0.3))
        assert a.rollout_status(2).state == "complete"  # one owner: below halt_min_devices
        devices[ids[1]].report(2, 100, IDLE, health=health(2, 0.2))
        halted = a.rollout_status(2)
        assert halted.state == "halted" and ids[1] in halted.halt_reason
    confirmed_server, confirmed_devices = staged(start_server, archives, 10, devices=4)
    with admin(confirmed_server) as a:
        a.set_rollout(2, halt_below=0.8, halt_min_devices=2, action="complete")
        a.confirm_version(2)
        for device in confirmed_devices.values():
            device.report(2, 100, IDLE, health=health(2, 0.1))
        assert a.rollout_status(2).state == "complete"  # confirmed: "it is good", the guard stands down


def test_a_withdrawn_rollout_names_the_cohort_it_had_reached(
    start_server, archives, admin_token_file, publisher_key
) -> None:
    server, devices = staged(start_server, archives, 0, devices=2)
    cli = cli_of(server, admin_token_file)
    with admin(server) as a:
        a.set_rollout(2, cohort=list(devices))
        a.withdraw(withdrawal(2, 1, publisher_key, reason="bad on night photos"))
    shown = cli("rollout-status", "2")
    assert "withdrawn (offered to no device; it had reached 0% and a cohort of 2)" in shown.output, shown.output


@pytest.fixture
def forced_v2(tmp_path, publisher_key):
    """v2 of the CHAIN exported with its gate overridden: ECC failed, --force with a reason."""
    reason = "ships the fix for crashes; recall loss accepted"
    bundle = chain_bundle(tmp_path, 2, publisher_key, cases={"new/h(old)": {"top1": 0.41}}, force_reason=reason)
    return pack_bundle(bundle, tmp_path / "v2.tar")


def test_rollout_status_shows_a_gate_overridden_at_export_and_its_reason(
    start_server, archives, forced_v2, admin_token_file
) -> None:
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(forced_v2, rollout_percent=5)
        assert a.rollout_status(2).gate_override_reason == "ships the fix for crashes; recall loss accepted"
        assert a.rollout_status(1).gate_override_reason == ""
    shown = cli_of(server, admin_token_file)("rollout-status", "2")
    assert "gate overridden at export (--force): ships the fix for crashes; recall loss accepted" in shown.output
    assert "new/h(old) top1 0.4100" in shown.output
