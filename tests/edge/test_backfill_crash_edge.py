"""Crash safety of a replicated backfill: a subprocess backfilling (random order, plans of 40
rows, batches of 4) and then syncing is SIGKILLed at 20+ random moments (mid-commit, at random
times); after the restarts its gallery equals an uninterrupted backfill of the same plans, and
another device of the owner converges to it through the replica."""

from __future__ import annotations

import dataclasses
import random
import shutil

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from tests.edge.conftest import publish, start_worker
from tests.edge.test_replication_crash_edge import _device, _kill_somewhere
from tests.edge.test_replication_edge import state

pytestmark = pytest.mark.slow
ROWS, PLAN, KILLS = 320, 40, 20

WORKER = """
import sys
from fctkit.edge_runtime import Device, sqlite_file
original_exit = sqlite_file.transaction.__exit__
def exit_hook(self, exc_type, exc, tb):
    if exc_type is None:
        print("commit", flush=True)
    return original_exit(self, exc_type, exc, tb)
sqlite_file.transaction.__exit__ = exit_hook
device = Device.open(sys.argv[1])
device.progress = False
if device.gallery.meta("backfill") is not None or sys.argv[2] != "0":
    device.backfill(int(sys.argv[2]) or None, order="random", seed=0, batch_size=4)
device.sync()
print("done", flush=True)
"""


def test_sigkilled_backfill_resumes_replicates_and_converges(
    edge_server, tiny_bundles, tmp_path, publisher_pub, monkeypatch
):
    import tests.edge.test_replication_crash_edge as crash

    publish(edge_server, tiny_bundles[1], tmp_path)
    device = _device(tmp_path / "phone", edge_server, "bf-owner", publisher_pub)
    device.settings = dataclasses.replace(device.settings, health_sample=0)  # its upgrade leaves every row adapted
    device.sync()
    pictures = np.random.default_rng(1).standard_normal((ROWS, 16)).astype(np.float32)
    device.add(pictures, item_ids=[f"b{i:04d}" for i in range(ROWS)])
    publish(edge_server, tiny_bundles[2], tmp_path)
    device.sync()
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS}
    device.close()
    reference_root = tmp_path / "reference"
    shutil.copytree(device.root, reference_root)  # never synced: it would push as the same device

    # the crash module's kill loop, running this worker (budget PLAN: resume or start a plan, then sync)
    monkeypatch.setattr(crash, "WORKER", WORKER)
    monkeypatch.setattr(crash, "SMALL_BATCH", PLAN)
    rng, kills, attempts = random.Random(5), 0, 0
    while kills < KILLS and attempts < 120:
        kills += _kill_somewhere(device.root, rng, ["mid-commit", "random-time"][attempts % 2])
        attempts += 1
    assert kills >= KILLS
    monkeypatch.setattr(crash, "SMALL_BATCH", 0)  # finish the recorded plan (if any), start none
    process, _ = start_worker(crash.WORKER, str(device.root), str(crash.SMALL_BATCH))
    assert process.wait(timeout=300) == 0, process.stderr.read()

    with Device.open(device.root) as phone:
        got = state(phone)
        native = sum(tag == "v2" for tag, *_ in got.values())
        assert native % PLAN == 0 and 0 < native <= ROWS and len(got) == ROWS
        assert phone.status()["replica"]["unpushed"] == 0
        key_file = phone.export_owner_key(tmp_path / "owner.key", "pw")
    with Device.open(reference_root) as reference:
        reference.progress = False
        for _ in range(native // PLAN):
            assert reference.backfill(PLAN, order="random", seed=0, batch_size=4).backfilled == PLAN
        expected = state(reference)
    assert {item: tag for item, (tag, *_) in got.items()} == {item: tag for item, (tag, *_) in expected.items()}
    for item, (_, embedding, side_info, _) in expected.items():
        np.testing.assert_allclose(
            np.frombuffer(got[item][1], "<f4"), np.frombuffer(embedding, "<f4"), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            np.frombuffer(got[item][2], "<f4"), np.frombuffer(side_info, "<f4"), rtol=1e-5, atol=1e-6
        )

    tablet = _device(
        tmp_path / "tablet", edge_server, "bf-owner", publisher_pub, owner_key_file=key_file, owner_key_passphrase="pw"
    )
    tablet.sync()
    assert state(tablet) == got
    tablet.close()
