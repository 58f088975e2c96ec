"""Bundle archives: deterministic pack, round trip, and malicious archives refused safely."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from fctkit.errors import BundleError, BundleFormatError, HashMismatchError
from fctkit.protos.bundle import MANIFEST_FILE, SIGNATURE_FILE, pack_bundle, unpack_bundle, verify_bundle


@pytest.fixture(scope="module")
def signed(tmp_path_factory, publisher_key, make_bundle):
    return make_bundle(tmp_path_factory.mktemp("archive") / "v2", publisher_key)


def test_pack_is_deterministic_and_round_trips(signed, publisher_key, tmp_path):
    first = pack_bundle(signed.root, tmp_path / "a.tar")
    second = pack_bundle(signed.root, tmp_path / "b.tar")
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.mode) for m in members} == {(0, 0, 0, 0o644)}
    unpacked = unpack_bundle(first, tmp_path / "unpacked")
    again = verify_bundle(unpacked, publisher_key.public_key(), installed_version=1)
    assert again.manifest == signed.manifest
    for artifact in signed.manifest.artifacts:
        assert (unpacked / artifact.file).read_bytes() == (signed.root / artifact.file).read_bytes()


def test_unpack_refuses_an_existing_destination(signed, tmp_path):
    archive = pack_bundle(signed.root, tmp_path / "b.tar")
    (tmp_path / "dest").mkdir()
    with pytest.raises(BundleError, match="already exists"):
        unpack_bundle(archive, tmp_path / "dest")


def test_pack_refuses_a_stray_file(signed, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in signed.root.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "notes.txt").write_text("unsigned")
    with pytest.raises(BundleFormatError, match=r"notes.txt"):
        pack_bundle(copy, tmp_path / "x.tar")


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, payload in members:
            if payload is not None:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                tar.addfile(info)
    return path


def _file(name: str, payload: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), payload


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _folder(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info, None


MALICIOUS = {
    "parent traversal": ([_file("../escaped.onnx")], "not a plain file name"),
    "absolute path": ([_file("/tmp/fctkit-escaped.onnx")], "not a plain file name"),
    "nested path": ([_file("sub/inner.onnx")], "not a plain file name"),
    "symlink": ([_link("embed.onnx", "/etc/passwd", tarfile.SYMTYPE)], "is a link"),
    "hard link": ([_file("a.onnx"), _link("embed.onnx", "a.onnx", tarfile.LNKTYPE)], "is a link"),
    "folder": ([_folder("models")], "is a folder"),
    "duplicate member": ([_file("embed.onnx"), _file("embed.onnx")], "appears twice"),
    "oversized manifest": ([_file(MANIFEST_FILE, b" " * ((1 << 20) + 1))], "more than"),
    "missing signature": ([_file(MANIFEST_FILE, b"{}")], "has no manifest.sig"),
}


@pytest.mark.parametrize("case", list(MALICIOUS))
def test_malicious_archives_are_refused_and_write_nothing(tmp_path, case):
    members, message = MALICIOUS[case]
    archive = _archive(tmp_path / "evil.tar", members)
    dest = tmp_path / "out" / "bundle"
    with pytest.raises(BundleFormatError, match=message):
        unpack_bundle(archive, dest)
    assert not dest.exists()
    assert list((tmp_path / "out").iterdir()) == [], "staging left behind"
    assert not (tmp_path / "escaped.onnx").exists() and not Path("/tmp/fctkit-escaped.onnx").exists()


def test_size_and_count_limits(tmp_path):
    archive = _archive(tmp_path / "big.tar", [_file("a.onnx", b"x" * 100), _file("b.onnx", b"y" * 100)])
    with pytest.raises(BundleFormatError, match="more than the 50 allowed"):
        unpack_bundle(archive, tmp_path / "d1", max_file_bytes=50)
    with pytest.raises(BundleFormatError, match="more than 150 bytes"):
        unpack_bundle(archive, tmp_path / "d2", max_total_bytes=150)
    with pytest.raises(BundleFormatError, match="more than 1 members"):
        unpack_bundle(archive, tmp_path / "d3", max_members=1)


def test_truncated_and_non_tar_archives(signed, tmp_path):
    archive = pack_bundle(signed.root, tmp_path / "b.tar")
    data = archive.read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleFormatError, match="truncated"):
        unpack_bundle(truncated, tmp_path / "d1")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x89PNG not a tar" * 100)
    with pytest.raises(BundleFormatError, match="not a tar archive"):
        unpack_bundle(garbage, tmp_path / "d2")
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()


def test_a_signed_archive_still_needs_the_signature_check(signed, publisher_key, tmp_path):
    archive = pack_bundle(signed.root, tmp_path / "b.tar")
    data = bytearray(archive.read_bytes())
    position = data.index(b"new_embedding")  # first in backward_2_to_1.onnx, the first member
    data[position] ^= 0x20
    archive.write_bytes(bytes(data))
    unpacked = unpack_bundle(archive, tmp_path / "unpacked")
    with pytest.raises(HashMismatchError, match="backward_2_to_1"):
        verify_bundle(unpacked, publisher_key.public_key())
    assert (unpacked / SIGNATURE_FILE).exists()
