"""Bundle archives: a bundle directory packed as a deterministic tar, and unpacked safely.

:func:`pack_bundle` writes only the signed files, sorted, with zeroed times and owners, so the
same bundle always gives the same bytes. :func:`unpack_bundle` accepts only plain files with
plain names, within size limits, and writes nothing outside its new destination directory; it
does not verify the signature (:func:`fctkit.protos.bundle_verification.verify_bundle` does)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from fctkit.errors import BundleFormatError

from .bundle_vocabulary import MANIFEST_FILE, MAX_MANIFEST_BYTES, SAFE_NAME, SIGNATURE_FILE, SIGNATURES_FILE
from .durable_files import read_regular_file, require_regular_file, staged_directory
from .manifest import Manifest

DEFAULT_MAX_MEMBERS = 256
DEFAULT_MAX_FILE_BYTES = 2 << 30
DEFAULT_MAX_TOTAL_BYTES = 4 << 30


def pack_bundle(root: str | os.PathLike[str], archive: str | os.PathLike[str]) -> Path:
    """Write the bundle directory as a deterministic tar (sorted, zero times and owners).

    Only the manifest, the signature and the artifacts the manifest lists are packed; a
    stray file is an error. The archive is written to a temporary name and renamed."""
    root, archive = Path(root), Path(archive)
    manifest_bytes = (
        read_regular_file(root / MANIFEST_FILE, MAX_MANIFEST_BYTES) if (root / MANIFEST_FILE).exists() else None
    )
    if manifest_bytes is None:
        raise BundleFormatError(f"{root} has no {MANIFEST_FILE}: not a bundle")
    manifest = Manifest.from_bytes(manifest_bytes)
    co_signed = {SIGNATURES_FILE} if (root / SIGNATURES_FILE).exists() else set()
    names = sorted({MANIFEST_FILE, SIGNATURE_FILE} | co_signed | {a.file for a in manifest.artifacts})
    present = {p.name for p in root.iterdir()}
    if set(names) - present or present - set(names):
        raise BundleFormatError(
            f"{root}: files missing {sorted(set(names) - present)} or not listed {sorted(present - set(names))}; "
            "pack a complete bundle directory"
        )
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".partial", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name in names:
                path = root / name
                require_regular_file(path)
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
        with open(tmp_name, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_name, archive)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    return archive


def unpack_bundle(
    archive: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> Path:
    """Extract a bundle archive into the new directory ``dest`` (created atomically).

    Only plain files with plain names are accepted: absolute paths, ``..``, folders,
    links, devices, duplicates and oversized members are refused, and nothing is written
    outside ``dest``. This does not verify the signature: call :func:`verify_bundle` next."""
    archive, dest = Path(archive), Path(dest)
    try:
        tar = tarfile.open(archive, mode="r:")  # noqa: SIM115 (opened apart so its errors are told from the extraction's; `with tar` below closes it)
    except FileNotFoundError as exc:
        raise BundleFormatError(f"bundle archive {archive} does not exist") from exc
    except (tarfile.TarError, OSError) as exc:
        raise BundleFormatError(f"{archive} is not a tar archive ({exc}); fetch it again") from exc
    with tar, staged_directory(dest) as staging:
        seen: set[str] = set()
        total = 0
        try:
            for member in tar:
                _check_member(member, seen, max_members, max_file_bytes, archive)
                total += member.size
                if total > max_total_bytes:
                    raise BundleFormatError(f"{archive}: members add up to more than {max_total_bytes} bytes; refused")
                source = tar.extractfile(member)
                assert source is not None  # regular files always have a payload
                with source, open(staging / member.name, "xb") as out:
                    shutil.copyfileobj(source, out)
                    if out.tell() != member.size:
                        raise BundleFormatError(
                            f"{archive}: member {member.name} is truncated; fetch the archive again"
                        )
        except (tarfile.TarError, EOFError) as exc:
            raise BundleFormatError(f"{archive} is truncated or corrupt ({exc}); fetch it again") from exc
        for required in (MANIFEST_FILE, SIGNATURE_FILE):
            if required not in seen:
                raise BundleFormatError(f"{archive} has no {required}: not a complete bundle")
    return dest


def _check_member(
    member: tarfile.TarInfo, seen: set[str], max_members: int, max_file_bytes: int, archive: Path
) -> None:
    if len(seen) >= max_members:
        raise BundleFormatError(f"{archive}: more than {max_members} members; refused")
    if not member.isreg():
        kind = "link" if (member.issym() or member.islnk()) else "folder" if member.isdir() else "special file"
        raise BundleFormatError(f"{archive}: member {member.name!r} is a {kind}; bundles hold only plain files")
    if not SAFE_NAME.fullmatch(member.name):
        raise BundleFormatError(
            f"{archive}: member name {member.name!r} is not a plain file name (absolute paths, folders and '..' are refused)"
        )
    if member.name in seen:
        raise BundleFormatError(f"{archive}: member {member.name!r} appears twice; refused")
    limit = MAX_MANIFEST_BYTES if member.name == MANIFEST_FILE else max_file_bytes
    if member.size > limit:
        raise BundleFormatError(
            f"{archive}: member {member.name!r} is {member.size} bytes, more than the {limit} allowed"
        )
    seen.add(member.name)
