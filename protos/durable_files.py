"""Careful file I/O for bundles and stored objects: regular files only (no links or special
files), reads bounded in size, chunked SHA-256, fsync of folders, and directories that appear
at their destination complete or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fctkit.errors import BundleError, BundleFormatError


def require_regular_file(path: Path) -> None:
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise BundleFormatError(f"{path} is not a regular file (links and special files are refused)")


def read_regular_file(path: Path, limit: int) -> bytes:
    require_regular_file(path)
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise BundleFormatError(f"{path} is larger than the {limit} bytes allowed")
    return data


def file_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """SHA-256 hex digest and size of a file, read in chunks."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        return digest, fh.tell()


@contextlib.contextmanager
def staged_directory(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``dest``; on success fsync everything in
    it and rename it to ``dest`` in one step, so ``dest`` is either absent or complete."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise BundleError(f"{dest} already exists: remove it or choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        yield staging
        for path in staging.iterdir():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(staging)
        os.rename(staging, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, renamed: ``path``
    holds the old bytes or the new ones, never a part. ``durable`` (the default) fsyncs the file
    and the folder; without it a crash may leave the old bytes (for values where that is safe)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
