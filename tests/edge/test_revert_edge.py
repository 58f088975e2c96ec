"""Withdraw and revert on the device (issue 36 §3): the manifest's rollback window, the rows'
previous vectors kept through it, signed withdrawals verified at a sync (refused ones change
nothing), the exact revert (answers and vectors as before the upgrade, bit for bit), the revert
after the window, the withdrawn version never installed again, and what status and reports say."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.edge_runtime.revert import take_withdrawals
from fctkit.edge_runtime.revert_records import (
    expire_rollback,
    revert_report_fields,
    rollback_window,
    withdrawal_log,
    withdrawal_status,
)
from fctkit.errors import BundleFormatError, DeviceError, GalleryDamagedError
from fctkit.export.bundle_builder import build_bundle
from fctkit.export.keys import write_withdrawal
from fctkit.protos.bundle import verify_bundle
from fctkit.protos.manifest import DEFAULT_ROLLBACK_WINDOW_DAYS, Manifest
from tests.edge.conftest import TINY_CHAIN
from tests.server.conftest import IMAGE_DIM, _sources

ROWS, QUERIES = 240, 60


def windowed_bundle(out: Path, key: Ed25519PrivateKey, version: int, days: int | None) -> Path:
    """A tiny chain bundle (tests/edge/conftest.py's) whose manifest asks for a ``days`` rollback window."""
    hops = TINY_CHAIN[version]
    sources = _sources(out.parent / f"{out.name}-src", version, hops, IMAGE_DIM)
    return build_bundle(
        out,
        version=version,
        parents=(version - 1,) if version > 1 else (),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {s.artifact_name: True for s in sources if s.role == "forward"}},
        private_key=key,
        rollback_window_days=days,
    ).root


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, publisher_key) -> dict[int, Path]:
    """v1..v3 asking for a 7-day window; "v2-none": v2 asking for none."""
    root = tmp_path_factory.mktemp("windowed")
    made = {v: windowed_bundle(root / f"v{v}", publisher_key, v, 7) for v in TINY_CHAIN}
    return {**made, "v2-none": windowed_bundle(root / "v2-none", publisher_key, 2, 0)}


def withdrawal(
    tmp_path: Path, key: Ed25519PrivateKey, version: int, revert_to: int, reason: str = "the adapter hurts recall"
) -> bytes:
    path = tmp_path / f"withdrawal.{version}.{key.public_key().public_bytes_raw().hex()[:8]}.{len(reason)}.json"
    write_withdrawal(path, version, revert_to, reason, key)
    return path.read_bytes()


def devices_at_v1(server, make_device, images, names, rows: int):
    """Devices enrolled on ``server`` (v1 published) without the health check, each holding ``rows``
    items whose originals went to the vault; returns them, the queries, and per device its top-10
    answers and gallery rows as they were at v1."""
    from tests.edge.conftest import enrolment_code

    devices = {name: make_device(name, health_sample=0) for name in names}
    queries, before = images(QUERIES, 8), {}
    for seed, (name, device) in enumerate(devices.items()):
        device.enrol(server.target, enrolment_code(server), device_name=name)
        assert device.sync().installed_after == 1
        device.add(images(rows, seed=20 + seed), item_ids=[f"{name}{i}" for i in range(rows)])
        before[name] = top10(device, queries), device.gallery.load()
    return devices, queries, before


def top10(device, queries: np.ndarray) -> list[list[str]]:
    return [[m.item_id for m in matches] for matches in device.query(queries, k=10)]


@pytest.fixture
def upgraded(make_device, bundles, images):
    """A device with ROWS rows at v1, its answers and rows recorded, then upgraded to v2 (window: 7 days)."""
    device = make_device("dev", health_sample=0)
    device.upgrade(bundles[1])
    device.add(
        images(ROWS, 1),
        item_ids=[f"r{i:04d}" for i in range(ROWS)],
        labels=[f"c{i % 7}" for i in range(ROWS)],
        upload=False,
    )
    queries = images(QUERIES, 2)
    before = top10(device, queries), device.gallery.load()
    device.upgrade(bundles[2])
    assert device.version == 2
    return device, queries, before


