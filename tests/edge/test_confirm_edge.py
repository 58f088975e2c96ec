"""A confirmed version on the device (issue 36 §3): when the server lists the version a device
runs as confirmed, its next sync drops the vectors kept for an exact revert (as when the rollback
window ends) and status says "confirmed"; a confirmation of another version changes nothing; a
later withdrawal still reverts, through the bundle's backward graph or by embedding the vault's
originals again, and the revert says the version was confirmed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.edge_runtime.revert import take_withdrawals
from fctkit.edge_runtime.revert_records import confirm_rollback, rollback_window
from fctkit.export.bundle_builder import build_bundle
from tests.edge.conftest import TINY_CHAIN
from tests.edge.test_revert_edge import QUERIES, devices_at_v1, top10, windowed_bundle, withdrawal
from tests.server.conftest import IMAGE_DIM, _sources

ROWS = 60


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, publisher_key) -> dict[int, Path]:
    """v1 and v2 of the tiny chain, each asking for a 7-day rollback window."""
    root = tmp_path_factory.mktemp("confirm-windowed")
    return {v: windowed_bundle(root / f"v{v}", publisher_key, v, 7) for v in (1, 2)}


def backward_bundle(folder: Path, key: Ed25519PrivateKey) -> Path:
    """v2 with a 7-day window and a backward graph to v1."""
    from fctkit.export.bundle_builder import ArtifactSource
    from tests.server.conftest import EMBED_DIM, linear_onnx

    sources = _sources(folder / "v2-src", 2, TINY_CHAIN[2], IMAGE_DIM)
    back = linear_onnx(folder / "v2-src" / "b.onnx", {"new": EMBED_DIM}, EMBED_DIM, seed=77, output="embedding")
    sources.append(ArtifactSource(back, "backward", 2, 1))
    return build_bundle(
        folder / "v2b",
        version=2,
        parents=(1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {s.artifact_name: True for s in sources if s.role in ("forward", "backward")}},
        private_key=key,
        rollback_window_days=7,
    ).root


def test_a_confirmed_window_drops_its_vectors_and_a_withdrawal_then_goes_backward(
    make_device, windowed, publisher_key, images, tmp_path
):
    device = make_device("dev", health_sample=0)
    device.upgrade(windowed[1])
    device.add(images(ROWS, 5), upload=False)
    device.upgrade(backward_bundle(tmp_path, publisher_key))
    adapted, queries = device.gallery.load(), images(QUERIES, 6)
    answers = top10(device, queries)
    assert device.gallery.extras.count("rollback_embedding") == ROWS

    assert confirm_rollback(device.gallery, [1, 3]) is None  # other versions' confirmations change nothing
    assert device.gallery.extras.count("rollback_embedding") == ROWS
    window = confirm_rollback(device.gallery, [2], now=rollback_window(device.gallery).until - 86400)
    assert window is not None and window.confirmed_at is not None and not window.is_open()
    assert device.gallery.extras.count("rollback_embedding") == 0 and rollback_window(device.gallery) == window
    status = device.status()["withdrawals"]["rollback_window"]
    assert (status["state"], status["open"], status["rows_kept"]) == ("confirmed", False, 0)
    assert confirm_rollback(device.gallery, [2]) is None  # once
    assert top10(device, queries) == answers  # the rows and answers at v2 are untouched

    engine = device.engine(2)
    expected = engine.run(engine.manifest.artifact("backward"), np.stack(adapted.embeddings))
    notes = take_withdrawals(device.parts, device.trust, [withdrawal(tmp_path, publisher_key, 2, 1)], client=None)
    device._upgraded()
    assert "reverted to v1 (backward, 60 row(s))" in notes[0] and "v2 was confirmed at" in notes[0]
    assert "the vectors kept of v1 were dropped then" in notes[0]
    assert device.version == 1 and np.array_equal(np.stack(device.gallery.load().embeddings), expected)
    assert device.status()["withdrawals"]["rollback_window"] is None


def test_a_sync_takes_the_servers_confirmation_then_a_withdrawal_reembeds(
    edge_server, windowed, publisher_key, make_device, images, tmp_path
):
    """On loopback: a real `fctkit serve`, v1 then v2 (7-day window); two devices upgrade. The admin
    confirms v2: the next sync of each drops its kept vectors, and status says "confirmed". The
    publisher then withdraws v2: each device goes back to v1 by embedding its vault originals
    again (no kept vectors, no backward graph) and answers every query as before the upgrade."""
    from fctkit.protos.client import FctkitClient
    from tests.edge.conftest import ADMIN_TOKEN, publish

    publish(edge_server, windowed[1], tmp_path)
    devices, queries, before = devices_at_v1(edge_server, make_device, images, ("a", "b"), 40)
    publish(edge_server, windowed[2], tmp_path)
    at_v2 = {}
    for name, device in devices.items():
        assert device.sync().installed_after == 2 and device.gallery.extras.count("rollback_embedding") == 40
        assert device.sync().notes == [] and device.status()["withdrawals"]["rollback_window"]["state"] == "open"
        at_v2[name] = top10(device, queries)

    with FctkitClient(edge_server.target, ADMIN_TOKEN) as admin:
        assert admin.confirm_version(2).confirmed_at
    for name, device in devices.items():
        result = device.sync()
        assert "v2 was confirmed: the vectors kept of v1 for a revert were dropped" in " ".join(result.notes)
        assert device.version == 2 and device.gallery.extras.count("rollback_embedding") == 0
        window = device.status()["withdrawals"]["rollback_window"]
        assert (window["state"], window["rows_kept"], window["version"]) == ("confirmed", 0, 2)
        assert top10(device, queries) == at_v2[name]
        assert not any("confirmed" in note for note in device.sync().notes)  # said once

    with FctkitClient(edge_server.target, ADMIN_TOKEN) as admin:
        admin.withdraw(withdrawal(tmp_path, publisher_key, 2, 1, "v2 hurts recall after all"))
    for name, device in devices.items():
        notes = " ".join(device.sync().notes)
        assert "reverted to v1 (reembedded, 40 row(s))" in notes and "v2 was confirmed at" in notes
        answers, rows_before = before[name]
        assert device.version == 1 and top10(device, queries) == answers
        rows = device.gallery.load()
        assert rows.item_ids == rows_before.item_ids and rows.tags == rows_before.tags
        np.testing.assert_allclose(np.stack(rows.embeddings), np.stack(rows_before.embeddings), atol=1e-6)
        assert device.status()["withdrawals"]["last_revert"]["method"] == "reembedded"
    with FctkitClient(edge_server.target, ADMIN_TOKEN) as admin:
        methods = {m: n for stage in admin.rollout_status(2).stages for m, n in stage.revert_methods.items()}
    assert methods == {"reembedded": 2}
