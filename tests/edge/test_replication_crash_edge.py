"""Crash safety of replication: a subprocess pushing (then one pulling) an owner's gallery is
SIGKILLed at 20+ random moments (right after the server acknowledged a push and before the
device recorded it, mid-commit, at random times); restarts finish the job, the server holds
every record exactly once, and every device converges to the gallery of an uninterrupted run."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device, DeviceSettings
from tests.edge.conftest import ServerProcess, enrolment_code, publish, start_worker
from tests.edge.test_replication_edge import live_rows, state

pytestmark = pytest.mark.slow
ROWS, SMALL_BATCH, KILLS = 480, 12, 20

# A device app's restart logic: open, sync (which replicates). Hooks print "acked" when the
# server acknowledged a push (before the device records it) and "commit" as COMMIT is sent.
WORKER = """
import sys
from fctkit.edge_runtime import Device, replication, sqlite_file
from fctkit.protos import client as client_module
replication.SEAL_BATCH = replication.PUSH_ROWS = replication.PULL_ROWS = int(sys.argv[2])  # small blocks, many transactions
original_exit, original_push = sqlite_file.transaction.__exit__, client_module.FctkitClient.push_records
def exit_hook(self, exc_type, exc, tb):
    if exc_type is None:
        print("commit", flush=True)
    return original_exit(self, exc_type, exc, tb)
def push_hook(self, records):
    response = original_push(self, records)
    print("acked", flush=True)
    return response
sqlite_file.transaction.__exit__ = exit_hook
client_module.FctkitClient.push_records = push_hook
device = Device.open(sys.argv[1])
device.progress = False
device.sync()
print("done", flush=True)
"""


def _kill_somewhere(root: Path, rng: random.Random, strategy: str) -> bool:
    """Run the worker and SIGKILL it per ``strategy``; True if it died before finishing."""
    process, lines = start_worker(WORKER, str(root), str(SMALL_BATCH))
    word = {"after-ack": "acked", "mid-commit": "commit"}.get(strategy)
    if word is None:
        time.sleep(rng.uniform(0.3, 1.5))
    else:
        target, seen = rng.randint(1, 3), 0
        while seen < target:
            line = lines.get(timeout=120)
            if line is None or line == "done":
                break
            seen += line == word
        time.sleep(rng.uniform(0.0, 0.003))
    process.send_signal(signal.SIGKILL)
    process.wait()
    return process.returncode == -signal.SIGKILL


def _finish(root: Path) -> None:
    process, _ = start_worker(WORKER, str(root), str(SMALL_BATCH))
    assert process.wait(timeout=300) == 0, process.stderr.read()


def _crash_until(current_root, seed: int, more_work) -> int:
    """Kill workers on ``current_root()`` until KILLS kills landed; ``more_work()`` gives new
    work whenever a worker finished the job between kills. Returns the kills."""
    rng, kills, attempts = random.Random(seed), 0, 0
    strategies = ["after-ack", "mid-commit", "random-time"]
    while kills < KILLS and attempts < 120:
        killed = _kill_somewhere(current_root(), rng, strategies[attempts % 3])
        attempts += 1
        kills += killed
        if not killed:
            more_work()
    return kills


@pytest.fixture(scope="module")
def server(tmp_path_factory, publisher_pub, admin_token_file, tiny_bundles):
    root = tmp_path_factory.mktemp("replica-crash-server")
    process = ServerProcess(root / "data", publisher_pub, admin_token_file).start()
    publish(process, tiny_bundles[1], root)
    publish(process, tiny_bundles[2], root)
    yield process
    process.stop()


def _device(root: Path, server, owner: str, publisher_pub: Path, **init) -> Device:
    device = Device.init(root, publisher_key=publisher_pub, settings=DeviceSettings(batch_size=64), **init)
    device.progress = False
    device.enrol(server.target, enrolment_code(server, owner=owner), device_name=root.name)
    return device


def _records(device: Device) -> list:
    with device.client() as client:
        return [r for batch in client.pull_records() for r in batch.records]


def test_sigkilled_push_and_pull_converge(server, tmp_path, publisher_pub):
    pictures = np.random.default_rng(0).standard_normal((ROWS * 2, 16)).astype(np.float32)
    pusher = _device(tmp_path / "pusher", server, "crash-owner", publisher_pub)
    pusher.sync(replicate=False)  # installs v2
    added = [0]

    def add_rows(count: int) -> None:
        start = added[0]
        with Device.open(pusher.root) as device:
            device.add(pictures[start : start + count], item_ids=[f"p{i:04d}" for i in range(start, start + count)])
        added[0] += count

    add_rows(ROWS)
    pusher.close()
    assert _crash_until(lambda: pusher.root, 7, lambda: add_rows(40)) >= KILLS
    _finish(pusher.root)

    with Device.open(pusher.root) as pusher:
        records = _records(pusher)
        assert pusher.status()["replica"]["unpushed"] == 0
        expected = state(pusher)
        key_file = pusher.export_owner_key(tmp_path / "owner.key", "pw")
    assert len(expected) == added[0]
    # every change is on the server exactly once, in one gap-free sequence of blocks
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert sorted(item for item, *_ in live_rows(records)) == sorted(expected)

    reference = _device(
        tmp_path / "reference", server, "crash-owner", publisher_pub, owner_key_file=key_file, owner_key_passphrase="pw"
    )
    reference.sync()
    assert state(reference) == expected
    reference.close()

    pullers: list[Path] = []

    def new_puller() -> None:  # a puller that finished between kills is checked later; a fresh one goes on
        device = _device(
            tmp_path / f"puller{len(pullers)}",
            server,
            "crash-owner",
            publisher_pub,
            owner_key_file=key_file,
            owner_key_passphrase="pw",
        )
        pullers.append(device.root)
        device.close()

    new_puller()
    assert _crash_until(lambda: pullers[-1], 11, new_puller) >= KILLS
    for root in pullers:
        _finish(root)
        with Device.open(root) as puller:
            assert state(puller) == expected and puller.status()["replica"] == {
                "cursor": len(records),
                "unpushed": 0,
                "pending": 0,
                "tombstones": 0,
            }
    assert len(live_rows(_records(reference))) == added[0]  # the restarts pushed nothing back