def test_the_manifest_field_is_optional_bounded_and_old_manifests_keep_their_bytes(
    tiny_bundles, bundles, publisher_key
):
    old = verify_bundle(tiny_bundles[2], publisher_key.public_key()).manifest
    assert old.rollback_window_days is None and old.rollback_days == DEFAULT_ROLLBACK_WINDOW_DAYS == 0
    assert b"rollback_window_days" not in old.canonical_bytes()
    assert Manifest.from_bytes(old.canonical_bytes()) == old
    windowed = verify_bundle(bundles[2], publisher_key.public_key()).manifest
    assert windowed.rollback_days == 7 and Manifest.from_bytes(windowed.canonical_bytes()).rollback_window_days == 7
    for bad in (-1, 366, 1.5, True, "7"):
        with pytest.raises(BundleFormatError, match="rollback_window_days"):
            dataclasses.replace(old, rollback_window_days=bad)


def test_within_the_window_every_row_keeps_its_previous_vectors_sealed(upgraded):
    device, _, (_, rows_before) = upgraded
    window = rollback_window(device.gallery)
    assert (window.version, window.previous_version) == (2, 1) and window.until > time.time() + 6.9 * 86400
    assert (
        device.gallery.extras.count("rollback_embedding") == device.gallery.extras.count("rollback_side_info") == ROWS
    )
    kept = device.gallery.extras.load("rollback_embedding")
    assert not kept.corrupt and np.array_equal(np.stack(kept.embeddings), np.stack(rows_before.embeddings))
    with sqlite3.connect(device.gallery.path) as db:  # sealed: no kept float32 vector appears in the file as plaintext
        blobs = b"".join(b for (b,) in db.execute("SELECT sealed FROM row_extras"))
    assert np.asarray(rows_before.embeddings[0], dtype="<f4").tobytes() not in blobs


def test_a_withdrawal_within_the_window_reverts_exactly(upgraded, tmp_path, publisher_key, bundles):
    device, queries, (answers_before, rows_before) = upgraded
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    device._upgraded()
    assert device.version == 1 and "reverted to v1 (exact, 240 row(s))" in notes[0]
    assert top10(device, queries) == answers_before  # every query's top-10, as before the upgrade
    rows = device.gallery.load()
    assert rows.item_ids == rows_before.item_ids and rows.tags == rows_before.tags
    assert np.array_equal(np.stack(rows.embeddings), np.stack(rows_before.embeddings))  # bit for bit
    assert np.array_equal(np.stack(rows.side_infos), np.stack(rows_before.side_infos))
    assert rows.labels == rows_before.labels and len(device.gallery) == ROWS
    assert device.gallery.extras.count("rollback_embedding") == 0 and rollback_window(device.gallery) is None

    assert revert_report_fields(device.gallery) == {"reverted_from": 2, "revert_method": "exact"}
    status = device.status()["withdrawals"]
    assert status["withdrawn_versions"]["v2"]["reason"] == "the adapter hurts recall"
    assert status["last_revert"]["method"] == "exact" and status["last_revert"]["rows_not_moved"] == 0
    from tests.edge.conftest import device_cli

    shown = device_cli("status", "--dir", str(device.root))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["withdrawals"]["last_revert"]["method"] == "exact"

    with pytest.raises(DeviceError, match="v2 was withdrawn"):  # never installed again
        device.upgrade(bundles[2])
    assert device.upgrade() == 0 and device.version == 1  # its bundle stays installed, never applied
    again = take_withdrawals(
        device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1, "again")], client=None
    )
    assert again == [] and device.version == 1  # the next sync's listing still carries it: nothing more happens
    device.upgrade(bundles[3])  # a later version is installed as usual (v1 -> v3 directly)
    assert device.version == 3 and revert_report_fields(device.gallery) == {}  # reports say it until the next upgrade


