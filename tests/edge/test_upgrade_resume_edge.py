"""Repeating the command after a crash finishes the job (issue 19 part 3): an interrupted
upgrade resumed by the same `upgrade --bundle` call completes and the call succeeds (it used
to finish, then refuse the bundle as a replay); a bundle installed by an upgrade that stopped
before it began is reported by `status` and applied by a plain `upgrade`; a different bundle
under an installed version number is still refused."""

from __future__ import annotations

import json

import pytest

from fctkit.edge_runtime import gallery as gallery_module
from fctkit.errors import RollbackError
from fctkit.export.bundle_builder import build_bundle
from tests.edge.conftest import TINY_CHAIN, device_cli_steps, make_tiny_bundle
from tests.server.conftest import IMAGE_DIM, _sources


class Crash(Exception):
    pass


def test_the_same_upgrade_command_resumes_and_succeeds(make_device, tiny_bundles, images, monkeypatch):
    device = make_device(batch_size=8)
    device.upgrade(tiny_bundles[1])
    device.add(images(40, seed=1), upload=False)
    original, calls = gallery_module.Gallery.write_upgrades, []

    def crash_after_two_batches(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise Crash("killed mid-upgrade")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gallery_module.Gallery, "write_upgrades", crash_after_two_batches)
    with pytest.raises(Crash):
        device.upgrade(tiny_bundles[2])
    monkeypatch.setattr(gallery_module.Gallery, "write_upgrades", original)
    assert device.gallery.upgrade_state is not None and device.version == 1
    assert device.upgrade(tiny_bundles[2]) == 24  # the same command: resumes, does not refuse v2
    assert device.version == 2 and device.status()["rows_by_space"] == {"v1->v2 (forward)": 40}
    assert device.upgrade(tiny_bundles[2]) == 0  # and once more: nothing left, no error


def test_a_bundle_installed_but_never_applied_is_reported_and_applied(make_device, tiny_bundles, images):
    device = make_device()
    device.upgrade(tiny_bundles[1])
    device.add(images(10, seed=2), upload=False)
    device.install_bundle(tiny_bundles[2])  # the crash window: installed, the plan not stored yet
    assert device.status()["installed_not_applied"]["versions"] == [2]
    root = str(device.root)
    device.close()
    status, upgraded, after = device_cli_steps(
        [("status", "--dir", root), ("upgrade", "--dir", root), ("status", "--dir", root)]
    )
    assert json.loads(status)["installed_not_applied"]["versions"] == [2]
    upgraded = json.loads(upgraded)
    assert (upgraded["rows_upgraded"], upgraded["installed_version"], upgraded["upgrade_health"]["version"]) == (
        10,
        2,
        2,
    )
    assert "installed_not_applied" not in json.loads(after)


def test_another_bundle_under_an_installed_version_is_still_a_replay(
    make_device, tiny_bundles, publisher_key, tmp_path
):
    device = make_device()
    device.upgrade([tiny_bundles[1], tiny_bundles[2]])
    sources = _sources(tmp_path / "src", 2, TINY_CHAIN[2], IMAGE_DIM)
    impostor = build_bundle(
        tmp_path / "other-v2",
        version=2,
        parents=(1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {"another": {"top1": 0.5}}, "ecc": {"forward_1_to_2": True}},
        private_key=publisher_key,
    ).root  # the same number, another signed manifest
    with pytest.raises(RollbackError, match="replay"):
        device.install_bundle(impostor)
    with pytest.raises(RollbackError, match="rollback"):
        device.install_bundle(make_tiny_bundle(tmp_path / "v1-again", publisher_key, 1, ()))


def test_upgrade_takes_a_bundle_archive_as_it_is(make_device, tiny_bundles, images, tmp_path):
    from fctkit.protos.bundle import pack_bundle

    device = make_device()
    device.upgrade(pack_bundle(tiny_bundles[1], tmp_path / "v1.tar"))
    device.add(images(6, seed=3), upload=False)
    assert device.upgrade(pack_bundle(tiny_bundles[2], tmp_path / "v2.tar")) == 6 and device.version == 2
