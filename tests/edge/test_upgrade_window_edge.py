"""Upgrades and backfills in the windows a device gives (issue 52 part 5): a bound by rows or by
seconds pauses the work after a committed batch, a paused upgrade still answers queries (forward
mode: with the version before it, until its switch), and windows end with the same gallery, bit
for bit, as one uninterrupted run. Nothing here asserts on a timing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from fctkit.edge_runtime import PAUSED_EXIT, Device, Window
from tests.edge.conftest import device_cli, publish
from tests.edge.test_replication_crash_edge import _device
from tests.edge.test_replication_edge import state

ROWS, BATCH = 40, 8


def _v1_device(make_device, tiny_bundles, images, name: str) -> Device:
    device = make_device(name, batch_size=BATCH, health_sample=0)
    device.upgrade(tiny_bundles[1])
    device.add(images(ROWS, seed=5), item_ids=[f"i{k:03d}" for k in range(ROWS)], labels=["a", "b"] * (ROWS // 2))
    return device


def _sealed_layout(device: Device) -> list[tuple]:
    """What is deterministic of the sealed state: every row's tag, origin and block, and the blocks' row counts."""
    live, _ = device.gallery._tables()
    db = device.gallery._db
    rows = db.execute(
        f"SELECT v.row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id "
        f"FROM {live} v JOIN items i USING (row_id) ORDER BY v.row_id"
    ).fetchall()
    blocks = db.execute(f"SELECT block_id, COUNT(*) FROM {live} GROUP BY block_id ORDER BY block_id").fetchall()
    return rows + blocks


def test_an_upgrade_in_windows_of_rows_equals_one_run(make_device, tiny_bundles, images):
    whole = _v1_device(make_device, tiny_bundles, images, "whole")
    assert whole.upgrade(tiny_bundles[2]) == ROWS
    windowed = _v1_device(make_device, tiny_bundles, images, "windowed")
    root = str(windowed.root)
    windowed.close()
    outputs = []
    for _ in range(ROWS // 16 + 2):  # windows of 16 rows: 16, 16, then the last 8 and the switch
        proc = device_cli("upgrade", "--dir", root, "--bundle", str(tiny_bundles[2]), "--max-rows", "16", "--quiet")
        outputs.append((proc.returncode, json.loads(proc.stdout)))
        if proc.returncode == 0:
            break
        assert proc.returncode == PAUSED_EXIT, proc.stderr
        assert "paused" in proc.stderr and f"fctkit device upgrade --dir {root} --max-rows 16" in proc.stderr
    assert [(rc, out["rows_upgraded"], out.get("rows_left")) for rc, out in outputs] == [
        (PAUSED_EXIT, 16, 24),
        (PAUSED_EXIT, 16, 8),
        (0, 8, None),
    ]
    assert outputs[0][1]["continue"] == f"fctkit device upgrade --dir {root} --max-rows 16"
    reopened = Device.open(root)
    try:
        assert reopened.version == 2 and reopened.gallery.upgrade_state is None
        assert state(reopened) == state(whole)  # decrypted vectors, tags and labels, bit for bit
        assert _sealed_layout(reopened) == _sealed_layout(whole)
    finally:
        reopened.close()


def test_a_paused_forward_upgrade_answers_with_the_version_before_it(make_device, tiny_bundles, images):
    device = _v1_device(make_device, tiny_bundles, images, "paused")
    queries = images(5, seed=9)
    before = device.query(queries, k=3)
    seen: list[tuple[int, int]] = []
    assert device.upgrade(tiny_bundles[2], window=Window(max_rows=BATCH, progress=lambda *p: seen.append(p))) == BATCH
    assert seen == [(BATCH, ROWS)]
    assert device.gallery.upgrade_state is not None and device.version == 1  # paused before the switch
    assert device.query(queries, k=3) == before  # the old query model against the live v1 rows
    while device.gallery.upgrade_state is not None:
        device.upgrade(window=Window(max_rows=BATCH, progress=lambda *p: seen.append(p)))
    assert seen == [(k, ROWS) for k in range(BATCH, ROWS + 1, BATCH)]
    whole = _v1_device(make_device, tiny_bundles, images, "whole")
    whole.upgrade(tiny_bundles[2])
    assert device.version == 2 and device.query(queries, k=3) == whole.query(queries, k=3)


def test_a_window_of_seconds_pauses_with_rows_left(make_device, tiny_bundles, images):
    device = _v1_device(make_device, tiny_bundles, images, "seconds")
    root = str(device.root)
    device.close()
    proc = device_cli("upgrade", "--dir", root, "--bundle", str(tiny_bundles[2]), "--max-seconds", "0.000001")
    assert proc.returncode == PAUSED_EXIT, proc.stderr
    out = json.loads(proc.stdout)
    assert out["paused"] and out["rows_left"] > 0 and out["rows_done"] == out["rows_upgraded"] >= BATCH
    assert out["rows_done"] + out["rows_left"] == ROWS and out["installed_version"] == 1
    finished = device_cli("upgrade", "--dir", root)  # no window: the resume finishes it
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout)["rows_upgraded"] == out["rows_left"]


def test_windows_refuse_an_empty_bound():
    with pytest.raises(Exception, match="max_rows"):
        Window(max_rows=0)


def test_a_backfill_in_windows_ends_with_the_rows_of_one_run(edge_server, tiny_bundles, tmp_path, publisher_pub):
    publish(edge_server, tiny_bundles[1], tmp_path)
    pictures = np.random.default_rng(3).standard_normal((ROWS, 16)).astype(np.float32)
    devices = {}
    for name in ("one-run", "in-windows"):
        device = _device(tmp_path / name, edge_server, f"owner-{name}", publisher_pub)
        device.settings = dataclasses.replace(device.settings, health_sample=0)  # its upgrade leaves rows adapted
        device.sync(replicate=False)
        device.add(pictures, item_ids=[f"b{k:03d}" for k in range(ROWS)])
        devices[name] = device
    publish(edge_server, tiny_bundles[2], tmp_path)
    for device in devices.values():
        device.sync(replicate=False)
        assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS}
    one = devices["one-run"].backfill(20, order="random", seed=0, batch_size=4)
    assert (one.backfilled, one.left) == (20, 0)
    windowed, seen = devices["in-windows"], []
    first = windowed.backfill(
        20, order="random", seed=0, batch_size=4, window=Window(max_rows=8, progress=lambda *p: seen.append(p))
    )
    assert (first.backfilled, first.left) == (8, 12) and windowed.gallery.meta("backfill") is not None
    assert windowed.backfill(batch_size=4, window=Window(max_rows=8)).left == 4  # the recorded plan, resumed
    last = windowed.backfill(batch_size=4, window=Window(max_rows=8))
    assert (last.skipped, last.backfilled, last.left) == (16, 4, 0) and windowed.gallery.meta("backfill") is None
    assert seen == [(4, 20), (8, 20)]
    assert state(windowed) == state(devices["one-run"])
    for device in devices.values():
        device.close()
