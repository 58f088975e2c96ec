"""Reverts that leave every device able to sync (issue 48 §3), on loopback with a real `fctkit serve`:
rows added on the withdrawn version go back with a valid origin version through every way back
(exact windows, the backward graph, the vault), so their records pass the server's checks; a
device an earlier revert left with origins above their versions heals at its next sync; an upgrade
a crash interrupted on its way to a version withdrawn since is not finished (forward mode gives it
up; unified mode goes back from where it stopped); the revert record says the mix of its ways."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import gallery as gallery_module
from fctkit.edge_runtime import revert as revert_module
from fctkit.edge_runtime.gallery.rows import VersionTag
from fctkit.edge_runtime.revert import take_withdrawals
from fctkit.edge_runtime.revert_records import (
    WithdrawalLog,
    last_revert,
    log_meta,
    revert_report_fields,
    rollback_window,
)
from fctkit.edge_runtime.upgrade_check import stored_health
from fctkit.errors import DeviceError, RpcStatusError
from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from tests.edge.conftest import ADMIN_TOKEN, TINY_CHAIN, ServerProcess, publish
from tests.edge.test_revert_edge import devices_at_v1, windowed_bundle, withdrawal
from tests.server.conftest import EMBED_DIM, IMAGE_DIM, _sources, linear_onnx

ROWS, ADDED = 40, 6


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, publisher_key) -> dict[int, Path]:
    """v1..v3 of the tiny chain, each asking for a 7-day rollback window."""
    root = tmp_path_factory.mktemp("sync-windowed")
    return {v: windowed_bundle(root / f"v{v}", publisher_key, v, 7) for v in TINY_CHAIN}


@pytest.fixture
def server(tmp_path, publisher_pub, admin_token_file):
    """A fresh `fctkit serve` on loopback (each test publishes and withdraws its own versions)."""
    started = ServerProcess(tmp_path / "server-data", publisher_pub, admin_token_file).start()
    yield started
    if started.alive():
        started.stop()


def on_v3_with_rows_added(server, windowed, make_device, images, tmp_path, publisher_key, name: str):
    """A device synced v1 -> v2 -> v3 (each inside its window, ROWS rows from v1) that then adds
    ADDED labelled rows at v3, their originals uploaded; v3 is then withdrawn back to v2."""
    from fctkit.protos.client import FctkitClient

    publish(server, windowed[1], tmp_path)
    device = devices_at_v1(server, make_device, images, (name,), ROWS)[0][name]
    for version in (2, 3):
        publish(server, windowed[version], tmp_path)
        assert device.sync().installed_after == version
    device.add(images(ADDED, 77), item_ids=[f"new{i}" for i in range(ADDED)], labels=[f"n{i}" for i in range(ADDED)])
    assert device.gallery.replica_log.outbox_size() == 0
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.withdraw(withdrawal(tmp_path, publisher_key, 3, 2, "v3 hurts recall"))
    return device


def crash_after(monkeypatch, batches: int) -> None:
    """The gallery's upgrade writes fail after ``batches`` of them (a process killed mid-upgrade)."""
    original, calls = gallery_module.Gallery.write_upgrades, []

    def write_upgrades(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > batches:
            raise Crash("killed mid-upgrade")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gallery_module.Gallery, "write_upgrades", write_upgrades)


def fleet_view(server, device) -> tuple[int, dict[str, int], int, int]:
    """The server's view: the device's listed version, and v3's revert methods, upgraded and reverted devices."""
    from fctkit.protos.client import FctkitClient

    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        listed = next(d.version for d in admin.list_devices() if d.device_id == device.settings.device_id)
        stages = admin.rollout_status(3).stages
    methods = {m: n for stage in stages for m, n in stage.revert_methods.items()}
    return listed, methods, sum(s.upgraded for s in stages), sum(s.reverted for s in stages)


def assert_valid_origins(device) -> None:
    rows = device.gallery.load()
    assert not rows.corrupt and all(0 < t.origin_version <= t.version for t in rows.tags)
    assert device.check()["damaged"] == 0


