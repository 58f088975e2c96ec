"""A damaged installed bundle (issue 34, section 2): `check` sees it, the commands that need it
say how to put it back, and `upgrade --bundle` (from a folder) or `repair` (from the server)
re-installs the very signed bundle; another bundle under the installed number stays a replay."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import BundleError, DeviceError, RollbackError
from fctkit.export.bundle_builder import build_bundle
from tests.edge.conftest import IMAGE_DIM, TINY_CHAIN, _sources
from tests.edge.test_device_trust_edge import root_file, rooted, tiny_keyed_bundles  # noqa: F401 (fixtures)
from tests.edge.test_replication_edge import enrolled, server  # noqa: F401 (server is a fixture)


def _flip(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _upgraded(make_device, tiny_bundles, images, name: str) -> tuple[Device, np.ndarray, list]:
    device = make_device(name)
    device.upgrade([tiny_bundles[1], tiny_bundles[2]])
    device.add(images(20, seed=3), item_ids=[f"b{i}" for i in range(20)], upload=False)
    queries = images(5, seed=4)
    return device, queries, _answers(device, queries)


def _answers(device: Device, queries: np.ndarray) -> list:
    return [[(m.item_id, round(m.distance, 6)) for m in found] for found in device.query(queries, k=3)]


def _impostor_v2(tmp_path: Path, key, version: int = 2) -> Path:
    """Another signed bundle under an installed number (another gate: another manifest)."""
    sources = _sources(tmp_path / f"src{version}", version, TINY_CHAIN[version], IMAGE_DIM)
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    return build_bundle(
        tmp_path / f"other-v{version}",
        version=version,
        parents=(version - 1,) if version > 1 else (),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {"another": {"top1": 0.5}}, "ecc": ecc},
        private_key=key,
    ).root


def _reopened(root: Path) -> Device:
    device = Device.open(root)
    device.progress = False
    return device


@pytest.mark.parametrize("damaged_file", ["manifest.json", "manifest.sig", "embed.onnx"])
def test_a_damaged_installed_bundle_is_seen_and_the_genuine_one_reinstalls_from_a_folder(
    make_device, tiny_bundles, images, damaged_file
):
    device, queries, answers = _upgraded(make_device, tiny_bundles, images, "flip")
    root = device.root
    device.close()
    _flip(
        root / "bundles" / "v2" / damaged_file, offset=len((root / "bundles" / "v2" / damaged_file).read_bytes()) // 2
    )
    with _reopened(root) as damaged:
        report = damaged.check()
        assert list(report["damaged_bundles"]) == ["v2"] and report["damaged"] == 1
        with pytest.raises(BundleError, match=r"installed bundle v2 is damaged.*fctkit device repair.*--bundle"):
            damaged.query(queries)
        repaired = damaged.repair()  # no server here: the report says what to do, nothing else is touched
        assert (
            list(repaired["damaged_bundles"]) == ["v2"]
            and "upgrade --dir DIR --bundle" in repaired["damaged_bundles"]["v2"]
        )
        assert repaired["rows_forgotten"] == [] and len(damaged.gallery) == 20
        assert damaged.upgrade(tiny_bundles[2]) == 0  # the very signed bundle: re-installed, not a replay
        assert damaged.check()["damaged"] == 0 and _answers(damaged, queries) == answers
        assert not list((root / "bundles").glob("v2.*"))  # no staging or damaged copy left behind


def test_the_gallerys_own_bundle_deleted_comes_back_and_another_one_stays_a_replay(
    make_device, tiny_bundles, images, publisher_key, tmp_path
):
    device, queries, answers = _upgraded(make_device, tiny_bundles, images, "gone")
    root = device.root
    device.close()
    _flip(root / "bundles" / "v2" / "embed.onnx")
    impostor = _impostor_v2(tmp_path, publisher_key)
    with _reopened(root) as damaged:
        with pytest.raises(RollbackError, match="replay"):  # a damaged copy does not open the door to another v2
            damaged.install_bundle(impostor)
        with pytest.raises(RollbackError, match="rollback"):  # nor to an older version
            damaged.upgrade(_impostor_v2(tmp_path, publisher_key, version=1))
    shutil.rmtree(root / "bundles" / "v2")
    with _reopened(root) as bare:
        assert bare.check()["damaged_bundles"] == {
            "v2": "bundle v2 is not installed; " + bare.check()["damaged_bundles"]["v2"].split("; ", 1)[1]
        }
        with pytest.raises(DeviceError, match=r"not installed.*fctkit device repair"):
            bare.query(queries)
        bare.upgrade(tiny_bundles[2])
        assert bare.check()["damaged"] == 0 and _answers(bare, queries) == answers
        with pytest.raises(RollbackError, match="replay"):
            bare.install_bundle(impostor)


def test_repair_downloads_a_damaged_bundle_again_from_the_server(server, make_device, images):  # noqa: F811
    device = enrolled(make_device, server, "fetching", "")
    device.add(images(6, seed=8), item_ids=[f"s{i}" for i in range(6)], upload=False)
    queries, root = images(3, seed=9), device.root
    answers = _answers(device, queries)
    device.close()
    _flip(sorted((root / "bundles" / "v1").glob("*.onnx"))[-1])
    with _reopened(root) as damaged:
        assert list(damaged.check()["damaged_bundles"]) == ["v1"]
        report = damaged.repair()
        assert report["damaged_bundles"] == {} and report["damaged_after"] == 0
        assert _answers(damaged, queries) == answers


@pytest.mark.parametrize("trust", ["publisher key", "root"])
def test_a_damaged_installed_manifest_says_to_put_the_bundle_back_before_anything_else(
    trust, request, make_device, images
):
    if trust == "root":  # the root's publisher role: its check would have more key holders sign the release
        device = request.getfixturevalue("rooted")
        device.upgrade([request.getfixturevalue("tiny_keyed_bundles")["alice"][1]])
    else:
        device = make_device("manifest")
        device.upgrade(request.getfixturevalue("tiny_bundles")[1])
    device.add(images(4, seed=5), item_ids=["m0", "m1", "m2", "m3"], upload=False)
    device.bundles.unload(1)
    _flip(device.root / "bundles" / "v1" / "manifest.json", offset=40)
    said = device.check()["damaged_bundles"]["v1"]
    with pytest.raises(BundleError) as refused:
        device.query(images(1, seed=6))
    for message in (said, str(refused.value)):
        assert message.startswith("the installed bundle v1 is damaged: put the published bundle back: ")
        advice = message.index("fctkit device repair --dir DIR")
        assert all(advice < message.index(a) for a in ("keys sign", "fetch the bundle again") if a in message)