def test_a_withdrawal_not_signed_by_the_publisher_is_refused_and_changes_nothing(upgraded, tmp_path):
    device, queries, _ = upgraded
    answers, rows = top10(device, queries), device.gallery.load()
    forged = withdrawal(tmp_path, Ed25519PrivateKey.generate(), 2, 1)
    notes = take_withdrawals(device.parts, device.trust, [forged, b"{not json"], client=None)
    assert len(notes) == 2 and all("refused and changed nothing" in n for n in notes)
    assert device.version == 2 and top10(device, queries) == answers
    assert np.array_equal(np.stack(device.gallery.load().embeddings), np.stack(rows.embeddings))
    assert device.gallery.extras.count("rollback_embedding") == ROWS and not withdrawal_log(device.gallery).versions
    status = device.status()["withdrawals"]
    assert len(status["withdrawals_refused"]) == 2 and status["last_revert"] is None
    assert revert_report_fields(device.gallery) == {}


def test_a_withdrawal_of_a_version_the_device_is_not_on_only_bars_it(
    make_device, bundles, tmp_path, publisher_key, images
):
    device = make_device("dev", health_sample=0)
    device.upgrade(bundles[1])
    device.add(images(20, 3), upload=False)
    assert take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None) == []
    assert device.version == 1 and withdrawal_log(device.gallery).withdrawn(2)
    with pytest.raises(DeviceError, match="v2 was withdrawn"):
        device.upgrade(bundles[2])
    assert device.version == 1 and len(device.gallery) == 20


def test_after_the_window_the_vectors_are_dropped_and_the_revert_says_so(upgraded, tmp_path, publisher_key):
    device, queries, _ = upgraded
    until = rollback_window(device.gallery).until
    assert (
        not expire_rollback(device.gallery, now=until - 1) and device.gallery.extras.count("rollback_embedding") == ROWS
    )
    assert expire_rollback(device.gallery, now=until + 1)
    assert device.gallery.extras.count("rollback_embedding") == 0 and rollback_window(device.gallery) is None
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    # not enrolled: no original is in the vault, so no row can be embedded again; they are reported, never mixed in
    assert "no rollback window kept v1's vectors" in notes[0] and "240 row(s) could not be moved" in notes[0]
    record = device.status()["withdrawals"]["last_revert"]
    assert (
        record["method"] == "reembedded" and record["rows_not_moved"] == ROWS and len(record["items_not_moved"]) == 100
    )
    device._upgraded()
    assert device.version == 1 and device.query(queries[:3], k=5) == [[], [], []]  # v2 rows stay out of v1's searches


def test_a_device_that_cannot_get_the_version_back_stays_and_says_so(upgraded, tmp_path, publisher_key):
    device, queries, _ = upgraded
    answers = top10(device, queries)
    shutil.rmtree(device.root / "bundles" / "v1")
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    assert notes == [
        "not reverted: v2 was withdrawn, but this device cannot get the bundle of v1 to go back to: "
        "it stays on v2 until a later version is published"
    ]
    assert device.version == 2 and top10(device, queries) == answers and revert_report_fields(device.gallery) == {}
    assert device.gallery.extras.count("rollback_embedding") == ROWS and withdrawal_log(device.gallery).withdrawn(2)


def test_a_bundle_without_a_window_keeps_nothing(make_device, bundles, images):
    device = make_device("dev", health_sample=0)
    device.upgrade(bundles[1])
    device.add(images(30, 4), upload=False)
    device.upgrade(bundles["v2-none"])
    assert device.version == 2 and rollback_window(device.gallery) is None
    assert device.gallery.extras.count("rollback_embedding") == 0
    assert withdrawal_status(device.gallery)["rollback_window"] is None


def test_a_closed_window_is_dropped_when_the_device_opens(upgraded, monkeypatch):
    device, _, _ = upgraded
    root, later = device.root, rollback_window(device.gallery).until + 1
    device.close()
    monkeypatch.setattr(time, "time", lambda: later)
    from fctkit.edge_runtime import Device

    with Device.open(root) as reopened:
        assert rollback_window(reopened.gallery) is None and reopened.gallery.extras.count("rollback_embedding") == 0
        assert reopened.version == 2 and len(reopened.gallery) == ROWS