def test_rows_added_on_the_withdrawn_version_go_back_with_a_valid_origin_and_every_sync_passes(
    server, windowed, make_device, images, tmp_path, publisher_key
):
    device = on_v3_with_rows_added(server, windowed, make_device, images, tmp_path, publisher_key, "mixed")
    result = device.sync()  # the revert, then replication: the server takes every record
    assert device.version == result.installed_after == 2
    assert f"reverted to v2 (exact {ROWS}, reembedded {ADDED}, {ROWS + ADDED} row(s))" in " ".join(result.notes)
    assert result.replication is not None
    assert_valid_origins(device)
    rows = device.gallery.load()
    added = [t for i, t in zip(rows.item_ids, rows.tags, strict=True) if i.startswith("new")]
    assert added == [VersionTag(2, 2, "native")] * ADDED
    assert [label for i, label in zip(rows.item_ids, rows.labels, strict=True) if i.startswith("new")] == [
        f"n{i}" for i in range(ADDED)
    ]  # labels sealed again for the new origin
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS, "v2": ADDED}

    record = last_revert(device.gallery)
    assert record.method == f"exact {ROWS}, reembedded {ADDED}"
    assert record.rows_by_method == {"exact": ROWS, "reembedded": ADDED}
    assert device.status()["withdrawals"]["last_revert"]["method"] == f"exact {ROWS}, reembedded {ADDED}"
    assert revert_report_fields(device.gallery) == {"reverted_from": 3, "revert_method": "reembedded"}
    assert device.sync().installed_after == 2  # and the next one
    assert fleet_view(server, device) == (2, {"reembedded": 1}, 0, 1)


def test_a_device_an_earlier_revert_left_with_bad_origins_heals_at_its_next_sync(
    server, windowed, make_device, images, tmp_path, publisher_key, monkeypatch
):
    device = on_v3_with_rows_added(server, windowed, make_device, images, tmp_path, publisher_key, "old")
    # the sync as it was: rows added on v3 kept origin 3 in v2's space, nothing healed them, the server refused them
    as_it_was = lambda tag, target, via: VersionTag(tag.origin_version, target, via)  # noqa: E731
    monkeypatch.setattr(revert_module, "_back_in", as_it_was, raising=False)
    monkeypatch.setattr(gallery_module.Gallery, "heal_origins", lambda self: 0, raising=False)
    with pytest.raises(RpcStatusError, match="origin_version 3 and version 2"):
        device.sync()
    monkeypatch.undo()
    assert device.version == 2 and device.gallery.tag_counts() == {"v1->v2 (forward)": ROWS, "v2": ADDED}
    assert {t for t in device.gallery.load().tags if t.origin_version > t.version} == {VersionTag(3, 2, "native")}
    assert any(b.tag == VersionTag(3, 2, "native") for b in device.gallery.replica_log.outgoing(10_000))

    result = device.sync()
    assert f"{ADDED} row(s) had an origin version above their version" in " ".join(result.notes)
    assert_valid_origins(device)
    assert not any(
        b.tag is not None and b.tag.origin_version > b.tag.version for b in device.gallery.replica_log.outgoing(10_000)
    )
    assert device.gallery.replica_log.replication_counts()["unpushed"] == 0  # pushed, with their origins healed
    assert "origin version above" not in " ".join(device.sync().notes) and fleet_view(server, device)[0] == 2


def test_an_upgrade_interrupted_on_its_way_to_a_withdrawn_version_is_given_up_not_finished(
    server, windowed, make_device, images, tmp_path, publisher_key, monkeypatch
):
    from fctkit.protos.client import FctkitClient

    publish(server, windowed[1], tmp_path)
    device = devices_at_v1(server, make_device, images, ("crashed",), ROWS)[0]["crashed"]
    publish(server, windowed[2], tmp_path)
    assert device.sync().installed_after == 2
    before, health_before = device.gallery.load(), stored_health(device.gallery)
    publish(server, windowed[3], tmp_path)
    device.settings = dataclasses.replace(device.settings, batch_size=8)
    crash_after(monkeypatch, 2)
    with pytest.raises(Crash):
        device.sync()
    monkeypatch.undo()
    assert device.gallery.upgrade_state["target"] == 3 and device.version == 2
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.withdraw(withdrawal(tmp_path, publisher_key, 3, 2, "v3 hurts recall"))

    result = device.sync()
    assert "while the upgrade to it was under way: the upgrade was given up (16 staged row(s) dropped)" in " ".join(
        result.notes
    )
    assert device.version == 2 and device.gallery.upgrade_state is None and result.rows_upgraded == 0
    rows = device.gallery.load()
    assert rows.item_ids == before.item_ids and rows.tags == before.tags and rows.labels == before.labels
    assert np.array_equal(np.stack(rows.embeddings), np.stack(before.embeddings))
    assert sum(device.gallery.vector_table_rows().values()) == ROWS  # nothing staged is left
    assert last_revert(device.gallery) is None and stored_health(device.gallery) == health_before  # v3 never served
    window = rollback_window(device.gallery)  # v2's own window stays: a withdrawal of v2 still reverts exactly
    assert (window.version, window.previous_version) == (2, 1) and device.gallery.extras.count(
        "rollback_embedding"
    ) == ROWS
    assert fleet_view(server, device) == (2, {}, 0, 0)


