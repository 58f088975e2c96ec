"""A device directory is owner-only whatever the umask and whatever mode it had (issue 19 part 2
and 3): under umask 000 a pre-existing 0755 folder ends with directories 0700 and files 0600
after init, installing bundles and adding rows (keys, token, settings, publisher key, gallery
and its WAL files, bundles)."""

from __future__ import annotations

import os
import stat

from fctkit.edge_runtime import Device


def test_a_device_directory_is_owner_only_under_any_umask(tiny_bundles, images, publisher_pub, tmp_path):
    root = tmp_path / "dev"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    old = os.umask(0)
    try:
        device = Device.init(root, publisher_key=publisher_pub)
        device.progress = False
        device.upgrade(tiny_bundles[1])
        device.add(images(5, seed=1), upload=False)
        device.upgrade(tiny_bundles[2])
        device.close()
        Device.open(root).close()
    finally:
        os.umask(old)
    wrong = {}
    for folder, _, files in os.walk(root):
        for path, wanted in ((folder, 0o700), *((os.path.join(folder, f), 0o600) for f in files)):
            if stat.S_IMODE(os.lstat(path).st_mode) != wanted:
                wrong[os.path.relpath(path, root)] = oct(stat.S_IMODE(os.lstat(path).st_mode))
    assert wrong == {}
    assert {"publisher.pub", "device.key", "gallery.sqlite"} <= set(os.listdir(root))