def test_a_sync_takes_the_servers_withdrawal_and_reverts_exactly_or_from_the_vault(
    edge_server, bundles, publisher_key, make_device, images, tmp_path
):
    """On loopback: a real `fctkit serve`, v1 and v2 published, two devices upgraded; the publisher withdraws
    v2. The next sync of a device inside its window reverts exactly; one whose window closed embeds its
    rows again from their vault originals; both answer every query as before, and their reports say how."""
    from fctkit.protos.client import FctkitClient
    from tests.edge.conftest import ADMIN_TOKEN, publish

    publish(edge_server, bundles[1], tmp_path)
    devices, queries, before = devices_at_v1(edge_server, make_device, images, ("inside", "closed", "restored"), 80)
    publish(edge_server, bundles[2], tmp_path)
    for device in devices.values():
        assert device.sync().installed_after == 2
    closed = devices["closed"]
    assert expire_rollback(closed.gallery, now=rollback_window(closed.gallery).until + 1)
    shutil.rmtree(devices["restored"].root / "bundles" / "v1")  # e.g. a device restored at v2: v1 comes from the server

    with FctkitClient(edge_server.target, ADMIN_TOKEN) as admin:
        admin.withdraw(withdrawal(tmp_path, publisher_key, 2, 1, "v2 hurts recall on the fleet"))
    results = {name: device.sync() for name, device in devices.items()}
    assert "reverted to v1 (exact, 80 row(s))" in " ".join(results["inside"].notes)
    assert "reverted to v1 (reembedded, 80 row(s))" in " ".join(results["closed"].notes)
    assert "reverted to v1 (exact, 80 row(s))" in " ".join(results["restored"].notes)
    assert "no rollback window kept v1's vectors" in " ".join(results["closed"].notes)  # it says so
    for name, device in devices.items():
        answers, rows_before = before[name]
        assert results[name].installed_after == device.version == 1 and top10(device, queries) == answers
        rows = device.gallery.load()
        assert rows.item_ids == rows_before.item_ids and rows.tags == rows_before.tags and len(device.gallery) == 80
        np.testing.assert_allclose(np.stack(rows.embeddings), np.stack(rows_before.embeddings), atol=1e-6)
    assert np.array_equal(
        np.stack(devices["inside"].gallery.load().embeddings), np.stack(before["inside"][1].embeddings)
    )
    assert devices["closed"].status()["withdrawals"]["last_revert"]["method"] == "reembedded"

    assert devices["inside"].sync().installed_after == 1  # v2 is not offered again, nor installed
    with FctkitClient(edge_server.target, ADMIN_TOKEN) as admin:
        fleet = {d.name: d for d in admin.list_devices()}
        methods = {m: n for stage in admin.rollout_status(2).stages for m, n in stage.revert_methods.items()}
    assert fleet["inside"].version == fleet["closed"].version == fleet["restored"].version == 1
    assert methods == {"exact": 2, "reembedded": 1}


def test_without_a_window_a_bundle_with_a_backward_graph_reverts_through_it(
    make_device, publisher_key, images, tmp_path
):
    from fctkit.export.bundle_builder import ArtifactSource
    from tests.server.conftest import EMBED_DIM, linear_onnx

    sources = _sources(tmp_path / "v2-src", 2, TINY_CHAIN[2], IMAGE_DIM)
    back = linear_onnx(tmp_path / "v2-src" / "b.onnx", {"new": EMBED_DIM}, EMBED_DIM, seed=77, output="embedding")
    sources.append(ArtifactSource(back, "backward", 2, 1))
    v2 = build_bundle(
        tmp_path / "v2b",
        version=2,
        parents=(1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {s.artifact_name: True for s in sources if s.role in ("forward", "backward")}},
        private_key=publisher_key,
        rollback_window_days=0,
    ).root
    device = make_device("dev", health_sample=0)
    device.upgrade(windowed_bundle(tmp_path / "v1", publisher_key, 1, 7))
    device.add(images(50, 5), upload=False)
    device.upgrade(v2)
    adapted = device.gallery.load()
    engine = device.engine(2)
    expected = engine.run(engine.manifest.artifact("backward"), np.stack(adapted.embeddings))
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    device._upgraded()
    assert "reverted to v1 (backward, 50 row(s))" in notes[0] and device.version == 1
    rows = device.gallery.load()
    assert {str(t) for t in rows.tags} == {"v1 (backward)"} and rows.item_ids == adapted.item_ids
    assert np.array_equal(np.stack(rows.embeddings), expected)
    assert np.array_equal(np.stack(rows.side_infos), np.stack(adapted.side_infos))
    assert revert_report_fields(device.gallery) == {"reverted_from": 2, "revert_method": "backward"}
    assert all(len(matches) == 5 for matches in device.query(images(4, 6), k=5))  # searched in v1's space again


