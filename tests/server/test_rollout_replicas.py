"""A staged rollout, its guard and a withdrawal across three replicas over PostgreSQL + S3, one of
them SIGKILLed during the rollout (issue 36, "Across replicas").

24 devices are enrolled across replicas A, B and C. v2 is staged with a halt guard and widened
on A: within a second B and C offer every device exactly what A offers (ListVersions with each
device's token on each replica). While the devices sync and report through channels that name
all three replicas, B is SIGKILLed. Bad health reported through C halts v2: A and C, then B
restarted, show it halted and offer v2 to nobody new. A withdrawal published through A: every
replica offers v2 to nobody and carries the withdrawal on every ListVersions page. At each step
the rollout status is the same on every replica.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.rollout import bucket
from tests.server.conftest import ADMIN_TOKEN, ServerProcess, enrolled_client
from tests.server.test_rollouts import health, listed
from tests.server.test_scale_out_failover import PATIENT
from tests.server.test_withdrawals import listing, withdrawal, withdrawn_versions_of

IDLE = fleet_pb2.UPGRADE_STATE_IDLE
DEVICES = 24
STAGED_IN, WIDENED_IN = 4, 14  # devices in v2's rollout when staged, then when widened
AGREE_S = 1.0  # the bound: every replica gives the same answer within a second
Offers = dict[str, tuple[list[int], int]]  # device id -> (versions listed, latest version)


@dataclass
class Fleet:
    """The replicas (A, B, C) and the devices enrolled across them."""

    replicas: list[ServerProcess]
    ranked: list[str]  # device ids by their bucket for v2: the first k are in at a percent between k-1 and k
    alone: list[dict[str, FctkitClient]]  # per replica: device id -> a client of that replica alone
    everywhere: dict[str, FctkitClient]  # device id -> a client whose channel names all three replicas
    versions: dict[str, int] = field(default_factory=dict)  # device id -> the version it last reported

    def admin(self, replica: int) -> FctkitClient:
        return FctkitClient(self.replicas[replica].target, ADMIN_TOKEN)

    def percent_for(self, inside: int) -> float:
        """A percent that puts exactly the first ``inside`` devices of :attr:`ranked` in v2's rollout."""
        return (bucket(self.ranked[inside - 1], 2) + bucket(self.ranked[inside], 2)) / 2

    def offers(self, replica: int) -> Offers:
        return {device_id: listed(client) for device_id, client in self.alone[replica].items()}

    def expected(self, inside: int) -> Offers:
        """v2 (and v3 behind it) for the first ``inside`` devices and those running v2; v1 for the others."""
        offered = set(self.ranked[:inside]) | {d for d, v in self.versions.items() if v >= 2}
        return {d: ([1, 2, 3], 3) if d in offered else ([1], 1) for d in self.ranked}

    def close(self) -> None:
        for client in [*self.everywhere.values(), *(c for clients in self.alone for c in clients.values())]:
            client.close()


def enrol_fleet(replicas: list[ServerProcess]) -> Fleet:
    """``DEVICES`` devices, enrolled on the replicas in turn, each reporting v1 to its own replica."""
    targets = ",".join(r.target for r in replicas)
    alone: list[dict[str, FctkitClient]] = [{} for _ in replicas]
    everywhere: dict[str, FctkitClient] = {}
    for k in range(DEVICES):
        home = k % len(replicas)
        client, enrolment = enrolled_client(replicas[home], name=f"camera-{k}")
        client.report(1, 100, IDLE)
        for index, replica in enumerate(replicas):
            alone[index][enrolment.device_id] = (
                client if index == home else FctkitClient(replica.target, enrolment.token)
            )
        everywhere[enrolment.device_id] = FctkitClient(targets, enrolment.token, retry=PATIENT)
    ranked = sorted(everywhere, key=lambda d: bucket(d, 2))
    return Fleet(replicas, ranked, alone, everywhere, dict.fromkeys(ranked, 1))


def agree(fleet: Fleet, replicas: list[int], canary: str, want: Offers, since: float, what: str) -> None:
    """Within a second of ``since`` each of ``replicas`` offers ``canary`` what ``want`` says (a
    replica takes a change in whole), and then every device exactly what ``want`` says."""
    for replica in replicas:
        while listed(fleet.alone[replica][canary]) != want[canary]:
            assert time.monotonic() - since < AGREE_S, f"replica {'ABC'[replica]} does not show {what} a second later"
            time.sleep(0.02)
    for replica in replicas:
        assert fleet.offers(replica) == want, (
            f"replica {'ABC'[replica]} offers other versions than expected after {what}"
        )


def same_status(fleet: Fleet, replicas: list[int], state: str):
    """v2's rollout status, identical on each of ``replicas`` and in ``state``."""
    statuses = []
    for replica in replicas:
        with fleet.admin(replica) as admin:
            statuses.append(admin.rollout_status(2))
    assert all(s == statuses[0] for s in statuses), f"the replicas' rollout statuses differ: {statuses}"
    assert statuses[0].state == state
    return statuses[0]


