"""The server's data directory is owner-only whatever the umask and whatever modes an existing
directory had (issue 19 part 2): under umask 000, a pre-existing 0755 data directory with a
0644 file and a 0777 folder ends with every directory 0700 and every file 0600 after a
server ran, enrolled a device and stored an upload (SQLite's WAL files and blobs included)."""

from __future__ import annotations

import os
import stat

import pytest

from fctkit.private_files import make_private

from .conftest import enrolled_client


def modes(root) -> dict[str, int]:
    found = {}
    for folder, _, files in os.walk(root):
        for path in (folder, *(os.path.join(folder, f) for f in files)):
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.mark.sqlite_only
def test_the_server_keeps_its_data_owner_only_under_any_umask(start_server, tmp_path):
    data = tmp_path / "data"
    (data / "stray").mkdir(parents=True)
    data.chmod(0o755)
    (data / "stray").chmod(0o777)
    (data / "notes.txt").write_text("an operator's file")
    (data / "notes.txt").chmod(0o644)
    old = os.umask(0)
    try:
        server = start_server(data_dir=data)
        client, _ = enrolled_client(server, name="phone")
        with client:
            client.upload_blob(b"sealed" * 1000, "item")
    finally:
        os.umask(old)
    server.stop()
    found = modes(data)
    assert any(path.startswith("blobs/") for path in found) and "meta.sqlite3" in found
    wrong = {
        path: oct(mode) for path, mode in found.items() if mode != (0o700 if os.path.isdir(data / path) else 0o600)
    }
    assert wrong == {}


def test_make_private_leaves_symbolic_links_alone(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not ours")
    outside.chmod(0o644)
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    assert make_private(root) == 1  # the root folder only
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
