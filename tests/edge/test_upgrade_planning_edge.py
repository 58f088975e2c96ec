"""Planning an upgrade from every version the gallery's rows are in: offline chains over the
installed bundles, a forward adapter on top of a "compatible" version (rows still tagged with
the older version), and plans refused before any row is touched."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from fctkit.edge_runtime.upgrade_plan import Hop, UpgradePlan, check_plan_dims
from fctkit.errors import DeviceError, GalleryError
from tests.edge.conftest import device_cli_steps, make_tiny_bundle


@pytest.fixture(scope="module")
def no_direct_chain(tmp_path_factory, publisher_key):
    """v1, v2 (1->2), v3 (2->3 only): v1 rows reach v3 only hop by hop."""
    root = tmp_path_factory.mktemp("no-direct")
    return {
        v: make_tiny_bundle(root / f"v{v}", publisher_key, v, hops)
        for v, hops in {1: (), 2: ((1, 2),), 3: ((2, 3),)}.items()
    }


def test_offline_chain_through_given_bundles_equals_upgrading_one_by_one(make_device, no_direct_chain, images):
    chained, stepwise = make_device("chained"), make_device("stepwise")
    for device in (chained, stepwise):
        device.upgrade(no_direct_chain[1])
        device.add(images(9, seed=4), item_ids=[f"i{k}" for k in range(9)])
    # given in any order: installed by version, planned v1 -> v2 -> v3
    assert chained.upgrade([no_direct_chain[3], no_direct_chain[2]]) == 9
    stepwise.upgrade(no_direct_chain[2])
    stepwise.upgrade(no_direct_chain[3])
    assert chained.version == stepwise.version == 3
    assert chained.status()["rows_by_space"] == {"v1->v3 (forward)": 9}
    np.testing.assert_array_equal(chained.gallery.load().embeddings, stepwise.gallery.load().embeddings)
    np.testing.assert_array_equal(chained.gallery.load().side_infos, stepwise.gallery.load().side_infos)


def test_offline_upgrade_without_a_path_is_refused_before_any_row_changes(make_device, no_direct_chain, images):
    device = make_device()
    device.upgrade(no_direct_chain[1])
    device.add(images(5, seed=5))
    before = device.gallery.load().embeddings.copy()
    with pytest.raises(
        DeviceError, match=r"no upgrade from v1 to v3: the installed bundles \(v1, v3\) hold no adapter path"
    ):
        device.upgrade(no_direct_chain[3])
    assert device.version == 1 and device.gallery.upgrade_state is None
    np.testing.assert_array_equal(device.gallery.load().embeddings, before)
    assert (
        device.upgrade(no_direct_chain[2]) == 5 and device.upgrade(no_direct_chain[3]) == 5
    )  # the missing hop brought


def _run(bundle_dir, graph: str, *inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(bundle_dir / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip([i.name for i in session.get_inputs()], inputs)))[0]


def test_forward_adapter_on_top_of_a_compatible_version(tmp_path, make_device, publisher_key, images):
    """v2 is "compatible" with v1 (rows keep their v1 tag, new rows are v2-native); v3's
    adapter is from v2. Every row reaches v3: the v1-tagged ones through the identity hop
    1->2 and then h 2->3, applied to their v1 vectors as v2 is compatible with them."""
    v1 = make_tiny_bundle(tmp_path / "c1", publisher_key, 1, ())
    v2 = make_tiny_bundle(tmp_path / "c2", publisher_key, 2, (), mode="compatible")
    v3 = make_tiny_bundle(tmp_path / "c3", publisher_key, 3, ((2, 3),))
    device = make_device()
    device.upgrade(v1)
    device.add(images(6, seed=6), item_ids=[f"old{k}" for k in range(6)])
    assert device.upgrade(v2) == 0  # compatible: no row rewritten
    device.add(images(4, seed=7), item_ids=[f"new{k}" for k in range(4)])
    assert device.status()["rows_by_space"] == {"v1": 6, "v2": 4}
    before = device.gallery.load()

    assert device.upgrade(v3) == 10
    assert device.version == 3 and device.status()["rows_by_space"] == {"v1->v3 (forward)": 6, "v2->v3 (forward)": 4}
    after = device.gallery.load()
    order = np.argsort(before.item_ids)
    expected = _run(v3, "forward_2_to_3", before.embeddings[order], before.side_infos[order])
    np.testing.assert_allclose(after.embeddings[np.argsort(after.item_ids)], expected, rtol=1e-5, atol=1e-6)


def _manifest(dims: int, *forwards: tuple[str, int, int]):
    artifacts = [
        SimpleNamespace(
            name=name, inputs=[SimpleNamespace(shape=(None, wanted))], outputs=[SimpleNamespace(shape=(None, out))]
        )
        for name, wanted, out in forwards
    ]
    return SimpleNamespace(embedding_dim=dims, artifacts=artifacts)


def test_plans_feeding_an_adapter_the_wrong_length_are_refused():
    """BT²-style: v2 is compatible with v1 on a 32-d prefix of its 80-d embedding; v3's adapter
    takes v2's 80-d embeddings, so v1's 32-d rows cannot take it (a direct 1->3 could)."""
    manifests = {
        1: _manifest(32),
        2: _manifest(80),
        3: _manifest(64, ("forward_2_to_3", 80, 64), ("forward_1_to_3", 32, 64)),
    }
    via_identity = UpgradePlan(3, "forward", (Hop(1, 2, 2, None, None), Hop(2, 3, 3, "forward_2_to_3", None)))
    with pytest.raises(GalleryError, match=r"rows of v1 are 32-d, but the adapter v2->v3 .* takes 80-d"):
        check_plan_dims(via_identity, [1, 2], manifests.get)
    check_plan_dims(via_identity, [2], manifests.get)  # v2's own rows are fine
    direct = UpgradePlan(3, "forward", (Hop(1, 3, 3, "forward_1_to_3", None), Hop(2, 3, 3, "forward_2_to_3", None)))
    check_plan_dims(direct, [1, 2], manifests.get)
    check_plan_dims(
        via_identity, [1, 2], {2: manifests[2], 3: manifests[3]}.get
    )  # v1 not installed: left to the engine


def test_cli_offline_upgrade_takes_several_bundles(tmp_path, no_direct_chain, publisher_pub, images):
    root = tmp_path / "offline-cli"
    np.savez(tmp_path / "add.npz", images=images(4, seed=8), ids=np.array([f"o{i}" for i in range(4)]))
    steps = [
        ("init", "--dir", str(root), "--publisher-key", str(publisher_pub)),
        ("upgrade", "--dir", str(root), "--bundle", str(no_direct_chain[1]), "--quiet"),
        ("add", "--dir", str(root), str(tmp_path / "add.npz")),
        (
            "upgrade",
            "--dir",
            str(root),
            "--bundle",
            str(no_direct_chain[3]),
            "--bundle",
            str(no_direct_chain[2]),
            "--quiet",
        ),
        ("status", "--dir", str(root)),
    ]
    outputs = device_cli_steps(steps)
    assert '"rows_upgraded": 4' in outputs[3] and '"installed_version": 3' in outputs[3]
    assert '"v1->v3 (forward)": 4' in outputs[4]
