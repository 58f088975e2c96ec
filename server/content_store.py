"""A content-addressed file store: each object lives at ``<root>/<aa>/<sha256>`` where
``aa`` is the first two hex digits of its SHA-256. Objects arrive as finished files that are
fsynced and renamed into place, so a crash never leaves a half-written object under its name."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from fctkit.protos.bundle import fsync_dir

_SHA256 = re.compile(r"[0-9a-f]{64}")


def checked_sha256(sha256: str) -> str:
    """``sha256`` when it is a lowercase SHA-256 hex digest (an object's name in any store), else ValueError."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a lowercase SHA-256 hex digest: {sha256!r}")
    return sha256


def is_sha256(name: str) -> bool:
    return _SHA256.fullmatch(name) is not None


class Contents(Protocol):
    """What the server needs of a store of immutable objects named by their SHA-256: this file
    store, or :class:`fctkit.server.object_store.S3ContentStore`."""

    def has(self, sha256: str) -> bool: ...
    def open(self, sha256: str, offset: int = 0) -> Any: ...
    def put(self, source: Path, sha256: str) -> object: ...
    def stage(self, source: Path, sha256: str) -> None: ...
    def delete(self, sha256: str) -> None: ...
    def listing(self) -> Iterator[tuple[str, float]]: ...
    def __iter__(self) -> Iterator[str]: ...


class ContentStore:
    """Immutable objects named by their SHA-256 under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / checked_sha256(sha256)

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        return self.path(sha256).stat().st_size

    def open(self, sha256: str, offset: int = 0) -> BinaryIO:
        """The stored file, open at ``offset`` (FileNotFoundError when absent): it stays readable
        even if deleted meanwhile."""
        handle = self.path(sha256).open("rb")
        handle.seek(offset)
        return handle

    def put(self, source: Path, sha256: str) -> Path:
        """Move the finished file ``source`` (whose digest the caller checked) into the store.

        An object that is already stored is kept and ``source`` is removed.
        """
        target = self.path(sha256)
        if target.is_file():
            source.unlink()
            return target
        target.parent.mkdir(exist_ok=True)
        with source.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(source, target)
        fsync_dir(target.parent)
        return target

    def stage(self, source: Path, sha256: str) -> None:
        """Nothing ahead of :meth:`put`: moving a file into place is one rename."""

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def listing(self) -> Iterator[tuple[str, float]]:
        """Every stored digest with its last change (seconds since the epoch)."""
        for shard in sorted(self.root.iterdir()):
            if shard.is_dir():
                for path in sorted(p for p in shard.iterdir() if is_sha256(p.name)):
                    with contextlib.suppress(FileNotFoundError):
                        yield path.name, path.stat().st_mtime

    def __iter__(self) -> Iterator[str]:
        """Every stored digest."""
        return (name for name, _ in self.listing())
