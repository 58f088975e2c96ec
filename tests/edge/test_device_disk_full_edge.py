"""A full disk on a device (issue 34, section 2): `upgrade`, `add` and `repair` say "no space left
on device" (the directory, and the bytes needed when known) and leave everything as it was.

For real: the device directory lives on a small tmpfs filled to the last page. Mounting needs
root; elsewhere these tests skip with the reason (and fail under CI=true, where they must run)."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import NoSpaceError
from tests.edge.conftest import device_cli, enrolment_code, flip_stored_byte, publish
from tests.edge.test_replication_edge import server  # noqa: F401 (a fixture: a real server with v1 published)

NO_SPACE = r"no space left on device for .*disk/dev"


def _cannot(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: under CI these tests must run (as root, where tmpfs can be mounted)")
    pytest.skip(reason)


@contextlib.contextmanager
def small_disk(where: Path, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the block; unmounted afterwards."""
    if os.geteuid() != 0:
        _cannot("mounting a tmpfs needs root")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode:
        _cannot(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full (the gallery's WAL emptied first, so the next write needs new pages)."""
    with contextlib.closing(sqlite3.connect(disk / "dev" / "gallery.sqlite")) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _dump(root: Path) -> list[str]:
    with sqlite3.connect(f"file:{root / 'gallery.sqlite'}?mode=ro", uri=True) as db:
        return list(db.iterdump())


def _device(disk: Path, publisher_pub: Path, tiny_bundles, images, n: int = 300) -> Device:
    device = Device.init(disk / "dev", publisher_key=publisher_pub)
    device.progress = False
    device.upgrade(tiny_bundles[1])
    device.add(images(n, seed=21), item_ids=[f"d{i}" for i in range(n)], upload=False)
    return device


def test_upgrade_and_add_on_a_full_disk_say_so_and_change_nothing(tmp_path, publisher_pub, tiny_bundles, images):
    with small_disk(tmp_path / "disk") as disk:
        device = _device(disk, publisher_pub, tiny_bundles, images)
        try:
            queries = images(4, seed=22)
            answers = [[m.item_id for m in found] for found in device.query(queries, k=3)]
            filler = _fill(disk)
            before = _dump(device.root)
            with pytest.raises(
                NoSpaceError, match=NO_SPACE + r".*installing the bundles and upgrading the gallery.*bytes are needed"
            ):
                device.upgrade(tiny_bundles[2])  # refused before anything is written
            with pytest.raises(NoSpaceError, match=NO_SPACE + r".*copying the bundle in.*bytes are needed"):
                device.install_bundle(tiny_bundles[2])  # the copy itself meets the full disk
            assert device.installed_versions() == [1] and sorted(
                p.name for p in (device.root / "bundles").iterdir()
            ) == ["v1"]
            with pytest.raises(NoSpaceError, match=NO_SPACE + ".*database or disk is full"):
                device.add(images(3000, seed=23), item_ids=[f"n{i}" for i in range(3000)], upload=False)
            assert _dump(device.root) == before and len(device.gallery) == 300
            assert [[m.item_id for m in found] for found in device.query(queries, k=3)] == answers
            cli = device_cli("upgrade", "--dir", str(device.root), "--bundle", str(tiny_bundles[2]))
            assert cli.returncode == 2 and "no space left on device" in cli.stderr and "Traceback" not in cli.stderr
            assert _dump(device.root) == before
            os.unlink(filler)
            device.upgrade(tiny_bundles[2])  # with room again, the same command goes through
            assert device.version == 2 and len(device.gallery) == 300
        finally:
            device.close()


def test_an_upgrade_that_would_fill_the_disk_midway_is_refused_before_it_starts(
    tmp_path, publisher_pub, tiny_bundles, images
):
    with small_disk(tmp_path / "disk") as disk:
        device = _device(disk, publisher_pub, tiny_bundles, images, n=3000)
        try:
            device.install_bundle(tiny_bundles[2])  # there is room for the bundle, not for the rows' rewrite
            filler = _fill(disk)
            os.truncate(filler, filler.stat().st_size - 512 * 1024)
            before = _dump(device.root)
            with pytest.raises(
                NoSpaceError, match=NO_SPACE + r".*upgrading the gallery's rows to v2.*bytes are needed"
            ):
                device.upgrade()
            assert _dump(device.root) == before and device.gallery.upgrade_state is None and device.version == 1
        finally:
            device.close()


def test_the_same_upgrade_again_on_a_full_disk_is_done_not_refused(tmp_path, publisher_pub, tiny_bundles, images):
    with small_disk(tmp_path / "disk") as disk:
        device = _device(disk, publisher_pub, tiny_bundles, images)
        try:
            device.upgrade(tiny_bundles[2])
            _fill(disk)
            before = _dump(device.root)
            assert device.upgrade(tiny_bundles[2]) == 0  # installed and applied: nothing to write, no room needed
            assert _dump(device.root) == before and device.version == 2 and device.installed_versions() == [1, 2]
            with pytest.raises(NoSpaceError, match=NO_SPACE + r".*installing the bundles"):
                device.upgrade(tiny_bundles[3])  # work to do: still refused before anything is written
            assert _dump(device.root) == before and device.installed_versions() == [1, 2]
        finally:
            device.close()


def test_opening_a_device_on_a_full_disk_says_no_space_not_damage(tmp_path, publisher_pub, tiny_bundles, images):
    with small_disk(tmp_path / "disk") as disk:
        with _device(disk, publisher_pub, tiny_bundles, images) as device:
            root = device.root
        np.save(tmp_path / "items.npy", images(5, seed=25))  # beside the disk, not on it

        def in_process() -> str:
            with pytest.raises(NoSpaceError) as refused:
                Device.open(root)
            return str(refused.value)

        for attempt in (
            in_process,
            lambda: device_cli("add", "--dir", str(root), str(tmp_path / "items.npy"), "--no-upload").stderr,
            lambda: device_cli("repair", "--dir", str(root)).stderr,
        ):
            Device.open(
                root
            ).close()  # closed: SQLite must make its shared-memory file again, which a full disk refuses
            filler = _fill(disk)
            said = attempt()
            assert "no space left on device" in said and "damaged" not in said, said
            os.unlink(filler)
        with Device.open(root) as device:
            assert len(device.gallery) == 300 and device.check()["damaged"] == 0


def test_repair_on_a_full_disk_says_so_and_keeps_the_damaged_gallery_for_later(
    tmp_path, publisher_pub, tiny_bundles, images
):
    with small_disk(tmp_path / "disk") as disk:
        root = _device(disk, publisher_pub, tiny_bundles, images, n=3000).root
        Device.open(root).close()
        with sqlite3.connect(root / "gallery.sqlite") as db:
            flip_stored_byte(db, "vector_blocks", "side_info", "1", 40)
        with Device.open(root) as device:
            device.progress = False
            filler = _fill(disk)
            before = _dump(root)
            with pytest.raises(NoSpaceError, match=NO_SPACE):
                device.repair()
            assert _dump(root) == before
            os.unlink(filler)
            report = device.repair()
            assert (
                report["rows_forgotten"] == []
                and len(report["side_info_restored"]) == 3000
                and report["damaged_after"] == 0
            )
            assert np.isfinite(device.gallery.load().side_infos).all()


def test_a_sync_whose_bundle_download_meets_a_full_disk_says_so(tmp_path, publisher_pub, tiny_bundles, images, server):  # noqa: F811
    with small_disk(tmp_path / "disk") as disk:
        device = Device.init(disk / "dev", publisher_key=publisher_pub)
        try:
            device.progress = False
            device.enrol(server.target, enrolment_code(server), device_name="full")
            device.sync()
            device.add(images(20, seed=24), item_ids=[f"s{i}" for i in range(20)])  # originals uploaded: no write waits
            publish(server, tiny_bundles[2], tmp_path)
            _fill(disk)
            before = _dump(device.root)
            with pytest.raises(NoSpaceError, match=NO_SPACE + r"/downloads \(downloading bundle v2\)"):
                device.sync(replicate=False)
            assert _dump(device.root) == before and device.installed_versions() == [1] and device.version == 1
        finally:
            device.close()