def test_an_exact_revert_ends_a_transition_the_upgrade_began(make_device, publisher_key, images, tmp_path):
    from fctkit.protos.search_policy import TransitionPolicy

    sources = _sources(tmp_path / "v2t-src", 2, TINY_CHAIN[2], IMAGE_DIM)
    v2 = build_bundle(
        tmp_path / "v2t",
        version=2,
        parents=(1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {s.artifact_name: True for s in sources if s.role == "forward"}},
        private_key=publisher_key,
        transition=TransitionPolicy(1, 0.5, 30.0),
        rollback_window_days=3,
    )
    device = make_device("dev", health_sample=0)
    device.upgrade(windowed_bundle(tmp_path / "v1", publisher_key, 1, 7))
    device.add(images(70, 9), upload=False)
    queries = images(20, 10)
    answers = top10(device, queries)
    device.upgrade(v2.root)
    assert device.transition is not None and device.gallery.extras.count("previous_embedding") == 70
    take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    device._upgraded()
    assert device.version == 1 and device.transition is None and device.gallery.extras.count("previous_embedding") == 0
    assert top10(device, queries) == answers


def test_a_damaged_rollback_setting_is_reported_and_repair_drops_the_window(upgraded):
    from tests.edge.conftest import flip_stored_byte

    device, _, _ = upgraded
    with sqlite3.connect(device.gallery.path) as db:
        assert flip_stored_byte(db, "meta", "mac", "key = 'rollback'", 3) == 1
    assert device.status()["damaged_settings"] == ["rollback"]
    with pytest.raises(GalleryDamagedError, match="rollback"):  # nothing is installed or upgraded before a repair
        device.upgrade()
    device.repair()
    assert rollback_window(device.gallery) is None and device.gallery.extras.count("rollback_embedding") == 0
    assert device.gallery.extras.count("rollback_side_info") == 0
    assert (
        device.version == 2
        and len(device.gallery) == ROWS
        and device.status()["withdrawals"]["rollback_window"] is None
    )


def test_under_a_root_a_withdrawal_needs_the_publisher_threshold(upgraded, tmp_path):
    """The root's rule, unit level: a root asking 2 of 3 publisher keys (tests/security's helpers) stands in for
    the device's trust; one signature is refused and changes nothing, two send the device back."""
    from types import SimpleNamespace

    from fctkit.export.keys import sign_withdrawal_file
    from tests.security.conftest import build_root, key, signed

    two_of_three = signed(
        build_root(1, root=("r1",), root_threshold=1, publishers=("alice", "bob", "carol"), publisher_threshold=2), "r1"
    )
    trust = SimpleNamespace(release_trust=lambda: two_of_three)
    device, queries, (answers, _) = upgraded
    path = tmp_path / "withdrawal.2.json"
    write_withdrawal(path, 2, 1, "fleet recall fell", key("alice"))
    notes = take_withdrawals(device.parts, trust, [path.read_bytes()], client=None)
    assert len(notes) == 1 and "refused and changed nothing" in notes[0] and "1 valid signature" in notes[0]
    assert device.version == 2 and not withdrawal_log(device.gallery).versions
    sign_withdrawal_file(path, key("bob"))
    notes = take_withdrawals(device.parts, trust, [path.read_bytes()], client=None)
    device._upgraded()
    assert "reverted to v1 (exact" in notes[0] and device.version == 1 and top10(device, queries) == answers