class Syncing:
    """Background devices: each syncs (ListVersions) and reports its version through a channel
    naming every replica, in turn, until stopped; every failure is kept."""

    def __init__(self, fleet: Fleet, devices: list[str]) -> None:
        self.fleet, self.devices = fleet, devices
        self.calls, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Syncing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "a device's call through the three-replica channel hung"

    def _run(self) -> None:
        while not self._stop.is_set():
            for device_id in self.devices:
                client = self.fleet.everywhere[device_id]
                try:
                    client.version_listing()
                    client.report(self.fleet.versions[device_id], 100, IDLE)
                    self.calls += 1
                except Exception as exc:
                    self.errors.append(f"{device_id}: {exc!r}")
                self._stop.wait(0.02)  # a fleet syncing, not a load test: the replicas keep a core free

    def wait_calls(self, more: int, timeout_s: float = 30.0) -> None:
        """Until ``more`` more devices synced and reported."""
        target, deadline = self.calls + more, time.monotonic() + timeout_s
        while self.calls < target:
            assert time.monotonic() < deadline, f"devices stopped syncing: {self.errors[:3]}"
            time.sleep(0.02)


def reachable_offers(fleet: Fleet, replica: int) -> Offers | None:
    """The replica's offers, or None while its clients' channels still back off from its restart
    (UNAVAILABLE: they reconnect on their own within their backoff)."""
    try:
        return fleet.offers(replica)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return None


def poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_rollout_halt_and_withdrawal_agree_across_three_replicas_with_one_sigkilled(
    start_replicas, archives, publisher_key
):
    replicas = start_replicas(3, "--max-reports-per-minute", "10000")
    a, b, c = 0, 1, 2
    with FctkitClient(replicas[a].target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])  # first: devices report only published versions
    fleet = enrol_fleet(replicas)
    try:
        upgraders = fleet.ranked[:3]  # in the rollout from the start; they take v2 and report its health
        with fleet.admin(a) as admin:
            admin.publish_bundle(archives[2], rollout_percent=fleet.percent_for(STAGED_IN))
            admin.publish_bundle(archives[3])  # to everyone, but behind v2: a device not offered v2 gets neither
            admin.set_rollout(2, halt_below=0.8, halt_min_devices=3)
        since = time.monotonic()
        agree(fleet, [a, b, c], fleet.ranked[0], fleet.expected(STAGED_IN), since, "v2 staged")

        with fleet.admin(a) as admin:
            admin.set_rollout(2, percent=fleet.percent_for(WIDENED_IN))
        since = time.monotonic()
        agree(fleet, [b, c], fleet.ranked[WIDENED_IN - 1], fleet.expected(WIDENED_IN), since, "v2 widened on A")
        widened = same_status(fleet, [a, b, c], "staged")
        assert [s.offered for s in widened.stages] == [
            STAGED_IN,
            WIDENED_IN - STAGED_IN,
        ] and widened.halt_min_devices == 3

        with Syncing(fleet, [d for d in fleet.ranked if d not in upgraders]) as syncing:
            syncing.wait_calls(10)
            replicas[b].process.kill()  # SIGKILL, in the middle of the devices' syncing
            replicas[b].process.wait()
            syncing.wait_calls(2 * DEVICES)  # they go on through A and C
            with fleet.admin(c) as admin:
                for k, (signal, state) in enumerate([(0.95, "staged"), (0.3, "staged"), (0.2, "halted")]):
                    fleet.alone[c][upgraders[k]].report(2, 100, IDLE, health=health(2, signal))
                    fleet.versions[upgraders[k]] = 2
                    assert admin.rollout_status(2).state == state, f"after health report {k + 1} through C"
            since = time.monotonic()
            halted = fleet.expected(0)  # nobody new: only the devices running v2 keep it
            agree(fleet, [a, c], fleet.ranked[STAGED_IN], halted, since, "v2 halted by reports through C")
            status = same_status(fleet, [a, c], "halted")
            assert upgraders[2] in status.halt_reason and status.stages[0].health.devices == 3

            replicas[b].launch()  # on its port: the devices' channels name it still
            replicas[b].wait_listening()
            poll(lambda: reachable_offers(fleet, b) == halted, 10.0, "the restarted replica B does not hold v2 back")
            assert same_status(fleet, [a, b, c], "halted") == status
            syncing.wait_calls(DEVICES)  # the devices go on syncing with B back in their channels
        assert not syncing.errors, syncing.errors[:5]

        with fleet.admin(a) as admin:
            admin.withdraw(withdrawal(2, 1, publisher_key, reason="v2 hurts recall on the fleet"))
        since = time.monotonic()
        agree(fleet, [a, b, c], upgraders[0], dict.fromkeys(fleet.ranked, ([1, 3], 3)), since, "the withdrawal of v2")
        withdrawn = same_status(fleet, [a, b, c], "withdrawn")
        assert (withdrawn.withdrawn_reason, withdrawn.revert_to) == ("v2 hurts recall on the fleet", 1)
        for replica in (a, b, c):
            for device_id, client in fleet.alone[replica].items():
                pages = [listing(client, page_size=1, after=after) for after in (0, 1, 3)]
                assert [[v.version for v in p.versions] for p in pages] == [[1], [3], []], device_id
                assert all(withdrawn_versions_of(p) == [2] for p in pages), f"a page of {'ABC'[replica]} lacks it"
    finally:
        fleet.close()