def test_an_offline_resume_gives_up_an_upgrade_to_a_version_withdrawn_since(make_device, windowed, images, monkeypatch):
    """A crash between recording the withdrawal and giving the upgrade up: `fctkit device upgrade`
    resumes nothing toward the withdrawn version."""
    device = make_device("dev", health_sample=0, batch_size=8)
    device.upgrade([windowed[1], windowed[2]])
    device.add(images(ROWS, 3), upload=False)
    before = device.gallery.load()
    crash_after(monkeypatch, 1)
    with pytest.raises(Crash):
        device.upgrade(windowed[3])
    monkeypatch.undo()
    log = WithdrawalLog({"3": {"revert_to": 2, "reason": "v3 hurts recall", "withdrawn_at": "2026-01-01T00:00:00"}})
    device.gallery.set_meta(log_meta(log))
    assert device.upgrade() == 0 and device.version == 2 and device.gallery.upgrade_state is None
    rows = device.gallery.load()
    assert rows.tags == before.tags and np.array_equal(np.stack(rows.embeddings), np.stack(before.embeddings))
    with pytest.raises(DeviceError, match="v3 was withdrawn"):
        device.upgrade(windowed[3])


def unified_v2(folder: Path, key) -> Path:
    """v2 in unified mode: the tiny chain's forward adapters 1 -> 2 and a backward graph 2 -> 1, no window."""
    sources = _sources(folder / "u2-src", 2, TINY_CHAIN[2], IMAGE_DIM)
    back = linear_onnx(folder / "u2-src" / "b.onnx", {"new": EMBED_DIM}, EMBED_DIM, seed=78, output="embedding")
    sources.append(ArtifactSource(back, "backward", 2, 1))
    return build_bundle(
        folder / "u2",
        version=2,
        parents=(1,),
        mode="unified",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {s.artifact_name: True for s in sources if s.role in ("forward", "backward")}},
        private_key=key,
    ).root


def test_an_interrupted_unified_upgrade_to_a_withdrawn_version_goes_back_from_where_it_stopped(
    make_device, windowed, images, tmp_path, publisher_key, monkeypatch
):
    device = make_device("dev", health_sample=0, batch_size=8)
    device.upgrade(windowed[1])
    device.add(images(ROWS, 4), labels=[f"c{i % 3}" for i in range(ROWS)], upload=False)
    before = device.gallery.load()
    crash_after(monkeypatch, 2)
    with pytest.raises(Crash):
        device.upgrade(unified_v2(tmp_path, publisher_key))
    monkeypatch.undo()
    assert device.version == 2 and device.gallery.tag_counts() == {"v1": ROWS - 16, "v1->v2 (forward)": 16}
    document = withdrawal(tmp_path, publisher_key, 2, 1)
    device.gallery.set_meta(log_meta(WithdrawalLog({"2": {"revert_to": 1, "reason": "r", "withdrawn_at": "x"}})))
    with pytest.raises(DeviceError, match="it is not finished"):  # offline: its queries switched, a sync goes back
        device.upgrade()

    notes = take_withdrawals(device.parts, device.trust, [document], client=None)
    device._upgraded()
    assert "reverted to v1 (backward, 16 row(s))" in notes[0]
    assert device.version == 1 and device.gallery.upgrade_state is None
    assert device.gallery.tag_counts() == {"v1": ROWS - 16, "v1 (backward)": 16}
    rows = device.gallery.load()
    assert not rows.corrupt and rows.item_ids == before.item_ids and rows.labels == before.labels
    untouched = [i for i, t in enumerate(rows.tags) if t.via == "native"]
    assert np.array_equal(np.stack(rows.embeddings)[untouched], np.stack(before.embeddings)[untouched])
    assert device.upgrade() == 0 and device.version == 1  # nothing left to resume; v2 is never applied again
    assert all(len(matches) == 5 for matches in device.query(images(3, 6), k=5))


def test_a_revert_through_the_backward_graph_gives_rows_added_on_the_withdrawn_version_its_target_as_origin(
    make_device, windowed, images, tmp_path, publisher_key
):
    from tests.edge.test_confirm_edge import backward_bundle

    device = make_device("dev", health_sample=0)
    device.upgrade(windowed[1])
    device.add(images(20, 5), upload=False)
    device.upgrade(backward_bundle(tmp_path, publisher_key))
    device.add(images(4, 6), item_ids=[f"new{i}" for i in range(4)], labels=["a", "b", None, "d"], upload=False)
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    device._upgraded()
    assert "reverted to v1 (exact 20, backward 4, 24 row(s))" in notes[0]
    assert_valid_origins(device)
    rows = device.gallery.load()
    assert [t for i, t in zip(rows.item_ids, rows.tags, strict=True) if i.startswith("new")] == [
        VersionTag(1, 1, "backward")
    ] * 4
    assert [label for i, label in zip(rows.item_ids, rows.labels, strict=True) if i.startswith("new")] == [
        "a",
        "b",
        None,
        "d",
    ]
    assert revert_report_fields(device.gallery) == {"reverted_from": 2, "revert_method": "backward"}
    assert device.status()["rows_by_space"] == {"v1": 20, "v1 (backward)": 4}
